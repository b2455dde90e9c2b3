"""The hang detector on stand-ins: which calls it cancels, and when it calls a server hung."""

import threading

import grpc

from copc_jax.rollout.health import HangDetector


class FakeCall:
  """A stream that yields nothing until cancelled (or released)."""

  def __init__(self):
    self.cancelled, self.released = threading.Event(), threading.Event()

  def __iter__(self):
    while not (self.cancelled.is_set() or self.released.is_set()):
      self.cancelled.wait(0.01)
    if self.cancelled.is_set():
      raise grpc.RpcError("cancelled")
    yield {"token_ids": [1]}

  def cancel(self):
    self.cancelled.set()


class FakeServer:
  def __init__(self, answers: bool):
    self.answers, self.client = answers, self
    self.probes = 0

  def status(self, timeout_s):
    self.probes += 1
    if not self.answers:
      raise grpc.RpcError("no answer")
    return {}


def consume(detector, server, call):
  with detector.watch(server, call) as messages:
    try:
      return list(messages)
    except grpc.RpcError:
      return "cancelled"


def make_detector(stall_timeout_s=0.05, lost_timeout_s=60.0):
  """A fast-polling detector and the list of servers it called hung."""
  hung = []
  return HangDetector(hung.append, stall_timeout_s=stall_timeout_s, probe_timeout_s=0.05,
                      lost_timeout_s=lost_timeout_s, interval_s=0.01), hung


def test_a_server_that_does_not_answer_is_hung_and_its_calls_cancelled():
  detector, hung = make_detector()
  server = FakeServer(answers=False)
  assert consume(detector, server, FakeCall()) == "cancelled"
  assert hung == [server] and detector.lost == 0
  detector.close()


def test_a_silent_call_on_an_answering_server_is_lost_not_hung():
  detector, hung = make_detector(lost_timeout_s=0.3)
  server = FakeServer(answers=True)
  assert consume(detector, server, FakeCall()) == "cancelled"
  assert hung == [] and detector.lost == 1 and server.probes >= 1
  detector.close()


def test_a_slow_call_that_finishes_is_left_alone():
  detector, hung = make_detector(stall_timeout_s=0.02, lost_timeout_s=3600)
  server, call = FakeServer(answers=True), FakeCall()
  result = []
  thread = threading.Thread(target=lambda: result.append(consume(detector, server, call)))
  thread.start()
  while server.probes < 2:          # probed at least twice (slow, not hung), then it finishes
    threading.Event().wait(0.01)
  call.released.set()
  thread.join()
  assert result == [[{"token_ids": [1]}]] and hung == [] and detector.lost == 0
  detector.close()


class SlowToNoticeCall(FakeCall):
  """A stream whose consumer notices a cancel only after `release` is set (a busy machine)."""

  def __init__(self):
    super().__init__()
    self.cancels = 0

  def __iter__(self):
    while not self.released.is_set():
      self.released.wait(0.01)
    raise grpc.RpcError("cancelled")

  def cancel(self):
    self.cancels += 1
    super().cancel()


def test_a_lost_call_is_cancelled_and_counted_once_however_late_its_consumer_notices():
  detector, hung = make_detector(lost_timeout_s=0.1)
  server, call = FakeServer(answers=True), SlowToNoticeCall()
  result = []
  thread = threading.Thread(target=lambda: result.append(consume(detector, server, call)))
  thread.start()
  call.cancelled.wait()
  seen = detector.passes
  while detector.passes < seen + 20:  # the detector keeps polling while the consumer lags
    threading.Event().wait(0.01)
  call.released.set()
  thread.join()
  assert result == ["cancelled"] and call.cancels == 1 and detector.lost == 1 and hung == []
  detector.close()
