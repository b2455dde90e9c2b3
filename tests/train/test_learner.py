import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

from copc_jax import presets, sharding
from copc_jax.models import tiny
from copc_jax.models.decoder import Decoder, ValueModel
from copc_jax.train import Learner, LearnerConfig, OptimizerConfig
from copc_jax.train.fake_data import random_batch


def make_learner(preset="copc", lr=1e-3, mesh=None, kl_coef=0.0, **kw):
  config = tiny.tiny_config("qwen2")
  actor = Decoder(config, rngs=nnx.Rngs(0))
  critic = ValueModel.from_policy(actor, rngs=nnx.Rngs(1))
  p = presets.get_preset(preset)
  p = dataclasses.replace(p, actor=dataclasses.replace(p.actor, kl_coef=kl_coef))
  kw.setdefault("actor_optimizer", OptimizerConfig(learning_rate=lr))
  kw.setdefault("critic_optimizer", OptimizerConfig(learning_rate=lr))
  learner_config = LearnerConfig(estimator=p.estimator, actor=p.actor, **kw)
  batch = random_batch(actor, batch_size=8, prompt_length=6, response_length=14, seed=3)
  return Learner(actor, critic, learner_config, mesh=mesh), batch


def test_the_optimizer_is_any_optax_optimizer_by_name():
  config = OptimizerConfig(learning_rate=1e-2, name="sgd", options=(("momentum", 0.9),))
  learner, batch = make_learner(actor_optimizer=config, critic_optimizer=config)
  first = learner.train_step(batch)
  # SGD's first step moves the weights by exactly lr × the (clipped) gradient; AdamW's would not.
  clipped = min(float(first["actor_grad_norm"]), 1.0)
  assert float(first["actor_update_norm"]) == pytest.approx(1e-2 * clipped, rel=1e-4)
  for _ in range(4):
    last = learner.train_step(batch)
  assert float(last["value_loss"]) < float(first["value_loss"])


def test_losses_decrease_on_a_fixed_batch():
  learner, batch = make_learner(num_minibatches=2)
  batch.validate()
  first = learner.train_step(batch)
  for _ in range(6):
    last = learner.train_step(batch)
  assert float(last["value_loss"]) < 0.5 * float(first["value_loss"])
  assert float(last["actor_loss"]) < float(first["actor_loss"])


def test_entropy_metric_is_the_mean_entropy_of_the_weights_before_the_update():
  from copc_jax.sampling import token_logprobs_and_entropy

  learner, batch = make_learner()
  logits = learner.actor(batch.tokens, attention_mask_bt=batch.attention_mask)
  _, entropy = token_logprobs_and_entropy(logits, batch.tokens, learner.config.sampling)
  expected = np.asarray(entropy)[np.asarray(batch.mask)].mean()
  metrics = learner.train_step(batch)
  assert float(metrics["entropy"]) == pytest.approx(float(expected), rel=1e-5)
  assert 0 < float(metrics["entropy"]) <= np.log(logits.shape[-1]) + 1e-5


def test_non_finite_behaviour_logprobs_do_not_poison_the_parameters():
  learner, batch = make_learner("tis")
  behaviour = np.array(batch.behavior_logprobs)
  rows, cols = np.nonzero(batch.mask)
  behaviour[rows[0], cols[0]] = np.nan
  behaviour[rows[-1], cols[-1]] = -np.inf
  metrics = learner.train_step(dataclasses.replace(batch, behavior_logprobs=behaviour))
  assert int(metrics["nonfinite_count"]) >= 1
  for leaf in jax.tree.leaves(learner.state):
    assert np.isfinite(np.asarray(leaf)).all()


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (fake) devices")
def test_sharded_train_step_equals_single_device():
  single, batch = make_learner(lr=1e-6)
  mesh = sharding.make_mesh(sharding.ShardingConfig(mesh_shape=(2, 2, 2)))
  sharded, _ = make_learner(lr=1e-6, mesh=mesh)
  m_single, m_sharded = single.train_step(batch), sharded.train_step(batch)
  for key in ("actor_loss", "value_loss", "actor_grad_norm"):
    np.testing.assert_allclose(float(m_sharded[key]), float(m_single[key]), rtol=1e-5, atol=1e-6)
  for a, b in zip(jax.tree.leaves(nnx.state(single.actor, nnx.Param)),
                  jax.tree.leaves(nnx.state(sharded.actor, nnx.Param))):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-5, rtol=0)
  q_proj = sharded.actor.model.layers[0].self_attn.q_proj.kernel[...]
  assert q_proj.sharding.spec == jax.sharding.PartitionSpec("fsdp", "tensor")


@pytest.mark.parametrize("preset", presets.DISTINCT)
def test_every_preset_trains_with_a_kl_term_to_the_frozen_reference(preset):
  """Every preset's step runs (finite diagnostics, the actor moves) with the KL term on: kl_coef > 0
  used to crash the first step (no reference); now the reference is the actor as it was given,
  frozen: KL 0 at the first update, then positive as the actor moves, reference unmoved."""
  learner, batch = make_learner(preset, lr=1e-2, kl_coef=0.1)
  reference_before = jax.tree.map(np.asarray, learner.reference)
  first = learner.train_step(batch)
  for key in ("actor_loss", "value_loss", "clip_fraction", "masked_fraction", "ess",
              "actor_grad_norm", "critic_grad_norm", "actor_update_norm", "actor_param_norm"):
    assert np.isfinite(float(first[key])), key
  assert float(first["actor_update_norm"]) > 0
  assert float(first["kl_ref"]) == pytest.approx(0.0, abs=1e-6)
  for _ in range(3):
    last = learner.train_step(batch)
  assert float(last["kl_ref"]) > 1e-6 and np.isfinite(float(last["actor_loss"]))
  jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, learner.reference), reference_before)


def test_the_update_loop_compiles_to_the_same_program_for_any_epochs_and_minibatches():
  """One scan over minibatches: the lowered step has as many matmuls for 1 × 1 as for 3 × 4."""
  def dot_count(epochs, minibatches):
    learner, batch = make_learner(epochs=epochs, num_minibatches=minibatches)
    text = learner._step.lower(learner.state, batch, jax.random.key(0), None).as_text()
    return text.count("dot_general")
  assert dot_count(1, 1) == dot_count(3, 4) > 0


def test_the_second_step_reuses_the_first_steps_compile(tmp_path):
  """A model loaded from a checkpoint: the step's outputs are placed like its inputs; step 2 lowers nothing."""
  from copc_jax.models import hf_io

  tiny.make_tiny_checkpoint(str(tmp_path))
  actor, _ = hf_io.from_pretrained(str(tmp_path), load_tokenizer=False)
  learner = Learner(actor, ValueModel.from_policy(actor, rngs=nnx.Rngs(1)), LearnerConfig())
  batch = random_batch(actor, batch_size=4, prompt_length=8, response_length=8)
  lowerings, listening = [], [True]
  jax.monitoring.register_event_duration_secs_listener(
      lambda event, duration, **kw: lowerings.append(event) if listening[0] and "to_mlir" in event else None)
  try:
    learner.train_step(batch)
    assert lowerings                       # the listener sees the first step's lowering
    lowerings.clear()
    learner.train_step(batch)
    assert lowerings == []
    jax.tree.map(np.asarray, nnx.state(actor))     # the caller's model is intact: the step donated a copy
  finally:
    listening[0] = False
