"""The README's headline numbers: the main command over several seeds, with provenance.

  python experiments/default_run_seeds.py                       # seeds 0 1 2, plus seed 0 once more
  python experiments/default_run_seeds.py --seeds 0 1 2 3 --repeats 1 --out experiments/results/default_run.json

Each run is the README's main command (`python -m copc_jax.main --config=configs/default.py`,
with `--config.seed=S`) in its own process and workdir under `--root`. A run that
already finished (its `summary.json` exists) is read, not rerun, so the script
resumes. The JSON holds every run's initial and final held-out accuracy, the
reward and staleness of its last updates, the mean and range over runs, the git
commit, the jax version and the resolved config. The default config is
asynchronous, so a rerun of the same seed differs a little (rollouts race the
learner): `--repeats` reruns seed 0 to show by how much.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import subprocess
import sys
import tempfile

import jax
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "experiments"))

import study  # noqa: E402

from configs import default  # noqa: E402
from copc_jax import config as config_lib  # noqa: E402
from copc_jax.train import metrics  # noqa: E402


def run_one(seed: int, workdir: str, extra: list[str]) -> dict:
  summary_path = os.path.join(workdir, "summary.json")
  if not os.path.exists(summary_path):
    command = [sys.executable, "-m", "copc_jax.main", "--config=configs/default.py", f"--workdir={workdir}",
               f"--config.seed={seed}", "--config.trainer.progress_bar=False", *extra]
    print(" ".join(command[1:]), flush=True)
    subprocess.run(command, cwd=ROOT, check=True)
  with open(summary_path) as f:
    summary = json.load(f)
  everything = metrics.read_metrics(workdir)
  rows = metrics.update_rows(everything)
  return {
      "seed": seed, "workdir_name": os.path.basename(workdir),
      "initial_eval_accuracy": summary["initial_eval_accuracy"],
      "final_eval_accuracy": summary["final_eval_accuracy"],
      "eval_curve": [(r["step"], r["eval_accuracy"]) for r in everything
                     if r.get("step", 0) >= 1 and r.get("eval_accuracy") is not None],
      "reward_first_10": float(np.mean([r["reward_mean"] for r in rows[:10]])),
      "reward_last_10": float(np.mean([r["reward_mean"] for r in rows[-10:]])),
      "staleness_mean": float(np.mean([r["staleness_mean"] for r in rows])),
      "mask_fraction_mean": float(np.mean([r["mask_fraction"] for r in rows])),
      "wall_time_s": summary["wall_time_s_this_run"],
  }


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
  parser.add_argument("--repeats", type=int, default=1, help="extra runs of the first seed")
  parser.add_argument("--root", default=os.path.join(tempfile.gettempdir(), "copc_default_seeds"))
  parser.add_argument("--out", default=os.path.join(ROOT, "experiments", "results", "default_run.json"))
  parser.add_argument("overrides", nargs="*", help="extra --config.x=y flags for every run")
  args = parser.parse_args()
  commit = study.git_commit()           # the code the runs start with
  jobs = [(s, f"seed{s}") for s in args.seeds] + [(args.seeds[0], f"seed{args.seeds[0]}_repeat{i + 1}")
                                                   for i in range(args.repeats)]
  runs = [run_one(seed, os.path.join(args.root, name), args.overrides) for seed, name in jobs]
  by_seed = [r for r in runs if "repeat" not in r["workdir_name"]]
  result = {
      "command": "python -m copc_jax.main --config=configs/default.py --workdir=DIR --config.seed=S",
      "git_commit": commit, "jax_version": jax.__version__, "python": platform.python_version(),
      "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
      "config": dataclasses.asdict(config_lib.from_config_dict(default.get_config())),
      "overrides": args.overrides,
      "runs": runs,
      "seeds": {key: study.spread([r[key] for r in by_seed]) for key in
                ("initial_eval_accuracy", "final_eval_accuracy", "reward_first_10", "reward_last_10")},
      "all_runs": {key: study.spread([r[key] for r in runs])
                   for key in ("initial_eval_accuracy", "final_eval_accuracy")},
  }
  os.makedirs(os.path.dirname(args.out), exist_ok=True)
  with open(args.out, "w") as f:
    json.dump(result, f, indent=1)
  print("\n| run | seed | held-out accuracy after warm start | after RL | reward first / last 10 updates |")
  print("|---|---:|---:|---:|---|")
  for r in runs:
    print(f"| {r['workdir_name']} | {r['seed']} | {r['initial_eval_accuracy']:.3f} | "
          f"{r['final_eval_accuracy']:.3f} | {r['reward_first_10']:.3f} / {r['reward_last_10']:.3f} |")
  for key, s in result["all_runs"].items():
    print(f"{key}: mean {s['mean']:.3f}, range {s['min']:.3f}–{s['max']:.3f} over {s['n']} runs")
  print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
