"""Random trajectory batches with the layout of real rollouts, for tests and benchmarks.

Rows are [prompt | response with one tool span | padding]; behaviour log-probs
are the actor's own plus Gaussian noise (a stand-in for a stale sampler).
"""

from __future__ import annotations

import numpy as np

from copc_jax.sampling import token_logprobs_and_entropy
from copc_jax.train.batch import TrajectoryBatch


def random_batch(actor, *, batch_size: int, prompt_length: int, response_length: int,
                 seed: int = 0, logprob_noise: float = 0.2, tool_span: int = 3,
                 learner_version: int = 10) -> TrajectoryBatch:
  rng = np.random.default_rng(seed)
  length = prompt_length + response_length
  vocab = actor.config.vocab_size
  tokens = rng.integers(3, vocab, size=(batch_size, length)).astype(np.int32)
  ends = rng.integers(prompt_length + tool_span + 2, length + 1, size=batch_size)
  positions = np.arange(length)[None]
  attention_mask = positions < ends[:, None]
  tokens = np.where(attention_mask, tokens, 0)
  mask = attention_mask & (positions >= prompt_length)
  tool_start = prompt_length + (ends - prompt_length - tool_span) // 2
  in_tool = (positions >= tool_start[:, None]) & (positions < tool_start[:, None] + tool_span)
  mask &= ~in_tool
  logp, _ = token_logprobs_and_entropy(actor(tokens, attention_mask_bt=attention_mask), tokens)
  behaviour = np.asarray(logp) + logprob_noise * rng.normal(size=logp.shape)
  rewards = np.zeros((batch_size, length), np.float32)
  last = np.where(mask, positions, -1).max(axis=1)
  rewards[np.arange(batch_size), last] = rng.integers(0, 2, size=batch_size)
  versions = learner_version - rng.integers(0, 4, size=(batch_size, length))
  return TrajectoryBatch(
      tokens=tokens, attention_mask=attention_mask, mask=mask,
      behavior_logprobs=np.where(mask, behaviour, 0.0).astype(np.float32),
      versions=np.where(mask, versions, 0).astype(np.int32), rewards=rewards,
      group_ids=np.broadcast_to(np.arange(batch_size, dtype=np.int32)[:, None] // 2, (batch_size, length)))
