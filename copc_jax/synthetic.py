"""A synthetic off-policy problem with exact advantages: the gradient check job.

Each trajectory has `num_steps` policy tokens a_t ∈ {0, 1}; the state is the
previous action, π(a_t = 1 | a_{t−1}) = p_t(a_{t−1}) = σ(θ_t + φ_t a_{t−1}), so an
action changes what the policy does next. Tool tokens (mask = 0) sit after every
`tool_every` policy tokens. The task reward Σ_t f_t a_t arrives on the last
token. Backward dynamic programming over the two states gives everything exactly:

    Q_t(s, a) = f_t a + W_{t+1}(a),   W_t(s) = Σ_a π_t(a | s) Q_t(s, a)
    V^π(s_t)  = Σ_{k < t} f_k a_k + W_t(a_{t−1})    (the reward so far is part of the return)
    A^π       = Q_t(s, a) − W_t(s)
    ∂J/∂θ_t   = Σ_s d_t(s) Σ_a π_t(a | s) A^π_t(s, a) (a − p_t(s))

with d_t the state distribution under π. Trajectories come from a stale
behaviour policy with θ_t + d·z_t and φ_t + d·z'_t, z ~ N(0, 1): the drift d
stands in for staleness. For each preset the job computes the estimator's
advantages and the actor loss's policy weights at θ = θ_prox, the gradient
estimate ĝ_t = mean(w_t Â_t (a_t − p_t)), its relative error against ∂J/∂θ, and
the bias decomposition terms. GAE built from μ's continuations estimates A^μ,
not A^π: COPC's advantage staleness.
"""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
from etils import epath

from copc_jax import estimators, losses, presets


@dataclasses.dataclass(frozen=True)
class OffPolicyBatch:
  rewards: np.ndarray          # [N, L]
  values: np.ndarray           # [N, L]
  logp_target: np.ndarray      # [N, L] log π at each token (0 on tool tokens)
  logp_behavior: np.ndarray    # [N, L] log μ
  mask: np.ndarray             # [N, L] policy tokens
  score: np.ndarray            # [N, L] ∇_θ log π(a_t) = a_t − p_t on policy tokens
  true_advantages: np.ndarray  # [N, L] A^π
  true_gradient: np.ndarray    # [num_steps]
  step_index: np.ndarray       # [L] which θ_t a position belongs to (−1 for tool tokens)


def layout(num_steps: int, tool_every: int) -> np.ndarray:
  """Position → policy step index, −1 where a tool token sits."""
  index = []
  for t in range(num_steps):
    index.append(t)
    if tool_every and (t + 1) % tool_every == 0 and t + 1 < num_steps:
      index.append(-1)
  return np.array(index)


def _sigmoid(x):
  return 1.0 / (1.0 + np.exp(-x))


def exact_solution(theta, phi, gain):
  """W_t(s), Q_t(s, a) and ∂J/∂θ_t of the two-state chain (start state s_0 = 0)."""
  num_steps = len(theta)
  p = _sigmoid(theta[:, None] + phi[:, None] * np.array([0.0, 1.0])[None])  # [T, s]
  w_next = np.zeros(2)
  w, q = np.zeros((num_steps + 1, 2)), np.zeros((num_steps, 2, 2))
  for t in reversed(range(num_steps)):
    q[t] = gain[t] * np.array([0.0, 1.0])[None, :] + w_next[None, :]  # [s, a]
    w[t] = (1 - p[t]) * q[t, :, 0] + p[t] * q[t, :, 1]
    w_next = w[t]
  state_dist = np.array([1.0, 0.0])
  grad = np.zeros(num_steps)
  for t in range(num_steps):
    adv = q[t] - w[t][:, None]                                      # [s, a]
    prob = np.stack([1 - p[t], p[t]], axis=1)                       # [s, a]
    score = np.array([0.0, 1.0])[None, :] - p[t][:, None]           # [s, a]
    grad[t] = (state_dist[:, None] * prob * adv * score).sum()
    state_dist = (state_dist[:, None] * prob).sum(axis=0)
  return p, w, q, grad


def sample_batch(rng: np.random.Generator, *, num_trajectories: int, num_steps: int,
                 tool_every: int, drift: float, value_noise: float = 0.0) -> OffPolicyBatch:
  theta, phi, gain = rng.normal(size=num_steps), 2 * rng.normal(size=num_steps), rng.normal(size=num_steps)
  p, w, q, true_gradient = exact_solution(theta, phi, gain)
  theta_mu = theta + drift * rng.normal(size=num_steps)
  phi_mu = phi + drift * rng.normal(size=num_steps)

  actions = np.zeros((num_trajectories, num_steps))
  states = np.zeros((num_trajectories, num_steps), dtype=int)
  state = np.zeros(num_trajectories, dtype=int)
  for t in range(num_steps):
    p_mu_t = _sigmoid(theta_mu[t] + phi_mu[t] * state)
    actions[:, t] = rng.random(num_trajectories) < p_mu_t
    states[:, t] = state
    state = actions[:, t].astype(int)
  steps = np.arange(num_steps)
  a = actions.astype(int)
  p_taken = p[steps, states]                                       # p_t(s_t)
  p_mu = _sigmoid(theta_mu + phi_mu * states)
  reward_so_far = np.cumsum(actions * gain, axis=1) - actions * gain

  step_index = layout(num_steps, tool_every)
  policy = step_index >= 0
  length = len(step_index)

  def scatter(per_step):  # [N, num_steps] → [N, L], zeros on tool tokens
    out = np.zeros((num_trajectories, length))
    out[:, policy] = per_step
    return out

  rewards_steps = np.zeros((num_trajectories, num_steps))
  rewards_steps[:, -1] = actions @ gain
  values = reward_so_far + w[steps, states] + value_noise * rng.normal(size=actions.shape)
  return OffPolicyBatch(
      rewards=scatter(rewards_steps), values=scatter(values),
      logp_target=scatter(np.where(a == 1, np.log(p_taken), np.log1p(-p_taken))),
      logp_behavior=scatter(np.where(a == 1, np.log(p_mu), np.log1p(-p_mu))),
      mask=np.broadcast_to(policy, (num_trajectories, length)),
      score=scatter(actions - p_taken),
      true_advantages=scatter(q[steps, states, a] - w[steps, states]),
      true_gradient=true_gradient, step_index=step_index)


def policy_weights_at_prox(batch: OffPolicyBatch, advantages, actor: losses.ActorLossConfig):
  """w_t with θ = θ_prox: the per-token factor of Â_t ∇log π in the actor gradient."""
  logp_theta = jnp.asarray(batch.logp_target, jnp.float32)
  grad = jax.grad(lambda lp: losses.actor_loss(
      lp, batch.logp_target, batch.logp_behavior, advantages, batch.mask,
      dataclasses.replace(actor, aggregation="token_mean"))[0])(logp_theta)
  # ∂loss/∂log π_t = −w_t Â_t / N_tokens.
  n_tokens = batch.mask.sum()
  safe_adv = jnp.where(jnp.abs(advantages) > 0, advantages, 1.0)
  return jnp.where(jnp.abs(advantages) > 0, -grad * n_tokens / safe_adv, 0.0)


def gradient_check(batch: OffPolicyBatch, preset_name: str) -> dict[str, float]:
  """Relative gradient error and bias terms of one preset on one batch."""
  preset = presets.get_preset(preset_name)
  advantages, _ = estimators.coupled_advantages(
      batch.rewards, batch.values, batch.logp_target, batch.logp_behavior, batch.mask,
      **preset.estimator.estimator_kwargs())
  weights = policy_weights_at_prox(batch, advantages, preset.actor)
  per_token = np.asarray(weights * advantages) * batch.score        # [N, L]
  policy = batch.step_index >= 0
  estimate = per_token[:, policy].mean(axis=0)
  error = np.linalg.norm(estimate - batch.true_gradient) / np.linalg.norm(batch.true_gradient)
  _, diagnostics = losses.actor_loss(
      batch.logp_target, batch.logp_target, batch.logp_behavior, advantages, batch.mask,
      preset.actor, reference_advantages=batch.true_advantages)
  result = {"relative_gradient_error": float(error)}
  for key in ("bias_policy", "bias_advantage", "bias_coupled", "variance_amplification",
              "masked_fraction", "ess"):
    result[key] = float(diagnostics[key])
  return result


def run(config, workdir: str) -> list[dict]:
  """The `gradient_check` job: every preset at every drift; a table on stdout, JSON in workdir."""
  check = config.gradient_check
  rows = []
  for drift in check.staleness_drifts:
    batch = sample_batch(np.random.default_rng(config.seed), num_trajectories=check.num_trajectories,
                         num_steps=check.num_steps, tool_every=check.tool_every, drift=drift,
                         value_noise=check.value_noise)
    for name in check.presets:
      rows.append({"drift": drift, "preset": name, **gradient_check(batch, name)})
  header = f"{'drift':>5}  {'preset':<14}{'grad err':>9}{'bias_pol':>10}{'bias_adv':>10}{'bias_cpl':>10}"
  print(header)
  for row in rows:
    print(f"{row['drift']:>5.2f}  {row['preset']:<14}{row['relative_gradient_error']:>9.3f}"
          f"{row['bias_policy']:>10.4f}{row['bias_advantage']:>10.4f}{row['bias_coupled']:>10.4f}")
  epath.Path(workdir).mkdir(parents=True, exist_ok=True)
  (epath.Path(workdir) / "gradient_check.json").write_text(json.dumps(rows, indent=1))
  return rows
