"""Study: presets across controlled staleness (lag mode), held-out accuracy curves over seeds.

  python -m experiments.presets_across_staleness.run            # default grid, about an hour here
  python -m experiments.presets_across_staleness.run --full     # 6 presets × k ∈ {4, 16, 64}, 3 seeds
  python -m experiments.presets_across_staleness.run --full --cells sync_ppo_k0 copc_k64   # part of it
  python -m experiments.presets_across_staleness.run --rerun --cells sync_ppo_k0 copc_k64  # the new learner

`--rerun` is the study on the learner as the field runs it (the task config's defaults: 4 minibatches
per batch, critic warm-up, centred whitening): sync PPO at k = 0, then every preset at k = 64 and 16,
COPC both as the spec states it and μ-anchored (`actor.anchor=behavior`, the collapse diagnosis's
stable reading), the group presets at 4 samples per prompt; 4 seeds, 300 updates per run. Its table
gives 95% t intervals over seeds, paired differences against sync PPO and against the best baseline
at that lag (the non-COPC cell with the highest mean final accuracy), and Fisher exact tests of the
collapse counts.
  python -m experiments.presets_across_staleness.run --render   # tables and figures from results.json

Resumable: finished cells are read, not rerun (workdirs under --root). The grid, the seeds and
the updates per cell are stated in results.json next to every number.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

from copc_jax import presets
from experiments import study

HERE = os.path.dirname(os.path.abspath(__file__))


CANDIDATES = study.CANDIDATES
DEFAULT = dict(presets=("async_ppo", "decoupled_ppo", "copc"), lags=(4, 16), seeds=(0, 1, 2), steps=80)
FULL = dict(presets=("async_ppo", "decoupled_ppo", "tis", "icepop", "vtrace", "copc"), lags=(4, 16, 64),
            seeds=(0, 1, 2), steps=300)
RERUN = dict(presets=study.RERUN_PRESETS, lags=(64, 16), seeds=(0, 1, 2, 3), steps=300)


def cells(presets, lags) -> list[study.Cell]:
  grid = [study.Cell("sync_ppo_k0", {"preset": "sync_ppo", "trainer.mode": "sync"})]
  grid += [study.Cell(f"{preset}_k{lag}", {**study.named_setting(preset), "trainer.mode": "lag",
                                           "trainer.lag": lag}) for lag in lags for preset in presets]
  return grid


def render(results: dict, here: str = HERE, name: str = "results") -> None:
  """Table and curves into README.md between the `name` markers (`results`, `results_full` or
  `results_rerun`)."""
  if name == "results_rerun":
    return study.render_by_lag(results, os.path.join(here, "README.md"), "results_rerun", "curves_rerun.png")
  cells = results["cells"].values()
  lags = sorted({c["overrides"]["trainer.lag"] for c in cells if "trainer.lag" in c["overrides"]})
  groups = {f"k = {lag} (sync PPO: k = 0)": ["sync_ppo_k0"] + [
      cell for cell, c in results["cells"].items() if c["overrides"].get("trainer.lag") == lag] for lag in lags}
  figure = study.figure_file("curves", name)
  study.curves_figure(results, os.path.join(here, figure), groups)
  text = (f"Grid: {len(results['cells'])} cells, seeds {results['seeds']}, "
          f"{results['common_overrides'].get('trainer.steps')} updates per run; "
          f"{study.grid_provenance(results)}.\n\n"
          + study.table(results, reference="sync_ppo_k0") + f"\n\n![held-out accuracy curves]({figure})")
  study.write_between_markers(os.path.join(here, "README.md"), name, text)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--full", action="store_true")
  parser.add_argument("--rerun", action="store_true", help="the study on the new learner (see above)")
  parser.add_argument("--render", action="store_true", help="only render results.json")
  parser.add_argument("--resummarise", action="store_true",
                      help="with --render: summarise again the runs whose workdirs are under --root")
  parser.add_argument("--presets", nargs="+", help="extend the grid with these presets (or CANDIDATES) ...")
  parser.add_argument("--lags", type=int, nargs="+", help="... at these lags (default: the grid's)")
  parser.add_argument("--cells", nargs="+", help="run only these cells of the grid (e.g. copc_k64)")
  parser.add_argument("--root", default=os.path.join(tempfile.gettempdir(), "copc_presets_across_staleness"))
  parser.add_argument("--replace-other-warm-starts", action="store_true", help=study.REPLACE_HELP)
  args = parser.parse_args()
  grid = RERUN if args.rerun else FULL if args.full else DEFAULT
  grid_cells = cells(grid["presets"], grid["lags"])
  unknown = set(args.presets or ()) - set(presets.PRESETS) - set(CANDIDATES) - set(study.VARIANTS)
  if unknown:
    allowed = sorted(presets.PRESETS) + sorted(CANDIDATES) + sorted(study.VARIANTS)
    parser.error(f"--presets: {sorted(unknown)} unknown; allowed: {allowed}")
  if args.presets:                    # an extension of the same study: same seeds and updates
    grid_cells += [c for c in cells(args.presets, args.lags or grid["lags"]) if c not in grid_cells]
  if args.cells:
    unknown = set(args.cells) - {c.name for c in grid_cells}
    if unknown:
      parser.error(f"--cells: {sorted(unknown)} not in the grid; allowed: {[c.name for c in grid_cells]}")
    grid_cells = [c for c in grid_cells if c.name in args.cells]
  name = "results_rerun" if args.rerun else "results_full" if args.full else "results"
  out = os.path.join(HERE, f"{name}.json")
  if args.render:
    with open(out) as f:
      results = json.load(f)
    if args.resummarise:
      results = study.resummarise(results, args.root)
      study.write_json(out, results)
    render(results, name=name)
    return
  results = study.run(grid_cells, list(grid["seeds"]), config="configs/default.py",
                      root=args.root, out=out,
                      common={"trainer.steps": grid["steps"], "trainer.eval_every": 20,
                              "trainer.checkpoint_every": 20},
                      description="presets across staleness: lag mode, held-out accuracy of the learner",
                      replace_other_warm_starts=args.replace_other_warm_starts)
  render(results, name=name)


if __name__ == "__main__":
  main()
