"""The RL trainer: rollouts from JetStream servers, COPC (or any preset) updates, weight pushes.

    python -m copc_jax.main --config=configs/default.py --workdir=DIR
    train_and_evaluate(config, workdir)          # the same from Python: warm start, then RL

The parts, each in its own module:

    warm_start.prepare ─► Trainer(config, workdir, actor_checkpoint=...)   (wiring only)
      run():  backend (JetStream pool or in-process) · WeightStore (weights.py) · batch source per mode
              (batch_sources.py: sync | lag | async) · Learner · Checkpointer · MetricsLogger
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
import dataclasses
import json
import math
import os
import signal
import sys
import threading
import time

import jax
import numpy as np
from flax import nnx

from copc_jax import sharding
from copc_jax.envs import data
from copc_jax.envs.tasks import make_task
from copc_jax.models import hf_io, tiny
from copc_jax.models.decoder import ValueModel
from copc_jax.rollout import auth
from copc_jax.rollout.in_process import InProcessBackend
from copc_jax.rollout.pool import PoolExhausted, RolloutPool
from copc_jax.rollout.protocol import RolloutBackend
from copc_jax.train import checkpoint, multihost, server_check, warm_start
from copc_jax.train import workdir as workdir_lib
from copc_jax.train.batch import TrajectoryBatch, padded_length
from copc_jax.train.batch_sources import make_batch_source
from copc_jax.train.episodes import Episode, EpisodeRunner, PromptSource, group_id
from copc_jax.train.episodes import collect as collect_episodes
from copc_jax.train.evaluator import Evaluator
from copc_jax.train.learner import Learner
from copc_jax.train.metrics import MetricsLogger, read_metrics, update_rows
from copc_jax.train.setup import learner_config
from copc_jax.train.timing import PhaseTimer
from copc_jax.train.weights import IN_PROCESS, WeightStore

STEP_PHASES = ("rollout_wait_s", "train_s", "weight_sync_s")    # they add up to step_time_s
MUST_BE_FINITE = ("actor_loss", "value_loss", "grad_norm", "critic_grad_norm")
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


class TrainingError(RuntimeError):
  """The run stopped; the message says what happened, what was saved and what to fix."""


class NonFiniteError(ArithmeticError):
  """A loss or gradient norm of an update was NaN or infinite."""


class NullLogger:
  """Metrics of processes other than the chief go nowhere."""

  def write(self, metrics: dict) -> dict:
    return metrics

  def note(self, message: str) -> None:
    pass

  def close(self) -> None:
    pass


def _say(message: str) -> None:
  if multihost.is_chief():
    print(message, file=sys.stderr, flush=True)


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


def tokenizer_dir(config, *checkpoints: str) -> str:
  """`config.model.tokenizer`, else the first of `checkpoints` that has tokenizer files (else the first)."""
  if config.model.tokenizer:
    return config.model.tokenizer
  return next((c for c in checkpoints if hf_io.has_tokenizer(c)), checkpoints[0])


def base_checkpoint(config, workdir: str) -> str:
  """The model RL starts from: `config.model.checkpoint`, or a tiny one built in the workdir."""
  source = config.model.checkpoint
  if source == "tiny":
    path = os.path.join(workdir, "base")
    if multihost.is_chief() and not os.path.exists(path):
      checkpoint.write_atomically(path, lambda tmp: tiny.make_tiny_checkpoint(tmp, config.model.tiny_arch,
                                                                             seed=config.seed))
    multihost.barrier("base checkpoint")
    return path
  if not os.path.isfile(os.path.join(source, "config.json")):
    raise FileNotFoundError(f"config.model.checkpoint: no Hugging Face checkpoint at {source!r} (expected "
                            f"config.json and *.safetensors there); give a local directory, or 'tiny'")
  return source


class Trainer:
  """`Trainer(config, workdir).run()`; `backend_factory` replaces the JetStream pool (tests only).

  The constructor wires the parts and restores the latest checkpoint if there is
  one; `actor_checkpoint` is where a fresh run's actor starts (the base model,
  or a warm start's result: see `train_and_evaluate`).
  """

  def __init__(self, config, workdir: str, *, actor_checkpoint: str | None = None, task=None,
               backend_factory=None):
    self.config, self.cfg = config, config.trainer
    self.workdir = os.path.abspath(workdir)
    os.makedirs(self.workdir, exist_ok=True)
    self.processes = jax.process_count()
    if self.cfg.batch_size % self.processes:
      raise ValueError(f"config.trainer.batch_size ({self.cfg.batch_size}) must be divisible by the "
                       f"{self.processes} learner processes")
    self.local_batch_size = self.cfg.batch_size // self.processes
    self.base_checkpoint = base_checkpoint(config, self.workdir)
    mesh = self._mesh()
    actor, _ = hf_io.from_pretrained(actor_checkpoint or self.base_checkpoint, load_tokenizer=False, mesh=mesh,
                                     rules=config.sharding.rules,       # each tensor straight into its shards
                                     **config.model.compute_options())
    self.tokenizer = hf_io.load_tokenizer(
        tokenizer_dir(config, *filter(None, (actor_checkpoint, self.base_checkpoint))),
        needed_for="the trainer (prompts, tool outputs and answers are text)")
    self.task = task or make_task(config.task, config.seed, self.tokenizer)
    critic = ValueModel.from_policy(actor, rngs=nnx.Rngs(config.seed + 1))
    self.learner = Learner(actor, critic, learner_config(config), mesh=mesh,
                           rules=config.sharding.rules, seed=config.seed)
    self.checkpointer = checkpoint.Checkpointer(os.path.join(self.workdir, "checkpoints"))
    self.step, self.record = 0, {}
    self.resuming = self.checkpointer.latest_step() is not None
    if self.resuming:
      self._restore()
    self.backend_factory = backend_factory or self._start_backend
    self.timer = PhaseTimer()

  # --- wiring -----------------------------------------------------------------------

  def _mesh(self):
    mesh = sharding.make_mesh(self.config.sharding)
    shards = mesh.shape["data"] * mesh.shape["fsdp"]
    group_rows = self.cfg.batch_size // self.cfg.num_minibatches // self.cfg.gradient_accumulation
    if group_rows % shards:
      raise ValueError(f"config.trainer.batch_size ({self.cfg.batch_size}) / num_minibatches "
                       f"({self.cfg.num_minibatches}) / gradient_accumulation "
                       f"({self.cfg.gradient_accumulation}) "
                       f"must be divisible by the {shards} data x fsdp shards of the mesh {dict(mesh.shape)}")
    return mesh

  def _restore(self) -> None:
    self.step, self.learner.state, self.learner.rng, self.record = self.checkpointer.restore_latest(
        self.learner.state, self.learner.rng, log=_say)
    saved_processes = len(self.record.get("processes", []))
    if saved_processes != self.processes:
      raise ValueError(f"the checkpoint in {self.checkpointer.directory} was written by {saved_processes} "
                       f"learner processes; resume it with the same number (this run has {self.processes})")
    stopped = self._stopped_state_path()
    if os.path.exists(stopped):       # saved by this process when a multi-process run stopped on an error
      with open(stopped) as f:
        self.record["processes"][jax.process_index()] = json.load(f)

  def _start_backend(self, evaluation: bool = False) -> RolloutBackend:
    """The training servers, or (`evaluation`) one server that evaluates the learner's weights; or,
    with `rollout.backend = "in_process"`, a generator in this process on the learner's devices."""
    c = self.config.rollout
    if c.backend == "in_process":
      try:
        return InProcessBackend(self.learner.actor, slots=c.slots, max_prefill_length=c.max_prefill_length,
                                max_length=c.max_length, steps_per_call=c.in_process_steps, version=-1,
                                mesh=self.learner.mesh)
      except ValueError as err:
        raise TrainingError(f"config.rollout: {err}") from err
    addresses = c.eval_addresses if evaluation else c.addresses
    if evaluation and c.addresses and not addresses:
      raise TrainingError("lag mode evaluates the learner's current weights on a server of its own: with "
                          "remote servers, give one in config.rollout.eval_addresses (or eval_every = 0)")
    count = len(addresses) or (1 if evaluation else c.num_servers)
    _say(f"starting {count} {'evaluation' if evaluation else 'rollout'} server(s)...")
    try:
      common = dict(stall_timeout_s=c.stall_timeout_s, probe_timeout_s=c.probe_timeout_s,
                    lost_timeout_s=c.lost_timeout_s, push_timeout_s=c.push_timeout_s)
      if addresses:
        return RolloutPool(addresses=list(addresses), max_in_flight=c.max_in_flight,
                           token=auth.resolve_token(c.auth_token_file),
                           tls_root_certificates=c.tls_root_certificates, **common)
      # Servers start on the base weights as version -1; every version the learner
      # owns is pushed before anything is generated with it.
      return RolloutPool(self.base_checkpoint, num_servers=count, max_in_flight=c.max_in_flight,
                         slots=c.slots, max_prefill_length=c.max_prefill_length, max_length=c.max_length,
                         platform=c.server_platform, tensor_parallelism=c.server_tensor_parallelism,
                         data_parallelism=c.server_data_parallelism, decode_steps=c.server_decode_steps,
                         dtype=c.server_dtype,
                         ready_timeout_s=c.ready_timeout_s, **common,
                         log_dir=os.path.join(self.workdir, "logs", "eval" if evaluation else ""),
                         version=-1)
    except (TimeoutError, RuntimeError) as err:
      raise TrainingError(f"the rollout servers did not start: {err}\nCheck the server log above; "
                          f"config.rollout.max_prefill_length / max_length / slots must suit the model, "
                          f"and config.rollout.ready_timeout_s ({c.ready_timeout_s}) must cover compilation.") \
          from err

  def _weight_transfer(self) -> str:
    """How pushed versions travel: as arrays to an in-process backend, else config.rollout.weight_transfer."""
    return IN_PROCESS if self.config.rollout.backend == "in_process" else self.config.rollout.weight_transfer

  # --- the run ------------------------------------------------------------------------

  def run(self) -> dict:
    """Train to `config.trainer.steps`; SIGTERM and Ctrl-C save a checkpoint before the run ends."""
    wall_start, source, logger, opened = time.time(), None, NullLogger(), []   # closed at the end
    with _sigterm_as_keyboard_interrupt():
      backend = self.backend_factory()
      opened.append(backend)
      try:
        self._check_servers(backend)
        if multihost.is_chief():
          logger = MetricsLogger(self.workdir, total_steps=self.cfg.steps, start_step=self.step,
                                 progress=self.cfg.progress_bar, trackers=self.cfg.trackers,
                                 wandb_project=self.cfg.wandb_project,
                                 run_config=json.loads(json.dumps(dataclasses.asdict(self.config),
                                                                  default=str)))
        runner = EpisodeRunner(backend.generate, self.task, self.tokenizer, self.config.rollout,
                                        seed=(self.config.seed, jax.process_index()))
        weights = WeightStore(os.path.join(self.workdir, "weights"), backend,
                              pushes=not self.config.rollout.addresses or multihost.is_chief(),
                              transfer=self._weight_transfer())
        opened.append(weights)
        saved = self._process_record()
        source = make_batch_source(self.cfg, runner, self._prompts(runner, saved.get("data", {})), weights,
                                   lambda: self.learner.actor, self.timer, batch_size=self.local_batch_size,
                                   buffered=saved.get("buffer", []))
        evaluator = self._evaluator(runner, weights, source, opened)
        self._train(source, evaluator, logger)
      finally:
        if source is not None:
          source.request_stop()
        for each in opened:
          each.close()
        if source is not None:
          source.stop()
        logger.close()
    return self._summary(wall_start)

  def sample_start_policy(self, count: int) -> list[Episode]:
    """`count` episodes of the actor as it starts RL, on the first training prompts that fit, sampled
    as training samples them (on its servers, with its tools and rewards); nothing is trained."""
    backend = self.backend_factory()
    try:
      self._check_servers(backend)
      runner = EpisodeRunner(backend.generate, self.task, self.tokenizer, self.config.rollout,
                                      seed=(self.config.seed, jax.process_index()))
      weights = WeightStore(os.path.join(self.workdir, "weights"), backend,
                            transfer=self._weight_transfer())
      try:
        weights.push(0, self.learner.actor)
        records = [{**r, "draw": i} for i, r in enumerate(r for r in self.task.train if runner.fits(r))][:count]
        return collect_episodes(runner, records, self.config.rollout.concurrency)
      finally:
        weights.close()
    finally:
      backend.close()

  def _check_servers(self, backend) -> None:
    """Servers must fit the rollout config's lengths and serve the learner's model (`server_check`)."""
    try:
      server_check.check_servers(backend.status(), self.config.rollout, self.learner.actor.config)
    except server_check.ServerMismatch as err:
      raise TrainingError(str(err)) from err

  def _evaluator(self, runner, weights, source, opened) -> Evaluator:
    """Greedy evaluation of the learner's current weights: on the training servers where they can
    take them, else (lag mode) on a dedicated evaluation server started for it."""
    records = [r for r in self.task.eval if runner.fits(r)]
    if source.serves_the_learner:
      return Evaluator(runner, records, weights, self.config.rollout.concurrency)
    backend = self.backend_factory(evaluation=True) if multihost.is_chief() else None
    if backend is not None:
      opened.append(backend)
      self._check_servers(backend)
    eval_runner = EpisodeRunner(backend.generate if backend else None, self.task, self.tokenizer,
                                         self.config.rollout, seed=runner.seed)
    eval_weights = WeightStore(weights.directory, backend, pushes=backend is not None,
                               transfer=weights.transfer)
    opened.append(eval_weights)
    return Evaluator(eval_runner, records, eval_weights, self.config.rollout.concurrency)

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

  def _prompts(self, runner, saved: dict) -> PromptSource:
    train = [r for r in self.task.train if runner.fits(r)]
    if not train:
      raise TrainingError(f"no training prompt fits config.rollout.max_prefill_length "
                          f"({self.config.rollout.max_prefill_length}); raise it")
    iterator = data.PromptIterator(train, seed=self.config.seed, shard_index=jax.process_index(),
                                   shard_count=self.processes, state=saved.get("iterator"))
    return PromptSource(iterator, saved.get("requeued"), saved.get("draws", 0),
                                 group_size=self.cfg.group_size)

  def _evaluation_due(self) -> bool:
    return bool(self.cfg.eval_every and self.step % self.cfg.eval_every == 0) or self.step == self.cfg.steps

  def _first_evaluation(self, evaluator, logger) -> None:
    if self.resuming:
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
    staleness = np.asarray(batch.staleness(self.step))[batch.mask]
    versions = np.asarray(batch.versions)[batch.mask]
    lengths = [sum(e.trajectory.mask) for e in episodes]       # tokens the policy wrote, per episode
    totals = multihost.sum_over_processes([
        len(episodes), sum(e.trajectory.reward for e in episodes), sum(e.correct for e in episodes),
        sum(lengths), sum(e.trajectory.num_turns for e in episodes),
        staleness.sum(), staleness.size])
    n, reward, correct, length, turns, stale_sum, stale_count = totals
    newest_version = int(multihost.max_over_processes(float(versions.max()) if versions.size else 0.0))
    self.step += 1
    return {
        "step": self.step, "weights_version": self.step,
        "reward_mean": reward / n, "accuracy": correct / n, "response_len_mean": length / n,
        "response_len_max": int(multihost.max_over_processes(float(max(lengths, default=0)))),
        "turns_mean": turns / n,
        "staleness_mean": stale_sum / max(stale_count, 1),
        "staleness_max": int(multihost.max_over_processes(float(staleness.max()) if staleness.size else 0.0)),
        # lag mode's first k updates train on data of version 0 only (the start policy's)
        "data_version_max": newest_version, "inside_first_lag": self.cfg.mode == "lag" and newest_version == 0,
        **{name: metrics[key] for name, key in ROW_METRICS.items() if key in metrics},
    }

  # --- saving -------------------------------------------------------------------------

  def _checkpoint(self, source, process_state: dict | None = None) -> None:
    """All processes: the learner state (orbax), and each process's data position and buffer."""
    process_state = process_state or source.state()
    self.record.update(step=self.step, version=self.step, processes=multihost.gather_json(process_state))
    self.checkpointer.save(self.step, self.learner.state, self.learner.rng, self.record)
    with contextlib.suppress(FileNotFoundError):
      os.remove(self._stopped_state_path())
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
      os.makedirs(self.checkpointer.directory, exist_ok=True)
      checkpoint.write_atomically(self._stopped_state_path(), lambda tmp: _write_json(tmp, process_state))
    return process_state

  def _stopped_state_path(self) -> str:
    return os.path.join(self.checkpointer.directory, f"stopped_process_{jax.process_index()}.json")

  def _process_record(self) -> dict:
    processes = self.record.get("processes")
    return processes[jax.process_index()] if processes else {}

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
    with open(os.path.join(self.workdir, "summary.json"), "w") as f:
      json.dump(summary, f, indent=2)
    return summary


def _check_finite(row: dict) -> None:
  for name in MUST_BE_FINITE:
    if not math.isfinite(float(row[name])):
      raise NonFiniteError(f"{name} is {float(row[name])} at update {row['step']}")


def _advice(err: BaseException) -> str:
  if isinstance(err, PoolExhausted):
    return "Every rollout server is down: restart them (or check config.rollout.addresses)."
  return "Fix the cause above."


def _write_json(path: str, value) -> None:
  with open(path, "w") as f:
    json.dump(value, f)


def train_and_evaluate(config, workdir: str, *, backend_factory=None, fresh_start: bool = False) -> dict:
  """The `train` job: the warm start (its own step, cached in DIR/warm_start), then RL.

  The run holds `workdir` (`workdir.claim`): a second run on it, or a fresh start over a previous
  run's history without `fresh_start`, stops with one line.
  """
  workdir = os.path.abspath(workdir)
  with workdir_lib.claim(workdir, fresh_start=fresh_start, process_index=jax.process_index(), log=_say):
    task, actor_checkpoint = start_policy(config, workdir)
    return Trainer(config, workdir, actor_checkpoint=actor_checkpoint, task=task,
                   backend_factory=backend_factory).run()


def start_policy(config, workdir: str):
  """(task, actor checkpoint) as RL starts: the task (through the chat template when the config asks),
  and the warm start's result cached in DIR/warm_start (None without a warm start: the base model)."""
  base = base_checkpoint(config, workdir)
  tokenizer = (hf_io.load_tokenizer(tokenizer_dir(config, base), needed_for="config.task.chat_template")
               if config.task.chat_template else None)
  task = make_task(config.task, config.seed, tokenizer)
  if not config.warm_start.steps:
    return task, None
  return task, warm_start.prepare(task, base, os.path.join(workdir, "warm_start"), config.warm_start,
                                  seed=config.seed, log=_say, tokenizer_dir=tokenizer_dir(config, base))


def dry_run_rollouts(config, workdir: str, count: int) -> dict:
  """`--dry_run_rollouts=N`: N episodes of the start policy (after the warm start, if the config has
  one; cached in DIR/warm_start as a training run caches it), each printed with its reward, and what
  they say about the task's format written to DIR/dry_run_rollouts.json: mean reward, accuracy, the
  share of episodes that called the tool, turns and finish reasons. The servers and weights of the
  dry run live in DIR/dry_run; nothing is trained and no training history is written."""
  workdir = os.path.abspath(workdir)
  task, actor_checkpoint = start_policy(config, workdir)
  trainer = Trainer(config, os.path.join(workdir, "dry_run"), actor_checkpoint=actor_checkpoint, task=task)
  episodes = trainer.sample_start_policy(count)
  tool_output_opening = task.tool_output[0]      # in the response only where the tool answered a call
  rows = []
  for i, episode in enumerate(episodes):
    response = trainer.tokenizer.decode(episode.trajectory.token_ids, skip_special_tokens=True)
    rows.append({"question": episode.record["question"], "response": response,
                 "reward": episode.trajectory.reward, "correct": episode.correct,
                 "called_tool": tool_output_opening in response, "turns": episode.trajectory.num_turns,
                 "finish_reason": episode.trajectory.finish_reason})
    print(f"--- episode {i}: reward {episode.trajectory.reward:.3f}, correct {episode.correct}, "
          f"turns {episode.trajectory.num_turns}, {episode.trajectory.finish_reason}\n{response}", flush=True)
  n = max(len(rows), 1)
  summary = {"episodes": len(rows), "start_policy": actor_checkpoint or base_checkpoint(config, workdir),
             "mean_reward": sum(r["reward"] for r in rows) / n, "accuracy": sum(r["correct"] for r in rows) / n,
             "tool_call_rate": sum(r["called_tool"] for r in rows) / n,
             "mean_turns": sum(r["turns"] for r in rows) / n,
             "finish_reasons": {k: sum(r["finish_reason"] == k for r in rows)
                                for k in sorted({str(r["finish_reason"]) for r in rows})},
             "rows": rows}
  with open(os.path.join(workdir, "dry_run_rollouts.json"), "w") as f:
    json.dump(summary, f, indent=1)
  print(f"dry run: {len(rows)} episodes, mean reward {summary['mean_reward']:.3f}, accuracy "
        f"{summary['accuracy']:.3f}, tool calls {summary['tool_call_rate']:.3f}; "
        f"{os.path.join(workdir, 'dry_run_rollouts.json')}", flush=True)
  return summary


def run(config, workdir: str, *, fresh_start: bool = False) -> dict:
  """The `train` job of `copc_jax.main`."""
  summary = train_and_evaluate(config, workdir, fresh_start=fresh_start)
  print("\n".join(["", "summary", *(f"  {k:<24}{v}" for k, v in summary.items())]), flush=True)
  return summary
