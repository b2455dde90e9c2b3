"""Typed experiment configuration, converted once from an `ml_collections.ConfigDict`.

Config files (`configs/*.py`) hold plain values; `from_config_dict` validates
them and returns frozen dataclasses that the library takes. A preset fills the
estimator and the actor loss; any field set in the config file (not None)
overrides the preset's value. Every error names the field, the value and what
is allowed.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ml_collections import config_dict

from copc_jax import presets
from copc_jax.envs.tasks import TaskConfig
from copc_jax.losses import ActorLossConfig, ValueLossConfig
from copc_jax.presets import EstimatorConfig
from copc_jax.rollout.config import RolloutConfig
from copc_jax.sharding import ShardingConfig
from copc_jax.train.setup import ModelSource, TrainerConfig, WarmStartConfig

JOBS = ("train", "gradient_check")


@dataclasses.dataclass(frozen=True)
class GradientCheckConfig:
  """The synthetic off-policy gradient check (`copc_jax.synthetic`)."""

  num_trajectories: int = 4096
  num_steps: int = 32
  tool_every: int = 4
  staleness_drifts: tuple[float, ...] = (0.0, 0.5, 1.0, 2.0)
  value_noise: float = 0.0
  presets: tuple[str, ...] = presets.DISTINCT    # one per distinct setting: no alias twice

  def __post_init__(self):
    for name in ("num_trajectories", "num_steps"):
      if getattr(self, name) < 1:
        raise ValueError(f"{name} must be >= 1; got {getattr(self, name)}")
    if self.tool_every < 0:
      raise ValueError(f"tool_every must be >= 0 (0 = no tool tokens); got {self.tool_every}")
    if any(d < 0 for d in self.staleness_drifts):
      raise ValueError(f"staleness_drifts must be >= 0; got {self.staleness_drifts}")
    if self.value_noise < 0:
      raise ValueError(f"value_noise must be >= 0; got {self.value_noise}")
    for name in self.presets:
      presets.get_preset(name)


@dataclasses.dataclass(frozen=True)
class ExperimentConfig:
  job: str
  preset: str
  seed: int
  estimator: EstimatorConfig
  actor: ActorLossConfig
  value: ValueLossConfig
  gradient_check: GradientCheckConfig
  sharding: ShardingConfig
  model: ModelSource = ModelSource()
  task: TaskConfig = TaskConfig()
  rollout: RolloutConfig = RolloutConfig()
  trainer: TrainerConfig = TrainerConfig()
  warm_start: WarmStartConfig = WarmStartConfig()


SECTIONS = {"estimator": EstimatorConfig, "actor": ActorLossConfig, "value": ValueLossConfig,
            "gradient_check": GradientCheckConfig, "sharding": ShardingConfig, "model": ModelSource,
            "task": TaskConfig, "rollout": RolloutConfig, "trainer": TrainerConfig,
            "warm_start": WarmStartConfig}
PRESET_SECTIONS = ("estimator", "actor")      # filled by the preset; the config file's values override it


def section(name: str) -> config_dict.ConfigDict:
  """The config section `name` with every field of its dataclass, so every field is overridable.

  Values are the dataclass defaults, the one source of truth; the preset's sections
  hold typed placeholders (None: take the preset's value).
  """
  defaults = SECTIONS[name]()
  values = {f.name: getattr(defaults, f.name) for f in dataclasses.fields(defaults)}
  if name in PRESET_SECTIONS:
    values = {key: config_dict.placeholder(type(value)) for key, value in values.items()}
  return config_dict.ConfigDict(values)


def _as_plain(value):
  if hasattr(value, "to_dict"):
    return value.to_dict()
  return value


def _as_tuple(value):
  """Lists (and nested lists) from ConfigDict.to_dict() or the command line → tuples."""
  return tuple(_as_tuple(v) for v in value) if isinstance(value, list | tuple) else value


def _number_tuple(value):
  """A tuple of numbers written on the command line, e.g. '(0.0, inf)' (ml_collections hands it over
  as a string, or a 1-tuple of one): its numbers, `inf` included; None if it is not one."""
  text = value[0] if isinstance(value, tuple) and len(value) == 1 and isinstance(value[0], str) else value
  if not isinstance(text, str):
    return None
  try:
    return tuple(float(part) for part in text.strip().strip("()[]").split(",") if part.strip())
  except ValueError:
    return None


def _coerce(path: str, value, default):
  """`value` with the type of the field's default (int → float, list → tuple), or an error."""
  value = _as_tuple(value)
  if isinstance(default, tuple) and default and all(isinstance(d, float | int) for d in default):
    value = _number_tuple(value) or value
    if not (isinstance(value, tuple) and all(isinstance(v, float | int) for v in value)):
      raise ValueError(f"{path} must be a tuple like {default!r}; got {value!r}")
  if default is None or isinstance(value, type(default)) and not (
      isinstance(value, bool) and not isinstance(default, bool)):
    return value
  if isinstance(default, float) and isinstance(value, int) and not isinstance(value, bool):
    return float(value)
  raise ValueError(f"{path} must be a {type(default).__name__} like {default!r}; got {value!r}")


def _build(cls, section: str, values: dict[str, Any], base=None):
  """`cls` from `values`, starting from `base`; unknown keys and bad values name the field."""
  values = {k: v for k, v in _as_plain(values or {}).items() if v is not None}
  known = {f.name for f in dataclasses.fields(cls)}
  unknown = sorted(set(values) - known)
  if unknown:
    raise ValueError(f"config.{section}: unknown field(s) {unknown}; allowed: {sorted(known)}")
  reference = base if base is not None else cls()
  for key, value in values.items():
    values[key] = _coerce(f"config.{section}.{key}", value, getattr(reference, key))
  try:
    return dataclasses.replace(base, **values) if base is not None else cls(**values)
  except (TypeError, ValueError) as err:
    raise ValueError(f"config.{section}.{err}") from None


def from_config_dict(config) -> ExperimentConfig:
  """Validate a ConfigDict (or plain dict) and return the typed configuration."""
  config = _as_plain(config)
  allowed = {"job", "preset", "seed", *SECTIONS}
  unknown = sorted(set(config) - allowed)
  if unknown:
    raise ValueError(f"config: unknown field(s) {unknown}; allowed: {sorted(allowed)}")
  job = config.get("job", "train")
  if job not in JOBS:
    raise ValueError(f"config.job must be one of {JOBS}; got {job!r}")
  try:
    preset = presets.get_preset(config.get("preset", "copc"))
  except ValueError as err:
    raise ValueError(f"config.{err}") from None
  seed = config.get("seed", 0)
  if not isinstance(seed, int) or seed < 0:
    raise ValueError(f"config.seed must be a non-negative int; got {seed!r}")
  typed = ExperimentConfig(
      job=job,
      preset=config.get("preset", "copc"),
      seed=seed,
      estimator=_build(EstimatorConfig, "estimator", config.get("estimator"), preset.estimator),
      actor=_build(ActorLossConfig, "actor", config.get("actor"), preset.actor),
      value=_build(ValueLossConfig, "value", config.get("value")),
      gradient_check=_build(GradientCheckConfig, "gradient_check", config.get("gradient_check")),
      sharding=_build(ShardingConfig, "sharding", config.get("sharding")),
      model=_build(ModelSource, "model", config.get("model")),
      task=_build(TaskConfig, "task", config.get("task")),
      rollout=_build(RolloutConfig, "rollout", config.get("rollout")),
      trainer=_build(TrainerConfig, "trainer", config.get("trainer")),
      warm_start=_build(WarmStartConfig, "warm_start", config.get("warm_start")),
  )
  _check_preset_fits(typed)
  return typed


def _check_preset_fits(config: ExperimentConfig) -> None:
  """Settings a preset is defined by: sync PPO's staleness 0, the group presets' groups."""
  if config.job != "train":
    return
  if config.preset == "sync_ppo" and config.trainer.mode != "sync":
    raise ValueError(f"config.trainer.mode: preset 'sync_ppo' is defined by staleness 0 and runs only in "
                     f"mode 'sync'; got {config.trainer.mode!r} (for uncorrected PPO on stale data use "
                     f"preset 'decoupled_ppo' with config.actor.behavior_weight=none)")
  if config.estimator.group_method and config.trainer.group_size < 2:
    raise ValueError(f"config.trainer.group_size: preset {config.preset!r} compares the samples of a prompt "
                     f"and needs group_size >= 2; got {config.trainer.group_size}")
