"""Every study's README shows exactly what its committed results JSON renders to."""

import importlib
import json
import os
import random
import shutil

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STUDIES = ["exact_decomposition", "advantage_staleness", "presets_across_staleness", "joint_sweep", "step_time",
           "search_stability", "copc_default"]


def load(study):
  return importlib.import_module(f"experiments.{study}.run")


@pytest.mark.parametrize("study,name", [(s, "results") for s in STUDIES]
                         + [("presets_across_staleness", "results_full"),
                            ("presets_across_staleness", "results_rerun"),
                            ("search_stability", "results_rerun"),
                            ("advantage_staleness", "results_rerun"), ("copc_default", "results_rerun"),
                            ("joint_sweep", "exact"),
                            ("joint_sweep", "policy_side"),
                            ("collapse_diagnosis", "results_search"),
                            ("collapse_diagnosis", "results_tool_arithmetic")])
def test_the_readme_tables_are_rendered_from_the_json(study, name, tmp_path):
  directory = os.path.join(ROOT, "experiments", study)
  if not os.path.exists(os.path.join(directory, f"{name}.json")):
    pytest.skip(f"{study} has no committed {name}.json yet")
  shutil.copy(os.path.join(directory, "README.md"), tmp_path / "README.md")
  with open(os.path.join(directory, f"{name}.json")) as f:
    results = json.load(f)
  module = load(study)
  module.render(results, here=str(tmp_path), **({"name": name} if name != "results" else {}))
  with open(os.path.join(directory, "README.md")) as f:
    assert (tmp_path / "README.md").read_text() == f.read()
  assert list(tmp_path.glob("*.png"))


def test_joint_sweep_broad_region_and_cells(tmp_path):
  module = load("joint_sweep")
  grid = [[0.10, 0.12, 0.50], [0.15, 0.30, 0.90]]
  assert module.broad_region(grid, higher_is_better=False, margin=0.05) == pytest.approx(3 / 6)
  assert module.broad_region([[0.9, 0.88], [0.5, 0.87]], higher_is_better=True, margin=0.03) == 0.75
  preset = module.copc_cell(2.0, 3.0)
  assert preset.actor.mask_range == (0.5, 2.0) and preset.estimator.rho_clip == (1 / 3, 3.0)
  assert preset.estimator.trace_clip == (1 / 3, 1.0)
  assert module.copc_cell(2.0, 3.0, "zero_one").estimator.trace_clip == (0.0, 1.0)
  cells = module.rl_cells((1.5, module.INF))
  assert [c.name for c in cells] == ["h1.5_rho1.5", "h1.5_rho∞", "h∞_rho1.5", "h∞_rho∞"]
  cells = module.policy_cells((2.0, module.INF), (0.8, 1.0))
  assert [c.name for c in cells] == ["cap2_lam0.8", "cap2_lam1", "cap∞_lam0.8", "cap∞_lam1"]
  assert cells[1].overrides == {"preset": "decoupled_ppo", "actor.weight_cap": 2.0, "estimator.lam": 1.0}
  assert [module.output_name(False, 16, False), module.output_name(True, 64, False),
          module.output_name(False, 16, True)] == ["results", "results_full_k64", "policy_side"]
  from experiments import study
  run = lambda a: {"0": {"eval_curve": [(0, 0.5), (80, a)], "final_eval_accuracy": a, "auc": a,
                         "peak_to_final_drop": 0, "updates_to_target": None, "mask_fraction_mean": 0,
                         "ess_mean": 1, "staleness_mean": 16, "reward_last_10": a}}
  results = {"cells": {c.name: {"overrides": {**c.overrides, "trainer.lag": 16}, "runs": run(0.5 + 0.1 * i),
                                "aggregate": study.aggregate(run(0.5 + 0.1 * i))} for i, c in enumerate(cells)},
             "seeds": [0], "common_overrides": {"trainer.steps": 80, "trainer.lag": 16}, "git_commit": "abc",
             "jax_version": "0", "machine": "x", "target_accuracy": 0.8}
  (tmp_path / "README.md").write_text("<!-- policy_side:begin -->\n<!-- policy_side:end -->\n")
  module.render(results, here=str(tmp_path), name="policy_side")
  text = (tmp_path / "README.md").read_text()
  assert "cells within 0.03 of the best: 25%" in text and (tmp_path / "rl_heatmaps_policy_side.png").exists()

  # The rerun: both lags in one grid (one root: one warm start per seed), read against the spec's cell.
  grid = module.rerun_cells((2.0, module.INF), (64, 16))
  assert [c.name for c in grid][:2] == ["h2_rho2_k64", "h2_rho∞_k64"] and len(grid) == 8
  assert grid[0].overrides["trainer.lag"] == 64 and grid[-1].overrides["trainer.mode"] == "lag"
  results = {"cells": {c.name: {"overrides": c.overrides, "runs": run(0.4 + 0.1 * i),
                                "aggregate": study.aggregate(run(0.4 + 0.1 * i))} for i, c in enumerate(grid)},
             "seeds": [0], "common_overrides": {"trainer.steps": 300}, "git_commit": "abc", "jax_version": "0",
             "machine": "x"}
  (tmp_path / "README.md").write_text("<!-- results_rerun:begin -->\n<!-- results_rerun:end -->\n")
  module.render(results, here=str(tmp_path), name="results_rerun")
  text = (tmp_path / "README.md").read_text()
  assert "**k = 64** (the spec's setting: h2_rho2_k64; best other cell: h∞_rho∞_k64)" in text
  assert "Grid so far: 8 of 18 cells run" in text          # of the rerun's grid, not of the cells given
  assert "**k = 16**" in text and (tmp_path / "rl_heatmaps_rerun.png").exists()


def test_advantage_staleness_statistics():
  from copc_jax.rollout import agent

  module = load("advantage_staleness")
  rng = np.random.default_rng(0)
  target = rng.normal(size=400)
  tokens = [{"mc_advantage": float(a), "mc_variance": 0.0,
             "estimators": {"exact": float(a), "shifted": float(a + 0.5), "noisy": float(a + rng.normal())}}
            for a in target]
  metrics = module.summarise(tokens, resamples=200)
  assert metrics["exact"]["bias"]["value"] == pytest.approx(0.0, abs=1e-12)
  assert metrics["exact"]["correlation"]["value"] == pytest.approx(1.0)
  assert metrics["shifted"]["bias"]["value"] == pytest.approx(0.5) and metrics["shifted"]["mse"]["value"] == \
      pytest.approx(0.25)
  low, high = metrics["noisy"]["mse"]["ci95"]
  assert low < 1.0 < high                                   # Var = 1 inside its bootstrap CI
  # Paired against its control on the same tokens: the mean of the squared errors' difference.
  tokens = [{"mc_advantage": float(a), "mc_variance": 0.3, "episode": i // 4,
             "estimators": {"GAE (no correction)": float(a + 1.0), "V-trace": float(a + 0.5),
                            "COPC (defaults)": float(a + 1.0)}} for i, a in enumerate(target)]
  metrics = module.summarise(tokens, resamples=200)
  paired = {name: m.get("mse_minus_control") for name, m in metrics.items()}
  assert paired["GAE (no correction)"] is None                       # a control has none of its own
  assert paired["V-trace"]["control"] == "GAE (no correction)"
  assert paired["V-trace"]["value"] == pytest.approx(0.25 - 1.0)   # the MC noise cancels
  assert paired["COPC (defaults)"]["value"] == pytest.approx(0.0, abs=1e-12)
  trajectory = agent.Trajectory(prompt_ids=[1], token_ids=list(range(10)),
                                mask=[True] * 4 + [False] * 2 + [True] * 4)
  chosen = module.chosen_positions(trajectory, random.Random(0), extra=1)
  assert {0, 1, 6, 7} <= set(chosen) and len(chosen) == 5 and all(trajectory.mask[i] for i in chosen)


def test_advantage_staleness_sets_a_collapsed_learner_apart(tmp_path):
  module = load("advantage_staleness")
  token = lambda a: {"mc_advantage": a, "mc_variance": 0.0, "episode": 0, "estimators": {"GAE": a + 0.1}}
  tokens = lambda a: [token(a), {**token(-a), "episode": 1}]
  seed = lambda rewards, a: {"learner_version": 8, "lags": {str(k): {
      "tokens": tokens(a), "metrics": module.summarise(tokens(a), resamples=20), "abs_log_ratio_mean": 0.01 * k,
      "outside_default_mask": 0.0, "reward_mean": r} for k, r in rewards.items()}}
  healthy, collapsed = seed({0: 0.6, 4: 0.7}, 0.5), seed({0: 0.0, 4: 0.8}, 2.0)
  assert module.learner_collapsed(healthy) is False and module.learner_collapsed(collapsed) is True
  assert module.learner_collapsed(seed({0: 0.55, 4: 0.7}, 0.5)) is False        # a drop of 0.15: not collapsed
  assert module.learner_collapsed(seed({4: 0.7}, 0.5)) is None                  # no lag 0: cannot tell
  results = {"seeds": {"0": healthy, "1": collapsed}, "lag_of_training_run": 4, "updates": 8, "episodes": 2,
             "mc_continuations": 2, "git_commit": "abc", "jax_version": "0"}
  module.pool(results, resamples=20)
  assert results["collapsed_seeds"] == ["1"] and results["lags"]["0"]["tokens"] == 2       # seed 0's only
  assert results["lags"]["4"]["reward_mean"] == pytest.approx(0.7)
  (tmp_path / "README.md").write_text("<!-- results:begin -->\n<!-- results:end -->\n")
  module.render(results, here=str(tmp_path))
  text = (tmp_path / "README.md").read_text()
  assert "Seed 1: the learner collapsed" in text and "Seed 1, whose learner collapsed, on its own" in text
  # The rerun on the new learner: its own markers and figure, the first rendering left as it was.
  (tmp_path / "README.md").write_text("<!-- results:begin -->\nfirst\n<!-- results:end -->\n"
                                      "<!-- results_rerun:begin -->\n<!-- results_rerun:end -->\n")
  module.render(results, here=str(tmp_path), name="results_rerun")
  text = (tmp_path / "README.md").read_text()
  assert "first" in text and "Seed 1, whose learner collapsed" in text.split("results_rerun:begin")[1]
  assert "](advantage_error_rerun.png)" in text and (tmp_path / "advantage_error_rerun.png").exists()


def test_step_time_ratios_and_render(tmp_path):
  module = load("step_time")
  def method(t, stall=0.0):                  # a stall: one slow step (a server restarted mid-run)
    times = [t, t, t + stall]
    return {"step_time_s": float(np.mean(times)), "rollout_wait_s": t / 2, "train_s": 0.1,
            "weight_sync_s": 0.01, "staleness_mean": 1.0, "step_times_s": times, "response_len_mean": 20.0,
            "response_len_max": 41.0}
  regime = {"tool_latency_median_s": 0.5, "tool_latency_sigma": 1.0,
            "methods": {"sync PPO": method(3.0), "async PPO": method(1.5, stall=9.0),
                        "async COPC": method(1.65)}}
  assert module.ratios(regime) == pytest.approx({"async_ppo_speedup": 2.0, "copc_speedup": 3.0 / 1.65,
                                                 "copc_overhead": 0.1})
  results = {"steps": 20, "git_commit": "abc", "jax_version": "0", "machine": "x", "regimes": {"0.5 s": regime}}
  (tmp_path / "README.md").write_text("<!-- results:begin -->\n<!-- results:end -->\n")
  module.render(results, here=str(tmp_path))
  text = (tmp_path / "README.md").read_text()
  assert "| 0.5 s | 2.00× | 1.82× | +10.0% |" in text and (tmp_path / "speedup.png").exists()
  assert "| 20.0 / 41.0 | 1.82× |" in text


def test_search_stability_cells_and_render(tmp_path):
  module = load("search_stability")          # puts experiments/ on the path
  from experiments import study
  assert [c.name for c in module.cells(("copc",), (16, 64))] == ["sync_ppo_k0", "copc_k16", "copc_k64"]
  candidate = module.cells(("copc_nomask_vtrace_pg",), (16,))[1]
  assert candidate.overrides["preset"] == "copc_spec"
  assert candidate.overrides["estimator.advantage_form"] == "vtrace_pg"
  smoothed = module.smooth([1.0, None, 3.0], window=3)
  assert smoothed.tolist() == pytest.approx([1.0, 2.0, 3.0])

  def run(curve, seed):
    rng = np.random.default_rng(seed)
    series = {k: rng.random(50).tolist() for k in ("entropy", "grad_norm", "mask_fraction")}
    return {"eval_curve": curve, "final_eval_accuracy": curve[-1][1], "auc": 0.5, "peak_to_final_drop": 0.1,
            "updates_to_target": None, "mask_fraction_mean": 0.0, "ess_mean": 1.0, "staleness_mean": 16.0,
            "reward_last_10": 0.5, "series": series}
  runs = {"0": run([(0, 0.4), (25, 0.7), (50, 0.3)], 0), "1": run([(0, 0.4), (25, 0.6), (50, 0.65)], 1)}
  results = {"cells": {"copc_k16": {"overrides": {"trainer.lag": 16}, "runs": runs,
                                    "aggregate": study.aggregate(runs)}},
             "seeds": [0, 1], "common_overrides": {"trainer.steps": 50}, "git_commit": "abc",
             "jax_version": "0", "machine": "x", "target_accuracy": 0.6}
  (tmp_path / "README.md").write_text("<!-- results:begin -->\n<!-- results:end -->\n")
  module.render(results, here=str(tmp_path))
  text = (tmp_path / "README.md").read_text()
  assert "| copc_k16 | 2 |" in text and "1/2 (at 50)" in text and (tmp_path / "curves.png").exists()
  assert "| copc_k16 | 2 | 0.400 ± 0.000 | 0.475 ± 0.175 | 0.075 ± 0.175 |" in text      # the RL gain table

  # The rerun: the same presets as the other reruns, and the comparison by lag against sync PPO.
  rerun = module.cells(module.RERUN["presets"], module.RERUN["lags"])
  assert {c.name for c in rerun} >= {"sync_ppo_k0", "copc_anchor_behavior_k64", "rloo_k16", "tis_k64"}
  assert next(c for c in rerun if c.name == "grpo_k16").overrides["trainer.group_size"] == 4
  assert next(c for c in rerun if c.name == "copc_anchor_behavior_k64").overrides["actor.anchor"] == "behavior"
  sync = {"0": run([(0, 0.4), (25, 0.6), (50, 0.7)], 2), "1": run([(0, 0.4), (25, 0.6), (50, 0.6)], 3)}
  results["cells"]["sync_ppo_k0"] = {"overrides": {"trainer.mode": "sync", "trainer.lag": 0}, "runs": sync,
                                     "aggregate": study.aggregate(sync)}
  (tmp_path / "README.md").write_text("<!-- results_rerun:begin -->\n<!-- results_rerun:end -->\n")
  module.render(results, here=str(tmp_path), name="results_rerun")
  text = (tmp_path / "README.md").read_text()
  assert "**k = 16** (best baseline: none run yet)" in text and (tmp_path / "curves_rerun.png").exists()


def test_copc_default_rule_counts_only_settings_run_in_every_cell():
  module = load("copc_default")
  stat = lambda mean: {"mean": mean, "std": 0.1, "n": 2}
  cells = {"a, k = 16": {"candidates": {"copc_spec": stat(0.7), "x": stat(0.9), "y": stat(0.95)}},
           "a, k = 64": {"candidates": {"copc_spec": stat(0.3), "x": stat(0.2), "y": stat(0.9)}},
           "b, k = 16": {"candidates": {"copc_spec": stat(0.5), "x": stat(0.5)}}}
  choice = module.choose(cells)
  assert choice["scores"] == pytest.approx({"copc_spec": 0.5, "x": 1.6 / 3})
  assert choice["pick"] == "x" and choice["not_measured_everywhere"] == {"y": ["b, k = 16"]}
  assert module.choose({"a": {"candidates": {}}})["pick"] is None


def test_copc_default_rerun_counts_a_cell_once_every_seed_finished(tmp_path):
  module = load("copc_default")
  final = lambda mean, n: {"aggregate": {"final_eval_accuracy": {"mean": mean, "std": 0.1, "n": n}}}
  results = {"seeds": [0, 1, 2, 3], "git_commit": "abc",
             "cells": {"copc_k64": final(0.1, 4), "copc_anchor_behavior_k64": final(0.8, 3),
                       "async_ppo_k64": final(0.85, 4), "copc_k16": final(0.7, 4)}}
  (tmp_path / "a.json").write_text(json.dumps(results))
  evidence = (("a, k = 64", "a", 64, "a.json"), ("a, k = 16", "a", 16, "a.json"),
              ("b, k = 64", "b", 64, "b.json"))
  cells = module.collect(evidence, str(tmp_path), module.RERUN_CANDIDATES, complete=True)
  assert cells["a, k = 64"]["candidates"] == {"copc_spec": {"mean": 0.1, "std": 0.1, "n": 4}}   # 3 of 4 seeds
  assert cells["a, k = 64"]["best_preset"]["cell"] == "async_ppo_k64"
  assert cells["b, k = 64"] == {"task": "b", "lag": 64, "source": "b.json", "source_commit": None,
                                "candidates": {}, "best_preset": None}                        # not run yet
  assert module.choose(cells)["pick"] is None
  partial = module.collect(evidence, str(tmp_path), module.RERUN_CANDIDATES)       # the first study's reading
  assert "copc_anchor_behavior" in partial["a, k = 64"]["candidates"]
  assert module.overrides_of("copc_anchor_behavior") == {"preset": "copc_spec", "actor.anchor": "behavior"}


def test_copc_default_table_gives_candidates_and_best_preset_the_same_spread(tmp_path):
  """The header names one spread (the 95% half-width where the JSON has intervals, the std in older JSON),
  and the best preset's column shows that spread too, not the std beside the candidates' intervals."""
  module = load("copc_default")
  stat = {"mean": 0.8, "std": 0.1, "ci95": 0.16, "n": 4}
  cell = {"candidates": {"copc_spec": stat}, "best_preset": {"cell": "async_ppo_k64", **stat}}
  results = {"candidates": ["copc_spec"], "cells": {"a, k = 64": cell}, "git_commit": "abc",
             "choice": {"scores": {"copc_spec": 0.8}, "pick": "copc_spec", "not_measured_everywhere": {}}}
  (tmp_path / "README.md").write_text("<!-- results:begin -->\n<!-- results:end -->\n")
  module.render(results, here=str(tmp_path))
  text = (tmp_path / "README.md").read_text()
  assert "mean ± half-width of the 95% t interval" in text
  assert "| 0.800 ± 0.160 | async_ppo_k64 0.800 ± 0.160 |" in text and "± 0.100" not in text
  for s in (stat, cell["best_preset"]):
    del s["ci95"]
  module.render(results, here=str(tmp_path))
  text = (tmp_path / "README.md").read_text()
  assert "mean ± std over seeds" in text and "| 0.800 ± 0.100 | async_ppo_k64 0.800 ± 0.100 |" in text


def test_the_copc_preset_is_the_setting_the_evidence_picked():
  """`copc` (the main job's default) is the committed pick of experiments/copc_default, whatever it is:
  the rerun's once it picks one, the first study's until then."""
  picks = {}
  for name in ("results_rerun", "results"):
    path = os.path.join(ROOT, "experiments", "copc_default", f"{name}.json")
    if os.path.exists(path):
      with open(path) as f:
        picks[name] = json.load(f)["choice"]["pick"]
  if not picks:
    pytest.skip("experiments/copc_default has no committed results yet")
  pick = picks.get("results_rerun") or picks.get("results")
  assert pick, "the committed evidence picks no setting"
  module = load("copc_default")
  from experiments import study
  picked = study.load_config("configs/default.py", module.overrides_of(pick), seed=0)
  default = study.load_config("configs/default.py", {"preset": "copc"}, seed=0)
  assert (default.estimator, default.actor) == (picked.estimator, picked.actor)


def test_the_comparison_table_pairs_seeds_against_the_best_baseline():
  from experiments import study
  run = lambda curve: {"eval_curve": curve, "final_eval_accuracy": curve[-1][1], "auc": 0.5,
                       "peak_to_final_drop": 0, "updates_to_target": None, "mask_fraction_mean": 0,
                       "ess_mean": 1, "staleness_mean": 64, "reward_last_10": 0}
  finals = {"sync_ppo_k0": (0.9, 0.8, 0.7), "a_k64": (0.6, 0.5, 0.4), "b_k64": (0.8, 0.7, 0.6),
            "copc_k64": (0.1, 0.7, 0.0)}
  results = {"cells": {}}
  for name, values in finals.items():
    runs = {str(s): run([(0, 0.5), (100, 0.9 if v < 0.3 else v), (300, v)]) for s, v in enumerate(values)}
    results["cells"][name] = {"runs": runs, "aggregate": study.aggregate(runs)}
  assert study.best_baseline(results, ["a_k64", "b_k64", "missing_k64"]) == "b_k64"
  table = study.comparison_table(results, list(finals), "sync_ppo_k0", "b_k64").splitlines()
  copc = next(line for line in table if line.startswith("| copc_k64"))
  # paired against b: (0.1 − 0.8, 0.7 − 0.7, 0 − 0.6) → mean −0.433; two of three collapsed (0.9 → 0.1, 0.9 → 0)
  assert "| -0.433 ± " in copc and "| 2/3 (at 300, 300) | 0.40 |" in copc
  assert next(line for line in table if line.startswith("| b_k64")).count("| – |") == 2


def test_runs_from_another_warm_start_are_not_paired_and_are_named(tmp_path):
  from experiments import study
  run = lambda start, final, **extra: {"eval_curve": [(0, start), (300, final)], "final_eval_accuracy": final,
                                       **extra}
  results = {"cells": {"ref": {"runs": {"0": run(0.32, 0.7), "1": run(0.44, 0.8, warm_start="aa")}},
                       "new": {"runs": {"0": run(0.33, 0.1), "1": run(0.44, 0.6, warm_start="aa"),
                                        "2": run(0.5, 0.5)}}}}
  difference = study.paired_difference(results, "new", "ref")
  assert difference["n"] == 1 and difference["mean"] == pytest.approx(-0.2)      # seed 1 only
  assert not study.same_warm_start(run(0.44, 0.8, warm_start="aa"), run(0.44, 0.8, warm_start="bb"))
  assert study.warm_start_note(results).endswith("not paired with them: new seed 0.")
  results["cells"]["new"]["runs"]["1"]["warm_start"] = "bb"
  assert study.warm_start_note(results).endswith("not paired with them: new seeds 0, 1.")
  (tmp_path / "a" / "b").mkdir(parents=True)
  (tmp_path / "a" / "b" / "w").write_bytes(b"1")
  first = study.digest(str(tmp_path / "a"))
  (tmp_path / "a" / "b" / "w").write_bytes(b"2")
  assert study.digest(str(tmp_path / "a")) != first and len(first) == 16


def test_the_early_signs_table_gives_each_windows_range_over_seeds():
  from experiments import study
  def run(kl, entropy, clip):
    return {"series": {"kl_behavior": kl, "entropy": entropy, "clip_fraction": clip}}
  updates = 60
  runs = {"0": run([0.1] * 25 + [1.0] * 35, [0.02] * updates, [0.0] * 24 + [0.5] + [0.9] * 35),
          "1": run([0.3] * 25 + [None] * 5 + [2.0] * 30, [0.04] * 10 + [0.2] * 50, [0.1] * updates)}
  results = {"cells": {"x_k64": {"runs": runs}, "empty_k64": {"runs": {}}}}
  table = study.early_signs_table(results, ["x_k64", "empty_k64", "missing_k64"]).splitlines()
  assert len(table) == 3 and "KL(μ‖π), updates 1–25" in table[0]
  # KL 1–25: 0.1 and 0.3; last 50 (updates 11–60): seed 0 (15·0.1 + 35·1) / 50 = 0.73, seed 1
  # (15·0.3 + 30·2) / 45 = 1.433 (None skipped); entropy 1–25: 0.02 and (10·0.04 + 15·0.2) / 25 = 0.136;
  # last 50: 0.02 and 0.2; clip 1–25: mean 0.02 and 0.1, largest 0.5 and 0.1.
  assert table[2] == ("| x_k64 | 2 | 0.100–0.300 | 0.730–1.433 | 0.020–0.136 | 0.020–0.200 | "
                      "0.020–0.100 | 0.100–0.500 |")
  assert study._range([-1e-5, 0.0]) == "0.000" and study._range([]) == "–"   # k3's rounding noise has no sign
