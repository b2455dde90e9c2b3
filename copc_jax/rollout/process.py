"""Rollout servers as subprocesses on the loopback interface."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time

from copc_jax.rollout import auth
from copc_jax.rollout.client import RolloutClient


def server_environment(platform: str) -> dict:
  """The server's environment: `platform` pins JAX to it ("cpu": no XLA flags of the parent, such as
  fake devices, either); "" keeps the parent's JAX_PLATFORMS (a TPU VM's chips, a GPU)."""
  env = dict(os.environ)
  if platform:
    env["JAX_PLATFORMS"] = platform
  if platform == "cpu":
    env["XLA_FLAGS"] = ""
  return env


class ServerProcess:
  """One `python -m copc_jax.rollout.serve` subprocess; `address` once ready. It gets a fresh random
  `token` (in its environment), which `client()` sends: nothing else on this machine can call it."""

  def __init__(self, checkpoint: str, *, slots: int = 4, max_prefill_length: int = 64,
               max_length: int = 256, seed: int = 0, version: int = 0, log_path: str | None = None,
               platform: str = "cpu", tensor_parallelism: int = -1, data_parallelism: int = 1,
               decode_steps: int = 1, dtype: str = "float32",
               launcher: tuple[str, ...] = (), token: str | None = None, weights_roots: tuple[str, ...] = (),
               tls: tuple[str, str, str] | None = None):
    """`launcher`: a command prefix the server runs under (e.g. a container that sees other files);
    `token`: the token it requires (None: a fresh random one); `weights_roots`: the only directories it
    reads pushed paths from (empty: any); `tls`: (certificate chain, private key, CA) PEM files: it
    serves over TLS only, and `client()` checks its certificate against the CA."""
    self._ready_dir = tempfile.TemporaryDirectory(prefix="copc_server_")
    self._ready_file = os.path.join(self._ready_dir.name, "port")
    self.log_path = log_path or os.path.join(self._ready_dir.name, "server.log")
    command = [*launcher, sys.executable, "-m", "copc_jax.rollout.serve", f"--checkpoint={checkpoint}",
               "--port=0",
               f"--slots={slots}", f"--max_prefill_length={max_prefill_length}",
               f"--max_length={max_length}", f"--seed={seed}", f"--version={version}",
               f"--tensor_parallelism={tensor_parallelism}", f"--data_parallelism={data_parallelism}",
               f"--decode_steps={decode_steps}",
               f"--dtype={dtype}",
               f"--ready_file={self._ready_file}", "--exit_with_parent",
               *([f"--weights_root={','.join(weights_roots)}"] if weights_roots else []),
               *([f"--tls_cert={tls[0]}", f"--tls_key={tls[1]}"] if tls else [])]
    self._tls_root_certificates = tls[2] if tls else ""
    self._log = open(self.log_path, "a")
    self.token = token or auth.new_token()
    self.process = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT,
                                    env={**server_environment(platform), auth.ENV_VAR: self.token},
                                    start_new_session=True)
    self.address: str | None = None

  def wait_ready(self, timeout_s: float = 120.0) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
      if self.process.poll() is not None:
        raise RuntimeError(f"rollout server exited with {self.process.returncode} before becoming "
                           f"ready; log: {self.log_path}\n{self.log_tail()}")
      if os.path.exists(self._ready_file) and os.path.getsize(self._ready_file):
        with open(self._ready_file) as f:
          self.address = f"127.0.0.1:{int(f.read())}"
        client = self.client()
        try:
          client.status(timeout_s=5)
          return self.address
        except Exception:  # noqa: BLE001 - not accepting yet
          pass
        finally:
          client.close()
      time.sleep(0.1)
    self.stop()
    raise TimeoutError(f"rollout server not ready after {timeout_s:.0f} s; log: {self.log_path}")

  def client(self, timeout_s: float = 300.0) -> RolloutClient:
    """A client of this server (carrying its token)."""
    return RolloutClient(self.address, timeout_s, token=self.token,
                         tls_root_certificates=self._tls_root_certificates)

  def log_tail(self, lines: int = 30) -> str:
    with open(self.log_path) as f:
      return "".join(f.readlines()[-lines:])

  def alive(self) -> bool:
    return self.process.poll() is None

  def kill(self) -> None:
    """SIGKILL the server and its process group (for failure tests)."""
    if self.alive():
      os.killpg(self.process.pid, signal.SIGKILL)
    self.process.wait()

  def stop(self, timeout_s: float = 10.0) -> None:
    if self.alive():
      os.killpg(self.process.pid, signal.SIGTERM)
      try:
        self.process.wait(timeout_s)
      except subprocess.TimeoutExpired:
        self.kill()
    self._log.close()
    self._ready_dir.cleanup()
