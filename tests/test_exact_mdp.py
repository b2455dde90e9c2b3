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
  copc = presets.get_preset("copc")
  unclipped = presets.Preset(
      dataclasses.replace(copc.estimator, rho_clip=(0.0, np.inf), trace_clip=(0.0, np.inf), lam=1.0),
      dataclasses.replace(copc.actor, mask_range=(0.0, np.inf)))
  assert exact_mdp.decomposition(tree, unclipped)["bias_total"] < 1e-4
  assert exact_mdp.decomposition(tree, "copc")["bias_total"] > 0.01         # the defaults do cost bias
