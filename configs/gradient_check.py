"""The synthetic off-policy gradient check of every preset.

Run:
  python -m copc_jax.main --config=configs/gradient_check.py --workdir=/tmp/copc_gradient_check
Pick the preset whose estimator/loss the config records with `configs/gradient_check.py:tis`;
override any field, e.g. `--config.estimator.rho_clip="(0.8, 1.5)"`.
Fields left as None take the preset's value (see copc_jax/presets.py).
"""

from ml_collections import config_dict

from configs import common
from copc_jax import presets


def get_config(arg=None):
  config = config_dict.ConfigDict()
  config.job = "gradient_check"
  config.preset = arg or "copc"
  config.seed = 0

  common.add_method_sections(config)

  config.gradient_check = config_dict.ConfigDict(dict(
      num_trajectories=4096, num_steps=32, tool_every=4,
      staleness_drifts=(0.0, 0.5, 1.0, 2.0), value_noise=0.0,
      presets=tuple(presets.PRESETS)))
  return config


