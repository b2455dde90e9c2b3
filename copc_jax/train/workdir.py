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
- **Remote workdirs.** `--workdir=gs://bucket/run` (any URL `etils.epath` opens): checkpoints (orbax),
  `metrics.jsonl`, TensorBoard's `tb/`, `summary.json` and the history checks live there. What only
  this host needs lives in a local scratch directory (`scratch(path)`): the lock (object stores have
  no `flock`, so it guards against a second run on this host only), the tiny base model, the warm
  start's cache, the weight files servers on this host read, server logs, W&B's files, and the rows
  and TensorBoard events as they are written, mirrored to the workdir at every checkpoint and when
  the run ends (`metrics.MetricsLogger.sync`). A local workdir is its own scratch.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import hashlib
import json
import os
import tempfile

from etils import epath

HISTORY = ("metrics.jsonl", "tb", "checkpoints", "logs", "weights", "summary.json")


class WorkdirError(RuntimeError):
  """The run must not start in this directory (one line says why and what to do)."""


def is_remote(path: str) -> bool:
  """A URL such as gs://bucket/run (not a local path)."""
  return "://" in str(path)


def resolve(path: str) -> str:
  """A local path made absolute; a URL as given."""
  return str(path) if is_remote(path) else os.path.abspath(path)


def scratch(path: str) -> str:
  """Where the run in `path` keeps what only this host needs: `path` itself when local; for a URL, a
  directory under the system's temporary directory named by the URL's hash (the same on every run)."""
  if not is_remote(path):
    return resolve(path)
  digest = hashlib.sha256(str(path).rstrip("/").encode()).hexdigest()[:16]
  return os.path.join(tempfile.gettempdir(), "copc_jax_scratch", digest)


def files_under(directory: epath.Path) -> list[epath.Path]:
  """Every file below `directory`, at any depth."""
  return [folder / name for folder, _, names in directory.walk() for name in names]


def move(source: epath.Path, target: epath.Path) -> None:
  """Move a file or directory: a rename on a local disk; on an object store, which has no directories
  to rename, every object is copied under `target` and then `source` is removed."""
  if not is_remote(source):
    target.parent.mkdir(parents=True, exist_ok=True)
    source.rename(target)
    return
  for item in ([source] if source.is_file() else files_under(source)):
    copy = target if item == source else target / item.relative_to(source)
    copy.write_bytes(item.read_bytes())
  if source.is_file():
    source.unlink()
  else:
    source.rmtree()


def _has_checkpoint(path: epath.Path) -> bool:
  return path.is_dir() and any(child.name.isdigit() for child in path.iterdir())


def previous_history(path: str) -> list[str]:
  """Files of an earlier run that a fresh start would overwrite (empty when resuming is possible)."""
  root = epath.Path(path)
  if _has_checkpoint(root / "checkpoints"):
    return []
  found = []
  metrics = root / "metrics.jsonl"
  if metrics.exists() and metrics.stat().length:
    found.append("metrics.jsonl")
  if (root / "tb").is_dir() and any((root / "tb").iterdir()):
    found.append("tb/")
  return found


def killed_before_first_checkpoint(path: str) -> bool:
  """History without a checkpoint whose rows are all of step 0 (evaluation before RL, critic warm-up):
  a run killed before its step-0 checkpoint, which starting over loses nothing of."""
  if not previous_history(path):
    return False
  rows = []
  metrics = epath.Path(path) / "metrics.jsonl"
  if metrics.exists():
    for line in metrics.read_text().splitlines():
      try:
        rows.append(json.loads(line))
      except json.JSONDecodeError:
        break                     # a line cut short by the kill
  return all(row.get("step", 0) == 0 for row in rows)


def move_aside(path: str) -> str | None:
  """Move the previous run's files into PATH/previous_<time>/; returns that directory (None if nothing)."""
  root = epath.Path(path)
  present = [name for name in HISTORY if (root / name).exists()]
  if not present:
    return None
  stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%S%fZ")
  target = root / f"previous_{stamp}"
  for name in present:
    move(root / name, target / name)
  return str(target)


@contextlib.contextmanager
def _locked(path: str, process_index: int):
  root = epath.Path(path)
  if root.exists() and not root.is_dir():
    raise WorkdirError(f"--workdir={path}: exists and is not a directory")
  root.mkdir(parents=True, exist_ok=True)
  os.makedirs(scratch(path), exist_ok=True)
  lock_path = os.path.join(scratch(path), ".lock" if process_index == 0 else f".lock.process_{process_index}")
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
  if not epath.Path(path).exists():
    return
  with _locked(path, 0):                 # a path that is not a directory is refused here
    if not fresh_start and not killed_before_first_checkpoint(path):
      _refuse_history(path)
