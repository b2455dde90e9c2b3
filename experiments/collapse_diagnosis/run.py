"""Study: what separates the runs that collapse at lag 64 from those that do not.

  python -m experiments.collapse_diagnosis.run --task search                 # every cell, seeds 0 1 2
  python -m experiments.collapse_diagnosis.run --task search --cells vtrace copc_anchor_behavior
  python -m experiments.collapse_diagnosis.run --task search --render        # tables and figure from JSON

Lag mode at k = 64 (every batch from the weights 64 updates old; the first 64 updates all train on the
warm start's data), the learner as the field runs it (4 minibatches per batch, 10 critic warm-up
updates, centred whitening), and one ablation per cell, each a config override of a preset:

- the anchor: the PPO indicator on π_θ/μ (`actor.anchor=behavior`), the token mask on π_θ/μ inside
  the loss (`actor.mask_ratio=current`), mask widths 1.25–2;
- whitening none / scale / center; one minibatch (the old learner); no critic warm-up;
- ratio-free uncorrected PPO on stale data (decoupled PPO's knobs with no behaviour weight: sync PPO's
  loss, which the sync_ppo preset refuses to run stale); full importance sampling without a trust
  region; COPC without the mask and with lower clips at 0;
- the actor learning rate (3e-4, the task configs' default, against 1e-4 and 3e-5: how far the policy
  may move in k updates).

Collapse, stated before the runs (`study.collapse_step`): held-out accuracy more than 0.2 below its
running maximum from some evaluation to the end. Every cell of a seed starts from that seed's warm start.
Resumable: finished cells are read, not rerun; results are written after every run.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import numpy as np

from experiments import study

HERE = os.path.dirname(os.path.abspath(__file__))

INF = float("inf")
TASKS = {"search": ("configs/search.py", 0.6), "tool_arithmetic": ("configs/default.py", 0.8)}
LAG = 64
REFERENCE = "vtrace"
# cell → overrides (a preset and its knobs); the order is the order they run in.
CELLS = {
    "vtrace": {"preset": "vtrace"},
    "copc": {"preset": "copc_spec"},
    "decoupled_ppo": {"preset": "decoupled_ppo"},
    "vtrace_anchor_behavior": {"preset": "vtrace", "actor.anchor": "behavior"},
    "copc_anchor_behavior": {"preset": "copc_spec", "actor.anchor": "behavior"},
    "copc_mask_current": {"preset": "copc_spec", "actor.mask_ratio": "current"},
    "vtrace_one_minibatch": {"preset": "vtrace", "trainer.num_minibatches": 1},
    "vtrace_no_critic_warmup": {"preset": "vtrace", "trainer.critic_warmup_steps": 0},
    "vtrace_lr1e-4": {"preset": "vtrace", "trainer.actor_learning_rate": 1e-4},
    "vtrace_lr3e-5": {"preset": "vtrace", "trainer.actor_learning_rate": 3e-5},
    "copc_lr1e-4": {"preset": "copc_spec", "trainer.actor_learning_rate": 1e-4},
    "vtrace_whiten_none": {"preset": "vtrace", "estimator.whiten": "none"},
    "vtrace_whiten_scale": {"preset": "vtrace", "estimator.whiten": "scale"},
    "copc_mask1.25": {"preset": "copc_spec", "actor.mask_range": (0.8, 1.25)},
    "copc_mask1.5": {"preset": "copc_spec", "actor.mask_range": (0.667, 1.5)},
    "copc_mask_current1.25": {"preset": "copc_spec", "actor.mask_ratio": "current",
                              "actor.mask_range": (0.8, 1.25)},
    "decoupled_ppo_anchor_behavior": {"preset": "decoupled_ppo", "actor.anchor": "behavior"},
    "uncorrected_ppo": {"preset": "decoupled_ppo", "actor.behavior_weight": "none"},
    "full_is_no_trust_region": {"preset": "decoupled_ppo", "actor.weight_cap": 1e9,
                                "actor.clip_eps_low": 0.999, "actor.clip_eps_high": 1e9},
    "copc_nomask_lower0": {"preset": "copc_spec", "actor.mask_range": (0.0, INF),
                           "estimator.rho_clip": (0.0, 2.0),
                           "estimator.trace_clip": (0.0, 1.0)},
}
COMMON = {"trainer.mode": "lag", "trainer.lag": LAG, "trainer.eval_every": 20, "trainer.checkpoint_every": 20}
SERIES = (("entropy", "policy entropy"), ("kl_behavior", "KL(μ‖π_prox), k3"),
          ("value_explained_variance", "value explained variance"),
          ("advantage_raw_mean", "raw advantage mean"),
          ("clip_fraction", "clip fraction"), ("ratio_p99", "behaviour ratio p99"))


def cells(names) -> list[study.Cell]:
  return [study.Cell(name, CELLS[name]) for name in names]


def _series(run: dict, key: str) -> np.ndarray:
  return np.asarray([np.nan if v is None else v for v in run["series"].get(key, [])], float)


def run_readings(run: dict) -> dict:
  """Per run: the collapse step and what the rows held inside the lag window (updates 1–64: data of
  the warm start only) and after it."""
  collapse = study.collapse_step(run["eval_curve"])
  window = {key: _series(run, key)[:LAG] for key, _ in SERIES}
  mean = lambda x: float(np.nanmean(x)) if np.isfinite(x).any() else None
  return {"collapse_step": collapse,
          "kl_behavior_window_mean": mean(window["kl_behavior"]),
          "kl_behavior_window_last": mean(window["kl_behavior"][-5:]),
          "entropy_window_max": float(np.nanmax(window["entropy"])) if np.isfinite(window["entropy"]).any()
          else None,
          "clip_fraction_mean": mean(_series(run, "clip_fraction")),
          # the median: a batch whose targets barely vary gives a huge negative ratio (runs before the
          # learner reported those as null)
          "explained_variance_window_median": (float(np.nanmedian(window["value_explained_variance"]))
                                               if np.isfinite(window["value_explained_variance"]).any()
                                               else None),
          "advantage_raw_mean_window": mean(window["advantage_raw_mean"]),
          "critic_warmup_explained_variance": run.get("critic_warmup_explained_variance")}


def diagnosis(results: dict) -> dict:
  """Per cell: collapse count, Fisher p against the reference cell, paired difference in final
  accuracy and AUC against it, and the window readings' spread over seeds."""
  reference = results["cells"].get(REFERENCE, {}).get("runs", {})
  ref_collapsed = sum(study.collapse_step(r["eval_curve"]) is not None for r in reference.values())
  out = {}
  for name, entry in results["cells"].items():
    runs = entry["runs"]
    if not runs:
      continue
    readings = {seed: run_readings(run) for seed, run in runs.items()}
    collapsed = sum(r["collapse_step"] is not None for r in readings.values())
    out[name] = {
        "seeds": len(runs), "collapsed": collapsed,
        "collapse_steps": sorted(r["collapse_step"] for r in readings.values()
                                 if r["collapse_step"] is not None),
        "fisher_p_vs_reference": (study.fisher_collapses(collapsed, len(runs), ref_collapsed, len(reference))
                                  if reference and name != REFERENCE else None),
        "final_minus_reference": (study.paired_difference(results, name, REFERENCE)
                                  if reference and name != REFERENCE else None),
        "auc_minus_reference": (study.paired_difference(results, name, REFERENCE, "auc")
                                if reference and name != REFERENCE else None),
        **{key: study.spread([r[key] for r in readings.values() if r[key] is not None])
           for key in ("kl_behavior_window_mean", "kl_behavior_window_last", "entropy_window_max",
                       "clip_fraction_mean", "explained_variance_window_median", "advantage_raw_mean_window",
                       "critic_warmup_explained_variance")},
    }
  return out


def table(results: dict, readings: dict) -> str:
  f = study.fmt
  lines = ["| cell | seeds | final accuracy | − vtrace (paired) | AUC | collapsed | Fisher p vs vtrace | "
           "KL(μ‖π) in the lag window | entropy max (window) | clip fraction | value EV (window median) | "
           "EV after critic warm-up |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
  for name, entry in results["cells"].items():
    if name not in readings:
      continue
    r, a = readings[name], entry["aggregate"]
    at = f" (at {', '.join(map(str, r['collapse_steps']))})" if r["collapse_steps"] else ""
    p = "–" if r["fisher_p_vs_reference"] is None else f"{r['fisher_p_vs_reference']:.2f}"
    lines.append(f"| {name} | {r['seeds']} | {f(a['final_eval_accuracy'])} | {f(r['final_minus_reference'])} | "
                 f"{f(a['auc'])} | {r['collapsed']}/{r['seeds']}{at} | {p} | "
                 f"{f(r['kl_behavior_window_mean'], 4)} | "
                 f"{f(r['entropy_window_max'])} | {f(r['clip_fraction_mean'])} | "
                 f"{f(r['explained_variance_window_median'])} | {f(r['critic_warmup_explained_variance'])} |")
  return "\n".join(lines)


def figure(results: dict, path: str, names: list[str]) -> None:
  """Small multiples: one row per cell, held-out accuracy and the series, one line per seed."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  names = [n for n in names if results["cells"].get(n, {}).get("runs")]
  fig, axes = plt.subplots(len(names), 1 + len(SERIES), figsize=(3.1 * (1 + len(SERIES)), 2.3 * len(names)),
                           squeeze=False)
  for row, name in zip(axes, names, strict=True):
    for seed, run in sorted(results["cells"][name]["runs"].items()):
      steps, accuracy = zip(*run["eval_curve"], strict=True)
      line, = row[0].plot(steps, accuracy, marker=".", label=f"seed {seed}")
      for ax, (key, _) in zip(row[1:], SERIES, strict=True):
        values = _series(run, key)
        ax.plot(np.arange(1, len(values) + 1), values, color=line.get_color(), lw=0.8)
    row[0].set_ylabel(name, fontsize=8)
    for ax, (key, title) in zip(row, [("", "held-out accuracy"), *SERIES], strict=True):
      ax.set_title(title, fontsize=8)
      if key == "value_explained_variance":
        ax.set_ylim(-1, 1)          # a batch whose targets barely vary gives huge negative values
      ax.axvline(LAG, color="grey", lw=0.6, ls=":")
      ax.tick_params(labelsize=7)
      ax.grid(alpha=0.3)
  axes[0][0].legend(fontsize=6)
  fig.tight_layout()
  fig.savefig(path, dpi=90)
  plt.close(fig)


def render(results: dict, name: str = "results_search", here: str = HERE) -> dict:
  """Tables and the figure of `results_<task>.json` into `here`'s README (between `<task>` markers)."""
  task = name.removeprefix("results_")
  readings = diagnosis(results)
  results["diagnosis"] = readings
  figure(results, os.path.join(here, f"{task}.png"), list(CELLS)[:8])
  text = (f"**{task}** (`{results['config']}`), lag {LAG}, {results['common_overrides'].get('trainer.steps')} "
          f"updates per run, seeds {sorted({s for e in results['cells'].values() for s in e['runs']})}; "
          f"{study.grid_provenance(results)}. "
          f"Mean ± half-width of the 95% t interval over seeds; paired differences per seed.\n\n"
          + table(results, readings) + f"\n\n![{task}]({task}.png)")
  study.write_between_markers(os.path.join(here, "README.md"), task, text)
  return results


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--task", choices=sorted(TASKS), default="search")
  parser.add_argument("--updates", type=int, default=100)
  parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
  parser.add_argument("--cells", nargs="+", choices=list(CELLS), help="run only these cells")
  parser.add_argument("--render", action="store_true")
  parser.add_argument("--resummarise", action="store_true",
                      help="with --render: summarise every run again from its workdir's rows under --root")
  parser.add_argument("--root", default=None)
  parser.add_argument("--replace-other-warm-starts", action="store_true", help=study.REPLACE_HELP)
  args = parser.parse_args()
  config, target = TASKS[args.task]
  out = os.path.join(HERE, f"results_{args.task}.json")
  root = args.root or os.path.join(tempfile.gettempdir(), f"copc_collapse_diagnosis_{args.task}")
  if args.render:
    with open(out) as f:
      results = json.load(f)
    if args.resummarise:
      results = study.resummarise(results, root)
    study.write_json(out, render(results, f"results_{args.task}"))
    return
  results = study.run(cells(args.cells or list(CELLS)), args.seeds, config=config, root=root, out=out,
                      common={**COMMON, "trainer.steps": args.updates}, target=target,
                      description=f"collapse diagnosis at lag {LAG} on {args.task}",
                      replace_other_warm_starts=args.replace_other_warm_starts)
  study.write_json(out, render(results, f"results_{args.task}"))


if __name__ == "__main__":
  main()
