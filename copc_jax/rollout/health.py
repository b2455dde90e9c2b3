"""Finding rollout servers that stopped answering (a paused or wedged process), within seconds.

A generation streams one message per decode step, so a call that has received nothing for
`stall_timeout_s` is suspicious, but it may only be slow (a first compilation, a long queue). The
detector then asks that server for its Status with a deadline of `probe_timeout_s`: a server whose
event loop still answers is slow and its calls keep waiting; one that does not is hung. The
detector cancels the hung server's calls (the pool resubmits them elsewhere, from the start) and
tells the pool, which takes the server out of routing until it answers Status again. A call that
stays silent for `lost_timeout_s` on a server that answers is lost (the server no longer knows it):
it alone is cancelled and resubmitted, and the server stays in routing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time

import grpc


@dataclasses.dataclass(eq=False)
class _Watched:
  server: object
  call: object
  last_message: float
  last_checked: float = 0.0
  cancelled: bool = False          # cancelled once; its consumer has not torn it down yet


class HangDetector:
  def __init__(self, on_hung, *, stall_timeout_s: float = 10.0, probe_timeout_s: float = 5.0,
               lost_timeout_s: float = 120.0, interval_s: float = 0.25):
    if not 0 < stall_timeout_s <= lost_timeout_s or probe_timeout_s <= 0:
      raise ValueError(f"need 0 < stall_timeout_s <= lost_timeout_s and probe_timeout_s > 0; got "
                       f"{stall_timeout_s}, {lost_timeout_s}, {probe_timeout_s}")
    self.on_hung, self.stall_timeout_s, self.probe_timeout_s = on_hung, stall_timeout_s, probe_timeout_s
    self.lost_timeout_s = lost_timeout_s
    self.lost = 0
    self.passes = 0                  # completed passes over the watched calls
    self.interval_s = interval_s
    self._calls: set[_Watched] = set()
    self._lock = threading.Lock()
    self._stopped = threading.Event()
    self._thread = threading.Thread(target=self._run, name="hang-detector", daemon=True)
    self._thread.start()

  @contextlib.contextmanager
  def watch(self, server, call):
    """Watch `call` (a streaming gRPC call to `server`); yields its messages as an iterator."""
    watched = _Watched(server, call, time.monotonic())

    def messages():
      for message in call:
        watched.last_message = time.monotonic()
        yield message

    with self._lock:
      self._calls.add(watched)
    try:
      yield messages()
    finally:
      with self._lock:
        self._calls.discard(watched)

  def responds(self, server) -> bool:
    try:
      server.client.status(timeout_s=self.probe_timeout_s)
      return True
    except grpc.RpcError:
      return False

  def _run(self):
    while not self._stopped.wait(self.interval_s):
      now = time.monotonic()
      with self._lock:
        stalled = {id(w.server): w.server for w in self._calls if not w.cancelled
                   and now - max(w.last_message, w.last_checked) > self.stall_timeout_s}
      for server in stalled.values():
        hung = not self.responds(server)
        if hung:
          self.on_hung(server)
        with self._lock:
          for watched in [w for w in self._calls if w.server is server and not w.cancelled]:
            if hung:
              watched.cancelled = True
              watched.call.cancel()
            elif time.monotonic() - watched.last_message > self.lost_timeout_s:
              self.lost += 1
              watched.cancelled = True
              watched.call.cancel()                          # lost: resubmitted, the server stays
            else:
              watched.last_checked = time.monotonic()        # slow, not hung: wait another period
      self.passes += 1

  def close(self):
    self._stopped.set()
    self._thread.join(timeout=10)
