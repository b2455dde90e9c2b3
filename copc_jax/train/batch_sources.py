"""Where each update's episodes come from, one class per mode, behind one small interface.

    source = make_batch_source(trainer_config, ...)
    source.start(step)                   # before the first batch (async: starts the workers)
    episodes = source.next_batch(step)   # the episodes of update `step` (this process's share)
    source.after_update(step + 1)        # the learner is at version step + 1
    source.state()                       # data position and buffered episodes, for the checkpoint

| mode  | batch of update v generated with   | weights pushed                     |
| ----- | ---------------------------------- | ---------------------------------- |
| sync  | version v (staleness 0)            | v, before the batch                |
| lag   | version max(0, v − lag), exactly   | that version; every v is kept      |
| async | whatever the servers hold (≤ η old)| every `sync_every` updates         |

`sync` and `lag` are reproducible (episodes are collected in prompt order with
per-episode seeds); `async` is not: which version an episode sees depends on
how the rollouts race the learner.
"""

from __future__ import annotations

from collections.abc import Callable

from copc_jax.models.decoder import Decoder
from copc_jax.train.episodes import (
  AsyncCollector,
  Episode,
  EpisodeRunner,
  PromptSource,
  units_from_json,
  units_to_json,
)
from copc_jax.train.episodes import collect as collect_episodes
from copc_jax.train.staleness import AdmissionControl, TrajectoryBuffer
from copc_jax.train.timing import PhaseTimer
from copc_jax.train.weights import WeightStore


class SyncSource:
  """sync: push version v, then generate the batch of update v with it."""

  def __init__(self, runner: EpisodeRunner, prompts: PromptSource, weights: WeightStore,
               actor: Callable[[], Decoder], timer: PhaseTimer, *, batch_size: int, workers: int):
    self.runner, self.prompts, self.weights, self.actor, self.timer = runner, prompts, weights, actor, timer
    self.batch_size, self.workers = batch_size, workers

  def version_for(self, step: int) -> int:
    return step

  def start(self, step: int) -> None:
    pass

  def next_batch(self, step: int) -> list[Episode]:
    version = self.version_for(step)
    with self.timer("weight_sync_s"):
      self.weights.push(version, self.actor() if version == step else None)
    return collect_episodes(self.runner, self.prompts.take(self.batch_size), self.workers)

  def after_update(self, step: int) -> None:
    pass

  @property
  def serves_the_learner(self) -> bool:
    """Whether the training servers can take the learner's current weights at any update.

    Not in lag mode (they serve version v − lag and only move forward): evaluations
    there go to a dedicated evaluation server.
    """
    return True

  def keep_versions_from(self, step: int) -> int:
    """The oldest weight version a resume from `step` may still push."""
    return step

  def metrics(self) -> dict:
    return {}

  def state(self) -> dict:
    return {"data": self.prompts.state(), "buffer": []}

  def request_stop(self) -> None:
    pass

  def stop(self) -> None:
    pass


class LagSource(SyncSource):
  """lag: the batch of update v is generated with version max(0, v − lag); every version is saved."""

  def __init__(self, *args, lag: int, **kwargs):
    super().__init__(*args, **kwargs)
    self.lag = lag

  def version_for(self, step: int) -> int:
    return max(0, step - self.lag)

  def after_update(self, step: int) -> None:
    if self.lag:
      self.weights.save(step, self.actor())      # pushed `lag` updates from now

  @property
  def serves_the_learner(self) -> bool:
    return self.lag == 0

  def keep_versions_from(self, step: int) -> int:
    return step - self.lag


class AsyncSource(SyncSource):
  """async: workers keep episodes running under admission control; weights pushed every `sync_every`."""

  def __init__(self, *args, max_staleness: int, sync_every: int, buffered: list = (), **kwargs):
    super().__init__(*args, **kwargs)
    self.sync_every = sync_every
    self.buffer = TrajectoryBuffer(max_staleness)
    for unit, oldest in units_from_json(buffered):
      self.buffer.put(unit, oldest)
    self.max_staleness = max_staleness
    self.collector: AsyncCollector | None = None

  def start(self, step: int) -> None:
    admission = AdmissionControl(self.max_staleness, self.units, learner_version=step,
                                 pending=len(self.buffer))
    self.weights.push(step, self.actor())
    self.collector = AsyncCollector(self.runner, self.prompts, admission, self.buffer,
                                             workers=self.workers, weights_version=lambda: self.weights.served)
    self.collector.start()

  @property
  def units(self) -> int:
    """Groups per batch: the async unit (one episode without groups)."""
    return self.batch_size // self.prompts.group_size

  def next_batch(self, step: int) -> list[Episode]:
    return [episode for unit in self.collector.take(self.units, step)[0] for episode in unit]

  def after_update(self, step: int) -> None:
    self.collector.admission.on_update(self.units)
    if step % self.sync_every == 0:
      self.weights.push(step, self.actor())
      self.collector.admission.wake()

  def metrics(self) -> dict:
    return {"buffer_size": len(self.buffer), "dropped_stale": self.buffer.dropped}

  def state(self) -> dict:
    if self.collector is None:
      return {"data": self.prompts.state(), "buffer": units_to_json(self.buffer.items())}
    return self.collector.state()

  def request_stop(self) -> None:
    if self.collector is not None:
      self.collector.request_stop()

  def stop(self) -> None:
    if self.collector is not None:
      self.collector.stop()


def make_batch_source(config, runner, prompts, weights, actor, timer, *, batch_size: int,
                      buffered: list = ()) -> SyncSource:
  """The source of `config.mode` (a `TrainerConfig`)."""
  common = dict(batch_size=batch_size, workers=runner.config.concurrency)
  args = (runner, prompts, weights, actor, timer)
  if config.mode == "sync":
    return SyncSource(*args, **common)
  if config.mode == "lag":
    return LagSource(*args, lag=config.lag, **common)
  return AsyncSource(*args, max_staleness=config.max_staleness, sync_every=config.sync_every,
                     buffered=buffered, **common)
