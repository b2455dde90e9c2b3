"""Default job: the synthetic off-policy gradient check of every preset.

Run:
  python -m copc_jax.main --config=configs/default.py --workdir=/tmp/copc_default
Pick the preset whose estimator/loss the config records with `configs/default.py:tis`;
override any field, e.g. `--config.estimator.rho_clip="(0.8, 1.5)"`.
Fields left as None take the preset's value (see copc_jax/presets.py).
"""

from ml_collections import config_dict

from copc_jax import presets, sharding

placeholder = config_dict.placeholder


def get_config(arg=None):
  config = config_dict.ConfigDict()
  config.job = "gradient_check"
  config.preset = arg or "copc"
  config.seed = 0

  config.estimator = config_dict.ConfigDict(dict(
      gamma=placeholder(float), lam=placeholder(float), rho_clip=placeholder(tuple),
      trace_clip=placeholder(tuple), advantage_form=placeholder(str),
      whiten_advantages=placeholder(bool), impl=placeholder(str)))
  config.actor = config_dict.ConfigDict(dict(
      policy_ratio=placeholder(str), behavior_weight=placeholder(str),
      weight_cap=placeholder(float), mask_range=placeholder(tuple),
      clip_eps_low=placeholder(float), clip_eps_high=placeholder(float),
      aggregation=placeholder(str), kl_coef=placeholder(float), kl_estimator=placeholder(str),
      entropy_coef=placeholder(float)))
  config.value = config_dict.ConfigDict(dict(clip=0.5, aggregation="token_mean"))

  # Mesh over (data, fsdp, tensor); -1 takes the remaining devices. Rules map logical axes
  # of the parameters to mesh axes (see copc_jax/sharding.py).
  config.sharding = config_dict.ConfigDict(dict(
      mesh_shape=(1, -1, 1), rules=sharding.DEFAULT_RULES))

  config.gradient_check = config_dict.ConfigDict(dict(
      num_trajectories=4096, num_steps=32, tool_every=4,
      staleness_drifts=(0.0, 0.5, 1.0, 2.0), value_noise=0.0,
      presets=tuple(presets.PRESETS)))
  return config


def smoke():
  """A seconds-long variant for tests."""
  config = get_config()
  config.gradient_check.num_trajectories = 256
  config.gradient_check.num_steps = 8
  config.gradient_check.staleness_drifts = (0.0, 1.0)
  return config
