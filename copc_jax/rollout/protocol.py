"""What the trainer needs from a rollout backend, and the wire constants of the `copc.Rollout` service.

    backend: RolloutBackend = RolloutPool(checkpoint, num_servers=2)   # or an in-process stand-in
    out = backend.generate(prompt_ids, 64, temperature=1.0, seed=7, stop_sequences=[[end_id]])
    backend.update_weights(path, version=3)

The JetStream pool (`rollout/pool.py`) and the tests' in-process stand-in both
satisfy `RolloutBackend`. Nothing here imports JetStream or gRPC, so configs and
the trainer's types load without them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

SERVICE = "copc.Rollout"             # the gRPC service of `rollout/server.py`
MAX_MESSAGE_BYTES = 1 << 30          # gRPC message limit on both ends (weights travel as bytes)


@dataclasses.dataclass
class Generation:
  """One completion: tokens, their behaviour log-probs log μ and the weights version of each."""

  token_ids: list[int]
  logprobs: list[float]
  versions: list[int]
  finish_reason: str | None          # "stop" | "length" | "stop_sequence"


@runtime_checkable
class RolloutBackend(Protocol):
  def generate(self, token_ids: Sequence[int], max_tokens: int, **sampling) -> Generation:
    """Sampling: temperature, top_p, top_k, stop_sequences, seed (see `copc_jax.sampling`)."""

  def update_weights(self, path: str, version: int) -> None:
    """Serve the `save_pretrained` directory `path` as `version` from now on (versions increase).
    (`rollout.weight_transfer = "memory"` also needs `update_weights_bytes(payload, version)`.)"""

  def close(self) -> None:
    """Release servers and connections."""
