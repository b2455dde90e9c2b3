"""What one step of a jitted `lax.scan` costs on XLA's CPU backend, by what the loop carries and writes.

  python -m experiments.xla_cpu_loop_costs            # T = 16384 steps

The estimator's speed on CPU (see `bench_estimators.py`) is bounded by these costs,
not by its arithmetic. Every loop below runs x ← a_t + b_t · x over T steps of
`lanes` parallel values and differs only in how many [lanes] rows it writes per step
(the scanned outputs) and how many values it carries. XLA compiles a loop whose
body touches fewer than `xla_cpu_small_while_loop_byte_threshold` bytes per step
(1024 by default) into one kernel; any other loop runs its body's kernels one by
one at every step. The last column says which of the two XLA chose.
"""

import argparse
import os

import jax
import jax.numpy as jnp
import numpy as np

from experiments.bench_estimators import best_time


def recurrence(num_outputs, num_carries):
  """A jitted reverse scan over time-major [T, lanes] inputs a, b with the given outputs and carries."""
  def step(carry, ab):
    a_t, b_t = ab
    x = a_t + b_t * carry[0]
    carry = (x,) + tuple(c + x for c in carry[1:])
    return carry, tuple(x + i for i in range(num_outputs))

  @jax.jit
  def run(a, b):
    init = tuple(jnp.zeros(a.shape[1]) for _ in range(num_carries))
    carry, outputs = jax.lax.scan(step, init, (a, b), reverse=True)
    return carry, outputs
  return run


def compiled_as_one_kernel(fn, *args):
  return 'xla_cpu_small_call="true"' in fn.lower(*args).compile().as_text()


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--length", type=int, default=16384)
  parser.add_argument("--lanes", type=int, nargs="+", default=[8, 64])
  parser.add_argument("--repeats", type=int, default=100)
  args = parser.parse_args()
  print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}, T = {args.length}, "
        f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}; best of {args.repeats} calls")
  header = (f"{'lanes':>5} {'carries':>7} {'outputs':>7} | {'ms':>7} {'ns/step':>8} {'ns/lane-step':>12}"
            " | one kernel")
  print(header)
  print("-" * len(header))
  rng = np.random.default_rng(0)
  for lanes in args.lanes:
    a, b = (jnp.asarray(rng.random((args.length, lanes), np.float32)) for _ in range(2))
    for num_carries, num_outputs in ((1, 0), (1, 1), (1, 2), (2, 2)):
      fn = recurrence(num_outputs, num_carries)
      jax.block_until_ready(fn(a, b))   # compile and warm up
      seconds = best_time(fn, a, b, repeats=args.repeats)
      per_step = seconds / args.length * 1e9
      print(f"{lanes:>5} {num_carries:>7} {num_outputs:>7} | {seconds * 1e3:>7.3f} {per_step:>8.1f}"
            f" {per_step / lanes:>12.2f} | {'yes' if compiled_as_one_kernel(fn, a, b) else 'no'}")


if __name__ == "__main__":
  main()
