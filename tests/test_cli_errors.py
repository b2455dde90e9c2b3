"""Every command-line mistake is one line naming the flag or field, the value and what is allowed (exit 2)."""

import json
import os
import subprocess
import sys

import pytest

from copc_jax.train import workdir

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = "--config=configs/default.py"

CASES = {
    "negative steps": ([CONFIG, "--config.trainer.steps=-1"], "config.trainer.steps must be >= 1; got -1"),
    "batch 0": ([CONFIG, "--config.trainer.batch_size=0"], "config.trainer.batch_size must be >= 1; got 0"),
    "unknown preset": ([CONFIG, "--config.preset=nope"], "config.preset must be one of ["),
    "unknown mode": ([CONFIG, "--config.trainer.mode=nope"], "config.trainer.mode must be one of"),
    "inverted clip": ([CONFIG, "--config.estimator.rho_clip=(2.0,0.5)"],
                      "config.estimator.rho_clip must satisfy 0 <= min <= max; got (2.0, 0.5)"),
    "unknown field": ([CONFIG, "--config.estimator.mask_low=3"],
                      "--config.estimator.mask_low: config.estimator has no field 'mask_low'; allowed: ["),
    "unknown section": ([CONFIG, "--config.nope=1"], "--config.nope: config has no field 'nope'"),
    "missing config file": (["--config=configs/nope.py"], "--config=configs/nope.py: no such file"),
    "nan temperature": ([CONFIG, "--config.rollout.temperature=nan"], "config.rollout.temperature must be"),
    "not an int": ([CONFIG, "--config.trainer.steps=abc"], "--config.trainer.steps=abc"),
}


def main_command(args, workdir_path):
  return [sys.executable, "-m", "copc_jax.main", *args, f"--workdir={workdir_path}"]


# the command line in a Python where JetStream is not installed (`sys.modules[name] = None` hides a package)
WITHOUT_JETSTREAM = ("import runpy, sys; sys.modules['jetstream'] = None; sys.argv[0] = 'copc_jax.main'; "
                     "runpy.run_module('copc_jax.main', run_name='__main__', alter_sys=True)")


def run_all(commands):
  """Start every command at once (each mostly waits on imports), then collect them."""
  env = {**os.environ, "XLA_FLAGS": "", "JAX_PLATFORMS": "cpu"}
  processes = [subprocess.Popen(c, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
               for c in commands]
  return [(p.wait(timeout=300), p.stdout.read(), p.stderr.read()) for p in processes]


def test_each_mistake_is_one_line_with_exit_status_2(tmp_path):
  a_file = tmp_path / "a_file"
  a_file.write_text("")
  busy = tmp_path / "busy"
  history = tmp_path / "history"
  history.mkdir()
  (history / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward_mean": 0.5}) + "\n")
  cases = {name: (main_command(args, tmp_path / name.replace(" ", "_")), message)
           for name, (args, message) in CASES.items()}
  cases["workdir is a file"] = (main_command([CONFIG], a_file),
                                f"--workdir={a_file}: exists and is not a directory")
  cases["workdir in use"] = (main_command([CONFIG], busy), f"is in use by another run (PID {os.getpid()})")
  cases["history without checkpoint"] = (main_command([CONFIG], history), "pass --fresh_start")
  cases["jetstream not installed"] = (
      [sys.executable, "-c", WITHOUT_JETSTREAM, CONFIG, f"--workdir={tmp_path / 'no_jetstream'}"],
      "config.rollout.backend = 'jetstream' runs JetStream servers, but JetStream is not installed: "
      "pip install --no-deps google-jetstream==0.2.2")
  verbose = CASES["negative steps"][0] + ["--verbose"]
  cases["verbose shows the traceback"] = (main_command(verbose, tmp_path / "v"), "Traceback")
  with workdir.claim(str(busy)):                 # this test process holds `busy` as a run would
    results = dict(zip(cases, run_all([command for command, _ in cases.values()])))
  for name, (returncode, _, stderr) in results.items():
    message = cases[name][1]
    assert message in stderr, (name, stderr[-2000:])
    if name == "verbose shows the traceback":
      assert returncode != 0 and len(stderr.splitlines()) > 5
      continue
    assert returncode == 2, (name, returncode, stderr[-2000:])
    assert stderr.strip().count("\n") == 0 and stderr.startswith("error: "), (name, stderr[-2000:])
  assert (history / "metrics.jsonl").exists()        # refused, not touched


def test_claim_locks_refuses_history_and_moves_it_aside_on_a_fresh_start(tmp_path):
  path = str(tmp_path / "run")
  said = []
  with workdir.claim(path):
    with pytest.raises(workdir.WorkdirError, match=f"PID {os.getpid()}"):
      with workdir.claim(path):
        pass
  with workdir.claim(path):                         # released when the first run ended
    pass
  os.makedirs(os.path.join(path, "tb"))
  open(os.path.join(path, "tb", "events"), "w").close()
  with open(os.path.join(path, "metrics.jsonl"), "w") as f:
    f.write('{"step": 1}\n')
  with pytest.raises(workdir.WorkdirError, match=r"previous run's history \(metrics.jsonl, tb/\)"):
    with workdir.claim(path):
      pass
  os.makedirs(os.path.join(path, "checkpoints", "3"))        # a checkpoint: this is a resume, not a restart
  with workdir.claim(path):
    pass
  with workdir.claim(path, fresh_start=True, log=said.append):
    assert not os.path.exists(os.path.join(path, "metrics.jsonl"))
  moved = said[0].rsplit(" ", 1)[1]
  assert sorted(os.listdir(moved)) == ["checkpoints", "metrics.jsonl", "tb"]
  with open(os.path.join(moved, "metrics.jsonl")) as f:
    assert f.read() == '{"step": 1}\n'


def test_a_run_killed_before_its_first_checkpoint_starts_over_with_its_rows_kept(tmp_path):
  """Only step-0 rows (the evaluation before RL, critic warm-up) and no checkpoint: the same command
  moves them aside, says where, and starts; no row is deleted."""
  path = str(tmp_path / "run")
  os.makedirs(os.path.join(path, "tb"))
  open(os.path.join(path, "tb", "events"), "w").close()
  rows = [{"step": 0, "eval_accuracy": 0.3}, {"step": 0, "critic_warmup_step": 1, "value_loss": 0.2}]
  with open(os.path.join(path, "metrics.jsonl"), "w") as f:
    f.write("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 0, "critic_warm')   # cut by the kill
  workdir.check(path)                                   # the command line's early check lets it through
  said = []
  with workdir.claim(path, log=said.append):
    assert not os.path.exists(os.path.join(path, "metrics.jsonl"))
  moved = said[0].rsplit(" ", 1)[1]
  assert "stopped before its first checkpoint" in said[0]
  with open(os.path.join(moved, "metrics.jsonl")) as f:
    assert [json.loads(line) for line in f.read().splitlines()[:2]] == rows


def test_print_config_shows_the_resolved_config_and_a_missing_workdir_is_one_line():
  (printed, out, err), (missing, _, missing_err) = run_all([
      [sys.executable, "-m", "copc_jax.main", "--config=configs/default.py:tis", "--print_config",
       "--config.trainer.steps=7"],
      [sys.executable, "-m", "copc_jax.main", "--config=configs/default.py"]])
  assert printed == 0, err[-2000:]
  config = json.loads(out)
  assert config["preset"] == "tis" and config["trainer"]["steps"] == 7 and config["actor"]["behavior_weight"]
  assert missing == 2 and missing_err.strip() == ("error: --workdir is required (a directory for metrics, "
                                                  "checkpoints and weights)")


def test_a_config_file_loads_from_any_working_directory(tmp_path):
  """The configs import `configs.common`; named by their path, they load outside the clone too."""
  done = subprocess.run([sys.executable, "-m", "copc_jax.main", f"--config={ROOT}/configs/default.py:tis",
                         "--print_config"], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                        env={**os.environ, "XLA_FLAGS": "", "JAX_PLATFORMS": "cpu"})
  assert done.returncode == 0, done.stderr[-2000:]
  assert json.loads(done.stdout)["preset"] == "tis"


def test_the_command_line_does_not_import_tensorboardx_before_a_run_logs_to_it():
  """tensorboardX imports PyTorch where it is installed: a refused command line or a dry run must not
  pay for it; the run that logs to TensorBoard imports it (test_trainer checks its event file)."""
  code = "import sys, copc_jax.main; print(sorted({'tensorboardX', 'torch'} & set(sys.modules)))"
  out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True,
                       env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert out.stdout.strip() == "[]", out.stdout
