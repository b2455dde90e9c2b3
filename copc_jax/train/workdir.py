"""A run's working directory: one run at a time, and never over a previous run's history.

    with workdir.claim(path, fresh_start=False):     # raises WorkdirError with one line if it must not start
      ...

- **Lock.** `claim` takes an exclusive `flock` on `PATH/.lock` (per learner process), writing its PID
  there; a second run on the same directory exits at once, naming the first one's PID. The kernel
  drops the lock when the process dies, however it dies.
- **History.** A run checkpoints step 0 before its first update (after the evaluation before RL and
  the critic warm-up), so a killed run resumes with the same command from then on. One killed before
  that checkpoint left only rows of step 0: `claim` moves them into `PATH/previous_<UTC time>/` (no row
  is deleted) and the same command starts over. A directory holding update rows but no checkpoint
  (someone deleted it) would be silently overwritten by a fresh start; `claim` refuses.
  `fresh_start` starts over in any case, after moving the earlier run's files (checkpoints included)
  into `PATH/previous_<UTC time>/`. The cached base model and warm start are kept: they are the same
  for every run of the config.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import glob
import json
import os
import shutil

HISTORY = ("metrics.jsonl", "tb", "checkpoints", "logs", "weights", "summary.json")


class WorkdirError(RuntimeError):
  """The run must not start in this directory (one line says why and what to do)."""


def _has_checkpoint(path: str) -> bool:
  return any(name.isdigit() for name in os.listdir(path)) if os.path.isdir(path) else False


def previous_history(path: str) -> list[str]:
  """Files of an earlier run that a fresh start would overwrite (empty when resuming is possible)."""
  if _has_checkpoint(os.path.join(path, "checkpoints")):
    return []
  found = []
  metrics = os.path.join(path, "metrics.jsonl")
  if os.path.exists(metrics) and os.path.getsize(metrics):
    found.append("metrics.jsonl")
  if glob.glob(os.path.join(path, "tb", "*")):
    found.append("tb/")
  return found


def killed_before_first_checkpoint(path: str) -> bool:
  """History without a checkpoint whose rows are all of step 0 (evaluation before RL, critic warm-up):
  a run killed before its step-0 checkpoint, which starting over loses nothing of."""
  if not previous_history(path):
    return False
  rows = []
  metrics = os.path.join(path, "metrics.jsonl")
  if os.path.exists(metrics):
    with open(metrics) as f:
      for line in f:
        try:
          rows.append(json.loads(line))
        except json.JSONDecodeError:
          break                   # a line cut short by the kill
  return all(row.get("step", 0) == 0 for row in rows)


def move_aside(path: str) -> str | None:
  """Move the previous run's files into PATH/previous_<time>/; returns that directory (None if nothing)."""
  present = [name for name in HISTORY if os.path.exists(os.path.join(path, name))]
  if not present:
    return None
  stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%S%fZ")
  target = os.path.join(path, f"previous_{stamp}")
  os.makedirs(target)
  for name in present:
    shutil.move(os.path.join(path, name), os.path.join(target, name))
  return target


@contextlib.contextmanager
def _locked(path: str, process_index: int):
  if os.path.exists(path) and not os.path.isdir(path):
    raise WorkdirError(f"--workdir={path}: exists and is not a directory")
  os.makedirs(path, exist_ok=True)
  lock_path = os.path.join(path, ".lock" if process_index == 0 else f".lock.process_{process_index}")
  handle = open(lock_path, "a+")
  try:
    fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
  except BlockingIOError:
    handle.seek(0)
    holder = handle.read().strip() or "unknown"
    handle.close()
    raise WorkdirError(f"--workdir={path} is in use by another run (PID {holder}); wait for it to end "
                       "or choose another --workdir") from None
  try:
    handle.seek(0)
    handle.truncate()
    handle.write(f"{os.getpid()}\n")
    handle.flush()
    yield
  finally:
    fcntl.flock(handle, fcntl.LOCK_UN)
    handle.close()


def _refuse_history(path: str) -> None:
  history = previous_history(path)
  if history:
    raise WorkdirError(f"--workdir={path} holds a previous run's history ({', '.join(history)}) and no "
                       "checkpoint to resume it from; pass --fresh_start to move it into "
                       "previous_<time>/ and start over, or choose another --workdir")


@contextlib.contextmanager
def claim(path: str, *, fresh_start: bool = False, process_index: int = 0, log=print):
  """Hold the directory for one run (see the module docstring)."""
  with _locked(path, process_index):
    if process_index == 0 and fresh_start:
      moved = move_aside(path)
      if moved:
        log(f"fresh start: the previous run's files are now in {moved}")
    elif process_index == 0 and killed_before_first_checkpoint(path):
      moved = move_aside(path)
      log(f"the previous run stopped before its first checkpoint: starting over; its step-0 rows are in "
          f"{moved}")
    _refuse_history(path)
    yield path


def check(path: str, *, fresh_start: bool = False) -> None:
  """What `claim` would refuse, found without changing anything (for a command line to fail early)."""
  if not os.path.exists(path):
    return
  with _locked(path, 0):                 # a path that is not a directory is refused here
    if not fresh_start and not killed_before_first_checkpoint(path):
      _refuse_history(path)
