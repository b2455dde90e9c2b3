"""The trainer's bookkeeping with the in-process `ScriptedPool` (the real servers: test_trainer_e2e.py)."""

import json

import numpy as np
import pytest
from scripted_pool import ScriptedPool

from configs import common
from copc_jax import config as config_lib
from copc_jax import presets
from copc_jax.envs.tasks import make_task
from copc_jax.models import tiny
from copc_jax.train import metrics, trainer
from copc_jax.train.setup import TrainerConfig


def make_config(preset="copc", **sections):
  raw = common.train_config(preset)
  raw.task.system_prompt = False
  raw.task.train_size, raw.task.eval_size = 64, 8
  raw.rollout.update(dict(max_tokens_per_turn=8, max_turns=2, max_prefill_length=64, max_length=96,
                          num_servers=1, max_in_flight=4))
  raw.trainer.update(dict(steps=4, batch_size=8, checkpoint_every=2, eval_every=2, progress_bar=False,
                          actor_learning_rate=1e-3, critic_warmup_steps=0, num_minibatches=1))
  for section, values in sections.items():
    raw[section].update(values)
  return config_lib.from_config_dict(raw)


def scripted_pool_factory(pools, **kwargs):
  tokenizer = tiny.make_tokenizer()
  end = tokenizer.encode("</code>", add_special_tokens=False)

  def factory(evaluation=False):
    pool = ScriptedPool(len(tokenizer), tool_call_end=end, seed=len(pools), **kwargs)
    pools.append(pool)
    return pool
  return factory


def train(config, workdir, **kwargs):
  pools = []
  parts = trainer.build(config, str(workdir), backend_factory=scripted_pool_factory(pools, **kwargs))
  summary = trainer.Trainer(parts).run()
  return summary, pools, metrics.read_metrics(str(workdir))


def test_sync_mode_trains_on_fresh_weights_and_logs_every_metric(tmp_path):
  summary, (pool,), rows = train(make_config(trainer=dict(mode="sync")), tmp_path)
  steps = [r for r in rows if r["step"] >= 1]
  assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
  for row in steps:
    assert set(metrics.REQUIRED_KEYS) <= set(row), set(metrics.REQUIRED_KEYS) - set(row)
    assert row["staleness_max"] == 0 and row["weights_version"] == row["step"]
  assert [r["step"] for r in rows if "eval_accuracy" in r] == [0, 2, 4]
  assert pool.pushes == [0, 1, 2, 3, 4]
  assert summary["steps"] == 4 and (tmp_path / "summary.json").exists()
  assert list((tmp_path / "tb").iterdir())                          # TensorBoard event file


@pytest.mark.parametrize("lag", [1, 3])
def test_lag_mode_trains_on_weights_exactly_lag_versions_old(tmp_path, lag):
  _, (pool, eval_pool), rows = train(make_config(trainer=dict(mode="lag", lag=lag, steps=6, eval_every=2)),
                                     tmp_path)
  for row in rows[1:]:
    expected = min(row["step"] - 1, lag)
    assert row["staleness_max"] == expected and row["staleness_mean"] == expected
  assert pool.pushes == sorted(set(pool.pushes)) and max(pool.pushes) == 5 - lag  # batch 6: version 5 − lag
  # Evaluations measure the learner's current weights, on a server of their own.
  evaluated = [(r["step"], r["eval_version"]) for r in rows if "eval_version" in r]
  assert evaluated == [(0, 0), (2, 2), (4, 4), (6, 6)]
  assert eval_pool.pushes == [0, 2, 4, 6]


def test_async_mode_respects_the_staleness_bound(tmp_path):
  config = make_config(trainer=dict(mode="async", max_staleness=2, steps=8, eval_every=0))
  _, _, rows = train(config, tmp_path, delay_s=0.01)
  assert max(r["staleness_max"] for r in rows[1:]) <= 2
  assert max(r["staleness_max"] for r in rows[1:]) >= 1                # it did overlap
  assert all("buffer_size" in r for r in rows[1:])


# One name per distinct preset: an alias (`mis` is `icepop`) runs the same code.
DISTINCT_PRESETS = presets.DISTINCT


@pytest.mark.parametrize("mode", ["sync", "async", "lag"])
@pytest.mark.parametrize("preset", DISTINCT_PRESETS)
def test_every_preset_runs_in_every_mode(tmp_path, preset, mode):
  if preset == "sync_ppo" and mode != "sync":
    with pytest.raises(ValueError, match="preset 'sync_ppo' is defined by staleness 0 and runs only in mode"):
      make_config(preset, trainer=dict(mode=mode))
    return
  config = make_config(preset, trainer=dict(mode=mode, lag=1, steps=2, eval_every=0, checkpoint_every=2))
  _, _, rows = train(config, tmp_path)
  assert [r["step"] for r in rows] == [0, 1, 2]
  assert all(r["value_loss"] is not None and r["grad_norm"] is not None for r in rows[1:])
  for key in ("advantage_raw_mean", "advantage_raw_std", "advantage_raw_min", "advantage_raw_max",
              "returns_mean", "value_explained_variance", "kl_behavior", "ratio_p99", "ratio_min",
              "ratio_max", "entropy", "clip_fraction", "mask_fraction", "inside_first_lag"):
    assert all(key in r for r in rows[1:]), key


@pytest.mark.parametrize("mode", ["sync", "async", "lag"])
def test_group_presets_train_on_whole_groups(tmp_path, mode, monkeypatch):
  """grpo with 4 samples per prompt: every batch holds whole groups of one prompt each, and the
  advantages the learner used are the group-normalised rewards (mean 0 within a group)."""
  from copc_jax.train.learner import Learner
  seen = []
  real_step = Learner.train_step

  def recording(self, batch, **kwargs):
    seen.append((np.asarray(batch.group_ids)[:, 0], np.asarray(batch.tokens)))
    return real_step(self, batch, **kwargs)

  monkeypatch.setattr(Learner, "train_step", recording)
  config = make_config("grpo", trainer=dict(mode=mode, lag=1, steps=3, eval_every=0, checkpoint_every=3))
  assert config.trainer.group_size == 4 and config.estimator.group_method == "grpo"
  _, _, rows = train(config, tmp_path)
  assert [r["step"] for r in rows if "reward_mean" in r] == [1, 2, 3]
  for groups, tokens in seen:
    ids, counts = np.unique(groups, return_counts=True)
    assert len(ids) == 2 and (counts == 4).all()                  # batch 8 = 2 prompts × 4 samples
    for g in ids:                                                 # the samples of a group share the prompt
      prompts = tokens[groups == g][:, :4]
      assert (prompts == prompts[0]).all()


def test_group_presets_refuse_groups_of_one():
  with pytest.raises(ValueError, match="config.trainer.group_size: preset 'rloo' compares the samples"):
    make_config("rloo", trainer=dict(group_size=1))


def test_critic_warm_up_moves_only_the_critic_then_checkpoints_step_zero(tmp_path):
  """critic_warmup_steps value-only updates on the start policy's rollouts: the actor is the warm start's
  at update 1 (its rows are at version 0), each warm-up row reports explained variance, and a
  checkpoint at step 0 holds the warmed-up critic."""
  config = make_config(trainer=dict(mode="sync", steps=1, eval_every=0, critic_warmup_steps=3))
  _, (pool,), rows = train(config, tmp_path)
  warmup = [r for r in rows if "critic_warmup_step" in r]
  assert [r["critic_warmup_step"] for r in warmup] == [1, 2, 3]
  assert all(r["step"] == 0 and r["value_explained_variance"] is not None for r in warmup)
  assert pool.pushes == [0, 1]                                     # version 0 served through the warm-up
  assert (tmp_path / "checkpoints" / "0").is_dir()
  record = json.loads((tmp_path / "checkpoints" / "1" / "record" / "metadata").read_text())
  assert record["critic_warmup"]["steps"] == 3 and "value_explained_variance" in record["critic_warmup"]


def test_a_kl_term_to_the_reference_trains_and_resumes(tmp_path):
  """actor.kl_coef > 0 passed validation and then crashed the first update; now it trains, logs
  kl_ref, and a resumed run rebuilds the same reference (it is not in the checkpoint)."""
  config = make_config(actor=dict(kl_coef=0.05), trainer=dict(mode="sync", steps=2, eval_every=0))
  _, _, rows = train(config, tmp_path)
  assert rows[1]["kl_ref"] == pytest.approx(0.0, abs=1e-6) and rows[2]["kl_ref"] > 0
  longer = make_config(actor=dict(kl_coef=0.05), trainer=dict(mode="sync", steps=3, eval_every=0))
  _, _, rows = train(longer, tmp_path)
  assert [r["step"] for r in rows] == [0, 1, 2, 3] and rows[3]["kl_ref"] > 0


def test_resume_continues_the_version_numbering(tmp_path):
  config = make_config(trainer=dict(mode="async", max_staleness=1, steps=4, checkpoint_every=2))
  train(config, tmp_path)
  longer = make_config(trainer=dict(mode="async", max_staleness=1, steps=7, checkpoint_every=2))
  _, (pool,), rows = train(longer, tmp_path)
  assert pool.pushes[0] == 4                                         # servers get the restored version
  assert [r["step"] for r in rows] == list(range(8))
  assert max(r["staleness_max"] for r in rows[1:]) <= 1


class FailingPool(ScriptedPool):
  def __init__(self, *args, fail_after: int, **kwargs):
    super().__init__(*args, **kwargs)
    self.calls, self.fail_after = 0, fail_after

  def generate(self, *args, **kwargs):
    self.calls += 1
    if self.calls > self.fail_after:
      from copc_jax.rollout.pool import PoolExhausted
      raise PoolExhausted("every remote rollout server is unreachable")
    return super().generate(*args, **kwargs)


def test_a_dead_pool_stops_the_run_with_a_checkpoint_and_advice(tmp_path):
  config = make_config(trainer=dict(mode="async", max_staleness=2, steps=20, checkpoint_every=100))
  tokenizer = tiny.make_tokenizer()
  make = lambda: FailingPool(len(tokenizer), fail_after=60)
  with pytest.raises(trainer.TrainingError) as info:
    trainer.Trainer(trainer.build(config, str(tmp_path), backend_factory=make)).run()
  message = str(info.value)
  assert "PoolExhausted" in message and "Every rollout server is down" in message
  assert "rerun the same command to resume" in message
  steps = sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit())
  assert steps and steps[-1] >= 1                                      # saved where it stopped
  record = json.loads((tmp_path / "checkpoints" / str(steps[-1]) / "record" / "metadata").read_text())
  assert record["step"] == steps[-1] and {"buffer", "data"} <= set(record["processes"][0])
  _, _, rows = train(config, tmp_path)                                 # a healthy pool: resumes
  # Every update once; an evaluation the dead pool interrupted is redone on resume (its own row).
  assert [r["step"] for r in metrics.update_rows(rows)] == list(range(1, 21))


def test_a_run_stopped_during_an_evaluation_evaluates_that_step_when_it_resumes(tmp_path):
  """The evaluation server (lag mode has its own) dies during the evaluation at update 2: the run
  stops with that update's row and a checkpoint; the resumed run evaluates update 2 before training
  on, so no point of the evaluation curve is lost."""
  config = make_config(trainer=dict(mode="lag", lag=1, steps=4, eval_every=2, checkpoint_every=100))
  tokenizer = tiny.make_tokenizer()
  end = tokenizer.encode("</code>", add_special_tokens=False)

  class DiesInItsSecondEvaluation(ScriptedPool):       # each evaluation first pushes its version
    def generate(self, *args, **kwargs):
      if len(self.pushes) >= 2:
        from copc_jax.rollout.pool import PoolExhausted
        raise PoolExhausted("every remote rollout server is unreachable")
      return super().generate(*args, **kwargs)

  factory = lambda evaluation=False: (DiesInItsSecondEvaluation if evaluation else ScriptedPool)(
      len(tokenizer), tool_call_end=end)
  with pytest.raises(trainer.TrainingError, match="training stopped at step 2"):
    trainer.Trainer(trainer.build(config, str(tmp_path), backend_factory=factory)).run()
  rows = metrics.read_metrics(str(tmp_path))
  assert [(r["step"], "eval_accuracy" in r) for r in rows] == [(0, True), (1, False), (2, False)]
  _, _, rows = train(config, tmp_path)
  evaluated = [r["step"] for r in rows if "eval_accuracy" in r]
  assert evaluated == [0, 2, 4] and [r["step"] for r in rows if "reward_mean" in r] == [1, 2, 3, 4]


def test_missing_checkpoint_is_named(tmp_path):
  config = make_config(model=dict(checkpoint=str(tmp_path / "nowhere")))
  with pytest.raises(FileNotFoundError, match="config.model.checkpoint: no Hugging Face checkpoint"):
    trainer.Trainer(trainer.build(config, str(tmp_path / "run")))


def test_bad_trainer_settings_fail_at_load_time():
  with pytest.raises(ValueError, match="config.trainer.mode must be one of"):
    make_config(trainer=dict(mode="semi"))
  with pytest.raises(ValueError, match=r"max_staleness \(0\) must be >= sync_every - 1"):
    make_config(trainer=dict(mode="async", max_staleness=0, sync_every=3))


def test_a_non_finite_gradient_stops_the_run_and_keeps_the_last_good_checkpoint(tmp_path, monkeypatch):
  from copc_jax.train.learner import Learner

  real_step, calls = Learner.train_step, []

  def poisoned_at_third_update(self, batch, **kwargs):
    metrics_ = dict(real_step(self, batch, **kwargs))
    calls.append(1)
    if len(calls) == 3:
      metrics_["actor_grad_norm"] = float("nan")
    return metrics_

  monkeypatch.setattr(Learner, "train_step", poisoned_at_third_update)
  config = make_config(trainer=dict(mode="sync", steps=6, checkpoint_every=1, eval_every=0))
  with pytest.raises(trainer.TrainingError, match=r"stopped at step 3: grad_norm is nan at update 3") as info:
    train(config, tmp_path)
  assert "last good checkpoint (step 2)" in str(info.value)
  saved = sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit())
  assert saved[-1] == 2                                                # nothing saved over it
  rows = metrics.read_metrics(str(tmp_path))
  assert rows[-1]["step"] == 3 and rows[-1]["grad_norm"] is None       # the bad update is on record


def test_an_error_inside_a_rollout_worker_stops_the_run(tmp_path):
  config = make_config(trainer=dict(mode="async", steps=50, eval_every=0, checkpoint_every=100))
  task = make_task(config.task, config.seed)
  calls = []

  def broken_tool(turn_text):
    calls.append(turn_text)
    if len(calls) >= 3:
      raise OSError("the sandbox is gone")
    return "<output>\n1\n</output>"

  task.tool = broken_tool
  pools = []
  run = trainer.Trainer(trainer.build(config, str(tmp_path), task=task,
                                      backend_factory=scripted_pool_factory(pools)))
  with pytest.raises(trainer.TrainingError, match="OSError: the sandbox is gone"):
    run.run()
  assert pools[0].closed


def test_phase_times_are_exclusive_and_add_up(monkeypatch):
  from copc_jax.train import timing

  clock = iter([0.0, 1.0, 3.0, 10.0, 10.0, 10.5])
  monkeypatch.setattr(timing.time, "perf_counter", lambda: next(clock))
  timer = timing.PhaseTimer()
  with timer("rollout_wait_s"):          # 0 → 10, of which 1 → 3 is a weight push
    with timer("weight_sync_s"):
      pass
  with timer("train_s"):                 # 10 → 10.5
    pass
  assert timer.lap() == {"weight_sync_s": 2.0, "rollout_wait_s": 8.0, "train_s": 0.5}
  assert timer.lap() == {}


def test_metrics_go_to_weights_and_biases_offline_and_a_resumed_run_keeps_its_id(tmp_path, monkeypatch):
  """`trainer.trackers` with "wandb": one W&B run per workdir, offline here, resumed under the same id;
  metrics.jsonl stays the record."""
  pytest.importorskip("wandb")
  from copc_jax.train.metrics import MetricsLogger, read_metrics

  monkeypatch.setenv("WANDB_MODE", "offline")
  monkeypatch.setenv("WANDB_SILENT", "true")
  for timeout in ("WANDB_INIT_TIMEOUT", "WANDB__SERVICE_WAIT"):   # a busy machine starts W&B's service slowly
    monkeypatch.setenv(timeout, "600")
  for start, steps in ((0, (1, 2)), (2, (3,))):
    logger = MetricsLogger(str(tmp_path), total_steps=3, start_step=start, progress=False,
                           trackers=("wandb",), run_config={"preset": "copc"})
    for step in steps:
      logger.write({"step": step, "reward_mean": 0.25 * step})
    logger.close()
  run_id = (tmp_path / "wandb_run_id").read_text()
  # One offline run directory per start, each holding run-ID.wandb (W&B suffixes "-1" to a directory
  # whose start fell in the same second as the one before).
  run_files = sorted((tmp_path / "wandb").glob(f"offline-run-*/run-{run_id}.wandb"))
  assert len(run_files) == 2 and not (tmp_path / "tb").exists()
  logged = b"".join(p.read_bytes() for p in run_files)
  assert b"reward_mean" in logged and b"0.75" in logged                 # the resumed run's row
  assert [r["step"] for r in read_metrics(str(tmp_path))] == [1, 2, 3]


def test_an_unknown_tracker_is_refused():
  with pytest.raises(ValueError, match="trackers must be among"):
    TrainerConfig(trackers=("mlflow",))
