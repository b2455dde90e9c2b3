"""An exact, LLM-like MDP: a K-ary tree of depth D whose state is the whole prefix, reward at the leaves.

As in decoding, an action changes every later state, so advantage estimates built from a
stale behaviour policy's continuations inherit its mismatch (advantage staleness). The
tree is small enough to enumerate every trajectory, so every expectation is exact:

    V^π(leaf) = r(leaf),   Q^π(s, a) = V^π(child(s, a)),   V^π(s) = Σ_a π(a|s) Q^π(s, a)
    A^π(s, a) = Q^π(s, a) − V^π(s)
    ∇J(π)     = Σ_s d^π(s) Σ_a π(a|s) A^π(s, a) ∇log π(a|s)            (true gradient)
    g*        = E_μ[Σ_t ρ_t A^π(s_t, a_t) ∇log π(a_t|s_t)],  ρ_t = π/μ   (per-token IS gradient)

with a tabular softmax policy (∇_{θ[s, b]} log π(a|s) = 1[a = b] − π(b|s)). For an actor
update g = E_μ[Σ_t w_t Â_t ∇log π(a_t|s_t)] (the preset's policy weight w_t from
`losses.actor_loss`, its advantage Â_t from `estimators.coupled_advantages`, at θ = θ_prox,
no whitening) and w = ρ + Δw, Â = A^π + ΔA (the COPC decomposition):

    g − g* = E[Δw·A^π ∇log π] + E[ρ·ΔA ∇log π] + E[Δw·ΔA ∇log π]     (policy, advantage, coupled)
    variance term  E[Σ_t w_t² Var(ΔA | s_t, a_t)]

`decomposition` computes each term exactly (a μ-weighted sum over all K^D trajectories) or
by sampling N trajectories from μ (`sample=N`), with standard errors.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from copc_jax import estimators, presets, synthetic


@dataclasses.dataclass(frozen=True)
class TreeMDP:
  branching: int
  depth: int
  logits_pi: np.ndarray      # [internal nodes, K]: the learner's policy π (= π_prox here)
  logits_mu: np.ndarray      # [internal nodes, K]: the stale behaviour policy μ
  logits_critic: np.ndarray  # [internal nodes, K]: the policy whose V the critic holds
  leaf_rewards: np.ndarray   # [K^D]

  @property
  def num_internal(self) -> int:
    return (self.branching ** self.depth - 1) // (self.branching - 1)


def make_tree(rng: np.random.Generator, *, branching: int = 3, depth: int = 6, drift: float = 0.5,
              critic_mix: float = 0.0, policy_scale: float = 1.0) -> TreeMDP:
  """A random tree; μ's logits are π's plus drift·N(0, 1); the critic is V of μ (critic_mix = 0),
  of π (1), or of the policy with logits in between."""
  n = (branching ** depth - 1) // (branching - 1)
  logits_pi = policy_scale * rng.normal(size=(n, branching))
  logits_mu = logits_pi + drift * rng.normal(size=(n, branching))
  logits_critic = (1 - critic_mix) * logits_mu + critic_mix * logits_pi
  return TreeMDP(branching, depth, logits_pi, logits_mu, logits_critic,
                 rng.normal(size=branching ** depth))


def _softmax(logits):
  z = np.exp(logits - logits.max(-1, keepdims=True))
  return z / z.sum(-1, keepdims=True)


def node_values(tree: TreeMDP, logits) -> np.ndarray:
  """V of the policy with `logits` at every node: internal nodes first (level order), then leaves."""
  k, probs = tree.branching, _softmax(logits)
  values = np.concatenate([np.zeros(tree.num_internal), tree.leaf_rewards])
  for node in reversed(range(tree.num_internal)):       # children of node i: k·i + 1 … k·i + k
    values[node] = probs[node] @ values[k * node + 1: k * node + k + 1]
  return values


def all_trajectories(tree: TreeMDP) -> np.ndarray:
  """Every action sequence, [K^D, D]."""
  k, d = tree.branching, tree.depth
  return np.array(np.unravel_index(np.arange(k ** d), (k,) * d)).T


def states(tree: TreeMDP, actions: np.ndarray) -> np.ndarray:
  """Node id of the state before each action, [N, D] (level-order ids: child of i by a = k·i + 1 + a)."""
  nodes = np.zeros(actions.shape, int)
  for t in range(1, tree.depth):
    nodes[:, t] = tree.branching * nodes[:, t - 1] + 1 + actions[:, t - 1]
  return nodes


def true_gradients(tree: TreeMDP) -> tuple[np.ndarray, np.ndarray]:
  """(∇J(π), g*) as [internal nodes, K] arrays."""
  k, pi, mu = tree.branching, _softmax(tree.logits_pi), _softmax(tree.logits_mu)
  v = node_values(tree, tree.logits_pi)
  grad_j, grad_is = np.zeros_like(pi), np.zeros_like(pi)
  reach_pi, reach_mu = np.zeros(tree.num_internal), np.zeros(tree.num_internal)
  reach_pi[0] = reach_mu[0] = 1.0
  for node in range(tree.num_internal):
    children = np.arange(k * node + 1, k * node + k + 1)
    advantage = v[children] - v[node]                          # A^π(node, a)
    score = np.eye(k) - pi[node][None, :]                      # row a: ∇_{θ[node]} log π(a|node)
    direction = (pi[node] * advantage) @ score                 # Σ_a π A^π ∇log π (μ·ρ = π)
    grad_j[node], grad_is[node] = reach_pi[node] * direction, reach_mu[node] * direction
    internal = children[children < tree.num_internal]
    reach_pi[internal] = reach_pi[node] * pi[node][:len(internal)]
    reach_mu[internal] = reach_mu[node] * mu[node][:len(internal)]
  return grad_j, grad_is


def sample_trajectories(tree: TreeMDP, num: int, seed: int = 0) -> np.ndarray:
  """`num` action sequences drawn from the behaviour policy μ, [num, D]."""
  rng = np.random.default_rng(seed)
  mu = _softmax(tree.logits_mu)
  actions = np.zeros((num, tree.depth), int)
  node = np.zeros(num, int)
  for t in range(tree.depth):
    cumulative = np.cumsum(mu[node], axis=1)
    actions[:, t] = (rng.random((num, 1)) > cumulative).sum(1)
    node = tree.branching * node + 1 + actions[:, t]
  return actions


def as_batch(tree: TreeMDP, actions: np.ndarray) -> synthetic.OffPolicyBatch:
  """The trajectories as an estimator/loss batch: one row each, reward on the last token, the critic's
  values, log π and log μ of every action, and the exact A^π(s_t, a_t) in `true_advantages`."""
  nodes = states(tree, actions)
  take = lambda logits: np.log(_softmax(logits))[nodes, actions]
  v_pi, v_critic = node_values(tree, tree.logits_pi), node_values(tree, tree.logits_critic)
  children = tree.branching * nodes + 1 + actions
  rewards = np.zeros(actions.shape)
  rewards[:, -1] = v_pi[children[:, -1]]                       # leaves: V = r
  mask = np.ones(actions.shape, bool)
  return synthetic.OffPolicyBatch(
      rewards=rewards, values=v_critic[nodes], logp_target=take(tree.logits_pi),
      logp_behavior=take(tree.logits_mu), mask=mask, score=np.zeros(actions.shape),
      true_advantages=v_pi[children] - v_pi[nodes], true_gradient=np.zeros(0),
      step_index=np.arange(tree.depth))


def _per_trajectory_terms(tree, actions, preset):
  """Per trajectory: the gradient of w·Â and of each bias term ([N, nodes·K] each), and Σ_t w_t²."""
  batch = as_batch(tree, actions)
  advantages, _ = estimators.coupled_advantages(
      batch.rewards, batch.values, batch.logp_target, batch.logp_behavior, batch.mask,
      **preset.estimator.estimator_kwargs())
  advantages = np.asarray(advantages, np.float64)
  weights = np.asarray(synthetic.policy_weights_at_prox(batch, advantages, preset.actor), np.float64)
  rho = np.exp(batch.logp_target - batch.logp_behavior)
  delta_w, delta_a = weights - rho, advantages - batch.true_advantages
  factors = {"estimate": weights * advantages, "is_reference": rho * batch.true_advantages,
             "bias_policy": delta_w * batch.true_advantages, "bias_advantage": rho * delta_a,
             "bias_coupled": delta_w * delta_a}
  nodes, pi = states(tree, actions), _softmax(tree.logits_pi)
  k = tree.branching
  out = {}
  for name, factor in factors.items():         # Σ_t factor_t ∇log π(a_t|s_t), flattened over (node, b)
    grad = np.zeros((len(actions), tree.num_internal, k))
    rows = np.arange(len(actions))
    for t in range(tree.depth):
      score = np.eye(k)[actions[:, t]] - pi[nodes[:, t]]        # [N, K]
      grad[rows, nodes[:, t]] += factor[:, t, None] * score
    out[name] = grad.reshape(len(actions), -1)
  return out, weights, delta_a, nodes, batch


def decomposition(tree: TreeMDP, preset: str | presets.Preset, *, sample: int = 0, seed: int = 0) -> dict:
  """Each term of the two-channel decomposition, exact (sample = 0) or from `sample` μ-trajectories.

  Returns ‖·‖ of every term relative to ‖g*‖, the relative error of the estimate against
  g* and ∇J, the variance term, and (sampled) each term's vector with its standard errors.
  """
  preset = presets.get_preset(preset) if isinstance(preset, str) else preset
  if sample:
    actions = sample_trajectories(tree, sample, seed)
    probs = np.full(sample, 1.0 / sample)
  else:
    actions = all_trajectories(tree)
    logp_mu = np.log(_softmax(tree.logits_mu))[states(tree, actions), actions]
    probs = np.exp(logp_mu.sum(1))
  terms, weights, delta_a, nodes, _ = _per_trajectory_terms(tree, actions, preset)
  means = {name: probs @ value for name, value in terms.items()}
  grad_j, grad_is = (g.reshape(-1) for g in true_gradients(tree))
  norm_is = np.linalg.norm(grad_is)
  result = {name: float(np.linalg.norm(means[name]) / norm_is)
            for name in ("bias_policy", "bias_advantage", "bias_coupled")}
  result["bias_total"] = float(np.linalg.norm(means["estimate"] - grad_is) / norm_is)
  result["error_vs_true_gradient"] = float(np.linalg.norm(means["estimate"] - grad_j) / np.linalg.norm(grad_j))
  # Var(ΔA | s, a): the state-action pair (s_t, a_t) is the child node, shared by every continuation.
  child = tree.branching * nodes + 1 + actions
  conditional_var = np.zeros_like(delta_a)
  for t in range(tree.depth):
    ids = child[:, t]
    moment = lambda x, ids=ids: np.bincount(ids, probs * x, minlength=ids.max() + 1)
    mass = np.maximum(moment(np.ones_like(probs)), 1e-300)
    mean, second = moment(delta_a[:, t]) / mass, moment(delta_a[:, t] ** 2) / mass
    conditional_var[:, t] = np.maximum(second - mean ** 2, 0.0)[ids]
  result["variance_term"] = float(probs @ (weights ** 2 * conditional_var).sum(1))
  estimate_centered = terms["estimate"] - means["estimate"]
  result["gradient_variance_trace"] = float(probs @ (estimate_centered ** 2).sum(1))
  result["masked_fraction"] = float(probs @ (weights == 0).mean(1))
  if sample:
    result["vectors"] = {name: means[name] for name in means}
    result["standard_errors"] = {name: value.std(0) / np.sqrt(sample) for name, value in terms.items()}
  else:
    result["vectors"] = means
  result["g_star"], result["grad_j"] = grad_is, grad_j
  return result



def kl_gradient(tree: TreeMDP) -> np.ndarray:
  """∇_θ Σ_s d^μ(s) KL(μ_s‖π_s) = −E_μ[Σ_t ∇log π(a_t|s_t)], flattened over (node, action):
  a step along it moves π away from the behaviour policy."""
  k, pi, mu = tree.branching, _softmax(tree.logits_pi), _softmax(tree.logits_mu)
  grad, reach = np.zeros_like(pi), np.zeros(tree.num_internal)
  reach[0] = 1.0
  for node in range(tree.num_internal):
    grad[node] = reach[node] * (pi[node] - mu[node])
    children = np.arange(k * node + 1, k * node + k + 1)
    internal = children[children < tree.num_internal]
    reach[internal] = reach[node] * mu[node][:len(internal)]
  return grad.reshape(-1)


def whitened_update(tree: TreeMDP, preset: str | presets.Preset, *, whiten: str,
                    critic_offset: float = 0.0) -> np.ndarray:
  """The exact expected actor update E_μ[Σ_t w_t · whiten(Â)_t ∇log π(a_t|s_t)] at θ = θ_prox,
  flattened over (node, action), with the critic's values lowered by `critic_offset` (> 0: a critic
  below its targets, as a fresh value head) and whitening `whiten` (`estimators.whiten`, or "plain":
  the usual (Â − m)/σ, the rule before the corrected one). m and σ are the μ-expectations over
  the tokens the policy channel keeps, as a batch of all trajectories would give them."""
  preset = presets.get_preset(preset) if isinstance(preset, str) else preset
  actions = all_trajectories(tree)
  nodes = states(tree, actions)
  probs = np.exp(np.log(_softmax(tree.logits_mu))[nodes, actions].sum(1))
  batch = as_batch(tree, actions)
  batch = dataclasses.replace(batch, values=batch.values - critic_offset)
  advantages = np.asarray(estimators.coupled_advantages(
      batch.rewards, batch.values, batch.logp_target, batch.logp_behavior, batch.mask,
      **preset.estimator.estimator_kwargs())[0], np.float64)
  weights = np.asarray(synthetic.policy_weights_at_prox(
      batch, np.where(advantages == 0, 1e-9, advantages), preset.actor), np.float64)
  kept = probs[:, None] * (weights != 0)
  mean = (kept * advantages).sum() / kept.sum()
  std = np.sqrt((kept * np.square(advantages - mean)).sum() / kept.sum())
  carried = np.clip(np.exp(batch.logp_target - batch.logp_behavior), *preset.estimator.rho_clip)
  whitened = {"none": advantages, "scale": advantages / std, "plain": (advantages - mean) / std,
              "center": (advantages - mean * carried) / std}[whiten]
  k, pi = tree.branching, _softmax(tree.logits_pi)
  grad = np.zeros((tree.num_internal, k))
  for t in range(tree.depth):
    score = np.eye(k)[actions[:, t]] - pi[nodes[:, t]]
    np.add.at(grad, nodes[:, t], (probs * weights[:, t] * whitened[:, t])[:, None] * score)
  return grad.reshape(-1)
