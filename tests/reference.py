"""Literal NumPy readings of the spec, one Python loop per trajectory: slow on purpose."""

import numpy as np


def coupled_advantages(rewards, values, target_logprobs, behavior_logprobs, mask, *,
                       gamma=1.0, lam=1.0, rho_clip=(0.5, 2.0), trace_clip=(0.5, 1.0),
                       bootstrap_value=None, advantage_form="trace"):
  rewards, values = np.asarray(rewards, np.float64), np.asarray(values, np.float64)
  log_ratio = np.asarray(target_logprobs, np.float64) - np.asarray(behavior_logprobs, np.float64)
  mask = np.asarray(mask, bool)
  batch, length = rewards.shape
  advantages, returns = np.zeros((batch, length)), np.zeros((batch, length))
  for b in range(batch):
    tokens = [t for t in range(length) if mask[b, t]]
    if not tokens:
      continue
    # Rewards at masked positions go to the closest preceding policy token.
    reward = {t: 0.0 for t in tokens}
    owner = None
    for t in range(length):
      if mask[b, t]:
        owner = t
      if owner is not None:
        reward[owner] += rewards[b, t]
    bootstrap = 0.0 if bootstrap_value is None else float(bootstrap_value[b])
    g_next, ret_next, v_next = 0.0, bootstrap, bootstrap
    for t in reversed(tokens):
      ratio = np.exp(log_ratio[b, t])
      if np.isfinite(log_ratio[b, t]):
        rho = np.clip(ratio, *rho_clip)
        trace = lam * np.clip(ratio, *trace_clip)
      else:
        rho = trace = 0.0
      delta = reward[t] + gamma * v_next - values[b, t]
      g = rho * delta + gamma * trace * g_next
      returns[b, t] = values[b, t] + g
      if advantage_form == "trace":
        advantages[b, t] = g
      else:
        advantages[b, t] = rho * (reward[t] + gamma * (lam * ret_next + (1 - lam) * v_next)
                                  - values[b, t])
      g_next, ret_next, v_next = g, returns[b, t], values[b, t]
  return advantages, returns


def gae(rewards, values, mask, *, gamma=1.0, lam=1.0, bootstrap_value=None):
  """Textbook GAE over the policy tokens (masked positions skipped, their rewards carried back)."""
  zeros = np.zeros(np.shape(rewards))
  adv, ret = coupled_advantages(rewards, values, zeros, zeros, mask, gamma=gamma, lam=lam,
                                rho_clip=(1.0, 1.0), trace_clip=(1.0, 1.0),
                                bootstrap_value=bootstrap_value)
  return adv, ret


def gae_textbook(rewards, values, gamma, lam, bootstrap=0.0):
  """A_t = Σ_k (γλ)^k δ_{t+k} for one unmasked sequence, by the sum formula."""
  values_next = np.append(values[1:], bootstrap)
  deltas = rewards + gamma * values_next - values
  length = len(rewards)
  return np.array([sum((gamma * lam) ** (k - t) * deltas[k] for k in range(t, length))
                   for t in range(length)])
