"""Learner step time and tokens/s, split into forward pass, estimator and update.

  python experiments/bench_learner.py                       # tiny and ~100M-parameter configs
  python experiments/bench_learner.py --configs tiny --steps 3

For each config, measured in the same run: the full jitted train step (one
epoch, one minibatch, COPC preset), the actor + critic forward pass alone (the
recomputation of log π_prox and V), and `coupled_advantages` alone on the same
[B, T]. "update" is the rest: backward passes and the two AdamW updates.
"""

import argparse
import time

import jax
from flax import nnx

from copc_jax import estimators, presets
from copc_jax.models import tiny
from copc_jax.models.decoder import Decoder, ValueModel
from copc_jax.sampling import token_logprobs_and_entropy
from copc_jax.train import Learner, LearnerConfig
from copc_jax.train.fake_data import random_batch
from copc_jax.train.learner import state_values

CONFIGS = {
    # name: (model overrides, batch size, prompt length, response length)
    "tiny": (dict(), 8, 32, 96),
    "100m": (dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_layers=12,
                  num_heads=12, num_kv_heads=4, head_dim=64, tie_word_embeddings=True), 4, 64, 192),
}


def best_of(fn, steps):
  times = []
  for _ in range(steps):
    start = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - start)
  return min(times)


def bench(name, steps):
  overrides, batch_size, prompt, response = CONFIGS[name]
  config = tiny.tiny_config("qwen2", **overrides)
  actor = Decoder(config, rngs=nnx.Rngs(0))
  critic = ValueModel.from_policy(actor, rngs=nnx.Rngs(1))
  n_params = sum(x.size for x in jax.tree.leaves(nnx.state(actor, nnx.Param)))
  batch = random_batch(actor, batch_size=batch_size, prompt_length=prompt, response_length=response)
  preset = presets.get_preset("copc")

  @nnx.jit
  def forward(actor, critic, batch):
    logp, _ = token_logprobs_and_entropy(actor(batch.tokens, attention_mask_bt=batch.attention_mask),
                                         batch.tokens)
    return logp, state_values(critic, batch)

  logp, values = forward(actor, critic, batch)
  estimate = lambda: estimators.coupled_advantages(batch.rewards, values, logp, batch.behavior_logprobs,
                                                   batch.mask, **preset.estimator.estimator_kwargs())
  learner = Learner(actor, critic, LearnerConfig(estimator=preset.estimator, actor=preset.actor))
  learner.train_step(batch)  # compile
  t_forward = best_of(lambda: forward(learner.actor, learner.critic, batch), steps)
  t_estimator = best_of(estimate, max(steps, 20))
  t_step = best_of(lambda: learner.train_step(batch)["actor_loss"], steps)
  tokens = batch_size * (prompt + response)
  t_update = t_step - t_forward - t_estimator
  print(f"{name:>5} | {n_params / 1e6:>7.1f}M | {batch_size:>2}×{prompt + response:<4} | {t_step:>8.3f} s"
        f" | {tokens / t_step:>9.0f} | {100 * t_forward / t_step:>6.1f}% | "
        f"{100 * t_estimator / t_step:>8.3f}% | {100 * t_update / t_step:>6.1f}%")


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
  parser.add_argument("--steps", type=int, default=3)
  args = parser.parse_args()
  print(f"jax {jax.__version__}, {jax.device_count()} × {jax.devices()[0].device_kind}; "
        f"best of {args.steps} steps after compilation")
  print(f"{'model':>5} | {'params':>8} | {'B×T':<7} | {'step':>10} | {'tokens/s':>9} | {'fwd':>7} | "
        f"{'estimator':>9} | {'update':>7}")
  for name in args.configs:
    bench(name, args.steps)


if __name__ == "__main__":
  main()
