"""Study: joint sweep of COPC's two channels (mask half-width h × advantage clip ρ̄), exact and in RL.

  python -m experiments.joint_sweep.run --exact     # the exact tree MDP, 6 × 6 (and a policy-side grid)
  python -m experiments.joint_sweep.run             # RL, lag k = 16: 3 × 3 cells × 2 seeds, 80 updates
  python -m experiments.joint_sweep.run --full      # RL: 6 × 6 × 3 seeds, 300 updates (--lag 64 too)
  python -m experiments.joint_sweep.run --policy_side   # RL, the policy-side grid: w_max × λ, 3 × 3 × 2
  python -m experiments.joint_sweep.run --rerun     # RL on the new learner: 3 × 3 × k ∈ {64, 16} × 4 seeds
  python -m experiments.joint_sweep.run --render    # tables and heatmaps from the JSON files

RL results go to `results.json` (COPC grid) or `policy_side.json`, with `_full` for `--full` and
`_k<lag>` for a lag other than 16.

`--rerun` (into `results_rerun.json`) is the RL grid on the learner as the field runs it (the task
config's defaults: several minibatches per batch, critic warm-up, centred whitening) at k = 64 and 16
in one grid under one `--root`, so both lags start from the *same* warm start per seed (pass the
presets rerun's `--root` to share its warm starts too): 4 seeds, 300 updates per run; the spec's cell
(h = 2, ρ̄ = 2) resolves to the presets study's `copc` cell, so its runs are copied from that study's
`results_rerun.json` (each marked `copied_from`) instead of run again. Per lag, the
mean final accuracy per cell, paired differences against the spec's setting (h = 2, ρ̄ = 2) and the
grid's best cell, and Fisher tests of the collapse counts.

A cell (h, ρ̄) is COPC with the token mask 1[1/h ≤ r ≤ h] and the advantage channel's clips
ρ ∈ [1/ρ̄, ρ̄], traces c ∈ [1/ρ̄, min(ρ̄, 1)] (the exact part also with traces (0, 1)); ∞ is "no
clip" (written 1e9 in configs). The policy-side grid of the same size is decoupled PPO's weight cap
w_max × GAE λ. "Broad region": the fraction of a grid's cells within a stated margin of its best cell.
Resumable (finished RL cells are read from the JSON, not rerun).
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import os
import tempfile

import numpy as np

from copc_jax import exact_mdp, presets
from experiments import figures, study

HERE = os.path.dirname(os.path.abspath(__file__))


INF = 1e9
FULL_VALUES = (1.25, 1.5, 2.0, 3.0, 5.0, INF)
DEFAULT_VALUES = (1.5, 2.0, INF)
LAMBDAS = (0.0, 0.5, 0.8, 0.9, 0.95, 1.0)
DRIFTS = (0.5, 1.0, 2.0)
NUM_TREES = 8
SAMPLES = 64                      # the MSE of a 64-trajectory estimate: ‖bias‖² + trace(Cov)/64
EXACT_MARGIN = 0.1                # a cell is "near the best" within 0.1 of its relative MSE
RL_MARGIN = 0.03                  # ... or within 0.03 of final held-out accuracy


def label(value: float) -> str:
  return "∞" if value >= INF else f"{value:g}"


def copc_cell(h: float, rho_bar: float, traces: str = "clip") -> presets.Preset:
  copc = presets.get_preset("copc_spec")
  trace = (1 / rho_bar, min(rho_bar, 1.0)) if traces == "clip" else (0.0, 1.0)
  return presets.Preset(dataclasses.replace(copc.estimator, rho_clip=(1 / rho_bar, rho_bar), trace_clip=trace),
                        dataclasses.replace(copc.actor, mask_range=(1 / h, h)))


def policy_side_cell(cap: float, lam: float) -> presets.Preset:
  decoupled = presets.get_preset("decoupled_ppo")
  return presets.Preset(dataclasses.replace(decoupled.estimator, lam=lam),
                        dataclasses.replace(decoupled.actor, weight_cap=cap))


def exact_grid(make, rows, columns, trees) -> dict:
  """{metric: [[mean over trees and drifts]]} for every (row, column) preset."""
  metrics = ("bias_total", "relative_mse", "variance_term", "masked_fraction")
  grid = {m: np.zeros((len(rows), len(columns))) for m in metrics}
  spread = np.zeros((len(rows), len(columns)))
  for i, row in enumerate(rows):
    for j, column in enumerate(columns):
      preset, values = make(row, column), {m: [] for m in metrics}
      for tree in trees:
        result = exact_mdp.decomposition(tree, preset)
        norm2 = float(np.sum(result["g_star"] ** 2))
        values["relative_mse"].append(result["bias_total"] ** 2
                                      + result["gradient_variance_trace"] / SAMPLES / norm2)
        for m in ("bias_total", "variance_term", "masked_fraction"):
          values[m].append(result[m])
      for m in metrics:
        grid[m][i, j] = float(np.mean(values[m]))
      spread[i, j] = float(np.std(values["relative_mse"]))
    print(f"  row {label(row) if row >= 1 else row}: done", flush=True)
  return {**{m: v.tolist() for m, v in grid.items()}, "relative_mse_std": spread.tolist()}


def broad_region(values, *, higher_is_better: bool, margin: float) -> float:
  values = np.asarray(values, float)
  best = values.max() if higher_is_better else values.min()
  near = values >= best - margin if higher_is_better else values <= best + margin
  return float(near.mean())


def run_exact(out: str) -> dict:
  trees = [exact_mdp.make_tree(np.random.default_rng(seed), branching=3, depth=6, drift=drift, critic_mix=0.0)
           for drift in DRIFTS for seed in range(NUM_TREES)]
  results = {"description": "joint sweep on the exact tree MDP (K = 3, D = 6, critic V of μ)",
             "values": list(FULL_VALUES), "lambdas": list(LAMBDAS), "drifts": list(DRIFTS),
             "num_trees": NUM_TREES, "samples": SAMPLES, "margin": EXACT_MARGIN,
             "git_commit": study.git_commit(), **study.provenance()}
  for traces in ("clip", "zero_one"):
    print(f"COPC grid, traces {traces}:", flush=True)
    results[f"copc_traces_{traces}"] = exact_grid(lambda h, r, t=traces: copc_cell(h, r, t),
                                                  FULL_VALUES, FULL_VALUES, trees)
  print("policy-side grid (decoupled PPO: w_max × λ):", flush=True)
  results["policy_side"] = exact_grid(policy_side_cell, FULL_VALUES, LAMBDAS, trees)
  for name in ("copc_traces_clip", "copc_traces_zero_one", "policy_side"):
    results[name]["broad_region"] = broad_region(results[name]["relative_mse"], higher_is_better=False,
                                                 margin=EXACT_MARGIN)
  study.write_json(out, results)
  return results


RL_LAMBDAS = (0.8, 0.95, 1.0)


def policy_cells(caps, lambdas) -> list[study.Cell]:
  return [study.Cell(f"cap{label(cap)}_lam{lam:g}",
                     {"preset": "decoupled_ppo", "actor.weight_cap": cap, "estimator.lam": lam})
          for cap in caps for lam in lambdas]


def output_name(full: bool, lag: int, policy_side: bool) -> str:
  return (("policy_side" if policy_side else "results") + ("_full" if full else "")
          + ("" if lag == 16 else f"_k{lag}"))


def rl_cells(values) -> list[study.Cell]:
  return [study.Cell(f"h{label(h)}_rho{label(r)}",
                     {"preset": "copc_spec", "actor.mask_range": (1 / h, h), "estimator.rho_clip": (1 / r, r),
                      "estimator.trace_clip": (1 / r, min(r, 1.0))})
          for h in values for r in values]


RERUN = dict(values=DEFAULT_VALUES, lags=(64, 16), seeds=(0, 1, 2, 3), steps=300)
PRESETS_RERUN = os.path.join(os.path.dirname(HERE), "presets_across_staleness", "results_rerun.json")


def rerun_cells(values, lags) -> list[study.Cell]:
  """The COPC grid at every lag in one grid (one root, so one warm start per seed for every lag)."""
  return [study.Cell(f"{c.name}_k{lag}", {**c.overrides, "trainer.mode": "lag", "trainer.lag": lag})
          for lag in lags for c in rl_cells(values)]


def render_rerun(results: dict, here: str = HERE) -> None:
  """Per lag: a heatmap of mean final accuracy and a table against the spec's cell and the best cell."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  cells = results["cells"]
  lags = sorted({c["overrides"]["trainer.lag"] for c in cells.values()}, reverse=True)
  rows = sorted({c["overrides"]["actor.mask_range"][1] for c in cells.values()})
  columns = sorted({c["overrides"]["estimator.rho_clip"][1] for c in cells.values()})
  fig, axes = plt.subplots(1, len(lags), figsize=(4.6 * len(lags), 4), squeeze=False)
  tables = []
  for ax, lag in zip(axes[0], lags, strict=True):
    names = [n for n, c in cells.items() if c["overrides"]["trainer.lag"] == lag]
    mean = np.full((len(rows), len(columns)), np.nan)
    for name in names:
      o, stat = cells[name]["overrides"], cells[name].get("aggregate", {}).get("final_eval_accuracy")
      if stat:
        mean[rows.index(o["actor.mask_range"][1]), columns.index(o["estimator.rho_clip"][1])] = stat["mean"]
    heatmap(ax, mean.tolist(), rows, columns, f"k = {lag}: final held-out accuracy (mean)", fmt="{:.3f}")
    ax.set_xlabel("advantage clip ρ̄")
    ax.set_ylabel("mask half-width h")
    spec = f"h2_rho2_k{lag}"
    best = study.best_baseline(results, [n for n in names if n != spec])
    tables.append(f"**k = {lag}** (the spec's setting: {spec}; best other cell: {best or 'none run yet'})\n\n"
                  + study.comparison_table(results, names, spec, best))
  fig.tight_layout()
  fig.savefig(os.path.join(here, "rl_heatmaps_rerun.png"), dpi=110)
  plt.close(fig)
  seeds = sorted({int(s) for c in cells.values() for s in c["runs"]})
  ran = sum(bool(c["runs"]) for c in cells.values())
  copied = sorted({f"{n} (from {r['copied_from']})" for n, c in cells.items() for r in c["runs"].values()
                   if r.get("copied_from")})
  grid_size = len(rerun_cells(RERUN["values"], RERUN["lags"]))
  text = (f"Grid so far: {ran} of {grid_size} cells run, seeds {seeds}, "
          f"{results['common_overrides'].get('trainer.steps')} updates per run; "
          f"{study.grid_provenance(results)}. Mean ± "
          "half-width of the 95% t interval over seeds; paired differences per seed."
          + (f" Runs read from another study (the same typed config and warm start): {'; '.join(copied)}."
             if copied else "") + "\n\n" + "\n\n".join(tables)
          + "\n\n![RL heatmaps, rerun](rl_heatmaps_rerun.png)")
  study.write_between_markers(os.path.join(here, "README.md"), "results_rerun", text)


def heatmap(ax, values, rows, columns, title, fmt="{:.2f}", cmap="viridis"):
  return figures.heatmap(ax, values, [label(r) for r in rows],
                         [label(c) if c >= 1 else f"{c:g}" for c in columns], title, fmt=fmt, cmap=cmap)


def render_exact(results: dict, here: str = HERE) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  values, lambdas = results["values"], results["lambdas"]
  fig, axes = plt.subplots(2, 3, figsize=(13, 8))
  for column, name in enumerate(("copc_traces_clip", "copc_traces_zero_one")):
    heatmap(axes[0, column], results[name]["bias_total"], values, values, f"{name}: relative bias")
    heatmap(axes[1, column], results[name]["relative_mse"], values, values, f"{name}: relative MSE (N = 64)")
    axes[1, column].set_xlabel("advantage clip ρ̄")
    axes[0, column].set_ylabel("mask half-width h")
    axes[1, column].set_ylabel("mask half-width h")
  heatmap(axes[0, 2], results["policy_side"]["bias_total"], values, lambdas, "decoupled PPO: relative bias")
  heatmap(axes[1, 2], results["policy_side"]["relative_mse"], values, lambdas, "decoupled PPO: relative MSE")
  axes[1, 2].set_xlabel("GAE λ")
  axes[0, 2].set_ylabel("weight cap w_max")
  fig.tight_layout()
  fig.savefig(os.path.join(here, "exact_heatmaps.png"), dpi=110)
  plt.close(fig)
  lines = [f"Exact tree MDPs: {results['num_trees']} trees × drifts {results['drifts']}, K = 3, D = 6, "
           f"critic V of μ; commit {results['git_commit'][:10]}. Relative MSE of a "
           f"{results['samples']}-trajectory estimate against the per-token importance-sampled gradient g*; "
           "rows: mask half-width h (COPC) "
           "or weight cap w_max (decoupled PPO); columns: ρ̄ (COPC) or λ.", ""]
  for name in ("copc_traces_clip", "copc_traces_zero_one", "policy_side"):
    grid = np.asarray(results[name]["relative_mse"])
    best = np.unravel_index(np.argmin(grid), grid.shape)
    columns = lambdas if name == "policy_side" else values
    lines.append(f"- `{name}`: best cell {label(values[best[0]])} × "
                 f"{label(columns[best[1]]) if columns[best[1]] >= 1 else columns[best[1]]} "
                 f"(relative MSE {grid[best]:.3f}); cells within {results['margin']} of it: "
                 f"{results[name]['broad_region']:.0%}; relative MSE by row (min–max over columns): "
                 + ", ".join(f"{label(v)}: {row.min():.3f}–{row.max():.3f}" for v, row in zip(values, grid)))
  text = "\n".join(lines) + "\n\n![exact heatmaps](exact_heatmaps.png)"
  study.write_between_markers(os.path.join(here, "README.md"), "exact", text)


def render_rl(results: dict, here: str = HERE, name: str = "results") -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  cells = results["cells"]
  policy_side = any("actor.weight_cap" in c["overrides"] for c in cells.values())
  row_of = (lambda o: o["actor.weight_cap"]) if policy_side else (lambda o: o["actor.mask_range"][1])
  column_of = (lambda o: o["estimator.lam"]) if policy_side else (lambda o: o["estimator.rho_clip"][1])
  rows = sorted({row_of(c["overrides"]) for c in cells.values()})
  columns = sorted({column_of(c["overrides"]) for c in cells.values()})
  mean = np.full((len(rows), len(columns)), np.nan)
  std = np.full_like(mean, np.nan)
  for cell in cells.values():
    i, j = rows.index(row_of(cell["overrides"])), columns.index(column_of(cell["overrides"]))
    stat = cell.get("aggregate", {}).get("final_eval_accuracy")
    if stat:
      mean[i, j], std[i, j] = stat["mean"], np.nan if stat["std"] is None else stat["std"]
  fig, axes = plt.subplots(1, 2, figsize=(9, 4))
  heatmap(axes[0], mean.tolist(), rows, columns, "final held-out accuracy (mean)", fmt="{:.3f}")
  heatmap(axes[1], std.tolist(), rows, columns, "seed std", fmt="{:.3f}", cmap="magma")
  for ax in axes:
    ax.set_xlabel("GAE λ" if policy_side else "advantage clip ρ̄")
    ax.set_ylabel("weight cap w_max (decoupled PPO)" if policy_side else "mask half-width h")
  fig.tight_layout()
  figure = study.figure_file("rl_heatmaps", name)
  fig.savefig(os.path.join(here, figure), dpi=110)
  plt.close(fig)
  finished = mean[np.isfinite(mean)]
  near = broad_region(finished, higher_is_better=True, margin=RL_MARGIN) if finished.size else None
  region = f"cells within {RL_MARGIN} of the best: {near:.0%}" if finished.size else "no finished cells yet"
  common = results["common_overrides"]
  text = (f"Grid: {len(cells)} cells, seeds {results['seeds']}, {common.get('trainer.steps')} "
          f"updates per run at lag {common.get('trainer.lag')}; "
          f"{study.grid_provenance(results)}; {region}.\n\n"
          + study.table(results) + f"\n\n![RL heatmaps]({figure})")
  study.write_between_markers(os.path.join(here, "README.md"), name, text)


def render(results: dict, here: str = HERE, name: str = "results") -> None:
  """`results.json` / `results_full.json` (RL) or `exact.json`."""
  if name == "exact":
    render_exact(results, here)
  elif name == "results_rerun":
    render_rerun(results, here)
  else:
    render_rl(results, here, name)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--exact", action="store_true", help="the exact-MDP grid (minutes)")
  parser.add_argument("--full", action="store_true")
  parser.add_argument("--render", action="store_true", help="only render the JSON files")
  parser.add_argument("--lag", type=int, default=16)
  parser.add_argument("--policy_side", action="store_true", help="decoupled PPO's w_max × λ grid (RL)")
  parser.add_argument("--rerun", action="store_true", help="RL on the new learner, k = 64 and 16 (see above)")
  parser.add_argument("--cells", nargs="+", help="with --rerun: run only these cells (e.g. h2_rho2_k64)")
  parser.add_argument("--root", default=os.path.join(tempfile.gettempdir(), "copc_joint_sweep"))
  parser.add_argument("--replace-other-warm-starts", action="store_true", help=study.REPLACE_HELP)
  args = parser.parse_args()
  if args.render:
    for path in sorted(glob.glob(os.path.join(HERE, "*.json"))):
      with open(path) as f:
        render(json.load(f), name=os.path.basename(path).removesuffix(".json"))
    return
  if args.exact:
    render(run_exact(os.path.join(HERE, "exact.json")), name="exact")
    return
  if args.rerun:
    grid = rerun_cells(RERUN["values"], RERUN["lags"])
    common = {"trainer.steps": RERUN["steps"], "trainer.eval_every": 20, "trainer.checkpoint_every": 20}
    out = os.path.join(HERE, "results_rerun.json")
    unknown = set(args.cells or ()) - {c.name for c in grid}
    if unknown:
      parser.error(f"--cells: {sorted(unknown)} not in the grid; allowed: {[c.name for c in grid]}")
    for cell in grid:          # the spec's cell is the presets study's `copc` cell: read, not run again
      if cell.name.startswith("h2_rho2_k"):
        study.copy_identical_runs(out, "configs/default.py", common, cell, PRESETS_RERUN,
                                  f"copc_k{cell.overrides['trainer.lag']}", seeds=RERUN["seeds"])
    grid = [c for c in grid if not args.cells or c.name in args.cells]
    results = study.run(grid, list(RERUN["seeds"]), config="configs/default.py", root=args.root, out=out,
                        common=common,
                        description="joint sweep of mask half-width × advantage clip, COPC, new learner, "
                                    "k = 64 and 16 from shared warm starts",
                        replace_other_warm_starts=args.replace_other_warm_starts)
    render(results, name="results_rerun")
    return
  if args.cells:
    parser.error("--cells is for --rerun")
  values, seeds, steps = (FULL_VALUES, (0, 1, 2), 300) if args.full else (DEFAULT_VALUES, (0, 1), 80)
  name = output_name(args.full, args.lag, args.policy_side)
  grid = policy_cells(values, LAMBDAS if args.full else RL_LAMBDAS) if args.policy_side else rl_cells(values)
  results = study.run(grid, list(seeds), config="configs/default.py",
                      root=os.path.join(args.root, f"k{args.lag}"), out=os.path.join(HERE, f"{name}.json"),
                      common={"trainer.steps": steps, "trainer.mode": "lag", "trainer.lag": args.lag,
                              "trainer.eval_every": 20, "trainer.checkpoint_every": 20},
                      description=(f"policy-side grid: decoupled PPO's w_max × GAE λ, lag {args.lag}"
                                   if args.policy_side else
                                   f"joint sweep of mask half-width × advantage clip, COPC, lag {args.lag}"))
  render(results, name=name)


if __name__ == "__main__":
  main()
