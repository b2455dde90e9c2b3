"""Who may call a rollout server: a shared token on every RPC, a root for weight paths, TLS as an option.

    token = auth.resolve_token(token_file)           # --auth_token_file, else $COPC_AUTH_TOKEN, else None
    auth.check_bind(host, token)                     # off the loopback interface a token is required
    server = grpc.aio.server(interceptors=auth.server_interceptors(token))
    channel = auth.client_channel(address, token, options)          # sends "authorization: Bearer <token>"

A server with a token answers a call without it, or with another, `UNAUTHENTICATED` before the call's
handler runs: nothing it serves changes. Local servers (`ServerProcess`) get a fresh random token each,
handed over in the environment (not on the command line, where `ps` shows it). `check_weights_path`
confines `UpdateWeights` paths to the server's `--weights_root` directories, symlinks resolved.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
import secrets
import socket

import grpc

ENV_VAR = "COPC_AUTH_TOKEN"
HEADER = "authorization"


def new_token() -> str:
  return secrets.token_urlsafe(32)


def resolve_token(token_file: str = "") -> str | None:
  """The token in `token_file` (stripped), else $COPC_AUTH_TOKEN, else None."""
  if token_file:
    with open(token_file) as f:
      token = f.read().strip()
    if not token:
      raise ValueError(f"--auth_token_file={token_file} is empty; write the shared token into it")
    return token
  return os.environ.get(ENV_VAR) or None


def is_loopback(host: str) -> bool:
  if host in ("localhost", ""):
    return host == "localhost"
  try:
    return ipaddress.ip_address(host).is_loopback
  except ValueError:
    try:
      return all(ipaddress.ip_address(info[4][0]).is_loopback for info in socket.getaddrinfo(host, None))
    except OSError:
      return False


def check_bind(host: str, token: str | None) -> None:
  """Serving beyond this machine needs a token: anyone who can reach the port could replace the model."""
  if not is_loopback(host) and not token:
    raise ValueError(f"--host={host} is reachable from the network: give a shared token (--auth_token_file "
                     f"or ${ENV_VAR}) so that only the learner can call this server, or bind 127.0.0.1")


def _authorized(metadata, token: str) -> bool:
  sent = dict(metadata or ()).get(HEADER, "")
  return hmac.compare_digest(sent.encode(), f"Bearer {token}".encode())


class TokenInterceptor(grpc.aio.ServerInterceptor):
  """Every RPC must carry `authorization: Bearer <token>`; others end `UNAUTHENTICATED` unhandled."""

  def __init__(self, token: str):
    self._token = token

  async def intercept_service(self, continuation, handler_call_details):
    handler = await continuation(handler_call_details)
    if handler is None or _authorized(handler_call_details.invocation_metadata, self._token):
      return handler

    async def deny(request, context):
      await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                          f"{handler_call_details.method}: missing or wrong token (authorization: Bearer ...)")

    kind = next(k for k in ("unary_unary", "unary_stream", "stream_unary", "stream_stream")
                if getattr(handler, k) is not None)
    make = getattr(grpc, f"{kind}_rpc_method_handler")
    return make(deny, request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)


def server_interceptors(token: str | None) -> list:
  return [TokenInterceptor(token)] if token else []


def server_credentials(cert_file: str, key_file: str) -> grpc.ServerCredentials:
  """TLS with this certificate chain and key (PEM files): gRPC's own credentials."""
  with open(key_file, "rb") as key, open(cert_file, "rb") as cert:
    return grpc.ssl_server_credentials([(key.read(), cert.read())])


class _TokenHeader(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                   grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
  """Adds the token to every call of a channel."""

  def __init__(self, token: str):
    self._header = (HEADER, f"Bearer {token}")

  def _with_token(self, details):
    metadata = list(details.metadata or ()) + [self._header]
    return details._replace(metadata=metadata) if hasattr(details, "_replace") else _Details(details, metadata)

  def intercept_unary_unary(self, continuation, details, request):
    return continuation(self._with_token(details), request)

  def intercept_unary_stream(self, continuation, details, request):
    return continuation(self._with_token(details), request)

  def intercept_stream_unary(self, continuation, details, request_iterator):
    return continuation(self._with_token(details), request_iterator)

  def intercept_stream_stream(self, continuation, details, request_iterator):
    return continuation(self._with_token(details), request_iterator)


class _Details(grpc.ClientCallDetails):
  def __init__(self, details, metadata):
    self.method, self.timeout, self.credentials = details.method, details.timeout, details.credentials
    self.wait_for_ready, self.compression = details.wait_for_ready, details.compression
    self.metadata = metadata


def client_channel(address: str, token: str | None, options=(), tls_root_certificates: str = ""):
  """A channel to `address` that sends `token` on every call; TLS when given the server's CA (PEM file)."""
  if tls_root_certificates:
    with open(tls_root_certificates, "rb") as f:
      channel = grpc.secure_channel(address, grpc.ssl_channel_credentials(f.read()), options=list(options))
  else:
    channel = grpc.insecure_channel(address, options=list(options))
  return grpc.intercept_channel(channel, _TokenHeader(token)) if token else channel


def check_weights_path(path: str, roots: tuple[str, ...]) -> str:
  """`path` with symlinks resolved, if it lies inside one of `roots` (resolved too); else ValueError."""
  real = os.path.realpath(path)
  for root in roots:
    real_root = os.path.realpath(root)
    if os.path.commonpath([real, real_root]) == real_root:
      return real
  raise ValueError(f"path {path!r} (resolved: {real!r}) is outside the server's --weights_root "
                   f"{list(roots)}; weights are read only from there")
