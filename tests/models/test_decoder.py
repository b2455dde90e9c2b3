import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from copc_jax.models import tiny
from copc_jax.models.decoder import Decoder, KVCache, ValueModel


@pytest.fixture(scope="module")
def model():
  return Decoder(tiny.tiny_config("qwen2"), rngs=nnx.Rngs(0))


def test_incremental_decoding_equals_the_full_forward_pass(model):
  ids = np.random.default_rng(0).integers(0, model.config.vocab_size, size=(2, 11))
  full = np.asarray(model(ids))
  positions = np.broadcast_to(np.arange(11), (2, 11))
  cache = KVCache.create(model.config, batch=2, max_length=16)
  logits, cache = model.decode(ids[:, :6], positions[:, :6], cache)   # prefill
  steps = [logits]
  for t in range(6, 11):
    logits, cache = jax.jit(lambda m, i, p, c: m.decode(i, p, c))(model, ids[:, t:t + 1],
                                                                 positions[:, t:t + 1], cache)
    steps.append(logits)
  np.testing.assert_allclose(np.concatenate(steps, axis=1), full, atol=1e-5, rtol=0)
  assert int(cache.index) == 11


def test_left_padded_prefill_then_decode_matches_unpadded_rows(model):
  rng = np.random.default_rng(1)
  short, long = rng.integers(3, 50, size=4), rng.integers(3, 50, size=7)
  ids = np.stack([np.concatenate([np.zeros(3, int), short]), long])
  valid = np.stack([np.arange(7) >= 3, np.ones(7, bool)])
  positions = np.maximum(np.cumsum(valid, axis=1) - 1, 0)
  cache = KVCache.create(model.config, batch=2, max_length=10)
  logits, cache = model.decode(ids, positions, cache, valid)
  next_ids = np.array([[5], [6]])
  step, _ = model.decode(next_ids, positions[:, -1:] + 1, cache)
  alone = np.asarray(model(np.concatenate([short, [5]])[None]))
  np.testing.assert_allclose(np.asarray(logits)[0, 3:], alone[0, :4], atol=1e-5)
  np.testing.assert_allclose(np.asarray(step)[0, 0], alone[0, 4], atol=1e-5)


def test_remat_gives_the_same_values_and_gradients():
  config = tiny.tiny_config("llama")
  plain, remat = Decoder(config, rngs=nnx.Rngs(3)), Decoder(config, rngs=nnx.Rngs(3), remat=True)
  ids = np.arange(12).reshape(2, 6)
  loss = lambda m: jnp.mean(m(ids) ** 2)
  g_plain, g_remat = nnx.grad(loss)(plain), nnx.grad(loss)(remat)
  for a, b in zip(jax.tree.leaves(g_plain), jax.tree.leaves(g_remat)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)


def test_value_model_starts_from_the_policy_and_shares_nothing(model):
  critic = ValueModel.from_policy(model, rngs=nnx.Rngs(7))
  ids = np.arange(8)[None]
  assert critic(ids).shape == (1, 8) and critic(ids).dtype == jnp.float32
  np.testing.assert_array_equal(np.asarray(critic.model(ids)), np.asarray(model.model(ids)))
  policy_leaves = {id(x) for x in jax.tree.leaves(nnx.state(model))}
  assert not policy_leaves & {id(x) for x in jax.tree.leaves(nnx.state(critic))}
  before = np.asarray(model(ids))
  critic.model.embed_tokens[...] = critic.model.embed_tokens[...] + 1.0   # training the critic ...
  np.testing.assert_array_equal(np.asarray(model(ids)), before)            # ... leaves the actor alone


def test_per_row_decoding_at_different_lengths_matches_the_full_pass(model):
  rng = np.random.default_rng(4)
  seqs = [rng.integers(3, 60, size=n) for n in (5, 9)]
  cache = KVCache.create(model.config, batch=2, max_length=12)
  # Prefill each row separately into its slots 0..n−1.
  keys, values, valid = [], [], []
  for seq in seqs:
    one = KVCache.create(model.config, batch=1, max_length=12)
    _, one = model.decode(seq[None], np.arange(len(seq))[None], one)
    keys.append(one.keys), values.append(one.values), valid.append(one.valid)
  cache = KVCache(keys=jnp.concatenate(keys, 1), values=jnp.concatenate(values, 1),
                  valid=jnp.concatenate(valid, 0), index=cache.index)
  next_tokens = np.array([7, 8])
  logits, cache = model.decode_rows(next_tokens, np.array([5, 9]), cache)
  for row, seq in enumerate(seqs):
    full = np.asarray(model(np.append(seq, next_tokens[row])[None]))[0, -1]
    np.testing.assert_allclose(np.asarray(logits[row]), full, atol=1e-5)
