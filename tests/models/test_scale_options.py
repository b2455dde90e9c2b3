"""The model's scale options change how it computes, not what: scanned layers, remat policies,
attention kernels, packed sequences (segment ids) and bfloat16 compute over float32 weights."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from copc_jax.models import attention, tiny
from copc_jax.models.decoder import Decoder, KVCache, ValueModel


def _ids(b=2, t=12, seed=0, vocab=None):
  vocab = vocab or tiny.tiny_config("qwen2").vocab_size
  return np.random.default_rng(seed).integers(0, vocab, size=(b, t))


def _grads(model, ids):
  return jax.tree.leaves(nnx.grad(lambda m: jnp.mean(m(ids) ** 2))(model))


@pytest.mark.parametrize("remat", ["none", "dots"])
def test_scanned_layers_give_the_looped_values_and_gradients(remat):
  config = tiny.tiny_config("llama")
  looped = Decoder(config, rngs=nnx.Rngs(3))
  scanned = Decoder(config, rngs=nnx.Rngs(3), scan_layers=True, remat=remat)
  ids = _ids()
  np.testing.assert_allclose(np.asarray(scanned(ids)), np.asarray(looped(ids)), atol=1e-5, rtol=0)
  for a, b in zip(_grads(looped, ids), _grads(scanned, ids), strict=True):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-6)
  # the parameters are the same modules, one per layer (checkpoints and HF names do not change)
  assert jax.tree.structure(nnx.state(looped)) == jax.tree.structure(nnx.state(scanned))


def test_scanned_layers_decode_with_the_cache_like_the_loop():
  config = tiny.tiny_config("qwen2")
  looped, scanned = Decoder(config, rngs=nnx.Rngs(0)), Decoder(config, rngs=nnx.Rngs(0), scan_layers=True)
  ids = _ids(t=9)
  positions = np.broadcast_to(np.arange(9), (2, 9))
  outs = []
  for model in (looped, scanned):
    cache = KVCache.create(config, batch=2, max_length=12)
    prefill, cache = model.decode(ids[:, :6], positions[:, :6], cache)
    step, cache = model.decode(ids[:, 6:7], positions[:, 6:7], cache)
    rows, cache = model.decode_rows(ids[:, 7], np.array([7, 7]), cache)
    outs.append((prefill, step, rows, cache.keys))
  for a, b in zip(*outs, strict=True):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-5, rtol=0)


@pytest.mark.parametrize("implementation", ["xla", "splash"])
def test_attention_kernels_agree_with_the_reference_on_packed_segments(implementation):
  keys = jax.random.split(jax.random.key(0), 3)
  b, t, n, kv, d = 2, 128, 4, 2, 16
  q = jax.random.normal(keys[0], (b, t, n, d))
  k, v = jax.random.normal(keys[1], (b, t, kv, d)), jax.random.normal(keys[2], (b, t, kv, d))
  segments = jnp.array([[1] * 70 + [2] * 50 + [0] * 8, [1] * 128])
  visible = attention.causal_segment_mask(segments)
  run = lambda q, impl: attention.attention(q, k, v, visible, segment_ids_bt=segments, implementation=impl,
                                            interpret=True)
  np.testing.assert_allclose(np.asarray(run(q, implementation)), np.asarray(run(q, "reference")), atol=2e-6)
  grad = lambda impl: jax.grad(lambda q: jnp.sum(run(q, impl) ** 2))(q)
  np.testing.assert_allclose(np.asarray(grad(implementation)), np.asarray(grad("reference")), atol=2e-5)


def test_a_packed_row_gives_each_document_what_it_gets_alone():
  """Two documents in one row (segment ids, positions restarting) = each one in its own row."""
  model = Decoder(tiny.tiny_config("qwen2"), rngs=nnx.Rngs(1))
  first, second = _ids(1, 5, seed=1)[0], _ids(1, 7, seed=2)[0]
  packed = np.concatenate([first, second])[None]
  segments = np.array([[1] * 5 + [2] * 7])
  positions = np.array([list(range(5)) + list(range(7))])
  logits = np.asarray(model(packed, positions_bt=positions, segment_ids_bt=segments))
  np.testing.assert_allclose(logits[0, :5], np.asarray(model(first[None]))[0], atol=1e-5)
  np.testing.assert_allclose(logits[0, 5:], np.asarray(model(second[None]))[0], atol=1e-5)


def test_bfloat16_compute_over_float32_weights_stays_close():
  """bf16 matmuls with float32 master weights: logits within 0.05 of float32 on the tiny model (bf16
  has 8 mantissa bits: ~0.4% per product, summed over 2 layers); parameters stay float32."""
  config = tiny.tiny_config("qwen2")
  exact = Decoder(config, rngs=nnx.Rngs(0))
  fast = Decoder(config, rngs=nnx.Rngs(0), dtype=jnp.bfloat16, param_dtype=jnp.float32, scan_layers=True)
  assert {x.dtype for x in jax.tree.leaves(nnx.state(fast, nnx.Param))} == {jnp.dtype(jnp.float32)}
  ids = _ids()
  out = fast(ids)
  assert out.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(out), np.asarray(exact(ids)), atol=0.05, rtol=0)
  critic = ValueModel.from_policy(fast, rngs=nnx.Rngs(2))
  assert critic.model.options == fast.model.options


@pytest.mark.parametrize("platform, dtype, expected", [
    ("cpu", "auto", ("float32", "reference")), ("tpu", "auto", ("bfloat16", "splash")),
    ("gpu", "auto", ("bfloat16", "cudnn")), ("gpu", "float32", ("float32", "xla")),  # cuDNN: half precision
])
def test_auto_picks_each_platforms_attention_kernel_and_dtype(platform, dtype, expected, monkeypatch):
  from copc_jax.train import setup
  monkeypatch.setattr(setup, "cudnn_attention_available", lambda: True)        # an Ampere or newer GPU
  options = setup.ModelSource(dtype=dtype).compute_options(platform)
  assert (str(options["dtype"]), options["attention"]) == expected
  assert setup.ModelSource(dtype=dtype, attention="xla").compute_options(platform)["attention"] == "xla"
  monkeypatch.setattr(setup, "cudnn_attention_available", lambda: False)       # e.g. a T4
  assert setup.ModelSource(dtype=dtype).compute_options(platform)["attention"] == (
      "xla" if platform == "gpu" else expected[1])


def test_bad_options_are_refused_with_their_allowed_values():
  config = tiny.tiny_config("qwen2")
  with pytest.raises(ValueError, match="remat must be one of"):
    Decoder(config, rngs=nnx.Rngs(0), remat="sometimes")
  with pytest.raises(ValueError, match="attention must be one of"):
    Decoder(config, rngs=nnx.Rngs(0), attention="flash3")


def test_splash_under_a_mesh_runs_per_shard_and_agrees_with_the_reference():
  """Rows over fsdp, heads over tensor (shard_map: a Pallas kernel is not partitioned by the compiler)."""
  mesh = jax.make_mesh((1, 2, 2), ("data", "fsdp", "tensor"), axis_types=(jax.sharding.AxisType.Auto,) * 3,
                       devices=jax.devices()[:4])
  keys = jax.random.split(jax.random.key(1), 3)
  b, t, n, kv, d = 4, 128, 4, 2, 16
  q = jax.random.normal(keys[0], (b, t, n, d))
  k, v = jax.random.normal(keys[1], (b, t, kv, d)), jax.random.normal(keys[2], (b, t, kv, d))
  segments = jnp.array([[1] * 70 + [2] * 50 + [0] * 8] * b)
  splash = jax.jit(lambda q, k, v, s: attention.attention(q, k, v, segment_ids_bt=s, implementation="splash",
                                                          interpret=True))
  with jax.set_mesh(mesh):
    out = splash(q, k, v, segments)
  reference = attention.attention(q, k, v, attention.causal_segment_mask(segments))
  np.testing.assert_allclose(np.asarray(out), np.asarray(reference), atol=2e-6)
