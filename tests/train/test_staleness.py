import random
import threading

import pytest

from copc_jax.train.staleness import AdmissionControl, TrajectoryBuffer


def simulate(eta, batch, in_order, seed, steps=200):
  """Rollouts start at the current version, finish (in order or not), are consumed in batches."""
  rng = random.Random(seed)
  control = AdmissionControl(max_staleness=eta, batch_size=batch)
  buffer = TrajectoryBuffer(max_staleness=eta)
  in_flight, staleness_seen = [], []
  for _ in range(steps):
    while control.try_start():
      in_flight.append(control.learner_version)
    if not in_order:
      rng.shuffle(in_flight)
    finished = rng.randint(1, len(in_flight)) if in_flight else 0
    for version in in_flight[:finished]:
      buffer.put(object(), oldest_version=version)
    in_flight = in_flight[finished:]
    dropped_before = buffer.dropped
    taken = buffer.take(batch, control.learner_version, timeout_s=0)
    control.on_dropped(buffer.dropped - dropped_before)
    if taken is not None:
      staleness_seen += taken[1]
      control.on_update(batch)
  return staleness_seen, buffer.dropped


@pytest.mark.parametrize("eta, batch", [(0, 4), (1, 4), (3, 2), (8, 1)])
def test_in_order_rollouts_are_all_used_and_never_too_stale(eta, batch):
  staleness, dropped = simulate(eta, batch, in_order=True, seed=eta * 10 + batch)
  assert staleness and max(staleness) <= eta and dropped == 0
  assert eta == 0 or max(staleness) > 0


@pytest.mark.parametrize("eta, batch", [(1, 4), (3, 2)])
def test_out_of_order_rollouts_are_never_trained_on_too_stale(eta, batch):
  staleness, _ = simulate(eta, batch, in_order=False, seed=7)
  assert staleness and max(staleness) <= eta


def test_sync_mode_admits_exactly_one_batch_per_version():
  control = AdmissionControl(max_staleness=0, batch_size=4)
  assert sum(control.try_start() for _ in range(10)) == 4
  control.on_update(4)
  assert sum(control.try_start() for _ in range(10)) == 4


def test_buffer_drops_what_became_too_stale_and_waits_for_enough():
  buffer = TrajectoryBuffer(max_staleness=2)
  for version in (0, 1, 3, 4):
    buffer.put(f"t{version}", oldest_version=version)
  trajectories, staleness = buffer.take(2, learner_version=4)
  assert trajectories == ["t3", "t4"] and staleness == [1, 0] and buffer.dropped == 2
  assert buffer.take(1, learner_version=4, timeout_s=0.05) is None
  threading.Timer(0.05, lambda: buffer.put("t5", 5)).start()
  assert buffer.take(1, learner_version=5, timeout_s=5) == (["t5"], [0])


def test_bad_settings_are_refused():
  with pytest.raises(ValueError, match="max_staleness must be >= 0"):
    AdmissionControl(max_staleness=-1, batch_size=2)
  with pytest.raises(ValueError, match="consumed 3 rollouts but only 0"):
    AdmissionControl(max_staleness=1, batch_size=2).on_update(3)
