import os
import subprocess
import sys

import pytest

from configs import gradient_check as default
from copc_jax import config as config_lib
from copc_jax import presets

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("name", sorted(presets.PRESETS))
def test_every_preset_config_loads_with_the_preset_values(name):
  config = config_lib.from_config_dict(default.get_config(name))
  assert config.preset == name
  assert config.estimator == presets.PRESETS[name].estimator
  assert config.actor == presets.PRESETS[name].actor


def test_fields_override_the_preset():
  raw = default.get_config("tis")
  raw.estimator.rho_clip = (0.8, 1.5)
  raw.actor.weight_cap = 3
  config = config_lib.from_config_dict(raw)
  assert config.estimator.rho_clip == (0.8, 1.5)
  assert config.actor.weight_cap == 3.0 and isinstance(config.actor.weight_cap, float)
  assert config.actor.behavior_weight == "truncate"


@pytest.mark.parametrize("mutate, message", [
    (lambda c: setattr(c, "preset", "ppo2"), r"config.preset must be one of .*'ppo2'"),
    (lambda c: setattr(c.estimator, "rho_clip", (2.0, 1.0)),
     r"config.estimator.rho_clip must satisfy 0 <= min <= max; got \(2.0, 1.0\)"),
    (lambda c: setattr(c.estimator, "gamma", -0.5), r"config.estimator.gamma must be >= 0; got -0.5"),
    (lambda c: setattr(c.actor, "mask_range", (3.0, 1.0)), r"config.actor.mask_range"),
    (lambda c: setattr(c.estimator, "advantage_form", "gae"), r"config.estimator.advantage_form"),
    (lambda c: setattr(c.gradient_check, "num_steps", 0), r"config.gradient_check.num_steps"),
    (lambda c: setattr(c, "job", "fly"), r"config.job must be one of"),
])
def test_bad_values_fail_at_load_time_with_field_value_and_allowed(mutate, message):
  raw = default.get_config()
  mutate(raw)
  with pytest.raises(ValueError, match=message):
    config_lib.from_config_dict(raw)


@pytest.mark.parametrize("mutate, message", [
    (lambda c: setattr(c.trainer, "optimizer", "adamz"), r"config.trainer.optimizer must name an optax "
                                                          r"optimizer .*; got 'adamz'"),
    (lambda c: setattr(c.trainer, "optimizer_options", (("beta1", 0.9),)),
     r"config.trainer.optimizer_options \{'beta1': 0.9\} do not fit optax.adamw .*its options: \['b1', 'b2'"),
    (lambda c: setattr(c.rollout, "weight_transfer", "nfs"), r"config.rollout.weight_transfer must be"),
    (lambda c: setattr(c.rollout, "server_platform", "gpu"), r"config.rollout.server_platform must be one of"),
])
def test_bad_training_values_fail_at_load_time(mutate, message):
  from configs import default as train_default
  raw = train_default.get_config()
  mutate(raw)
  with pytest.raises(ValueError, match=message):
    config_lib.from_config_dict(raw)
  good = train_default.get_config()
  good.trainer.optimizer, good.trainer.optimizer_options = "lion", (("b1", 0.95),)
  assert config_lib.from_config_dict(good).trainer.optimizer_options == (("b1", 0.95),)


def test_wrong_type_and_unknown_field():
  raw = default.get_config().to_dict()
  raw["estimator"]["lam"] = "high"
  with pytest.raises(ValueError, match=r"config.estimator.lam must be a float.*'high'"):
    config_lib.from_config_dict(raw)
  raw = default.get_config().to_dict()
  raw["actor"]["eps"] = 0.1
  with pytest.raises(ValueError, match=r"config.actor: unknown field\(s\) \['eps'\]"):
    config_lib.from_config_dict(raw)


def run_main(*args):
  return subprocess.run(
      [sys.executable, "-m", "copc_jax.main", *args], cwd=ROOT, capture_output=True, text=True,
      timeout=300, env={**os.environ, "XLA_FLAGS": ""})


def test_main_runs_the_smoke_job_through_absl_flags(tmp_path):
  result = run_main("--config=configs/gradient_check.py", f"--workdir={tmp_path}",
                    "--config.gradient_check.num_trajectories=64",
                    "--config.gradient_check.num_steps=6",
                    "--config.gradient_check.staleness_drifts=(0.0,1.0)")
  assert result.returncode == 0, result.stderr[-3000:]
  assert "copc" in result.stdout and "grad err" in result.stdout
  assert (tmp_path / "gradient_check.json").exists()


def test_main_rejects_a_bad_override_naming_the_field(tmp_path):
  result = run_main("--config=configs/gradient_check.py", f"--workdir={tmp_path}",
                    "--config.estimator.gamma=-1.0")
  assert result.returncode != 0
  assert "config.estimator.gamma must be >= 0; got -1.0" in result.stderr


def test_sharding_rules_come_from_the_config():
  raw = default.get_config()
  raw.sharding.mesh_shape = (2, -1, 2)
  raw.sharding.rules = (("embed", None), ("mlp", "tensor"), ("batch", ("data", "fsdp")))
  config = config_lib.from_config_dict(raw)
  assert config.sharding.mesh_shape == (2, -1, 2)
  assert dict(config.sharding.rules)["batch"] == ("data", "fsdp")
  raw.sharding.rules = (("embed", "model"),)
  with pytest.raises(ValueError, match="config.sharding.rules: logical axis 'embed' maps to unknown"):
    config_lib.from_config_dict(raw)


def test_number_pairs_from_the_command_line_accept_inf():
  """ml_collections hands '--config.estimator.rho_clip=(0.0, inf)' over as a string in a 1-tuple."""
  raw = default.get_config()
  raw.estimator.rho_clip = ("(0.0, inf)",)
  raw.actor.mask_range = ("(0.5, 1e9)",)
  config = config_lib.from_config_dict(raw)
  assert config.estimator.rho_clip == (0.0, float("inf")) and config.actor.mask_range == (0.5, 1e9)
  raw.estimator.rho_clip = ("(0.5, x)",)
  with pytest.raises(ValueError, match=r"config.estimator.rho_clip must be a tuple like \(0.5, 2.0\)"):
    config_lib.from_config_dict(raw)


def test_sync_ppo_refuses_every_mode_but_sync():
  from configs import common, staleness_sweep
  raw = common.train_config("sync_ppo")
  assert raw.trainer.mode == "sync"                 # the config files give it sync mode by default
  config_lib.from_config_dict(raw)
  for mode in ("async", "lag"):
    raw.trainer.mode = mode
    message = (r"config.trainer.mode: preset 'sync_ppo' is defined by staleness 0 and runs only in mode "
               rf"'sync'; got '{mode}'")
    with pytest.raises(ValueError, match=message):
      config_lib.from_config_dict(raw)
  with pytest.raises(ValueError, match="preset 'sync_ppo' is defined by staleness 0"):
    config_lib.from_config_dict(staleness_sweep.get_config("sync_ppo,16"))


def test_loading_a_config_imports_neither_the_trainer_nor_grpc_nor_jetstream():
  """A config (every section validated) loads with the settings' own modules: no import climbs into
  the trainer, and nothing pulls the rollout servers' stack."""
  code = ("import sys\n"
          "from configs import default, search\n"
          "from copc_jax import config\n"
          "for module in (default, search):\n"
          "  config.from_config_dict(module.get_config())\n"
          "loaded = [m for m in sys.modules if m.split('.')[0] in ('grpc', 'jetstream')\n"
          "          or m in ('copc_jax.train.trainer', 'copc_jax.rollout.pool', 'copc_jax.rollout.server')]\n"
          "print(loaded)\n")
  out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-2000:]
  assert out.stdout.strip().splitlines()[-1] == "[]"
