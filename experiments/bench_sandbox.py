"""Per-call cost of the code sandbox against a bare interpreter start, measured in the same run.

  python -m experiments.bench_sandbox [--calls 30] [--concurrent 8]

Reference: `python -I -S -c "print(1)"` as a plain subprocess (the interpreter the sandbox runs).
Prints the median wall time of each and their ratio; with --concurrent, the same through a
SandboxPool (wall time per call when that many run at once).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import time

from copc_jax.envs import sandbox

CODE = "print(1)"


def median_ms(call, n: int) -> float:
  call()                                         # warm: filter compiled, page cache filled
  times = []
  for _ in range(n):
    start = time.perf_counter()
    call()
    times.append(time.perf_counter() - start)
  return 1e3 * statistics.median(times)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--calls", type=int, default=30)
  parser.add_argument("--concurrent", type=int, default=8)
  args = parser.parse_args()
  interpreter = sandbox.sandbox_interpreter()
  bare = median_ms(lambda: subprocess.run([interpreter, "-I", "-S", "-c", CODE], capture_output=True,
                                          check=True), args.calls)
  boxed = median_ms(lambda: sandbox.run_python(CODE), args.calls)
  print(f"interpreter {interpreter}, {os.cpu_count()} CPUs")
  print(f"bare interpreter:  {bare:7.1f} ms per call")
  print(f"sandboxed (bwrap): {boxed:7.1f} ms per call  ({boxed / bare:.2f}× the bare start, "
        f"+{boxed - bare:.1f} ms)")
  with sandbox.SandboxPool(max_concurrent=args.concurrent) as pool:
    start = time.perf_counter()
    results = pool.map([CODE] * (args.calls * 2))
    wall = time.perf_counter() - start
  assert all(r.status == "ok" for r in results), [r for r in results if r.status != "ok"][:1]
  print(f"{args.concurrent} at a time: {1e3 * wall / len(results):7.1f} ms of wall time per call")


if __name__ == "__main__":
  main()
