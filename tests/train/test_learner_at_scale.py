"""The learner's scale settings compute the same step: log π in time chunks (no [B, T, V] logits),
scanned layers with remat, and (within a stated tolerance) bfloat16 compute over float32 weights."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from copc_jax import presets
from copc_jax.models import tiny
from copc_jax.models.decoder import Decoder, ValueModel
from copc_jax.sampling import SamplingParams, token_logprobs_and_entropy, token_logprobs_and_entropy_chunked
from copc_jax.train import Learner, LearnerConfig, OptimizerConfig
from copc_jax.train.fake_data import random_batch


@pytest.mark.parametrize("chunk", [5, 64])
@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.7, top_p=0.9, top_k=20)])
def test_chunked_logprobs_equal_the_whole_sequence_values_and_gradients(chunk, params):
  actor = Decoder(tiny.tiny_config("qwen2"), rngs=nnx.Rngs(0))
  tokens = np.random.default_rng(0).integers(3, actor.config.vocab_size, size=(3, 20))
  whole = lambda m: token_logprobs_and_entropy(m(tokens), tokens, params)
  chunked = lambda m: token_logprobs_and_entropy_chunked(m.model(tokens), m.logits, tokens, params, chunk=chunk)
  for a, b in zip(whole(actor), chunked(actor), strict=True):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-5, rtol=0)

  def loss(fn):
    return lambda m: jnp.sum(jnp.where(jnp.isfinite(fn(m)[0]), fn(m)[0], 0.0)) + jnp.sum(fn(m)[1])
  grads = [jax.tree.leaves(nnx.grad(loss(fn))(actor)) for fn in (whole, chunked)]
  for a, b in zip(*grads, strict=True):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-5)


def _step(logits_chunk=0, forward_microbatches=1, **options):
  config = tiny.tiny_config("qwen2")
  actor = Decoder(config, rngs=nnx.Rngs(0), **options)
  critic = ValueModel.from_policy(actor, rngs=nnx.Rngs(1))
  p = presets.get_preset("copc")
  learner_config = LearnerConfig(estimator=p.estimator, actor=p.actor, num_minibatches=2,
                                 logits_chunk=logits_chunk, forward_microbatches=forward_microbatches,
                                 actor_optimizer=OptimizerConfig(learning_rate=1e-3),
                                 critic_optimizer=OptimizerConfig(learning_rate=1e-3))
  batch = random_batch(Decoder(config, rngs=nnx.Rngs(0)), batch_size=8, prompt_length=6, response_length=14,
                       seed=3)
  learner = Learner(actor, critic, learner_config)
  metrics = learner.train_step(batch)
  return metrics, jax.tree.leaves(nnx.state(learner.actor, nnx.Param))


def test_the_scaled_learner_step_equals_todays_step_in_float32():
  """Chunked log π + the no-gradient passes in 4 row groups + scanned layers + remat: the same metrics
  and updated weights (float32, 1e-5)."""
  plain_metrics, plain_params = _step()
  scaled_metrics, scaled_params = _step(logits_chunk=7, forward_microbatches=4, scan_layers=True, remat="full")
  for key in ("actor_loss", "value_loss", "clip_fraction", "entropy", "advantage_raw_mean", "kl_behavior_prox"):
    assert float(scaled_metrics[key]) == pytest.approx(float(plain_metrics[key]), abs=1e-5), key
  for a, b in zip(plain_params, scaled_params, strict=True):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-5)


def test_the_learner_step_in_bfloat16_stays_near_float32():
  """bf16 compute, float32 weights and optimizer: losses within 2% of float32 after one step (bf16
  rounds each product to 8 mantissa bits); the master weights stay float32."""
  plain_metrics, _ = _step()
  bf16_metrics, params = _step(logits_chunk=7, scan_layers=True, dtype=jnp.bfloat16, param_dtype=jnp.float32)
  assert {p.dtype for p in params} == {jnp.dtype(jnp.float32)}
  for key in ("value_loss", "entropy"):
    assert float(bf16_metrics[key]) == pytest.approx(float(plain_metrics[key]), rel=0.02), key


def test_a_negative_chunk_is_refused():
  with pytest.raises(ValueError, match="logits_chunk must be >= 0"):
    dataclasses.replace(LearnerConfig(), logits_chunk=-1)


def test_a_batch_padded_to_its_bucket_trains_like_one_padded_to_max_length():
  """`trainer.pad_to_multiple`: the same rows with less right padding give the same advantages,
  losses and updated weights (padding carries no mask, no reward and no attention)."""
  from copc_jax.train.batch import TrajectoryBatch, padded_length

  assert [padded_length(n, 96, 32) for n in (1, 20, 32, 33, 95)] == [32, 32, 32, 64, 96]
  assert padded_length(20, 96, 0) == 96
  config = tiny.tiny_config("qwen2")
  p = presets.get_preset("copc")
  short = random_batch(Decoder(config, rngs=nnx.Rngs(0)), batch_size=8, prompt_length=6, response_length=14,
                       seed=3)
  pad = lambda x: np.pad(np.asarray(x), ((0, 0), (0, 96 - x.shape[1])))
  long = TrajectoryBatch(**{f: pad(getattr(short, f)) for f in TrajectoryBatch.__dataclass_fields__})
  results = []
  for batch in (short, long):
    actor = Decoder(config, rngs=nnx.Rngs(0))
    learner = Learner(actor, ValueModel.from_policy(actor, rngs=nnx.Rngs(1)),
                      LearnerConfig(estimator=p.estimator, actor=p.actor, num_minibatches=2,
                                    actor_optimizer=OptimizerConfig(learning_rate=1e-3),
                                    critic_optimizer=OptimizerConfig(learning_rate=1e-3)))
    results.append((learner.train_step(batch), jax.tree.leaves(nnx.state(learner.actor, nnx.Param))))
  (short_metrics, short_params), (long_metrics, long_params) = results
  for key in ("actor_loss", "value_loss", "advantage_raw_mean", "advantage_raw_std", "returns_mean", "entropy"):
    assert float(long_metrics[key]) == pytest.approx(float(short_metrics[key]), abs=1e-5), key
  for a, b in zip(short_params, long_params, strict=True):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-5)
