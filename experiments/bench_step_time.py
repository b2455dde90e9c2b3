"""Step time of sync PPO, async PPO and async COPC on the same task and batch, measured in one run.

  python -m experiments.bench_step_time [--steps=20] [--tool_latency_s=0.5]

Each method trains the default config's tiny model (one shared warm start) against
two local JetStream servers for `--steps` updates; the mean step time skips the
first 3 (compilation). Two regimes: the tool as it is (a sandboxed Python run),
and with extra long-tailed tool latency (log-normal, median `--tool_latency_s`),
as remote sandboxes and search services have. Ratios are against sync PPO.
"""

import argparse
import os
import random
import shutil
import tempfile
import time

import numpy as np

from configs import default, search
from copc_jax import config as config_lib
from copc_jax.envs.tasks import make_task
from copc_jax.train import metrics, trainer, warm_start

CONFIGS = {"default": default, "search": search}      # tool arithmetic; knowledge search (1–3 turns)
METHODS = (("sync PPO", "sync_ppo", "sync"), ("async PPO", "async_ppo", "async"),
           ("async COPC", "copc", "async"))


def with_latency(tool, median_s: float, seed: int, sigma: float = 1.0):
  """`tool` plus a log-normal delay (median `median_s`; sigma 1: a long tail, p99 ≈ 10× the median)."""
  rng = random.Random(seed)

  def slow_tool(turn_text):
    time.sleep(median_s * rng.lognormvariate(0.0, sigma))
    return tool(turn_text)
  return slow_tool


def warm_start_of(warm_dir: str, warm_steps: int | None = None, config_name: str = "default") -> str:
  """The config's warm-started model (built once in `warm_dir`, then cached); `warm_steps` overrides
  the config's number of warm-start steps."""
  raw = CONFIGS[config_name].get_config()
  if warm_steps is not None:
    raw.warm_start.steps = warm_steps
  config = config_lib.from_config_dict(raw)
  base = trainer.base_checkpoint(config, warm_dir)
  return warm_start.prepare(make_task(config.task, config.seed), base, os.path.join(warm_dir, "warm_start"),
                            config.warm_start, seed=config.seed)


def run_method(preset, mode, steps, warm_dir, workdir, tool_latency_s, sigma=1.0, warm_steps=None,
               config_name="default"):
  raw = CONFIGS[config_name].get_config(preset)
  raw.trainer.update(dict(mode=mode, steps=steps, eval_every=0, checkpoint_every=steps, progress_bar=False))
  os.makedirs(workdir)
  shutil.copytree(os.path.join(warm_dir, "base"), os.path.join(workdir, "base"))
  run = trainer.Trainer(trainer.build(config_lib.from_config_dict(raw), workdir,
                        actor_checkpoint=warm_start_of(warm_dir, warm_steps, config_name)))
  if tool_latency_s:
    run.task.tool = with_latency(run.task.tool, tool_latency_s, seed=0, sigma=sigma)
  run.run()
  rows = [r for r in metrics.update_rows(metrics.read_metrics(workdir)) if r["step"] > 3]
  return {**{key: float(np.mean([r[key] for r in rows]))
             for key in ("step_time_s", "rollout_wait_s", "train_s", "weight_sync_s", "staleness_mean",
                         "response_len_mean", "response_len_max", "turns_mean")},
          "step_times_s": [float(r["step_time_s"]) for r in rows]}


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=20)
  parser.add_argument("--tool_latency_s", type=float, default=0.5)
  args = parser.parse_args()
  root = tempfile.mkdtemp(prefix="copc_bench_step_")
  try:
    warm_dir = os.path.join(root, "warm")
    warm_start_of(warm_dir)          # one warm start, shared by every method
    for latency in (0.0, args.tool_latency_s):
      results = {name: run_method(preset, mode, args.steps, warm_dir,
                                  os.path.join(root, f"{preset}_{mode}_{latency}"), latency)
                 for name, preset, mode in METHODS}
      reference = results["sync PPO"]["step_time_s"]
      print(f"\ntool latency: {'none added' if not latency else f'log-normal, median {latency} s'}")
      print("| method | step time | vs sync PPO | rollout wait | train | weight sync | staleness |")
      print("| --- | --- | --- | --- | --- | --- | --- |")
      for name, r in results.items():
        print(f"| {name} | {r['step_time_s']:.2f} s | {reference / r['step_time_s']:.2f}× | "
              f"{r['rollout_wait_s']:.2f} s | {r['train_s']:.3f} s | {r['weight_sync_s']:.3f} s | "
              f"{r['staleness_mean']:.2f} |")
  finally:
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
  main()
