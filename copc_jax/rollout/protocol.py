"""The seam between the trainer and whatever generates its rollouts, and the wire constants of `copc.Rollout`.

    backend: RolloutBackend = RolloutPool(checkpoint, num_servers=2)   # or InProcessBackend(actor, ...)
    out = backend.generate(prompt_ids, 64, temperature=1.0, seed=7, stop_sequences=[[end_id]])
    backend.push(WeightUpdate(3, "/workdir/weights/v3"))                # serve version 3 from now on
    [s.version for s in backend.status()]

A backend is four calls: `generate`, `push(WeightUpdate)`, `status() → [ServerStatus]`, `close`. How
a version travels is the update's `kind` (`UPDATE_KINDS`); which kind a run uses is decided by the
trainer's `WeightStore` alone (`train/weights.py`). The JetStream pool (`rollout/pool.py`), the
in-process backend (`rollout/in_process.py`) and the tests' stand-ins satisfy `RolloutBackend`.
Nothing here imports JetStream or gRPC, so configs and the trainer's types load without them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

SERVICE = "copc.Rollout"             # the gRPC service of `rollout/server.py`
MAX_MESSAGE_BYTES = 1 << 30          # gRPC message limit on both ends (weights travel as bytes)

# How a weight version reaches a backend (`WeightUpdate.kind`):
#   "path":   a `save_pretrained` directory the backend reads where it is (a shared filesystem, or
#             shared memory on the same machine);
#   "stream": that directory's safetensors file, streamed by the sender (no shared filesystem);
#   "bytes":  one safetensors file's bytes, serialized in memory (nothing on disk);
#   "arrays": the learner's parameters as arrays (`nnx.State`): only a backend in the learner's process.
UPDATE_KINDS = ("path", "stream", "bytes", "arrays")
# `config.rollout.weight_transfer` → (the kind of a push made with the learner's weights at hand, the
# kind of a push of a version saved earlier, as lag mode makes): "memory" and "shm" never write the
# fresh version to the workdir (shm writes it to /dev/shm and sends its path).
WEIGHT_TRANSFERS = {"path": ("path", "path"), "stream": ("stream", "stream"), "memory": ("bytes", "stream"),
                    "shm": ("path", "path")}


@dataclasses.dataclass(frozen=True)
class WeightUpdate:
  """Serve `payload` as weights `version` from now on. Versions increase; `reset` starts a new
  sequence (a new run on servers kept alive)."""

  version: int
  payload: Any                        # a directory (str), safetensors bytes, or an nnx.State of arrays
  kind: str = "path"
  reset: bool = False

  def __post_init__(self):
    if self.kind not in UPDATE_KINDS:
      raise ValueError(f"WeightUpdate.kind must be one of {UPDATE_KINDS}; got {self.kind!r}")
    expected = {"path": str, "stream": str, "bytes": bytes}.get(self.kind)
    if expected is not None and not isinstance(self.payload, expected):
      raise ValueError(f"a {self.kind!r} WeightUpdate carries a {expected.__name__}; got "
                       f"{type(self.payload).__name__}")

  def describe(self) -> str:
    if self.kind == "bytes":
      return f"{len(self.payload)} bytes in memory"
    return f"{self.kind} {self.payload}" if self.kind != "arrays" else "arrays in memory"


@dataclasses.dataclass(frozen=True)
class ServerStatus:
  """One server of a backend as the trainer sees it: routing state and the server's own report
  (`version`, `max_prefill_length`, `max_length`, `model` — its config —, engine counters; empty
  while it does not answer)."""

  address: str
  healthy: bool = True
  hung: bool = False
  in_flight: int = 0
  restarts: int = 0
  hangs: int = 0
  report: dict = dataclasses.field(default_factory=dict)

  @property
  def version(self) -> int | None:
    return self.report.get("version")


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

  def push(self, update: WeightUpdate) -> None:
    """Serve `update`'s weights as its version from now on (every server; restarted ones too)."""

  def status(self) -> list[ServerStatus]:
    """Each server's routing state and report."""

  def close(self) -> None:
    """Release servers and connections."""
