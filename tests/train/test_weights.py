import os
import subprocess
import sys

import pytest
from flax import nnx

from copc_jax.models import hf_io, tiny
from copc_jax.models.decoder import Decoder
from copc_jax.train import weights as weights_lib

pytestmark = pytest.mark.skipif(not os.path.isdir(weights_lib.SHARED_MEMORY), reason="needs /dev/shm")


class PathBackend:
  """Records what a server would read at each pushed path."""

  def __init__(self):
    self.pushed = []

  def push(self, update):
    self.pushed.append((update.payload, update.version, sorted(hf_io.tensor_files(update.payload))))


def test_shm_pushes_go_through_shared_memory_and_keep_only_the_newest(tmp_path):
  actor = Decoder(tiny.tiny_config("qwen2"), rngs=nnx.Rngs(0))
  backend = PathBackend()
  store = weights_lib.WeightStore(str(tmp_path / "weights"), backend, transfer="shm")
  store.push(1, actor)
  store.push(2, actor)
  (first, _, names), (second, version, _) = backend.pushed
  assert os.path.dirname(second).startswith(os.path.join(weights_lib.SHARED_MEMORY, "copc_jax_weights_"))
  assert version == 2 and names == sorted(ours for ours, _ in hf_io.hf_parameter_names(actor.config).values())
  assert not os.path.exists(first) and os.path.exists(second)      # the served version alone
  assert not (tmp_path / "weights").exists()                        # nothing on the workdir's disk
  store.close()
  assert not os.path.exists(os.path.dirname(second))


def test_shared_memory_left_by_a_dead_process_is_freed():
  dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                        text=True, check=True)
  stale = os.path.join(weights_lib.SHARED_MEMORY, f"copc_jax_weights_{int(dead.stdout)}_test")
  os.makedirs(os.path.join(stale, "v3"))
  mine = weights_lib.shared_memory_directory()
  try:
    assert not os.path.exists(stale) and os.path.isdir(mine)
  finally:
    os.rmdir(mine)
