"""Decode throughput through JetStream servers vs a bare jitted decode loop of the same model.

  python experiments/bench_rollout.py                 # small model, 4 slots, 64 new tokens
  python experiments/bench_rollout.py --servers 1 2 4

Measured in the same run: (1) a bare loop of the engine's jitted sample + decode
step over `slots` rows (no JetStream, no gRPC); (2) one server receiving `slots`
concurrent requests per round through the RL service; (3) a pool of N servers
with `slots` requests in flight per server. Tokens/s count tokens actually
returned (a generation may end early on EOS).
"""

import argparse
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from copc_jax import sampling
from copc_jax.models import hf_io, tiny
from copc_jax.models.decoder import Decoder, KVCache
from copc_jax.rollout.pool import RolloutPool


def bare_decode_tokens_per_s(model: Decoder, slots: int, prompt_len: int, new_tokens: int,
                             max_length: int, rounds: int) -> float:
  graphdef, params = nnx.split(model)

  @jax.jit
  def step(params, tokens, positions, cache, rng):
    logits, cache = nnx.merge(graphdef, params).decode_rows(tokens, positions, cache)
    ones = jnp.ones((slots,))
    next_tokens, logprobs = sampling.sample(jax.random.split(rng, slots), logits, ones, ones,
                                            jnp.zeros((slots,), jnp.int32))
    return next_tokens, logprobs, cache

  @jax.jit
  def prefill(params, prompt):
    cache = KVCache.create(model.config, batch=slots, max_length=max_length)
    _, cache = nnx.merge(graphdef, params).decode(prompt, jnp.broadcast_to(jnp.arange(prompt_len),
                                                                          prompt.shape), cache)
    return cache

  prompt = jnp.asarray(np.random.default_rng(0).integers(3, model.config.vocab_size,
                                                         size=(slots, prompt_len)), jnp.int32)
  best = 0.0
  for r in range(rounds + 1):                 # round 0 compiles
    start = time.perf_counter()
    cache = prefill(params, prompt)
    tokens = prompt[:, -1]
    rng = jax.random.key(r)
    for t in range(new_tokens):
      rng, sub = jax.random.split(rng)
      tokens, _, cache = step(params, tokens, jnp.full((slots,), prompt_len + t, jnp.int32), cache, sub)
    jax.block_until_ready(tokens)
    if r:
      best = max(best, slots * new_tokens / (time.perf_counter() - start))
  return best


def served_tokens_per_s(pool: RolloutPool, concurrent: int, prompt_len: int, new_tokens: int,
                        vocab: int, rounds: int) -> float:
  rng = np.random.default_rng(1)
  best = 0.0
  for r in range(rounds + 1):                 # round 0 compiles every server
    requests = [dict(token_ids=rng.integers(3, vocab, size=prompt_len).tolist(), max_tokens=new_tokens)
                for _ in range(concurrent)]
    start = time.perf_counter()
    outs = pool.generate_many(requests, max_workers=concurrent)
    elapsed = time.perf_counter() - start
    if r:
      best = max(best, sum(len(o.token_ids) for o in outs) / elapsed)
  return best


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--hidden", type=int, default=256)
  parser.add_argument("--layers", type=int, default=4)
  parser.add_argument("--slots", type=int, default=4)
  parser.add_argument("--prompt", type=int, default=16)
  parser.add_argument("--new-tokens", type=int, default=64)
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--servers", type=int, nargs="+", default=[1, 2, 4])
  args = parser.parse_args()
  max_length = 128
  with tempfile.TemporaryDirectory() as tmp:
    tiny.make_tiny_checkpoint(tmp, "qwen2", hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                              num_layers=args.layers, head_dim=args.hidden // 4)
    model, _ = hf_io.from_pretrained(tmp, load_tokenizer=False)
    params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    print(f"model: {params / 1e6:.2f}M parameters, {args.slots} slots, prompt {args.prompt}, "
          f"{args.new_tokens} new tokens; best of {args.rounds} rounds after a warm-up round")
    bare = bare_decode_tokens_per_s(model, args.slots, args.prompt, args.new_tokens, max_length,
                                    args.rounds)
    print(f"bare jitted decode loop:   {bare:8.1f} tokens/s")
    for n in args.servers:
      with RolloutPool(tmp, num_servers=n, max_in_flight=args.slots, slots=args.slots,
                       max_prefill_length=32, max_length=max_length) as pool:
        rate = served_tokens_per_s(pool, n * args.slots, args.prompt, args.new_tokens,
                                   model.config.vocab_size, args.rounds)
      print(f"{n} server(s) via gRPC:     {rate:8.1f} tokens/s   ({rate / bare:.2f}× bare loop)")


if __name__ == "__main__":
  main()
