"""Checkpoints of the whole training state through orbax, safe against a kill at any moment.

Saved per step: the learner state (actor, critic, both optimizers), the RNG, and
a JSON record of the rest (step, weights version, data-iterator state, buffered
trajectories, anything else the trainer adds). orbax writes each step into a
temporary directory and renames it when complete, so a process killed during a
save leaves the previous checkpoint as the latest; `restore_latest` never sees
a partial one, and falls back past checkpoints that were damaged later.
"""

from __future__ import annotations

import json
import os
import shutil

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from flax import nnx

from copc_jax.train import workdir as workdir_lib


def write_atomically(path: str, write) -> str:
  """`write(tmp)` then rename to `path`: a kill never leaves a half-written directory at `path`."""
  tmp = f"{path}.tmp"
  shutil.rmtree(tmp, ignore_errors=True)
  write(tmp)
  shutil.rmtree(path, ignore_errors=True)
  os.replace(tmp, path)
  return path


def write_json(path: str, value) -> None:
  """`value` as JSON at `path`, whole or not at all: a local file through a rename, an object of a remote
  store (gs://…) in one write, which such stores make atomic."""
  if workdir_lib.is_remote(path):
    epath.Path(path).parent.mkdir(parents=True, exist_ok=True)
    epath.Path(path).write_text(json.dumps(value))
    return
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(f"{path}.tmp", "w") as f:
    json.dump(value, f)
  os.replace(f"{path}.tmp", path)


class CheckpointError(RuntimeError):
  """No checkpoint of the run can be loaded."""


class Checkpointer:
  def __init__(self, directory: str, max_to_keep: int = 3):
    self.directory = workdir_lib.resolve(directory)     # a local path or a URL (gs://…), as orbax takes
    self._manager = ocp.CheckpointManager(
        self.directory, options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True))

  def save(self, step: int, learner_state, rng, record: dict) -> None:
    """Write step `step` and wait until it is on disk."""
    # The RNG as a host array: the same on every process, saved once.
    pytree = {"learner": nnx.to_pure_dict(learner_state), "rng": np.asarray(jax.random.key_data(rng))}
    self._manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(pytree), record=ocp.args.JsonSave(record)))
    self._manager.wait_until_finished()

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def restore_latest(self, learner_state_like, rng_like, log=print):
    """(step, learner state, rng, record) of the newest checkpoint that loads, or None if there is none.

    `learner_state_like` gives the structure, dtypes and shardings (e.g. a freshly built learner's
    state). A checkpoint that does not load (truncated, garbage, empty files) is skipped with one line
    saying which and why, and moved to `corrupt_<step>/` so that later saves do not collide with it;
    when none loads, `CheckpointError` says so in one line.
    """
    steps = sorted(self._manager.all_steps(), reverse=True)
    if not steps:
      return None
    skipped = []
    for step in steps:
      try:
        restored = self._restore(step, learner_state_like, rng_like)
      except Exception as err:  # noqa: BLE001 - whatever the files hold, the run goes on from an older one
        reason = " ".join(str(err).split())[:200] or type(err).__name__
        skipped.append(f"step {step} ({type(err).__name__}: {reason})")
        log(f"checkpoint of step {step} in {self.directory} does not load, skipped: {type(err).__name__}: "
            f"{reason}")
        continue
      for bad in steps[:len(skipped)]:
        self._set_aside(bad)
      return restored
    raise CheckpointError(f"no checkpoint in {self.directory} loads: {'; '.join(skipped)}")

  def _restore(self, step: int, learner_state_like, rng_like):
    abstract = {"learner": jax.tree.map(ocp.utils.to_shape_dtype_struct,
                                        nnx.to_pure_dict(learner_state_like)),
                "rng": np.zeros_like(np.asarray(jax.random.key_data(rng_like)))}
    restored = self._manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract), record=ocp.args.JsonRestore()))
    if not isinstance(restored["record"], dict):
      raise ValueError(f"its record is {type(restored['record']).__name__}, not a JSON object")
    learner_state = learner_state_like
    nnx.replace_by_pure_dict(learner_state, restored["state"]["learner"])
    rng = jax.random.wrap_key_data(jax.numpy.asarray(restored["state"]["rng"]),
                                   impl=jax.random.key_impl(rng_like))
    return step, learner_state, rng, dict(restored["record"])

  def _set_aside(self, step: int) -> None:
    source = epath.Path(self.directory) / str(step)
    if source.is_dir():
      workdir_lib.move(source, epath.Path(self.directory) / f"corrupt_{step}")
    self._manager.reload()

  def close(self) -> None:
    self._manager.close()
