"""CI's check that the training numerics did not change by accident (experiments/numerics_fingerprint.py)."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from experiments import numerics_fingerprint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_the_default_configs_numerics_match_the_recorded_fingerprint(tmp_path):
  """The script in its own process on one device (the tests' 8 fake devices would change the mesh)."""
  out = tmp_path / "fingerprint.json"
  result = subprocess.run([sys.executable, "-m", "experiments.numerics_fingerprint", f"--out={out}"], cwd=ROOT,
                          capture_output=True, text=True, timeout=900, env={**os.environ, "XLA_FLAGS": ""})
  assert result.returncode == 0, result.stderr[-3000:]
  got = json.loads(out.read_text())
  same_cpu = [r for r in numerics_fingerprint.recordings() if r["cpu"] == got["cpu"]]
  recorded = (same_cpu or numerics_fingerprint.recordings())[0]
  rtol, atol = (1e-4, 1e-6) if same_cpu else (numerics_fingerprint.CROSS_CPU_RTOL,
                                              numerics_fingerprint.CROSS_CPU_ATOL)
  advice = ("the training numerics changed: if this commit means to change them, rerun "
            "`python -m experiments.numerics_fingerprint --update`, say why in the commit, and regenerate "
            "the README numbers it moves (experiments/default_run_seeds.py); if not, find what moved")
  if not same_cpu:
    advice += " (no recording for this CPU's instruction set, compared within the cross-CPU drift)"
  if got["jax_version"] != recorded["jax_version"]:
    advice += f" (recorded with jax {recorded['jax_version']}, this is {jax.__version__})"
  assert got["evaluations"] == recorded["evaluations"], advice
  np.testing.assert_allclose([v for _, v in got["critic_warmup"]], [v for _, v in recorded["critic_warmup"]],
                             rtol=rtol, err_msg=advice)
  assert [r["step"] for r in got["updates"]] == [r["step"] for r in recorded["updates"]], advice
  for mine, theirs in zip(got["updates"], recorded["updates"], strict=True):
    for key in numerics_fingerprint.KEYS:
      as_float = lambda v: np.nan if v is None else v          # null: undefined (equal when both are)
      np.testing.assert_allclose(as_float(mine[key]), as_float(theirs[key]), rtol=rtol, atol=atol,
                                 err_msg=f"update {mine['step']}, {key}: {advice}")


def test_a_recording_replaces_this_cpus_and_a_deliberate_change_drops_the_others(tmp_path, monkeypatch):
  monkeypatch.setattr(numerics_fingerprint, "FIXTURE", str(tmp_path / "fingerprint.json"))
  numerics_fingerprint.record({"cpu": "a", "n": 1})
  numerics_fingerprint.record({"cpu": "b", "n": 1})
  numerics_fingerprint.record({"cpu": "a", "n": 2})
  assert numerics_fingerprint.recordings() == [{"cpu": "b", "n": 1}, {"cpu": "a", "n": 2}]
  numerics_fingerprint.record({"cpu": "a", "n": 3}, others=False)
  assert numerics_fingerprint.recordings() == [{"cpu": "a", "n": 3}]
