"""An in-process stand-in for `RolloutPool` (tests only): random tokens, a per-call version, no servers.

It exercises the trainer's bookkeeping (modes, staleness, checkpoints) quickly;
the real pool of JetStream servers is tested end to end in test_trainer_e2e.py.
"""

import threading
import time

import numpy as np

from copc_jax.rollout.protocol import Generation, ServerStatus


class ScriptedPool:
  def __init__(self, vocab_size: int, *, tool_call_end: list[int] | None = None, delay_s: float = 0.0,
               seed: int = 0):
    self.vocab_size, self.tool_call_end, self.delay_s = vocab_size, tool_call_end or [], delay_s
    self.version = -1
    self.pushes: list[int] = []
    self._rng = np.random.default_rng(seed)
    self._lock = threading.Lock()
    self.closed = False

  def generate(self, token_ids, max_tokens, *, stop_sequences=(), **sampling):
    if self.closed:
      raise RuntimeError("the pool is closed")
    with self._lock:
      version = self.version
      n = int(self._rng.integers(1, max_tokens + 1))
      tokens = self._rng.integers(20, self.vocab_size, n).tolist()
      call_tool = self.tool_call_end and self._rng.random() < 0.3
      logprobs = (-self._rng.random(n) * 3).tolist()
    if self.delay_s:
      time.sleep(self.delay_s * self._rng.random())
    if call_tool and n > len(self.tool_call_end):
      tokens[-len(self.tool_call_end):] = self.tool_call_end
      return Generation(tokens, logprobs, [version] * n, "stop_sequence")
    return Generation(tokens, logprobs, [version] * n, "length" if n == max_tokens else "stop")

  def push(self, update):
    version = update.version
    assert version > self.version, (version, self.version)
    self.version = version
    self.pushes.append(version)

  def status(self):
    return [ServerStatus("scripted", report={"version": self.version})]

  def close(self):
    self.closed = True
