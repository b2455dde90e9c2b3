"""Tiny end-to-end runs of the study scripts that the runner test does not cover (real servers, tools)."""

import json
import os
import shutil
import subprocess
import sys

import pytest
from test_notebooks import load_notebook_runner
from test_studies_render import load  # a study's run.py as a module

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_advantage_staleness_end_to_end(tmp_path, monkeypatch):
  """The notebook's live cell runs the study's script in the smoke setting; its JSON is checked here."""
  monkeypatch.setenv("COPC_NOTEBOOK_SMOKE", "1")
  monkeypatch.setenv("COPC_NOTEBOOK_OUT", str(tmp_path))
  monkeypatch.setenv("XLA_FLAGS", "")
  execute = load_notebook_runner()
  execute.execute("advantage_staleness", timeout_s=900)
  out = tmp_path / "advantage_staleness" / "results.json"
  results = json.loads(out.read_text())
  module = load("advantage_staleness")
  names = list(module.estimators_compared())
  assert set(results["lags"]) == {"0", "1"} and set(results["seeds"]) == {"0"}
  assert results["seeds"]["0"]["learner_version"] == 2
  on_policy = results["lags"]["0"]
  assert on_policy["abs_log_ratio_mean"] == pytest.approx(0.0, abs=1e-3)
  assert on_policy["tokens"] >= 4 and set(on_policy["metrics"]) == set(names)
  # On-policy data: every correction is the identity, so GAE, V-trace and COPC's defaults coincide.
  bias = {name: on_policy["metrics"][name]["bias"]["value"] for name in names}
  assert bias["V-trace"] == pytest.approx(bias["GAE (no correction)"], abs=1e-4)
  assert bias["COPC (defaults)"] == pytest.approx(bias["GAE (no correction)"], abs=1e-4)
  for token in results["seeds"]["0"]["lags"]["1"]["tokens"]:
    assert token["mc_variance"] >= 0 and set(token["estimators"]) == set(names)

  command = [sys.executable, "-m", "experiments.advantage_staleness.run", "--seeds", "0", "--lags", "0", "1",
             "--episodes", "2", "--mc", "2", "--updates", "2", "--warm_start_steps", "5", "--resamples", "50",
             "--root", str(out.parent), "--out", str(out)]          # the notebook's smoke command
  again = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "XLA_FLAGS": ""})       # resumable: the seed is not rerun
  assert again.returncode == 0 and "training" not in again.stdout and "continuations" not in again.stdout

  here = tmp_path / "study"
  here.mkdir()
  shutil.copy(os.path.join(ROOT, "experiments", "advantage_staleness", "README.md"), here / "README.md")
  module.render(results, here=str(here))
  assert (here / "advantage_error.png").exists() and "GAE λ = 0.8" in (here / "README.md").read_text()


def test_exact_decomposition_end_to_end(tmp_path):
  """One tree per drift: on-policy every method is unbiased, and unclipped COPC is at every drift."""
  out = tmp_path / "exact.json"
  result = subprocess.run([sys.executable, "-m", "experiments.exact_decomposition.run", "--trees", "1",
                           "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stderr[-2000:]
  rows = json.loads(out.read_text())["rows"]
  for row in rows.values():
    if row["drift"] == 0.0 or row["method"] == "copc_unclipped":
      assert abs(row["bias_total"]["mean"]) < 1e-5, row
  at_drift_one = [r for r in rows.values() if r["drift"] == 1.0 and r["method"] == "decoupled_ppo"]
  assert all(r["bias_total"]["mean"] > 0.1 for r in at_drift_one)          # policy-side leaves bias
