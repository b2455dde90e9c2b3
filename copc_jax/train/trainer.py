"""The RL trainer: rollouts from JetStream servers, COPC (or any preset) updates, weight pushes.

    python -m copc_jax.main --config=configs/default.py --workdir=DIR

Modes (`config.trainer.mode`), with version v = number of learner updates so far:

- `sync`: push v, generate a batch with it, train; staleness 0.
- `async`: worker threads keep episodes running while the learner trains;
  weights are pushed every `sync_every` updates; an episode starts only if it
  will be at most `max_staleness` versions old when consumed, and nothing older
  is ever trained on (`train/staleness.py`).
- `lag`: the batch of update v is generated with the weights of version
  max(0, v − lag), exactly: controlled staleness for sweeps up to 64 steps.

With several learner processes (`--distributed`), each collects its share of
every batch from its shard of the prompts; process 0 writes files and metrics and
pushes weights to shared servers (`train/multihost.py`).

A run is resumable at any moment: the learner state, RNG, data position, the
episodes buffered and the prompts in flight are checkpointed with orbax every
`checkpoint_every` updates and when the run stops on an error; the same command
continues from the latest checkpoint with the same version numbering.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
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
from copc_jax.models.decoder import Decoder, ValueModel
from copc_jax.rollout.agent import to_batch
from copc_jax.rollout.pool import PoolExhausted, RolloutPool
from copc_jax.train import checkpoint, multihost, rollouts, warm_start
from copc_jax.train.learner import Learner, LearnerConfig, OptimizerConfig
from copc_jax.train.metrics import MetricsLogger, read_metrics
from copc_jax.train.staleness import AdmissionControl, TrajectoryBuffer

MODES = ("sync", "async", "lag")


@dataclasses.dataclass(frozen=True)
class ModelSource:
  checkpoint: str = "tiny"      # a Hugging Face directory (config.json + safetensors), or "tiny"
  tiny_arch: str = "qwen2"      # for "tiny": built in the workdir from the seed

  def __post_init__(self):
    if self.tiny_arch not in ("qwen2", "llama"):
      raise ValueError(f"tiny_arch must be 'qwen2' or 'llama'; got {self.tiny_arch!r}")


@dataclasses.dataclass(frozen=True)
class TrainerConfig:
  mode: str = "async"
  steps: int = 60
  batch_size: int = 32
  max_staleness: int = 4         # async: η
  sync_every: int = 1            # async: push weights every this many updates
  lag: int = 0                   # lag: k
  eval_every: int = 20           # 0: evaluate only before and after training
  checkpoint_every: int = 10
  epochs: int = 1
  num_minibatches: int = 1
  actor_learning_rate: float = 1e-4
  critic_learning_rate: float = 1e-3
  max_grad_norm: float = 1.0
  warmup_steps: int = 0
  progress_bar: bool = True

  def __post_init__(self):
    if self.mode not in MODES:
      raise ValueError(f"mode must be one of {MODES}; got {self.mode!r}")
    for name in ("steps", "batch_size", "sync_every", "checkpoint_every", "epochs", "num_minibatches"):
      if getattr(self, name) < 1:
        raise ValueError(f"{name} must be >= 1; got {getattr(self, name)}")
    for name in ("max_staleness", "lag", "eval_every", "warmup_steps"):
      if getattr(self, name) < 0:
        raise ValueError(f"{name} must be >= 0; got {getattr(self, name)}")
    if self.mode == "async" and self.max_staleness < self.sync_every - 1:
      raise ValueError(f"max_staleness ({self.max_staleness}) must be >= sync_every - 1 "
                       f"({self.sync_every - 1}): weights pushed every {self.sync_every} updates are that "
                       f"stale")
    if self.batch_size % self.num_minibatches:
      raise ValueError(f"batch_size ({self.batch_size}) must be divisible by num_minibatches "
                       f"({self.num_minibatches})")
    for name in ("actor_learning_rate", "critic_learning_rate", "max_grad_norm"):
      if getattr(self, name) <= 0:
        raise ValueError(f"{name} must be > 0; got {getattr(self, name)}")


class NullLogger:
  """Metrics of processes other than the chief go nowhere."""

  def write(self, metrics: dict) -> dict:
    return metrics

  def note(self, message: str) -> None:
    pass

  def close(self) -> None:
    pass


class TrainingError(RuntimeError):
  """The run stopped; the message says what happened, what was saved and what to fix."""


def _raise_keyboard_interrupt(signum, frame):
  raise KeyboardInterrupt(f"signal {signum}")


def _atomic_dir(path: str, write) -> str:
  """`write(tmp)` then rename to `path`: a kill never leaves a half-written directory at `path`."""
  tmp = f"{path}.tmp"
  shutil.rmtree(tmp, ignore_errors=True)
  write(tmp)
  shutil.rmtree(path, ignore_errors=True)
  os.replace(tmp, path)
  return path


def _say(message: str) -> None:
  if multihost.is_chief():
    print(message, file=sys.stderr, flush=True)


class Trainer:
  """`Trainer(config, workdir).run()`; `pool_factory` replaces the JetStream pool (tests only)."""

  def __init__(self, config, workdir: str, *, pool_factory=None):
    self.config, self.cfg = config, config.trainer
    self._pool_factory = pool_factory
    self.workdir = os.path.abspath(workdir)
    os.makedirs(self.workdir, exist_ok=True)
    self.task = make_task(config.task, config.seed)
    self.processes = jax.process_count()
    if self.cfg.batch_size % self.processes:
      raise ValueError(f"config.trainer.batch_size ({self.cfg.batch_size}) must be divisible by the "
                       f"{self.processes} learner processes")
    self.local_batch_size = self.cfg.batch_size // self.processes
    self.base_checkpoint = self._base_checkpoint()
    actor, self.tokenizer = hf_io.from_pretrained(self.base_checkpoint)
    self.checkpointer = checkpoint.Checkpointer(os.path.join(self.workdir, "checkpoints"))
    self.resuming = self.checkpointer.latest_step() is not None
    self.warm_start_losses: list[float] = []
    if not self.resuming and config.warm_start.steps:
      actor = self._warm_start(actor)
    critic = ValueModel.from_policy(actor, rngs=nnx.Rngs(config.seed + 1))
    mesh = sharding.make_mesh(config.sharding)
    batch_shards = mesh.shape["data"] * mesh.shape["fsdp"]
    if (self.cfg.batch_size // self.cfg.num_minibatches) % batch_shards:
      raise ValueError(f"config.trainer.batch_size ({self.cfg.batch_size}) / num_minibatches "
                       f"({self.cfg.num_minibatches}) must be divisible by the {batch_shards} data x fsdp "
                       f"shards of the mesh {dict(mesh.shape)}")
    self.learner = Learner(actor, critic, self._learner_config(), mesh=mesh, rules=config.sharding.rules,
                           seed=config.seed)
    self.record: dict = {}
    self.step = 0
    if self.resuming:
      self.step, self.learner.state, self.learner.rng, self.record = self.checkpointer.restore_latest(
          self.learner.state, self.learner.rng)
      saved_processes = len(self.record.get("processes", []))
      if saved_processes != self.processes:
        raise ValueError(f"the checkpoint in {self.checkpointer.directory} was written by {saved_processes} "
                         f"learner processes; resume it with the same number (this run has {self.processes})")
    self.server_version: int | None = None
    # Local servers belong to each process; shared (remote) servers are driven by the chief.
    self.pushes_weights = not config.rollout.addresses or multihost.is_chief()
    self.weight_sync_s = 0.0

  # --- setup ----------------------------------------------------------------------

  def _base_checkpoint(self) -> str:
    source = self.config.model.checkpoint
    if source == "tiny":
      path = os.path.join(self.workdir, "base")
      if multihost.is_chief() and not os.path.exists(path):
        _atomic_dir(path, lambda tmp: tiny.make_tiny_checkpoint(tmp, self.config.model.tiny_arch,
                                                                 seed=self.config.seed))
      multihost.barrier("base checkpoint")
      return path
    if not os.path.isfile(os.path.join(source, "config.json")):
      raise FileNotFoundError(f"config.model.checkpoint: no Hugging Face checkpoint at {source!r} (expected "
                              f"config.json and *.safetensors there); give a local directory, or 'tiny'")
    return source

  def _learner_config(self) -> LearnerConfig:
    c = self.cfg
    make_opt = lambda lr: OptimizerConfig(learning_rate=lr, max_grad_norm=c.max_grad_norm,
                                          warmup_steps=c.warmup_steps)
    return LearnerConfig(estimator=self.config.estimator, actor=self.config.actor, value=self.config.value,
                         actor_optimizer=make_opt(c.actor_learning_rate),
                         critic_optimizer=make_opt(c.critic_learning_rate),
                         epochs=c.epochs, num_minibatches=c.num_minibatches)

  def _warm_start(self, actor):
    """SFT on the task's demonstrations; demonstrations and the result are cached in the workdir."""
    directory = os.path.join(self.workdir, "warm_start")
    model_dir = os.path.join(directory, "model")
    if not multihost.is_chief():
      multihost.barrier("warm start")
      return hf_io.from_pretrained(model_dir, load_tokenizer=False)[0]
    if os.path.exists(model_dir):
      multihost.barrier("warm start")
      _say(f"warm start: reusing {model_dir}")
      return hf_io.from_pretrained(model_dir, load_tokenizer=False)[0]
    os.makedirs(directory, exist_ok=True)
    demos_path = os.path.join(directory, "demonstrations.jsonl")
    if not os.path.exists(demos_path):
      demos = self.task.demonstrations(self.task.train)
      with open(demos_path + ".tmp", "w") as f:
        f.writelines(json.dumps(d) + "\n" for d in demos)
      os.replace(demos_path + ".tmp", demos_path)
    with open(demos_path) as f:
      demos = [json.loads(line) for line in f]
    start = time.time()
    self.warm_start_losses = warm_start.train_on_demonstrations(
        actor, self.tokenizer, demos, self.config.warm_start, seed=self.config.seed, log=_say)
    _say(f"warm start: {len(self.warm_start_losses)} steps in {time.time() - start:.1f} s, final loss "
         f"{np.mean(self.warm_start_losses[-20:]):.4f}")
    _atomic_dir(model_dir, lambda tmp: hf_io.save_pretrained(actor, tmp, tokenizer=self.tokenizer))
    multihost.barrier("warm start")
    return actor

  def _start_pool(self) -> RolloutPool:
    c = self.config.rollout
    if self._pool_factory is not None:
      return self._pool_factory()
    _say(f"starting {len(c.addresses) or c.num_servers} rollout server(s)...")
    try:
      if c.addresses:
        return RolloutPool(addresses=list(c.addresses), max_in_flight=c.max_in_flight)
      # Servers start on the base weights as version -1; every version the learner
      # owns is pushed before anything is generated with it.
      return RolloutPool(self.base_checkpoint, num_servers=c.num_servers, max_in_flight=c.max_in_flight,
                         slots=c.slots, max_prefill_length=c.max_prefill_length, max_length=c.max_length,
                         ready_timeout_s=c.ready_timeout_s, log_dir=os.path.join(self.workdir, "logs"),
                         version=-1)
    except (TimeoutError, RuntimeError) as err:
      raise TrainingError(f"the rollout servers did not start: {err}\nCheck the server log above; "
                          f"config.rollout.max_prefill_length / max_length / slots must suit the model, "
                          f"and config.rollout.ready_timeout_s ({c.ready_timeout_s}) must cover compilation.") \
          from err

  # --- weights --------------------------------------------------------------------

  def _weights_dir(self, version: int) -> str:
    return os.path.join(self.workdir, "weights", f"v{version}")

  def _save_weights(self, version: int) -> None:
    """All processes call this (the weights may be sharded across them); the chief writes."""
    actor = self.learner.actor
    if self.processes > 1:    # a separate host copy: the learner's own arrays stay where they are
      params = multihost.fully_replicated_host_copy(nnx.state(actor, nnx.Param))
      actor = nnx.eval_shape(lambda: Decoder(actor.config, rngs=nnx.Rngs(0)))
      nnx.update(actor, params)
    if multihost.is_chief():
      _atomic_dir(self._weights_dir(version), lambda tmp: hf_io.save_pretrained(actor, tmp))
    multihost.barrier(f"weights v{version}")

  def _push(self, pool: RolloutPool, version: int) -> None:
    if self.server_version == version:
      return
    start = time.perf_counter()
    path = self._weights_dir(version)
    if version == self.step and not (self.cfg.mode == "lag" and os.path.exists(path)):
      self._save_weights(version)
    elif not os.path.exists(path):
      raise TrainingError(f"the weights of version {version} are gone from {path}; lag mode keeps the "
                          f"last `lag` versions there; do not delete them while a run can resume")
    if self.pushes_weights:
      pool.update_weights(path, version)
    multihost.barrier(f"push v{version}")      # nobody generates with version v before the servers have it
    self.server_version = version
    self.weight_sync_s += time.perf_counter() - start

  def _prune_weights(self) -> None:
    """Keep the versions a resume from the latest checkpoint can still push."""
    if not multihost.is_chief():
      return
    keep_from = self.step - (self.cfg.lag if self.cfg.mode == "lag" else 0)
    root = os.path.join(self.workdir, "weights")
    for name in os.listdir(root) if os.path.isdir(root) else []:
      if name.startswith("v") and name[1:].isdigit() and int(name[1:]) < keep_from \
          and int(name[1:]) != self.server_version:
        shutil.rmtree(os.path.join(root, name), ignore_errors=True)

  # --- steps ----------------------------------------------------------------------

  def _train_on(self, episodes: list[rollouts.Episode]) -> tuple[dict, float]:
    """One update on this process's episodes (its rows of the global batch); the row of metrics."""
    batch = to_batch([e.trajectory for e in episodes], length=self.config.rollout.max_length)
    start = time.perf_counter()
    metrics = jax.device_get(self.learner.train_step(batch, process_local=True))
    train_s = time.perf_counter() - start
    staleness = np.asarray(batch.staleness(self.step))[batch.mask]
    totals = multihost.sum_over_processes([
        len(episodes), sum(e.trajectory.reward for e in episodes), sum(e.correct for e in episodes),
        sum(sum(e.trajectory.mask) for e in episodes), sum(e.trajectory.num_turns for e in episodes),
        staleness.sum(), staleness.size])
    n, reward, correct, length, turns, stale_sum, stale_count = totals
    row = {
        "reward_mean": reward / n, "accuracy": correct / n, "response_len_mean": length / n,
        "turns_mean": turns / n,
        "staleness_mean": stale_sum / max(stale_count, 1),
        "staleness_max": int(multihost.max_over_processes(float(staleness.max()) if staleness.size else 0.0)),
        "mask_fraction": metrics["masked_fraction"], "clip_fraction": metrics["clip_fraction"],
        "ess": metrics["ess"], "value_loss": metrics["value_loss"], "grad_norm": metrics["actor_grad_norm"],
        "critic_grad_norm": metrics["critic_grad_norm"], "actor_loss": metrics["actor_loss"],
        "ratio_mean": metrics["ratio_mean"], "ratio_max": metrics["ratio_max"],
        "ratio_min": metrics["ratio_min"], "advantage_std": metrics["advantage_std"],
        "value_explained_variance": metrics["value_explained_variance"],
        "nonfinite_count": metrics["nonfinite_count"],
    }
    self.step += 1
    row.update(step=self.step, weights_version=self.step)
    return row, train_s

  def evaluate(self, pool: RolloutPool, runner: rollouts.EpisodeRunner, records: list[dict], *,
               latest: bool = True) -> dict:
    """Greedy accuracy on the held-out split, of the learner's weights (`latest`) or of those served.

    Servers only move forward in versions, so lag mode evaluates the weights it
    serves (version step − lag) until the end.
    """
    if latest:
      self._push(pool, self.step)
    if not multihost.is_chief():
      return {}
    episodes = rollouts.collect(runner, records, self.config.rollout.concurrency, greedy=True)
    return {"eval_accuracy": float(np.mean([e.correct for e in episodes])),
            "eval_reward": float(np.mean([e.trajectory.reward for e in episodes])),
            "eval_version": self.server_version}

  def _checkpoint(self, process_state: dict) -> None:
    """All processes: the learner state (orbax), and each process's data position and buffer."""
    self.record.update(step=self.step, version=self.step, processes=multihost.gather_json(process_state))
    self.checkpointer.save(self.step, self.learner.state, self.learner.rng, self.record)
    self._prune_weights()

  def _process_record(self) -> dict:
    processes = self.record.get("processes")
    return processes[jax.process_index()] if processes else {}

  # --- the run ----------------------------------------------------------------------

  def run(self) -> dict:
    """Train to `config.trainer.steps`; SIGTERM and Ctrl-C save a checkpoint before the run ends."""
    if threading.current_thread() is threading.main_thread():
      previous = signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
      try:
        return self._run()
      finally:
        signal.signal(signal.SIGTERM, previous)
    return self._run()

  def _run(self) -> dict:
    c, wall_start = self.cfg, time.time()
    pool = self._start_pool()
    logger = MetricsLogger(self.workdir, total_steps=c.steps, start_step=self.step,
                           progress=c.progress_bar) if multihost.is_chief() else NullLogger()
    runner = rollouts.EpisodeRunner(pool.generate, self.task, self.tokenizer, self.config.rollout)
    train = [r for r in self.task.train if runner.fits(r)]
    eval_records = [r for r in self.task.eval if runner.fits(r)]
    if not train:
      raise TrainingError(f"no training prompt fits config.rollout.max_prefill_length "
                          f"({self.config.rollout.max_prefill_length}); raise it")
    saved = self._process_record().get("data", {})
    iterator = data.PromptIterator(train, seed=self.config.seed, shard_index=jax.process_index(),
                                   shard_count=jax.process_count(), state=saved.get("iterator"))
    prompts = rollouts.PromptSource(iterator, saved.get("requeued"))
    collector, pending_row = None, None
    try:
      if self.resuming:
        logger.note(f"resumed from step {self.step} (weights version {self.step}) in {self.workdir}")
      else:
        evaluation = self.evaluate(pool, runner, eval_records)
        if evaluation:
          self.record["initial_eval_accuracy"] = evaluation["eval_accuracy"]
          logger.write({"step": 0, **evaluation})
          logger.note(f"eval accuracy before RL: {evaluation['eval_accuracy']:.3f}")
      if c.mode == "async":
        collector = self._start_collector(pool, runner, prompts)
      while self.step < c.steps:
        step_start, self.weight_sync_s = time.perf_counter(), 0.0
        if c.mode == "async":
          episodes, _ = collector.take(self.local_batch_size, self.step)
        else:
          self._push(pool, max(0, self.step - c.lag) if c.mode == "lag" else self.step)
          episodes = rollouts.collect(runner, prompts.take(self.local_batch_size),
                                      self.config.rollout.concurrency)
        rollout_wait_s = time.perf_counter() - step_start - self.weight_sync_s
        row, train_s = self._train_on(episodes)
        pending_row = row             # logged even if what follows fails (the state is saved at this step)
        if c.mode == "lag":
          self._save_weights(self.step)       # pushed `lag` updates from now
        if collector is not None:
          collector.admission.on_update(self.local_batch_size)
          if self.step % c.sync_every == 0:
            self._push(pool, self.step)
        row.update(rollout_wait_s=rollout_wait_s, train_s=train_s, weight_sync_s=self.weight_sync_s,
                   step_time_s=time.perf_counter() - step_start)
        if collector is not None:
          row.update(buffer_size=len(collector.buffer), dropped_stale=collector.buffer.dropped)
        if (c.eval_every and self.step % c.eval_every == 0) or self.step == c.steps:
          row.update(self.evaluate(pool, runner, eval_records, latest=c.mode != "lag" or self.step == c.steps))
        logger.write(row)
        pending_row = None
        if self.step % c.checkpoint_every == 0 or self.step == c.steps:
          self._checkpoint(self._state(prompts, collector))
    except (KeyboardInterrupt, Exception) as err:
      if collector is not None:
        collector.request_stop()
      if pending_row is not None:
        logger.write(pending_row)
      self._checkpoint(self._state(prompts, collector))
      buffered = len(self._process_record().get("buffer", []))
      if isinstance(err, KeyboardInterrupt):
        raise
      raise TrainingError(
          f"training stopped at step {self.step}: {type(err).__name__}: {err}\nSaved: the learner state at "
          f"step {self.step} and {buffered} buffered episodes in {self.checkpointer.directory}. "
          f"{self._advice(err)} Then rerun the same command to resume.") from err
    finally:
      if collector is not None:
        collector.request_stop()
      pool.close()
      if collector is not None:
        collector.stop()
      logger.close()
    return self._summary(wall_start)

  def _start_collector(self, pool, runner, prompts) -> rollouts.AsyncCollector:
    c = self.cfg
    buffer = TrajectoryBuffer(c.max_staleness)
    for payload, oldest in self._process_record().get("buffer", []):
      buffer.put(rollouts.Episode.from_json(payload), oldest)
    admission = AdmissionControl(c.max_staleness, self.local_batch_size, learner_version=self.step,
                                 pending=len(buffer))
    self._push(pool, self.step)
    collector = rollouts.AsyncCollector(runner, prompts, admission, buffer,
                                        workers=self.config.rollout.concurrency,
                                        weights_version=lambda: self.server_version)
    collector.start()
    return collector

  def _state(self, prompts, collector) -> dict:
    if collector is not None:
      return collector.state()
    return {"data": prompts.state(), "buffer": []}

  @staticmethod
  def _advice(err: BaseException) -> str:
    if isinstance(err, PoolExhausted):
      return "Every rollout server is down: restart them (or check config.rollout.addresses)."
    return "Fix the cause above."

  def _summary(self, wall_start: float) -> dict:
    if not multihost.is_chief():
      return {"steps": self.step}
    rows = [r for r in read_metrics(self.workdir) if r.get("step", 0) >= 1]
    evals = [r["eval_accuracy"] for r in rows if r.get("eval_accuracy") is not None]
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


def run(config, workdir: str) -> dict:
  """The `train` job of `copc_jax.main`."""
  summary = Trainer(config, workdir).run()
  print("\n".join(["", "summary", *(f"  {k:<24}{v}" for k, v in summary.items())]), flush=True)
  return summary
