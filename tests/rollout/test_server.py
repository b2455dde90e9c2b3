"""Real servers (subprocesses), real gRPC on 127.0.0.1."""

import grpc
import jax
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import save as save_safetensors_bytes

from copc_jax import sampling
from copc_jax.models import hf_io, tiny
from copc_jax.models.decoder import Decoder, KVCache
from copc_jax.rollout import auth, jetstream_adapter
from copc_jax.rollout.process import ServerProcess

_, _, _, jetstream_pb2, jetstream_pb2_grpc = jetstream_adapter.install()
TOL = 1e-4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
  path = tmp_path_factory.mktemp("ckpt") / "tiny"
  tiny.make_tiny_checkpoint(str(path), "qwen2", seed=0)
  return str(path)


@pytest.fixture(scope="module")
def server(checkpoint):
  process = ServerProcess(checkpoint, slots=4, max_prefill_length=32, max_length=96)
  process.wait_ready()
  client = process.client()
  yield process, client
  client.close()
  process.stop()


def teacher_forced(model, prompt, generated, **options):
  tokens = np.array([list(prompt) + list(generated)])
  logp = sampling.sampling_logprobs(model(tokens), tokens, **options)
  return np.asarray(logp)[0, len(prompt):]


@pytest.mark.parametrize("options", [dict(), dict(temperature=0.7, top_p=0.9), dict(temperature=1.3, top_k=20)])
def test_behaviour_logprobs_equal_the_learner_recomputation(server, checkpoint, options):
  _, client = server
  model, _ = hf_io.from_pretrained(checkpoint, load_tokenizer=False)
  prompt = [1, 20, 21, 22, 23, 24]
  out = client.generate(prompt, max_tokens=20, **options)
  assert len(out.token_ids) == len(out.logprobs) == len(out.versions) > 0
  assert out.finish_reason in ("stop", "length")
  np.testing.assert_allclose(out.logprobs, teacher_forced(model, prompt, out.token_ids, **options),
                             atol=TOL)
  assert set(out.versions) == {client.status()["version"]}


def test_stop_token_is_returned_with_its_logprob(server, checkpoint):
  _, client = server
  model, _ = hf_io.from_pretrained(checkpoint, load_tokenizer=False)
  eos = model.config.eos_token_id
  for seed_prompt in range(40):   # find a generation that ends on EOS
    out = client.generate([1, 30 + seed_prompt % 50], max_tokens=60, temperature=1.5)
    if out.finish_reason == "stop":
      assert out.token_ids[-1] == eos and len(out.logprobs) == len(out.token_ids)
      return
    assert len(out.token_ids) == 60
  pytest.skip("no sampled generation reached EOS")


def test_malformed_requests_get_errors_and_the_server_keeps_serving(server, tmp_path):
  process, client = server
  vocab = len(tiny.make_tokenizer())
  bad = [
      (dict(token_ids=[], max_tokens=4), "non-empty"),
      (dict(token_ids=[1] * 33, max_tokens=4), "longer than the prefill bucket"),
      (dict(token_ids=[1, vocab + 5], max_tokens=4), "unknown token ids"),
      (dict(token_ids=[1, 2], max_tokens=0), "max_tokens must be an integer in [1, 94]"),
      (dict(token_ids=[1, 2], max_tokens=95), "max_tokens must be an integer in [1, 94]"),
      (dict(token_ids=[1, 2], max_tokens=4, temperature=0.0), "temperature must be a finite number in [0.001"),
      (dict(token_ids=[1, 2], max_tokens=4, temperature=1e-30), "temperature must be a finite number"),
      (dict(token_ids=[1, 2], max_tokens=4, top_p=1.5), "top_p must be a finite number in (0, 1]"),
      (dict(token_ids=[1, 2], max_tokens=4, top_k=-1), f"top_k must be an integer in [0, {vocab}]"),
      (dict(token_ids=[1, 2], max_tokens=4, top_k=2**40), "top_k must be an integer"),
      (dict(token_ids=[1, 2], max_tokens=True), "max_tokens must be an integer"),
      (dict(token_ids=[1, 2], max_tokens=4, seed=2**32), "seed must be an integer in [0, 4294967295]"),
      (dict(token_ids=[1, 2], max_tokens=4, stop_sequences=[[]]), "stop_sequences[0] must be a non-empty"),
  ]
  for kwargs, message in bad:
    with pytest.raises(grpc.RpcError) as err:
      client.generate(**kwargs)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in err.value.details(), (kwargs, err.value.details())
  with pytest.raises(grpc.RpcError, match="UpdateWeights"):
    client.update_weights("/nonexistent/dir", version=99)
  with pytest.raises(grpc.RpcError, match="UpdateWeightsBytes"):
    client.update_weights_bytes(b"not safetensors", version=99)
  garbage = tmp_path / "garbage"
  garbage.mkdir()
  (garbage / "model.safetensors").write_bytes(b"\xff" * 64)
  for path in (str(garbage), str(tmp_path / "empty_dir")):
    (tmp_path / "empty_dir").mkdir(exist_ok=True)
    with pytest.raises(grpc.RpcError) as err:
      client.update_weights(path, version=99)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
  with pytest.raises(grpc.RpcError, match="checkpoint lacks 25 tensor"):
    client.update_weights_bytes(save_safetensors_bytes({"model.norm.weight": np.ones(3, np.float32)}),
                                version=99)
  assert process.alive()
  assert len(client.generate([1, 2, 3], max_tokens=5).token_ids) > 0


def test_raw_bodies_that_are_not_json_objects_are_invalid_arguments(server):
  from copc_jax.rollout.protocol import SERVICE

  process, client = server
  with auth.client_channel(process.address, process.token) as channel:
    generate = channel.unary_stream(f"/{SERVICE}/Generate", lambda b: b, lambda b: b)
    update = channel.unary_unary(f"/{SERVICE}/UpdateWeights", lambda b: b, lambda b: b)
    bodies = [(b"[1, 2, 3]", "must be a JSON object; got list"), (b"7", "got int"),
              (b"\xff\xfe{", "not UTF-8"), (b"{not json", "not JSON"),
              (b'{"token_ids": [1, 2], "max_tokens": 4, "temperature": NaN}', "not a JSON number"),
              (b'{"token_ids": [1, 2], "max_token": 4}', "unknown field(s) ['max_token']"),
              (b'{"token_ids": [1, true], "max_tokens": 4}', "token_ids must be integers; got True"),
              (b'{"token_ids": [1, 2], "max_tokens": 4, "top_k": true}', "top_k must be an integer"),
              (b"[" * 100_000, "not JSON")]
    for body, message in bodies:
      for call in (lambda b: list(generate(b, timeout=30)), lambda b: update(b, timeout=30)):
        with pytest.raises(grpc.RpcError) as err:
          call(body)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (body[:20], err.value.details())
        assert message in err.value.details() or "UpdateWeights" in err.value.details()
    with pytest.raises(grpc.RpcError, match="reset must be true or false; got 1"):
      update(b'{"path": "x", "version": 1, "reset": 1}', timeout=30)
  assert process.alive()
  assert len(client.generate([1, 2, 3], max_tokens=5, top_k=1).token_ids) > 0


def test_extreme_but_allowed_sampling_settings_give_finite_logprobs(server):
  _, client = server
  for options in (dict(temperature=1e-3), dict(temperature=1e3), dict(top_k=1), dict(top_p=1e-9)):
    out = client.generate([1, 20, 21], max_tokens=8, **options)
    assert np.all(np.isfinite(out.logprobs)) and len(out.token_ids) > 0, options


def test_stock_jetstream_decode_client_gets_tokens(server):
  process, _ = server
  with auth.client_channel(process.address, process.token) as channel:
    stub = jetstream_pb2_grpc.OrchestratorStub(channel)
    assert stub.HealthCheck(jetstream_pb2.HealthCheckRequest()).is_live
    request = jetstream_pb2.DecodeRequest(
        max_tokens=6, token_content=jetstream_pb2.DecodeRequest.TokenContent(token_ids=[20, 21, 22]))
    tokens = [t for response in stub.Decode(request) for s in response.stream_content.samples
              for t in s.token_ids]
    assert 0 < len(tokens) <= 6
    text_request = jetstream_pb2.DecodeRequest(
        max_tokens=4, text_content=jetstream_pb2.DecodeRequest.TextContent(text="12+3="))
    texts = [s.text for response in stub.Decode(text_request) for s in response.stream_content.samples]
    assert texts
    bad = jetstream_pb2.DecodeRequest(
        max_tokens=4, token_content=jetstream_pb2.DecodeRequest.TokenContent(token_ids=[999999]))
    with pytest.raises(grpc.RpcError, match="unknown token ids"):
      list(stub.Decode(bad))
    long_text = jetstream_pb2.DecodeRequest(   # tokenizes to more than the prefill bucket (32)
        max_tokens=4, text_content=jetstream_pb2.DecodeRequest.TextContent(text="1+2=" * 20))
    too_many = jetstream_pb2.DecodeRequest(
        max_tokens=1000, token_content=jetstream_pb2.DecodeRequest.TokenContent(token_ids=[20, 21, 22]))
    for request, message in ((long_text, "longer than the prefill bucket"), (too_many, "max_tokens must be")):
      with pytest.raises(grpc.RpcError) as err:
        list(stub.Decode(request))
      assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in err.value.details()
  assert process.alive()


def test_weight_push_mid_generation_versions_and_logprobs(checkpoint):
  """In-flight update, stepped by hand: the engine JetStream drives, with the swap between two steps.

  Deterministic by construction (no push racing a stream): the swap lands before
  generate step 8, so token 8 still comes from logits of the old weights and token
  9 onward from the new ones, over a KV cache that the old weights wrote.
  """
  from copc_jax.rollout.engine import SamplingOptions
  from copc_jax.rollout.jetstream_adapter import CopcEngine, SampledPrompt

  old, _ = hf_io.from_pretrained(checkpoint, load_tokenizer=False)
  new = Decoder(old.config, rngs=nnx.Rngs(42))
  engine = CopcEngine(old, max_concurrent_decodes=2, max_prefill_length=16, max_length=128, version=0)
  store = engine.load_params()
  prompt = [1, 40, 41, 42]
  padded = np.zeros(16, np.int32)
  padded[:len(prompt)] = prompt
  options = SamplingOptions(seed=5)
  prefix = engine.prefill(params=store, padded_tokens=SampledPrompt(padded, options), true_length=len(prompt))
  state = engine.insert(prefix, engine.init_decode_state(), 1)
  tokens, logprobs, versions = [], [], []
  for step in range(24):
    if step == 8:
      store.update(engine.read_weights(hf_io.hf_tensors(new)), 1)
    state, result = engine.generate(store, state)
    token, _, _, logprob_bits, version = np.asarray(result.data)[1]
    tokens.append(int(token))
    logprobs.append(float(np.array(logprob_bits, np.int32).view(np.float32)))
    versions.append(int(version))
  switch = 9
  assert versions == [0] * switch + [1] * (len(tokens) - switch)
  sequence = prompt + tokens
  boundary = len(prompt) + switch - 1           # the logits of token[switch] came from the new weights
  cache = KVCache.create(old.config, batch=1, max_length=len(sequence))
  _, cache = old.decode(np.array([sequence[:boundary]]), np.arange(boundary)[None], cache)
  expected = []
  for position in range(boundary, len(sequence) - 1):
    logits, cache = new.decode(np.array([[sequence[position]]]), np.array([[position]]), cache)
    expected.append(float(jax.nn.log_softmax(logits[0, 0])[sequence[position + 1]]))
  np.testing.assert_allclose(logprobs[switch:], expected, atol=TOL)
  np.testing.assert_allclose(logprobs[:switch], teacher_forced(old, prompt, tokens)[:switch], atol=TOL)


def test_weight_pushes_between_requests_swap_without_recompiling(checkpoint, tmp_path):
  process = ServerProcess(checkpoint, slots=2, max_prefill_length=16, max_length=128, seed=1)
  process.wait_ready()
  client = process.client()
  try:
    old, _ = hf_io.from_pretrained(checkpoint, load_tokenizer=False)
    new = Decoder(old.config, rngs=nnx.Rngs(42))
    hf_io.save_pretrained(new, str(tmp_path / "v1"))
    prompt = [1, 40, 41, 42]
    client.generate(prompt, max_tokens=2)                  # compile prefill/insert/generate once
    compilations_before = client.status()["compilations"]
    assert compilations_before == {"prefill": 1, "insert": 1, "generate": 1, "prefill_slots": 0}
    calls = client.status()["engine_calls"]
    assert calls["prefill"] == calls["insert"] == 1 and calls["generate"] >= 1
    assert client.update_weights(str(tmp_path / "v1"), version=1) == 1
    fresh = client.generate(prompt, max_tokens=15, seed=11)
    assert set(fresh.versions) == {1}
    np.testing.assert_allclose(fresh.logprobs, teacher_forced(new, prompt, fresh.token_ids), atol=TOL)
    assert client.generate(prompt, max_tokens=15, seed=11) == fresh      # keyed by the request
    assert client.status()["compilations"] == compilations_before      # swapped in place
    payload = save_safetensors_bytes({k: np.asarray(v) for k, v in
                                      hf_io.read_safetensors(str(tmp_path / "v1")).items()})
    assert client.update_weights_bytes(payload, version=2) == 2
    assert set(client.generate(prompt, max_tokens=3).versions) == {2}
    with pytest.raises(grpc.RpcError, match="version must increase: got 1, serving 2"):
      client.update_weights(str(tmp_path / "v1"), version=1)
    assert client.update_weights(str(tmp_path / "v1"), version=2) == 2       # served already: a no-op
    assert client.update_weights(str(tmp_path / "v1"), version=0, reset=True) == 0   # a new run's first
    assert set(client.generate(prompt, max_tokens=3).versions) == {0}
    assert client.status()["compilations"] == compilations_before
  finally:
    client.close()
    process.stop()


def test_stop_sequences_end_the_generation(server):
  _, client = server
  every_token = [[t] for t in range(3, 110)]
  out = client.generate([1, 50, 51], max_tokens=30, stop_sequences=every_token)
  if out.token_ids[0] > 2:                      # not EOS/BOS/PAD: the first token is a stop sequence
    assert out.finish_reason == "stop_sequence" and len(out.token_ids) == 1
  pair = client.generate([1, 50, 51], max_tokens=30, temperature=0.01).token_ids[1:3]  # near-greedy
  out = client.generate([1, 50, 51], max_tokens=30, temperature=0.01, stop_sequences=[pair])
  assert out.finish_reason == "stop_sequence" and out.token_ids[-2:] == pair


class _AbortingContext:
  class Aborted(Exception):
    pass

  def __init__(self):
    self.code = None

  async def abort(self, code, details):
    self.code, self.details = code, details
    raise self.Aborted(details)


class _BrokenEngine:
  """An engine whose weight swap fails for the server's own reasons (not the request's)."""

  def read_weights(self, source):
    raise MemoryError("device out of memory")


def test_the_servers_own_failures_are_internal_not_the_clients():
  import asyncio

  from copc_jax.rollout.server import RolloutService

  service = RolloutService(driver=None, engine=_BrokenEngine())
  context = _AbortingContext()
  with pytest.raises(_AbortingContext.Aborted):
    asyncio.run(service._swap({}, 3, context, "UpdateWeights"))
  assert context.code == grpc.StatusCode.INTERNAL and "MemoryError" in context.details
  context = _AbortingContext()
  with pytest.raises(_AbortingContext.Aborted):
    asyncio.run(service.update_weights({"version": "three", "path": "x"}, context))
  assert context.code == grpc.StatusCode.INVALID_ARGUMENT


def test_a_seeded_request_gets_the_same_tokens_whatever_the_slot_and_traffic(server):
  from concurrent.futures import ThreadPoolExecutor

  _, client = server
  request = dict(token_ids=[1, 30, 31], max_tokens=24, temperature=0.7, top_p=0.9, top_k=20, seed=7)
  alone = client.generate(**request)
  with ThreadPoolExecutor(6) as executor:      # the same request among others, in whatever slot is free
    crowd = list(executor.map(lambda s: client.generate(**{**request, "seed": s}), [3, 7, 4, 7, 5, 7]))
  assert crowd[1] == crowd[3] == crowd[5] == alone
  assert crowd[0].token_ids != alone.token_ids or crowd[2].token_ids != alone.token_ids  # seeds matter


def test_servers_take_their_platform_from_the_environment_unless_pinned(monkeypatch):
  from copc_jax.rollout.process import server_environment

  monkeypatch.setenv("JAX_PLATFORMS", "tpu")
  monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
  inherited = server_environment("")
  assert inherited["JAX_PLATFORMS"] == "tpu" and inherited["XLA_FLAGS"].endswith("=8")
  pinned = server_environment("cpu")
  assert pinned["JAX_PLATFORMS"] == "cpu" and pinned["XLA_FLAGS"] == ""
  assert server_environment("cuda")["JAX_PLATFORMS"] == "cuda"


def engine_decode(engine, prompts, steps, seed=5):
  """Tokens and log-probs of `steps` decode steps for each prompt, one slot each (stepped by hand)."""
  from copc_jax.rollout.engine import SamplingOptions
  from copc_jax.rollout.jetstream_adapter import SampledPrompt

  store, state = engine.load_params(), engine.init_decode_state()
  for slot, prompt in enumerate(prompts):
    padded = np.zeros(16, np.int32)
    padded[:len(prompt)] = prompt
    options = SamplingOptions(seed=seed + slot)
    prefix = engine.prefill(params=store, padded_tokens=SampledPrompt(padded, options), true_length=len(prompt))
    state = engine.insert(prefix, state, slot)
  tokens, logprobs = [], []
  for _ in range(steps // engine.decode_steps):
    state, result = engine.generate(store, state)
    data = np.asarray(result.data)[:len(prompts)]
    for step in range(engine.decode_steps):                  # 5 columns per decode step
      tokens.append(data[:, 5 * step].tolist())
      logprobs.append(data[:, 5 * step + 3].astype(np.int32).view(np.float32).tolist())
  return np.array(tokens), np.array(logprobs), state


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (fake) devices")
@pytest.mark.parametrize("data_parallelism,tensor_parallelism", [(1, 2), (1, 8), (2, 4)])
def test_a_tensor_parallel_engine_decodes_like_one_device_and_swaps_in_place(checkpoint, data_parallelism,
                                                                             tensor_parallelism):
  """Split over `tensor` (and, with a `data` axis, the slots over data groups): the same tokens and
  log-probs as one device, and a weight push keeps every placement."""
  from copc_jax.rollout.engine import serving_mesh
  from copc_jax.rollout.jetstream_adapter import CopcEngine

  model, _ = hf_io.from_pretrained(checkpoint, load_tokenizer=False)
  prompts = [[1, 40, 41, 42], [1, 7, 8]]
  make = lambda mesh: CopcEngine(model, max_concurrent_decodes=2, max_prefill_length=16, max_length=64,
                                 mesh=mesh)
  single = make(None)
  sharded = make(serving_mesh(tensor_parallelism, data_parallelism=data_parallelism))
  kernel = sharded.store.get()[0]["model"]["layers"][0]["mlp"]["gate_proj"]["kernel"][...]
  assert kernel.sharding.spec == jax.sharding.PartitionSpec(None, "tensor")      # split over the mesh
  assert len(kernel.sharding.device_set) == tensor_parallelism * data_parallelism
  expected_tokens, expected_logprobs, _ = engine_decode(single, prompts, steps=20)
  tokens, logprobs, state = engine_decode(sharded, prompts, steps=20)
  prefix = sharded.prefill(params=sharded.load_params(), padded_tokens=np.ones(16, np.int32), true_length=3)
  state = sharded.insert(prefix, state, 0)              # into a state that came out of generate
  assert sharded.trace_counts == {"prefill": 1, "insert": 1, "generate": 1, "prefill_slots": 0}
  np.testing.assert_array_equal(tokens, expected_tokens)
  np.testing.assert_allclose(logprobs, expected_logprobs, atol=1e-5)
  kv_split = model.config.num_kv_heads % tensor_parallelism == 0
  spec = tuple(state.cache.keys.sharding.spec) + (None,) * 5
  assert spec[3] == ("tensor" if kv_split else None)
  assert spec[1] == ("data" if data_parallelism > 1 else None)         # slots over the data groups
  assert state.lengths.sharding.spec == jax.sharding.PartitionSpec("data" if data_parallelism > 1 else None)
  compiled = dict(sharded.trace_counts)
  new = Decoder(model.config, rngs=nnx.Rngs(42))
  sharded.store.update(sharded.read_weights(hf_io.hf_tensors(new)), 1)    # a weight push
  single.store.update(single.read_weights(hf_io.hf_tensors(new)), 1)
  swapped = sharded.store.get()[0]["model"]["layers"][0]["mlp"]["gate_proj"]["kernel"][...]
  assert swapped.sharding == kernel.sharding
  tokens, logprobs, _ = engine_decode(sharded, prompts, steps=10)
  expected_tokens, expected_logprobs, _ = engine_decode(single, prompts, steps=10)
  np.testing.assert_array_equal(tokens, expected_tokens)
  np.testing.assert_allclose(logprobs, expected_logprobs, atol=1e-5)
  assert sharded.trace_counts == compiled                              # no recompilation


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (fake) devices")
def test_a_server_process_serves_over_all_devices_of_its_platform(checkpoint):
  """platform "" keeps this environment (8 fake CPU devices): the server splits the model over all
  of them and its log-probs are the learner's."""
  process = ServerProcess(checkpoint, slots=2, max_prefill_length=16, max_length=64, platform="")
  process.wait_ready()
  client = process.client()
  try:
    assert client.status()["mesh"] == {"data": 1, "fsdp": 1, "tensor": 8}
    out = client.generate([1, 40, 41], max_tokens=12, seed=3)
    model, _ = hf_io.from_pretrained(checkpoint, load_tokenizer=False)
    np.testing.assert_allclose(out.logprobs, teacher_forced(model, [1, 40, 41], out.token_ids), atol=TOL)
  finally:
    client.close()
    process.stop()


@pytest.mark.parametrize("decode_steps", [3, 4])
def test_several_decode_steps_per_call_give_the_same_tokens(checkpoint, decode_steps):
  """`decode_steps` tokens per engine call (a scan on the device) change nothing in what is sampled."""
  from copc_jax.rollout.jetstream_adapter import CopcEngine

  model, _ = hf_io.from_pretrained(checkpoint, load_tokenizer=False)
  make = lambda k: CopcEngine(model, max_concurrent_decodes=2, max_prefill_length=16, max_length=64,
                              decode_steps=k)
  prompts = [[1, 40, 41, 42], [1, 7, 8]]
  expected_tokens, expected_logprobs, _ = engine_decode(make(1), prompts, steps=12)
  engine = make(decode_steps)
  tokens, logprobs, _ = engine_decode(engine, prompts, steps=12)
  np.testing.assert_array_equal(tokens, expected_tokens)
  np.testing.assert_allclose(logprobs, expected_logprobs, atol=1e-5)
  assert engine.trace_counts["generate"] == 1


def test_a_server_decoding_several_steps_per_call_stops_exactly(checkpoint, server):
  """Through JetStream's loop with 4 tokens per call: the same seeded tokens as one per call, a stop
  sequence or max_tokens that falls inside a call ends the generation exactly there."""
  _, single = server
  process = ServerProcess(checkpoint, slots=4, max_prefill_length=32, max_length=96, decode_steps=4)
  process.wait_ready()
  client = process.client()
  try:
    request = dict(token_ids=[1, 30, 31], max_tokens=11, temperature=1.0, seed=9)
    expected = single.generate(**request)
    out = client.generate(**request)
    assert out.token_ids == expected.token_ids and out.finish_reason == expected.finish_reason
    assert out.logprobs == pytest.approx(expected.logprobs, abs=1e-5) and len(out.token_ids) <= 11
    if out.finish_reason == "length":
      assert len(out.token_ids) == 11
    long = client.generate(**{**request, "max_tokens": 40})
    stop = [long.token_ids[5]]                                   # a stop inside the second call
    cut = client.generate(**{**request, "max_tokens": 40, "stop_sequences": [stop]})
    first = long.token_ids.index(stop[0])
    assert cut.token_ids == long.token_ids[:first + 1] and cut.finish_reason == "stop_sequence"
  finally:
    client.close()
    process.stop()


def test_a_bfloat16_engine_keeps_a_bfloat16_cache_and_records_its_own_logprobs(checkpoint):
  """`serve --dtype=bfloat16`: weights, compute and KV cache in bf16 (half the cache), and the behaviour
  log-probs it records are those of its bf16 model, recomputed teacher-forced within 0.05 (a full pass
  and incremental decoding round differently in bf16)."""
  import jax.numpy as jnp

  from copc_jax.rollout.jetstream_adapter import CopcEngine

  model, _ = hf_io.from_pretrained(checkpoint, load_tokenizer=False, dtype=jnp.bfloat16)
  engine = CopcEngine(model, max_concurrent_decodes=2, max_prefill_length=16, max_length=64)
  prompts = [[1, 40, 41, 42], [1, 7, 8]]
  tokens, logprobs, state = engine_decode(engine, prompts, steps=8)
  assert state.cache.keys.dtype == jnp.bfloat16 and state.cache.values.dtype == jnp.bfloat16
  for row, prompt in enumerate(prompts):
    np.testing.assert_allclose(logprobs[:, row], teacher_forced(model, prompt, tokens[:, row]), atol=0.05)
