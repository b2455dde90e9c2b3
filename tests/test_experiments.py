import os
import subprocess
import sys

import numpy as np
import pytest

from copc_jax import estimators
from experiments import bench_estimators

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_benchmark_numpy_loop_computes_the_same_advantages():
  rng = np.random.default_rng(0)
  shape = (4, 50)
  rewards, values = rng.normal(size=shape).astype(np.float32), rng.normal(size=shape).astype(np.float32)
  log_ratio = (0.4 * rng.normal(size=shape)).astype(np.float32)
  mask = rng.random(shape) < 0.7
  bootstrap = rng.normal(size=4).astype(np.float32)
  adv, _ = estimators.coupled_advantages(rewards, values, log_ratio, np.zeros_like(log_ratio), mask,
                                         bootstrap_value=bootstrap)
  loop = bench_estimators.numpy_reverse_loop(rewards, values, log_ratio, mask, bootstrap)
  np.testing.assert_allclose(np.where(mask, loop, 0.0), np.asarray(adv), atol=1e-5)


def test_benchmark_script_runs():
  result = subprocess.run(
      [sys.executable, "-m", "experiments.bench_estimators", "--batch=4", "--lengths", "64",
       "--rounds=1", "--calls=1"], cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stderr[-2000:]
  assert "scan/rlax" in result.stdout


def test_learner_benchmark_runs_on_the_tiny_config(tmp_path):
  import json
  result = subprocess.run(
      [sys.executable, "-m", "experiments.bench_learner", "--configs", "tiny", "--steps", "1",
       f"--out={tmp_path / 'learner.json'}"], cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stderr[-2000:]
  assert "estimator" in result.stdout and " tiny |" in result.stdout
  written = json.loads((tmp_path / "learner.json").read_text())
  (row,) = written["rows"]
  assert row["model"] == "tiny" and row["step_s"] > 0 and 0 < row["mfu"] < 1 and written["git_commit"]
  assert row["forward_fraction"] + row["estimator_fraction"] + row["update_fraction"] == pytest.approx(1.0)


def test_rollout_benchmark_runs_with_one_server(tmp_path):
  import json
  result = subprocess.run(
      [sys.executable, "-m", "experiments.bench_rollout", "--hidden=64", "--layers=1", "--new-tokens=8",
       "--rounds=1", "--servers", "1", "--decode-steps", "4", "--concurrent", "6",
       f"--out={tmp_path / 'rollout.json'}"], cwd=ROOT,
      capture_output=True, text=True, timeout=600, env={**os.environ, "XLA_FLAGS": ""})
  assert result.returncode == 0, result.stderr[-2000:]
  assert "on-device generation (reference)" in result.stdout
  assert "1 server(s) via gRPC, 4 step(s)" in result.stdout
  assert result.stdout.count("× reference") == 4
  rows = json.loads((tmp_path / "rollout.json").read_text())["rows"]
  assert [r["path"] for r in rows] == ["on-device reference", "Python loop of the jitted step",
                                       "in-process backend", "gRPC", "gRPC"]
  assert rows[2]["steps_per_call"] == 16 and rows[2]["tokens_per_s"] > 0
  rows = rows[:2] + rows[3:]
  assert rows[0]["vs_reference"] == 1.0 and rows[2]["servers"] == 1 and rows[2]["decode_steps"] == 4
  assert rows[2]["tokens_per_s"] > 0 and len(rows[2]["peak_server_gib"]) == 1
  assert rows[3]["concurrent"] == 6 and rows[3]["servers"] == 1 and rows[3]["tokens_per_s"] > 0
  breakdown = json.loads((tmp_path / "rollout.json").read_text())["breakdown"]
  assert breakdown["request_fixed_ms"] > 0 and breakdown["reference_step_ms"] > 0
  costs = breakdown["round"]             # 4 steps per call over 4 slots: at least one slot-step per token
  assert costs["round_ms"] > 0 and costs["server_xla_compute_cpu_ms"] > 0 and costs["slot_steps_per_token"] >= 1
  readme = tmp_path / "README.md"
  readme.write_text("before\n<!-- rollout:begin -->\nold\n<!-- rollout:end -->\nafter\n")
  from experiments import bench_rollout
  bench_rollout.render(str(tmp_path / "rollout.json"), str(readme))
  text = readme.read_text()
  assert "old" not in text and text.count("| 1 server(s) through gRPC") == 2 and "slot-steps per" in text
  assert "| in-process backend, 16 decode steps per device call" in text and "the best in-process row" in text


def test_loop_cost_script_runs_and_its_recurrence_is_right():
  from experiments import xla_cpu_loop_costs
  rng = np.random.default_rng(0)
  a, b = rng.random((20, 3), np.float32), rng.random((20, 3), np.float32)
  (x0,), (out,) = xla_cpu_loop_costs.recurrence(num_outputs=1, num_carries=1)(a, b)
  expected, x = np.zeros_like(a), np.zeros(3, np.float32)
  for t in reversed(range(20)):
    x = a[t] + b[t] * x
    expected[t] = x
  np.testing.assert_allclose(np.asarray(out), expected, rtol=1e-6)
  np.testing.assert_allclose(np.asarray(x0), expected[0], rtol=1e-6)
  result = subprocess.run(
      [sys.executable, "-m", "experiments.xla_cpu_loop_costs", "--length=64", "--lanes", "4",
       "--repeats=1"], cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stderr[-2000:]
  assert "ns/lane-step" in result.stdout and result.stdout.count("\n    4 ") == 4


def test_weight_push_benchmark_runs_every_transfer(tmp_path):
  import json
  result = subprocess.run(
      [sys.executable, "-m", "experiments.bench_weight_push", "--config=tiny", "--servers", "1", "--rounds=1",
       f"--out={tmp_path / 'push.json'}"], cwd=ROOT, capture_output=True, text=True, timeout=600,
      env={**os.environ, "XLA_FLAGS": ""})
  assert result.returncode == 0, result.stderr[-2000:]
  row = json.loads((tmp_path / "push.json").read_text())["rows"][0]
  assert row["servers"] == 1 and all(row[f"{t}_s"] > 0 for t in ("path", "stream", "memory", "shm"))
  assert "| 1 |" in result.stdout and row["path_share_of_step"] > 0     # learner.json has the tiny step
  readme = tmp_path / "README.md"
  readme.write_text("<!-- weight_push:begin -->\n<!-- weight_push:end -->\n")
  from experiments import bench_weight_push
  bench_weight_push.render(str(tmp_path / "push.json"), str(readme))
  assert "| 1 | " in readme.read_text() and "its share of the step" in readme.read_text()


def test_peer_benchmark_times_our_side_and_its_peer_script_splits_steps(tmp_path):
  """Our phases for real on a small model; the peer script's per-step accounting on recorded calls
  (Tunix itself lives in its own environment, experiments/peer/requirements.txt)."""
  import argparse
  import json

  from experiments import bench_peer
  from experiments.peer import tunix_ppo

  calls = [("rollout_s", 0.0, 1.0, 10), ("forward_s", 1.0, 1.5), ("update_s", 1.5, 3.0),     # warm-up step
           ("rollout_s", 3.0, 3.2, 12), ("forward_s", 3.2, 3.3), ("update_s", 3.3, 3.8),
           ("rollout_s", 4.0, 4.1, 14), ("update_s", 4.1, 4.5)]
  steps = tunix_ppo.per_step(calls, end=5.0, warmup=1)
  assert [s["step_s"] for s in steps] == pytest.approx([1.0, 1.0])
  assert [s["rollout_tokens"] for s in steps] == [12, 14]
  assert steps[0]["update_s"] == pytest.approx(0.5) and steps[1]["forward_s"] == 0

  prompts = bench_peer.write_workload(str(tmp_path), prompts=4, prompt_length=8, hidden=32, layers=1)
  in_process = bench_peer.Ours(str(tmp_path), prompts, argparse.Namespace(
      new_tokens=4, epochs=2, decode_steps=1, backend="in_process"))
  try:
    side = in_process.run(steps=1, warmup=1)
  finally:
    in_process.close()
  assert 0 < side["rollout_tokens"] <= 4 * 4 and side["weight_sync_s"] > 0    # arrays: no file, no server
  args = argparse.Namespace(new_tokens=4, epochs=2, decode_steps=1, backend="jetstream")
  ours = bench_peer.Ours(str(tmp_path), prompts, args)
  try:
    mine = ours.run(steps=2, warmup=1)
    peaks = ours.peak_gib()
  finally:
    ours.close()
  assert len(mine["steps"]) == 2 and 0 < mine["rollout_tokens"] <= 4 * 4
  assert mine["learner_s"] > 0 and mine["weight_sync_s"] > 0 and peaks["server"] > 0
  assert not os.path.exists(ours.weights._shared)                     # the shm push is freed on close
  peer = {"rollout_s": 0.5, "rollout_tokens_per_s": 40.0, "forward_s": 0.1, "update_s": 0.3,
          "weight_sync_s": 0.0, "step_s": 1.0}
  result = bench_peer.summarise([mine], [peer], tokens_per_step=4 * 12)
  learner = result["summary"]["learner_tokens_per_s"]
  assert learner["peer"] == pytest.approx(48 / 0.4)
  assert learner["ratio"] == pytest.approx(0.4 / mine["learner_s"])
  assert "ratio" not in result["summary"]["weight_sync_s"]            # the peer has none: no ratio
  record = {**result, "peer": {"version": "0.1.7", "jax": "0.10.2"}, "parameters": 10 ** 5, "prompts": 4,
            "prompt_length": 8, "new_tokens": 4, "epochs": 2, "repeats_run": 1, "steps": 2, "warmup": 1,
            "git_commit": "0" * 40, "command": "python -m experiments.bench_peer",
            "peak_memory_gib": {"copc_jax_learner_process": 1.0, "copc_jax_server": 0.5, "peer": 1.0}}
  (tmp_path / "peer.json").write_text(json.dumps(record))
  readme = tmp_path / "README.md"
  readme.write_text("<!-- peer:begin -->\n<!-- peer:end -->\n")
  bench_peer.render(str(tmp_path / "peer.json"), str(readme))
  assert "| rollout tokens/s |" in readme.read_text() and "| weight sync, s |" in readme.read_text()


def test_the_default_run_on_both_backends_is_read_from_the_two_jsons():
  from experiments import default_run_seeds, study
  def result(finals, commit):
    runs = [{"workdir_name": f"seed{s}", "seed": s, "final_eval_accuracy": a, "initial_eval_accuracy": 0.4,
             "wall_time_s": 420.0} for s, a in enumerate(finals)]
    return {"git_commit": commit, "command": "python -m copc_jax.main --config=configs/default.py",
            "overrides": ["--config.rollout.backend=in_process"], "runs": runs,
            "seeds": {"initial_eval_accuracy": study.spread([0.4] * len(finals)),
                      "final_eval_accuracy": study.spread(finals)}}
  text = default_run_seeds.render_backends(result([0.5, 0.7, 0.9], "aaaaaaa1"),
                                           result([0.6, 0.6, 1.0], "bbbbbbb2"))
  assert "| JetStream servers | aaaaaaa | 3 | 0.400 | 0.700 ±" in text
  assert "| in-process | bbbbbbb | 3 |" in text
  assert "in-process − JetStream: +0.033 ±" in text and "range -0.100 to +0.100" in text
  other_start = result([0.6, 0.6, 1.0], "bbbbbbb2")
  other_start["runs"][1]["initial_eval_accuracy"] = 0.45          # a warm start built on another CPU
  text = default_run_seeds.render_backends(result([0.5, 0.7, 0.9], "aaaaaaa1"), other_start)
  assert "Not paired" in text and "in-process − JetStream" not in text


def test_the_rerun_plan_calls_each_study_with_flags_and_cells_it_has(tmp_path):
  """experiments/rerun_studies.sh, run with a Python that only records its arguments: every study it
  calls defines the flags it passes, and every cell it names is in that study's rerun grid."""
  from experiments.joint_sweep import run as joint_sweep_run
  from experiments.presets_across_staleness import run as presets_run
  from experiments.search_stability import run as search_run
  log = tmp_path / "calls.txt"
  fake = tmp_path / "python"
  fake.write_text(f"#!/usr/bin/env bash\necho \"$*\" >> {log}\n[ \"$1\" = - ] && exit 1\nexit 0\n")
  fake.chmod(0o755)
  subprocess.run(["bash", os.path.join(ROOT, "experiments", "rerun_studies.sh"), str(tmp_path / "runs")],
                 check=True, env={**os.environ, "PYTHON": str(fake)})
  calls = [line.split() for line in log.read_text().splitlines()]
  modules = [call[1] for call in calls if call[0] == "-m"]
  search = {c.name for c in search_run.cells(search_run.RERUN["presets"], search_run.RERUN["lags"])}
  early_k16 = ["copc_k16", "copc_anchor_behavior_k16", "async_ppo_k16"]     # what copc_default --rerun needs
  search_first = [c for c in search if c.endswith("_k64") or c == "sync_ppo_k0"] + early_k16
  joint_sweep = {c.name for c in joint_sweep_run.rerun_cells(joint_sweep_run.RERUN["values"],
                                                             joint_sweep_run.RERUN["lags"])}
  half = ["experiments.joint_sweep.run"] * (len(joint_sweep) // 2 - 1)      # a lag's cells but the spec's
  search_calls = ["experiments.search_stability.run"] * len(search_first)
  assert modules == (["experiments.presets_across_staleness.run"] * 4 + half
                     + ["experiments.warm_start_store"] + search_calls
                     + ["experiments.advantage_staleness.run"] + half + ["experiments.search_stability.run"])
  grids = {"experiments.presets_across_staleness.run": {
      c.name for c in presets_run.cells(presets_run.RERUN["presets"], presets_run.RERUN["lags"])},
      "experiments.joint_sweep.run": joint_sweep, "experiments.search_stability.run": search}
  named = set()
  for call in calls:
    if call[0] != "-m":
      continue
    source = open(os.path.join(ROOT, *call[1].split(".")) + ".py").read()
    for flag in (arg for arg in call[2:] if arg.startswith("--")):
      assert f'"{flag}"' in source, (call[1], flag)
    if "--cells" in call:
      cells = call[call.index("--cells") + 1:]
      cells = cells[:next((i for i, c in enumerate(cells) if c.startswith("--")), len(cells))]
      assert set(cells) <= grids[call[1]], set(cells) - grids[call[1]]
      named |= {(call[1], c) for c in cells}
  # Search runs sync PPO, every preset at k = 64 and the cells the copc default needs at k = 16, a cell
  # at a time, before the k = 16 halves.
  assert {c for m, c in named if m == "experiments.search_stability.run"} == set(search_first)
  assert set(early_k16) <= search
  # Every joint-sweep cell but the spec's (copied from the presets study) is named once.
  assert {c for m, c in named if m == "experiments.joint_sweep.run"} == {
      c for c in joint_sweep if not c.startswith("h2_rho2_")}
