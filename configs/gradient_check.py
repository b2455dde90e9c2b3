"""The synthetic off-policy gradient check of every preset.

Run:
  python -m copc_jax.main --config=configs/gradient_check.py --workdir=/tmp/copc_gradient_check
Pick the preset whose estimator/loss the config records with `configs/gradient_check.py:tis`;
override any field, e.g. `--config.estimator.rho_clip="(0.8, 1.5)"`.
Fields left as None take the preset's value (see copc_jax/presets.py).
"""

from ml_collections import config_dict

from configs import common
from copc_jax import config as config_lib


def get_config(arg=None):
  config = config_dict.ConfigDict()
  config.job = "gradient_check"
  config.preset = arg or "copc"
  config.seed = 0

  common.add_method_sections(config)

  config.gradient_check = config_lib.section("gradient_check")
  return config


