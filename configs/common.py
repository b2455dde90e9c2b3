"""Sections shared by the config files, built from the library's dataclasses (`copc_jax.config.section`).

Every field of every dataclass is a config field at its default, so a new field is
overridable from the command line without editing this file. Fields left as None
(placeholders) take the preset's value (copc_jax/presets.py); anything set in a
config file or on the command line overrides it.
"""

from ml_collections import config_dict

from copc_jax import config as config_lib
from copc_jax import presets

GROUP_SIZE = 4      # samples per prompt for the critic-free group presets (grpo, dr_grpo, rloo)


def mode_for(preset: str, mode: str = "async") -> str:
  """`mode`, except for sync PPO, which is defined by staleness 0 and refuses any mode but sync."""
  return "sync" if preset == "sync_ppo" else mode


def add_method_sections(config: config_dict.ConfigDict) -> None:
  """The method (estimator and actor loss: placeholders the preset fills), value loss and sharding."""
  for name in ("estimator", "actor", "value", "sharding"):
    config[name] = config_lib.section(name)


def train_config(preset: str) -> config_dict.ConfigDict:
  """Every section of the `train` job at the library's defaults; config files change what they need."""
  config = config_dict.ConfigDict()
  config.job = "train"
  config.preset = preset
  config.seed = 0
  add_method_sections(config)
  for name in ("model", "task", "rollout", "trainer", "warm_start"):
    config[name] = config_lib.section(name)
  config.trainer.mode = mode_for(preset, config.trainer.mode)
  if preset in presets.PRESETS and presets.get_preset(preset).estimator.group_method:
    config.trainer.group_size = GROUP_SIZE
  return config
