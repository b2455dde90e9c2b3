"""Workdirs on gs:// (`train/workdir.py`): the same API as a local path, run against a Cloud Storage
emulator on 127.0.0.1 (gcsfs for etils.epath, tensorstore for orbax, both pointed at it)."""

import json
import logging
import os
import socket
import subprocess
import sys
import time
import uuid

import jax
import jax.numpy as jnp
import pytest
from etils import epath
from flax import nnx
from test_trainer import make_config

from copc_jax.train import build, checkpoint, metrics, workdir

pytest.importorskip("gcsfs")
pytest.importorskip("gcp_storage_emulator")
BUCKET = "copc-test"


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


# The emulator, with the one header of Cloud Storage that tensorstore's OCDBT driver needs and the
# emulator omits: a download carries its object's generation (`x-goog-generation`). Without it a
# second write of the same checkpoint's manifest is refused as "Malformed StorageGeneration", on
# some runs and not others (whether orbax's writes reach the manifest in one flush or two).
EMULATOR = """
import sys
from gcp_storage_emulator.handlers import objects

download = objects.download

def download_with_generation(request, response, storage, *args, **kwargs):
    download(request, response, storage, *args, **kwargs)
    try:
        obj = storage.get_file_obj(request.params["bucket_name"], request.params["object_id"])
        response["x-goog-generation"] = obj["generation"]
    except Exception:
        pass

objects.download = download_with_generation
from gcp_storage_emulator.__main__ import main
main(sys.argv[1:])
"""


@pytest.fixture(scope="module")
def emulator():
  port = _free_port()
  process = subprocess.Popen([sys.executable, "-c", EMULATOR, "start", "--host=127.0.0.1",
                              f"--port={port}", "--in-memory", f"--default-bucket={BUCKET}"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  url = f"http://127.0.0.1:{port}"
  for name in ("gcsfs", "google.auth"):               # "no default credentials": the emulator needs none
    logging.getLogger(name).setLevel(logging.ERROR)
  saved = {k: os.environ.get(k) for k in ("STORAGE_EMULATOR_HOST", "TENSORSTORE_GCS_HTTP_URL")}
  os.environ["STORAGE_EMULATOR_HOST"] = url            # gcsfs (etils.epath's gs:// backend)
  os.environ["TENSORSTORE_GCS_HTTP_URL"] = url         # tensorstore (orbax's arrays)
  for _ in range(600):                                 # until it answers (no timing is asserted)
    try:
      socket.create_connection(("127.0.0.1", port), timeout=1).close()
      break
    except OSError:
      assert process.poll() is None, "the storage emulator exited"
      time.sleep(0.1)
  yield url
  process.terminate()
  process.wait()
  for key, value in saved.items():
    if value is None:
      os.environ.pop(key, None)
    else:
      os.environ[key] = value


@pytest.fixture(params=["local", "gs"])
def place(request, tmp_path):
  """A workdir that does not exist yet: a local path, or a fresh gs:// prefix on the emulator."""
  if request.param == "local":
    return str(tmp_path / "run")
  request.getfixturevalue("emulator")
  return f"gs://{BUCKET}/{uuid.uuid4().hex}/run"


def test_scratch_is_the_workdir_when_local_and_one_fixed_local_directory_for_a_url(tmp_path):
  assert workdir.scratch(str(tmp_path)) == str(tmp_path)
  remote = workdir.scratch("gs://bucket/run")
  assert "://" not in remote and remote == workdir.scratch("gs://bucket/run/")
  assert remote != workdir.scratch("gs://bucket/other")


def test_claim_refuses_history_without_checkpoint_and_a_fresh_start_moves_it_aside(place):
  root = epath.Path(place)
  root.mkdir(parents=True)
  (root / "metrics.jsonl").write_text(json.dumps({"step": 3, "reward_mean": 0.5}) + "\n")
  with pytest.raises(workdir.WorkdirError, match="previous run's history"), workdir.claim(place):
    pass
  with workdir.claim(place, fresh_start=True, log=lambda _: None):
    pass
  moved = [p for p in root.iterdir() if p.name.startswith("previous_")]
  assert len(moved) == 1 and (moved[0] / "metrics.jsonl").exists()
  assert not (root / "metrics.jsonl").exists()


def test_the_lock_is_held_on_this_host_for_a_remote_workdir_too(place):
  with workdir.claim(place), pytest.raises(workdir.WorkdirError, match="in use by another run"):
    with workdir.claim(place):
      pass


def test_rows_and_events_reach_the_workdir_and_a_resume_keeps_rows_up_to_its_step(place):
  logger = metrics.MetricsLogger(place, total_steps=3, progress=False)
  for step in (1, 2, 3):
    logger.write({"step": step, "reward_mean": step / 10})
    if step == 2:
      logger.sync()                                 # as the trainer does at a checkpoint
      assert [r["step"] for r in metrics.read_metrics(place)] == [1, 2]
  logger.close()
  assert [r["step"] for r in metrics.read_metrics(place)] == [1, 2, 3]
  events = list((epath.Path(place) / "tb").iterdir())
  assert events and all(e.stat().length > 0 for e in events)
  resumed = metrics.MetricsLogger(place, total_steps=3, start_step=2, progress=False)
  resumed.close()
  assert [r["step"] for r in metrics.read_metrics(place)] == [1, 2]


def test_checkpoints_and_the_stopped_state_round_trip(place):
  checkpointer = checkpoint.Checkpointer(os.path.join(place, "checkpoints"))
  saved = nnx.state(nnx.Linear(2, 3, rngs=nnx.Rngs(0)))
  checkpointer.save(4, saved, jax.random.key(7), {"step": 4, "data": {"epoch": 1}})
  checkpoint.write_json(os.path.join(place, "checkpoints", "stopped_process_0.json"), {"buffer": []})
  fresh = nnx.state(nnx.Linear(2, 3, rngs=nnx.Rngs(1)))
  step, restored, rng, record = checkpointer.restore_latest(fresh, jax.random.key(0), log=lambda _: None)
  assert step == 4 and record["data"] == {"epoch": 1}
  assert jnp.array_equal(restored["kernel"].value, saved["kernel"].value)
  assert jnp.array_equal(jax.random.key_data(rng), jax.random.key_data(jax.random.key(7)))
  stopped = epath.Path(place) / "checkpoints" / "stopped_process_0.json"
  assert json.loads(stopped.read_text()) == {"buffer": []}
  checkpointer.close()


def test_remote_servers_cannot_read_weights_by_path_from_a_gs_workdir():
  config = make_config(rollout=dict(addresses=("10.0.0.2:9000",), weight_transfer="path"))
  with pytest.raises(ValueError, match="weight_transfer = 'path'.*use 'stream'"):
    build.build(config, "gs://bucket/run")
