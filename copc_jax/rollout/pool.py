"""A pool of rollout servers: least-loaded routing, weight pushes, restart on failure.

    with RolloutPool(checkpoint=DIR, num_servers=2) as pool:
      out = pool.generate(prompt_ids, max_tokens=64, temperature=1.0)
      pool.push(WeightUpdate(1, path))

Each server takes at most `max_in_flight` requests at a time (JetStream's own
prefill queue is unbounded). A request whose server dies is resubmitted from the
start on a healthy server after the dead one is restarted (local servers only),
so every request returns exactly one complete generation. A server that stops answering
(paused, wedged) is found by the `HangDetector` within `stall_timeout_s + probe_timeout_s`:
its requests are cancelled and resubmitted elsewhere, and it takes no requests until it answers
again (then it first gets the latest weights). Servers given by `addresses` (e.g. on TPU VMs, or
kept alive across the runs of a study) are used as they are and never restarted; a pool's first push
to a server starts a new sequence of versions there (versions increase within a run, and a new run
starts at its own).
"""

from __future__ import annotations

import atexit
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc

from copc_jax.models.hf_io import SAFETENSORS_SINGLE
from copc_jax.rollout import auth
from copc_jax.rollout.client import RolloutClient, collect
from copc_jax.rollout.health import HangDetector
from copc_jax.rollout.process import ServerProcess
from copc_jax.rollout.protocol import Generation, ServerStatus, WeightUpdate

RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN,
             grpc.StatusCode.INTERNAL, grpc.StatusCode.DEADLINE_EXCEEDED}

SERVED_KINDS = ("path", "stream", "bytes")     # the `WeightUpdate` kinds a server process can take


class PoolExhausted(RuntimeError):
  """No server could complete a request after every retry."""


class WeightPushError(RuntimeError):
  """A server refused a weight version (it could not read it, or it does not fit its model)."""


class _Server:
  def __init__(self, address: str | None, process: ServerProcess | None, token: str | None = None,
               tls_root_certificates: str = ""):
    self.process, self.address = process, address
    self.client = None
    if address:
      self.client = process.client() if process else RolloutClient(
          address, token=token, tls_root_certificates=tls_root_certificates)
    self.in_flight = 0
    self.healthy = address is not None
    self.hung = False
    self.restarts = 0
    self.hangs = 0
    self.pushed = False          # has taken a push from this pool (before: its versions are another run's)
    self.lock = threading.Lock()

  def push(self, update: WeightUpdate, timeout_s: float | None = None) -> None:
    """Send `update` (its first from this pool resets the server's versions); abandoned after `timeout_s`."""
    reset = update.reset or not self.pushed
    if update.kind == "bytes":
      self.client.update_weights_bytes(update.payload, update.version, reset=reset, timeout_s=timeout_s)
    elif update.kind == "stream":
      self.client.update_weights_file(os.path.join(update.payload, SAFETENSORS_SINGLE), update.version,
                                      reset=reset, timeout_s=timeout_s)
    else:
      self.client.update_weights(update.payload, update.version, reset=reset, timeout_s=timeout_s)
    self.pushed = True


class RolloutPool:
  def __init__(self, checkpoint: str | None = None, *, num_servers: int = 2,
               addresses: list[str] | None = None, max_in_flight: int = 4, max_retries: int = 5,
               ready_timeout_s: float = 120.0, log_dir: str | None = None, stall_timeout_s: float = 10.0,
               probe_timeout_s: float = 5.0, lost_timeout_s: float = 120.0,
               token: str | None = None, tls_root_certificates: str = "", push_timeout_s: float = 300.0,
               **server_kwargs):
    """`token`: the remote servers' shared token (None: $COPC_AUTH_TOKEN, if set); local servers get
    one of their own (`ServerProcess`). `tls_root_certificates`: the remote servers' CA (PEM file).
    `push_timeout_s`: a weight push a server has not completed by then is abandoned, the server taken
    out of routing as hung, and the newest weights pushed again when it answers."""
    self.push_timeout_s = push_timeout_s
    if (checkpoint is None) == (addresses is None):
      raise ValueError("give either checkpoint (start local servers) or addresses (remote servers)")
    self._checkpoint, self._server_kwargs, self._log_dir = checkpoint, server_kwargs, log_dir
    self.max_in_flight, self.max_retries = max_in_flight, max_retries
    self.ready_timeout_s = ready_timeout_s
    self._cond = threading.Condition()
    self._latest_weights: WeightUpdate | None = None     # for servers that missed it
    self._closed = False
    # Local servers share one fresh token: another pool given it (`token=pool.token`) may call them.
    self.token = token if addresses is not None else auth.new_token()
    self._server_kwargs = {**server_kwargs, **({"token": self.token} if addresses is None else {})}
    if addresses is not None:
      self.servers = [_Server(a, None, token, tls_root_certificates) for a in addresses]
    else:
      processes = [ServerProcess(checkpoint, seed=i, log_path=self._log_path(i), **self._server_kwargs)
                   for i in range(num_servers)]
      self.servers = []
      try:
        for process in processes:
          self.servers.append(_Server(process.wait_ready(ready_timeout_s), process))
      except BaseException:
        for process in processes:
          process.stop()
        raise
    self._detector = HangDetector(self._on_hung, stall_timeout_s=stall_timeout_s,
                                  probe_timeout_s=probe_timeout_s, lost_timeout_s=lost_timeout_s)
    atexit.register(self.close)

  def _log_path(self, index: int) -> str | None:
    if self._log_dir is None:
      return None
    os.makedirs(self._log_dir, exist_ok=True)
    return os.path.join(self._log_dir, f"server_{index}.log")

  # --- routing ----------------------------------------------------------------

  def _acquire(self) -> _Server:
    with self._cond:
      while True:
        if self._closed:
          raise RuntimeError("the pool is closed")
        candidates = [s for s in self.servers if s.healthy and s.in_flight < self.max_in_flight]
        if candidates:
          server = min(candidates, key=lambda s: s.in_flight)
          server.in_flight += 1
          return server
        if not any(s.healthy for s in self.servers) and not any(s.process for s in self.servers):
          raise PoolExhausted("every remote rollout server is unreachable")
        self._cond.wait(timeout=1.0)

  def _release(self, server: _Server) -> None:
    with self._cond:
      server.in_flight -= 1
      self._cond.notify_all()

  def _handle_failure(self, server: _Server) -> None:
    """Mark the server down; restart it if it is ours and its process died."""
    with server.lock:
      if server.process is None:
        server.healthy = False
        return
      if server.process.alive():
        return       # a transient error: the server is still there
      server.healthy = False
      old = server.process
      old.stop()
      seed = len(self.servers) + server.restarts
      server.process = ServerProcess(self._checkpoint, seed=seed, log_path=self._log_path(seed),
                                     **self._server_kwargs)
      server.address = server.process.wait_ready(self.ready_timeout_s)
      server.client = server.process.client()
      server.restarts += 1
      server.pushed = False
      if self._latest_weights is not None:
        server.push(self._latest_weights, self.push_timeout_s)
      server.healthy = True
    with self._cond:
      self._cond.notify_all()

  def _on_hung(self, server: _Server) -> None:
    """Out of routing until it answers Status again (checked in a thread of its own)."""
    if server.process is not None and not server.process.alive():
      return                            # dead, not hung: the caller's failure path restarts it
    with self._cond:
      if server.hung:
        return
      server.hung, server.healthy = True, False
      server.hangs += 1
    threading.Thread(target=self._await_recovery, args=(server,), daemon=True).start()

  def _await_recovery(self, server: _Server) -> None:
    while not self._closed:
      if server.process is not None and not server.process.alive():
        server.hung = False
        try:
          self._handle_failure(server)      # it died while hung: a restart, as for any dead server
        except (RuntimeError, TimeoutError):
          if not self._closed:
            raise
        return
      if self._detector.responds(server):
        try:
          if self._latest_weights is not None:
            server.push(self._latest_weights, self.push_timeout_s)
        except grpc.RpcError:
          continue
        with self._cond:
          server.hung, server.healthy = False, True
          self._cond.notify_all()
        return
      time.sleep(self._detector.interval_s)

  # --- public API -------------------------------------------------------------

  def generate(self, token_ids, max_tokens: int, **sampling) -> Generation:
    last_error = None
    for attempt in range(self.max_retries + 1):
      if attempt:
        time.sleep(min(0.25 * 2 ** (attempt - 1), 4.0))   # a busy or restarting server gets a moment
      server = self._acquire()
      try:
        with self._detector.watch(server, server.client.start(token_ids, max_tokens, **sampling)) as messages:
          return collect(messages)
      except grpc.RpcError as err:
        if err.code() not in RETRYABLE:
          raise
        last_error = err
      finally:
        self._release(server)
      self._handle_failure(server)
    raise PoolExhausted(f"request failed {self.max_retries + 1} times; last error: {last_error}")

  def generate_many(self, requests: list[dict], max_workers: int | None = None) -> list[Generation]:
    """Run `generate(**request)` for every request concurrently; results in request order."""
    workers = max_workers or self.max_in_flight * len(self.servers)
    with ThreadPoolExecutor(workers) as executor:
      return list(executor.map(lambda r: self.generate(**r), requests))

  def push(self, update: WeightUpdate) -> None:
    """Push `update` to every server (servers restarted or recovered later get it too)."""
    if update.kind not in SERVED_KINDS:
      raise ValueError(f"a server process takes weights as one of {SERVED_KINDS}; got {update.kind!r} "
                       f"(arrays in memory are for the in-process backend)")
    self._latest_weights = update
    version = update.version

    def push(server: _Server) -> None:
      if server.process is not None and not server.process.alive():
        self._handle_failure(server)    # dead: restarted now, with these weights
        return
      if not server.healthy:
        return                          # paused (or an unreachable remote): it gets them when it answers
      if not self._detector.responds(server):
        self._on_hung(server)       # it gets these weights when it answers again
        return
      try:
        server.push(update, self.push_timeout_s)
      except grpc.RpcError as err:
        alive = server.process is None or server.process.alive()
        if err.code() == grpc.StatusCode.DEADLINE_EXCEEDED and alive:
          self._on_hung(server)         # stopped answering mid-push: re-pushed when it answers again
          return
        if err.code() not in RETRYABLE:
          hint = (" A server that does not share this machine's filesystem needs weight_transfer='stream' "
                  "(config.rollout.weight_transfer)." if update.kind == "path" else "")
          raise WeightPushError(f"rollout server {server.address} refused weights version {version} "
                                f"({update.describe()}): {err.details()}.{hint}") from err
        self._handle_failure(server)    # a restarted local server gets these weights as it starts

    with ThreadPoolExecutor(len(self.servers)) as executor:
      list(executor.map(push, self.servers))
    if not any(s.healthy for s in self.servers):
      raise PoolExhausted(f"no rollout server took weights version {version}: every one is unreachable")

  def status(self) -> list[ServerStatus]:
    return [ServerStatus(address=s.address, healthy=s.healthy, hung=s.hung, in_flight=s.in_flight,
                         restarts=s.restarts, hangs=s.hangs, report=s.client.status() if s.healthy else {})
            for s in self.servers]

  def close(self) -> None:
    with self._cond:
      if self._closed:
        return
      self._closed = True
      self._cond.notify_all()
    self._detector.close()
    for server in self.servers:
      if server.client is not None:
        server.client.close()
      if server.process is not None:
        server.process.stop()

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()


def wait_until(predicate, timeout_s: float, interval_s: float = 0.05) -> bool:
  deadline = time.monotonic() + timeout_s
  while time.monotonic() < deadline:
    if predicate():
      return True
    time.sleep(interval_s)
  return predicate()
