import numpy as np
import pytest

from copc_jax import estimators, synthetic


def test_exact_gradient_matches_finite_differences():
  rng = np.random.default_rng(0)
  theta, phi, gain = rng.normal(size=5), rng.normal(size=5), rng.normal(size=5)

  def objective(th):
    p, w, _, _ = synthetic.exact_solution(th, phi, gain)
    return w[0, 0]  # J = W_0(s_0 = 0)

  _, _, _, grad = synthetic.exact_solution(theta, phi, gain)
  for t in range(5):
    step = np.zeros(5)
    step[t] = 1e-6
    numeric = (objective(theta + step) - objective(theta - step)) / 2e-6
    assert grad[t] == pytest.approx(numeric, abs=1e-6)


def test_on_policy_gae_estimates_the_true_advantage_without_bias():
  batch = synthetic.sample_batch(np.random.default_rng(1), num_trajectories=20000, num_steps=6,
                                 tool_every=2, drift=0.0)
  adv, _ = estimators.gae(batch.rewards, batch.values, batch.mask)
  error = np.asarray(adv) - batch.true_advantages
  policy = batch.mask[0]
  mean_error = error[:, policy].mean(axis=0)
  standard_error = error[:, policy].std(axis=0) / np.sqrt(error.shape[0])
  assert np.all(np.abs(mean_error) < 5 * standard_error + 1e-6)


def test_on_policy_gradient_estimate_is_unbiased_and_staleness_hurts_async_ppo():
  on = synthetic.sample_batch(np.random.default_rng(2), num_trajectories=20000, num_steps=8,
                              tool_every=3, drift=0.0)
  stale = synthetic.sample_batch(np.random.default_rng(2), num_trajectories=20000, num_steps=8,
                                 tool_every=3, drift=1.5)
  on_error = synthetic.gradient_check(on, "async_ppo")["relative_gradient_error"]
  stale_error = synthetic.gradient_check(stale, "async_ppo")["relative_gradient_error"]
  assert on_error < 0.1
  assert stale_error > 3 * on_error
