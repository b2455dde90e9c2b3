import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from copc_jax import losses, presets

TOL = 1e-5
EPS_LOW, EPS_HIGH = 0.2, 0.28


def tiny_batch(seed=0, batch=3, length=6):
  rng = np.random.default_rng(seed)
  return dict(
      logp_theta=(-rng.random((batch, length)) + 0.3 * rng.normal(size=(batch, length))).astype(np.float32),
      logp_prox=(-rng.random((batch, length))).astype(np.float32),
      logp_behavior=(-rng.random((batch, length)) + 0.8 * rng.normal(size=(batch, length))).astype(np.float32),
      advantages=rng.normal(size=(batch, length)).astype(np.float32),
      mask=rng.random((batch, length)) < 0.75,
  )


def hand_policy_weight(name, b):
  """w_t of each preset derived by hand: ∂loss/∂log π_θ = −w Â / N."""
  r = np.exp(b["logp_prox"].astype(np.float64) - b["logp_behavior"])
  anchor = b["logp_behavior"] if name == "async_ppo" else b["logp_prox"]
  q = np.exp(b["logp_theta"].astype(np.float64) - anchor)
  copc_spec_mask = ((r >= 0.5) & (r <= 2.0)).astype(float)
  behaviour = {
      "sync_ppo": np.ones_like(r), "async_ppo": np.ones_like(r), "vtrace": np.ones_like(r),
      "decoupled_ppo": np.minimum(r, 5.0), "tis": np.minimum(r, 2.0),
      "icepop": np.where((r >= 0.5) & (r <= 5.0), r, 0.0),
      "mis": np.where((r >= 0.5) & (r <= 5.0), r, 0.0),
      "copc": copc_spec_mask, "copc_spec": copc_spec_mask,
  }[name]
  adv = b["advantages"]
  clipped = ((adv > 0) & (q > 1 + EPS_HIGH)) | ((adv < 0) & (q < 1 - EPS_LOW))
  return np.where(b["mask"] & ~clipped, behaviour * q, 0.0)


@pytest.mark.parametrize("name", sorted(presets.PRESETS))
def test_gradient_of_each_preset_equals_hand_derived(name):
  b = tiny_batch(1)
  config = presets.get_preset(name).actor
  grad = jax.grad(lambda lp: losses.actor_loss(lp, b["logp_prox"], b["logp_behavior"],
                                               b["advantages"], b["mask"], config)[0])(b["logp_theta"])
  expected = -hand_policy_weight(name, b) * b["advantages"] / b["mask"].sum()
  np.testing.assert_allclose(np.asarray(grad), expected, atol=TOL, rtol=1e-4)


@pytest.mark.parametrize("name", sorted(presets.PRESETS))
def test_loss_value_of_each_preset(name):
  b = tiny_batch(2)
  config = presets.get_preset(name).actor
  loss, diag = losses.actor_loss(**b, config=config)
  w = hand_policy_weight(name, b)  # weight·q where unclipped
  anchor = b["logp_behavior"] if name == "async_ppo" else b["logp_prox"]
  q = np.exp(b["logp_theta"].astype(np.float64) - anchor)
  r = np.exp(b["logp_prox"].astype(np.float64) - b["logp_behavior"])
  adv = b["advantages"]
  weight = np.where(q > 0, w / q, 0.0)
  # Where the clip is active the behaviour weight is still applied to the clipped term.
  clipped_q = np.clip(q, 1 - EPS_LOW, 1 + EPS_HIGH)
  active = b["mask"] & (clipped_q * adv < q * adv)
  behaviour = losses.behavior_weights(jnp.asarray(r), config)
  weight = np.where(active, np.asarray(behaviour), weight)
  expected = -(weight * np.minimum(q * adv, clipped_q * adv) * b["mask"]).sum() / b["mask"].sum()
  np.testing.assert_allclose(float(loss), expected, rtol=1e-5, atol=TOL)
  np.testing.assert_allclose(float(diag["clip_fraction"]), active.sum() / b["mask"].sum(), atol=TOL)


def test_targets_carry_no_gradient():
  b = tiny_batch(3)
  config = presets.get_preset("copc").actor

  def loss_of(prox, behaviour, adv):
    return losses.actor_loss(b["logp_theta"], prox, behaviour, adv, b["mask"], config)[0]

  grads = jax.grad(loss_of, argnums=(0, 1, 2))(b["logp_prox"], b["logp_behavior"], b["advantages"])
  for g in grads:
    assert np.all(np.asarray(g) == 0)
  value_grad = jax.grad(lambda ret: losses.value_loss(
      jnp.ones((3, 6)), jnp.ones((3, 6)), ret, b["mask"], losses.ValueLossConfig())[0])(
          jnp.zeros((3, 6)))
  assert np.all(np.asarray(value_grad) == 0)


def test_non_finite_ratios_are_masked_counted_and_never_propagated():
  b = tiny_batch(4)
  b["mask"][:] = True
  b["logp_behavior"][0, 1] = -np.inf
  b["logp_behavior"][1, 2] = np.nan
  b["logp_theta"][2, 3] = np.nan
  config = presets.get_preset("copc").actor
  (loss, diag), grad = jax.value_and_grad(
      lambda lp: losses.actor_loss(lp, b["logp_prox"], b["logp_behavior"], b["advantages"],
                                   b["mask"], config), has_aux=True)(b["logp_theta"])
  assert np.isfinite(float(loss))
  assert np.isfinite(np.asarray(grad)).all()
  assert int(diag["nonfinite_count"]) == 3
  assert float(grad[0, 1]) == 0 and float(grad[2, 3]) == 0
  for key, value in diag.items():
    assert np.isfinite(np.asarray(value)).all(), key


def test_diagnostics_match_hand_computation():
  logp_prox = np.log(np.array([[1.0, 1.0, 1.0, 1.0]], np.float32))
  logp_behavior = np.log(np.array([[1.0, 0.25, 0.5, 2.0]], np.float32))  # r = 1, 4, 2, 0.5
  adv = np.array([[1.0, -1.0, 2.0, 0.0]], np.float32)
  mask = np.array([[True, True, True, True]])
  _, diag = losses.actor_loss(logp_prox, logp_prox, logp_behavior, adv, mask,
                              presets.get_preset("copc").actor)
  r = np.array([1.0, 4.0, 2.0, 0.5])
  assert float(diag["masked_fraction"]) == pytest.approx(0.25)  # r = 4 is outside [0.5, 2]
  assert float(diag["ratio_mean"]) == pytest.approx(r.mean())
  assert float(diag["ratio_max"]) == pytest.approx(4.0)
  assert float(diag["ratio_min"]) == pytest.approx(0.5)
  assert float(diag["ess"]) == pytest.approx(r.mean() ** 2 / (r ** 2).mean())
  assert float(diag["advantage_mean"]) == pytest.approx(0.5)
  assert float(diag["advantage_std"]) == pytest.approx(np.std([1.0, -1.0, 2.0, 0.0]))
  assert float(diag["clip_fraction"]) == 0.0


def test_sequence_mean_aggregation():
  per_token = jnp.array([[1.0, 3.0, 0.0], [4.0, 0.0, 0.0], [9.0, 9.0, 9.0]])
  mask = jnp.array([[True, True, False], [True, False, False], [False, False, False]])
  assert float(losses.aggregate(per_token, mask, "token_mean")) == pytest.approx(8 / 3)
  assert float(losses.aggregate(per_token, mask, "seq_mean")) == pytest.approx((2 + 4) / 2)


@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_kl_penalty(estimator):
  b = tiny_batch(5)
  logp_ref = b["logp_prox"] - 0.1
  base = dataclasses.replace(presets.get_preset("copc").actor, kl_estimator=estimator)
  with_kl = dataclasses.replace(base, kl_coef=0.5)
  loss0, _ = losses.actor_loss(**b, config=base)
  loss1, _ = losses.actor_loss(**b, config=with_kl, logp_ref=logp_ref)
  k1 = (b["logp_theta"] - logp_ref).astype(np.float64)
  kl = k1 if estimator == "k1" else np.exp(-k1) + k1 - 1
  expected = (kl * b["mask"]).sum() / b["mask"].sum()
  np.testing.assert_allclose(float(loss1 - loss0), 0.5 * expected, rtol=1e-5, atol=TOL)
  with pytest.raises(ValueError, match="logp_ref"):
    losses.actor_loss(**b, config=with_kl)


def test_entropy_bonus_lowers_the_loss():
  b = tiny_batch(6)
  entropy = np.full(b["mask"].shape, 2.0, np.float32)
  config = dataclasses.replace(presets.get_preset("tis").actor, entropy_coef=0.01)
  loss0, _ = losses.actor_loss(**b, config=presets.get_preset("tis").actor)
  loss1, _ = losses.actor_loss(**b, config=config, entropy=entropy)
  assert float(loss0 - loss1) == pytest.approx(0.02, abs=1e-6)


def test_value_loss_is_clipped():
  values = jnp.array([[2.0, 0.0]])
  old = jnp.array([[0.0, 0.0]])
  returns = jnp.array([[1.0, 1.0]])
  mask = jnp.array([[True, True]])
  loss, _ = losses.value_loss(values, old, returns, mask, losses.ValueLossConfig(clip=0.5))
  # token 0: max((2−1)², (0.5−1)²) = 1; token 1: max(1, 1) = 1 → ½·mean = 0.5
  assert float(loss) == pytest.approx(0.5)
  grad = jax.grad(lambda v: losses.value_loss(v, old, returns, mask,
                                              losses.ValueLossConfig(clip=0.5))[0])(values)
  np.testing.assert_allclose(np.asarray(grad), [[0.5, -0.5]], atol=TOL)


def test_bias_decomposition_terms_sum_to_the_total_bias():
  rng = np.random.default_rng(0)
  w, adv, ref, rho = (jnp.asarray(rng.normal(size=(2, 5))) for _ in range(4))
  valid = jnp.ones((2, 5), bool)
  terms = losses.bias_decomposition(w, adv, ref, rho, valid)
  total = float(jnp.mean(w * adv - rho * ref))
  assert terms["bias_policy"] + terms["bias_advantage"] + terms["bias_coupled"] == pytest.approx(total)


@pytest.mark.parametrize("kw, field", [
    (dict(policy_ratio="old"), "policy_ratio"), (dict(behavior_weight="clip"), "behavior_weight"),
    (dict(mask_range=(2.0, 0.5)), "mask_range"), (dict(clip_eps_low=1.5), "clip_eps_low"),
    (dict(aggregation="sum"), "aggregation"), (dict(kl_estimator="k2"), "kl_estimator"),
    (dict(weight_cap=0.0), "weight_cap"), (dict(entropy_coef=-1.0), "entropy_coef"),
])
def test_bad_loss_config_names_the_field(kw, field):
  with pytest.raises(ValueError, match=field):
    losses.ActorLossConfig(**kw)
