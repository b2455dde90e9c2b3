"""Weight sync time of the trainer's own push (`WeightStore.push`) for each weight transfer.

  python -m experiments.bench_weight_push                   # the 100M config, 1, 2 and 4 servers
  python -m experiments.bench_weight_push --out experiments/bench_weight_push.json
  python -m experiments.bench_weight_push --render          # docs/training.md table from that JSON

A model of bench_learner's config is pushed to local servers `--rounds` times per transfer, each
time as a new version, exactly as the trainer does after an update (what its `weight_sync_s` times):
  path    the learner saves the version's safetensors in the workdir, every server reads the file;
  stream  the learner saves the file, then streams its bytes in 4 MiB gRPC chunks to every server;
  memory  the learner serializes the weights in memory and streams those bytes; nothing on disk;
  shm     the learner writes the version to shared memory (/dev/shm) in the servers' own layout (no
          transposes), every server reads it there.
Reported: the median and the slowest seconds per push (saved, and swapped on every server; a path
or stream push that writes while the kernel flushes earlier versions to disk waits), and each transfer's
share of the learner's step for the same config when `experiments/bench_learner.json` has it
(measured by bench_learner in its own run; its commit is written next to the share).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time

import jax
from flax import nnx

from copc_jax.models import hf_io, tiny
from copc_jax.models.decoder import Decoder
from copc_jax.rollout import auth
from copc_jax.rollout.pool import RolloutPool
from copc_jax.rollout.process import ServerProcess
from copc_jax.rollout.protocol import WEIGHT_TRANSFERS
from copc_jax.train.weights import WeightStore, shared_memory_directory
from experiments import bench_learner, study

TRANSFERS = tuple(WEIGHT_TRANSFERS)
LEARNER_JSON = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench_learner.json")


def time_pushes(addresses, actor, directory: str, transfer: str, rounds: int, first_version: int,
                token: str | None = None) -> list:
  """Seconds of `rounds` pushes of new versions through the trainer's WeightStore (the first push of a
  pool is not timed: it resets the servers)."""
  times = []
  with RolloutPool(addresses=addresses, token=token) as pool:
    store = WeightStore(os.path.join(directory, transfer), pool, transfer=transfer)
    for i in range(rounds + 1):
      start = time.perf_counter()
      store.push(first_version + i, actor)
      if i:
        times.append(time.perf_counter() - start)
      store.prune(first_version + i)
  return times


def shm_stages_s(actor, rounds: int) -> dict:
  """The median seconds of each stage of an shm push, timed alone in this process: the learner writes
  its weights to shared memory in the servers' layout (`save_params`), and a server reads them into
  its placements (`read_like`, with this process's single-device placement)."""
  stages = {"write": [], "read_and_place": []}
  directory = shared_memory_directory()
  try:
    for _ in range(rounds):
      start = time.perf_counter()
      hf_io.save_params(actor, directory)
      stages["write"].append(time.perf_counter() - start)
      start = time.perf_counter()
      jax.block_until_ready(nnx.state(hf_io.read_like(actor, directory)))
      stages["read_and_place"].append(time.perf_counter() - start)
  finally:
    shutil.rmtree(directory, ignore_errors=True)
  return {name: statistics.median(times) for name, times in stages.items()}


def learner_step_s(config_name: str) -> tuple[float, str] | None:
  """The learner's step time for `config_name` and the commit it was measured at, from bench_learner's JSON."""
  if not os.path.exists(LEARNER_JSON):
    return None
  with open(LEARNER_JSON) as f:
    learner = json.load(f)
  rows = [r for r in learner["rows"] if r.get("model") == config_name and "step_s" in r]
  return (rows[0]["step_s"], learner["git_commit"]) if rows else None


RESULTS = study.beside(__file__)
README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs",
                      "training.md")


def render(results_path: str = RESULTS, readme: str = README) -> str:
  """docs/training.md's weight-push table, from the benchmark's JSON."""
  with open(results_path) as f:
    r = json.load(f)
  step = r.get("learner_step")
  lines = [f"The {r['config']} model ({r['parameters'] / 1e6:.1f}M parameters, "
           f"{r['bytes_per_version'] / 2**20:.0f} MiB per version), median and slowest of {r['rounds']} "
           f"pushes, each saved and swapped on every server (commit {r['git_commit'][:10]}; `{r['command']}`)"
           + (f"; share: of the learner's step for this config ({step['step_s']:.2f} s, "
              f"`bench_learner.json` at {step['git_commit'][:10]})." if step else "."), "",
           "| servers | " + " | ".join(f"{t} (s)" for t in TRANSFERS) + " | fastest | its share of the step |",
           "|---:|" + "---:|" * (len(TRANSFERS) + 2)]
  for row in r["rows"]:
    fastest = min(TRANSFERS, key=lambda t: row[f"{t}_s"])
    share = f"{100 * row[f'{fastest}_share_of_step']:.0f}%" if step else "–"
    lines.append(f"| {row['servers']} | " + " | ".join(
        f"{row[f'{t}_s']:.2f} (slowest {row[f'{t}_slowest_s']:.2f})" for t in TRANSFERS)
        + f" | {fastest} | {share} |")
  if "shm_stages_s" in r:
    st = r["shm_stages_s"]
    lines += ["", f"An shm push's stages, each timed alone (median): the learner writes its weights to "
              f"`/dev/shm` in the servers' layout in {st['write']:.2f} s, and a server reads them into its "
              f"placements in {st['read_and_place']:.2f} s."]
  text = "\n".join(lines)
  study.write_between_markers(readme, "weight_push", text)
  return text


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--config", default="100m", choices=list(bench_learner.CONFIGS))
  parser.add_argument("--servers", type=int, nargs="+", default=[1, 2, 4])
  parser.add_argument("--rounds", type=int, default=5)
  parser.add_argument("--out", help="also write the numbers here (JSON)")
  parser.add_argument("--render", action="store_true", help="only rewrite the docs table from " + RESULTS)
  args = parser.parse_args()
  if args.render:
    print(render())
    return
  actor = Decoder(tiny.tiny_config("qwen2", **bench_learner.CONFIGS[args.config][0]), rngs=nnx.Rngs(1))
  params = sum(x.size for x in jax.tree.leaves(nnx.state(actor, nnx.Param)))
  step = learner_step_s(args.config)
  rows = []
  stages = shm_stages_s(actor, args.rounds)
  print("an shm push's stages alone: " + ", ".join(f"{name} {t:.3f} s" for name, t in stages.items()))
  with tempfile.TemporaryDirectory() as tmp:
    base = os.path.join(tmp, "base")
    hf_io.save_pretrained(actor, base)
    size = os.path.getsize(os.path.join(base, hf_io.SAFETENSORS_SINGLE))
    print(f"model {args.config}: {params / 1e6:.1f}M parameters, {size / 2**20:.0f} MiB per version; median of "
          f"{args.rounds} pushes" + (f"; share of the learner step ({step[0]:.2f} s, bench_learner.json at "
                                     f"{step[1][:10]})" if step else "") + "\n")
    print("| servers | " + " | ".join(f"{t} (s, slowest)" for t in TRANSFERS) + " | shm / path |"
          + (" shm share of the step |" if step else ""))
    print("|---:|" + "---:|" * (len(TRANSFERS) + 1 + bool(step)))
    for n in args.servers:
      token = auth.new_token()
      servers = [ServerProcess(base, slots=2, max_prefill_length=16, max_length=32, seed=i, version=-1,
                               token=token) for i in range(n)]
      try:
        addresses = [s.wait_ready(600) for s in servers]
        medians, slowest = {}, {}
        for j, transfer in enumerate(TRANSFERS):
          times = time_pushes(addresses, actor, tmp, transfer, args.rounds, j * (args.rounds + 1), token)
          medians[transfer], slowest[transfer] = statistics.median(times), max(times)
      finally:
        for s in servers:
          s.stop()
      row = {"servers": n, **{f"{t}_s": medians[t] for t in TRANSFERS},
             **{f"{t}_slowest_s": slowest[t] for t in TRANSFERS}}
      if step:
        row.update({f"{t}_share_of_step": medians[t] / step[0] for t in TRANSFERS})
      rows.append(row)
      print(f"| {n} | " + " | ".join(f"{medians[t]:.2f} ({slowest[t]:.2f})" for t in TRANSFERS)
            + f" | {medians['shm'] / medians['path']:.2f}× |"
            + (f" {100 * row['shm_share_of_step']:.0f}% |" if step else ""), flush=True)
  if args.out:
    study.write_benchmark(args.out, {
        "description": __doc__.splitlines()[0], "config": args.config, "parameters": params,
        "bytes_per_version": size, "rounds": args.rounds, "rows": rows, "shm_stages_s": stages,
        "learner_step": {"step_s": step[0], "git_commit": step[1]} if step else None})


if __name__ == "__main__":
  main()
