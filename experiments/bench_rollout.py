"""Decode throughput: JetStream servers and the in-process backend vs on-device generation of one model.

  python -m experiments.bench_rollout                 # small model, 4 slots, 64 new tokens
  python -m experiments.bench_rollout --servers 1 2 4
  python -m experiments.bench_rollout --hidden 128 --layers 4 --slots 8 --prompt 16 --new-tokens 32
  python -m experiments.bench_rollout --hidden 768 --layers 12 --slots 8 --prompt 16 --new-tokens 32 \
      --servers 1 --out experiments/bench_rollout_100m.json     # the 100M model: the device step dominates
  python -m experiments.bench_rollout --render   # docs/results.md tables from both JSONs

Measured in the same run: (0) the reference: the whole batch generated in one jitted
call, prefill and a `lax.fori_loop` of sample + decode steps on the device (the
fastest way JAX generates on one host); (1) a Python loop of the same jitted step
(no JetStream, no gRPC); (2) the in-process backend (`rollout/in_process.py`: the servers' engine
driven in this process, `steps_per_call` decode steps per jitted `while_loop`) with `slots`
concurrent requests; (3) N servers with `slots` requests in flight per server through the RL
service. Tokens/s count tokens actually returned (a generation may
end early on EOS); ratios are against the on-device reference.
"""

import argparse
import json
import os
import resource
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from copc_jax import sampling
from copc_jax.models import hf_io, tiny
from copc_jax.models.decoder import Decoder, KVCache
from copc_jax.rollout.in_process import InProcessBackend
from copc_jax.rollout.pool import RolloutPool
from experiments import study


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


def on_device_tokens_per_s(model: Decoder, slots: int, prompt_len: int, new_tokens: int,
                           max_length: int, rounds: int) -> float:
  """Prefill and every decode step in one jitted call (`lax.fori_loop`), KV cache on the device."""
  graphdef, params = nnx.split(model)

  @jax.jit
  def generate(params, prompt, rng):
    decoder = nnx.merge(graphdef, params)
    cache = KVCache.create(model.config, batch=slots, max_length=max_length)
    logits, cache = decoder.decode(prompt, jnp.broadcast_to(jnp.arange(prompt_len), prompt.shape), cache)
    ones = jnp.ones((slots,))

    def step(t, carry):
      logits, cache, tokens = carry
      keys = jax.random.split(jax.random.fold_in(rng, t), slots)
      next_tokens, _ = sampling.sample(keys, logits, ones, ones, jnp.zeros((slots,), jnp.int32))
      logits, cache = decoder.decode_rows(next_tokens, jnp.full((slots,), prompt_len + t, jnp.int32), cache)
      return logits, cache, tokens.at[:, t].set(next_tokens)
    tokens = jnp.zeros((slots, new_tokens), jnp.int32)
    return jax.lax.fori_loop(0, new_tokens, step, (logits[:, -1], cache, tokens))[2]

  prompt = jnp.asarray(np.random.default_rng(0).integers(3, model.config.vocab_size,
                                                         size=(slots, prompt_len)), jnp.int32)
  best = 0.0
  for r in range(rounds + 1):                 # round 0 compiles
    start = time.perf_counter()
    jax.block_until_ready(generate(params, prompt, jax.random.key(r)))
    if r:
      best = max(best, slots * new_tokens / (time.perf_counter() - start))
  return best


def in_process_tokens_per_s(model: Decoder, slots: int, prompt_len: int, new_tokens: int, max_length: int,
                            rounds: int, steps_per_call: int) -> float:
  """`slots` concurrent requests (one thread each, as the episode workers call it) on the in-process
  backend; the best round after a warm-up."""

  rng = np.random.default_rng(1)
  backend = InProcessBackend(model, slots=slots, max_prefill_length=32, max_length=max_length,
                             steps_per_call=steps_per_call)
  best = 0.0
  try:
    with ThreadPoolExecutor(slots) as executor:
      for r in range(rounds + 1):
        requests = [dict(token_ids=rng.integers(3, model.config.vocab_size, size=prompt_len).tolist(),
                         max_tokens=new_tokens) for _ in range(slots)]
        start = time.perf_counter()
        outs = list(executor.map(lambda q: backend.generate(**q), requests))
        if r:
          best = max(best, sum(len(o.token_ids) for o in outs) / (time.perf_counter() - start))
  finally:
    backend.close()
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


def thread_cpu_s(pid: int) -> dict:
  """CPU seconds of a process's threads by kind (Linux /proc): XLA's compute threads, the rest."""
  ticks = os.sysconf("SC_CLK_TCK")
  totals = {"xla_compute": 0.0, "python_and_grpc": 0.0}
  for task in os.listdir(f"/proc/{pid}/task"):
    try:
      with open(f"/proc/{pid}/task/{task}/comm") as f:
        name = f.read().strip()
      with open(f"/proc/{pid}/task/{task}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    except FileNotFoundError:       # the thread ended
      continue
    kind = "xla_compute" if name.startswith("tf_XLA") else "python_and_grpc"
    totals[kind] += (int(fields[11]) + int(fields[12])) / ticks     # utime + stime
  return totals


def served_round_costs(pool: RolloutPool, concurrent: int, prompt_len: int, new_tokens: int, vocab: int,
                       rounds: int, slots: int) -> dict:
  """Per served round (`concurrent` requests): its wall time, the CPU it took (the servers' XLA
  compute threads, their Python and gRPC threads, this client), and how many slot-steps the servers
  decoded per returned token (1.0: every slot of every engine step produced a returned token)."""
  rng = np.random.default_rng(3)
  pids = [s.process.process.pid for s in pool.servers]
  make = lambda: [dict(token_ids=rng.integers(3, vocab, size=prompt_len).tolist(), max_tokens=new_tokens)
                  for _ in range(concurrent)]
  pool.generate_many(make(), max_workers=concurrent)                 # warm
  calls = lambda: sum(s.report["engine_calls"]["generate"] * s.report["decode_steps"] for s in pool.status())
  cpu = lambda: [thread_cpu_s(pid) for pid in pids]
  steps0, cpu0, client0, start, tokens = calls(), cpu(), time.process_time(), time.perf_counter(), 0
  for _ in range(rounds):
    tokens += sum(len(o.token_ids) for o in pool.generate_many(make(), max_workers=concurrent))
  wall, client = time.perf_counter() - start, time.process_time() - client0
  steps, cpu1 = calls() - steps0, cpu()
  per_round = lambda kind: 1e3 * sum(b[kind] - a[kind] for a, b in zip(cpu0, cpu1)) / rounds
  return {"round_ms": 1e3 * wall / rounds, "tokens_per_round": tokens / rounds,
          "server_xla_compute_cpu_ms": per_round("xla_compute"),
          "server_python_grpc_cpu_ms": per_round("python_and_grpc"), "client_cpu_ms": 1e3 * client / rounds,
          "slot_steps_per_token": steps * slots / tokens}


def one_request_s(pool: RolloutPool, prompt_len: int, new_tokens: int, vocab: int, rounds: int):
  """Best wall time of one request alone and the tokens it got (a random model may stop early)."""
  rng = np.random.default_rng(2)
  best = (float("inf"), 0)
  for r in range(rounds + 1):
    start = time.perf_counter()
    out = pool.generate(rng.integers(3, vocab, size=prompt_len).tolist(), max_tokens=new_tokens)
    elapsed = time.perf_counter() - start
    if r and elapsed < best[0]:
      best = (elapsed, len(out.token_ids))
  return best


RESULTS = study.beside(__file__)
RESULTS_100M = study.beside(__file__, "_100m.json")     # --hidden 768 --layers 12: marker `rollout_100m`
README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs",
                      "results.md")


def render(results_path: str = RESULTS, readme: str = README, marker: str = "rollout") -> str:
  """docs/results.md's rollout table and cost breakdown, from the benchmark's JSON (between `marker`'s
  markers)."""

  with open(results_path) as f:
    r = json.load(f)
  lines = [f"Model {r['parameters'] / 1e6:.2f}M parameters, {r['slots']} slots per server, "
           f"{r['prompt']}-token prompts, {r['new_tokens']} new tokens; best of {r['rounds']} served rounds "
           f"(of {r.get('reference_rounds', r['rounds'])} for the in-process loops) after a warm-up (commit "
           f"{r['git_commit'][:10]}; `{r['command']}`).", "",
           "| path | tokens/s | vs on-device reference | peak memory per server (GiB) |", "|---|---:|---:|---|"]
  for row in r["rows"]:
    if row["path"] == "gRPC":
      name = (f"{row['servers']} server(s) through gRPC, {row['decode_steps']} decode step(s) per engine call, "
              f"{row['concurrent']} concurrent requests")
      peaks = ", ".join(f"{p:.2f}" for p in row["peak_server_gib"])
    else:
      name = {"on-device reference": "on-device reference: prefill + `lax.fori_loop` of sample + decode, "
              "one jitted call", "Python loop of the jitted step": "Python loop of the same jitted step (no "
              "JetStream, no gRPC)"}.get(row["path"]) or (
                  f"in-process backend, {row.get('steps_per_call')} decode steps per device call, "
                  f"{r['slots']} concurrent requests")
      peaks = "–"
    lines.append(f"| {name} | {row['tokens_per_s']:.0f} | {row['vs_reference']:.2f}× | {peaks} |")
  b, ratios = r["breakdown"], [x["vs_reference"] for x in r["rows"] if x["path"] == "gRPC"]
  in_process = [x for x in r["rows"] if x["path"] == "in-process backend"]
  lines += ["", f"Served: {min(ratios):.2f}–{max(ratios):.2f}× the reference"]
  if in_process:
    best = max(x["tokens_per_s"] for x in in_process)
    served = [x["tokens_per_s"] / best for x in r["rows"] if x["path"] == "gRPC"]
    lines[-1] += (f"; the in-process backend {max(x['vs_reference'] for x in in_process):.2f}×, and the served "
                  f"paths {min(served):.2f}–{max(served):.2f}× the best in-process row")
  lines[-1] += "."
  lines += [f"On the first served pool: one "
            f"request for one token costs {b['request_fixed_ms']:.1f} ms, each further token of a lone "
            f"request {b['served_step_ms']:.2f} ms, against {b['reference_step_ms']:.2f} ms per "
            f"{r['slots']}-slot step of the reference (prefill included)."]
  if "round" in b:
    c = b["round"]
    lines[-1] += (f" A served round ({c['tokens_per_round']:.0f} tokens, mean of 10) takes "
                  f"{c['round_ms']:.1f} ms of wall time and this CPU: the server's XLA compute threads "
                  f"{c['server_xla_compute_cpu_ms']:.1f} ms, its Python and gRPC threads "
                  f"{c['server_python_grpc_cpu_ms']:.1f} ms, the client {c['client_cpu_ms']:.1f} ms; the "
                  f"server decoded {c['slot_steps_per_token']:.2f} slot-steps per returned token (the "
                  f"reference: 1.00).")
  text = "\n".join(lines)
  study.write_between_markers(readme, marker, text)
  return text


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--hidden", type=int, default=256)
  parser.add_argument("--layers", type=int, default=4)
  parser.add_argument("--slots", type=int, default=4)
  parser.add_argument("--prompt", type=int, default=16)
  parser.add_argument("--new-tokens", type=int, default=64)
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--reference-rounds", type=int, default=20,
                      help="rounds of the in-process loops (30 ms each here; their best is the reference)")
  parser.add_argument("--servers", type=int, nargs="+", default=[1, 2, 4])
  parser.add_argument("--in-process-steps", type=int, nargs="+", default=[16],
                      help="decode steps per device call of the in-process backend")
  parser.add_argument("--decode-steps", type=int, nargs="+", default=[1, 4, 16],
                      help="tokens per slot per engine call on the servers")
  parser.add_argument("--concurrent", type=int, nargs="*", default=[],
                      help="also: this many concurrent requests on the largest number of servers")
  parser.add_argument("--out", help="also write the numbers here (JSON, with provenance)")
  parser.add_argument("--render", action="store_true", help="only rewrite the docs table from " + RESULTS)
  args = parser.parse_args()
  if args.render:
    print(render())
    if os.path.exists(RESULTS_100M):
      print(render(RESULTS_100M, marker="rollout_100m"))
    return
  rows = []
  max_length = 128
  with tempfile.TemporaryDirectory() as tmp:
    tiny.make_tiny_checkpoint(tmp, "qwen2", hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                              num_layers=args.layers, head_dim=args.hidden // 4)
    model, _ = hf_io.from_pretrained(tmp, load_tokenizer=False)
    params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    print(f"model: {params / 1e6:.2f}M parameters, {args.slots} slots, prompt {args.prompt}, "
          f"{args.new_tokens} new tokens; best of {args.rounds} served rounds ({args.reference_rounds} for the "
          f"in-process loops) after a warm-up round")
    reference = on_device_tokens_per_s(model, args.slots, args.prompt, args.new_tokens, max_length,
                                       args.reference_rounds)
    print(f"on-device generation (reference): {reference:8.1f} tokens/s")
    bare = bare_decode_tokens_per_s(model, args.slots, args.prompt, args.new_tokens, max_length,
                                    args.reference_rounds)
    print(f"Python loop of the jitted step:   {bare:8.1f} tokens/s   ({bare / reference:.2f}× reference)")
    rows += [{"path": "on-device reference", "tokens_per_s": reference},
             {"path": "Python loop of the jitted step", "tokens_per_s": bare}]
    for steps in args.in_process_steps:
      rate = in_process_tokens_per_s(model, args.slots, args.prompt, args.new_tokens, max_length,
                                     args.reference_rounds, steps)
      print(f"in-process backend, {steps} steps/call: {rate:8.1f} tokens/s   "
            f"({rate / reference:.2f}× reference)")
      rows.append({"path": "in-process backend", "steps_per_call": steps, "tokens_per_s": rate})
    cases = [(steps, n, n * args.slots) for steps in args.decode_steps for n in args.servers]
    cases += [(args.decode_steps[0], max(args.servers), c) for c in args.concurrent]
    for steps, n, concurrent in cases:
      with RolloutPool(tmp, num_servers=n, max_in_flight=max(args.slots, concurrent // n), slots=args.slots,
                       max_prefill_length=32, max_length=max_length, decode_steps=steps) as pool:
        rate = served_tokens_per_s(pool, concurrent, args.prompt, args.new_tokens, model.config.vocab_size,
                                   args.rounds)
        peaks = [s.report["memory"]["peak_resident_bytes"] / 2**30 for s in pool.status()]
        if (steps, n, concurrent) == cases[0]:        # where a served batch's time goes, on this pool
          breakdown = cost_breakdown(pool, args, model.config.vocab_size, reference)
          breakdown["round"] = served_round_costs(pool, concurrent, args.prompt, args.new_tokens,
                                                  model.config.vocab_size, 10, args.slots)
          print_round_costs(breakdown["round"], args.slots * args.new_tokens / reference)
      rows.append({"path": "gRPC", "servers": n, "decode_steps": steps, "concurrent": concurrent,
                   "tokens_per_s": rate, "peak_server_gib": peaks})
      print(f"{n} server(s) via gRPC, {steps} step(s)/call, {concurrent} concurrent: {rate:8.1f} tokens/s   "
            f"({rate / reference:.2f}× reference); peak memory per server: "
            f"{', '.join(f'{p:.2f}' for p in peaks)} GiB")
  peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
  print(f"peak memory of this process (the reference loops): {peak:.2f} GiB")
  if args.out:
    study.write_benchmark(args.out, {
        "description": __doc__.splitlines()[0], "parameters": int(params), "slots": args.slots,
        "prompt": args.prompt, "new_tokens": args.new_tokens, "rounds": args.rounds,
        "reference_rounds": args.reference_rounds,
        "rows": [{**r, "vs_reference": r["tokens_per_s"] / reference} for r in rows],
        "breakdown": breakdown, "peak_client_gib": peak})


def cost_breakdown(pool: RolloutPool, args, vocab: int, reference: float) -> dict:
  """A served request's fixed cost (one request, one token) and its cost per further decode step (one
  request, `new_tokens`), against the reference's time per decode step of a full batch."""
  fixed_s, _ = one_request_s(pool, args.prompt, 1, vocab, args.rounds)
  whole_s, tokens = one_request_s(pool, args.prompt, args.new_tokens, vocab, args.rounds)
  result = {"request_fixed_ms": 1e3 * fixed_s,
            "served_step_ms": 1e3 * (whole_s - fixed_s) / max(tokens - 1, 1),
            "reference_step_ms": 1e3 * args.slots / reference}
  print(f"one request: {result['request_fixed_ms']:.1f} ms fixed (1 token), then "
        f"{result['served_step_ms']:.2f} ms per decode step; the reference: "
        f"{result['reference_step_ms']:.2f} ms per step of {args.slots} slots (prefill included)")
  return result


def print_round_costs(costs: dict, reference_round_s: float) -> None:
  print(f"a served round: {costs['round_ms']:.1f} ms wall for {costs['tokens_per_round']:.0f} tokens "
        f"(the reference: {1e3 * reference_round_s:.1f} ms for its batch); CPU per round: servers' XLA "
        f"compute {costs['server_xla_compute_cpu_ms']:.1f} ms, their Python and gRPC threads "
        f"{costs['server_python_grpc_cpu_ms']:.1f} ms, this client {costs['client_cpu_ms']:.1f} ms; "
        f"{costs['slot_steps_per_token']:.2f} slot-steps decoded per returned token")


if __name__ == "__main__":
  main()
