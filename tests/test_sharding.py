"""Sharding on 8 fake CPU devices (tests/conftest.py sets XLA_FLAGS)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from copc_jax import sharding
from copc_jax.models import tiny
from copc_jax.models.decoder import Decoder

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (fake) devices")


def test_mesh_shape_and_bad_shapes():
  mesh = sharding.make_mesh(sharding.ShardingConfig(mesh_shape=(2, -1, 2)))
  assert dict(mesh.shape) == {"data": 2, "fsdp": 2, "tensor": 2}
  with pytest.raises(ValueError, match="needs 12 devices"):
    sharding.make_mesh(sharding.ShardingConfig(mesh_shape=(2, 3, 2)))
  with pytest.raises(ValueError, match="unknown mesh axis 'model'"):
    sharding.ShardingConfig(rules=(("embed", "model"),))


def test_each_weight_gets_the_sharding_of_the_rules():
  mesh = sharding.make_mesh(sharding.ShardingConfig(mesh_shape=(2, 2, 2)))
  config = tiny.tiny_config("llama")
  model = sharding.create_sharded(lambda: Decoder(config, rngs=nnx.Rngs(0)), mesh,
                                  sharding.DEFAULT_RULES)
  layer = model.model.layers[0]
  expected = {
      "embed_tokens": (model.model.embed_tokens, P("tensor", "fsdp")),
      "q_proj": (layer.self_attn.q_proj.kernel, P("fsdp", "tensor")),
      "o_proj": (layer.self_attn.o_proj.kernel, P("tensor", "fsdp")),
      "down_proj": (layer.mlp.down_proj.kernel, P("tensor", "fsdp")),
      "norm": (layer.input_layernorm.weight, P(None)),
      "lm_head": (model.lm_head.kernel, P("fsdp", "tensor")),
  }
  # A dimension the mesh does not divide stays replicated (num_kv_heads·head_dim = 32 on
  # tensor = 2 divides; a 3-wide dimension would not).
  assert sharding.logical_to_spec(("embed", "mlp"), (3, 8), mesh, sharding.DEFAULT_RULES) == P(
      None, "tensor")
  for name, (variable, spec) in expected.items():
    assert variable[...].sharding.spec == spec, name
    assert variable[...].sharding.mesh.shape == mesh.shape


def test_sharded_forward_equals_single_device():
  config = tiny.tiny_config("qwen2")
  single = Decoder(config, rngs=nnx.Rngs(1))
  ids = np.random.default_rng(0).integers(0, config.vocab_size, size=(8, 16))
  expected = np.asarray(single(ids))
  mesh = sharding.make_mesh(sharding.ShardingConfig(mesh_shape=(2, 2, 2)))
  sharded = sharding.create_sharded(lambda: Decoder(config, rngs=nnx.Rngs(1)), mesh,
                                    sharding.DEFAULT_RULES)
  ids_sharded = jax.device_put(ids, sharding.batch_sharding(mesh, sharding.DEFAULT_RULES))

  @nnx.jit
  def forward(model, ids):
    return model(ids)

  logits = forward(sharded, ids_sharded)
  np.testing.assert_allclose(np.asarray(logits), expected, atol=1e-5, rtol=0)


def test_shard_model_places_a_loaded_model():
  config = tiny.tiny_config("qwen2")
  model = Decoder(config, rngs=nnx.Rngs(2))
  before = np.asarray(model(jnp.arange(8)[None]))
  mesh = sharding.make_mesh(sharding.ShardingConfig(mesh_shape=(1, 4, 2)))
  sharding.shard_model(model, mesh, sharding.DEFAULT_RULES)
  assert model.model.layers[1].mlp.up_proj.kernel[...].sharding.spec == P("fsdp", "tensor")
  np.testing.assert_allclose(np.asarray(model(jnp.arange(8)[None])), before, atol=1e-5)
