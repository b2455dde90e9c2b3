"""Study: stability of the asynchronous presets on knowledge search, over long lag-mode runs.

  python -m experiments.search_stability.run              # sync PPO + 5 presets × k ∈ {16, 64} × 2 seeds
  python -m experiments.search_stability.run --cells copc_k16 vtrace_k16   # part of the grid
  python -m experiments.search_stability.run --render                 # tables and figures from results.json
  python -m experiments.search_stability.run --rerun --cells sync_ppo_k0 copc_k64   # the new learner

`--rerun` is the study on the learner as the field runs it (the search config's defaults: several
minibatches per batch, critic warm-up, centred whitening) with the presets of the other reruns
(`study.RERUN_PRESETS`: COPC as the spec states it and μ-anchored, the group presets at 4 samples per
prompt) at k = 64 and 16 against sync PPO, 4 seeds, 300 updates per run, into `results_rerun.json`:
95% t intervals over seeds, paired differences against sync PPO and the best baseline at each lag,
Fisher exact tests of the collapse counts (`study.render_by_lag`).

The task (`configs/search.py`): half of each 2-hop question's demonstrations chain the second search
and half stop after the first and guess (`task.demo_chain_fraction = 0.5`), so the warm-started policy
chains about half the time and RL can learn to always chain; held-out accuracy is measured on questions
about entities no training question names. Sync PPO (k = 0) is the reference for the RL gain. Each
other run is lag mode (every batch from the weights k updates old) for `--updates` updates; the
learner's current weights are evaluated every 25 updates on a dedicated server.

Collapse, stated before the runs: held-out accuracy more than 0.2 below its running maximum from some
evaluation to the end of the run (`study.collapse_step`). A run that dips and recovers has not
collapsed. Resumable: finished cells are read, not rerun.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import numpy as np

from experiments import figures, study

HERE = os.path.dirname(os.path.abspath(__file__))

PRESETS = ("async_ppo", "decoupled_ppo", "icepop", "vtrace", "copc")
LAGS = (16, 64)
SEEDS = (0, 1)
RERUN = dict(presets=study.RERUN_PRESETS, lags=(64, 16), seeds=(0, 1, 2, 3))
COMMON = {"trainer.eval_every": 25, "trainer.checkpoint_every": 25}
SERIES = (("entropy", "policy entropy (nats/token)"), ("grad_norm", "actor gradient norm"),
          ("mask_fraction", "mask fraction"))


def cells(presets, lags) -> list[study.Cell]:
  grid = [study.Cell("sync_ppo_k0", {"preset": "sync_ppo", "trainer.mode": "sync", "trainer.lag": 0})]
  return grid + [study.Cell(f"{preset}_k{lag}", {**study.named_setting(preset),
                                                 "trainer.mode": "lag", "trainer.lag": lag})
                 for lag in lags for preset in presets]


def smooth(values, window: int = 10) -> np.ndarray:
  values = np.asarray([np.nan if v is None else v for v in values], float)
  kernel = np.ones(window)
  valid = np.isfinite(values)
  total = np.convolve(np.where(valid, values, 0.0), kernel, "same")
  count = np.convolve(valid.astype(float), kernel, "same")
  return np.where(count > 0, total / np.maximum(count, 1), np.nan)


def figure(results: dict, path: str) -> None:
  """Per lag (rows): held-out accuracy, entropy, gradient norm, mask fraction; mean over seeds per preset."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  lags = sorted({c["overrides"]["trainer.lag"] for c in results["cells"].values()} - {0})   # 0: in every row
  fig, axes = plt.subplots(len(lags), 4, figsize=(18, 3.4 * len(lags)), squeeze=False)
  styles = figures.line_styles([n.rsplit("_k", 1)[0] for n in results["cells"]])
  styles = {n: styles[n.rsplit("_k", 1)[0]] for n in results["cells"]}
  for row, lag in zip(axes, lags, strict=True):
    for name, entry in results["cells"].items():
      if entry["overrides"]["trainer.lag"] not in (0, lag) or not entry["runs"]:
        continue
      runs = list(entry["runs"].values())
      curves = [dict(map(tuple, r["eval_curve"])) for r in runs]
      steps = sorted(set.intersection(*(set(c) for c in curves)))
      row[0].plot(steps, np.mean([[c[s] for s in steps] for c in curves], 0), marker=".",
                  label=f"{name} (n={len(runs)})", **styles[name])
      for ax, (key, _) in zip(row[1:], SERIES, strict=True):
        length = min(len(r["series"][key]) for r in runs)
        ax.plot(np.arange(1, length + 1), np.nanmean([smooth(r["series"][key][:length]) for r in runs], 0),
                label=name, **styles[name])
    for ax, title in zip(row, ["held-out accuracy (greedy)"] + [t for _, t in SERIES], strict=True):
      ax.set_title(f"k = {lag}: {title}", fontsize=9)
      ax.set_xlabel("update")
      ax.grid(alpha=0.3)
    figures.legend_outside(row[-1])
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def gain_table(results: dict) -> str:
  """Held-out accuracy of the warm start (update 0), at the end, and the RL gain between them."""
  lines = ["| cell | seeds | warm start | final | gain (final − warm start) | best | gain at best |",
           "|---|---:|---:|---:|---:|---:|---:|"]
  for name, entry in results["cells"].items():
    curves = [r["eval_curve"] for r in entry["runs"].values()]
    if not curves:
      continue
    start = [c[0][1] for c in curves]
    final, best = [c[-1][1] for c in curves], [max(a for _, a in c) for c in curves]
    fmt = lambda values: f"{np.mean(values):.3f} ± {np.std(values):.3f}"
    lines.append(f"| {name} | {len(curves)} | {fmt(start)} | {fmt(final)} | "
                 f"{fmt(np.subtract(final, start))} | {fmt(best)} | {fmt(np.subtract(best, start))} |")
  return "\n".join(lines)


def render(results: dict, here: str = HERE, name: str = "results") -> None:
  """README.md between `name`'s markers: the first study's tables and figure (`results`), or the rerun's
  comparison by lag (`results_rerun`)."""
  if name == "results_rerun":
    return study.render_by_lag(results, os.path.join(here, "README.md"), "results_rerun", "curves_rerun.png")
  figure(results, os.path.join(here, "curves.png"))
  reference = "sync_ppo_k0" if results["cells"].get("sync_ppo_k0", {}).get("runs") else None
  text = (f"Grid: {len(results['cells'])} cells, seeds {results['seeds']}, "
          f"{results['common_overrides'].get('trainer.steps')} updates per run; "
          f"{study.grid_provenance(results)}.\n\n"
          + study.table(results, reference=reference) + "\n\n**RL gain on held-out questions**\n\n"
          + gain_table(results) + "\n\n![curves](curves.png)")
  study.write_between_markers(os.path.join(here, "README.md"), "results", text)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--updates", type=int, default=300)
  parser.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS))
  parser.add_argument("--cells", nargs="+", help="run only these cells (e.g. copc_k16)")
  parser.add_argument("--candidates", nargs="+", choices=sorted(study.CANDIDATES), default=[],
                      help="extend the grid with these COPC settings (study.CANDIDATES) at every lag")
  parser.add_argument("--rerun", action="store_true", help="the study on the new learner (see above)")
  parser.add_argument("--render", action="store_true")
  parser.add_argument("--root", default=os.path.join(tempfile.gettempdir(), "copc_search_stability"))
  parser.add_argument("--out", help="default: results.json (results_rerun.json with --rerun)")
  parser.add_argument("--replace-other-warm-starts", action="store_true", help=study.REPLACE_HELP)
  args = parser.parse_args()
  name = "results_rerun" if args.rerun else "results"
  args.out = args.out or os.path.join(HERE, f"{name}.json")
  if args.rerun:
    args.seeds = args.seeds if args.seeds != list(SEEDS) else list(RERUN["seeds"])
  grid = cells((RERUN["presets"] if args.rerun else PRESETS) + tuple(args.candidates),
               RERUN["lags"] if args.rerun else LAGS)
  if args.cells:
    unknown = set(args.cells) - {c.name for c in grid}
    if unknown:
      parser.error(f"--cells: {sorted(unknown)} not in the grid; allowed: {[c.name for c in grid]}")
    grid = [c for c in grid if c.name in args.cells]
  if args.render:
    if not os.path.exists(args.out):
      parser.error(f"--render: {args.out} does not exist yet (run the grid first)")
    with open(args.out) as f:
      render(json.load(f), name=name)
    return
  results = study.run(grid, args.seeds, config="configs/search.py", root=args.root, out=args.out,
                      common={**COMMON, "trainer.steps": args.updates}, target=0.6,
                      description="stability on knowledge search: lag mode, held-out accuracy of the learner",
                      replace_other_warm_starts=args.replace_other_warm_starts)
  if os.path.abspath(args.out) == os.path.join(HERE, f"{name}.json"):
    render(results, name=name)


if __name__ == "__main__":
  main()
