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


def hand_ratios(name, b):
  """q_t, the ratio of the gradient (π_θ/π_prox, or π_θ/μ for async PPO's own surrogate), and a_t, the
  ratio the PPO indicator is taken on: q_t, or π_θ/μ where the preset anchors the clip on μ."""
  actor = presets.get_preset(name).actor
  theta = b["logp_theta"].astype(np.float64)
  q = np.exp(theta - (b["logp_behavior"] if actor.policy_ratio == "behavior" else b["logp_prox"]))
  return q, (np.exp(theta - b["logp_behavior"]) if actor.anchor == "behavior" else q)


def hand_clipped(a, adv):
  """The PPO indicator's clipped tokens: Â > 0 with a > 1 + ε_high, or Â < 0 with a < 1 − ε_low."""
  return ((adv > 0) & (a > 1 + EPS_HIGH)) | ((adv < 0) & (a < 1 - EPS_LOW))


def hand_policy_weight(name, b):
  """w_t of each preset derived by hand: ∂loss/∂log π_θ = −w Â / N."""
  r = np.exp(b["logp_prox"].astype(np.float64) - b["logp_behavior"])
  q, a = hand_ratios(name, b)
  copc_spec_mask = ((r >= 0.5) & (r <= 2.0)).astype(float)
  behaviour = {
      "sync_ppo": np.ones_like(r), "async_ppo": np.ones_like(r), "vtrace": np.ones_like(r),
      "decoupled_ppo": np.minimum(r, 5.0), "tis": np.minimum(r, 2.0),
      "icepop": np.where((r >= 0.5) & (r <= 5.0), r, 0.0),
      "mis": np.where((r >= 0.5) & (r <= 5.0), r, 0.0),
      "copc": copc_spec_mask, "copc_spec": copc_spec_mask,
      "grpo": np.ones_like(r), "dr_grpo": np.ones_like(r), "rloo": np.ones_like(r),
  }[name]
  return np.where(b["mask"] & ~hand_clipped(a, b["advantages"]), behaviour * q, 0.0)


@pytest.mark.parametrize("name", sorted(presets.PRESETS))
def test_gradient_of_each_preset_equals_hand_derived(name):
  b = tiny_batch(1)
  config = presets.get_preset(name).actor
  grad = jax.grad(lambda lp: losses.actor_loss(lp, b["logp_prox"], b["logp_behavior"],
                                               b["advantages"], b["mask"], config)[0])(b["logp_theta"])
  expected = -hand_policy_weight(name, b) * b["advantages"] / _denominator(config, b)
  np.testing.assert_allclose(np.asarray(grad), expected, atol=TOL, rtol=1e-4)


def _denominator(config, b):
  """Token mean: the policy tokens; Dr. GRPO's token sum: the constant B·T."""
  return b["mask"].size if config.aggregation == "token_sum" else b["mask"].sum()


@pytest.mark.parametrize("name", sorted(presets.PRESETS))
def test_loss_value_of_each_preset(name):
  b = tiny_batch(2)
  config = presets.get_preset(name).actor
  loss, diag = losses.actor_loss(**b, config=config)
  q, a = hand_ratios(name, b)
  r = np.exp(b["logp_prox"].astype(np.float64) - b["logp_behavior"])
  adv = b["advantages"]
  # The behaviour weight b_t applies to the term whether or not the clip is active.
  behaviour = np.asarray(losses.behavior_weights(jnp.asarray(r), config), np.float64)
  if a is q:                 # the indicator on q: the clipped term replaces q Â where it is smaller
    clipped_q = np.clip(q, 1 - EPS_LOW, 1 + EPS_HIGH)
    active = b["mask"] & (clipped_q * adv < q * adv)
    term = np.minimum(q * adv, clipped_q * adv)
  else:                      # the indicator on π_θ/μ: the value stays q Â, the gradient stops there
    active = b["mask"] & hand_clipped(a, adv)
    term = q * adv
  expected = -(behaviour * term * b["mask"]).sum() / _denominator(config, b)
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
                              presets.get_preset("copc_spec").actor)
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


# --- the anchors: which ratio decides the PPO indicator, which ratio the mask is taken on ----------

def _loss_and_grad(b, config):
  loss = lambda lp: losses.actor_loss(lp, b["logp_prox"], b["logp_behavior"], b["advantages"], b["mask"],
                                      config)[0]
  return jax.value_and_grad(loss)(b["logp_theta"])


@pytest.mark.parametrize("name", ["decoupled_ppo", "tis", "icepop", "vtrace", "copc"])
def test_anchors_agree_at_the_proximal_policy_on_fresh_data(name):
  """θ = θ_prox and μ = π_prox (r = 1): π_θ/π_prox = π_θ/μ, so both anchors and both mask readings
  give the same loss and gradient."""
  b = tiny_batch(4)
  b["logp_theta"] = b["logp_behavior"] = b["logp_prox"]
  base = presets.get_preset(name).actor
  reference = _loss_and_grad(b, base)
  for anchor in losses.ANCHORS:
    for mask_ratio in losses.MASK_RATIOS:
      got = _loss_and_grad(b, dataclasses.replace(base, anchor=anchor, mask_ratio=mask_ratio))
      np.testing.assert_allclose(got[0], reference[0], atol=TOL)
      np.testing.assert_allclose(got[1], reference[1], atol=TOL)


@pytest.mark.parametrize("name", ["decoupled_ppo", "vtrace", "copc"])
def test_behavior_anchor_stops_the_tokens_whose_current_ratio_to_mu_left_the_clip(name):
  """anchor = behavior: gradient b_t q_t Â_t where the PPO indicator on π_θ/μ is inactive, 0 where
  (Â > 0 and π_θ/μ > 1 + ε_high) or (Â < 0 and π_θ/μ < 1 − ε_low); the weight keeps q = π_θ/π_prox."""
  b = tiny_batch(5)
  config = dataclasses.replace(presets.get_preset(name).actor, anchor="behavior")
  loss, grad = _loss_and_grad(b, config)
  r = np.exp(b["logp_prox"].astype(np.float64) - b["logp_behavior"])
  q = np.exp(b["logp_theta"].astype(np.float64) - b["logp_prox"])
  current = np.exp(b["logp_theta"].astype(np.float64) - b["logp_behavior"])
  adv = b["advantages"]
  behaviour = np.asarray(losses.behavior_weights(jnp.asarray(r), config))
  stopped = ((adv > 0) & (current > 1 + EPS_HIGH)) | ((adv < 0) & (current < 1 - EPS_LOW))
  expected_grad = -np.where(b["mask"] & ~stopped, behaviour * q, 0.0) * adv / b["mask"].sum()
  np.testing.assert_allclose(np.asarray(grad), expected_grad, atol=TOL, rtol=1e-4)
  np.testing.assert_allclose(float(loss), -(behaviour * q * adv * b["mask"]).sum() / b["mask"].sum(),
                             rtol=1e-5, atol=TOL)
  # The indicators differ from the proximal anchor's on this batch: the knob changes something.
  proximal_stopped = ((adv > 0) & (q > 1 + EPS_HIGH)) | ((adv < 0) & (q < 1 - EPS_LOW))
  assert (b["mask"] & (stopped != proximal_stopped)).any()


def test_current_mask_ratio_masks_on_pi_theta_over_mu_without_gradient_through_it():
  """mask_ratio = current: COPC's m_t = 1[0.5 ≤ sg(π_θ/μ) ≤ 2]; the proximal reading keeps π_prox/μ."""
  b = tiny_batch(6)
  config = dataclasses.replace(presets.get_preset("copc_spec").actor, mask_ratio="current")
  _, grad = _loss_and_grad(b, config)
  q = np.exp(b["logp_theta"].astype(np.float64) - b["logp_prox"])
  current = np.exp(b["logp_theta"].astype(np.float64) - b["logp_behavior"])
  adv = b["advantages"]
  inside = (current >= 0.5) & (current <= 2.0)
  clipped = ((adv > 0) & (q > 1 + EPS_HIGH)) | ((adv < 0) & (q < 1 - EPS_LOW))
  expected = -np.where(b["mask"] & inside & ~clipped, q, 0.0) * adv / b["mask"].sum()
  np.testing.assert_allclose(np.asarray(grad), expected, atol=TOL, rtol=1e-4)
  r = np.exp(b["logp_prox"].astype(np.float64) - b["logp_behavior"])
  assert (b["mask"] & (inside != ((r >= 0.5) & (r <= 2.0)))).any()     # the readings differ here


def test_anchors_diverge_after_one_update_as_the_formulas_say():
  """After a step θ ≠ θ_prox: on fresh data (μ = π_prox) π_θ/μ = π_θ/π_prox, so the behaviour anchor
  equals the proximal one (the same gradient; the loss value differs where the clip binds: the
  proximal form writes clip(q)·Â, the behaviour form sg(q)·Â); on stale data (μ ≠ π_prox) the
  gradients differ exactly on the tokens whose indicator flips between the two ratios."""
  b = tiny_batch(7)
  base = presets.get_preset("vtrace").actor
  fresh = dict(b, logp_behavior=b["logp_prox"])
  np.testing.assert_allclose(_loss_and_grad(fresh, base)[1],
                             _loss_and_grad(fresh, dataclasses.replace(base, anchor="behavior"))[1], atol=TOL)
  g_prox = np.asarray(_loss_and_grad(b, base)[1])
  g_beh = np.asarray(_loss_and_grad(b, dataclasses.replace(base, anchor="behavior"))[1])
  q = np.exp(b["logp_theta"].astype(np.float64) - b["logp_prox"])
  current = np.exp(b["logp_theta"].astype(np.float64) - b["logp_behavior"])
  adv = b["advantages"]
  stop = lambda ratio: ((adv > 0) & (ratio > 1 + EPS_HIGH)) | ((adv < 0) & (ratio < 1 - EPS_LOW))
  differs = b["mask"] & (stop(q) != stop(current))
  assert differs.any()
  np.testing.assert_array_equal(np.abs(g_prox - g_beh) > 1e-7, differs)


def test_kl_behavior_is_the_k3_estimate():
  b = tiny_batch(8)
  _, diag = losses.actor_loss(**b, config=presets.get_preset("copc").actor)
  x = np.exp(b["logp_theta"].astype(np.float64) - b["logp_behavior"])
  np.testing.assert_allclose(float(diag["kl_behavior"]), (x - 1 - np.log(x))[b["mask"]].mean(), rtol=1e-4)


def test_unknown_anchor_is_one_clear_line():
  with pytest.raises(ValueError, match="anchor must be one of"):
    losses.ActorLossConfig(anchor="mu")
