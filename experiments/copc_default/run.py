"""Which setting the `copc` preset ships with, chosen from the studies' committed results.

  python -m experiments.copc_default.run            # reads the studies' JSON, writes results.json and README
  python -m experiments.copc_default.run --render   # README from the committed results.json
  python -m experiments.copc_default.run --rerun    # the pick again, from the reruns on the new learner

Nothing is rerun here. The evidence is every (task, staleness) cell in which the studies ran COPC:

  tool arithmetic, k = 16   presets_across_staleness/results.json       3 seeds, 80 updates
  tool arithmetic, k = 64   presets_across_staleness/results_full.json  3 seeds, 300 updates
  knowledge search, k = 16  search_stability/results.json               2 seeds, 300 updates
  knowledge search, k = 64  search_stability/results.json               2 seeds, 300 updates

The rule: the candidates are the spec's setting (the `copc` preset as the spec writes it) and the
settings in `study.CANDIDATES`; a candidate competes only if it was measured in every cell; its score
is the mean over cells of its seed-mean final held-out accuracy (each cell weighs the same, whatever
its scale); the highest score is the default. Every cell also names the best preset of any kind, so
the README can say where policy-side presets win.

`--rerun` applies the same rule to the studies rerun on the learner as the field runs it (issue 27:
minibatches, critic warm-up, centred whitening, 4 seeds, 300 updates, the shipped warm starts):

  tool arithmetic, k = 16 and 64   presets_across_staleness/results_rerun.json
  knowledge search, k = 16 and 64  search_stability/results_rerun.json

with the candidates those reruns run: the spec's setting and COPC anchored on the behaviour policy
(`copc_anchor_behavior`). A candidate's cell counts only once all the rerun's seeds have finished in
it; until every candidate has every cell, the rerun picks nothing and the `copc` preset stays as it is.
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np

from experiments import figures, study

HERE = os.path.dirname(os.path.abspath(__file__))
EXPERIMENTS = os.path.dirname(HERE)

SPEC = "copc_spec"      # the spec's setting (a preset): the cell named `copc_k{lag}` in each study
EVIDENCE = (  # (cell label, task, lag, results file relative to experiments/)
    ("tool arithmetic, k = 16", "tool arithmetic", 16, "presets_across_staleness/results.json"),
    ("tool arithmetic, k = 64", "tool arithmetic", 64, "presets_across_staleness/results_full.json"),
    ("knowledge search, k = 16", "knowledge search", 16, "search_stability/results.json"),
    ("knowledge search, k = 64", "knowledge search", 64, "search_stability/results.json"),
)
EVIDENCE_RERUN = (
    ("tool arithmetic, k = 16", "tool arithmetic", 16, "presets_across_staleness/results_rerun.json"),
    ("tool arithmetic, k = 64", "tool arithmetic", 64, "presets_across_staleness/results_rerun.json"),
    ("knowledge search, k = 16", "knowledge search", 16, "search_stability/results_rerun.json"),
    ("knowledge search, k = 64", "knowledge search", 64, "search_stability/results_rerun.json"),
)
FIRST_CANDIDATES = (SPEC, *study.CANDIDATES)           # the first studies' named COPC settings
RERUN_CANDIDATES = (SPEC, "copc_anchor_behavior")


def candidate_cell(candidate: str, lag: int) -> str:
  return f"copc_k{lag}" if candidate == SPEC else f"{candidate}_k{lag}"


def collect(evidence=EVIDENCE, root: str = EXPERIMENTS, candidates=FIRST_CANDIDATES, *,
            complete: bool = False) -> dict:
  """Per evidence cell: each candidate's final accuracy over seeds and the best preset of any kind.
  A results file not written yet leaves its cells empty; with `complete`, a cell counts only once every
  seed of its study has finished in it."""
  cells = {}
  for label, task, lag, path in evidence:
    if not os.path.exists(os.path.join(root, path)):
      cells[label] = {"task": task, "lag": lag, "source": path, "source_commit": None, "candidates": {},
                      "best_preset": None}
      continue
    with open(os.path.join(root, path)) as f:
      results = json.load(f)
    seeds = len(results["seeds"]) if complete else 1
    finals = {name: entry["aggregate"]["final_eval_accuracy"] for name, entry in results["cells"].items()
              if name.endswith(f"_k{lag}") and entry["aggregate"]["final_eval_accuracy"]
              and entry["aggregate"]["final_eval_accuracy"]["n"] >= seeds}
    best = max(finals, key=lambda name: finals[name]["mean"]) if finals else None
    cells[label] = {
        "task": task, "lag": lag, "source": path, "source_commit": results["git_commit"],
        "candidates": {c: finals[candidate_cell(c, lag)] for c in candidates
                       if candidate_cell(c, lag) in finals},
        "best_preset": {"cell": best, **finals[best]} if best else None}
  return cells


def choose(cells: dict) -> dict:
  """Scores of the candidates measured in every cell, the pick, and who was left out for missing cells."""
  names = sorted({c for cell in cells.values() for c in cell["candidates"]})
  missing = {c: [label for label, cell in cells.items() if c not in cell["candidates"]] for c in names}
  scores = {c: float(np.mean([cell["candidates"][c]["mean"] for cell in cells.values()]))
            for c in names if not missing[c]}
  pick = max(scores, key=scores.get) if scores else None
  return {"scores": scores, "pick": pick, "not_measured_everywhere": {c: m for c, m in missing.items() if m}}


def overrides_of(candidate: str) -> dict:
  """Config overrides that turn the spec's `copc` setting into `candidate`."""
  return {"preset": SPEC} if candidate == SPEC else dict(study.named_setting(candidate))


def figure(results: dict, path: str) -> None:
  """Per evidence cell: each candidate's final accuracy (mean, seed std as error bar) and the best preset."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  labels, names = list(results["cells"]), results["candidates"]
  width = 0.8 / (len(names) + 1)
  fig, ax = plt.subplots(figsize=(9, 3.6))
  for i, name in enumerate([*names, "best preset at this lag"]):
    stats = [cell["candidates"].get(name) if name in names else cell["best_preset"]
             for cell in results["cells"].values()]
    x = np.arange(len(labels)) + (i - len(names) / 2) * width
    bars = ax.bar(x, [s["mean"] if s else np.nan for s in stats], width,
                  yerr=[(s["std"] or 0) if s else 0 for s in stats],
                  label=name, color="0.6" if name not in names else figures.color_of(name), capsize=2)
    figures.label_bars(ax, bars)
  ax.set_xticks(np.arange(len(labels)), labels, fontsize=8)
  ax.set_ylabel("final held-out accuracy")
  ax.set_ylim(0, 1)
  ax.grid(alpha=0.3, axis="y")
  figures.legend_outside(ax)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def render(results: dict, here: str = HERE, name: str = "results") -> None:
  """Table and figure into README.md between the `name` markers (`results` or `results_rerun`)."""
  names = " | ".join(f"`{c}`" for c in results["candidates"])
  rows = [f"| evidence | {names} | best preset at this lag |",
          "|---|" + "---:|" * (len(results["candidates"]) + 1)]
  for label, cell in results["cells"].items():
    values = [study.fmt(cell["candidates"].get(c)) for c in results["candidates"]]
    best = cell["best_preset"]
    best = f"{best['cell']} {study.fmt(best)}" if best else "not run yet"
    rows.append(f"| {label} | " + " | ".join(values) + f" | {best} |")
  scores = results["choice"]["scores"]
  rows.append("| **score** (mean over cells) | "
              + " | ".join(f"**{scores[c]:.3f}**" if c in scores else "not in every cell"
                           for c in results["candidates"]) + " | |")
  left_out = results["choice"]["not_measured_everywhere"]
  pick = results["choice"]["pick"]
  chart = study.figure_file("settings", name)
  stats = [s for cell in results["cells"].values()
           for s in [*cell["candidates"].values(), cell["best_preset"]] if s]
  spread = ("half-width of the 95% t interval" if any("ci95" in s for s in stats)
            else "std")                       # results written before intervals carry the std only
  text = (f"Final held-out accuracy, mean ± {spread} over seeds, of each COPC setting in each cell the studies "
          f"ran it in; commit {results['git_commit'][:10]}.\n\n" + "\n".join(rows)
          + (f"\n\n**Pick: `{pick}`** (config overrides: `{json.dumps(overrides_of(pick))}`)." if pick
             else "\n\n**No pick yet**: no candidate was run in every cell.")
          + "".join(f" `{c}` was not run in: {', '.join(m)}." for c, m in left_out.items())
          + f"\n\n![each setting in each cell]({chart})")
  figure(results, os.path.join(here, chart))
  study.write_between_markers(os.path.join(here, "README.md"), name, text)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--render", action="store_true")
  parser.add_argument("--rerun", action="store_true", help="the pick from the reruns on the new learner")
  args = parser.parse_args()
  name = "results_rerun" if args.rerun else "results"
  out = os.path.join(HERE, f"{name}.json")
  if args.render:
    with open(out) as f:
      render(json.load(f), name=name)
    return
  candidates = list(RERUN_CANDIDATES if args.rerun else FIRST_CANDIDATES)
  cells = collect(EVIDENCE_RERUN if args.rerun else EVIDENCE, candidates=candidates, complete=args.rerun)
  results = {"description": "the copc preset's default, chosen from the studies' committed results"
                            + (" rerun on the new learner" if args.rerun else ""),
             "rule": "highest mean over evidence cells of the seed-mean final held-out accuracy, among the "
                     "candidates measured in every cell" + (" on every seed" if args.rerun else ""),
             "candidates": candidates, "cells": cells, "choice": choose(cells),
             "git_commit": study.git_commit(), **study.provenance()}
  study.write_json(out, results)
  render(results, name=name)
  print(json.dumps(results["choice"], indent=1))


if __name__ == "__main__":
  main()
