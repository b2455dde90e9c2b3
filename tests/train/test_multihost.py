"""Two learner processes through jax.distributed on localhost: one global mesh, same step as one process."""

import json
import os
import subprocess
import sys

import jax
import multihost_worker
import portpicker
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


def run_two_processes(script, *args, timeout_s=600):
  """Run `script PROCESS_ID PORT *args` as processes 0 and 1 of one jax.distributed job; their RESULTs."""
  port = portpicker.pick_unused_port()
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  workers = [subprocess.Popen([sys.executable, os.path.join(HERE, script), str(i), str(port), *args],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for i in range(2)]
  outputs = [worker.communicate(timeout=timeout_s) for worker in workers]
  report = "\n".join(f"process {i} (exit {w.returncode}):\n{out[-2000:]}\n{err[-2000:]}"
                      for i, (w, (out, err)) in enumerate(zip(workers, outputs, strict=True)))
  assert all(w.returncode == 0 for w in workers), report          # both: one's error often explains the other's
  return [json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[7:])
          for out, _ in outputs]


@pytest.mark.slow
@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (fake) devices for the 1-process reference")
def test_two_processes_equal_one():
  results = run_two_processes("multihost_worker.py")
  assert all(r["process_count"] == 2 and r["device_count"] == 8 for r in results)
  assert results[0] == results[1]                       # both processes see the same global step
  single = multihost_worker.run_step()                  # this process: 8 local fake devices
  for key in ("actor_loss", "value_loss", "actor_grad_norm", "param_checksum"):
    assert results[0][key] == pytest.approx(single[key], rel=1e-5, abs=1e-6), key


def run_trainers(workdir, steps, mode):
  return run_two_processes("multihost_trainer_worker.py", str(workdir), str(steps), mode)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_two_trainer_processes_train_one_model_and_resume(tmp_path, mode):
  from copc_jax.train import metrics

  first = run_trainers(tmp_path, 3, mode)
  assert all(r["process_count"] == 2 and r["steps"] == 3 for r in first)
  assert first[0]["pushes"] == first[1]["pushes"] and first[0]["pushes"][0] == 0
  second = run_trainers(tmp_path, 5, mode)                 # resumes from step 3 on both processes
  assert all(r["pushes"][0] == 3 and r["steps"] == 5 for r in second)
  rows = metrics.read_metrics(str(tmp_path))               # written by process 0 only, each step once
  assert [r["step"] for r in rows] == list(range(6))
  assert max(r["staleness_max"] for r in rows[1:]) <= (0 if mode == "sync" else 1)
  record = json.loads((tmp_path / "checkpoints" / "5" / "record" / "metadata").read_text())
  assert len(record["processes"]) == 2 and record["step"] == 5


@pytest.mark.slow
def test_a_failing_trainer_process_saves_without_collectives_and_the_run_resumes(tmp_path):
  """Process 1's servers die: it saves its own state and exits without waiting for process 0."""
  port = portpicker.pick_unused_port()
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  command = lambda i: [sys.executable, os.path.join(HERE, "multihost_trainer_worker.py"), str(i), str(port),
                       str(tmp_path), "4", "sync", "1:6"]
  workers = [subprocess.Popen(command(i), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for i in range(2)]
  try:
    out, err = workers[1].communicate(timeout=300)       # it must not hang in a collective
    assert workers[1].returncode == 3, err[-3000:]
    assert "STOPPED training stopped at step" in out and "PoolExhausted" in out
  finally:
    workers[0].kill()                                    # it waits in the next collective (known limit)
    workers[0].communicate()
  assert (tmp_path / "checkpoints" / "stopped_process_1.json").exists()
  saved = json.loads((tmp_path / "checkpoints" / "stopped_process_1.json").read_text())
  assert {"data", "buffer"} <= set(saved)
  results = run_trainers(tmp_path, 4, "sync")              # healthy pools: both resume and finish
  assert all(r["steps"] == 4 for r in results)
  assert not (tmp_path / "checkpoints" / "stopped_process_1.json").exists()
