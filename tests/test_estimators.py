import functools

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference
import rlax

from copc_jax import estimators

TOL = 1e-5
IMPLS = ("scan", "associative")
FORMS = ("trace", "vtrace_pg")


def random_batch(seed, batch=5, length=23, p_policy=0.7, ragged=True, log_ratio_scale=0.6):
  rng = np.random.default_rng(seed)
  mask = rng.random((batch, length)) < p_policy
  if ragged:  # padding at the end of each row
    ends = rng.integers(0, length + 1, size=batch)
    mask &= np.arange(length)[None] < ends[:, None]
  return dict(
      rewards=rng.normal(size=(batch, length)).astype(np.float32),
      values=rng.normal(size=(batch, length)).astype(np.float32),
      target_logprobs=(-rng.random((batch, length))
                       + log_ratio_scale * rng.normal(size=(batch, length))).astype(np.float32),
      behavior_logprobs=(-rng.random((batch, length))).astype(np.float32),
      mask=mask,
  ), rng.normal(size=batch).astype(np.float32)


def call(batch, **kw):
  """Exactly the public API of the spec."""
  return estimators.coupled_advantages(
      batch["rewards"], batch["values"], batch["target_logprobs"], batch["behavior_logprobs"],
      batch["mask"], **kw)


def assert_close(actual, expected, tol=TOL):
  np.testing.assert_allclose(np.asarray(actual), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("seed", range(4))
def test_matches_literal_reference(seed, form, impl):
  batch, bootstrap = random_batch(seed)
  kw = dict(gamma=0.97, lam=0.9, rho_clip=(0.3, 1.7), trace_clip=(0.2, 1.1),
            bootstrap_value=bootstrap, advantage_form=form)
  adv, ret = call(batch, impl=impl, **kw)
  ref_adv, ref_ret = reference.coupled_advantages(**batch, **kw)
  assert adv.dtype == jnp.float32 and ret.dtype == jnp.float32
  assert_close(adv, ref_adv)
  assert_close(ret, ref_ret)


def test_spec_defaults_match_reference_without_bootstrap():
  batch, _ = random_batch(7)
  adv, ret = call(batch)
  ref_adv, ref_ret = reference.coupled_advantages(**batch)
  assert_close(adv, ref_adv)
  assert_close(ret, ref_ret)


def test_hand_computed_case_with_tool_token():
  # Positions: policy, tool (reward 0.5, masked), policy, padding. γ = 0.5, λ = 1.
  rewards = np.array([[0.0, 0.5, 1.0, 0.0]], np.float32)
  values = np.array([[0.2, 7.0, 0.4, 7.0]], np.float32)
  mask = np.array([[True, False, True, False]])
  log_ratio = np.log(np.array([[3.0, 1.0, 0.25, 1.0]], np.float32))
  zeros = np.zeros_like(rewards)
  adv, ret = estimators.coupled_advantages(
      rewards, values, log_ratio, zeros, mask, gamma=0.5, lam=1.0, rho_clip=(0.5, 2.0),
      trace_clip=(0.5, 1.0), bootstrap_value=np.array([0.8], np.float32))
  # Token 2: ρ̃ = 0.5, δ = 1 + 0.5·0.8 − 0.4 = 1.0, G = 0.5.
  # Token 0: ρ̃ = 2, c̃ = 1, R = 0 + 0.5 (tool reward), δ = 0.5 + 0.5·0.4 − 0.2 = 0.5,
  #          G = 2·0.5 + 0.5·1·0.5 = 1.25.
  assert_close(adv, [[1.25, 0.0, 0.5, 0.0]])
  assert_close(ret, [[1.45, 0.0, 0.9, 0.0]])
  pg_adv, _ = estimators.coupled_advantages(
      rewards, values, log_ratio, zeros, mask, gamma=0.5, lam=1.0, rho_clip=(0.5, 2.0),
      trace_clip=(0.5, 1.0), bootstrap_value=np.array([0.8], np.float32),
      advantage_form="vtrace_pg")
  # vtrace_pg, token 0: 2·(0.5 + 0.5·0.9 − 0.2) = 1.5; token 2: 0.5·(1 + 0.5·0.8 − 0.4) = 0.5.
  assert_close(pg_adv, [[1.5, 0.0, 0.5, 0.0]])


@pytest.mark.parametrize("impl", IMPLS)
def test_unit_clips_are_textbook_gae(impl):
  batch, bootstrap = random_batch(3, ragged=False, p_policy=1.1)
  adv, ret = call(batch, gamma=0.9, lam=0.8, rho_clip=(1.0, 1.0), trace_clip=(1.0, 1.0),
                  bootstrap_value=bootstrap, impl=impl)
  for b in range(len(bootstrap)):
    expected = reference.gae_textbook(batch["rewards"][b].astype(np.float64),
                                      batch["values"][b].astype(np.float64), 0.9, 0.8,
                                      bootstrap=float(bootstrap[b]))
    assert_close(adv[b], expected)
    assert_close(ret[b], expected + batch["values"][b])


def test_gae_preset_skips_tool_tokens_like_the_compacted_sequence():
  batch, bootstrap = random_batch(11, ragged=False)
  adv, _ = estimators.gae(batch["rewards"], batch["values"], batch["mask"], gamma=0.95, lam=0.9,
                          bootstrap_value=bootstrap)
  for b in range(len(bootstrap)):
    keep = batch["mask"][b]
    if not keep.any():
      continue
    # Rewards of masked positions move to the preceding policy token.
    owner = np.maximum.accumulate(np.where(keep, np.arange(len(keep)), -1))
    rewards = np.zeros(len(keep))
    np.add.at(rewards, owner[owner >= 0], batch["rewards"][b][owner >= 0])
    expected = reference.gae_textbook(rewards[keep], batch["values"][b][keep].astype(np.float64),
                                      0.95, 0.9, bootstrap=float(bootstrap[b]))
    assert_close(adv[b][keep], expected)


@pytest.mark.parametrize("lam", (1.0, 0.8))
@pytest.mark.parametrize("impl", IMPLS)
def test_vtrace_matches_rlax(lam, impl):
  batch, bootstrap = random_batch(5, ragged=False, p_policy=1.1, log_ratio_scale=1.0)
  rho_bar, gamma = 1.3, 0.9
  adv, ret = estimators.vtrace(batch["rewards"], batch["values"], batch["target_logprobs"],
                               batch["behavior_logprobs"], batch["mask"], gamma=gamma, lam=lam,
                               rho_bar=rho_bar, bootstrap_value=bootstrap, impl=impl)
  rhos = np.exp(batch["target_logprobs"] - batch["behavior_logprobs"])
  values_t = np.concatenate([batch["values"][:, 1:], bootstrap[:, None]], axis=1)
  out = jax.vmap(functools.partial(
      rlax.vtrace_td_error_and_advantage, lambda_=lam, clip_rho_threshold=rho_bar,
      clip_pg_rho_threshold=rho_bar))(
          batch["values"], values_t, batch["rewards"], np.full_like(rhos, gamma), rhos)
  assert_close(ret, batch["values"] + np.asarray(out.errors))
  assert_close(adv, out.pg_advantage)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("clips", [((0.5, 2.0), (0.5, 1.0)), ((0.0, 1.0), (1.0, 3.0)),
                                   ((1.0, 1.0), (0.2, 1.0))])
def test_on_policy_reduces_to_gae(form, clips):
  batch, bootstrap = random_batch(9)
  batch["behavior_logprobs"] = batch["target_logprobs"]
  adv, ret = call(batch, gamma=0.9, lam=0.7, rho_clip=clips[0], trace_clip=clips[1],
                  bootstrap_value=bootstrap, advantage_form=form)
  gae_adv, gae_ret = estimators.gae(batch["rewards"], batch["values"], batch["mask"], gamma=0.9,
                                    lam=0.7, bootstrap_value=bootstrap)
  assert_close(adv, gae_adv)
  assert_close(ret, gae_ret)


@hypothesis.settings(max_examples=60, deadline=None)
@hypothesis.given(
    seed=st.integers(0, 2**31 - 1), batch=st.integers(1, 4), length=st.integers(1, 40),
    p_policy=st.floats(0.0, 1.0), gamma=st.floats(0.0, 1.0), lam=st.floats(0.0, 1.0),
    rho=st.tuples(st.floats(0.0, 3.0), st.floats(0.0, 3.0)).map(sorted),
    trace=st.tuples(st.floats(0.0, 3.0), st.floats(0.0, 3.0)).map(sorted),
    form=st.sampled_from(FORMS), with_bootstrap=st.booleans())
def test_property_scan_associative_and_reference_agree(seed, batch, length, p_policy, gamma, lam,
                                                       rho, trace, form, with_bootstrap):
  data, bootstrap = random_batch(seed, batch=batch, length=length, p_policy=p_policy)
  kw = dict(gamma=gamma, lam=lam, rho_clip=tuple(rho), trace_clip=tuple(trace),
            bootstrap_value=bootstrap if with_bootstrap else None, advantage_form=form)
  ref_adv, ref_ret = reference.coupled_advantages(**data, **kw)
  for impl in IMPLS:
    adv, ret = call(data, impl=impl, **kw)
    assert_close(adv, ref_adv, tol=2e-5)
    assert_close(ret, ref_ret, tol=2e-5)
    assert np.all(np.asarray(adv)[~data["mask"]] == 0)
    assert np.all(np.asarray(ret)[~data["mask"]] == 0)


def test_jit_and_no_jit_agree():
  batch, bootstrap = random_batch(2)
  jitted = call(batch, bootstrap_value=bootstrap)
  with jax.disable_jit():
    eager = call(batch, bootstrap_value=bootstrap)
  for a, b in zip(jitted, eager):
    assert_close(a, np.asarray(b))


def test_callable_inside_user_jit_and_vmap_free():
  batch, bootstrap = random_batch(4)
  fn = jax.jit(lambda b, v: estimators.coupled_advantages(
      b["rewards"], b["values"], b["target_logprobs"], b["behavior_logprobs"], b["mask"],
      bootstrap_value=v))
  for a, b in zip(fn(batch, bootstrap), call(batch, bootstrap_value=bootstrap)):
    assert_close(a, np.asarray(b))


@pytest.mark.parametrize("form", FORMS)
def test_same_results_without_the_experimental_layout_api(form, monkeypatch):
  batch, bootstrap = random_batch(7, length=31)
  kw = dict(bootstrap_value=bootstrap, advantage_form=form)
  with_constraint = call(batch, **kw)
  monkeypatch.setattr(estimators, "with_layout_constraint", None)
  jax.clear_caches()  # retrace with the fallback
  without = call(batch, **kw)
  ref_adv, ref_ret = reference.coupled_advantages(**batch, **kw)
  for a, b, ref in zip(with_constraint, without, (ref_adv, ref_ret)):
    assert_close(a, ref)
    assert_close(b, ref)


def test_bfloat16_inputs_accumulate_in_float32():
  batch, bootstrap = random_batch(6, length=200)
  as_bf16 = {k: (jnp.asarray(v, jnp.bfloat16) if k != "mask" else v) for k, v in batch.items()}
  rounded = {k: (np.asarray(v, np.float32) if k != "mask" else v) for k, v in as_bf16.items()}
  adv, ret = call(as_bf16, bootstrap_value=bootstrap)
  assert adv.dtype == jnp.float32
  ref_adv, ref_ret = reference.coupled_advantages(**rounded, bootstrap_value=bootstrap)
  assert_close(adv, ref_adv)
  assert_close(ret, ref_ret)


def test_inserting_zero_reward_tool_tokens_changes_nothing():
  batch, bootstrap = random_batch(8, ragged=False, p_policy=1.1, length=10)
  adv, ret = call(batch, bootstrap_value=bootstrap)
  widened = {k: np.repeat(v, 2, axis=1) for k, v in batch.items()}
  widened["mask"][:, 1::2] = False
  widened["rewards"][:, 1::2] = 0.0
  wadv, wret = call(widened, bootstrap_value=bootstrap)
  assert_close(wadv[:, ::2], np.asarray(adv))
  assert_close(wret[:, ::2], np.asarray(ret))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("form", FORMS)
def test_non_finite_ratio_cuts_the_trace_without_nan(form, impl):
  batch, _ = random_batch(1, ragged=False, p_policy=1.1, length=8)
  batch["behavior_logprobs"][0, 4] = -np.inf
  batch["target_logprobs"][1, 2] = np.nan
  batch["target_logprobs"][1, 5] = 200.0   # finite log-ratio whose exp overflows: clipped, kept
  adv, ret = call(batch, advantage_form=form, impl=impl)
  assert np.isfinite(np.asarray(adv)).all() and np.isfinite(np.asarray(ret)).all()
  with np.errstate(over="ignore"):
    ref_adv, ref_ret = reference.coupled_advantages(**batch, advantage_form=form)
  assert_close(adv, ref_adv)
  assert_close(ret, ref_ret)
  assert float(adv[0, 4]) == 0.0


def test_padding_with_garbage_is_ignored():
  batch, bootstrap = random_batch(12)
  batch["rewards"][~batch["mask"]] = 0.0   # rewards at masked positions do count; the rest not
  dirty = {k: np.array(v) for k, v in batch.items()}
  for key in ("values", "target_logprobs", "behavior_logprobs"):
    dirty[key][~batch["mask"]] = np.nan
  dirty["target_logprobs"][~batch["mask"]] = -np.inf
  for a, b in zip(call(dirty, bootstrap_value=bootstrap), call(batch, bootstrap_value=bootstrap)):
    assert_close(a, np.asarray(b))


@pytest.mark.parametrize("kw, message", [
    (dict(rho_clip=(2.0, 1.0)), "rho_clip"),
    (dict(trace_clip=(1.0, 0.5)), "trace_clip"),
    (dict(trace_clip=(-0.5, 1.0)), r"trace_clip must satisfy 0 <= min"),
    (dict(advantage_form="gae"), "advantage_form"),
    (dict(gamma=-0.1), "gamma"),
    (dict(lam=1.5), "lam"),
    (dict(impl="loop"), "impl"),
    (dict(bootstrap_value=np.zeros(3)), "bootstrap_value"),
])
def test_bad_arguments_name_the_argument(kw, message):
  batch, _ = random_batch(0)
  with pytest.raises(ValueError, match=message):
    call(batch, **kw)


def test_shape_mismatch_is_reported():
  batch, _ = random_batch(0)
  batch["values"] = batch["values"][:, :-1]
  with pytest.raises(ValueError, match="values"):
    call(batch)


def test_whiten_uses_policy_tokens_only():
  adv = jnp.array([[1.0, 100.0, 3.0]])
  mask = jnp.array([[True, False, True]])
  out = np.asarray(estimators.whiten(adv, mask))
  assert_close(out, [[-1.0, 0.0, 1.0]], tol=1e-5)


# --- whitening modes and the σ floor -------------------------------------------------------------

def test_whiten_modes_against_the_formula():
  rng = np.random.default_rng(0)
  adv = rng.normal(size=(3, 5)).astype(np.float32) + 0.7
  mask = rng.random((3, 5)) < 0.7
  carried = rng.uniform(0.5, 2.0, size=(3, 5)).astype(np.float32)
  m, s = adv[mask].mean(), adv[mask].std()
  np.testing.assert_allclose(estimators.whiten(adv, mask, mode="none"), np.where(mask, adv, 0), atol=1e-6)
  np.testing.assert_allclose(estimators.whiten(adv, mask, mode="scale"), np.where(mask, adv / s, 0), atol=1e-5)
  np.testing.assert_allclose(estimators.whiten(adv, mask, mode="center", carried_ratio=carried),
                             np.where(mask, (adv - m * carried) / s, 0), atol=1e-5)
  np.testing.assert_allclose(estimators.whiten(adv, mask, mode="center"),        # c_t = 1: the usual rule
                             np.where(mask, (adv - m) / s, 0), atol=1e-5)


def test_whiten_floor_keeps_an_all_equal_batch_small():
  """All rewards 0 after a collapse: advantages are critic noise of ~1e-3; the floor keeps them that size."""
  rng = np.random.default_rng(1)
  adv = 1e-3 * rng.normal(size=(4, 6)).astype(np.float32)
  mask = np.ones((4, 6), bool)
  floored = np.asarray(estimators.whiten(adv, mask, mode="center", min_std=0.05))
  unfloored = np.asarray(estimators.whiten(adv, mask, mode="center", min_std=0.0))
  assert np.abs(floored).max() < 0.1
  assert np.std(unfloored) == pytest.approx(1.0, abs=1e-3)


def test_whiten_rejects_an_unknown_mode():
  with pytest.raises(ValueError, match="whiten mode must be one of"):
    estimators.whiten(np.zeros((1, 2)), np.ones((1, 2), bool), mode="mean")


# --- group baselines --------------------------------------------------------------------------------

def _literal_group_advantages(rewards, groups, method, eps):
  out = []
  for i, (r, g) in enumerate(zip(rewards, groups, strict=True)):
    members = [rewards[j] for j in range(len(rewards)) if groups[j] == g]
    others = [rewards[j] for j in range(len(rewards)) if groups[j] == g and j != i]
    if len(members) == 1:
      out.append(0.0)
    elif method == "grpo":
      out.append((r - np.mean(members)) / (np.std(members, ddof=1) + eps))
    elif method == "dr_grpo":
      out.append(r - np.mean(members))
    else:
      out.append(r - np.mean(others))
  return np.array(out)


@pytest.mark.parametrize("method", ["grpo", "dr_grpo", "rloo"])
def test_group_advantages_match_a_literal_reading(method):
  rng = np.random.default_rng(2)
  groups = np.array([7, 3, 7, 3, 3, 9, 7, 3, 11, 11])       # unsorted ids, a group of one (9)
  rewards = rng.integers(0, 2, size=10).astype(np.float32) + 0.1 * rng.normal(size=10).astype(np.float32)
  got = estimators.group_advantages(rewards, groups, method=method)
  expected = _literal_group_advantages(rewards, groups, method, 1e-6)
  np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


def test_grpo_matches_tunix_formula():
  """Tunix's `grpo` estimator: rewards reshaped [prompts, n], mean and std(ddof=1), eps = 1e-4."""
  rng = np.random.default_rng(3)
  n = 4
  rewards = rng.integers(0, 2, size=4 * n).astype(np.float32)
  grouped = rewards.reshape(-1, n)
  tunix = (rewards - np.repeat(grouped.mean(1), n)) / (np.repeat(grouped.std(1, ddof=1), n) + 1e-4)
  got = estimators.group_advantages(rewards, np.repeat(np.arange(4), n), method="grpo", eps=1e-4)
  np.testing.assert_allclose(got, tunix, rtol=1e-5, atol=1e-6)


def test_rloo_is_the_scaled_dr_grpo():
  rewards, groups = np.array([1.0, 0.0, 0.0, 1.0, 1.0]), np.array([0, 0, 0, 1, 1])
  n = np.array([3, 3, 3, 2, 2])
  np.testing.assert_allclose(estimators.group_advantages(rewards, groups, method="rloo"),
                             n / (n - 1) * np.asarray(estimators.group_advantages(rewards, groups,
                                                                                   method="dr_grpo")),
                             rtol=1e-6)
