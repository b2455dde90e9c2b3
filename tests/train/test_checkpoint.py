import os
import signal
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest
from flax import nnx

from copc_jax.models import tiny
from copc_jax.models.decoder import Decoder, ValueModel
from copc_jax.train import Learner, LearnerConfig
from copc_jax.train.checkpoint import Checkpointer, CheckpointError
from copc_jax.train.fake_data import random_batch


def make():
  config = tiny.tiny_config("qwen2")
  actor = Decoder(config, rngs=nnx.Rngs(0))
  learner = Learner(actor, ValueModel.from_policy(actor, rngs=nnx.Rngs(1)), LearnerConfig())
  return learner, random_batch(actor, batch_size=4, prompt_length=4, response_length=8, seed=1)


def leaves(state):
  return [np.asarray(x) for x in jax.tree.leaves(state)]


def test_save_restore_round_trip_continues_identically(tmp_path):
  learner, batch = make()
  learner.train_step(batch)
  ckpt = Checkpointer(str(tmp_path))
  record = {"version": 7, "data_state": {"next_index": 3},
            "buffer": [{"token_ids": [1, 2], "mask": [True, False]}]}
  ckpt.save(1, learner.state, learner.rng, record)
  expected = learner.train_step(batch)

  fresh, _ = make()
  step, fresh.state, fresh.rng, restored_record = ckpt.restore_latest(fresh.state, fresh.rng)
  assert step == 1 and restored_record == record
  again = fresh.train_step(batch)
  for key in ("actor_loss", "value_loss", "actor_update_norm"):
    np.testing.assert_allclose(float(again[key]), float(expected[key]), rtol=1e-6)
  for a, b in zip(leaves(fresh.state), leaves(learner.state)):
    np.testing.assert_array_equal(a, b)
  ckpt.close()


def test_no_checkpoint_yet(tmp_path):
  learner, _ = make()
  assert Checkpointer(str(tmp_path)).restore_latest(learner.state, learner.rng) is None


def test_sigkill_during_saves_leaves_a_complete_latest_checkpoint(tmp_path):
  script = tmp_path / "saver.py"
  script.write_text(textwrap.dedent(f"""
      import sys
      sys.path.insert(0, {os.path.dirname(__file__)!r})
      from test_checkpoint import make
      from copc_jax.train.checkpoint import Checkpointer
      learner, batch = make()
      ckpt = Checkpointer({str(tmp_path / 'ckpt')!r}, max_to_keep=2)
      step = 0
      while True:
        step += 1
        learner.train_step(batch)
        ckpt.save(step, learner.state, learner.rng, {{"version": step}})
        print(step, flush=True)
      """))
  process = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "XLA_FLAGS": ""})
  for _ in range(3):
    process.stdout.readline()
  process.send_signal(signal.SIGKILL)   # most likely in the middle of writing the next step
  process.wait()
  learner, _ = make()
  step, _, _, record = Checkpointer(str(tmp_path / "ckpt")).restore_latest(learner.state, learner.rng)
  assert step >= 3 and record == {"version": step}


def _damage(step_dir, how):
  files = sorted(p for p in step_dir.rglob("*") if p.is_file())
  assert files
  for path in files:
    if how == "empty":
      path.write_bytes(b"")
    elif how == "garbage" and (path.name.endswith("metadata") or path.suffix == ".json"):
      path.write_bytes(b"\x00garbage{")
    elif how == "truncated" and path.stat().st_size > 64:
      path.write_bytes(path.read_bytes()[:path.stat().st_size // 3])


@pytest.mark.parametrize("how", ["empty", "garbage", "truncated"])
def test_a_damaged_latest_checkpoint_falls_back_to_the_newest_that_loads(tmp_path, how):
  learner, batch = make()
  ckpt = Checkpointer(str(tmp_path))
  ckpt.save(1, learner.state, learner.rng, {"step": 1})
  learner.train_step(batch)
  ckpt.save(2, learner.state, learner.rng, {"step": 2})
  ckpt.close()
  _damage(tmp_path / "2", how)
  said = []
  fresh, _ = make()
  ckpt = Checkpointer(str(tmp_path))
  step, _, _, record = ckpt.restore_latest(fresh.state, fresh.rng, log=said.append)
  assert step == 1 and record == {"step": 1}
  assert len(said) == 1 and said[0].startswith("checkpoint of step 2") and "skipped" in said[0]
  assert (tmp_path / "corrupt_2").is_dir() and ckpt.latest_step() == 1
  ckpt.save(2, learner.state, learner.rng, {"step": 2})       # the next save of step 2 does not collide
  ckpt.close()
  _damage(tmp_path / "1", how)
  _damage(tmp_path / "2", how)
  with pytest.raises(CheckpointError) as err:
    Checkpointer(str(tmp_path)).restore_latest(fresh.state, fresh.rng, log=said.append)
  assert "\n" not in str(err.value) and "no checkpoint" in str(err.value) and "step 2" in str(err.value)
