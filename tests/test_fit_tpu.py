"""AOT compiles for a TPU slice that is not there (libtpu on this CPU; `experiments/fit_tpu.py` does the
same at full size): a 2-layer learner step and the server's decode for v5e:2x2, the compiler's memory
plan checked against a hand count of what the step's arguments are."""

import importlib
import os

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

pytest.importorskip("libtpu", reason="libtpu (requirements-dev.txt) compiles for TPU topologies")

from copc_jax import presets  # noqa: E402
from copc_jax.models.config import ModelConfig  # noqa: E402
from copc_jax.models.decoder import Decoder, ValueModel  # noqa: E402
from copc_jax.rollout import engine  # noqa: E402
from copc_jax.train.learner import LearnerConfig, lower_train_step  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ModelConfig(vocab_size=1024, hidden_size=256, intermediate_size=512, num_layers=2, num_heads=4,
                    num_kv_heads=2, head_dim=64)


@pytest.fixture(scope="module")
def fit_tpu():
  return importlib.import_module("experiments.fit_tpu")


def test_a_two_layer_learner_step_compiles_for_v5e_and_its_plan_matches_a_hand_count(fit_tpu):
  mesh = fit_tpu.mesh_over(fit_tpu.topology_devices("v5e:2x2"), (1, -1, 1))        # 4 chips, fsdp 4
  options = dict(dtype=jnp.bfloat16, param_dtype=jnp.float32, scan_layers=True, remat="full",
                 attention="splash")

  def make_models():
    actor = Decoder(SMALL, rngs=nnx.Rngs(0), **options)
    return actor, ValueModel.from_policy(actor, rngs=nnx.Rngs(1))

  preset = presets.get_preset("copc")
  config = LearnerConfig(estimator=preset.estimator, actor=preset.actor, num_minibatches=2, logits_chunk=128)
  batch_size, length = 8, 512
  lowered = lower_train_step(make_models, config, mesh, batch_size=batch_size, length=length)
  compiled = lowered.compile()
  memory = compiled.memory_analysis()
  # The hand count: actor and critic parameters (float32) and AdamW's two moments of each, sharded over
  # 4 chips where the rules divide them; plus each chip's quarter of the batch (7 fields of [8, 512]).
  per_layer = (256 * 256 + 256) + 2 * (256 * 128 + 128) + 256 * 256 + 3 * 256 * 512 + 2 * 256
  actor_params = 1024 * 256 + 2 * per_layer + 256
  critic_params = actor_params + 256 + 1
  state_bytes = 3 * 4 * (actor_params + critic_params) / 4
  batch_bytes = batch_size * length // 4 * (4 + 1 + 1 + 4 + 4 + 4 + 4)
  expected = state_bytes + batch_bytes
  # replicated norms and biases, optimizer step counts and the rng add a little; TPU tiling pads small arrays
  assert expected <= memory.argument_size_in_bytes <= 1.05 * expected
  assert memory.alias_size_in_bytes >= 0.95 * state_bytes            # the state is donated: updated in place
  assert 0 < memory.temp_size_in_bytes < 16 * 2**30
  plan = fit_tpu.plan(compiled, "v5e", 1.0, flops=4e12, chips=4)
  assert 0.9 < plan["headroom"] < 1.0 and plan["flops_per_chip"] == 1e12


def test_the_server_decode_compiles_for_v5e_with_the_cache_over_slots_and_heads(fit_tpu):
  devices = fit_tpu.topology_devices("v5e:2x2")
  mesh = fit_tpu.mesh_over(devices, (2, 1, 2))
  expected = jax.sharding.PartitionSpec(None, "data", None, "tensor", None)
  assert engine.cache_partition(SMALL, mesh, slots=8) == expected

  class Rollout:
    slots, max_length, max_prefill_length = 8, 1024, 128

  class Typed:
    rollout = Rollout

  prefill, decode = fit_tpu.compile_server(Typed, SMALL, devices, (2, 1, 2))
  # per chip: bf16 weights (embedding, attention and MLP split over tensor 2) and a quarter of the bf16
  # cache [2 layers, 8 slots, 1024, 2 heads, 64] × keys and values; logits [8, 1024] f32 over data 2
  cache_bytes = 2 * (2 * 8 * 1024 * 2 * 64 * 2) / 4
  memory = decode.memory_analysis()
  assert memory.argument_size_in_bytes >= cache_bytes
  assert memory.alias_size_in_bytes >= cache_bytes               # the cache is donated
  assert prefill.memory_analysis().output_size_in_bytes > 0          # its prompt's keys, values and logits


def test_the_model_flop_count_matches_a_hand_count(fit_tpu):
  """The FLOPs the table reports (the compiler counts a scanned loop's body once): a 2-layer model,
  by hand, for one token over 100 keys; and a learner step is its passes × tokens."""
  h, i, heads, kv, d, v = 256, 512, 4, 2, 64, 1024
  per_layer = 2 * (h * d * heads + 2 * h * d * kv + heads * d * h + 3 * h * i) + 4 * heads * d * 100
  assert fit_tpu.forward_flops_per_token(SMALL, 100) == 2 * per_layer + 2 * h * v
  assert fit_tpu.forward_flops_per_token(SMALL, 100, logits=False) == 2 * per_layer

  class Typed:
    class trainer:
      batch_size, epochs = 8, 2
    class rollout:
      max_length = 200
    class model:
      remat = "full"
    class actor:
      kl_coef = 0.0

  actor, critic = (fit_tpu.forward_flops_per_token(SMALL, 100, logits) for logits in (True, False))
  # π_prox and V once; per epoch forward + backward (2) + the remat recompute, for both models
  assert fit_tpu.learner_flops(SMALL, Typed) == pytest.approx(8 * 200 * (actor * 9 + critic * 9))
