"""The trainer with `rollout.backend = "in_process"`: no servers, the learner's own devices, the same
sampling contract (sync mode's ratios are 1) and version bookkeeping as with the JetStream pool."""

import pytest
from test_trainer import make_config

from copc_jax.train import metrics, trainer


@pytest.mark.parametrize("mode", ["sync", "lag"])
def test_in_process_rollouts_train_with_exact_versions(tmp_path, mode):
  config = make_config(rollout=dict(backend="in_process", in_process_steps=8),
                       trainer=dict(mode=mode, lag=2, steps=3, eval_every=3, checkpoint_every=100))
  summary = trainer.Trainer(trainer.build(config, str(tmp_path))).run()
  rows = metrics.read_metrics(str(tmp_path))
  updates = metrics.update_rows(rows)
  assert [r["step"] for r in updates] == [1, 2, 3] and summary["final_eval_accuracy"] is not None
  assert not (tmp_path / "logs").exists()                       # no server was started
  if mode == "sync":     # every token sampled by the weights being trained: ratios 1 up to float error
    assert all(r["staleness_max"] == 0 for r in updates)
    assert all(abs(r["ratio_min"] - 1) < 1e-3 and abs(r["ratio_max"] - 1) < 1e-3 for r in updates)
  else:                  # the first `lag` updates train on the start's data, then on weights 2 updates old
    assert [r["staleness_max"] for r in updates] == [0, 1, 2]
