"""The learner's input: a padded batch of trajectories, token-aligned."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct


@struct.dataclass
class TrajectoryBatch:
  """Position t holds token y_t; per-token fields describe y_t (the first position is never a policy token).

  tokens:            int32 [B, T]  prompt + response (+ tool output) + padding
  attention_mask:    bool  [B, T]  real tokens (False on padding)
  mask:              bool  [B, T]  policy-generated tokens
  behavior_logprobs: float [B, T]  log μ(y_t) from the sampler
  versions:          int32 [B, T]  weights version that sampled y_t
  rewards:           float [B, T]  reward received after y_t
  group_ids:         int32 [B, T]  the prompt group of the row (n samples per prompt), on every
                                   position of the row; (`from_episodes`: each row its own
                                   group unless given)
  """

  tokens: jax.Array
  attention_mask: jax.Array
  mask: jax.Array
  behavior_logprobs: jax.Array
  versions: jax.Array
  rewards: jax.Array
  group_ids: jax.Array

  @classmethod
  def from_episodes(cls, trajectories, length: int | None = None, group_ids=None) -> TrajectoryBatch:
    """Right-padded batch of `trajectories` (`rollout.agent.Trajectory`: an episode's tokens, mask, log μ
    and versions); each trajectory's reward sits on its last generated token. `group_ids`: the prompt
    group of each trajectory (default: each its own)."""
    length = length or max(len(t.context) for t in trajectories)
    b = len(trajectories)
    tokens = np.zeros((b, length), np.int32)
    attention_mask = np.zeros((b, length), bool)
    mask = np.zeros((b, length), bool)
    logprobs = np.zeros((b, length), np.float32)
    versions = np.zeros((b, length), np.int32)
    rewards = np.zeros((b, length), np.float32)
    for i, t in enumerate(trajectories):
      n, p = len(t.context), len(t.prompt_ids)
      if n > length:
        raise ValueError(f"trajectory {i} has {n} tokens; the batch length is {length}")
      tokens[i, :n] = t.context
      attention_mask[i, :n] = True
      mask[i, p:n] = t.mask
      logprobs[i, p:n] = t.logprobs
      versions[i, p:n] = t.versions
      generated = np.nonzero(mask[i])[0]
      if len(generated):
        rewards[i, generated[-1]] = t.reward
    group_ids = np.arange(b) if group_ids is None else np.asarray(group_ids)
    if group_ids.shape != (b,):
      raise ValueError(f"group_ids must have one id per trajectory ({b}); got shape {group_ids.shape}")
    return cls(tokens=tokens, attention_mask=attention_mask, mask=mask, behavior_logprobs=logprobs,
               versions=versions, rewards=rewards,
               group_ids=np.broadcast_to(group_ids.astype(np.int32)[:, None], (b, length)).copy())

  def validate(self) -> None:
    shape = self.tokens.shape
    if len(shape) != 2:
      raise ValueError(f"tokens must be [B, T]; got shape {shape}")
    for name in ("attention_mask", "mask", "behavior_logprobs", "versions", "rewards", "group_ids"):
      if getattr(self, name).shape != shape:
        raise ValueError(f"{name} must have the shape of tokens {shape}; got {getattr(self, name).shape}")
    if bool(jnp.any(self.mask[:, 0])):
      raise ValueError("mask[:, 0] must be False: the first token has no preceding state")
    if bool(jnp.any(self.mask & ~self.attention_mask)):
      raise ValueError("mask marks padding positions (attention_mask False) as policy tokens")

  def staleness(self, learner_version: int) -> jax.Array:
    """learner version − version of each policy token (0 elsewhere)."""
    return jnp.where(self.mask, learner_version - self.versions, 0)


def padded_length(longest: int, max_length: int, multiple: int) -> int:
  """The time length of a batch whose longest row has `longest` tokens: `max_length` (multiple = 0:
  every batch one shape), or `longest` rounded up to a multiple of `multiple`, at most `max_length`
  (a few shapes, each compiled once; short batches do not pay for the longest context)."""
  if multiple <= 0:
    return max_length
  return min(max_length, -(-longest // multiple) * multiple)
