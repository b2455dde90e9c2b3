"""Against real JetStream servers: the sampling contract holds end to end, and sync/lag runs reproduce."""

import pytest
from test_trainer import make_config

from copc_jax.train import metrics, trainer

COMPARED = ("reward_mean", "accuracy", "response_len_mean", "turns_mean", "staleness_mean", "staleness_max",
            "mask_fraction", "ratio_max", "ratio_min", "value_loss", "grad_norm", "eval_accuracy",
            "eval_version")


def run_twice(tmp_path, **sections):
  config = make_config(**sections)
  runs = []
  for name in ("first", "second"):
    trainer.Trainer(trainer.build(config, str(tmp_path / name))).run()
    runs.append(metrics.read_metrics(str(tmp_path / name)))
  return runs


def projection(rows):
  return [{k: row[k] for k in ("step", *COMPARED) if k in row} for row in rows]


@pytest.mark.slow
def test_sync_run_at_truncated_sampling_is_on_policy_and_reproducible(tmp_path):
  """Temperature 0.7, top-p 0.9, top-k 20: the learner's π equals the servers' μ, and two runs agree."""
  first, second = run_twice(
      tmp_path, trainer=dict(mode="sync", steps=3, eval_every=3),
      rollout=dict(num_servers=2, slots=4, max_in_flight=4, temperature=0.7, top_p=0.9, top_k=20))
  for row in first[1:]:
    assert abs(row["ratio_max"] - 1) <= 1e-4 and abs(row["ratio_min"] - 1) <= 1e-4, row
    assert row["mask_fraction"] == 0 and row["nonfinite_count"] == 0, row
  assert projection(first) == projection(second)


@pytest.mark.slow
def test_lag_runs_reproduce_exactly(tmp_path):
  first, second = run_twice(tmp_path, trainer=dict(mode="lag", lag=2, steps=4, eval_every=2),
                            rollout=dict(num_servers=2, slots=4, max_in_flight=4))
  assert [r["step"] for r in first] == [0, 1, 2, 3, 4]
  assert [r["staleness_max"] for r in first[1:]] == [0, 1, 2, 2]
  assert projection(first) == projection(second)
