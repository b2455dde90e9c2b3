"""Learner step time, tokens/s and model FLOP utilisation, split into forward pass, estimator and update.

  python -m experiments.bench_learner                       # tiny and ~100M-parameter configs
  python -m experiments.bench_learner --configs tiny --steps 3

For each config, measured in the same run: the full jitted train step (one
epoch, one minibatch, COPC preset), the actor + critic forward pass alone (the
recomputation of log π_prox and V), and `coupled_advantages` alone on the same
[B, T]. "update" is the rest: backward passes and the two AdamW updates. Also:
the step with a KL term to a frozen reference (one more forward pass), the
compile time of the step for 1 × 1 and 2 × 4 epochs × minibatches (one scan:
about the same), and MFU = the step's model FLOPs (`step_flops`) per second over
the rate of a dense float32 matmul (`--matmul` cubed) measured in the same run.
The peak resident memory of the process is printed at the end.
"""

import argparse
import dataclasses
import resource
import time

import jax
import jax.numpy as jnp
from flax import nnx

from copc_jax import estimators, presets
from copc_jax.models import tiny
from copc_jax.models.decoder import Decoder, ValueModel
from copc_jax.sampling import token_logprobs_and_entropy
from copc_jax.train import Learner, LearnerConfig
from copc_jax.train.fake_data import random_batch
from copc_jax.train.learner import state_values
from experiments import study

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


def matmul_flops_per_s(n: int, steps: int = 3) -> float:
  """The rate of a jitted n × n × n float32 matmul: the reference for MFU."""
  a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
  f = jax.jit(lambda x: x @ x)
  jax.block_until_ready(f(a))
  return 2 * n ** 3 / best_of(lambda: f(a), steps)


def forward_flops_per_token(config, sequence: int, lm_head: bool) -> float:
  """Matmul FLOPs of one forward pass per token: 2 × (weights used per token) + causal attention."""
  h, layers = config.hidden_size, config.num_layers
  q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
  per_layer = h * (q + 2 * kv) + q * h + 3 * h * config.intermediate_size
  attention = 2 * layers * sequence * q          # QK and AV over half the context on average
  return 2 * (layers * per_layer + (config.vocab_size * h if lm_head else h)) + attention


def step_flops(config, tokens: int, sequence: int, epochs: int = 1, kl: bool = False) -> float:
  """π_prox and V forwards, then per epoch actor and critic forward + backward (3 × forward)."""
  actor = forward_flops_per_token(config, sequence, lm_head=True)
  critic = forward_flops_per_token(config, sequence, lm_head=False)
  return tokens * ((actor + critic) * (1 + 3 * epochs) + (actor if kl else 0.0))


def compile_seconds(learner, batch) -> float:
  start = time.perf_counter()
  learner._step.lower(learner.state, batch, jax.random.key(0), learner.reference).compile()
  return time.perf_counter() - start


def bench(name, steps, matmul_rate):
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
  learner_config = LearnerConfig(estimator=preset.estimator, actor=preset.actor)
  learner = Learner(actor, critic, learner_config)
  learner.train_step(batch)  # compile
  t_forward = best_of(lambda: forward(learner.actor, learner.critic, batch), steps)
  t_estimator = best_of(estimate, max(steps, 20))
  t_step = best_of(lambda: learner.train_step(batch)["actor_loss"], steps)
  with_kl = Learner(learner.actor, learner.critic, dataclasses.replace(
      learner_config, actor=dataclasses.replace(preset.actor, kl_coef=0.05)))
  with_kl.train_step(batch)
  t_kl = best_of(lambda: with_kl.train_step(batch)["actor_loss"], steps)
  compiles = [compile_seconds(Learner(learner.actor, learner.critic, dataclasses.replace(
      learner_config, epochs=e, num_minibatches=m)), batch) for e, m in ((1, 1), (2, 4))]
  tokens = batch_size * (prompt + response)
  t_update = t_step - t_forward - t_estimator
  mfu = step_flops(config, tokens, prompt + response) / t_step / matmul_rate
  print(f"{name:>5} | {n_params / 1e6:>7.1f}M | {batch_size:>2}×{prompt + response:<4} | {t_step:>8.3f} s"
        f" | {tokens / t_step:>9.0f} | {100 * mfu:>5.1f}% | {100 * t_forward / t_step:>6.1f}% | "
        f"{100 * t_estimator / t_step:>8.3f}% | {100 * t_update / t_step:>6.1f}% | {t_kl / t_step:>5.2f}× | "
        f"{compiles[0]:>6.1f} s | {compiles[1]:>6.1f} s")
  return {"model": name, "parameters": int(n_params), "batch": batch_size, "sequence": prompt + response,
          "step_s": t_step, "tokens_per_s": tokens / t_step, "mfu": mfu, "forward_fraction": t_forward / t_step,
          "estimator_fraction": t_estimator / t_step, "update_fraction": t_update / t_step,
          "kl_step_ratio": t_kl / t_step, "compile_s_1x1": compiles[0], "compile_s_2x4": compiles[1]}


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
  parser.add_argument("--steps", type=int, default=3)
  parser.add_argument("--matmul", type=int, default=2048, help="size of the reference matmul")
  parser.add_argument("--out", help="also write the numbers here (JSON, with provenance)")
  args = parser.parse_args()
  rate = matmul_flops_per_s(args.matmul)
  print(f"jax {jax.__version__}, {jax.device_count()} × {jax.devices()[0].device_kind}; best of "
        f"{args.steps} steps after compilation; {args.matmul}³ float32 matmul: {rate / 1e9:.1f} GFLOP/s")
  print(f"{'model':>5} | {'params':>8} | {'B×T':<7} | {'step':>10} | {'tokens/s':>9} | {'MFU':>6} | "
        f"{'fwd':>7} | {'estimator':>9} | {'update':>7} | {'+KL':>6} | compile 1×1 | compile 2×4")
  rows = [bench(name, args.steps, rate) for name in args.configs]
  peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
  print(f"peak resident memory of this process: {peak:.2f} GiB")
  if args.out:
    study.write_benchmark(args.out, {"description": __doc__.splitlines()[0], "steps": args.steps,
                             "matmul_flops_per_s": rate, "rows": rows, "peak_resident_gib": peak})


if __name__ == "__main__":
  main()
