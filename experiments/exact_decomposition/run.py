"""Study: the exact two-channel decomposition of every preset's actor gradient, on random tree MDPs.

  python -m experiments.exact_decomposition.run            # 8 trees (K = 3, D = 6) × 5 drifts × 2 critics
  python -m experiments.exact_decomposition.run --render   # table and figures from results.json

Every number is exact (a μ-weighted sum over all 729 trajectories of each tree, `copc_jax.exact_mdp`);
the spread is over random trees. "Relative" means divided by ‖g*‖, the per-token importance-sampled
gradient E_μ[Σ_t ρ_t A^π ∇log π]; the MSE of an N-trajectory estimate is ‖bias‖² + trace(Cov)/N.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

import jax
import numpy as np

from copc_jax import exact_mdp, presets
from experiments import figures, study

HERE = os.path.dirname(os.path.abspath(__file__))


DRIFTS = (0.0, 0.25, 0.5, 1.0, 2.0)
CRITICS = {"V of μ": 0.0, "V halfway from μ to π": 0.5}
SAMPLE_SIZES = (64, 1024)
TERMS = ("bias_total", "bias_policy", "bias_advantage", "bias_coupled", "variance_term",
         "gradient_variance_trace", "error_vs_true_gradient", "masked_fraction")


def methods() -> dict[str, presets.Preset]:
  copc = presets.get_preset("copc_spec")
  names = ("async_ppo", "decoupled_ppo", "tis", "icepop", "vtrace")
  chosen = {name: presets.get_preset(name) for name in names}
  chosen["copc"] = copc                             # the spec's setting, whatever `copc` picks now
  # The best COPC setting of the two-state toy (issue notes): no mask, no ρ clip, traces (0, 1),
  # λ = 0.8, the vtrace_pg form; and COPC with every clip open (unbiased for g*).
  chosen["copc_toy_best"] = presets.Preset(
      dataclasses.replace(copc.estimator, rho_clip=(0.0, np.inf), trace_clip=(0.0, 1.0), lam=0.8,
                          advantage_form="vtrace_pg"),
      dataclasses.replace(copc.actor, mask_range=(0.0, np.inf)))
  chosen["copc_unclipped"] = presets.Preset(
      dataclasses.replace(copc.estimator, rho_clip=(0.0, np.inf), trace_clip=(0.0, np.inf)),
      dataclasses.replace(copc.actor, mask_range=(0.0, np.inf)))
  return chosen


def measure(num_trees: int) -> dict:
  rows = {}
  for critic_name, mix in CRITICS.items():
    for drift in DRIFTS:
      per_tree = {name: [] for name in methods()}
      for seed in range(num_trees):
        tree = exact_mdp.make_tree(np.random.default_rng(seed), branching=3, depth=6, drift=drift,
                                   critic_mix=mix)
        for name, preset in methods().items():
          result = exact_mdp.decomposition(tree, preset)
          norm2 = float(np.sum(result["g_star"] ** 2))
          entry = {key: result[key] for key in TERMS}
          for n in SAMPLE_SIZES:
            entry[f"relative_mse_n{n}"] = (result["bias_total"] ** 2
                                           + result["gradient_variance_trace"] / n / norm2)
          per_tree[name].append(entry)
      for name, entries in per_tree.items():
        rows[f"{critic_name} | drift {drift} | {name}"] = {
            "critic": critic_name, "drift": drift, "method": name,
            **{key: {"mean": float(np.mean([e[key] for e in entries])),
                     "std": float(np.std([e[key] for e in entries]))} for key in entries[0]}}
      print(f"{critic_name}, drift {drift}: done", flush=True)
  return rows


def render(results: dict, here: str = HERE) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  rows = results["rows"]
  names = list(dict.fromkeys(r["method"] for r in rows.values()))
  fig, axes = plt.subplots(1, 3, figsize=(15, 3.8))
  styles = figures.line_styles(names)
  for name in names:
    panels = ((axes[0], "bias_total", "V of μ"), (axes[1], "bias_total", "V halfway from μ to π"),
              (axes[2], "relative_mse_n64", "V of μ"))
    for ax, key, critic in panels:
      points = [(r["drift"], r[key]["mean"]) for r in rows.values()
                if r["method"] == name and r["critic"] == critic]
      ax.plot(*zip(*points), marker="o", label=name, **styles[name])
      ax.set_title(f"{key.replace('_', ' ')} ({critic})")
      ax.set_xlabel("drift of μ from π (logit noise)")
      ax.set_yscale("symlog", linthresh=1e-2)
      ax.grid(alpha=0.3)
  axes[0].set_ylabel("relative to ‖g*‖")
  figures.legend_outside(axes[2])
  fig.tight_layout()
  fig.savefig(os.path.join(here, "bias_and_mse.png"), dpi=110)
  plt.close(fig)
  fmt = lambda s: f"{s['mean']:.3f} ± {s['std']:.3f}"
  sections = []
  for critic in CRITICS:
    for drift in (0.5, 1.0):
      lines = [f"**{critic}, drift {drift}** (mean ± std over {results['num_trees']} trees)", "",
               "| method | bias ‖E ĝ − g*‖ | policy term | advantage term | coupled term | variance term "
               "E[w² Var(ΔA)] | rel. MSE, N = 64 | rel. MSE, N = 1024 | error vs ∇J | masked |",
               "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
      for name in names:
        r = rows[f"{critic} | drift {drift} | {name}"]
        lines.append(f"| {name} | {fmt(r['bias_total'])} | {fmt(r['bias_policy'])} | "
                     f"{fmt(r['bias_advantage'])} | {fmt(r['bias_coupled'])} | {fmt(r['variance_term'])} | "
                     f"{fmt(r['relative_mse_n64'])} | "
                     f"{fmt(r['relative_mse_n1024'])} | {fmt(r['error_vs_true_gradient'])} | "
                     f"{r['masked_fraction']['mean']:.3f} |")
      sections.append("\n".join(lines))
  text = (f"Commit {results['git_commit'][:10]}, jax {results['jax_version']}.\n\n" + "\n\n".join(sections)
          + "\n\n![bias and MSE against drift](bias_and_mse.png)")
  study.write_between_markers(os.path.join(here, "README.md"), "results", text)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--trees", type=int, default=8)
  parser.add_argument("--render", action="store_true")
  parser.add_argument("--out", default=os.path.join(HERE, "results.json"), help="elsewhere: no README update")
  args = parser.parse_args()
  out = args.out
  if not args.render:
    results = {"description": "exact two-channel decomposition on K = 3, D = 6 tree MDPs",
               "num_trees": args.trees, "drifts": DRIFTS, "critics": CRITICS, "sample_sizes": SAMPLE_SIZES,
               "git_commit": study.git_commit(), "jax_version": jax.__version__,
               "methods": {name: json.loads(json.dumps(dataclasses.asdict(p), default=str))
                           for name, p in methods().items()},
               "rows": measure(args.trees)}
    study.write_json(out, results)
  if os.path.abspath(out) == os.path.join(HERE, "results.json"):
    with open(out) as f:
      render(json.load(f))


if __name__ == "__main__":
  main()
