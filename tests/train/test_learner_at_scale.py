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


def _step(logits_chunk=0, forward_microbatches=1, gradient_accumulation=1, optimizer="adamw", **options):
  config = tiny.tiny_config("qwen2")
  actor = Decoder(config, rngs=nnx.Rngs(0), **options)
  critic = ValueModel.from_policy(actor, rngs=nnx.Rngs(1))
  p = presets.get_preset("copc")
  learner_config = LearnerConfig(estimator=p.estimator, actor=p.actor, num_minibatches=2,
                                 logits_chunk=logits_chunk, forward_microbatches=forward_microbatches,
                                 gradient_accumulation=gradient_accumulation,
                                 actor_optimizer=OptimizerConfig(learning_rate=1e-3, name=optimizer),
                                 critic_optimizer=OptimizerConfig(learning_rate=1e-3, name=optimizer))
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


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean", "token_sum"])
def test_accumulated_gradient_equals_the_whole_minibatch_gradient(aggregation):
  """`trainer.gradient_accumulation`: the minibatch's gradient summed over 4 row groups with their
  aggregation shares is the whole minibatch's gradient, for the actor and the critic loss (float32,
  1e-6 relative to the gradient's scale); a wrong share (e.g. 1/G for the token mean of groups with
  different token counts) is off by far more."""
  from copc_jax import losses
  from copc_jax.train import learner as learner_lib

  config = tiny.tiny_config("qwen2")
  actor = Decoder(config, rngs=nnx.Rngs(0))
  critic = ValueModel.from_policy(actor, rngs=nnx.Rngs(1))
  batch = random_batch(Decoder(config, rngs=nnx.Rngs(0)), batch_size=8, prompt_length=6, response_length=14,
                       seed=3)
  mask = np.asarray(batch.mask).copy()
  mask[0, 8:] = False               # rows of different lengths, one with no policy token
  mask[5] = False
  batch = dataclasses.replace(batch, mask=jnp.asarray(mask))
  rng = np.random.default_rng(0)
  extra = {"logp_prox": jnp.asarray(batch.behavior_logprobs) + 0.1 * rng.normal(size=mask.shape),
           "advantages": jnp.asarray(rng.normal(size=mask.shape), jnp.float32),
           "returns": jnp.asarray(rng.uniform(size=mask.shape), jnp.float32),
           "old_values": jnp.zeros(mask.shape, jnp.float32)}
  actor_config = dataclasses.replace(presets.get_preset("copc").actor, aggregation=aggregation,
                                     entropy_coef=0.01)
  value_config = losses.ValueLossConfig(aggregation=aggregation)
  learner_config = LearnerConfig(actor=actor_config, value=value_config)

  def actor_loss(model, mb, mb_extra):
    logp, entropy = learner_lib.policy_logprobs_and_entropy(model, mb, learner_config)
    return losses.actor_loss(logp, mb_extra["logp_prox"], mb.behavior_logprobs, mb_extra["advantages"],
                             mb.mask, actor_config, entropy=entropy)

  def value_loss(model, mb, mb_extra):
    return losses.value_loss(learner_lib.state_values(model, mb), mb_extra["old_values"], mb_extra["returns"],
                             mb.mask, value_config)

  for loss_fn, model in ((actor_loss, actor), (value_loss, critic)):
    whole_diag, whole = learner_lib.accumulated_value_and_grad(loss_fn, model, batch, extra, groups=1,
                                                              aggregation=aggregation)
    diag, accumulated = learner_lib.accumulated_value_and_grad(loss_fn, model, batch, extra, groups=4,
                                                               aggregation=aggregation)
    scale = max(float(jnp.abs(g).max()) for g in jax.tree.leaves(whole))
    for a, b in zip(jax.tree.leaves(whole), jax.tree.leaves(accumulated), strict=True):
      np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-6 * scale, rtol=0)
    loss_key = "actor_loss" if loss_fn is actor_loss else "value_loss"
    assert float(diag[loss_key]) == pytest.approx(float(whole_diag[loss_key]), rel=1e-5)
    if loss_fn is actor_loss:
      assert float(diag["ratio_max"]) == pytest.approx(float(whole_diag["ratio_max"]), rel=1e-6)
  if aggregation == "token_mean":      # the shares matter: equal weights give another gradient
    grouped_mask = np.asarray(batch.mask).reshape(2, 4, -1).swapaxes(0, 1)
    shares = np.asarray(losses.aggregation_shares(grouped_mask, aggregation))
    assert np.ptp(shares) > 0.05


def test_a_learner_step_with_gradient_accumulation_equals_the_plain_step():
  """SGD, so the updated weights compare the gradients (Adam's first step, g / (|g| + eps), turns a
  float32 rounding of a near-zero gradient entry into a difference of up to the learning rate)."""
  plain_metrics, plain_params = _step(optimizer="sgd")
  accumulated_metrics, accumulated_params = _step(gradient_accumulation=2, optimizer="sgd")
  for key in ("actor_loss", "value_loss", "actor_grad_norm", "critic_grad_norm"):
    assert float(accumulated_metrics[key]) == pytest.approx(float(plain_metrics[key]), rel=1e-5), key
  for a, b in zip(plain_params, accumulated_params, strict=True):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-5)


def test_gradient_accumulation_that_does_not_divide_the_minibatch_is_refused():
  from copc_jax.train.setup import TrainerConfig
  with pytest.raises(ValueError, match="must be divisible by gradient_accumulation"):
    TrainerConfig(batch_size=32, num_minibatches=4, gradient_accumulation=3)
  with pytest.raises(ValueError, match="gradient_accumulation must be >= 1"):
    LearnerConfig(gradient_accumulation=0)
