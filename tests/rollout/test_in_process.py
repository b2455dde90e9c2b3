"""The in-process backend against a real JetStream server on the same checkpoint: the same tokens,
log-probs, versions and finish reasons for seeded requests, the same multi-turn tool episode, the same
weights after a push."""

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from flax import nnx

from copc_jax.models import hf_io, tiny
from copc_jax.models.decoder import Decoder
from copc_jax.rollout import agent
from copc_jax.rollout.engine import DecodeEngine, SamplingOptions, SlotPrompt, rows_bucket
from copc_jax.rollout.in_process import InProcessBackend
from copc_jax.rollout.pool import RolloutPool
from copc_jax.rollout.protocol import RolloutBackend, WeightUpdate
from copc_jax.sampling import SamplingParams

LIMITS = dict(max_prefill_length=32, max_length=96)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
  path = str(tmp_path_factory.mktemp("in_process") / "tiny")
  tiny.make_tiny_checkpoint(path, "qwen2", seed=0)
  return path


@pytest.fixture(scope="module")
def backends(checkpoint):
  model, _ = hf_io.from_pretrained(checkpoint, load_tokenizer=False)
  local = InProcessBackend(model, slots=3, steps_per_call=5, version=0, **LIMITS)
  with RolloutPool(checkpoint, num_servers=1, slots=4, version=0, **LIMITS) as served:
    yield local, served
  local.close()


def requests_to_compare():
  """Seeded requests of several lengths and sampling settings, some with stop sequences."""
  out = []
  for i in range(10):
    out.append(dict(token_ids=[1, 5 + i, 9, 12 + i][: 2 + i % 3], max_tokens=20 + 7 * i, seed=100 + i,
                    temperature=(1.0, 0.7, 1.3)[i % 3], top_p=(1.0, 0.9)[i % 2], top_k=30 if i > 5 else 0))
  return out


def test_both_backends_are_rollout_backends(backends):
  assert all(isinstance(b, RolloutBackend) for b in backends)


def test_seeded_requests_give_the_servers_tokens_logprobs_versions_and_finish_reasons(backends):
  local, served = backends
  requests = requests_to_compare()
  reference = served.generate_many(requests)
  # Stop sequences cut from the server's own outputs (tokens 3..4 of a generation), so they fire.
  for request, out in [(r, o) for r, o in zip(requests, reference) if len(o.token_ids) > 5][:4]:
    request["stop_sequences"] = [[3], out.token_ids[3:5]]
  reference = served.generate_many(requests)
  with ThreadPoolExecutor(6) as pool:                     # more requests than slots, from many threads
    mine = list(pool.map(lambda r: local.generate(**r), requests))
  for request, ours, theirs in zip(requests, mine, reference):
    assert ours.token_ids == theirs.token_ids, request
    np.testing.assert_allclose(ours.logprobs, theirs.logprobs, atol=2e-5)
    assert ours.versions == theirs.versions == [0] * len(ours.token_ids)
    assert ours.finish_reason == theirs.finish_reason
  reasons = {g.finish_reason for g in reference}
  assert reasons == {"stop", "stop_sequence", "length"}, reasons      # every way a slot ends, compared


def test_a_multi_turn_tool_episode_is_the_same_on_both(backends):
  local, served = backends
  prompt, tool_output = [1, 20, 21, 22], [60, 61, 62]
  play = lambda generate, call_end: agent.run_episode(
      generate, prompt, tool=lambda turn: list(tool_output), tool_call_end=call_end, max_turns=3,
      max_tokens_per_turn=12, max_prompt_length=32, max_length=96, seed=9)
  call_end = play(served.generate, []).token_ids[1:2]         # a token this episode's first turn samples
  ours, theirs = play(local.generate, call_end), play(served.generate, call_end)
  assert theirs.num_turns >= 2 and False in theirs.mask                 # the tool ran
  assert (ours.token_ids, ours.mask, ours.versions, ours.finish_reason, ours.num_turns) == \
      (theirs.token_ids, theirs.mask, theirs.versions, theirs.finish_reason, theirs.num_turns)
  np.testing.assert_allclose(ours.logprobs, theirs.logprobs, atol=2e-5)


def test_pushed_weights_are_served_with_their_version(backends, checkpoint, tmp_path):
  """New weights as arrays (the learner's) and as a directory (lag mode's saved versions): the
  in-process backend then samples what a server given the same directory samples."""
  local, served = backends
  model, _ = hf_io.from_pretrained(checkpoint, load_tokenizer=False)
  new = Decoder(model.config, rngs=nnx.Rngs(7))
  hf_io.save_pretrained(new, str(tmp_path / "v1"))
  request = dict(token_ids=[1, 8, 9], max_tokens=12, seed=4)
  local.push(WeightUpdate(1, nnx.state(new, nnx.Param), "arrays"))
  served.push(WeightUpdate(1, str(tmp_path / "v1")))
  by_arrays, reference = local.generate(**request), served.generate(**request)
  local.push(WeightUpdate(2, str(tmp_path / "v1")))
  by_path = local.generate(**request)
  assert by_arrays.token_ids == reference.token_ids == by_path.token_ids
  assert set(by_arrays.versions) == {1} and set(by_path.versions) == {2}
  assert local.status()[0].version == 2
  with pytest.raises(ValueError, match="version must increase: got 2, serving 2"):
    local.push(WeightUpdate(2, str(tmp_path / "v1")))


def test_bad_requests_get_one_line_naming_the_field(backends):
  local, _ = backends
  with pytest.raises(ValueError, match=r"prompt of 40 tokens is longer than the prefill bucket \(32\)"):
    local.generate([1] * 40, 4)
  with pytest.raises(ValueError, match=r"max_tokens must be an integer in \[1, 93\]"):
    local.generate([1, 2, 3], 200)
  with pytest.raises(ValueError, match="at most 4 of at most 16 tokens each"):
    local.generate([1, 2], 4, stop_sequences=[[3]] * 5)
  with pytest.raises(ValueError, match="arrays or a directory, not bytes"):
    local.push(WeightUpdate(9, b"\x00", "bytes"))
  assert local.generate([1, 2], 3, seed=1).finish_reason in ("stop", "length")     # still serving


def test_a_closed_backend_refuses_requests(checkpoint):
  model, _ = hf_io.from_pretrained(checkpoint, load_tokenizer=False)
  backend = InProcessBackend(model, slots=2, **LIMITS)
  assert backend.generate([1, 4], 3, seed=0).versions == [-1] * 3          # the base weights: version −1
  backend.close()
  with pytest.raises(RuntimeError, match="closed"):
    backend.generate([1, 4], 3)


def test_a_failure_in_the_driver_reaches_every_caller_and_closes_the_backend(checkpoint):
  model, _ = hf_io.from_pretrained(checkpoint, load_tokenizer=False)
  backend = InProcessBackend(model, slots=2, **LIMITS)

  def broken(*args, **kwargs):
    raise RuntimeError("the device is gone")

  backend.engine.prefill_into_slots = broken
  with ThreadPoolExecutor(3) as pool:
    futures = [pool.submit(backend.generate, [1, 4], 3) for _ in range(3)]
    errors = [f.exception(timeout=120) for f in futures]
  assert all(isinstance(e, RuntimeError) for e in errors), errors
  assert any("the device is gone" in str(e) for e in errors)
  with pytest.raises(RuntimeError, match="closed"):
    backend.generate([1, 4], 3)
  backend.close()


def test_prompts_prefilled_together_give_the_state_of_one_at_a_time(checkpoint):
  model, _ = hf_io.from_pretrained(checkpoint, load_tokenizer=False)
  engine = DecodeEngine(model, slots=4, **LIMITS)
  weights = engine.store.get()
  prompts = [SlotPrompt(3, [1, 5, 9], SamplingOptions(SamplingParams(0.7, 0.9, 30), seed=11)),
             SlotPrompt(0, list(range(2, 22)), SamplingOptions(seed=12))]          # buckets 16 and 32
  one_at_a_time = engine.init_decode_state()
  for p in prompts:
    prefix = engine.prefill_prompt(weights, np.pad(p.tokens, (0, 32 - len(p.tokens))), len(p.tokens), p.options)
    one_at_a_time = engine.insert_prefix(prefix, one_at_a_time, p.slot)
  together = engine.prefill_into_slots(weights, prompts, engine.init_decode_state())
  assert engine.calls["prefill_slots"] == 1 and rows_bucket(2, 4) == 2
  for name, ours, theirs in zip(("keys", "values"), (together.cache.keys, together.cache.values),
                                (one_at_a_time.cache.keys, one_at_a_time.cache.values)):
    np.testing.assert_allclose(ours[:, :, :32], theirs[:, :, :32], atol=1e-5, err_msg=name)
  np.testing.assert_allclose(together.logits, one_at_a_time.logits, atol=1e-5)
  for field in ("lengths", "generated", "logits_version", "temperature", "top_p", "top_k", "key_data"):
    np.testing.assert_array_equal(getattr(together, field), getattr(one_at_a_time, field), err_msg=field)
  np.testing.assert_array_equal(together.cache.valid, one_at_a_time.cache.valid)
  assert np.asarray(together.lengths).tolist() == [20, 0, 0, 3]           # slots 1 and 2 untouched


def test_requests_sent_together_start_in_one_device_call(checkpoint):
  model, _ = hf_io.from_pretrained(checkpoint, load_tokenizer=False)
  backend = InProcessBackend(model, slots=4, steps_per_call=8, admission_window_s=60.0, **LIMITS)
  try:
    with ThreadPoolExecutor(4) as pool:        # the window closes when every free slot has a request
      outs = list(pool.map(lambda i: backend.generate([1, 4 + i], 8, seed=i), range(4)))
    assert all(o.finish_reason in ("stop", "length") for o in outs)
    assert backend.calls == {"prefill": 1, "decode": 1}
  finally:
    backend.close()
