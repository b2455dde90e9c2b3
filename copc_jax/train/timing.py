"""Per-phase wall times of a training step, through one context manager.

    timer = PhaseTimer()
    with timer("rollout_wait_s"):
      ...
      with timer("weight_sync_s"):    # nested: counted here, not in rollout_wait_s
        ...
    times = timer.lap()               # {"rollout_wait_s": ..., "weight_sync_s": ...}; starts over

Times are exclusive (a nested phase is subtracted from the one around it), so
the phases of a step add up to the wall time spent inside them.
"""

from __future__ import annotations

import collections
import contextlib
import threading
import time


class PhaseTimer:
  def __init__(self):
    self._times: dict[str, float] = collections.defaultdict(float)
    self._local = threading.local()       # the stack of open phases, per thread

  @contextlib.contextmanager
  def __call__(self, name: str):
    stack = self._local.__dict__.setdefault("stack", [])
    stack.append(0.0)                     # time spent in phases nested inside this one
    start = time.perf_counter()
    try:
      yield
    finally:
      elapsed = time.perf_counter() - start
      nested = stack.pop()
      self._times[name] += elapsed - nested
      if stack:
        stack[-1] += elapsed

  def lap(self) -> dict[str, float]:
    """The times since the last lap, and start over."""
    times, self._times = dict(self._times), collections.defaultdict(float)
    return times
