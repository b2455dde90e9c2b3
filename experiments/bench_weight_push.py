"""Weight push time: servers reading each version from a path vs the bytes streamed over gRPC.

  python experiments/bench_weight_push.py                   # the 100M config, 1 and 4 servers
  python experiments/bench_weight_push.py --out experiments/results/weight_push.json

A model of bench_learner's config is saved as two versions; for each number of local servers, a
pool pushes alternating versions `--rounds` times with `weight_transfer="path"` (each server reads
the safetensors file itself) and `"stream"` (this process reads it and streams 4 MiB chunks to every
server in parallel, as to servers that share no filesystem). Reported: the median seconds per push
(every server has swapped) and stream/path, measured in the same run.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_learner  # noqa: E402
import jax  # noqa: E402
from flax import nnx  # noqa: E402

from copc_jax.models import hf_io, tiny  # noqa: E402
from copc_jax.models.decoder import Decoder  # noqa: E402
from copc_jax.rollout.pool import RolloutPool  # noqa: E402
from copc_jax.rollout.process import ServerProcess  # noqa: E402


def save_versions(directory: str, config_name: str) -> tuple[list[str], float]:
  overrides = bench_learner.CONFIGS[config_name][0]
  config = tiny.tiny_config("qwen2", **overrides)
  paths = []
  for seed in (1, 2):
    model = Decoder(config, rngs=nnx.Rngs(seed))
    paths.append(os.path.join(directory, f"v{seed}"))
    hf_io.save_pretrained(model, paths[-1])
  params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  return paths, params


def time_pushes(addresses, paths, transfer: str, rounds: int, first_version: int) -> list[float]:
  times = []
  with RolloutPool(addresses=addresses, weight_transfer=transfer) as pool:
    for i in range(rounds + 1):                      # the first push of a pool resets: not timed
      start = time.perf_counter()
      pool.update_weights(paths[i % 2], first_version + i)
      if i:
        times.append(time.perf_counter() - start)
  return times


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--config", default="100m", choices=list(bench_learner.CONFIGS))
  parser.add_argument("--servers", type=int, nargs="+", default=[1, 4])
  parser.add_argument("--rounds", type=int, default=5)
  parser.add_argument("--out", help="also write the numbers here (JSON)")
  args = parser.parse_args()
  rows = []
  with tempfile.TemporaryDirectory() as tmp:
    paths, params = save_versions(tmp, args.config)
    size = os.path.getsize(os.path.join(paths[0], hf_io.SAFETENSORS_SINGLE))
    print(f"model {args.config}: {params / 1e6:.1f}M parameters, {size / 2**20:.0f} MiB per version; median of "
          f"{args.rounds} pushes\n")
    print("| servers | path (s) | stream (s) | stream / path |")
    print("|---:|---:|---:|---:|")
    for n in args.servers:
      servers = [ServerProcess(paths[0], slots=2, max_prefill_length=16, max_length=32, seed=i, version=-1)
                 for i in range(n)]
      try:
        addresses = [s.wait_ready(600) for s in servers]
        version = 0
        medians = {}
        for transfer in ("path", "stream"):
          medians[transfer] = statistics.median(time_pushes(addresses, paths, transfer, args.rounds, version))
          version += args.rounds + 1
      finally:
        for s in servers:
          s.stop()
      rows.append({"servers": n, "path_s": medians["path"], "stream_s": medians["stream"]})
      print(f"| {n} | {medians['path']:.2f} | {medians['stream']:.2f} | "
            f"{medians['stream'] / medians['path']:.2f}× |", flush=True)
  if args.out:
    import json
    import subprocess
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    with open(args.out, "w") as f:
      json.dump({"description": __doc__.splitlines()[0], "config": args.config, "parameters": params,
                 "bytes_per_version": size, "rounds": args.rounds, "rows": rows, "git_commit": commit,
                 "jax_version": jax.__version__, "machine": f"{platform.machine()}, {os.cpu_count()} CPUs"},
                f, indent=1)


if __name__ == "__main__":
  main()
