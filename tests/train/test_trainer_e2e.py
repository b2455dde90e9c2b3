"""The trainer against real JetStream servers: the main command killed and resumed, failures on the way."""

import dataclasses
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time

import jax
import pytest
from test_trainer import make_config

from copc_jax.rollout.pool import wait_until
from copc_jax.rollout.process import ServerProcess
from copc_jax.train import metrics, trainer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMALL = ["--config.warm_start.steps=30", "--config.trainer.batch_size=8", "--config.trainer.max_staleness=2",
         "--config.trainer.checkpoint_every=1", "--config.trainer.eval_every=4", "--config.task.eval_size=16",
         "--config.rollout.num_servers=1", "--config.rollout.slots=4", "--config.rollout.max_in_flight=4",
         "--config.trainer.progress_bar=False"]


def main_command(workdir, steps):
  return [sys.executable, "-m", "copc_jax.main", "--config=configs/default.py", f"--workdir={workdir}",
          f"--config.trainer.steps={steps}", *SMALL]


def servers_of(workdir) -> list[int]:
  out = subprocess.run(["pgrep", "-f", f"copc_jax.rollout.serve --checkpoint={workdir}"], capture_output=True,
                       text=True).stdout
  return [int(pid) for pid in out.split()]


@pytest.mark.slow
@pytest.mark.parametrize("moment", ["warm_start", "critic_warmup", "updates"])
def test_the_main_command_killed_at_a_random_moment_resumes(tmp_path, moment):
  """SIGKILL during the warm start (its demonstrations written, its model not yet), the critic warm-up
  (before the step-0 checkpoint) or among the first updates: the same command continues, every update
  row appears once, and no row is deleted (rows of a run killed before its first checkpoint are moved
  into previous_<time>/). SIGKILL mid-save: test_checkpoint.py."""
  workdir = tmp_path / "run"
  env = {**os.environ, "XLA_FLAGS": ""}
  first = subprocess.Popen(main_command(workdir, 8), cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE, text=True)
  warm_start = workdir / "warm_start"
  rows = lambda: metrics.read_metrics(str(workdir))
  reached = {"warm_start": lambda: (warm_start / "demonstrations.jsonl").exists(),
             "critic_warmup": lambda: any("critic_warmup_step" in r for r in rows()),
             "updates": lambda: len(metrics.update_rows(rows())) >= 2}[moment]
  assert wait_until(lambda: reached() or first.poll() is not None,
                    timeout_s=400, interval_s=0.05), f"no {moment} row within 400 s"
  assert first.poll() is None, first.stderr.read()[-3000:]
  if moment != "warm_start":
    time.sleep(random.uniform(0.0, 1.0))                  # somewhere in a step, a push or a checkpoint
  first.send_signal(signal.SIGKILL)
  first.wait()
  warm_start_done = (warm_start / "model").exists()
  assert wait_until(lambda: not servers_of(workdir), timeout_s=15), "the servers outlived the trainer"
  before = metrics.read_metrics(str(workdir))
  killed_at = max((r["step"] for r in before), default=0)

  second = subprocess.run(main_command(workdir, 8), cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
  assert second.returncode == 0, second.stderr[-3000:]
  rows = metrics.read_metrics(str(workdir))
  # a warm start killed before its model was written is trained again; a finished one is reused
  assert ("warm start: reusing" in second.stderr) == warm_start_done
  if moment == "warm_start" and not before:                # killed before any row: nothing to move aside
    assert not [p for p in workdir.iterdir() if p.name.startswith("previous_")]
  elif "resumed from step" in second.stderr:
    resumed_from = int(second.stderr.split("resumed from step ")[1].split()[0])
    assert 0 <= resumed_from <= killed_at
  else:                                                  # killed before the step-0 checkpoint
    assert "stopped before its first checkpoint" in second.stderr
    moved = [p for p in workdir.iterdir() if p.name.startswith("previous_")]
    assert len(moved) == 1 and metrics.read_metrics(str(moved[0])) == before     # nothing deleted
  updates = metrics.update_rows(rows)
  assert [r["step"] for r in updates] == list(range(1, 9))  # every update once, numbering continued
  assert all(r["weights_version"] == r["step"] for r in updates)
  assert max(r["staleness_max"] for r in updates) <= 2
  summary = json.loads((workdir / "summary.json").read_text())
  assert summary["steps"] == 8 and summary["final_eval_accuracy"] is not None
  assert not servers_of(workdir)


def small_config(**sections):
  """test_trainer's small config, long enough (and rarely checkpointed) for a server to die mid-run."""
  merged = {"trainer": dict(steps=40, eval_every=0, checkpoint_every=100),
            "rollout": dict(slots=4, max_tokens_per_turn=16)}
  for section, values in sections.items():
    merged[section] = {**merged.get(section, {}), **values}
  return make_config(**merged)


def test_servers_that_never_become_ready_end_the_run_with_advice(tmp_path):
  config = small_config(rollout=dict(ready_timeout_s=0.5))
  with pytest.raises(trainer.TrainingError, match=r"did not start(.|\n)*ready_timeout_s \(0.5\)"):
    trainer.Trainer(trainer.build(config, str(tmp_path))).run()
  assert not servers_of(tmp_path)


def test_a_remote_pool_that_dies_saves_and_says_so(tmp_path, monkeypatch):
  from copc_jax.models import tiny

  tiny.make_tiny_checkpoint(str(tmp_path / "model"))
  server = ServerProcess(str(tmp_path / "model"), slots=4, max_prefill_length=64, max_length=128, version=-1)
  address = server.wait_ready()
  monkeypatch.setenv("COPC_AUTH_TOKEN", server.token)          # the remote server's shared token
  config = small_config(model=dict(checkpoint=str(tmp_path / "model")),
                        rollout=dict(addresses=(address,)))
  workdir = tmp_path / "run"
  killer = threading.Thread(target=lambda: wait_until(
      lambda: len(metrics.read_metrics(str(workdir))) >= 3, timeout_s=300) and server.kill())
  killer.start()
  try:
    with pytest.raises(trainer.TrainingError) as info:
      trainer.Trainer(trainer.build(config, str(workdir))).run()
  finally:
    killer.join()
    server.stop()
  message = str(info.value)
  assert "Every rollout server is down" in message and "rerun the same command" in message
  saved = [int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit()]
  assert max(saved) >= 2


def test_the_main_command_names_missing_data(tmp_path):
  # the config's model is not on this machine either: a tiny one (so the data is what is missing)
  result = subprocess.run([sys.executable, "-m", "copc_jax.main", "--config=configs/qwen2_5_math.py:1.5b",
                           f"--workdir={tmp_path}", f"--config.task.train_path={tmp_path}/train.parquet",
                           "--config.model.checkpoint=tiny", "--config.task.chat_template=False"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "XLA_FLAGS": ""})
  assert result.returncode != 0
  assert f"jax {jax.__version__}" in result.stderr and "devices: [" in result.stderr   # logged by default
  assert '"train_path": ' in result.stderr                                             # the resolved config
  assert f"config.task.train_path: {tmp_path}/train.parquet does not exist" in result.stderr
  assert "Traceback" not in result.stderr


def test_servers_that_do_not_fit_the_config_or_serve_another_model_are_refused(tmp_path, monkeypatch):
  from copc_jax.models import tiny

  tiny.make_tiny_checkpoint(str(tmp_path / "qwen2"), "qwen2")
  tiny.make_tiny_checkpoint(str(tmp_path / "llama"), "llama")
  server = ServerProcess(str(tmp_path / "qwen2"), slots=4, max_prefill_length=64, max_length=96, version=-1)
  address = server.wait_ready()
  monkeypatch.setenv("COPC_AUTH_TOKEN", server.token)
  try:
    config = small_config(model=dict(checkpoint=str(tmp_path / "qwen2")),
                          rollout=dict(addresses=(address,), max_length=128))
    short = (rf"rollout server {address} has max_length 96, less than config.rollout.max_length 128: start "
             r"it with --max_length=128")
    with pytest.raises(trainer.TrainingError, match=short):
      trainer.Trainer(trainer.build(config, str(tmp_path / "short"))).run()
    config = small_config(model=dict(checkpoint=str(tmp_path / "llama")), rollout=dict(addresses=(address,)))
    other = rf"rollout server {address} serves a different model: model_type is 'qwen2' there and 'llama' in"
    with pytest.raises(trainer.TrainingError, match=other):
      trainer.Trainer(trainer.build(config, str(tmp_path / "other"))).run()
  finally:
    server.stop()
  for workdir in ("short", "other"):           # refused before anything was generated or trained
    assert not metrics.read_metrics(str(tmp_path / workdir))


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="needs bubblewrap (setup.sh installs it)")
def test_streamed_weights_reach_a_server_that_cannot_see_the_learners_files(tmp_path, monkeypatch):
  """The server runs in a mount namespace where the learner's workdir is an empty tmpfs: pushing by
  path fails with advice; weight_transfer='stream' trains, every version arriving over gRPC; 'memory'
  and 'shm' (shared memory, which the server still sees) never write a version to the workdir."""
  from copc_jax.models import tiny

  tiny.make_tiny_checkpoint(str(tmp_path / "model"))
  hide = ["bwrap", "--dev-bind", "/", "/"]
  for name in ("by_path", "streamed", "in_memory", "shared_memory"):
    (tmp_path / name).mkdir()
    hide += ["--tmpfs", str(tmp_path / name)]
  hide = (*hide, "--")
  server = ServerProcess(str(tmp_path / "model"), slots=4, max_prefill_length=64, max_length=128, version=-1,
                         launcher=hide)
  address = server.wait_ready()
  client = server.client()
  monkeypatch.setenv("COPC_AUTH_TOKEN", server.token)          # the remote server's shared token
  try:
    config = small_config(model=dict(checkpoint=str(tmp_path / "model")), rollout=dict(addresses=(address,)),
                          trainer=dict(mode="sync", steps=3, eval_every=0))
    refused = r"refused weights version 0 \(path .*by_path.*weight_transfer='stream'"
    with pytest.raises(trainer.TrainingError, match=refused):
      trainer.Trainer(trainer.build(config, str(tmp_path / "by_path"))).run()
    rollout = dataclasses.replace(config.rollout, weight_transfer="stream")
    streamed = dataclasses.replace(config, rollout=rollout)
    trainer.Trainer(trainer.build(streamed, str(tmp_path / "streamed"))).run()
    rows = metrics.read_metrics(str(tmp_path / "streamed"))
    assert [r["step"] for r in rows if r["step"] >= 1] == [1, 2, 3]
    status = client.status()
    assert status["weight_swaps"] == {"UpdateWeights": 0, "UpdateWeightsBytes": status["version"] + 1}
    assert status["version"] == 3
    def train_without_the_workdir_disk(transfer: str, name: str) -> dict:
      """A 3-update run with `transfer` that writes no version to its workdir; the server's Status after."""
      rollout = dataclasses.replace(config.rollout, weight_transfer=transfer)
      trainer.Trainer(trainer.build(dataclasses.replace(config, rollout=rollout), str(tmp_path / name))).run()
      assert [r["step"] for r in metrics.read_metrics(str(tmp_path / name)) if r["step"] >= 1] == [1, 2, 3]
      weights = tmp_path / name / "weights"
      assert not weights.exists() or not any(weights.iterdir())
      return client.status()

    # "memory": the same, and nothing goes through the learner's disk either.
    swaps = train_without_the_workdir_disk("memory", "in_memory")["weight_swaps"]
    assert swaps["UpdateWeightsBytes"] == status["weight_swaps"]["UpdateWeightsBytes"] + 4
    # "shm": versions 0..3 by path from /dev/shm; the workdir and /dev/shm hold none afterwards.
    after = train_without_the_workdir_disk("shm", "shared_memory")
    assert after["version"] == 3 and after["weight_swaps"]["UpdateWeights"] == 4
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"copc_jax_weights_{os.getpid()}_")]
  finally:
    client.close()
    server.stop()
