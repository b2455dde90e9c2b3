"""Who may call a rollout server: token on every RPC, weights only from the allowed root, owner-only shm."""

import json
import os
import shutil
import stat
import subprocess
import sys

import grpc
import pytest
from jetstream.core.proto import jetstream_pb2, jetstream_pb2_grpc

from copc_jax.models import tiny
from copc_jax.rollout import auth
from copc_jax.rollout.client import RolloutClient
from copc_jax.rollout.pool import RolloutPool
from copc_jax.rollout.process import ServerProcess
from copc_jax.rollout.protocol import SERVICE

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_loopback_addresses():
  assert auth.is_loopback("127.0.0.1") and auth.is_loopback("::1") and auth.is_loopback("localhost")
  assert not auth.is_loopback("0.0.0.0") and not auth.is_loopback("10.1.2.3") and not auth.is_loopback("")


def test_binding_beyond_loopback_needs_a_token():
  auth.check_bind("127.0.0.1", None)
  auth.check_bind("0.0.0.0", "secret")
  with pytest.raises(ValueError, match=r"--host=0.0.0.0 is reachable from the network: give a shared token"):
    auth.check_bind("0.0.0.0", None)


def test_token_from_file_or_environment(tmp_path, monkeypatch):
  monkeypatch.delenv(auth.ENV_VAR, raising=False)
  assert auth.resolve_token() is None
  monkeypatch.setenv(auth.ENV_VAR, "from-env")
  assert auth.resolve_token() == "from-env"
  (tmp_path / "token").write_text("from-file\n")
  assert auth.resolve_token(str(tmp_path / "token")) == "from-file"
  (tmp_path / "empty").write_text("\n")
  with pytest.raises(ValueError, match="is empty"):
    auth.resolve_token(str(tmp_path / "empty"))


def test_weights_paths_outside_the_root_are_refused_symlinks_resolved(tmp_path):
  root, outside = tmp_path / "weights", tmp_path / "elsewhere"
  (root / "v1").mkdir(parents=True)
  outside.mkdir()
  (root / "sneaky").symlink_to(outside)
  assert auth.check_weights_path(str(root / "v1"), (str(root),)) == os.path.realpath(root / "v1")
  for path in (outside, root / "sneaky", root / ".." / "elsewhere"):
    with pytest.raises(ValueError, match="outside the server's --weights_root"):
      auth.check_weights_path(str(path), (str(root),))


def test_the_serve_command_refuses_the_network_without_a_token(tmp_path):
  env = {k: v for k, v in os.environ.items() if k != auth.ENV_VAR}
  result = subprocess.run([sys.executable, "-m", "copc_jax.rollout.serve", f"--checkpoint={tmp_path}",
                           "--host=0.0.0.0"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**env, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""})
  assert result.returncode == 2
  assert result.stderr.strip().splitlines() == [
      f"error: --host=0.0.0.0 is reachable from the network: give a shared token (--auth_token_file or "
      f"${auth.ENV_VAR}) so that only the learner can call this server, or bind 127.0.0.1"]


@pytest.fixture(scope="module")
def guarded(tmp_path_factory):
  """A server with a token and a weights root; two weight versions on disk, one inside the root."""
  base = tmp_path_factory.mktemp("auth")
  tiny.make_tiny_checkpoint(str(base / "model"), "qwen2", seed=0)
  tiny.make_tiny_checkpoint(str(base / "weights" / "v1"), "qwen2", seed=1)
  tiny.make_tiny_checkpoint(str(base / "outside"), "qwen2", seed=2)
  (base / "weights" / "link").symlink_to(base / "outside")
  process = ServerProcess(str(base / "model"), slots=2, max_prefill_length=16, max_length=32,
                          weights_roots=(str(base / "weights"),))
  process.wait_ready()
  yield process, base
  process.stop()


def _raw_calls(channel):
  encode = lambda m: json.dumps(m).encode()
  decode = lambda b: json.loads(b.decode())
  return {
      "Status": lambda: channel.unary_unary(f"/{SERVICE}/Status", encode, decode)({}, timeout=30),
      "Generate": lambda: list(channel.unary_stream(f"/{SERVICE}/Generate", encode, decode)(
          {"token_ids": [1, 5], "max_tokens": 2}, timeout=30)),
      "UpdateWeights": lambda: channel.unary_unary(f"/{SERVICE}/UpdateWeights", encode, decode)(
          {"path": "/nonexistent", "version": 7}, timeout=30),
      "UpdateWeightsBytes": lambda: channel.stream_unary(f"/{SERVICE}/UpdateWeightsBytes", lambda b: b, decode)(
          iter([b"junk"]), metadata=[("copc-version", "7")], timeout=30),
      "Decode": lambda: list(jetstream_pb2_grpc.OrchestratorStub(channel).Decode(
          jetstream_pb2.DecodeRequest(token_content=jetstream_pb2.DecodeRequest.TokenContent(token_ids=[1, 5]),
                                      max_tokens=2), timeout=30)),
  }


@pytest.mark.parametrize("token", [None, "wrong-token"])
def test_every_rpc_without_the_token_is_unauthenticated_and_changes_nothing(guarded, token):
  process, base = guarded
  owner = process.client()
  before = owner.status()
  channel = auth.client_channel(process.address, token)
  try:
    for name, call in _raw_calls(channel).items():
      with pytest.raises(grpc.RpcError) as info:
        call()
      assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED, name
      assert "missing or wrong token" in info.value.details(), name
  finally:
    channel.close()
  intruder = RolloutClient(process.address, token=token or "")
  with pytest.raises(grpc.RpcError):
    intruder.update_weights(str(base / "weights" / "v1"), version=99)
  intruder.close()
  after = owner.status()
  assert after["version"] == before["version"] and after["weight_swaps"] == before["weight_swaps"]
  owner.close()


def test_the_token_holder_pushes_inside_the_root_and_nothing_outside_it(guarded):
  process, base = guarded
  client = process.client()
  try:
    for path in (base / "outside", base / "weights" / "link"):
      with pytest.raises(grpc.RpcError) as info:
        client.update_weights(str(path), version=5)
      assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
      assert "outside the server's --weights_root" in info.value.details()
      assert client.status()["version"] != 5
    assert client.update_weights(str(base / "weights" / "v1"), version=3, reset=True) == 3
    assert client.status()["version"] == 3
    assert len(client.generate([1, 5], max_tokens=2).token_ids) == 2
  finally:
    client.close()


def test_shared_memory_versions_are_owner_only_under_unguessable_names():
  from copc_jax.train import weights
  first, second = weights.shared_memory_directory(), weights.shared_memory_directory()
  try:
    for path in (first, second):
      assert stat.S_IMODE(os.stat(path).st_mode) == 0o700
      assert len(os.path.basename(path).rsplit("_", 1)[1]) == 32        # 128 random bits
    assert first != second
    target = os.path.join(first, "v0")
    weights.checkpoint.write_atomically(target, lambda tmp: weights._owner_only(
        (os.makedirs(tmp), open(os.path.join(tmp, "model.safetensors"), "wb").close()), tmp))
    assert stat.S_IMODE(os.stat(os.path.join(target, "model.safetensors")).st_mode) == 0o600
  finally:
    shutil.rmtree(first, ignore_errors=True)
    shutil.rmtree(second, ignore_errors=True)


def _self_signed(directory, name: str) -> tuple[str, str]:
  """A certificate for 127.0.0.1 signed by its own key (it is its own CA), with `openssl`."""
  cert, key = str(directory / f"{name}.pem"), str(directory / f"{name}.key")
  subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-keyout", key,
                  "-out", cert, "-subj", "/CN=localhost",
                  "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"],
                 check=True, capture_output=True)
  return cert, key


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command to make certificates")
def test_tls_serves_only_callers_that_speak_tls_trust_its_certificate_and_carry_the_token(tmp_path):
  cert, key = _self_signed(tmp_path, "server")
  other_ca, _ = _self_signed(tmp_path, "other")
  tiny.make_tiny_checkpoint(str(tmp_path / "model"), "qwen2", seed=0)
  process = ServerProcess(str(tmp_path / "model"), slots=2, max_prefill_length=16, max_length=32,
                          tls=(cert, key, cert))
  try:
    process.wait_ready()
    owner = process.client()
    before = owner.status()
    assert len(owner.generate([1, 5], max_tokens=2).token_ids) == 2
    channels = {"plaintext": auth.client_channel(process.address, process.token),
                "untrusted certificate": auth.client_channel(process.address, process.token,
                                                             tls_root_certificates=other_ca),
                "no token": auth.client_channel(process.address, None, tls_root_certificates=cert)}
    expected = {"plaintext": grpc.StatusCode.UNAVAILABLE, "untrusted certificate": grpc.StatusCode.UNAVAILABLE,
                "no token": grpc.StatusCode.UNAUTHENTICATED}
    for name, channel in channels.items():
      for call, rpc in _raw_calls(channel).items():
        with pytest.raises(grpc.RpcError) as info:
          rpc()
        assert info.value.code() == expected[name], (name, call)
      channel.close()
    after = owner.status()
    assert (after["version"], after["weight_swaps"]) == (before["version"], before["weight_swaps"])
    owner.close()
    pool = RolloutPool(addresses=[process.address], token=process.token, tls_root_certificates=cert)
    try:
      assert len(pool.generate([1, 5], max_tokens=2).token_ids) == 2
    finally:
      pool.close()
  finally:
    process.stop()
