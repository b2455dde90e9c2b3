"""Staleness accounting for asynchronous training: admission control and a bounded buffer.

Staleness of a token = learner version at the update that uses it − version
that sampled it. With a bound η (`max_staleness`):

- `AdmissionControl.try_start()` admits a new rollout only if, counting the
  rollouts already in flight or buffered ahead of it, it will be consumed by an
  update at most η versions after the version it starts with;
- `TrajectoryBuffer.take(n, learner_version)` hands out trajectories in arrival order
  and never one whose oldest token is more than η versions behind; such a
  trajectory (one that finished late, out of order) is dropped and counted.
"""

from __future__ import annotations

import collections
import dataclasses
import threading


@dataclasses.dataclass
class AdmissionControl:
  """Decides whether a rollout may start now; one version step per `batch_size` trajectories."""

  max_staleness: int
  batch_size: int
  learner_version: int = 0
  pending: int = 0            # started (in flight or buffered), not yet consumed

  def __post_init__(self):
    if self.max_staleness < 0 or self.batch_size < 1:
      raise ValueError(f"max_staleness must be >= 0 and batch_size >= 1; got {self.max_staleness}, "
                       f"{self.batch_size}")
    self._cond = threading.Condition()

  def consumed_at(self, position: int) -> int:
    """Learner version of the update that will consume the `position`-th pending rollout (0-based)."""
    return self.learner_version + position // self.batch_size

  def try_start(self, weights_version: int | None = None) -> bool:
    """Admit one more rollout if it will not be too stale when consumed.

    `weights_version` is the version the rollout starts with (the servers'; by
    default the learner's, as when weights are pushed after every update).
    """
    start = self.learner_version if weights_version is None else weights_version
    with self._cond:
      if self.consumed_at(self.pending) - start > self.max_staleness:
        return False
      self.pending += 1
      return True

  def wait_to_start(self, weights_version, stopped: threading.Event) -> bool:
    """Block until a rollout is admitted (True) or `stopped` is set (False).

    `weights_version()` is read each time the state changes: after an update, a
    drop, or `wake()` (a weight push, a stop request).
    """
    with self._cond:
      while not stopped.is_set():
        if self.try_start(weights_version()):
          return True
        self._cond.wait()
      return False

  def wake(self) -> None:
    """Waiting rollouts look again (the servers' version changed, or the run is stopping)."""
    with self._cond:
      self._cond.notify_all()

  def on_update(self, consumed: int) -> None:
    """The learner consumed `consumed` rollouts and moved to the next version."""
    with self._cond:
      if consumed > self.pending:
        raise ValueError(f"consumed {consumed} rollouts but only {self.pending} were started")
      self.pending -= consumed
      self.learner_version += 1
      self._cond.notify_all()

  def on_dropped(self, count: int = 1) -> None:
    with self._cond:
      self.pending -= count
      self._cond.notify_all()


@dataclasses.dataclass
class BufferedTrajectory:
  trajectory: object
  oldest_version: int


class TrajectoryBuffer:
  """FIFO of finished rollouts; `take` enforces the staleness bound and records what it saw."""

  def __init__(self, max_staleness: int):
    if max_staleness < 0:
      raise ValueError(f"max_staleness must be >= 0; got {max_staleness}")
    self.max_staleness = max_staleness
    self._items: collections.deque[BufferedTrajectory] = collections.deque()
    self._cond = threading.Condition()
    self.dropped = 0
    self.error: BaseException | None = None

  def __len__(self) -> int:
    return len(self._items)

  def items(self) -> list[tuple[object, int]]:
    """(trajectory, oldest version) of everything buffered, oldest first (for checkpoints)."""
    with self._cond:
      return [(i.trajectory, i.oldest_version) for i in self._items]

  def put(self, trajectory, oldest_version: int) -> None:
    with self._cond:
      self._items.append(BufferedTrajectory(trajectory, oldest_version))
      self._cond.notify_all()

  def fail(self, error: BaseException) -> None:
    """A producer failed: `take` raises `error` (now, or as soon as it waits)."""
    with self._cond:
      self.error = self.error or error
      self._cond.notify_all()

  def take(self, n: int, learner_version: int, timeout_s: float | None = None):
    """`n` trajectories at most η versions old (in arrival order) and their staleness; None on timeout.

    Raises the error given to `fail`, if any, instead of waiting.
    """
    with self._cond:
      while True:
        if self.error is not None:
          raise self.error
        fresh = [i for i in self._items if learner_version - i.oldest_version <= self.max_staleness]
        self.dropped += len(self._items) - len(fresh)   # rollouts that finished out of order, too late
        self._items = collections.deque(fresh)
        if len(self._items) >= n:
          items = [self._items.popleft() for _ in range(n)]
          return [i.trajectory for i in items], [learner_version - i.oldest_version for i in items]
        if not self._cond.wait(timeout_s):
          return None
