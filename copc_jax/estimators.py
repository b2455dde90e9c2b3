"""Coupled off-policy advantage estimation (COPC's advantage channel).

Reads `coupled_advantages` as specified for copc_jax: over the policy-generated
tokens of a trajectory, in order (tool/prompt/padding positions, `mask = 0`, are
skipped without breaking the chain),

    r_t    = exp(log π_prox(y_t) − log μ(y_t))
    δ_t    = R_t + γ · V_next(t) − V_t
    ρ̃_t    = clip(r_t, rho_min, rho_max)
    c̃_t    = λ · clip(r_t, trace_min, trace_max)
    G_t    = ρ̃_t · δ_t + γ · c̃_t · G_next(t)          G after the last token = 0
    returns_t    = V_t + G_t
    advantages_t = G_t                                   advantage_form="trace"
    advantages_t = ρ̃_t · (δ_t + γ · λ · G_next(t))       advantage_form="vtrace_pg"

where V_next(t) is the value at the next policy token (the bootstrap value after
the last one) and R_t also holds the rewards of the masked positions that follow
token t (a tool call's reward is credited to the token that made the call;
rewards before the first policy token have no token to credit and are unused).
A token whose ratio is not finite gets ρ̃ = c̃ = 0.
The vtrace_pg line is IMPALA's ρ̃_t (R_t + γ(λ v_next + (1 − λ) V_next) − V_t)
with v_next = V_next + G_next, rearranged.

Special cases: rho = trace = (1, 1) is GAE(γ, λ); rho = (0, ρ̄), trace = (0, 1)
with "vtrace_pg" is V-trace (Espeholt et al., 2018).

Implementation: a reverse scan whose carry is (G, U) with
U = γ · V_next + (rewards of masked positions seen since the next policy token).
A policy token sets G ← ρ̃ (R − V + U) + γ c̃ G and U ← γ V; a masked token
leaves G alone and adds its reward to U. Each position is therefore an affine
map of the carry, which also gives the `associative_scan` variant: compose the
maps in O(log T) depth.

The scan reads three time-major arrays: R, V and one "ratio code" holding r_t on
policy tokens, NaN where r_t is not finite and −1 on masked positions, so the
mask and both clips ride on a single input. It writes one: G at the next policy
token ≥ t (0 on masked positions for the "trace" form, where that is the
advantage). Both implementations end in the same vectorised step that forms
the returns and the vtrace_pg advantages from G. On CPU every op of the loop
body and every output it writes costs a fixed overhead per time step, which is
what this layout minimises (see `experiments/xla_cpu_loop_costs.py`).
"""

from __future__ import annotations

import functools
from typing import Literal

import jax
import jax.numpy as jnp

try:  # an experimental API: without it the estimator is the same, only slower on CPU
  from jax.experimental.layout import Layout, with_layout_constraint
except ImportError:
  Layout = with_layout_constraint = None

AdvantageForm = Literal["trace", "vtrace_pg"]
ADVANTAGE_FORMS = ("trace", "vtrace_pg")
SCAN_IMPLS = ("scan", "associative")

# Clip ranges of the named special cases of the estimator.
GAE_CLIPS = dict(rho_clip=(1.0, 1.0), trace_clip=(1.0, 1.0))
INF = float("inf")


def _check_args(rewards, values, target_logprobs, behavior_logprobs, mask,
                rho_clip, trace_clip, advantage_form, bootstrap_value):
  shape = jnp.shape(rewards)
  if len(shape) != 2:
    raise ValueError(f"rewards must have shape [B, T]; got {shape}")
  for name, x in (("values", values), ("target_logprobs", target_logprobs),
                  ("behavior_logprobs", behavior_logprobs), ("mask", mask)):
    if jnp.shape(x) != shape:
      raise ValueError(f"{name} must have the shape of rewards {shape}; got {jnp.shape(x)}")
  if bootstrap_value is not None and jnp.shape(bootstrap_value) != shape[:1]:
    raise ValueError(
        f"bootstrap_value must have shape [B] = {shape[:1]}; got {jnp.shape(bootstrap_value)}")
  if advantage_form not in ADVANTAGE_FORMS:
    raise ValueError(f"advantage_form must be one of {ADVANTAGE_FORMS}; got {advantage_form!r}")
  for name, (lo, hi) in (("rho_clip", rho_clip), ("trace_clip", trace_clip)):
    if not 0 <= lo <= hi:
      raise ValueError(f"{name} must satisfy 0 <= min <= max; got {(lo, hi)}")


def _ratio_code(target_logprobs, behavior_logprobs, mask):
  """float32 [B, T]: r_t on policy tokens, NaN where r_t is not finite, −1 on masked positions.

  Masked positions may hold anything (padding, −inf log-probs); they never reach
  exp. r_t ≥ 0, so −1 can only mean "masked".
  """
  log_ratio = jnp.asarray(target_logprobs, jnp.float32) - jnp.asarray(behavior_logprobs, jnp.float32)
  finite = jnp.isfinite(log_ratio)
  ratio = jnp.where(finite, jnp.exp(jnp.where(finite, log_ratio, 0.0)), jnp.nan)
  return jnp.where(jnp.asarray(mask, bool), ratio, -1.0)


def _clipped_weights(ratio_code, gamma, lam, rho_clip, trace_clip):
  """[B, T] ρ̃ and γ·λ·c̃ from the ratio code; no weight and no trace where r_t is not finite."""
  finite = ratio_code == ratio_code
  rho = jnp.where(finite, jnp.clip(ratio_code, *rho_clip), 0.0)
  discounted_trace = jnp.where(finite, gamma * lam * jnp.clip(ratio_code, *trace_clip), 0.0)
  return rho, discounted_trace


def _row_major(x):
  """`x` materialised in row-major order on CPU.

  Without this, XLA's CPU backend fuses a transpose into the elementwise ops that
  read it and runs the fused kernel several times slower than a plain transpose
  followed by those ops. Other backends choose their own layouts.
  """
  if with_layout_constraint is None or jax.default_backend() != "cpu":
    return x
  return with_layout_constraint(x, Layout(major_to_minor=tuple(range(x.ndim))))


def _scan_impl(rewards, values, ratio_code, bootstrap_b, gamma, lam, rho_clip, trace_clip, zero_masked):
  """Reverse `lax.scan` over time with carry (G, U); returns G at the next policy token ≥ t, [B, T].

  With `zero_masked`, G is written as 0 on masked positions. The loop writes this
  one output: on XLA's CPU runtime each output written per time step costs about
  as much as the arithmetic of a step (see `experiments/xla_cpu_loop_costs.py`),
  so the returns and the vtrace_pg advantages are formed from G after the loop.
  """
  def step(carry, x):
    g_next, u_next = carry
    r_t, v_t, code_t = x
    masked_t = code_t == -1.0
    rho_t = jnp.clip(code_t, *rho_clip)
    trace_t = gamma * lam * jnp.clip(code_t, *trace_clip)
    td_t = r_t - v_t + u_next                      # δ_t (U holds γV_next + the masked rewards)
    g_policy_t = rho_t * td_t + trace_t * g_next
    finite_t = code_t == code_t                    # NaN code: no weight, trace cut
    g_t = jnp.where(masked_t, g_next, jnp.where(finite_t, g_policy_t, 0.0))
    # (g_t − g_t) is 0 for any finite G: it makes U's update read G, so XLA orders it
    # after G's read of U and updates the carry in place instead of copying it each step.
    u_t = jnp.where(masked_t, u_next + r_t, gamma * v_t) + (g_t - g_t)
    return (g_t, u_t), (jnp.where(masked_t, 0.0, g_t) if zero_masked else g_t)

  xs = (rewards.T, values.T, ratio_code.T)
  init = (jnp.zeros_like(bootstrap_b), gamma * bootstrap_b)
  _, g_tb = jax.lax.scan(step, init, xs, reverse=True)
  return _row_major(g_tb.T)


def _compose(later, earlier):
  """Composition of per-position affine maps of the carry (G, U).

  A map (α, β, κ, u, ν) sends the carry (G', U') that follows a position to
  G = α + β G' + κ U',  U = u + ν U'. The result applies `later` first, then
  `earlier`.
  """
  a2, b2, k2, u2, n2 = later
  a1, b1, k1, u1, n1 = earlier
  return (a1 + b1 * a2 + k1 * u2, b1 * b2, b1 * k2 + k1 * n2, u1 + n1 * u2, n1 * n2)


def _associative_impl(rewards_bt, values_bt, rho_bt, trace_bt, mask_bt, bootstrap_b, gamma, zero_masked):
  """Same recursion as `_scan_impl`, solved with `lax.associative_scan` (O(log T) depth)."""
  zeros, ones = jnp.zeros_like(rewards_bt), jnp.ones_like(rewards_bt)
  maps = (
      jnp.where(mask_bt, rho_bt * (rewards_bt - values_bt), 0.0),  # α
      jnp.where(mask_bt, trace_bt, 1.0),                           # β
      jnp.where(mask_bt, rho_bt, 0.0),                             # κ
      jnp.where(mask_bt, gamma * values_bt, rewards_bt),           # u
      jnp.where(mask_bt, zeros, ones),                             # ν
  )
  # With reverse=True the combine function receives (maps of later positions, earlier ones).
  alpha, _, kappa, _, _ = jax.lax.associative_scan(_compose, maps, axis=1, reverse=True)
  # Evaluate the composed maps at the terminal carry (G, U) = (0, γ·bootstrap).
  g_bt = alpha + kappa * (gamma * bootstrap_b)[:, None]
  return jnp.where(mask_bt, g_bt, 0.0) if zero_masked else g_bt


def _outputs(g_bt, values_bt, mask_bt, ratio_code, gamma, lam, rho_clip, trace_clip, advantage_form):
  """(advantages, returns), 0 on masked positions, from G at the next policy token ≥ t.

  For "trace", g_bt comes already zeroed on masked positions and is the advantage.
  For "vtrace_pg" it is not (a masked position carries G_next for the token before it):
  ρ̃(δ + γλ G_next) = G_t + (γλρ̃ − γλ·clip(r)) G_next, since
  G_t = ρ̃ δ + γλ·clip(r) G_next on a policy token with a finite ratio.
  """
  returns = jnp.where(mask_bt, values_bt + g_bt, 0.0)
  if advantage_form == "trace":
    return g_bt, returns
  rho, discounted_trace = _clipped_weights(ratio_code, gamma, lam, rho_clip, trace_clip)
  g_next = jnp.concatenate([g_bt[:, 1:], jnp.zeros_like(g_bt[:, :1])], axis=1)
  finite = ratio_code == ratio_code
  advantages = jnp.where(finite, g_bt + (gamma * lam * rho - discounted_trace) * g_next, 0.0)
  return jnp.where(mask_bt, advantages, 0.0), returns


@functools.partial(
    jax.jit,
    static_argnames=("gamma", "lam", "rho_clip", "trace_clip", "advantage_form", "impl"))
def _coupled_advantages(rewards, values, target_logprobs, behavior_logprobs, mask,
                        bootstrap_value, *, gamma, lam, rho_clip, trace_clip,
                        advantage_form, impl):
  rewards = jnp.asarray(rewards, jnp.float32)
  values = jnp.asarray(values, jnp.float32)
  if bootstrap_value is None:
    bootstrap_b = jnp.zeros(rewards.shape[:1], jnp.float32)
  else:
    bootstrap_b = jnp.asarray(bootstrap_value, jnp.float32)
  mask = jnp.asarray(mask, bool)
  ratio_code = _ratio_code(target_logprobs, behavior_logprobs, mask)
  zero_masked = advantage_form == "trace"
  if impl == "scan":
    g_bt = _scan_impl(rewards, values, ratio_code, bootstrap_b, gamma, lam, rho_clip, trace_clip,
                      zero_masked)
  else:
    rho, trace = _clipped_weights(ratio_code, gamma, lam, rho_clip, trace_clip)
    g_bt = _associative_impl(rewards, values, rho, trace, mask, bootstrap_b, gamma, zero_masked)
  return _outputs(g_bt, values, mask, ratio_code, gamma, lam, rho_clip, trace_clip, advantage_form)


def coupled_advantages(rewards, values, target_logprobs, behavior_logprobs, mask, *,
                       gamma: float = 1.0, lam: float = 1.0,
                       rho_clip: tuple[float, float] = (0.5, 2.0),
                       trace_clip: tuple[float, float] = (0.5, 1.0),
                       bootstrap_value=None,
                       advantage_form: AdvantageForm = "trace",
                       impl: str = "scan"):
  """Advantages and value targets with two-sided clipped-ratio weighting of TD residuals.

  Args:
    rewards: float [B, T], reward received after each position.
    values: float [B, T], V_t at every position (only policy positions are read).
    target_logprobs: float [B, T], log π_prox of each token.
    behavior_logprobs: float [B, T], log μ of each token (from the sampler).
    mask: bool [B, T], True where the policy generated the token.
    gamma: discount per policy token, γ ≥ 0.
    lam: trace decay λ ∈ [0, 1].
    rho_clip: (min, max) clip of the TD-residual weight ρ̃.
    trace_clip: (min, max) clip of the trace coefficient c̃ (before λ).
    bootstrap_value: float [B], value after the last position; None means 0
      (the episode ended).
    advantage_form: "trace" (advantage = G_t) or "vtrace_pg".
    impl: "scan" (reverse `lax.scan`) or "associative" (`lax.associative_scan`).

  Returns:
    (advantages, returns): float32 [B, T], 0 where `mask` is False. Targets are
    not stop-gradiented here; the losses do that. No whitening.
  """
  if impl not in SCAN_IMPLS:
    raise ValueError(f"impl must be one of {SCAN_IMPLS}; got {impl!r}")
  rho_clip = tuple(float(x) for x in rho_clip)
  trace_clip = tuple(float(x) for x in trace_clip)
  _check_args(rewards, values, target_logprobs, behavior_logprobs, mask,
              rho_clip, trace_clip, advantage_form, bootstrap_value)
  if gamma < 0:
    raise ValueError(f"gamma must be >= 0; got {gamma}")
  if not 0.0 <= lam <= 1.0:
    raise ValueError(f"lam must be in [0, 1]; got {lam}")
  return _coupled_advantages(
      rewards, values, target_logprobs, behavior_logprobs, mask, bootstrap_value,
      gamma=float(gamma), lam=float(lam), rho_clip=rho_clip, trace_clip=trace_clip,
      advantage_form=advantage_form, impl=impl)


def gae(rewards, values, mask, *, gamma: float = 1.0, lam: float = 1.0,
        bootstrap_value=None, impl: str = "scan"):
  """GAE(γ, λ) over policy tokens: `coupled_advantages` with every ratio clipped to 1."""
  zeros = jnp.zeros(jnp.shape(rewards), jnp.float32)
  return coupled_advantages(rewards, values, zeros, zeros, mask, gamma=gamma, lam=lam,
                            bootstrap_value=bootstrap_value, impl=impl, **GAE_CLIPS)


def vtrace(rewards, values, target_logprobs, behavior_logprobs, mask, *,
           gamma: float = 1.0, lam: float = 1.0, rho_bar: float = 1.0, c_bar: float = 1.0,
           bootstrap_value=None, impl: str = "scan"):
  """V-trace targets and policy-gradient advantages (one-sided clips ρ̄, c̄)."""
  return coupled_advantages(rewards, values, target_logprobs, behavior_logprobs, mask,
                            gamma=gamma, lam=lam, rho_clip=(0.0, rho_bar),
                            trace_clip=(0.0, c_bar), bootstrap_value=bootstrap_value,
                            advantage_form="vtrace_pg", impl=impl)


WHITEN_MODES = ("none", "scale", "center")


def whiten(advantages, mask, *, mode: str = "center", carried_ratio=None, min_std: float = 0.0):
  """Batch normalisation of advantages (the whitening rule); 0 outside `mask`.

      none     Â_t
      scale    Â_t / σ
      center   (Â_t − m · c_t) / σ

  m, σ: mean and standard deviation of Â over `mask` (the policy tokens the policy channel keeps),
  σ floored at `min_std` so an all-equal batch is not blown up to unit variance. c_t
  (`carried_ratio`, float [B, T]; None = 1) is the ratio the advantage channel carries on token t:
  ρ̃_t = clip(r_t, rho_min, rho_max) for `vtrace`/`copc`, 1 for the GAE presets. With c_t = 1 this is
  the usual (Â − m)/σ; with a ratio-free policy channel, subtracting m·ρ̃_t instead of m keeps the
  baseline unbiased (E_μ[r_t ∇log π] = 0), where the plain constant pushes π away from μ.
  """
  if mode not in WHITEN_MODES:
    raise ValueError(f"whiten mode must be one of {WHITEN_MODES}; got {mode!r}")
  mask = jnp.asarray(mask, bool)
  advantages = jnp.asarray(advantages, jnp.float32)
  if mode == "none":
    return jnp.where(mask, advantages, 0.0)
  mask_f = mask.astype(jnp.float32)
  count = jnp.maximum(mask_f.sum(), 1.0)
  mean = (advantages * mask_f).sum() / count
  std = jnp.sqrt((jnp.square(advantages - mean) * mask_f).sum() / count)
  std = jnp.maximum(std, jnp.maximum(min_std, 1e-8))
  if mode == "scale":
    return jnp.where(mask, advantages / std, 0.0)
  carried = 1.0 if carried_ratio is None else jnp.asarray(carried_ratio, jnp.float32)
  return jnp.where(mask, (advantages - mean * carried) / std, 0.0)


GROUP_METHODS = ("grpo", "dr_grpo", "rloo")


def group_advantages(rewards_b, group_ids_b, *, method: str = "grpo", eps: float = 1e-6):
  """Critic-free outcome advantages, one per sequence, from the other samples of its prompt.

  With g the group of sequence i (the sequences whose `group_ids_b` equal its own), n = |g|:

      grpo     A_i = (R_i − mean_g R) / (std_g R + eps)     std with n − 1 in the denominator
      dr_grpo  A_i =  R_i − mean_g R
      rloo     A_i =  R_i − mean_{j ∈ g, j ≠ i} R_j  =  n/(n − 1) · (R_i − mean_g R)

  A group of one sequence gets A_i = 0 (no baseline to compare with). Group ids are any integers
  and need not be sorted or contiguous.

  Args:
    rewards_b: float [B], the outcome reward of each sequence.
    group_ids_b: int [B], the prompt (group) each sequence was sampled for.
  """
  if method not in GROUP_METHODS:
    raise ValueError(f"group method must be one of {GROUP_METHODS}; got {method!r}")
  rewards_b = jnp.asarray(rewards_b, jnp.float32)
  group_ids_b = jnp.asarray(group_ids_b)
  if rewards_b.ndim != 1 or group_ids_b.shape != rewards_b.shape:
    raise ValueError(f"rewards_b and group_ids_b must both be [B]; got {rewards_b.shape} and "
                     f"{group_ids_b.shape}")
  same_bb = (group_ids_b[:, None] == group_ids_b[None, :]).astype(jnp.float32)
  n_b = same_bb.sum(axis=1)
  mean_b = same_bb @ rewards_b / n_b
  centered_b = rewards_b - mean_b
  several_b = n_b > 1
  if method == "dr_grpo":
    return jnp.where(several_b, centered_b, 0.0)
  if method == "rloo":
    return jnp.where(several_b, centered_b * n_b / jnp.maximum(n_b - 1.0, 1.0), 0.0)
  deviation_b = rewards_b[None, :] - mean_b[:, None]                       # [i, j]: R_j − mean of i's group
  var_b = (same_bb * jnp.square(deviation_b)).sum(axis=1) / jnp.maximum(n_b - 1.0, 1.0)
  return jnp.where(several_b, centered_b / (jnp.sqrt(var_b) + eps), 0.0)
