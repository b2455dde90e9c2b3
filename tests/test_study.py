"""The study runner: a 2-cell × 2-seed grid of real runs end to end, resume, aggregation, rendering."""

import json
import os
import shutil

import numpy as np
import pytest

from experiments import study

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


TINY = {"trainer.steps": 2, "trainer.batch_size": 8, "trainer.eval_every": 2, "trainer.checkpoint_every": 2,
        "task.train_size": 64, "task.eval_size": 8, "warm_start.steps": 5, "warm_start.batch_size": 8,
        "rollout.num_servers": 1, "rollout.slots": 4, "rollout.max_in_flight": 4,
        "rollout.max_tokens_per_turn": 16}


@pytest.mark.slow
def test_a_tiny_grid_runs_resumes_and_aggregates(tmp_path, monkeypatch):
  cells = [study.Cell("copc_k1", {"preset": "copc", "trainer.mode": "lag", "trainer.lag": 1}),
           study.Cell("async_ppo_k1", {"preset": "async_ppo", "trainer.mode": "lag", "trainer.lag": 1})]
  out = str(tmp_path / "results.json")
  results = study.run(cells, [0, 1], config="configs/default.py", root=str(tmp_path / "runs"), out=out,
                      common=TINY, target=0.0)
  assert json.load(open(out)) == json.loads(json.dumps(results))
  assert results["git_commit"] and results["jax_version"] and results["base_config"]["trainer"]["steps"] == 2
  for name in ("copc_k1", "async_ppo_k1"):
    runs = results["cells"][name]["runs"]
    assert sorted(runs) == ["0", "1"]
    for run in runs.values():
      assert [s for s, _ in run["eval_curve"]] == [0, 2] and run["updates_to_target"] == 0
      assert len(run["series"]["reward_mean"]) == 2
    finals = [r["final_eval_accuracy"] for r in runs.values()]
    assert results["cells"][name]["aggregate"]["final_eval_accuracy"]["mean"] == pytest.approx(np.mean(finals))
  # One warm start per seed, shared by both cells; the run configs name it.
  assert sorted(os.listdir(tmp_path / "runs" / "_warm_start")) == ["seed0", "seed1"]
  log = (tmp_path / "runs" / "copc_k1" / "seed1" / "stdout.log").read_text()
  assert "_warm_start/seed1/model" in log and '"lag": 1' in log
  # The servers stayed alive across all four runs (one training and one evaluation server, started
  # once); no run started its own. On its own servers a run gets the same numbers (seeded sampling).
  assert sorted(os.listdir(tmp_path / "runs" / "_servers")) == ["server_0.log", "server_1.log"]
  assert not any((tmp_path / "runs" / cell / f"seed{s}" / "logs").exists()
                 for cell in ("copc_k1", "async_ppo_k1") for s in (0, 1))
  alone = study.run(cells[:1], [1], config="configs/default.py", root=str(tmp_path / "alone"),
                    out=str(tmp_path / "alone.json"), common=TINY, target=0.0, share_servers=False)
  assert (tmp_path / "alone" / "copc_k1" / "seed1" / "logs").exists()
  for key in ("eval_curve", "series"):
    assert alone["cells"]["copc_k1"]["runs"]["1"][key] == results["cells"]["copc_k1"]["runs"]["1"][key]

  def must_not_run(*args, **kwargs):
    raise AssertionError("a finished cell was run again")
  monkeypatch.setattr(study, "run_cell", must_not_run)
  shutil.rmtree(tmp_path / "runs")           # a later session: only the committed JSON is left
  again = study.run(cells, [0, 1], config="configs/default.py", root=str(tmp_path / "runs"), out=out,
                    common=TINY, target=0.0)
  assert again["cells"] == json.loads(json.dumps(results["cells"]))

  readme = tmp_path / "README.md"
  readme.write_text("# study\n<!-- results:begin -->\nold\n<!-- results:end -->\ntail\n")
  study.write_between_markers(str(readme), "results", study.table(again))
  text = readme.read_text()
  assert "old" not in text and "| copc_k1 | 2 |" in text and text.endswith("tail\n")
  study.curves_figure(again, str(tmp_path / "curves.png"), {"k = 1": ["copc_k1", "async_ppo_k1"]})
  assert (tmp_path / "curves.png").stat().st_size > 1000


def test_aggregate_counts_only_seeds_that_reached_the_target():
  runs = {"0": {"final_eval_accuracy": 0.5, "updates_to_target": 10, "auc": 0.4, "peak_to_final_drop": 0.0,
                "mask_fraction_mean": 0.0, "ess_mean": 1.0, "staleness_mean": 4.0, "reward_last_10": 0.5},
          "1": {"final_eval_accuracy": 0.7, "updates_to_target": None, "auc": 0.6, "peak_to_final_drop": 0.1,
                "mask_fraction_mean": 0.0, "ess_mean": 1.0, "staleness_mean": 4.0, "reward_last_10": 0.7}}
  a = study.aggregate(runs)
  assert a["final_eval_accuracy"]["mean"] == pytest.approx(0.6)
  assert a["final_eval_accuracy"]["std"] == pytest.approx(0.2 / 2 ** 0.5)          # sample std (n − 1)
  assert a["final_eval_accuracy"]["ci95"] == pytest.approx(12.7062 * 0.1, rel=1e-4)  # t(0.975, 1) · s / √2
  assert a["updates_to_target"] == {"mean": 10.0, "std": None, "ci95": None, "min": 10.0, "max": 10.0, "n": 1}


def test_fisher_test_of_collapse_counts():
  """2 of 3 against 1 of 3 collapsed: the exact test cannot tell them apart (the issue's example)."""
  assert study.fisher_collapses(2, 3, 1, 3) == pytest.approx(1.0)
  assert study.fisher_collapses(4, 4, 0, 4) == pytest.approx(2 / 70)     # two-sided: both extreme tables


def test_collapse_is_a_drop_that_does_not_recover():
  assert study.collapse_step([(0, 0.4), (20, 0.9), (40, 0.6), (60, 0.65)]) == 40
  assert study.collapse_step([(0, 0.4), (20, 0.9), (40, 0.6), (60, 0.8)]) is None      # recovered
  assert study.collapse_step([(0, 0.4), (20, 0.9), (40, 0.75)]) is None                # within 0.2
  assert study.collapse_step([(0, 0.9), (20, 0.5), (40, 0.95), (60, 0.1)]) == 60       # the running max


def test_runs_of_an_identical_cell_are_copied_with_their_source_and_others_are_not(tmp_path):
  """The joint sweep's spec cell is the presets study's `copc` cell: same typed config, so its runs are
  read from there (marked), not run again; a cell whose config differs copies nothing."""
  common = {"trainer.steps": 300, "trainer.mode": "lag", "trainer.lag": 64}
  source = tmp_path / "presets.json"
  run = {"final_eval_accuracy": 0.5, "auc": 0.4, "peak_to_final_drop": 0.1, "updates_to_target": None,
         "mask_fraction_mean": 0.1, "ess_mean": 0.9, "staleness_mean": 64.0, "reward_last_10": 0.5,
         "warm_start": "abc"}
  runs = {"0": run, "1": {**run, "final_eval_accuracy": 0.3}}
  source.write_text(json.dumps({"config": "configs/default.py", "cells": {"copc_k64": {
      "overrides": {**common, "preset": "copc"}, "runs": runs}}}))
  out = str(tmp_path / "sweep.json")
  spec = study.Cell("h2_rho2_k64", {"preset": "copc", "actor.mask_range": (0.5, 2.0),
                                    "estimator.rho_clip": (0.5, 2.0), "estimator.trace_clip": (0.5, 1.0)})
  assert study.copy_identical_runs(out, "configs/default.py", common, spec, str(source), "copc_k64",
                                   seeds=[0, 1, 2]) == [0, 1]
  entry = json.load(open(out))["cells"]["h2_rho2_k64"]
  assert entry["runs"]["1"]["final_eval_accuracy"] == 0.3
  assert entry["runs"]["0"]["copied_from"] == f"{os.path.relpath(source, ROOT)}: copc_k64"
  assert entry["aggregate"]["final_eval_accuracy"]["mean"] == pytest.approx(0.4)
  assert study.copy_identical_runs(out, "configs/default.py", common, spec, str(source), "copc_k64",
                                   seeds=[0, 1]) == []                      # already held: left alone
  tighter = study.Cell("h1.5_rho2_k64", {**spec.overrides, "actor.mask_range": (1 / 1.5, 1.5)})
  assert study.copy_identical_runs(out, "configs/default.py", common, tighter, str(source), "copc_k64",
                                   seeds=[0, 1]) == []
  assert "h1.5_rho2_k64" not in json.load(open(out))["cells"]


def test_a_study_file_keeps_each_series_on_one_line_and_reads_back_equal(tmp_path):
  value = {"seeds": [0, 1], "cells": {"copc_k64": {"runs": {"0": {
      "series": {"reward_mean": [0.5, 0.25, float("nan")]}, "eval_curve": [[0, 0.5], [20, 0.75]]}}}},
      "rows": [{"a": 1}, {"b": [1, 2]}], "empty": {}, "none": None}
  path = str(tmp_path / "results.json")
  study.write_json(path, value)
  text = open(path).read()
  assert '"reward_mean": [0.5, 0.25, NaN]' in text and '"eval_curve": [[0, 0.5], [20, 0.75]]' in text
  assert '\n  {\n   "a": 1\n  }' in text                    # a list of objects is indented like an object
  back = json.loads(text)
  assert json.dumps(back, sort_keys=True) == json.dumps(value, sort_keys=True)


def test_a_grid_names_the_commits_its_runs_ran_at():
  """A grid filled over several sessions: the header names every run's commit, not the last invocation's."""
  runs = lambda *commits: {str(i): {"git_commit": c} for i, c in enumerate(commits)}
  results = {"git_commit": "f" * 40, "cells": {"a": {"runs": runs("a" * 40, "b" * 40)},
                                               "b": {"runs": runs("b" * 40 + "+uncommitted")}}}
  assert study.run_commits(results) == f"commits {'b' * 10} (2 runs), {'a' * 10} (1 run)"
  one = {"git_commit": "c" * 40, "cells": {"a": {"runs": runs("a" * 40)}}}
  assert study.run_commits(one) == f"commit {'a' * 10}"
  unrecorded = {"git_commit": "c" * 40, "cells": {"a": {"runs": {"0": {}}}}}      # runs from before commits
  assert study.run_commits(unrecorded) == f"commit {'c' * 10}"


def test_only_code_changes_mark_a_commit_uncommitted(tmp_path, monkeypatch):
  """Results, READMEs and figures a running study writes into its checkout are not code: runs recorded
  after them keep the plain commit; an edited module marks it."""
  import subprocess
  git = lambda *args: subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True)
  git("init", "-q")
  (tmp_path / "run.py").write_text("x = 1\n")
  (tmp_path / "README.md").write_text("old\n")
  git("add", ".")
  git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "start")
  monkeypatch.setattr(study, "ROOT", str(tmp_path))
  head = study.git_commit()
  (tmp_path / "README.md").write_text("rendered\n")
  assert study.git_commit() == head and "+" not in head
  (tmp_path / "run.py").write_text("x = 2\n")
  assert study.git_commit() == head + "+uncommitted"
