"""The RL trainer: the loop over updates, its checkpoints, and the save when it stops on an error.

    python -m copc_jax.main --config=configs/default.py --workdir=DIR
    train_and_evaluate(config, workdir)          # the same from Python: warm start, then RL
    Trainer(build(config, workdir)).run()        # RL from the parts (`train/build.py`)

The parts, each in its own module:

    warm_start.prepare ─► build(config, workdir) → parts (model, learner, task, restored checkpoint)
      run():  parts.open() → backend (JetStream pool or in-process) · WeightStore (weights.py) · batch
              source per mode (batch_sources.py: sync | lag | async) · Evaluator · MetricsLogger
      loop:   next_batch(v) → train → after_update(v + 1) → [eval] → log → [checkpoint]

With several learner processes (`--distributed`), each collects its share of
every batch from its shard of the prompts; process 0 writes files and metrics and
pushes weights to shared servers (`train/multihost.py`).

A run is resumable at any moment: the learner state, RNG, data position, the
episodes buffered and the prompts in flight are checkpointed with orbax every
`checkpoint_every` updates and when the run stops on an error; the same command
continues from the latest checkpoint with the same version numbering. A non-finite
loss or gradient norm stops the run without saving: the last good checkpoint stays.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import threading
import time

import jax
import numpy as np
from etils import epath

from copc_jax.envs.tasks import make_task
from copc_jax.models import hf_io
from copc_jax.rollout.pool import PoolExhausted
from copc_jax.train import checkpoint, multihost, warm_start
from copc_jax.train import workdir as workdir_lib
from copc_jax.train.batch import TrajectoryBatch, padded_length
from copc_jax.train.build import Parts, TrainingError, base_checkpoint, build, say, tokenizer_dir
from copc_jax.train.episodes import Episode, group_id
from copc_jax.train.episodes import collect as collect_episodes
from copc_jax.train.metrics import STEP_PHASES, read_metrics, update_row, update_rows

MUST_BE_FINITE = ("actor_loss", "value_loss", "grad_norm", "critic_grad_norm")
__all__ = ["MUST_BE_FINITE", "NonFiniteError", "Parts", "Trainer", "TrainingError", "base_checkpoint", "build",
           "start_policy", "tokenizer_dir", "train_and_evaluate"]


class NonFiniteError(ArithmeticError):
  """A loss or gradient norm of an update was NaN or infinite."""


@contextlib.contextmanager
def _sigterm_as_keyboard_interrupt():
  """SIGTERM stops the run like Ctrl-C (a checkpoint is saved); only possible on the main thread."""
  if threading.current_thread() is not threading.main_thread():
    yield
    return
  def interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")
  previous = signal.signal(signal.SIGTERM, interrupt)
  try:
    yield
  finally:
    signal.signal(signal.SIGTERM, previous)


class Trainer:
  """`Trainer(build(config, workdir)).run()`: train the parts to `config.trainer.steps`."""

  def __init__(self, parts: Parts):
    self.parts, self.config, self.cfg = parts, parts.config, parts.config.trainer
    self.learner, self.checkpointer, self.timer = parts.learner, parts.checkpointer, parts.timer
    self.workdir, self.task, self.tokenizer = parts.workdir, parts.task, parts.tokenizer
    self.processes, self.local_batch_size = parts.processes, parts.local_batch_size

  # step and record live in the parts (restored there), so a resumed run and its checkpoints agree
  @property
  def step(self) -> int:
    return self.parts.step

  @step.setter
  def step(self, value: int) -> None:
    self.parts.step = value

  @property
  def record(self) -> dict:
    return self.parts.record

  def run(self) -> dict:
    """Train to `config.trainer.steps`; SIGTERM and Ctrl-C save a checkpoint before the run ends."""
    wall_start = time.time()
    with _sigterm_as_keyboard_interrupt(), self.parts.open() as live:
      self._train(live.source, live.evaluator, live.logger)
    return self._summary(wall_start)

  def _train(self, source, evaluator, logger) -> None:
    c, row = self.cfg, None
    try:
      self._first_evaluation(evaluator, logger)
      if "critic_warmup" not in self.record:
        self._warm_up_critic(source, logger)
      source.start(self.step)
      while self.step < c.steps:
        with self.timer("rollout_wait_s"):
          episodes = source.next_batch(self.step)
        with self.timer("train_s"):
          row = self._train_on(episodes)
        _check_finite(row)
        with self.timer("weight_sync_s"):
          source.after_update(self.step)
        row.update(self.timer.lap(), **source.metrics())
        row["step_time_s"] = sum(row.get(phase, 0.0) for phase in STEP_PHASES)
        final = self.step == c.steps
        if self._evaluation_due():
          with self.timer("eval_s"):
            row.update(evaluator(self.step, self.learner.actor))
          row.update(self.timer.lap())
          self.record["evaluated_step"] = self.step
        logger.write(row)
        row = None
        if self.step % c.checkpoint_every == 0 or final:
          self._checkpoint(source)
          logger.sync()              # a remote workdir's rows and events, up to this checkpoint
    except NonFiniteError as err:
      logger.write(row)
      raise TrainingError(f"training stopped at step {self.step}: {err}. Nothing was saved over the last good "
                          f"checkpoint (step {self.checkpointer.latest_step()}) in "
                          f"{self.checkpointer.directory}. Lower the learning rate or check the data, then "
                          f"rerun the same command to resume from it.") from err
    except (KeyboardInterrupt, Exception) as err:
      source.request_stop()
      if row is not None:            # the update happened: its row goes with the state saved below
        logger.write(row)
      buffered = sum(len(unit) for unit, _ in self._save_on_error(source)["buffer"])
      if isinstance(err, KeyboardInterrupt):
        raise
      raise TrainingError(
          f"training stopped at step {self.step}: {type(err).__name__}: {err}\nSaved: the learner state at "
          f"step {self.step} and {buffered} buffered episodes in {self.checkpointer.directory}. "
          f"{_advice(err)} Then rerun the same command to resume.") from err

  def _warm_up_critic(self, source, logger) -> None:
    """`critic_warmup_steps` value-only updates on fresh rollouts of the start policy (version 0),
    then a checkpoint at step 0: the actor moves only once the critic knows its returns (as verl's
    `critic_warmup`). Group presets have no critic to warm up. The last row reports explained variance."""
    steps = 0 if self.config.estimator.group_method else self.cfg.critic_warmup_steps
    metrics, explained = {}, []
    for i in range(steps):
      with self.timer("weight_sync_s"):
        source.weights.push(0, self.learner.actor)
      episodes = collect_episodes(source.runner, source.prompts.take(self.local_batch_size), source.workers)
      batch = TrajectoryBatch.from_episodes([e.trajectory for e in episodes],
                                            length=self._batch_length(episodes))
      metrics = jax.device_get(self.learner.critic_step(batch, process_local=True))
      explained.append(float(metrics["value_explained_variance"]))
      logger.write({"step": 0, "critic_warmup_step": i + 1, "value_loss": metrics["value_loss"],
                    "value_explained_variance": metrics["value_explained_variance"],
                    "returns_mean": metrics["returns_mean"], **self.timer.lap()})
    # Explained variance at the end of warm-up: the mean over its last 3 batches (a batch whose targets
    # do not vary has none).
    last = [e for e in explained[-3:] if math.isfinite(e)]
    self.record["critic_warmup"] = {"steps": steps,
                                    "value_explained_variance": float(np.mean(last)) if last else None,
                                    **({"value_loss": float(metrics["value_loss"])} if metrics else {})}
    if steps:
      logger.note(f"critic warm-up: {steps} value-only updates, explained variance over its last batches "
                  f"{self.record['critic_warmup']['value_explained_variance']}")
    self._checkpoint(source)        # step 0: a run killed from here on resumes with the same command

  def _evaluation_due(self) -> bool:
    return bool(self.cfg.eval_every and self.step % self.cfg.eval_every == 0) or self.step == self.cfg.steps

  def _first_evaluation(self, evaluator, logger) -> None:
    if self.parts.resuming:
      logger.note(f"resumed from step {self.step} (weights version {self.step}) in {self.workdir}")
      if self._evaluation_due() and self.record.get("evaluated_step", self.step) != self.step:
        evaluation = evaluator(self.step, self.learner.actor)      # the run stopped before this one
        if evaluation:                                             # (the chief's; other processes: {})
          logger.write({"step": self.step, **evaluation})
        self.record["evaluated_step"] = self.step
      return
    evaluation = evaluator(self.step, self.learner.actor)
    self.record["evaluated_step"] = self.step
    if evaluation:
      self.record["initial_eval_accuracy"] = evaluation["eval_accuracy"]
      logger.write({"step": 0, **evaluation})
      logger.note(f"eval accuracy before RL: {evaluation['eval_accuracy']:.3f}")

  def _batch_length(self, episodes: list[Episode]) -> int:
    # several processes build one global batch: its rows must have one length everywhere
    multiple = self.cfg.pad_to_multiple if self.processes == 1 else 0
    return padded_length(max(len(e.trajectory.context) for e in episodes), self.config.rollout.max_length,
                         multiple)

  def _train_on(self, episodes: list[Episode]) -> dict:
    """One update on this process's episodes (its rows of the global batch); the row of metrics."""
    batch = TrajectoryBatch.from_episodes([e.trajectory for e in episodes], length=self._batch_length(episodes),
                                          group_ids=[group_id(e.record, jax.process_index()) for e in episodes])
    metrics = jax.device_get(self.learner.train_step(batch, process_local=True))
    row = update_row(self.step, episodes, batch, metrics, mode=self.cfg.mode)
    self.step += 1
    return row

  # --- saving -------------------------------------------------------------------------

  def _checkpoint(self, source, process_state: dict | None = None) -> None:
    """All processes: the learner state (orbax), and each process's data position and buffer."""
    process_state = process_state or source.state()
    self.record.update(step=self.step, version=self.step, processes=multihost.gather_json(process_state))
    self.checkpointer.save(self.step, self.learner.state, self.learner.rng, self.record)
    epath.Path(self.parts.stopped_state_path()).unlink(missing_ok=True)
    source.weights.prune(source.keep_versions_from(self.step))

  def _save_on_error(self, source) -> dict:
    """Save without collectives, so one failing learner process cannot hang the others.

    One process: the full checkpoint. Several: this process's data position and
    buffered episodes, next to the last complete checkpoint, which a resume restores. Returns
    what was saved of this process.
    """
    process_state = source.state()
    if self.processes == 1:
      self._checkpoint(source, process_state)
    else:
      checkpoint.write_json(self.parts.stopped_state_path(), process_state)
    return process_state

  def _summary(self, wall_start: float) -> dict:
    if not multihost.is_chief():
      return {"steps": self.step}
    everything = read_metrics(self.workdir)
    rows = update_rows(everything)
    evals = [r["eval_accuracy"] for r in everything
             if r.get("step", 0) >= 1 and r.get("eval_accuracy") is not None]
    summary = {
        "steps": self.step, "mode": self.cfg.mode, "preset": self.config.preset,
        "initial_eval_accuracy": self.record.get("initial_eval_accuracy"),
        "final_eval_accuracy": evals[-1] if evals else None,
        "reward_mean_last_10": float(np.mean([r["reward_mean"] for r in rows[-10:]])) if rows else None,
        "staleness_max": max((r["staleness_max"] for r in rows), default=0),
        "step_time_s_mean": float(np.mean([r["step_time_s"] for r in rows])) if rows else None,
        "wall_time_s_this_run": time.time() - wall_start,
    }
    (epath.Path(self.workdir) / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def _check_finite(row: dict) -> None:
  for name in MUST_BE_FINITE:
    if not math.isfinite(float(row[name])):
      raise NonFiniteError(f"{name} is {float(row[name])} at update {row['step']}")


def _advice(err: BaseException) -> str:
  if isinstance(err, PoolExhausted):
    return "Every rollout server is down: restart them (or check config.rollout.addresses)."
  return "Fix the cause above."


def train_and_evaluate(config, workdir: str, *, backend_factory=None, fresh_start: bool = False) -> dict:
  """The `train` job: the warm start (its own step, cached in DIR/warm_start), then RL.

  The run holds `workdir` (`workdir.claim`): a second run on it, or a fresh start over a previous
  run's history without `fresh_start`, stops with one line.
  """
  workdir = workdir_lib.resolve(workdir)
  with workdir_lib.claim(workdir, fresh_start=fresh_start, process_index=jax.process_index(), log=say):
    task, actor_checkpoint = start_policy(config, workdir)
    return Trainer(build(config, workdir, actor_checkpoint=actor_checkpoint, task=task,
                         backend_factory=backend_factory)).run()


def start_policy(config, workdir: str):
  """(task, actor checkpoint) as RL starts: the task (through the chat template when the config asks),
  and the warm start's result cached in DIR/warm_start, DIR's scratch for a remote DIR (None without a
  warm start: the base model)."""
  base = base_checkpoint(config, workdir)
  tokenizer = (hf_io.load_tokenizer(tokenizer_dir(config, base), needed_for="config.task.chat_template")
               if config.task.chat_template else None)
  task = make_task(config.task, config.seed, tokenizer)
  if not config.warm_start.steps:
    return task, None
  return task, warm_start.prepare(task, base, os.path.join(workdir_lib.scratch(workdir), "warm_start"),
                                  config.warm_start, seed=config.seed, log=say,
                                  tokenizer_dir=tokenizer_dir(config, base))


def run(config, workdir: str, *, fresh_start: bool = False) -> dict:
  """The `train` job of `copc_jax.main`."""
  summary = train_and_evaluate(config, workdir, fresh_start=fresh_start)
  print("\n".join(["", "summary", *(f"  {k:<24}{v}" for k, v in summary.items())]), flush=True)
  return summary
