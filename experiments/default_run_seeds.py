"""The README's headline numbers: the main command over several seeds, with provenance.

  python -m experiments.default_run_seeds                       # seeds 0 1 2, plus seed 0 once more
  python -m experiments.default_run_seeds --seeds 0 1 2 3 --repeats 1 --out experiments/default_run_seeds.json
  python -m experiments.default_run_seeds --render      # the README's table and reading from the JSON
  python -m experiments.default_run_seeds --out experiments/default_run_seeds_in_process.json \
      -- --config.rollout.backend=in_process             # the same runs with the in-process backend

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

from configs import default
from copc_jax import config as config_lib
from copc_jax.train import metrics
from experiments import study

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

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


def render(result: dict) -> str:
  """The README's default-run table and the sentences that read it, every number from `result`."""
  runs, seeds = result["runs"], result["seeds"]
  first = runs[0]
  again = [r for r in runs if r["seed"] == first["seed"]]
  lines = ["| run | seed | held-out accuracy after warm start | after 150 updates | best on the way | "
           "reward, first / last 10 updates |", "|---|---:|---:|---:|---:|---|"]
  for r in runs:
    best = max(a for _, a in r["eval_curve"])
    lines.append(f"| {r['workdir_name']} | {r['seed']} | {r['initial_eval_accuracy']:.3f} | "
                 f"{r['final_eval_accuracy']:.3f} | {best:.3f} | {r['reward_first_10']:.3f} / "
                 f"{r['reward_last_10']:.3f} |")
  gains = [r["final_eval_accuracy"] - r["initial_eval_accuracy"] for r in runs]
  i, f = seeds["initial_eval_accuracy"], seeds["final_eval_accuracy"]
  text = "\n".join(lines) + (
      f"\n\nOver seeds {', '.join(str(r['seed']) for r in runs if 'repeat' not in r['workdir_name'])}: after "
      f"the warm start {i['mean']:.3f} (range {i['min']:.3f}–{i['max']:.3f}), after RL {f['mean']:.3f} ± "
      f"{f['ci95']:.3f} (95% t interval over {f['n']} seeds; range {f['min']:.3f}–{f['max']:.3f}). Every run "
      f"gained ({min(gains):+.3f} to {max(gains):+.3f}). The main command as printed above is seed "
      f"{first['seed']}: expect {first['initial_eval_accuracy']:.3f} after the warm start (bit-identical run "
      f"to run on one CPU; a CPU with other vector instructions, which XLA compiles for, builds another warm "
      f"start and lands elsewhere) and about {min(r['final_eval_accuracy'] for r in again):.2f}–"
      f"{max(r['final_eval_accuracy'] for r in again):.2f} after RL (the two runs of seed {first['seed']} "
      f"here); "
      f"the default mode is async, where which weights each episode sees depends on how the rollouts race the "
      f"learner, so a rerun of the same seed moves. Staleness sat near its bound (mean "
      f"{min(r['staleness_mean'] for r in runs):.1f}–{max(r['staleness_mean'] for r in runs):.1f} of η = "
      f"{result['config']['trainer']['max_staleness']}); COPC masked "
      f"{100 * min(r['mask_fraction_mean'] for r in runs):.2f}–"
      f"{100 * max(r['mask_fraction_mean'] for r in runs):.2f}% "
      f"of the policy tokens. Runs at commit {result['git_commit'][:7]}, jax {result['jax_version']}, "
      f"{result['machine']}, {min(r['wall_time_s'] for r in runs) / 60:.0f}–"
      f"{max(r['wall_time_s'] for r in runs) / 60:.0f} minutes a run on a machine also running a study.")
  return text


def figure(result: dict, path: str) -> None:
  """Held-out accuracy against updates, one line per run (the README's figure)."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(6.4, 3.2))
  for r in result["runs"]:
    curve = [(0, r["initial_eval_accuracy"])] + [(s, a) for s, a in r["eval_curve"] if s > 0]
    steps, accuracy = zip(*curve, strict=True)
    ax.plot(steps, accuracy, marker=".", label=f"{r['workdir_name']}")
  ax.set_xlabel("update (0: after the warm start)")
  ax.set_ylabel("held-out accuracy (greedy)")
  ax.set_ylim(0, 1)
  ax.set_title(f"configs/default.py: async COPC, commit {result['git_commit'][:7]}", fontsize=9)
  ax.grid(alpha=0.3)
  ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


IN_PROCESS = study.beside(__file__, "_in_process.json")
RESULTS_MD = os.path.join(ROOT, "docs", "results.md")


def render_backends(jetstream: dict, in_process: dict) -> str:
  """docs/results.md: the default job's held-out accuracy with either rollout backend, per seed and over
  seeds (95% t interval), every number from the two JSONs."""
  lines = ["| backend | commit | seeds | after warm start | after RL, mean ± 95% t | range after RL | "
           "per run (seed: final) |", "|---|---|---:|---:|---:|---:|---|"]
  for name, r in (("JetStream servers", jetstream), ("in-process", in_process)):
    i, f = r["seeds"]["initial_eval_accuracy"], r["seeds"]["final_eval_accuracy"]
    runs = ", ".join(f"{x['workdir_name']}: {x['final_eval_accuracy']:.3f}" for x in r["runs"])
    lines.append(f"| {name} | {r['git_commit'][:7]} | {f['n']} | {i['mean']:.3f} | {f['mean']:.3f} ± "
                 f"{f['ci95']:.3f} | {f['min']:.3f}–{f['max']:.3f} | {runs} |")
  by_seed = lambda r: {x["seed"]: x["final_eval_accuracy"] for x in r["runs"]
                       if "repeat" not in x["workdir_name"]}
  a, b = by_seed(jetstream), by_seed(in_process)
  both = sorted(set(a) & set(b))
  start = lambda r: {x["seed"]: x["initial_eval_accuracy"] for x in r["runs"]}
  same_start = all(start(jetstream)[s] == start(in_process)[s] for s in both)
  if same_start:
    difference = study.spread([b[s] - a[s] for s in both])
    lines += ["", f"Paired by seed ({', '.join(map(str, both))}), from the same warm start per seed, "
              f"in-process − JetStream: {difference['mean']:+.3f} ± {difference['ci95']:.3f} (95% t "
              f"interval; range {difference['min']:+.3f} to {difference['max']:+.3f}). "]
  else:
    lines += ["", "Not paired: the two rows began from different warm starts (built on CPUs with other vector "
              "instructions; the held-out accuracy after the warm start differs). "]
  lines[-1] += (f"Same config (`configs/default.py`, async mode); commands: `{jetstream['command']}` with "
                f"{' '.join(in_process['overrides'])} for the second row; wall time per run "
                f"{min(x['wall_time_s'] for x in in_process['runs']) / 60:.0f}–"
                f"{max(x['wall_time_s'] for x in in_process['runs']) / 60:.0f} min in-process, "
                f"{min(x['wall_time_s'] for x in jetstream['runs']) / 60:.0f}–"
                f"{max(x['wall_time_s'] for x in jetstream['runs']) / 60:.0f} min with servers (each beside "
                "other work on this 2-core machine).")
  return "\n".join(lines)


def write_backends() -> None:
  with open(study.beside(__file__)) as f, open(IN_PROCESS) as g:
    study.write_between_markers(RESULTS_MD, "default_run_backends", render_backends(json.load(f), json.load(g)))


def write(result: dict) -> None:
  """The README's table and reading, and its figure, from `result`."""
  study.write_between_markers(os.path.join(ROOT, "README.md"), "default_run", render(result))
  figure(result, study.beside(__file__, ".png"))


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--render", action="store_true", help="rewrite the README's section from --out")
  parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
  parser.add_argument("--repeats", type=int, default=1, help="extra runs of the first seed")
  parser.add_argument("--root", default=os.path.join(tempfile.gettempdir(), "copc_default_seeds"))
  parser.add_argument("--out", default=study.beside(__file__))
  parser.add_argument("overrides", nargs="*", help="extra --config.x=y flags for every run")
  args = parser.parse_args()
  if args.render:
    with open(args.out) as f:
      write(json.load(f))
    if os.path.exists(IN_PROCESS):
      write_backends()
    return
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
  if os.path.abspath(args.out) == study.beside(__file__):
    write(result)
    print(f"wrote {args.out}, the README's table and experiments/default_run_seeds.png")
  elif os.path.abspath(args.out) == IN_PROCESS:
    write_backends()
    print(f"wrote {args.out} and docs/results.md's table of both backends")


if __name__ == "__main__":
  main()
