"""Synchronous client of one copc_jax rollout server (the `copc.Rollout` gRPC service)."""

from __future__ import annotations

import json

from copc_jax.rollout import auth
from copc_jax.rollout.protocol import MAX_MESSAGE_BYTES, SERVICE, Generation

CHUNK_BYTES = 4 << 20


def collect(messages) -> Generation:
  """One generation from a stream of per-step messages."""
  result = Generation([], [], [], None)
  for step in messages:
    result.token_ids += step["token_ids"]
    result.logprobs += step["logprobs"]
    result.versions += step["versions"]
    result.finish_reason = step["finish_reason"] or result.finish_reason
  return result


class RolloutClient:
  def __init__(self, address: str, timeout_s: float = 300.0, *, token: str | None = None,
               tls_root_certificates: str = ""):
    """`token`: sent on every call (None: $COPC_AUTH_TOKEN, if set); `tls_root_certificates`: the
    servers' CA (PEM file) for TLS."""
    self.address = address
    self.timeout_s = timeout_s
    self._channel = auth.client_channel(
        address, token if token is not None else auth.resolve_token(),
        tls_root_certificates=tls_root_certificates,
        options=[("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                 ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)])
    encode, decode = (lambda m: json.dumps(m).encode()), (lambda b: json.loads(b.decode()))
    self._generate = self._channel.unary_stream(f"/{SERVICE}/Generate", encode, decode)
    self._update = self._channel.unary_unary(f"/{SERVICE}/UpdateWeights", encode, decode)
    self._update_bytes = self._channel.stream_unary(f"/{SERVICE}/UpdateWeightsBytes", lambda b: b, decode)
    self._status = self._channel.unary_unary(f"/{SERVICE}/Status", encode, decode)

  def start(self, token_ids, max_tokens: int, *, temperature=1.0, top_p=1.0, top_k=0, stop_sequences=(),
            seed: int | None = None):
    """Start a generation: the gRPC call, an iterator of the server's per-step messages
    {token_ids, logprobs, versions, finish_reason} that another thread may `cancel()`.

    With a `seed`, the tokens depend only on the request and the weights (not on
    the server, its slot or other requests).
    """
    request = {"token_ids": [int(t) for t in token_ids], "max_tokens": max_tokens,
               "temperature": temperature, "top_p": top_p, "top_k": top_k,
               "stop_sequences": [[int(t) for t in s] for s in stop_sequences]}
    if seed is not None:
      request["seed"] = int(seed)
    return self._generate(request, timeout=self.timeout_s)

  def stream(self, token_ids, max_tokens: int, **sampling):
    """Yield the server's per-step messages (see `start`)."""
    yield from self.start(token_ids, max_tokens, **sampling)

  def generate(self, token_ids, max_tokens: int, **sampling) -> Generation:
    return collect(self.stream(token_ids, max_tokens, **sampling))

  def update_weights(self, path: str, version: int, reset: bool = False, timeout_s: float | None = None) -> int:
    """Serve `path` as `version`; `reset` starts a new sequence of versions (a new run); a server that
    has not answered within `timeout_s` (default: the client's) ends the call with DEADLINE_EXCEEDED."""
    body = {"path": path, "version": version, **({"reset": True} if reset else {})}
    return self._update(body, timeout=timeout_s or self.timeout_s)["version"]

  def update_weights_bytes(self, payload: bytes, version: int, reset: bool = False,
                           timeout_s: float | None = None) -> int:
    """Stream one safetensors file's bytes (in `CHUNK_BYTES` messages) as `version`."""
    chunks = (payload[i:i + CHUNK_BYTES] for i in range(0, max(len(payload), 1), CHUNK_BYTES))
    return self._stream_update(chunks, version, reset, timeout_s)

  def update_weights_file(self, path: str, version: int, reset: bool = False,
                          timeout_s: float | None = None) -> int:
    """Stream a safetensors file from this machine's disk as `version`, read chunk by chunk: the
    server needs no access to the path (no shared filesystem)."""
    def chunks():
      with open(path, "rb") as f:
        while chunk := f.read(CHUNK_BYTES):
          yield chunk
    return self._stream_update(chunks(), version, reset, timeout_s)

  def _stream_update(self, chunks, version: int, reset: bool, timeout_s: float | None) -> int:
    metadata = [("copc-version", str(version))] + ([("copc-reset", "1")] if reset else [])
    return self._update_bytes(chunks, metadata=metadata, timeout=timeout_s or self.timeout_s)["version"]

  def status(self, timeout_s: float | None = None) -> dict:
    return self._status({}, timeout=timeout_s or self.timeout_s)

  def close(self):
    self._channel.close()
