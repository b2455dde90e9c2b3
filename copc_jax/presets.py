"""The named methods of the COPC comparison: one estimator and one loss, different knobs.

| preset          | policy channel                      | advantage channel          |
| --------------- | ----------------------------------- | -------------------------- |
| sync_ppo        | PPO vs π_prox (staleness 0)         | GAE                        |
| async_ppo       | PPO with q against μ, no mask       | GAE                        |
| decoupled_ppo   | PPO vs π_prox × min(r, w_max = 5)   | GAE                        |
| tis             | PPO vs π_prox × min(r, C = 2)       | GAE                        |
| icepop / mis    | PPO vs π_prox × r·1[0.5 ≤ r ≤ 5]    | GAE                        |
| vtrace          | PPO vs π_prox                       | V-trace, one-sided clips   |
| copc_spec       | token mask 1[0.5 ≤ r ≤ 2]           | two-sided clipped TD       |
| copc            | copc_spec, the PPO clip on π_θ/μ    | two-sided clipped TD       |
| grpo            | PPO vs π_prox                       | (R − mean_g) / std_g       |
| dr_grpo         | PPO vs π_prox, token sum / constant | R − mean_g                 |
| rloo            | PPO vs π_prox                       | R − leave-one-out mean     |

The group presets are critic-free: `trainer.group_size` samples per prompt form a group g; the
policy-side corrections are their knobs (`actor.behavior_weight` = truncate / masked_ratio, ...).

In `vtrace` and `copc` the advantage already carries the ratio of the token
being updated, so the policy channel carries none.

`copc_spec` is the setting the spec writes down (the paper's own values are not public);
`copc` is the setting picked by the rule of `experiments/copc_default/` (what the evidence says,
and how strongly, is in that study's README, not here): today the spec's setting with the PPO
indicator taken on π_θ/μ (`actor.anchor = "behavior"`, see `losses`).
"""

from __future__ import annotations

import dataclasses

from copc_jax import estimators
from copc_jax.losses import ActorLossConfig


@dataclasses.dataclass(frozen=True)
class EstimatorConfig:
  """Advantage channel: the arguments of `estimators.coupled_advantages` plus whitening."""

  gamma: float = 1.0
  lam: float = 1.0
  rho_clip: tuple[float, float] = (0.5, 2.0)
  trace_clip: tuple[float, float] = (0.5, 1.0)
  advantage_form: str = "trace"
  group_method: str = ""          # "" = the critic's coupled advantages; "grpo" | "dr_grpo" | "rloo"
  whiten: str = "center"          # "none" | "scale" | "center" (estimators.whiten)
  whiten_min_std: float = 0.05    # σ floor, in reward units (the tasks' rewards lie in [0, 1])
  impl: str = "scan"

  def __post_init__(self):
    if self.gamma < 0:
      raise ValueError(f"gamma must be >= 0; got {self.gamma}")
    if not 0 <= self.lam <= 1:
      raise ValueError(f"lam must be in [0, 1]; got {self.lam}")
    for name in ("rho_clip", "trace_clip"):
      lo, hi = getattr(self, name)
      if not 0 <= lo <= hi:
        raise ValueError(f"{name} must satisfy 0 <= min <= max; got {tuple(getattr(self, name))}")
    if self.advantage_form not in estimators.ADVANTAGE_FORMS:
      raise ValueError(f"advantage_form must be one of {estimators.ADVANTAGE_FORMS}; "
                       f"got {self.advantage_form!r}")
    if self.group_method and self.group_method not in estimators.GROUP_METHODS:
      raise ValueError(f"group_method must be '' (critic) or one of {estimators.GROUP_METHODS}; got "
                       f"{self.group_method!r}")
    if self.whiten not in estimators.WHITEN_MODES:
      raise ValueError(f"whiten must be one of {estimators.WHITEN_MODES}; got {self.whiten!r}")
    if not self.whiten_min_std >= 0:
      raise ValueError(f"whiten_min_std must be >= 0; got {self.whiten_min_std}")
    if self.impl not in estimators.SCAN_IMPLS:
      raise ValueError(f"impl must be one of {estimators.SCAN_IMPLS}; got {self.impl!r}")

  def estimator_kwargs(self) -> dict:
    return dict(gamma=self.gamma, lam=self.lam, rho_clip=self.rho_clip,
                trace_clip=self.trace_clip, advantage_form=self.advantage_form, impl=self.impl)


@dataclasses.dataclass(frozen=True)
class Preset:
  estimator: EstimatorConfig
  actor: ActorLossConfig


_GAE = EstimatorConfig(rho_clip=(1.0, 1.0), trace_clip=(1.0, 1.0))


def _group(method: str) -> EstimatorConfig:
  return EstimatorConfig(rho_clip=(1.0, 1.0), trace_clip=(1.0, 1.0), group_method=method, whiten="none")


_COPC_SPEC = Preset(EstimatorConfig(), ActorLossConfig(behavior_weight="mask", mask_range=(0.5, 2.0)))
_ICEPOP = Preset(_GAE, ActorLossConfig(behavior_weight="masked_ratio", mask_range=(0.5, 5.0)))

PRESETS: dict[str, Preset] = {
    "sync_ppo": Preset(_GAE, ActorLossConfig(behavior_weight="none")),
    "async_ppo": Preset(_GAE, ActorLossConfig(policy_ratio="behavior", behavior_weight="none")),
    "decoupled_ppo": Preset(_GAE, ActorLossConfig(behavior_weight="truncate", weight_cap=5.0)),
    "tis": Preset(_GAE, ActorLossConfig(behavior_weight="truncate", weight_cap=2.0)),
    "icepop": _ICEPOP,
    "mis": _ICEPOP,
    "vtrace": Preset(
        EstimatorConfig(rho_clip=(0.0, 1.0), trace_clip=(0.0, 1.0), advantage_form="vtrace_pg"),
        ActorLossConfig(behavior_weight="none")),
    # Critic-free: n samples per prompt (trainer.group_size), one outcome advantage per sequence.
    "grpo": Preset(_group("grpo"), ActorLossConfig(behavior_weight="none")),
    "dr_grpo": Preset(_group("dr_grpo"), ActorLossConfig(behavior_weight="none", aggregation="token_sum")),
    "rloo": Preset(_group("rloo"), ActorLossConfig(behavior_weight="none")),
    "copc_spec": _COPC_SPEC,
    # The pick of experiments/copc_default (its test holds the two together): the spec's setting with the
    # PPO indicator on π_θ/μ.
    "copc": Preset(_COPC_SPEC.estimator, dataclasses.replace(_COPC_SPEC.actor, anchor="behavior")),
}


# One name per distinct setting (an alias such as `mis` for `icepop` dropped), for sweeps and tests.
DISTINCT: tuple[str, ...] = tuple(sorted({id(p): n for n, p in sorted(PRESETS.items(), reverse=True)}.values()))


def get_preset(name: str) -> Preset:
  if name not in PRESETS:
    raise ValueError(f"preset must be one of {sorted(PRESETS)}; got {name!r}")
  return PRESETS[name]
