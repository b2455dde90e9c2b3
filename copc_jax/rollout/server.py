"""A JetStream server for copc_jax: the stock Orchestrator service plus the RL service.

    python -m copc_jax.rollout.serve --checkpoint=DIR --port=PORT

Services on one gRPC server bound to 127.0.0.1 by default:

- `jetstream_proto.Orchestrator` (`Decode`, `HealthCheck`): JetStream's own, unchanged
  except that requests are validated first.
- `copc.Rollout` (JSON messages, no protoc needed):
    Generate(stream):  {token_ids, max_tokens, temperature, top_p, top_k, stop_sequences, seed}
                       → stream of {token_ids, logprobs, versions, finish_reason} (a message holds
                         every decode step waiting when it was sent: one or more tokens)
                       (with a seed, the tokens depend only on the request and the weights)
    UpdateWeights:     {path, version, reset?} → {version}   (a save_pretrained directory)
    UpdateWeightsBytes(client stream of safetensors bytes; metadata copc-version, copc-reset?) → {version}
    Status:            {} → {version, max_prefill_length, max_length, model (its config), slots_in_use,
                         compilations, engine_calls, compile_s, memory, ...}

Every request is checked before it reaches JetStream's threads, whose exceptions
would kill the process: bad requests get INVALID_ARGUMENT with what was wrong;
the server's own failures on a valid request get INTERNAL.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json

import grpc
import jax
import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load as load_safetensors_bytes

from copc_jax.models import hf_io
from copc_jax.rollout import auth, requests
from copc_jax.rollout.channel import BatchingChannel
from copc_jax.rollout.engine import SamplingOptions
from copc_jax.rollout.jetstream_adapter import (
  CopcDriver,
  CopcEngine,
  RLActiveRequest,
  ValidatingOrchestrator,
  jetstream_pb2_grpc,
  limits_of,
)
from copc_jax.rollout.protocol import MAX_MESSAGE_BYTES, SERVICE
from copc_jax.sampling import SamplingParams

_to_json = lambda obj: json.dumps(obj).encode()
_raw = lambda data: data


class RolloutService:
  """The copc_jax RL service: generation with log-probs and versions, weight updates, status."""

  def __init__(self, driver, engine: CopcEngine):
    self._driver, self._engine = driver, engine
    self._update_lock = asyncio.Lock()
    self._swaps = {"UpdateWeights": 0, "UpdateWeightsBytes": 0}     # weight versions taken, by method

  async def generate(self, request, context):
    try:
      parsed = requests.generate_request(request, limits_of(self._engine))
    except requests.RequestError as err:
      await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
    token_ids, max_tokens = parsed.token_ids, parsed.max_tokens
    sampling = SamplingOptions(
        params=SamplingParams(temperature=parsed.temperature, top_p=parsed.top_p, top_k=parsed.top_k),
        stop_sequences=parsed.stop_sequences, seed=parsed.seed)
    channel = BatchingChannel()
    active = RLActiveRequest(
        max_tokens=max_tokens, return_channel=channel,
        prefill_content=np.asarray(token_ids, np.int32), is_client_side_tokenization=True,
        history_path="rl", sampling=sampling)   # a history path tells 0.2.2 not to add BOS
    try:
      self._driver.place_request_on_prefill_queue(active)
      async for steps in channel.batches():     # every decode step waiting: one message
        samples = [samples[0] for samples in steps]
        message = {"token_ids": [t for s in samples for t in s.token_ids],
                   "logprobs": [p for s in samples for p in s.logprobs],
                   "versions": [v for s in samples for v in s.versions],
                   "finish_reason": next((s.finish_reason for s in samples if s.finish_reason), None)}
        if message["token_ids"] or message["finish_reason"]:
          yield message
    except Exception as err:  # noqa: BLE001 - a valid request that the server failed to serve
      await context.abort(grpc.StatusCode.INTERNAL, f"Generate: the server failed: {type(err).__name__}: {err}")

  async def update_weights(self, request, context):
    try:
      path, version, reset = requests.update_weights_request(request)
      if self.weights_roots is not None:
        path = auth.check_weights_path(path, self.weights_roots)
      if version == self._engine.store.version and not reset:
        return {"version": version}          # served already (a catch-up push after a pause): a no-op
      await asyncio.to_thread(hf_io.tensor_files, path)     # a directory with readable safetensors
    except Exception as err:  # noqa: BLE001 - the path and the files in it are the client's
      await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"UpdateWeights: {err}")
    return await self._swap(path, version, context, "UpdateWeights", reset)

  async def update_weights_bytes(self, request_iterator, context):
    try:
      metadata = dict(context.invocation_metadata())
      version = requests.integer(int(metadata["copc-version"]), "copc-version", 0, 2**62)
      reset = metadata.get("copc-reset", "0") == "1"
      payload = b"".join([chunk async for chunk in request_iterator])
      tensors = await asyncio.to_thread(load_safetensors_bytes, payload)
    except Exception as err:  # noqa: BLE001 - the metadata and bytes are the client's
      await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"UpdateWeightsBytes: {err}")
    return await self._swap(tensors, version, context, "UpdateWeightsBytes", reset)

  async def _swap(self, source, version: int, context, method: str, reset: bool = False):
    """Serve the weights of `source` (a checkpoint directory, or tensors in memory) as `version`: weights
    that do not fit the model or files that cannot be read are the client's error (INVALID_ARGUMENT),
    anything else failing is the server's own (INTERNAL)."""
    def read_and_swap():
      weights = self._engine.read_weights(source)
      self._engine.store.update(weights, version, reset)
    try:
      async with self._update_lock:
        await asyncio.to_thread(read_and_swap)
    except (KeyError, ValueError, TypeError, OSError, SafetensorError) as err:
      await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{method}: {err}")
    except Exception as err:  # noqa: BLE001 - reported to the client as the server's failure
      await context.abort(grpc.StatusCode.INTERNAL, f"{method}: the server failed: {type(err).__name__}: {err}")
    self._swaps[method] += 1
    return {"version": self._engine.store.version}

  async def status(self, request, context):
    engine = self._engine
    return {"version": engine.store.version, "max_concurrent_decodes": engine.max_concurrent_decodes,
            **self._driver.occupancy(), "max_prefill_length": engine.max_prefill_length,
            "max_length": engine.max_length,
            "compilations": dict(engine.trace_counts), "engine_calls": dict(engine.calls),
            "decode_steps": engine.decode_steps, "weight_swaps": dict(self._swaps),
            "mesh": {name: int(size) for name, size in engine.mesh.shape.items()},
            "compile_s": {name: round(s, 3) for name, s in engine.compile_s.items()}, "memory": memory(),
            "model": json.loads(json.dumps(dataclasses.asdict(engine.config)))}

  def handler(self) -> grpc.GenericRpcHandler:
    return grpc.method_handlers_generic_handler(SERVICE, {
        "Generate": grpc.unary_stream_rpc_method_handler(
            self.generate, request_deserializer=requests.parse_json, response_serializer=_to_json),
        "UpdateWeights": grpc.unary_unary_rpc_method_handler(
            self.update_weights, request_deserializer=requests.parse_json, response_serializer=_to_json),
        "UpdateWeightsBytes": grpc.stream_unary_rpc_method_handler(
            self.update_weights_bytes, request_deserializer=_raw, response_serializer=_to_json),
        "Status": grpc.unary_unary_rpc_method_handler(
            self.status, request_deserializer=requests.parse_json, response_serializer=_to_json),
    })


def memory() -> dict:
  """This process's resident memory now and at peak (Linux /proc), and each device's bytes in use
  where JAX reports them (accelerators; the CPU backend does not)."""
  fields = {}
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith(("VmRSS:", "VmHWM:")):
        fields[line.split(":")[0]] = int(line.split()[1]) * 1024
  devices = {str(d): (d.memory_stats() or {}).get("bytes_in_use") for d in jax.local_devices()}
  return {"resident_bytes": fields.get("VmRSS"), "peak_resident_bytes": fields.get("VmHWM"),
          "device_bytes_in_use": {k: v for k, v in devices.items() if v is not None}}


async def serve(engine: CopcEngine, port: int, host: str = "127.0.0.1", ready_file: str | None = None,
                calls_ahead: int = 2, token: str | None = None, weights_roots: tuple[str, ...] | None = None,
                credentials: grpc.ServerCredentials | None = None):
  """Run the server until cancelled; returns the bound port through `ready_file` if given.

  `token`: every RPC must carry it (`auth`); required off the loopback interface. `weights_roots`:
  the directories `UpdateWeights` may read from (None: any the process can read, loopback only).
  `credentials`: TLS (`auth.server_credentials`)."""
  auth.check_bind(host, token)
  if weights_roots is None and not auth.is_loopback(host):
    raise ValueError(f"--host={host} is reachable from the network: give --weights_root, the directories "
                     f"weight pushes by path may be read from")
  store = engine.load_params()
  driver = CopcDriver(prefill_engines=[engine], generate_engines=[engine], prefill_params=[store],
                      generate_params=[store], interleaved_mode=True, calls_ahead=calls_ahead)
  server = grpc.aio.server(options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                                    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)],
                           interceptors=auth.server_interceptors(token))
  jetstream_pb2_grpc.add_OrchestratorServicer_to_server(ValidatingOrchestrator(driver, engine), server)
  service = RolloutService(driver, engine)
  service.weights_roots = weights_roots
  server.add_generic_rpc_handlers([service.handler()])
  address = f"{host}:{port}"
  bound = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
  await server.start()
  if ready_file:
    with open(ready_file, "w") as f:
      f.write(str(bound))
  try:
    await server.wait_for_termination()
  finally:
    await server.stop(grace=1)
    driver.stop()
