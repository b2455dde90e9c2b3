"""Per-step metrics: `metrics.jsonl` (one JSON object per step), TensorBoard, Weights & Biases (optional),
a progress bar.

    logger = MetricsLogger(workdir, total_steps=100, start_step=restored_step,
                           trackers=("tensorboard", "wandb"), run_config=config_dict)
    logger.write({"step": 1, "reward_mean": 0.4, ...})
    logger.close()

On resume, rows past the restored step (written after the last checkpoint by the
killed run) are dropped from `metrics.jsonl`, so every step appears once there, from the run that
counts. The W&B run keeps one id per workdir (`DIR/wandb_run_id`) and resumes it; W&B refuses steps it
has already seen, so for the steps a killed run logged after its last checkpoint it keeps the killed
run's values (`metrics.jsonl` is the record). `WANDB_MODE=offline` writes the run under `DIR/wandb`.

A remote workdir (gs://…, `train/workdir.py`) gets its rows and TensorBoard events written to the local
scratch directory first (object stores cannot append) and mirrored there by `sync()`, which the trainer
calls at every checkpoint and `close()` calls at the end: a resume keeps only rows up to its checkpoint,
so what a crash leaves unmirrored is what a resume would drop anyway (and it stays on the local disk).
"""

from __future__ import annotations

import json
import math
import os
import secrets
import sys

import numpy as np
import tqdm
from etils import epath

from copc_jax.train import multihost
from copc_jax.train import workdir as workdir_lib

REQUIRED_KEYS = ("step", "reward_mean", "response_len_mean", "staleness_mean", "staleness_max",
                 "mask_fraction", "clip_fraction", "ess", "value_loss", "grad_norm", "step_time_s",
                 "rollout_wait_s", "train_s", "weight_sync_s")


STEP_PHASES = ("rollout_wait_s", "train_s", "weight_sync_s")    # they add up to step_time_s
# Row name → the learner's metric (what moves before a failure is kept in every row).
ROW_METRICS = {
    "mask_fraction": "masked_fraction", "clip_fraction": "clip_fraction", "ess": "ess",
    "value_loss": "value_loss", "value_explained_variance": "value_explained_variance",
    "grad_norm": "actor_grad_norm", "critic_grad_norm": "critic_grad_norm", "actor_loss": "actor_loss",
    "ratio_mean": "ratio_mean", "ratio_max": "ratio_batch_max", "ratio_min": "ratio_batch_min",
    "ratio_p99": "ratio_batch_p99", "advantage_std": "advantage_std",
    "advantage_raw_mean": "advantage_raw_mean", "advantage_raw_std": "advantage_raw_std",
    "advantage_raw_min": "advantage_raw_min", "advantage_raw_max": "advantage_raw_max",
    "returns_mean": "returns_mean", "kl_behavior": "kl_behavior_prox", "kl_behavior_theta": "kl_behavior",
    "entropy": "entropy", "nonfinite_count": "nonfinite_count", "kl_ref": "kl_ref",
    "actor_update_norm": "actor_update_norm",
}


def update_row(version: int, episodes: list, batch, learner_metrics: dict, *, mode: str) -> dict:
  """The row of the update from weights `version` to `version + 1`: the episodes' rewards, lengths and
  turns over every learner process, the batch's staleness, and the learner's metrics under their row
  names (`ROW_METRICS`). Lag mode's first k updates train on data of version 0 only (the start
  policy's): `inside_first_lag` says so."""
  staleness = np.asarray(batch.staleness(version))[batch.mask]
  versions = np.asarray(batch.versions)[batch.mask]
  lengths = [sum(e.trajectory.mask) for e in episodes]       # tokens the policy wrote, per episode
  n, reward, correct, length, turns, stale_sum, stale_count = multihost.sum_over_processes([
      len(episodes), sum(e.trajectory.reward for e in episodes), sum(e.correct for e in episodes),
      sum(lengths), sum(e.trajectory.num_turns for e in episodes), staleness.sum(), staleness.size])
  newest_version = int(multihost.max_over_processes(float(versions.max()) if versions.size else 0.0))
  return {
      "step": version + 1, "weights_version": version + 1,
      "reward_mean": reward / n, "accuracy": correct / n, "response_len_mean": length / n,
      "response_len_max": int(multihost.max_over_processes(float(max(lengths, default=0)))),
      "turns_mean": turns / n,
      "staleness_mean": stale_sum / max(stale_count, 1),
      "staleness_max": int(multihost.max_over_processes(float(staleness.max()) if staleness.size else 0.0)),
      "data_version_max": newest_version, "inside_first_lag": mode == "lag" and newest_version == 0,
      **{name: learner_metrics[key] for name, key in ROW_METRICS.items() if key in learner_metrics},
  }


def read_metrics(workdir: str) -> list[dict]:
  path = epath.Path(workdir) / "metrics.jsonl"
  if not path.exists():
    return []
  rows = []
  for line in path.read_text().splitlines():
    try:
      rows.append(json.loads(line))
    except json.JSONDecodeError:
      break                # a line cut short by a kill: the rows after it cannot exist
  return rows


def update_rows(rows: list[dict]) -> list[dict]:
  """The rows of updates; the others are evaluation-only rows (before RL at step 0, or of a step
  whose evaluation a stopped run left to its resume)."""
  return [row for row in rows if "reward_mean" in row]


def _plain(value):
  value = np.asarray(value).item() if not isinstance(value, int | float | str | bool) else value
  if isinstance(value, float) and not math.isfinite(value):
    return None
  return value


class WandbWriter:
  """One W&B run per workdir (its id kept in `DIR/wandb_run_id`), resumed by a resumed run."""

  def __init__(self, workdir: str, project: str, run_config: dict | None):
    try:
      import wandb
    except ImportError:
      raise ValueError("trainer.trackers has 'wandb' but wandb is not installed: pip install "
                       "'copc_jax[wandb]' (or drop it from trainer.trackers)") from None
    id_path = epath.Path(workdir) / "wandb_run_id"
    if id_path.exists():
      run_id = id_path.read_text().strip()
    else:
      run_id = secrets.token_hex(8)          # W&B run ids: letters and digits
      id_path.write_text(run_id)
    self._run = wandb.init(project=project, dir=workdir_lib.scratch(workdir), id=run_id, resume="allow",
                           config=run_config, name=id_path.parent.name)

  def write(self, row: dict) -> None:
    self._run.log({k: v for k, v in row.items() if k != "step" and v is not None}, step=row["step"])

  def close(self) -> None:
    self._run.finish()


def _tensorboard_writer(path: str):
  """tensorboardX's writer, imported only by a run that logs to TensorBoard: importing tensorboardX
  imports PyTorch wherever PyTorch is installed (seconds), which a dry run or a refused command line
  should not pay."""
  from tensorboardX import SummaryWriter
  return SummaryWriter(path)


class MetricsLogger:
  def __init__(self, workdir: str, *, total_steps: int, start_step: int = 0, progress: bool = True,
               trackers: tuple[str, ...] = ("tensorboard",), wandb_project: str = "copc_jax",
               run_config: dict | None = None):
    self.workdir = workdir_lib.resolve(workdir)
    self.staging = workdir_lib.scratch(self.workdir)      # the workdir itself unless it is remote
    os.makedirs(self.staging, exist_ok=True)
    self.path = os.path.join(self.staging, "metrics.jsonl")
    kept = [row for row in read_metrics(self.workdir) if row.get("step", 0) <= start_step]
    with open(self.path + ".tmp", "w") as f:
      f.writelines(json.dumps(row) + "\n" for row in kept)
    os.replace(self.path + ".tmp", self.path)
    self._file = open(self.path, "a")
    self._tensorboard = (_tensorboard_writer(os.path.join(self.staging, "tb")) if "tensorboard" in trackers
                         else None)
    self._wandb = WandbWriter(workdir, wandb_project, run_config) if "wandb" in trackers else None
    self._bar = tqdm.tqdm(total=total_steps, initial=start_step, desc="train", unit="step",
                          file=sys.stderr, dynamic_ncols=True, disable=not progress)

  def write(self, metrics: dict) -> dict:
    row = {k: _plain(v) for k, v in metrics.items()}
    self._file.write(json.dumps(row) + "\n")
    self._file.flush()
    step = row["step"]
    for key, value in row.items():
      if self._tensorboard and key != "step" and isinstance(value, int | float) and not isinstance(value, bool):
        self._tensorboard.add_scalar(key, value, step)
    if self._wandb:
      self._wandb.write(row)
    postfix = {"reward": f"{row.get('reward_mean', 0):.3f}", "stale": f"{row.get('staleness_mean', 0):.2f}"}
    if row.get("eval_accuracy") is not None:
      postfix["eval"] = f"{row['eval_accuracy']:.3f}"
    self._bar.set_postfix(postfix, refresh=False)
    self._bar.update(step - self._bar.n)
    return row

  def note(self, message: str) -> None:
    """A line above the progress bar."""
    self._bar.write(message, file=sys.stderr)

  def sync(self) -> None:
    """Mirror the rows and TensorBoard's event files to a remote workdir (a local one has them already)."""
    if not workdir_lib.is_remote(self.workdir):
      return
    if not self._file.closed:                 # close() mirrors after closing both
      self._file.flush()
      if self._tensorboard:
        self._tensorboard.flush()
    target = epath.Path(self.workdir)
    with open(self.path) as f:
      (target / "metrics.jsonl").write_text(f.read())
    events = epath.Path(self.staging) / "tb"
    for event in (workdir_lib.files_under(events) if events.exists() else ()):
      copy = target / "tb" / event.relative_to(events)
      if not copy.exists() or copy.stat().length != event.stat().length:   # event files only grow
        copy.write_bytes(event.read_bytes())

  def close(self) -> None:
    self._bar.close()
    if self._tensorboard:
      self._tensorboard.close()
    if self._wandb:
      self._wandb.close()
    self._file.close()
    self.sync()
