"""The actor's weight versions on disk and the version the rollout servers serve.

    weights = WeightStore(os.path.join(workdir, "weights"), backend, pushes=True)
    weights.push(v, actor)        # save version v (if new) and serve it; a no-op if served already
    weights.save(v, actor)        # lag mode: keep v for a push `lag` updates later
    weights.prune(keep_from)      # drop versions a resume can no longer need

Version v = the learner's weights after v updates; `DIR/weights/v{v}` is a
`save_pretrained` directory, written atomically. With several learner processes
every process calls `save` and `push` (the weights may be sharded across them),
the chief writes, and only processes that own servers push.

How a version pushed with the learner's weights at hand reaches the servers (`transfer`,
`config.rollout.weight_transfer`): "path" and "stream" save it in DIR first (the pool then
names the directory or streams its bytes); "memory" streams bytes serialized in memory, and
"shm" writes them to shared memory (`/dev/shm`, a tmpfs) for the servers to read there, so
nothing touches the disk and nothing crosses gRPC but the path. Both send the servers' own
layout (`hf_io.params_bytes`, `save_params`: parameter paths, no transposes on either side).
Versions pushed later (lag mode) are saved in DIR and go by path or stream.
"""

from __future__ import annotations

import atexit
import os
import re
import secrets
import shutil

import jax
import jax.numpy as jnp
from flax import nnx

from copc_jax.models import hf_io
from copc_jax.models.decoder import Decoder
from copc_jax.rollout.protocol import WEIGHT_TRANSFERS, RolloutBackend, WeightUpdate
from copc_jax.train import checkpoint, multihost

IN_PROCESS = "arrays"        # the transfer of an in-process backend (not a config.rollout.weight_transfer)


class WeightsGone(RuntimeError):
  """A version the run needs to push was deleted from the workdir."""


SHARED_MEMORY = "/dev/shm"


def shared_memory_directory() -> str:
  """A new directory in shared memory for this process's pushed versions, removed when the process
  exits; directories left there by processes that died (a SIGKILLed trainer) are removed first."""
  if not os.path.isdir(SHARED_MEMORY):
    raise RuntimeError(f"weight_transfer 'shm' needs {SHARED_MEMORY} (Linux shared memory); this machine "
                       f"has none: use 'path' or 'memory'")
  for name in os.listdir(SHARED_MEMORY):
    owner = re.fullmatch(r"copc_jax_weights_(\d+)_.*", name)
    if owner and not _alive(int(owner.group(1))):
      shutil.rmtree(os.path.join(SHARED_MEMORY, name), ignore_errors=True)
  # Owner-only (0700; the files in it 0600) under an unguessable name: other users can neither read a
  # version nor plant one for the servers to load.
  path = os.path.join(SHARED_MEMORY, f"copc_jax_weights_{os.getpid()}_{secrets.token_hex(16)}")
  os.mkdir(path, 0o700)
  atexit.register(shutil.rmtree, path, ignore_errors=True)
  return path


def _owner_only(result, directory: str):
  """Files of `directory` readable and writable by their owner alone (0600)."""
  for name in os.listdir(directory):
    os.chmod(os.path.join(directory, name), 0o600)
  return result


def _alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:      # alive, another user's
    pass
  return True


class WeightStore:
  def __init__(self, directory: str, backend: RolloutBackend, *, pushes: bool = True, transfer: str = "path"):
    """`transfer`: how a version pushed with the learner's weights at hand reaches the servers (see
    the module docstring): "memory" and "shm" never write it to `directory`."""
    if transfer not in (*WEIGHT_TRANSFERS, IN_PROCESS):
      raise ValueError(f"transfer must be one of {(*WEIGHT_TRANSFERS, IN_PROCESS)}; got {transfer!r}")
    self.directory, self.backend, self.pushes, self.transfer = directory, backend, pushes, transfer
    self.served: int | None = None          # the version the servers hold (None: the base weights)
    self._shared = shared_memory_directory() if transfer == "shm" and pushes else None

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
    fresh = actor is not None and not os.path.exists(self.path(version))
    if fresh and self.transfer in ("memory", "shm", IN_PROCESS):
      if self.transfer == IN_PROCESS:        # one process: the in-process backend refuses several
        self.backend.push(WeightUpdate(version, jax.tree.map(jnp.copy, nnx.state(actor, nnx.Param)), "arrays"))
      else:
        actor = self._whole(actor)           # every process takes part in gathering the weights
        if self.pushes and self.transfer == "memory":
          self.backend.push(WeightUpdate(version, hf_io.params_bytes(actor), "bytes"))
        elif self.pushes:
          self._push_through_shared_memory(version, actor)
      multihost.barrier(f"push v{version}")
      self.served = version
      return
    if not os.path.exists(self.path(version)):
      if actor is None:
        raise WeightsGone(f"the weights of version {version} are gone from {self.path(version)}; lag mode "
                          f"keeps the last `lag` versions there; do not delete them while a run can resume")
      self.save(version, actor)
    if self.pushes:
      saved_kind = WEIGHT_TRANSFERS.get(self.transfer, ("path", "path"))[1]
      self.backend.push(WeightUpdate(version, self.path(version), saved_kind))
    multihost.barrier(f"push v{version}")      # nobody generates with `version` before the servers have it
    self.served = version

  def _push_through_shared_memory(self, version: int, actor: Decoder) -> None:
    """Write `version` to this process's shared-memory directory and serve it from there; the version
    served before is deleted (the pool re-pushes only the newest to a restarted server)."""
    path = os.path.join(self._shared, f"v{version}")
    checkpoint.write_atomically(path, lambda tmp: _owner_only(hf_io.save_params(actor, tmp), tmp))
    self.backend.push(WeightUpdate(version, path, "path"))
    for name in os.listdir(self._shared):
      if name != f"v{version}":
        shutil.rmtree(os.path.join(self._shared, name), ignore_errors=True)

  def close(self) -> None:
    """Free the shared memory this store holds."""
    if self._shared is not None:
      shutil.rmtree(self._shared, ignore_errors=True)

  def prune(self, keep_from: int) -> None:
    """Delete versions older than `keep_from`, except the one served."""
    if not multihost.is_chief() or not os.path.isdir(self.directory):
      return
    for name in os.listdir(self.directory):
      if name.startswith("v") and name[1:].isdigit() and int(name[1:]) < keep_from \
          and int(name[1:]) != self.served:
        shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)

