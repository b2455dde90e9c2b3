"""The sampling distribution and its log-probabilities, shared by the server and the learner.

The behaviour log-probability of a token is taken under the distribution it was
actually sampled from: logits / temperature, restricted to the top-k tokens and
then to the smallest nucleus of mass ≥ top_p, renormalised:

    log μ(y) = log softmax(z / τ)[y] − log Σ_{v ∈ kept} softmax(z / τ)[v]   (y kept)

The learner recomputes π_prox with `sampling_logprobs` and the same options, so
the ratio π_prox/μ compares like with like. top_k = 0 and top_p = 1 disable the
truncations; temperature must be > 0.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def kept_log_probs(logits_bv, temperature_b, top_p_b, top_k_b):
  """Renormalised log-probs of the truncated tempered distribution; −inf outside it.

  Per-row options: temperature_b, top_p_b float [B]; top_k_b int [B] (0 = all).
  """
  vocab = logits_bv.shape[-1]
  log_p = jax.nn.log_softmax(logits_bv.astype(jnp.float32) / temperature_b[:, None], axis=-1)
  order = jnp.argsort(-log_p, axis=-1)
  sorted_log_p = jnp.take_along_axis(log_p, order, axis=-1)
  rank = jnp.arange(vocab)[None]
  k = jnp.where(top_k_b > 0, top_k_b, vocab)[:, None]
  in_top_k = rank < k
  # Nucleus: keep a token if the mass strictly before it (within the top-k) is < top_p.
  probs = jnp.where(in_top_k, jnp.exp(sorted_log_p), 0.0)
  mass_before = jnp.cumsum(probs, axis=-1) - probs
  keep_sorted = in_top_k & (mass_before < top_p_b[:, None])
  keep_sorted = keep_sorted.at[:, 0].set(True)
  keep = jnp.zeros_like(keep_sorted).at[jnp.arange(logits_bv.shape[0])[:, None], order].set(keep_sorted)
  kept = jnp.where(keep, log_p, -jnp.inf)
  return kept - jax.scipy.special.logsumexp(kept, axis=-1, keepdims=True)


def sample(rng, logits_bv, temperature_b, top_p_b, top_k_b):
  """One token per row and its log-probability under the distribution sampled from."""
  log_probs = kept_log_probs(logits_bv, temperature_b, top_p_b, top_k_b)
  tokens = jax.random.categorical(rng, log_probs, axis=-1)
  return tokens, jnp.take_along_axis(log_probs, tokens[:, None], axis=-1)[:, 0]


def sampling_logprobs(logits_btv, tokens_bt, *, temperature=1.0, top_p=1.0, top_k=0):
  """log μ(y_t) for tokens already in a sequence, logits[:, t − 1] predicting token t.

  Aligned with tokens like `train.learner.token_logprobs_and_entropy`: position 0 gets 0.
  """
  b, t, v = logits_btv.shape
  flat = logits_btv[:, :-1].reshape(b * (t - 1), v)
  n = flat.shape[0]
  log_probs = kept_log_probs(flat, jnp.full((n,), temperature, jnp.float32),
                             jnp.full((n,), top_p, jnp.float32), jnp.full((n,), top_k, jnp.int32))
  picked = jnp.take_along_axis(log_probs, tokens_bt[:, 1:].reshape(n, 1), axis=-1).reshape(b, t - 1)
  return jnp.concatenate([jnp.zeros((b, 1), picked.dtype), picked], axis=1)
