"""The exact tree MDP: exact gradients, the decomposition's identity, exact = sampled, and COPC unbiased."""

import dataclasses

import numpy as np
import pytest

from copc_jax import exact_mdp, presets


@pytest.fixture(scope="module")
def tree():
  return exact_mdp.make_tree(np.random.default_rng(0), branching=3, depth=4, drift=0.7)


def test_true_gradient_equals_finite_differences_of_the_value(tree):
  grad_j, _ = exact_mdp.true_gradients(tree)
  eps, numeric = 1e-6, np.zeros_like(tree.logits_pi)
  for index in np.ndindex(tree.logits_pi.shape):
    bumped = [tree.logits_pi.copy(), tree.logits_pi.copy()]
    bumped[0][index] += eps
    bumped[1][index] -= eps
    values = [exact_mdp.node_values(tree, b)[0] for b in bumped]
    numeric[index] = (values[0] - values[1]) / (2 * eps)
  np.testing.assert_allclose(grad_j, numeric, atol=1e-7)


@pytest.mark.parametrize("preset", ["async_ppo", "decoupled_ppo", "icepop", "vtrace", "copc"])
def test_the_bias_is_the_sum_of_the_three_terms(tree, preset):
  result = exact_mdp.decomposition(tree, preset)
  v = result["vectors"]
  np.testing.assert_allclose(v["estimate"] - v["is_reference"],
                             v["bias_policy"] + v["bias_advantage"] + v["bias_coupled"], atol=1e-6)
  np.testing.assert_allclose(v["is_reference"], result["g_star"], atol=1e-5)   # E_μ[ρ A^π ∇log π] = g*


@pytest.mark.parametrize("preset", ["copc", "decoupled_ppo", "async_ppo"])
def test_sampled_terms_agree_with_the_exact_ones(tree, preset):
  exact = exact_mdp.decomposition(tree, preset)
  sampled = exact_mdp.decomposition(tree, preset, sample=20000, seed=1)
  for name in ("estimate", "bias_advantage"):
    error = sampled["vectors"][name] - exact["vectors"][name]
    # Σ error² against Σ SE²: about 1 when they agree within their confidence intervals.
    assert (error ** 2).sum() / (sampled["standard_errors"][name] ** 2).sum() < 3.0, name
  assert sampled["variance_term"] == pytest.approx(exact["variance_term"], rel=0.1)


def test_unclipped_unmasked_copc_is_unbiased_for_the_importance_sampled_gradient(tree):
  copc = presets.get_preset("copc_spec")          # the PPO clip on π_θ/π_prox: inactive at θ = θ_prox
  unclipped = presets.Preset(
      dataclasses.replace(copc.estimator, rho_clip=(0.0, np.inf), trace_clip=(0.0, np.inf), lam=1.0),
      dataclasses.replace(copc.actor, mask_range=(0.0, np.inf)))
  assert exact_mdp.decomposition(tree, unclipped)["bias_total"] < 1e-4
  assert exact_mdp.decomposition(tree, "copc_spec")["bias_total"] > 0.01    # the spec's clips do cost bias


# --- whitening: the baseline's push along ∇KL(μ‖π) ------------------------

def _baseline_push(tree, preset, rule):
  """The component along ∇KL(μ‖π) of what subtracting the baseline adds to the expected update,
  relative to the update without it (> 0: whitening pushes π away from μ)."""
  kl_direction = exact_mdp.kl_gradient(tree)
  kl_direction /= np.linalg.norm(kl_direction)
  scaled = exact_mdp.whitened_update(tree, preset, whiten="scale", critic_offset=1.0)
  centered = exact_mdp.whitened_update(tree, preset, whiten=rule, critic_offset=1.0)
  return float((centered - scaled) @ kl_direction / np.linalg.norm(scaled))


def _unclipped(name):
  """The preset with ratio clips that never bind: its channels carry r_t exactly once."""
  preset = presets.get_preset(name)
  return dataclasses.replace(preset, estimator=dataclasses.replace(
      preset.estimator, rho_clip=(0.0, 1e9), trace_clip=(0.0, 1e9)))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_centered_whitening_adds_no_push_away_from_mu_when_the_channels_carry_the_ratio_once(seed):
  """V-trace with unclipped ρ (ratio-free policy channel, ρ_t on the advantage): the old rule's
  constant adds (m/σ)·∇KL(μ‖π) (a push away from μ when the critic is below its targets); the
  spec's rule subtracts m·ρ_t, whose expectation under μ is 0."""
  tree = exact_mdp.make_tree(np.random.default_rng(seed), branching=3, depth=4, drift=1.0)
  assert _baseline_push(tree, _unclipped("vtrace"), "plain") > 0.3
  assert abs(_baseline_push(tree, _unclipped("vtrace"), "center")) < 1e-6


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("name", ["vtrace", "copc"])
def test_centered_whitening_shrinks_the_push_for_the_ratio_free_presets(seed, name):
  """With the presets' own clips (ρ̃ = clip(r), COPC's mask) the centred baseline is not exactly
  unbiased (E_μ[clip(r) ∇log π] ≠ 0), but its push away from μ is smaller than the old rule's
  (measured here: about half for V-trace's one-sided clip at 1, a tenth to a half for COPC)."""
  tree = exact_mdp.make_tree(np.random.default_rng(seed), branching=3, depth=4, drift=0.5)
  old, new = _baseline_push(tree, name, "plain"), _baseline_push(tree, name, "center")
  assert old > 0.2
  assert new < old


@pytest.mark.parametrize("name", ["decoupled_ppo", "tis", "icepop", "async_ppo"])
def test_centered_whitening_is_the_usual_rule_for_the_gae_presets(name):
  """The GAE presets carry no ratio in the advantage (c_t = 1): both rules are (Â − m)/σ."""
  tree = exact_mdp.make_tree(np.random.default_rng(0), branching=3, depth=4, drift=1.0)
  np.testing.assert_allclose(exact_mdp.whitened_update(tree, name, whiten="center", critic_offset=1.0),
                             exact_mdp.whitened_update(tree, name, whiten="plain", critic_offset=1.0),
                             atol=1e-12)
