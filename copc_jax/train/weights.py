"""The actor's weight versions on disk and the version the rollout servers serve.

    weights = WeightStore(os.path.join(workdir, "weights"), backend, pushes=True)
    weights.push(v, actor)        # save version v (if new) and serve it; a no-op if served already
    weights.save(v, actor)        # lag mode: keep v for a push `lag` updates later
    weights.prune(keep_from)      # drop versions a resume can no longer need

Version v = the learner's weights after v updates; `DIR/weights/v{v}` is a
`save_pretrained` directory, written atomically. With several learner processes
every process calls `save` and `push` (the weights may be sharded across them),
the chief writes, and only processes that own servers push.
"""

from __future__ import annotations

import os
import shutil

import jax
from flax import nnx

from copc_jax.models import hf_io
from copc_jax.models.decoder import Decoder
from copc_jax.rollout.protocol import RolloutBackend
from copc_jax.train import checkpoint, multihost


class WeightsGone(RuntimeError):
  """A version the run needs to push was deleted from the workdir."""


class WeightStore:
  def __init__(self, directory: str, backend: RolloutBackend, *, pushes: bool = True, in_memory: bool = False):
    """`in_memory`: a version pushed with the learner's weights at hand goes to the servers as bytes
    serialized in memory (`update_weights_bytes`), never through the disk; versions pushed later
    (lag mode) are still saved and pushed from `directory`."""
    self.directory, self.backend, self.pushes, self.in_memory = directory, backend, pushes, in_memory
    self.served: int | None = None          # the version the servers hold (None: the base weights)

  def path(self, version: int) -> str:
    return os.path.join(self.directory, f"v{version}")

  @staticmethod
  def _whole(actor: Decoder) -> Decoder:
    """The actor with every weight on this host (all processes take part when there are several)."""
    if jax.process_count() > 1:    # a separate host copy: the learner's own arrays stay where they are
      params = multihost.fully_replicated_host_copy(nnx.state(actor, nnx.Param))
      actor = nnx.eval_shape(lambda: Decoder(actor.config, rngs=nnx.Rngs(0)))
      nnx.update(actor, params)
    return actor

  def save(self, version: int, actor: Decoder) -> None:
    actor = self._whole(actor)
    if multihost.is_chief():
      checkpoint.write_atomically(self.path(version), lambda tmp: hf_io.save_pretrained(actor, tmp))
    multihost.barrier(f"weights v{version}")

  def push(self, version: int, actor: Decoder | None = None) -> None:
    """Serve `version`; `actor` (the learner's weights of that version) saves it if it is not on disk."""
    if self.served == version:
      return
    if self.in_memory and actor is not None and not os.path.exists(self.path(version)):
      actor = self._whole(actor)
      if self.pushes:
        self.backend.update_weights_bytes(hf_io.safetensors_bytes(actor), version)
      multihost.barrier(f"push v{version}")
      self.served = version
      return
    if not os.path.exists(self.path(version)):
      if actor is None:
        raise WeightsGone(f"the weights of version {version} are gone from {self.path(version)}; lag mode "
                          f"keeps the last `lag` versions there; do not delete them while a run can resume")
      self.save(version, actor)
    if self.pushes:
      self.backend.update_weights(self.path(version), version)
    multihost.barrier(f"push v{version}")      # nobody generates with `version` before the servers have it
    self.served = version

  def prune(self, keep_from: int) -> None:
    """Delete versions older than `keep_from`, except the one served."""
    if not multihost.is_chief() or not os.path.isdir(self.directory):
      return
    for name in os.listdir(self.directory):
      if name.startswith("v") and name[1:].isdigit() and int(name[1:]) < keep_from \
          and int(name[1:]) != self.served:
        shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)

