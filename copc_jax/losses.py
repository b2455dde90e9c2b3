"""Actor and critic losses for every preset: one PPO-style surrogate, configured.

Per policy token t (mask_t = 1), with the behaviour ratio r_t = π_prox/μ and
the PPO ratio q_t = π_θ/π_ref, where π_ref is π_prox or, for `policy_ratio =
"behavior"` (async PPO's own surrogate), μ itself:

    b_t = behaviour weight:   1                      "none"
                              min(r_t, C)            "truncate"      (TIS, decoupled PPO)
                              r_t · 1[lo ≤ r_t ≤ hi] "masked_ratio"  (IcePop / MIS)
                              1[lo ≤ r_t ≤ hi]       "mask"          (COPC's token mask m_t)
    ℓ_t = − b_t · min(q_t Â_t, clip(q_t, 1 − ε_low, 1 + ε_high) Â_t)

Two anchors of the policy channel, knobs of every preset:

- `mask_ratio`: the indicator 1[lo ≤ · ≤ hi] of "mask"/"masked_ratio" is taken on r_t = π_prox/μ
  ("proximal", fixed per batch) or on sg(π_θ/μ) ("current": it closes as the update moves away
  from μ over several minibatches). The value r_t of "masked_ratio" stays π_prox/μ.
- `anchor`: which ratio a_t decides the PPO indicator (the tokens that stop receiving gradient):
  q_t itself ("proximal") or π_θ/μ ("behavior"). The gradient weight stays b_t q_t; with
  anchor = "behavior" the term is ℓ_t = − b_t · (q_t Â_t if the clip of a_t is inactive, else
  sg(q_t) Â_t), the clip being active where (Â_t > 0 and a_t > 1 + ε_high) or (Â_t < 0 and
  a_t < 1 − ε_low). With θ = θ_prox and r_t = 1 both anchors agree.

aggregated as a token mean (Σ_t ℓ_t / Σ_t mask_t over the batch), a sequence
mean (token mean per sequence, then mean over sequences), or a token sum over a
constant (Σ_t ℓ_t / (B·T), the batch's shape: Dr. GRPO's aggregation, no length bias). Tokens whose ratio is
not finite are dropped from the numerator and counted. Optional KL to a
reference policy (k1: log π_θ − log π_ref; k3: e^{−k1} + k1 − 1) and entropy
bonus are added with their coefficients.

Gradient: ∇ℓ_t = − w_t Â_t ∇log π_θ(y_t) with the policy weight
w_t = b_t q_t 1[PPO clip inactive]; `policy_weights` returns it, and with
reference advantages A^π the diagnostics split the gradient bias as in COPC:
E[(Δw A^π + ρ ΔA + Δw ΔA) ∇log π], Δw = w − ρ, ΔA = Â − A^π, ρ = π_θ/μ.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

POLICY_RATIOS = ("proximal", "behavior")
ANCHORS = ("proximal", "behavior")
MASK_RATIOS = ("proximal", "current")
BEHAVIOR_WEIGHTS = ("none", "truncate", "masked_ratio", "mask")
AGGREGATIONS = ("token_mean", "seq_mean", "token_sum")
KL_ESTIMATORS = ("k1", "k3")


def _check_range(name, value, lower=0.0):
  lo, hi = value
  if not lower <= lo <= hi:
    raise ValueError(f"{name} must satisfy {lower} <= min <= max; got {tuple(value)}")


def _check_choice(name, value, allowed):
  if value not in allowed:
    raise ValueError(f"{name} must be one of {allowed}; got {value!r}")


@dataclasses.dataclass(frozen=True)
class ActorLossConfig:
  """Policy channel of one preset (see the table in the module docstring)."""

  policy_ratio: str = "proximal"
  anchor: str = "proximal"
  mask_ratio: str = "proximal"
  behavior_weight: str = "mask"
  weight_cap: float = 2.0
  mask_range: tuple[float, float] = (0.5, 2.0)
  clip_eps_low: float = 0.2
  clip_eps_high: float = 0.28
  aggregation: str = "token_mean"
  kl_coef: float = 0.0
  kl_estimator: str = "k3"
  entropy_coef: float = 0.0

  def __post_init__(self):
    _check_choice("policy_ratio", self.policy_ratio, POLICY_RATIOS)
    _check_choice("anchor", self.anchor, ANCHORS)
    _check_choice("mask_ratio", self.mask_ratio, MASK_RATIOS)
    _check_choice("behavior_weight", self.behavior_weight, BEHAVIOR_WEIGHTS)
    _check_choice("aggregation", self.aggregation, AGGREGATIONS)
    _check_choice("kl_estimator", self.kl_estimator, KL_ESTIMATORS)
    _check_range("mask_range", self.mask_range)
    if not self.weight_cap > 0:
      raise ValueError(f"weight_cap must be > 0; got {self.weight_cap}")
    if not 0 <= self.clip_eps_low < 1:
      raise ValueError(f"clip_eps_low must be in [0, 1); got {self.clip_eps_low}")
    for name in ("clip_eps_high", "kl_coef", "entropy_coef"):
      if getattr(self, name) < 0:
        raise ValueError(f"{name} must be >= 0; got {getattr(self, name)}")


@dataclasses.dataclass(frozen=True)
class ValueLossConfig:
  """Clipped squared error of the value head against the estimator's returns."""

  clip: float | None = 0.5
  aggregation: str = "token_mean"

  def __post_init__(self):
    _check_choice("aggregation", self.aggregation, AGGREGATIONS)
    if self.clip is not None and self.clip <= 0:
      raise ValueError(f"clip must be > 0 or None; got {self.clip}")


def aggregate(per_token_bt, mask_bt, how: str):
  """Token mean Σ x / Σ mask, the mean over sequences of each sequence's token mean, or Σ x / (B·T)."""
  mask_f = jnp.asarray(mask_bt, jnp.float32)
  per_token_bt = jnp.where(mask_bt, per_token_bt, 0.0)
  if how == "token_mean":
    return per_token_bt.sum() / jnp.maximum(mask_f.sum(), 1.0)
  if how == "token_sum":
    return per_token_bt.sum() / per_token_bt.size
  tokens_b = mask_f.sum(axis=1)
  per_seq_b = per_token_bt.sum(axis=1) / jnp.maximum(tokens_b, 1.0)
  has_tokens_b = (tokens_b > 0).astype(jnp.float32)
  return (per_seq_b * has_tokens_b).sum() / jnp.maximum(has_tokens_b.sum(), 1.0)


def aggregation_shares(mask_gbt, how: str):
  """w_g, the share of row group g in `aggregate` over all groups' rows, so that
  Σ_g w_g · aggregate(x_g, mask_g) = aggregate(x, mask) exactly (gradient accumulation):
  tokens_g / tokens for the token mean, sequences-with-tokens_g / sequences-with-tokens for the
  sequence mean, rows_g / rows (1/G, groups of equal size) for the token sum over B·T."""
  mask_f = jnp.asarray(mask_gbt, jnp.float32)
  groups = mask_f.shape[0]
  if how == "token_mean":
    tokens_g = mask_f.sum(axis=(1, 2))
    return tokens_g / jnp.maximum(tokens_g.sum(), 1.0)
  if how == "token_sum":
    return jnp.full((groups,), 1.0 / groups)
  sequences_g = (mask_f.sum(axis=2) > 0).sum(axis=1).astype(jnp.float32)
  return sequences_g / jnp.maximum(sequences_g.sum(), 1.0)


def _safe_exp(log_x_bt, valid_bt):
  """exp where valid, 1 elsewhere, with no NaN in the gradient of the invalid entries."""
  return jnp.exp(jnp.where(valid_bt, log_x_bt, 0.0))


def behavior_weights(ratio_bt, config: ActorLossConfig, mask_ratio_bt=None):
  """b_t of the module docstring, from the behaviour ratio r_t = π_prox/μ (no gradient); the mask's
  indicator is taken on `mask_ratio_bt` when given (sg(π_θ/μ) for `mask_ratio = "current"`)."""
  lo, hi = config.mask_range
  mask_ratio_bt = ratio_bt if mask_ratio_bt is None else mask_ratio_bt
  inside_bt = (mask_ratio_bt >= lo) & (mask_ratio_bt <= hi)
  if config.behavior_weight == "none":
    return jnp.ones_like(ratio_bt)
  if config.behavior_weight == "truncate":
    return jnp.minimum(ratio_bt, config.weight_cap)
  if config.behavior_weight == "masked_ratio":
    return jnp.where(inside_bt, ratio_bt, 0.0)
  return inside_bt.astype(ratio_bt.dtype)


def masked_stats(x_bt, valid_bt):
  """(mean, std, count) of `x_bt` over `valid_bt`."""
  valid_f = valid_bt.astype(jnp.float32)
  count = jnp.maximum(valid_f.sum(), 1.0)
  mean = jnp.where(valid_bt, x_bt, 0.0).sum() / count
  var = jnp.where(valid_bt, jnp.square(x_bt - mean), 0.0).sum() / count
  return mean, jnp.sqrt(var), count


def actor_loss(logp_theta, logp_prox, logp_behavior, advantages, mask,
               config: ActorLossConfig, *, logp_ref=None, entropy=None,
               reference_advantages=None):
  """PPO-family actor loss of one preset; returns (loss, diagnostics).

  Args:
    logp_theta: float [B, T], log π_θ(y_t); the only input that carries gradient.
    logp_prox: float [B, T], log π_prox(y_t) recomputed before the update.
    logp_behavior: float [B, T], log μ(y_t) from the sampler.
    advantages: float [B, T], Â_t (stop-gradiented here).
    mask: bool [B, T], policy-generated tokens.
    config: the preset's policy channel.
    logp_ref: float [B, T], reference-policy log-probs for the KL penalty.
    entropy: float [B, T], per-token entropy of π_θ for the entropy bonus.
    reference_advantages: float [B, T], A^π where known (synthetic tasks); adds
      the bias/variance decomposition terms to the diagnostics.
  """
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  logp_theta = f32(logp_theta)
  logp_prox = jax.lax.stop_gradient(f32(logp_prox))
  logp_behavior = jax.lax.stop_gradient(f32(logp_behavior))
  advantages = jax.lax.stop_gradient(f32(advantages))
  mask = jnp.asarray(mask, bool)

  log_ratio_bt = logp_prox - logp_behavior
  logp_q_reference = logp_behavior if config.policy_ratio == "behavior" else logp_prox
  log_q_bt = logp_theta - logp_q_reference
  log_current_bt = jax.lax.stop_gradient(logp_theta) - logp_behavior      # log sg(π_θ/μ)
  finite_bt = (jnp.isfinite(log_ratio_bt) & jnp.isfinite(log_q_bt) & jnp.isfinite(advantages)
               & jnp.isfinite(log_current_bt))
  valid_bt = mask & finite_bt
  ratio_bt = _safe_exp(log_ratio_bt, valid_bt)
  q_bt = _safe_exp(log_q_bt, valid_bt)
  current_bt = _safe_exp(log_current_bt, valid_bt)
  advantages = jnp.where(valid_bt, advantages, 0.0)

  mask_ratio_bt = current_bt if config.mask_ratio == "current" else ratio_bt
  weight_bt = jnp.where(valid_bt, behavior_weights(ratio_bt, config, mask_ratio_bt), 0.0)
  lo_clip, hi_clip = 1.0 - config.clip_eps_low, 1.0 + config.clip_eps_high
  unclipped_term_bt = q_bt * advantages
  if config.anchor == "proximal" or config.policy_ratio == "behavior":    # the indicator's ratio is q
    clipped_term_bt = jnp.clip(q_bt, lo_clip, hi_clip) * advantages
    clip_active_bt = valid_bt & (clipped_term_bt < unclipped_term_bt)
    surrogate_bt = weight_bt * jnp.minimum(unclipped_term_bt, clipped_term_bt)
  else:                       # the indicator on π_θ/μ, the gradient weight b_t q_t unchanged
    clip_active_bt = valid_bt & (((advantages > 0) & (current_bt > hi_clip))
                                 | ((advantages < 0) & (current_bt < lo_clip)))
    surrogate_bt = weight_bt * jnp.where(clip_active_bt, jax.lax.stop_gradient(unclipped_term_bt),
                                         unclipped_term_bt)
  loss = -aggregate(surrogate_bt, mask, config.aggregation)

  if config.kl_coef > 0:
    if logp_ref is None:
      raise ValueError("kl_coef > 0 needs logp_ref (reference-policy log-probs)")
    k1_bt = logp_theta - jax.lax.stop_gradient(f32(logp_ref))
    kl_bt = k1_bt if config.kl_estimator == "k1" else jnp.exp(-k1_bt) + k1_bt - 1.0
    kl = aggregate(jnp.where(valid_bt, kl_bt, 0.0), mask, config.aggregation)
    loss = loss + config.kl_coef * kl
  if config.entropy_coef > 0:
    if entropy is None:
      raise ValueError("entropy_coef > 0 needs the per-token entropy")
    mean_entropy = aggregate(jnp.where(valid_bt, f32(entropy), 0.0), mask, config.aggregation)
    loss = loss - config.entropy_coef * mean_entropy

  policy_weight_bt = jnp.where(clip_active_bt, 0.0, weight_bt * q_bt)
  mask_f = mask.astype(jnp.float32)
  n_tokens = jnp.maximum(mask_f.sum(), 1.0)
  ratio_mean, _, n_valid = masked_stats(ratio_bt, valid_bt)
  ratio_sq_mean, _, _ = masked_stats(jnp.square(ratio_bt), valid_bt)
  adv_mean, adv_std, _ = masked_stats(advantages, valid_bt)
  diagnostics = {
      "actor_loss": loss,
      "masked_fraction": (mask & (weight_bt == 0)).sum() / n_tokens,
      "nonfinite_count": (mask & ~finite_bt).sum(),
      "clip_fraction": clip_active_bt.sum() / n_tokens,
      "ratio_mean": ratio_mean,
      "ratio_max": jnp.where(valid_bt, ratio_bt, -jnp.inf).max(),
      "ratio_min": jnp.where(valid_bt, ratio_bt, jnp.inf).min(),
      # Kish effective sample size of r_t over the batch, as a fraction in (0, 1].
      "ess": jnp.square(ratio_mean) / jnp.maximum(ratio_sq_mean, 1e-30) * (n_valid > 0),
      "advantage_mean": adv_mean,
      "advantage_std": adv_std,
      # KL(μ‖π_θ) on μ's samples, k3 estimator (x − 1 − log x with x = π_θ/μ), over the policy tokens.
      "kl_behavior": masked_stats(current_bt - 1.0 - jnp.where(valid_bt, log_current_bt, 0.0), valid_bt)[0],
      "policy_weight_mean": masked_stats(policy_weight_bt, valid_bt)[0],
  }
  if reference_advantages is not None:
    diagnostics.update(bias_decomposition(
        policy_weight_bt, advantages, f32(reference_advantages),
        _safe_exp(jax.lax.stop_gradient(logp_theta) - logp_behavior, valid_bt), valid_bt))
  return loss, diagnostics


def bias_decomposition(policy_weight_bt, advantages_bt, reference_advantages_bt,
                       is_ratio_bt, valid_bt):
  """Token means of the two-channel terms Δw·A^π, ρ·ΔA, Δw·ΔA and w²·ΔA².

  Δw = w − ρ (policy-weight error), ΔA = Â − A^π (advantage error); the first
  three sum to the per-token bias of w·Â against ρ·A^π, the last is the
  conditional variance term amplified by the squared policy weight.
  """
  weight_error_bt = policy_weight_bt - is_ratio_bt
  advantage_error_bt = advantages_bt - reference_advantages_bt
  terms = {
      "bias_policy": weight_error_bt * reference_advantages_bt,
      "bias_advantage": is_ratio_bt * advantage_error_bt,
      "bias_coupled": weight_error_bt * advantage_error_bt,
      "variance_amplification": jnp.square(policy_weight_bt * advantage_error_bt),
  }
  return {name: masked_stats(x_bt, valid_bt)[0] for name, x_bt in terms.items()}


def value_loss(values, old_values, returns, mask, config: ValueLossConfig):
  """½ max((V − G)², (clip(V, V_old ± c) − G)²) over policy tokens; returns (loss, diagnostics)."""
  values = jnp.asarray(values, jnp.float32)
  returns = jax.lax.stop_gradient(jnp.asarray(returns, jnp.float32))
  old_values = jax.lax.stop_gradient(jnp.asarray(old_values, jnp.float32))
  error_bt = jnp.square(values - returns)
  if config.clip is not None:
    clipped_bt = old_values + jnp.clip(values - old_values, -config.clip, config.clip)
    error_bt = jnp.maximum(error_bt, jnp.square(clipped_bt - returns))
  loss = 0.5 * aggregate(error_bt, mask, config.aggregation)
  mask = jnp.asarray(mask, bool)
  returns_var = masked_stats(returns, mask)[1] ** 2
  # 1 − Var(G − V)/Var(G); undefined (NaN, logged as null) when the targets barely vary (e.g. every
  # episode of the batch got the same reward), where the ratio would be noise over ~0.
  explained = jnp.where(returns_var > 1e-6, 1.0 - masked_stats(returns - values, mask)[1] ** 2
                        / jnp.maximum(returns_var, 1e-6), jnp.nan)
  return loss, {"value_loss": loss, "value_explained_variance": explained}
