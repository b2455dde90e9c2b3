"""`--dry_run_rollouts=N`: the start policy's episodes, printed with their rewards, and the measured
tool-call rate instead of a claim about the format; nothing is trained."""

import json
import os
import subprocess
import sys

import pytest

from copc_jax.envs import math_tool

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_a_dry_run_prints_the_start_policys_episodes_and_measures_them(tmp_path):
  workdir = tmp_path / "run"
  command = [sys.executable, "-m", "copc_jax.main", "--config=configs/default.py", f"--workdir={workdir}",
             "--dry_run_rollouts=4", "--config.warm_start.steps=0", "--config.rollout.num_servers=1"]
  out = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900)
  assert out.returncode == 0, out.stderr[-3000:]
  summary = json.loads((workdir / "dry_run_rollouts.json").read_text())
  rows = summary["rows"]
  assert summary["episodes"] == len(rows) == 4 and out.stdout.count("--- episode") == 4
  assert summary["tool_call_rate"] == sum(math_tool.OUTPUT_OPEN in r["response"] for r in rows) / 4
  assert summary["mean_reward"] == pytest.approx(sum(r["reward"] for r in rows) / 4)
  assert summary["start_policy"] == str(workdir / "base")              # no warm start: the base model
  assert not (workdir / "metrics.jsonl").exists() and not (workdir / "checkpoints").exists()
