"""The policy's distribution under the sampling settings: one definition for the server and the learner.

The log-probability of a token is taken under the distribution it is sampled
from: logits / temperature, restricted to the top-k tokens and then to the
smallest nucleus of mass ≥ top_p, renormalised:

    log π(y) = log softmax(z / τ)[y] − log Σ_{v ∈ kept(z)} softmax(z / τ)[v]   (y ∈ kept(z))
    log π(y) = −inf                                                             (y ∉ kept(z))

`kept_log_probs` is that definition. The server samples from it and records log μ
with it; the learner computes log π_prox and log π_θ with it and the same settings
(`SamplingParams`, carried by the learner's config), so on-policy data has ratios
of exactly 1 at any setting. The kept set is the policy's own: π_θ truncates
its own logits, so a token outside π_θ's nucleus has log π_θ = −inf, ratio 0, and
is masked by the policy channel. top_k = 0 and top_p = 1 disable the truncations;
with both disabled the sort is skipped (for static settings).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """Temperature and truncations of the sampling distribution (and of the learner's π)."""

  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = 0                 # 0: no top-k

  def __post_init__(self):
    if not (isinstance(self.temperature, int | float) and np.isfinite(self.temperature)
            and self.temperature > 0):
      raise ValueError(f"temperature must be > 0 and finite; got {self.temperature!r}")
    if not (isinstance(self.top_p, int | float) and 0 < self.top_p <= 1):
      raise ValueError(f"top_p must be in (0, 1]; got {self.top_p!r}")
    if not (isinstance(self.top_k, int) and not isinstance(self.top_k, bool) and self.top_k >= 0):
      raise ValueError(f"top_k must be >= 0 and an integer (0 = no top-k); got {self.top_k!r}")

  @property
  def truncates(self) -> bool:
    return self.top_k > 0 or self.top_p < 1


def kept_log_probs(logits_nv, temperature, top_p, top_k):
  """Renormalised log-probs of the truncated tempered distribution; −inf outside it.

  Options are scalars (Python numbers: the sort is skipped when nothing is
  truncated) or per-row arrays [N]; top_k = 0 keeps every token.
  """
  vocab = logits_nv.shape[-1]
  as_rows = lambda x, dtype: jnp.broadcast_to(jnp.asarray(x, dtype), logits_nv.shape[:1])[:, None]
  log_p = jax.nn.log_softmax(logits_nv.astype(jnp.float32) / as_rows(temperature, jnp.float32), axis=-1)
  static = all(isinstance(x, int | float) for x in (top_p, top_k))
  if static and top_k == 0 and top_p >= 1:
    return log_p
  order = jnp.argsort(-log_p, axis=-1)
  sorted_log_p = jnp.take_along_axis(log_p, order, axis=-1)
  rank = jnp.arange(vocab)[None]
  top_k = as_rows(top_k, jnp.int32)
  in_top_k = rank < jnp.where(top_k > 0, top_k, vocab)
  # Nucleus: keep a token if the mass strictly before it (within the top-k) is < top_p.
  probs = jnp.where(in_top_k, jnp.exp(sorted_log_p), 0.0)
  mass_before = jnp.cumsum(probs, axis=-1) - probs
  keep_sorted = in_top_k & (mass_before < as_rows(top_p, jnp.float32))
  keep_sorted = keep_sorted.at[:, 0].set(True)
  keep = jnp.zeros_like(keep_sorted).at[jnp.arange(logits_nv.shape[0])[:, None], order].set(keep_sorted)
  kept = jnp.where(keep, log_p, -jnp.inf)
  return kept - jax.scipy.special.logsumexp(kept, axis=-1, keepdims=True)


def sample(keys_n, logits_nv, temperature_n, top_p_n, top_k_n):
  """One token per row, drawn with that row's key, and its log-probability under the distribution."""
  log_probs = kept_log_probs(logits_nv, temperature_n, top_p_n, top_k_n)
  tokens = jax.vmap(jax.random.categorical)(keys_n, log_probs)
  return tokens, jnp.take_along_axis(log_probs, tokens[:, None], axis=-1)[:, 0]


def entropy(log_probs_nv):
  """−Σ_v π(v) log π(v), with −inf entries (truncated tokens) contributing 0, NaN-free gradients."""
  finite = jnp.isfinite(log_probs_nv)
  safe = jnp.where(finite, log_probs_nv, 0.0)
  return -jnp.sum(jnp.where(finite, jnp.exp(safe), 0.0) * safe, axis=-1)


def token_logprobs_and_entropy(logits_btv, tokens_bt, params: SamplingParams = SamplingParams()):
  """log π(y_t) and the entropy of π(· | y_<t) under `params`, logits[:, t − 1] predicting token t.

  Outputs are aligned with tokens; position 0 has no prediction and gets 0.
  """
  b, t, v = logits_btv.shape
  log_probs = kept_log_probs(logits_btv[:, :-1].reshape(b * (t - 1), v), params.temperature,
                             params.top_p, params.top_k)
  logp = jnp.take_along_axis(log_probs, tokens_bt[:, 1:].reshape(-1, 1), axis=-1).reshape(b, t - 1)
  token_entropy = entropy(log_probs).reshape(b, t - 1)
  pad = jnp.zeros((b, 1), jnp.float32)
  return jnp.concatenate([pad, logp], axis=1), jnp.concatenate([pad, token_entropy], axis=1)


def token_logprobs_and_entropy_chunked(hidden_btd, project, tokens_bt,
                                       params: SamplingParams = SamplingParams(), *, chunk: int):
  """`token_logprobs_and_entropy(project(hidden_btd), tokens_bt, params)` computed `chunk` positions at
  a time, each chunk's logits recomputed in the backward pass (`jax.checkpoint`): the [B, T, V]
  float32 logits never exist at once, only [B, chunk, V]. `project`: hidden [B, c, H] → logits."""
  b, t, d = hidden_btd.shape
  targets_bt = jnp.concatenate([tokens_bt[:, 1:], jnp.zeros_like(tokens_bt[:, :1])], axis=1)   # y_{t+1}
  pad = (-t) % chunk
  n = (t + pad) // chunk
  hidden_nbcd = jnp.pad(hidden_btd, ((0, 0), (0, pad), (0, 0))).reshape(b, n, chunk, d).swapaxes(0, 1)
  targets_nbc = jnp.pad(targets_bt, ((0, 0), (0, pad))).reshape(b, n, chunk).swapaxes(0, 1)

  @jax.checkpoint
  def one_chunk(hidden_bcd, targets_bc):
    logits_bcv = project(hidden_bcd)
    log_probs = kept_log_probs(logits_bcv.reshape(b * chunk, -1), params.temperature, params.top_p,
                               params.top_k)
    logp = jnp.take_along_axis(log_probs, targets_bc.reshape(-1, 1), axis=-1).reshape(b, chunk)
    return logp, entropy(log_probs).reshape(b, chunk)

  logp_nbc, entropy_nbc = jax.lax.map(lambda xs: one_chunk(*xs), (hidden_nbcd, targets_nbc))
  unchunk = lambda x_nbc: x_nbc.swapaxes(0, 1).reshape(b, n * chunk)[:, :t - 1]   # position t predicts t + 1
  pad_b1 = jnp.zeros((b, 1), jnp.float32)
  return (jnp.concatenate([pad_b1, unchunk(logp_nbc)], axis=1),
          jnp.concatenate([pad_b1, unchunk(entropy_nbc)], axis=1))


def sampling_logprobs(logits_btv, tokens_bt, *, temperature=1.0, top_p=1.0, top_k=0):
  """log π(y_t) of tokens already in a sequence (see `token_logprobs_and_entropy`)."""
  params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k)
  return token_logprobs_and_entropy(logits_btv, tokens_bt, params)[0]
