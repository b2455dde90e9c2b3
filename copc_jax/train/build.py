"""Everything a training run is made of, built before it runs; `Trainer(parts).run()` only loops.

    parts = build(config, workdir)                  # model, learner, task, checkpoint restored
    with parts.open() as live:                      # servers, weight store, batch source, evaluator, logger
      ...                                           # (what `Trainer.run` does)

`build` loads what needs no closing: the base checkpoint (a tiny one made in the workdir for
`model.checkpoint = "tiny"`), the actor and critic in their shards of the mesh, the tokenizer, the
task and the learner, and restores the latest checkpoint when there is one (the step, the learner
state, each process's data position and buffered episodes). `Parts.open` starts what must be closed,
in the order the run needs it: the rollout backend (JetStream servers or the in-process sampler),
checked against the rollout config; the metrics logger (the chief only); the episode runner, the
weight store, the batch source of the mode; and the evaluator, on a server of its own in lag mode.
`Live.close` closes them in the order that lets every thread stop.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys

import jax
from etils import epath
from flax import nnx

from copc_jax import sharding
from copc_jax.envs import data
from copc_jax.envs.tasks import make_task
from copc_jax.models import hf_io, tiny
from copc_jax.models.decoder import ValueModel
from copc_jax.rollout import auth
from copc_jax.rollout.in_process import InProcessBackend
from copc_jax.rollout.pool import RolloutPool
from copc_jax.rollout.protocol import RolloutBackend
from copc_jax.train import checkpoint, multihost, server_check
from copc_jax.train import workdir as workdir_lib
from copc_jax.train.batch_sources import make_batch_source
from copc_jax.train.episodes import EpisodeRunner, PromptSource
from copc_jax.train.evaluator import Evaluator
from copc_jax.train.learner import Learner
from copc_jax.train.metrics import MetricsLogger
from copc_jax.train.setup import learner_config
from copc_jax.train.timing import PhaseTimer
from copc_jax.train.weights import IN_PROCESS, WeightStore


class TrainingError(RuntimeError):
  """The run stopped; the message says what happened, what was saved and what to fix."""


def say(message: str) -> None:
  """A line on stderr from the chief process."""
  if multihost.is_chief():
    print(message, file=sys.stderr, flush=True)


class NullLogger:
  """Metrics of processes other than the chief go nowhere."""

  def write(self, metrics: dict) -> dict:
    return metrics

  def note(self, message: str) -> None:
    pass

  def sync(self) -> None:
    pass

  def close(self) -> None:
    pass


def tokenizer_dir(config, *checkpoints: str) -> str:
  """`config.model.tokenizer`, else the first of `checkpoints` that has tokenizer files (else the first)."""
  if config.model.tokenizer:
    return config.model.tokenizer
  return next((c for c in checkpoints if hf_io.has_tokenizer(c)), checkpoints[0])


def base_checkpoint(config, workdir: str) -> str:
  """The model RL starts from: `config.model.checkpoint`, or a tiny one built in the workdir (its
  scratch, for a remote workdir)."""
  source = config.model.checkpoint
  if source == "tiny":
    path = os.path.join(workdir_lib.scratch(workdir), "base")
    if multihost.is_chief() and not os.path.exists(path):
      checkpoint.write_atomically(path, lambda tmp: tiny.make_tiny_checkpoint(tmp, config.model.tiny_arch,
                                                                             seed=config.seed))
    multihost.barrier("base checkpoint")
    return path
  if not os.path.isfile(os.path.join(source, "config.json")):
    raise FileNotFoundError(f"config.model.checkpoint: no Hugging Face checkpoint at {source!r} (expected "
                            f"config.json and *.safetensors there); give a local directory, or 'tiny'")
  return source


def make_mesh(config):
  """The learner's mesh; its data × fsdp shards must divide every gradient-accumulation group."""
  c = config.trainer
  mesh = sharding.make_mesh(config.sharding)
  shards = mesh.shape["data"] * mesh.shape["fsdp"]
  group_rows = c.batch_size // c.num_minibatches // c.gradient_accumulation
  if group_rows % shards:
    raise ValueError(f"config.trainer.batch_size ({c.batch_size}) / num_minibatches ({c.num_minibatches}) / "
                     f"gradient_accumulation ({c.gradient_accumulation}) must be divisible by the {shards} "
                     f"data x fsdp shards of the mesh {dict(mesh.shape)}")
  return mesh


@dataclasses.dataclass
class Parts:
  """A run's model, learner, task and saved position; `open()` starts what it trains with."""

  config: object
  workdir: str
  base_checkpoint: str
  tokenizer: object
  task: object
  learner: Learner
  checkpointer: checkpoint.Checkpointer
  backend_factory: object          # (evaluation: bool = False) -> RolloutBackend
  step: int = 0
  record: dict = dataclasses.field(default_factory=dict)    # what the checkpoint keeps besides arrays
  resuming: bool = False
  timer: PhaseTimer = dataclasses.field(default_factory=PhaseTimer)

  @property
  def processes(self) -> int:
    return jax.process_count()

  @property
  def local_batch_size(self) -> int:
    return self.config.trainer.batch_size // self.processes

  def stopped_state_path(self) -> str:
    """Where a process of a multi-process run saves its data position when the run stops on an error."""
    return os.path.join(self.checkpointer.directory, f"stopped_process_{jax.process_index()}.json")

  def process_record(self) -> dict:
    processes = self.record.get("processes")
    return processes[jax.process_index()] if processes else {}

  def check_servers(self, backend) -> None:
    """Servers must fit the rollout config's lengths and serve the learner's model (`server_check`)."""
    try:
      server_check.check_servers(backend.status(), self.config.rollout, self.learner.actor.config)
    except server_check.ServerMismatch as err:
      raise TrainingError(str(err)) from err

  def runner(self, backend) -> EpisodeRunner:
    return EpisodeRunner(backend.generate if backend else None, self.task, self.tokenizer, self.config.rollout,
                         seed=(self.config.seed, jax.process_index()))

  def weight_store(self, backend, *, pushes: bool = True) -> WeightStore:
    """How pushed versions travel: as arrays to an in-process backend, else config.rollout.weight_transfer."""
    rollout = self.config.rollout
    transfer = IN_PROCESS if rollout.backend == "in_process" else rollout.weight_transfer
    return WeightStore(os.path.join(workdir_lib.scratch(self.workdir), "weights"), backend, pushes=pushes,
                       transfer=transfer)

  def open(self) -> Live:
    """Start the backend(s), weight store, batch source, evaluator and logger (closed by `Live.close`)."""
    live = Live()
    try:
      live.backend = live.opens(self.backend_factory())
      self.check_servers(live.backend)
      if multihost.is_chief():
        c = self.config.trainer
        resolved = json.loads(json.dumps(dataclasses.asdict(self.config), default=str))
        live.logger = MetricsLogger(self.workdir, total_steps=c.steps, start_step=self.step,
                                    progress=c.progress_bar, trackers=c.trackers, wandb_project=c.wandb_project,
                                    run_config=resolved)
      runner = self.runner(live.backend)
      weights = live.opens(self.weight_store(live.backend,
                                             pushes=not self.config.rollout.addresses or multihost.is_chief()))
      saved = self.process_record()
      live.source = make_batch_source(self.config.trainer, runner, self._prompts(runner, saved.get("data", {})),
                                      weights, lambda: self.learner.actor, self.timer,
                                      batch_size=self.local_batch_size, buffered=saved.get("buffer", []))
      live.evaluator = self._evaluator(live, runner, weights)
    except BaseException:
      live.close()
      raise
    return live

  def _prompts(self, runner, saved: dict) -> PromptSource:
    train = [r for r in self.task.train if runner.fits(r)]
    if not train:
      raise TrainingError(f"no training prompt fits config.rollout.max_prefill_length "
                          f"({self.config.rollout.max_prefill_length}); raise it")
    iterator = data.PromptIterator(train, seed=self.config.seed, shard_index=jax.process_index(),
                                   shard_count=self.processes, state=saved.get("iterator"))
    return PromptSource(iterator, saved.get("requeued"), saved.get("draws", 0),
                        group_size=self.config.trainer.group_size)

  def _evaluator(self, live, runner, weights) -> Evaluator:
    """Greedy evaluation of the learner's current weights: on the training servers where they can
    take them, else (lag mode) on a dedicated evaluation server started for it."""
    records = [r for r in self.task.eval if runner.fits(r)]
    concurrency = self.config.rollout.concurrency
    if live.source.serves_the_learner:
      return Evaluator(runner, records, weights, concurrency)
    backend = live.opens(self.backend_factory(evaluation=True)) if multihost.is_chief() else None
    if backend is not None:
      self.check_servers(backend)
    eval_runner = EpisodeRunner(backend.generate if backend else None, self.task, self.tokenizer,
                                self.config.rollout, seed=runner.seed)
    eval_weights = live.opens(WeightStore(weights.directory, backend, pushes=backend is not None,
                                          transfer=weights.transfer))
    return Evaluator(eval_runner, records, eval_weights, concurrency)


@dataclasses.dataclass
class Live:
  """What a run trains with while it runs; `close` stops the source's threads, then closes the rest."""

  backend: RolloutBackend | None = None
  source: object = None
  evaluator: Evaluator | None = None
  logger: object = dataclasses.field(default_factory=NullLogger)
  opened: list = dataclasses.field(default_factory=list)      # backends and weight stores, closed in order

  def opens(self, thing):
    self.opened.append(thing)
    return thing

  def close(self) -> None:
    if self.source is not None:
      self.source.request_stop()
    for each in self.opened:
      each.close()
    if self.source is not None:
      self.source.stop()
    self.logger.close()

  def __enter__(self) -> Live:
    return self

  def __exit__(self, *exc) -> None:
    self.close()


def build(config, workdir: str, *, actor_checkpoint: str | None = None, task=None,
          backend_factory=None) -> Parts:
  """The parts of a run in `workdir`, its latest checkpoint restored if it has one.

  `actor_checkpoint` is where a fresh run's actor starts (the base model, or a warm start's result: see
  `trainer.train_and_evaluate`); `task` replaces the config's task; `backend_factory(evaluation=False)`
  replaces the rollout backend the config names (tests only).
  """
  workdir = workdir_lib.resolve(workdir)
  if workdir_lib.is_remote(workdir) and config.rollout.addresses and config.rollout.weight_transfer == "path":
    raise ValueError(f"config.rollout.weight_transfer = 'path' has remote servers read weight files from the "
                     f"workdir, but {workdir} keeps them in this host's scratch: use 'stream'")
  epath.Path(workdir).mkdir(parents=True, exist_ok=True)
  os.makedirs(workdir_lib.scratch(workdir), exist_ok=True)
  processes = jax.process_count()
  if config.trainer.batch_size % processes:
    raise ValueError(f"config.trainer.batch_size ({config.trainer.batch_size}) must be divisible by the "
                     f"{processes} learner processes")
  base = base_checkpoint(config, workdir)
  mesh = make_mesh(config)
  actor, _ = hf_io.from_pretrained(actor_checkpoint or base, load_tokenizer=False, mesh=mesh,
                                   rules=config.sharding.rules,          # each tensor straight into its shards
                                   **config.model.compute_options())
  tokenizer = hf_io.load_tokenizer(tokenizer_dir(config, *filter(None, (actor_checkpoint, base))),
                                   needed_for="the trainer (prompts, tool outputs and answers are text)")
  critic = ValueModel.from_policy(actor, rngs=nnx.Rngs(config.seed + 1))
  learner = Learner(actor, critic, learner_config(config), mesh=mesh, rules=config.sharding.rules,
                    seed=config.seed)
  parts = Parts(config, workdir, base, tokenizer, task or make_task(config.task, config.seed, tokenizer),
                learner, checkpoint.Checkpointer(os.path.join(workdir, "checkpoints")), backend_factory=None)
  parts.backend_factory = backend_factory or (lambda evaluation=False: start_backend(parts, evaluation))
  if parts.checkpointer.latest_step() is not None:
    restore(parts)
  return parts


def restore(parts: Parts) -> None:
  """The latest checkpoint into `parts`: step, learner state and RNG, and each process's record."""
  learner = parts.learner
  parts.step, learner.state, learner.rng, parts.record = parts.checkpointer.restore_latest(
      learner.state, learner.rng, log=say)
  parts.resuming = True
  saved_processes = len(parts.record.get("processes", []))
  if saved_processes != parts.processes:
    raise ValueError(f"the checkpoint in {parts.checkpointer.directory} was written by {saved_processes} "
                     f"learner processes; resume it with the same number (this run has {parts.processes})")
  stopped = epath.Path(parts.stopped_state_path())
  if stopped.exists():              # saved by this process when a multi-process run stopped on an error
    parts.record["processes"][jax.process_index()] = json.loads(stopped.read_text())


def start_backend(parts: Parts, evaluation: bool = False) -> RolloutBackend:
  """The training servers, or (`evaluation`) one server that evaluates the learner's weights; or,
  with `rollout.backend = "in_process"`, a generator in this process on the learner's devices."""
  c = parts.config.rollout
  if c.backend == "in_process":
    try:
      return InProcessBackend(parts.learner.actor, slots=c.slots, max_prefill_length=c.max_prefill_length,
                              max_length=c.max_length, steps_per_call=c.in_process_steps, version=-1,
                              mesh=parts.learner.mesh)
    except ValueError as err:
      raise TrainingError(f"config.rollout: {err}") from err
  addresses = c.eval_addresses if evaluation else c.addresses
  if evaluation and c.addresses and not addresses:
    raise TrainingError("lag mode evaluates the learner's current weights on a server of its own: with "
                        "remote servers, give one in config.rollout.eval_addresses (or eval_every = 0)")
  count = len(addresses) or (1 if evaluation else c.num_servers)
  say(f"starting {count} {'evaluation' if evaluation else 'rollout'} server(s)...")
  logs = os.path.join(workdir_lib.scratch(parts.workdir), "logs", "eval" if evaluation else "")
  try:
    common = dict(stall_timeout_s=c.stall_timeout_s, probe_timeout_s=c.probe_timeout_s,
                  lost_timeout_s=c.lost_timeout_s, push_timeout_s=c.push_timeout_s)
    if addresses:
      return RolloutPool(addresses=list(addresses), max_in_flight=c.max_in_flight,
                         token=auth.resolve_token(c.auth_token_file),
                         tls_root_certificates=c.tls_root_certificates, **common)
    # Servers start on the base weights as version -1; every version the learner
    # owns is pushed before anything is generated with it.
    return RolloutPool(parts.base_checkpoint, num_servers=count, max_in_flight=c.max_in_flight,
                       slots=c.slots, max_prefill_length=c.max_prefill_length, max_length=c.max_length,
                       platform=c.server_platform, tensor_parallelism=c.server_tensor_parallelism,
                       data_parallelism=c.server_data_parallelism, decode_steps=c.server_decode_steps,
                       dtype=c.server_dtype, ready_timeout_s=c.ready_timeout_s, **common,
                       log_dir=logs, version=-1)
  except (TimeoutError, RuntimeError) as err:
    raise TrainingError(f"the rollout servers did not start: {err}\nCheck the server log above; "
                        f"config.rollout.max_prefill_length / max_length / slots must suit the model, "
                        f"and config.rollout.ready_timeout_s ({c.ready_timeout_s}) must cover compilation.") \
        from err


@contextlib.contextmanager
def sampling(parts: Parts):
  """(runner, weights) on a backend of `parts` with the learner's weights pushed as version 0: the start
  policy sampled as training samples it (the dry run); everything is closed on exit."""
  backend = parts.backend_factory()
  try:
    parts.check_servers(backend)
    weights = parts.weight_store(backend)
    try:
      weights.push(0, parts.learner.actor)
      yield parts.runner(backend), weights
    finally:
      weights.close()
  finally:
    backend.close()
