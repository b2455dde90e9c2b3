"""Study: step time of sync PPO, async PPO and async COPC across tool-latency and response-length regimes.

  python -m experiments.step_time.run                 # 6 regimes × 3 methods × 20 updates, ~40 min here
  python -m experiments.step_time.run --render        # table and figure from results.json

Every method trains the config's tiny model from one shared warm start against two local
JetStream servers (`bench_step_time.run_method`); the step time is the mean over updates 4 … N
(compilation excluded). A regime adds a log-normal delay to every tool call (median m, shape σ):
none; m = 0.1, 0.5, 2 s with σ = 0.25 (a steady service); m = 0.5 s with σ = 1.0 (long-tailed: p99
≈ 10 × m, the straggler that holds a synchronous batch back). The response-length regime swaps the
task for knowledge search (`configs/search.py`, its own warm start): 1- and 2-hop questions, 1–3
turns with a retrieved passage between them, so the length of an episode varies with the number of
searches; the table reports each regime's mean and longest response (tokens the policy wrote,
averaged over updates), so the spread is measured rather than assumed. Speedups are against sync
PPO of the same regime; COPC's overhead is against async PPO of the same regime. Timings need a
quiet machine: run nothing else alongside.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile

import numpy as np

from experiments import bench_step_time, figures, study

HERE = os.path.dirname(os.path.abspath(__file__))

REGIMES = {                    # name: (config, added tool latency's median (s), its log-normal σ)
    "none": ("default", 0.0, 0.0), "0.1 s": ("default", 0.1, 0.25), "0.5 s": ("default", 0.5, 0.25),
    "2 s": ("default", 2.0, 0.25), "0.5 s, long tail": ("default", 0.5, 1.0),
    "length spread (search)": ("search", 0.0, 0.0)}


def measure(args, results: dict) -> dict:
  import jax
  root = tempfile.mkdtemp(prefix="copc_step_time_")
  try:
    for regime in args.regimes:
      if regime in results.get("regimes", {}):
        continue
      config_name, median, sigma = REGIMES[regime]
      print(f"regime {regime}", flush=True)
      warm_dir = os.path.join(root, f"warm_{config_name}")
      bench_step_time.warm_start_of(warm_dir, config_name=config_name)
      workdir = lambda preset, mode, regime=regime: os.path.join(root, f"{preset}_{mode}_{regime}")
      methods = {name: bench_step_time.run_method(preset, mode, args.steps, warm_dir, workdir(preset, mode),
                                                  median, sigma, config_name=config_name)
                 for name, preset, mode in bench_step_time.METHODS}
      results.setdefault("regimes", {})[regime] = {"config": config_name, "tool_latency_median_s": median,
                                                   "tool_latency_sigma": sigma, "methods": methods}
      results.update({"description": __doc__.splitlines()[0], "steps": args.steps,
                      "git_commit": study.git_commit(), **study.provenance(), "jax_version": jax.__version__})
      study.write_json(args.out, results)
  finally:
    shutil.rmtree(root, ignore_errors=True)
  return results


def median_step_s(method: dict) -> float:
  """The median step time: one rare stall (a server restarted mid-run) moves the mean by seconds."""
  return float(np.median(method["step_times_s"]))


def ratios(regime: dict) -> dict:
  """Speedups over sync PPO and COPC's overhead over async PPO, of the median step times."""
  m = regime["methods"]
  sync, async_ppo, copc = (median_step_s(m[name]) for name in ("sync PPO", "async PPO", "async COPC"))
  return {"async_ppo_speedup": sync / async_ppo, "copc_speedup": sync / copc,
          "copc_overhead": copc / async_ppo - 1}


def length_cell(method: dict) -> str:
  if "response_len_max" not in method:
    return "–"
  return f"{method['response_len_mean']:.1f} / {method['response_len_max']:.1f}"


def render(results: dict, here: str = HERE) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  names = [r for r in REGIMES if r in results["regimes"]]
  steps = results["steps"]
  lines = [f"{steps} updates per method and regime (updates 4 … {steps}); commit "
           f"{results['git_commit'][:10]}, jax {results['jax_version']}, {results['machine']}.", "",
           "Ratios use the median step time; the mean and the slowest step are shown next to it (a server",
           "restarted mid-run shows as one slow step).", "",
           "| regime | method | median step (s) | mean (s) | slowest (s) | rollout wait (s) | train (s) | "
           "weight sync (s) | staleness | response tokens: mean / longest | speedup over sync |",
           "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
  for regime in names:
    entry = results["regimes"][regime]
    sync = median_step_s(entry["methods"]["sync PPO"])
    for j, (method, r) in enumerate(entry["methods"].items()):
      lines.append(f"| {regime if j == 0 else ''} | {method} | {median_step_s(r):.2f} | "
                   f"{r['step_time_s']:.2f} | {max(r['step_times_s']):.2f} | {r['rollout_wait_s']:.2f} | "
                   f"{r['train_s']:.2f} | "
                   f"{r['weight_sync_s']:.3f} | {r['staleness_mean']:.2f} | {length_cell(r)} | "
                   f"{sync / median_step_s(r):.2f}× |")
  summary = summary_table(results)
  lines += [""] + summary
  fig, axes = plt.subplots(1, 2, figsize=(11, 3.6))
  x = np.arange(len(names))
  for offset, (key, label) in enumerate((("async_ppo_speedup", "async PPO"), ("copc_speedup", "async COPC"))):
    bars = axes[0].bar(x + 0.4 * offset - 0.2, [ratios(results["regimes"][n])[key] for n in names], 0.4,
                       label=label, color=figures.color_of("async_ppo" if offset == 0 else "copc"))
    figures.label_bars(axes[0], bars)
  axes[0].axhline(1.0, color="k", lw=0.8)
  axes[0].set_title("speedup of the step over sync PPO")
  bars = axes[1].bar(x, [100 * ratios(results["regimes"][n])["copc_overhead"] for n in names], 0.5,
                     color=figures.color_of("copc"))
  figures.label_bars(axes[1], bars, fmt="{:+.1f}")
  axes[1].axhline(0.0, color="k", lw=0.8)
  axes[1].set_title("COPC's step time over async PPO (%)")
  for ax in axes:
    ax.set_xticks(x, [n.replace(", ", ",\n").replace(" (", "\n(") for n in names], fontsize=8)
    ax.grid(alpha=0.3, axis="y")
  figures.legend_outside(axes[0])
  fig.supxlabel("regime (added tool latency's median, or the search task's spread lengths)", fontsize=9)
  fig.tight_layout()
  fig.savefig(os.path.join(here, "speedup.png"), dpi=110)
  plt.close(fig)
  lines += ["", "![speedup over sync PPO and COPC's overhead](speedup.png)"]
  study.write_between_markers(os.path.join(here, "README.md"), "results", "\n".join(lines))
  if here == HERE:                          # the results page's summary of this study
    study.write_between_markers(os.path.join(os.path.dirname(os.path.dirname(HERE)), "docs", "results.md"),
                                "step_time",
                                "\n".join([lines[0], ""] + summary))


def summary_table(results: dict) -> list[str]:
  """Per regime: the speedups over sync PPO and COPC's overhead over async PPO (markdown lines)."""
  lines = ["| regime | async PPO over sync | async COPC over sync | COPC's overhead over async PPO |",
           "|---|---:|---:|---:|"]
  for regime in (r for r in REGIMES if r in results["regimes"]):
    r = ratios(results["regimes"][regime])
    lines.append(f"| {regime} | {r['async_ppo_speedup']:.2f}× | {r['copc_speedup']:.2f}× | "
                 f"{100 * r['copc_overhead']:+.1f}% |")
  return lines


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=20)
  parser.add_argument("--regimes", nargs="+", default=list(REGIMES), choices=list(REGIMES))
  parser.add_argument("--render", action="store_true")
  parser.add_argument("--out", default=os.path.join(HERE, "results.json"))
  args = parser.parse_args()
  if args.steps < 5:
    parser.error(f"--steps must be >= 5 (the first 3 updates compile); got {args.steps}")
  results = {}
  if os.path.exists(args.out):
    with open(args.out) as f:
      results = json.load(f)
    if results.get("steps") != args.steps:
      results = {}
  if not args.render:
    results = measure(args, results)
  if os.path.abspath(args.out) == os.path.join(HERE, "results.json"):
    render(results)


if __name__ == "__main__":
  main()
