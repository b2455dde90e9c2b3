"""Tokens/s of `coupled_advantages` against rlax V-trace, a bare recurrence and NumPy.

  python -m experiments.bench_estimators            # B = 64, T ∈ {1024, 4096, 16384}

All timings come from the same run. The jitted implementations are timed in
interleaved rounds (each round: the best of `--calls` calls of every one of them,
after a compile/warm-up call), so a slow spell of a shared machine hits all of
them alike; the table shows medians over `--rounds` rounds, and each ratio is the
median of the per-round ratios with its range over the rounds. copc_jax handles
masks (20% tool tokens), rewards on tool tokens and bootstrap values; rlax's
V-trace and the bare one-carry recurrence handle none of them and set the
reference and the ceiling.
"""

import argparse
import functools
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import rlax

from copc_jax import estimators


def best_time(fn, *args, repeats):
  """Best wall time of `repeats` calls (the caller has already compiled `fn`)."""
  best = float("inf")
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    best = min(best, time.perf_counter() - start)
  return best


def interleaved_times(jobs, *, rounds, calls):
  """{name: [best time of `calls` calls in each round]} for jobs = {name: (fn, args)}.

  Every job runs in every round, so a slow spell of the machine hits all of them alike.
  """
  for fn, args in jobs.values():
    jax.block_until_ready(fn(*args))   # compile and warm up
  times = {name: [] for name in jobs}
  for _ in range(rounds):
    for name, (fn, args) in jobs.items():
      times[name].append(best_time(fn, *args, repeats=calls))
  return times


def paired_ratio(times, name, reference):
  """Median and range over rounds of time(reference) / time(name) (> 1: `name` is faster)."""
  ratios = np.asarray(times[reference]) / np.asarray(times[name])
  return float(np.median(ratios)), float(ratios.min()), float(ratios.max())


@jax.jit
def rlax_vtrace(rewards, values, target_logprobs, behavior_logprobs, bootstrap_value):
  """rlax V-trace from the same inputs as copc_jax: ratios and next values built here."""
  values_next = jnp.concatenate([values[:, 1:], bootstrap_value[:, None]], axis=1)
  ratios = jnp.exp(target_logprobs - behavior_logprobs)
  out = jax.vmap(functools.partial(rlax.vtrace_td_error_and_advantage, lambda_=1.0,
                                   clip_rho_threshold=1.0, clip_pg_rho_threshold=1.0))(
      values, values_next, rewards, jnp.ones_like(rewards), ratios)
  return out.errors, out.pg_advantage


@jax.jit
def bare_recurrence(a, b):
  """x_t = a_t + b_t x_{t+1}: one carry, two inputs, no masks: the ceiling."""
  def step(x, ab):
    x = ab[0] + ab[1] * x
    return x, x
  _, xs = jax.lax.scan(step, jnp.zeros(a.shape[0]), (a.T, b.T), reverse=True)
  return xs.T


def numpy_reverse_loop(rewards, values, log_ratio, mask, bootstrap, gamma=1.0, lam=1.0,
                       rho_clip=(0.5, 2.0), trace_clip=(0.5, 1.0)):
  """The same recursion in NumPy, vectorised over the batch, a Python loop over time."""
  ratio = np.exp(np.where(mask, log_ratio, 0.0))
  rho, trace = np.clip(ratio, *rho_clip), gamma * lam * np.clip(ratio, *trace_clip)
  g, u = np.zeros(rewards.shape[0], np.float32), gamma * bootstrap
  out = np.zeros_like(rewards)
  for t in reversed(range(rewards.shape[1])):
    m = mask[:, t]
    g = np.where(m, rho[:, t] * (rewards[:, t] - values[:, t] + u) + trace[:, t] * g, g)
    u = np.where(m, gamma * values[:, t], u + rewards[:, t])
    out[:, t] = g
  return out


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--batch", type=int, default=64)
  parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384])
  parser.add_argument("--rounds", type=int, default=15)
  parser.add_argument("--calls", type=int, default=5)
  parser.add_argument("--tool-fraction", type=float, default=0.2)
  args = parser.parse_args()
  print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}, B = {args.batch}, "
        f"{args.tool_fraction:.0%} tool tokens, {args.rounds} interleaved rounds of best-of-{args.calls}, "
        f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}")
  header = (f"{'T':>6} | {'copc scan':>9} {'copc assoc':>10} {'rlax vtrace':>11} {'bare scan':>9}"
            f" {'numpy':>6} | {'scan/rlax (range)':>18} {'assoc/rlax':>10} {'bare/rlax':>9}")
  print("tokens/s in millions (median over rounds); ratios: median of per-round ratios")
  print(header)
  print("-" * len(header))
  for length in args.lengths:
    rng = np.random.default_rng(length)
    shape = (args.batch, length)
    rewards = rng.normal(size=shape).astype(np.float32)
    values = rng.normal(size=shape).astype(np.float32)
    target = (-rng.random(shape)).astype(np.float32)
    behaviour = (target + 0.3 * rng.normal(size=shape)).astype(np.float32)
    mask = rng.random(shape) >= args.tool_fraction
    bootstrap = rng.normal(size=args.batch).astype(np.float32)
    device = [jax.device_put(x) for x in (rewards, values, target, behaviour, mask, bootstrap)]
    jobs = {impl: (functools.partial(copc_call, impl=impl), device) for impl in estimators.SCAN_IMPLS}
    jobs["rlax"] = (rlax_vtrace, (*device[:4], device[5]))
    jobs["bare"] = (bare_recurrence, device[:2])
    times = interleaved_times(jobs, rounds=args.rounds, calls=args.calls)
    start = time.perf_counter()
    numpy_reverse_loop(rewards, values, target - behaviour, mask, bootstrap)
    times["numpy"] = [time.perf_counter() - start]
    rate = {k: args.batch * length / float(np.median(v)) / 1e6 for k, v in times.items()}
    scan, scan_lo, scan_hi = paired_ratio(times, "scan", "rlax")
    print(f"{length:>6} | {rate['scan']:>9.1f} {rate['associative']:>10.1f} {rate['rlax']:>11.1f}"
          f" {rate['bare']:>9.1f} {rate['numpy']:>6.1f} |"
          f" {f'{scan:.2f} ({scan_lo:.2f}-{scan_hi:.2f})':>18}"
          f" {paired_ratio(times, 'associative', 'rlax')[0]:>10.2f}"
          f" {paired_ratio(times, 'bare', 'rlax')[0]:>9.2f}")


def copc_call(rewards, values, target, behaviour, mask, bootstrap, *, impl):
  return estimators.coupled_advantages(rewards, values, target, behaviour, mask,
                                       bootstrap_value=bootstrap, impl=impl)


if __name__ == "__main__":
  main()
