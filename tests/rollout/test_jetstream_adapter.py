"""The JetStream 0.2.2 shims: each test fails if its shim regresses."""

import logging
import subprocess
import sys

import numpy as np
import pytest

from copc_jax.rollout import jetstream_adapter

engine_api, orchestrator, token_utils, jetstream_pb2, _ = jetstream_adapter.install()


def test_import_chain_needs_neither_tensorflow_nor_seqio_and_keeps_the_root_logger():
  code = (
      "import logging, sys; root = logging.getLogger(); level = root.level; n = len(root.handlers)\n"
      "from copc_jax.rollout import jetstream_adapter; jetstream_adapter.install()\n"
      "from jetstream.core import orchestrator, server_lib\n"
      "assert 'tensorflow' not in sys.modules, 'tensorflow imported'\n"
      "assert root.level == level and len(root.handlers) == n, (root.level, root.handlers)\n"
      "import jax; assert jax.tree_map is jax.tree.map\n")
  result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
  assert result.returncode == 0, result.stderr[-2000:]


def test_sentencepiece_vocabulary_refuses_to_build():
  import seqio
  with pytest.raises(ImportError, match="copc_jax does not install"):
    seqio.vocabularies.SentencePieceVocabulary("spm.model")


def test_orchestrator_uses_our_result_processing():
  assert token_utils.process_result_tokens is jetstream_adapter.process_result_tokens
  assert logging.getLogger().level != logging.DEBUG or logging.getLogger().handlers == []


class _Tokenizer:
  stop_tokens = {2}

  def decode(self, ids):
    return "".join(chr(97 + i % 26) for i in ids)


def result(tokens, lengths, logprobs, versions):
  data = np.stack([tokens, np.ones_like(tokens), lengths,
                   np.asarray(logprobs, np.float32).view(np.int32), versions], axis=1).astype(np.int32)
  return engine_api.ResultTokens(data=data, tokens_idx=(0, 1), valid_idx=(1, 2), length_idx=(2, 3),
                                 samples_per_slot=1)


def test_result_processing_keeps_logprobs_versions_and_the_stop_token():
  rt = result(np.array([7, 2]), np.array([3, 1]), [-0.5, -1.25], [4, 5])
  samples, complete = jetstream_adapter.process_result_tokens(
      _Tokenizer(), slot=1, slot_max_length=10, result_tokens=rt, complete=np.zeros(1, bool),
      is_client_side_tokenization=True)
  assert samples[0].token_ids == [2] and samples[0].logprobs == [-1.25] and samples[0].versions == [5]
  assert samples[0].finish_reason == "stop" and complete.all()
  samples, complete = jetstream_adapter.process_result_tokens(
      _Tokenizer(), slot=0, slot_max_length=3, result_tokens=rt, complete=np.zeros(1, bool))
  assert samples[0].token_ids == [7] and samples[0].text == ["h"] and samples[0].finish_reason == "length"
  assert complete.all()


def test_result_processing_of_several_decode_steps_per_row_stops_where_the_sample_does():
  """A row of 3 decode steps per slot: tokens after the one that completes the sample are dropped."""
  steps = [result(np.array([7, 9]), np.array([n, n]), [-0.1 * n, -0.2 * n], [4, 4]).data for n in (1, 2, 3)]
  data = np.concatenate(steps, axis=1)
  data[0, 5] = 2                                   # slot 0: EOS at the second step
  rt = engine_api.ResultTokens(data=data, tokens_idx=(0, 1), valid_idx=(1, 2), length_idx=(2, 3),
                               samples_per_slot=1)
  samples, complete = jetstream_adapter.process_result_tokens(
      _Tokenizer(), slot=0, slot_max_length=10, result_tokens=rt, complete=np.zeros(1, bool),
      is_client_side_tokenization=True)
  assert samples[0].token_ids == [7, 2] and samples[0].finish_reason == "stop" and complete.all()
  assert samples[0].logprobs == pytest.approx([-0.1, -0.2])
  samples, complete = jetstream_adapter.process_result_tokens(
      _Tokenizer(), slot=1, slot_max_length=2, result_tokens=rt, complete=np.zeros(1, bool),
      is_client_side_tokenization=True)
  assert samples[0].token_ids == [9, 9] and samples[0].finish_reason == "length" and complete.all()
  samples, complete = jetstream_adapter.process_result_tokens(
      _Tokenizer(), slot=1, slot_max_length=10, result_tokens=rt, complete=np.zeros(1, bool),
      is_client_side_tokenization=True)
  assert samples[0].token_ids == [9, 9, 9] and samples[0].finish_reason is None and not complete.any()


def test_stock_proto_still_loads():
  request = jetstream_pb2.DecodeRequest(max_tokens=3)
  assert request.max_tokens == 3


class _Engine:
  """What JetStream's generate loop asks of an engine, counting fresh decode states."""
  max_concurrent_decodes = 2

  def __init__(self):
    self.decode_states = 0

  def init_decode_state(self):
    self.decode_states += 1
    return object()

  def generate(self, params, decode_state):
    raise AssertionError("no slot holds a request: nothing to generate")


def _driver_in_the_race(driver_class):
  """A driver whose generate loop meets 0.2.2's race: slot 1 is busy when the loop counts free slots;
  the loop takes slot 0, finds no request and puts it back; at that moment the detokenize thread frees
  slot 1 (its request finished) and the server is asked to stop (None in the generate backlog)."""
  import queue


  class Slots(queue.Queue):
    freed = False

    def put(self, item, block=True, timeout=None):
      super().put(item, block, timeout)
      if item == 0 and not self.freed:
        self.freed = True
        super().put(1)               # the detokenize thread, in between
        backlog.put(None)

  driver = object.__new__(driver_class)
  engine, backlog, slots = _Engine(), queue.Queue(), Slots(2)
  queue.Queue.put(slots, 0)          # slot 0 free, slot 1 busy
  driver.live, driver._interleaved_mode, driver._metrics_collector = True, False, None
  driver._generate_engines, driver._generate_params, driver._generate_slots = [engine], [None], [slots]
  driver._generate_backlogs, driver._detokenize_backlogs = {0: backlog}, [queue.Queue(8)]
  driver._prefill_backlog, driver._transfer_backlogs = queue.Queue(), [queue.Queue(4)]
  assert jetstream_adapter.CopcDriver.__mro__[1] is jetstream_adapter.install()[1].Driver
  return driver, engine


def test_the_generate_loop_survives_jetstream_s_slot_race():
  stock, _ = _driver_in_the_race(jetstream_adapter.install()[1].Driver)
  with pytest.raises(AssertionError, match="must have some requests inserted"):   # what kills a 0.2.2 server
    stock._generate_thread(0)
  driver, engine = _driver_in_the_race(jetstream_adapter.CopcDriver)
  assert driver._generate_thread(0) is None        # started over, then stopped when asked
  assert engine.decode_states == 2                  # a fresh decode state after the race


def test_the_generate_loop_runs_at_most_calls_ahead_calls_past_the_detokenizer():
  """JetStream's loop blocks once `calls_ahead` results wait for the detokenizer: a slot whose
  request finished is decoded at most that many more times (+1 in flight) before it is freed."""
  import queue
  import threading
  import types

  from flax import nnx

  from copc_jax.models import tiny
  from copc_jax.models.decoder import Decoder
  from copc_jax.rollout.jetstream_adapter import CopcEngine

  engine = CopcEngine(Decoder(tiny.tiny_config("qwen2"), rngs=nnx.Rngs(0)), max_concurrent_decodes=2,
                      max_prefill_length=16, max_length=32)
  store = engine.load_params()
  with pytest.raises(ValueError, match="calls_ahead must be >= 1; got 0"):
    jetstream_adapter.CopcDriver(prefill_engines=[engine], generate_engines=[engine],
                                 prefill_params=[store], generate_params=[store], calls_ahead=0)
  driver = jetstream_adapter.CopcDriver(prefill_engines=[engine], generate_engines=[engine],
                                        prefill_params=[store], generate_params=[store], interleaved_mode=True)
  driver.stop()
  assert [b.maxsize for b in driver._detokenize_backlogs] == [2]

  class Counting(_Engine):          # one slot busy forever; the detokenizer never comes
    calls = 0

    def generate(self, params, decode_state):
      self.calls += 1
      return decode_state, types.SimpleNamespace(copy_to_host_async=lambda: None)

  class Backlog(queue.Queue):        # notes when the loop has to wait for the detokenizer
    blocked = threading.Event()

    def put(self, item, block=True, timeout=None):
      if self.full():
        self.blocked.set()
      super().put(item, block, timeout)

  stalled, _ = _driver_in_the_race(jetstream_adapter.CopcDriver)
  stalled._generate_engines = [Counting()]
  stalled._generate_slots[0].get()                    # no free slot: the loop only generates
  backlog = Backlog(driver._detokenize_backlogs[0].maxsize)
  stalled._detokenize_backlogs = [backlog]
  loop = threading.Thread(target=stalled._generate_thread, args=(0,), daemon=True)
  loop.start()
  assert backlog.blocked.wait(timeout=120)
  assert stalled._generate_engines[0].calls == 3     # 2 waiting + the one blocked on the full backlog
  stalled.live = False
  backlog.get()
  loop.join(timeout=30)
  assert not loop.is_alive()
