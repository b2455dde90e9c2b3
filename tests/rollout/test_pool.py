import os
import signal
import subprocess
import sys
import textwrap
import threading

import pytest

from copc_jax.models import tiny
from copc_jax.rollout.pool import RolloutPool, wait_until
from copc_jax.rollout.protocol import WeightUpdate


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
  path = tmp_path_factory.mktemp("pool") / "tiny"
  tiny.make_tiny_checkpoint(str(path), "qwen2", seed=0)
  return str(path)


def test_a_killed_server_loses_and_duplicates_nothing(checkpoint):
  with RolloutPool(checkpoint, num_servers=2, max_in_flight=4, slots=4, max_prefill_length=16,
                   max_length=96) as pool:
    requests = [dict(token_ids=[1, 3 + i % 90, 4 + i % 80], max_tokens=24 + i % 8) for i in range(64)]
    results = [None] * 64
    calls = [0] * 64

    def run(i):
      calls[i] += 1
      results[i] = pool.generate(**requests[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(64)]
    for t in threads:
      t.start()
    victim = pool.servers[0]
    assert wait_until(lambda: victim.in_flight > 0, timeout_s=60)
    victim.process.kill()                                  # SIGKILL in the middle of the batch
    for t in threads:
      t.join(timeout=300)
    assert all(not t.is_alive() for t in threads)
    assert calls == [1] * 64
    for request, result in zip(requests, results):
      assert result is not None
      assert len(result.token_ids) == len(result.logprobs) == len(result.versions)
      assert result.finish_reason in ("stop", "length")
      if result.finish_reason == "length":
        assert len(result.token_ids) == request["max_tokens"]
    assert victim.restarts == 1 and victim.process.alive()


def test_weight_push_reaches_every_server_and_restarted_ones(checkpoint, tmp_path):
  """Streamed pushes reach every server and restarted servers catch up the same way; a new run on the
  same servers (a study's next cell), pushing by path, starts its own versions at 0."""
  from flax import nnx

  from copc_jax.models import hf_io
  from copc_jax.models.decoder import Decoder

  model, _ = hf_io.from_pretrained(checkpoint, load_tokenizer=False)
  hf_io.save_pretrained(Decoder(model.config, rngs=nnx.Rngs(5)), str(tmp_path / "v3"))
  with RolloutPool(checkpoint, num_servers=2, max_prefill_length=16, max_length=64) as pool:
    pool.push(WeightUpdate(3, str(tmp_path / "v3"), "stream"))
    assert [s.version for s in pool.status()] == [3, 3]
    pool.servers[1].process.kill()
    pool._handle_failure(pool.servers[1])
    assert pool.status()[1].version == 3
    outs = pool.generate_many([dict(token_ids=[1, 5, 6], max_tokens=4)] * 8)
    assert all(set(o.versions) == {3} for o in outs)
    pool.servers[0].process.kill()
    pool._on_hung(pool.servers[0])          # the detector's probe of a dead server: not "hung"
    assert not pool.servers[0].hung
    pool.push(WeightUpdate(4, str(tmp_path / "v3"), "stream"))     # a push restarts a dead server
    assert [s.version for s in pool.status()] == [4, 4] and pool.servers[0].restarts == 1
    assert all(s.report["weight_swaps"]["UpdateWeights"] == 0 for s in pool.status())   # restarts streamed too
    before = [s.report["weight_swaps"] for s in pool.status()]
    with RolloutPool(addresses=[s.address for s in pool.servers], token=pool.token) as next_run:
      next_run.push(WeightUpdate(0, str(tmp_path / "v3")))
      next_run.push(WeightUpdate(1, str(tmp_path / "v3")))
      assert [s.version for s in next_run.status()] == [1, 1]
      outs = next_run.generate_many([dict(token_ids=[1, 5], max_tokens=3)] * 4)
      assert all(set(o.versions) == {1} for o in outs)
      after = [s.report["weight_swaps"] for s in next_run.status()]
      assert [a["UpdateWeights"] - b["UpdateWeights"] for a, b in zip(after, before)] == [2, 2]
      assert [a["UpdateWeightsBytes"] for a in after] == [b["UpdateWeightsBytes"] for b in before]


def test_remote_addresses_and_clean_shutdown_on_ctrl_c(checkpoint, tmp_path):
  script = tmp_path / "run_pool.py"
  stacks = tmp_path / "stacks.txt"
  script.write_text(textwrap.dedent(f"""
      import faulthandler, signal, time
      faulthandler.register(signal.SIGUSR1, file=open({str(stacks)!r}, "w"), all_threads=True)
      # As in a terminal: a shell starts `cmd &` with SIGINT ignored (POSIX), pytest's children inherit
      # that when CI runs in the background, and Python then installs no KeyboardInterrupt handler.
      signal.signal(signal.SIGINT, signal.default_int_handler)
      from copc_jax.rollout.pool import RolloutPool
      pool = RolloutPool({checkpoint!r}, num_servers=2, max_prefill_length=16, max_length=64)
      print(",".join(str(s.process.process.pid) for s in pool.servers), flush=True)
      remote = RolloutPool(addresses=[s.address for s in pool.servers], token=pool.token)
      print(len(remote.generate([1, 7, 8], max_tokens=3).token_ids), flush=True)
      print("ready", flush=True)
      # Ctrl-C lands here, uncaught: the pool's exit hook must stop the servers. Short sleeps: a
      # signal the kernel hands to another thread (gRPC's, the hang detector's) only sets Python's
      # flag, and a main thread blocked in one long sleep would not see it until the sleep ends.
      while True:
        time.sleep(0.05)
      """))
  process = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "XLA_FLAGS": ""})
  pids = [int(p) for p in process.stdout.readline().split(",")]
  assert int(process.stdout.readline()) > 0
  assert process.stdout.readline().strip() == "ready"
  process.send_signal(signal.SIGINT)
  try:
    assert process.wait(timeout=180) != 0     # interrupted, not finished (servers stop in <= 10 s each + kill)
  except subprocess.TimeoutExpired:
    process.send_signal(signal.SIGUSR1)       # where it hangs, for the failure message
    wait_until(lambda: stacks.exists() and stacks.stat().st_size > 0, timeout_s=10)
    process.kill()
    pytest.fail(f"the pool did not exit after Ctrl-C; its threads:\n{stacks.read_text()[-6000:]}")

  def gone(pid):
    try:
      os.kill(pid, 0)
      return False
    except ProcessLookupError:
      return True

  assert wait_until(lambda: all(gone(pid) for pid in pids), timeout_s=20)


def test_a_paused_server_is_found_its_requests_finish_elsewhere_and_it_comes_back(checkpoint, tmp_path):
  """SIGSTOP one of two servers with requests on it: the pool notices (Status gets no answer), cancels
  and resubmits them on the other server, and routes to the paused one again after SIGCONT."""
  from flax import nnx

  from copc_jax.models import hf_io
  from copc_jax.models.decoder import Decoder

  requests = [dict(token_ids=[1, 3 + i, 4 + i], max_tokens=24, temperature=0.8, seed=100 + i) for i in range(8)]
  with RolloutPool(checkpoint, num_servers=2, max_in_flight=4, slots=4, max_prefill_length=16, max_length=96,
                   stall_timeout_s=2.0, probe_timeout_s=2.0) as pool:
    expected = pool.generate_many(requests)      # seeded: the same tokens on any server
    paused = pool.servers[0]
    os.kill(paused.process.process.pid, signal.SIGSTOP)
    try:
      results = pool.generate_many(requests)
      assert paused.hangs == 1 and paused.hung and not paused.healthy
      model, _ = hf_io.from_pretrained(checkpoint, load_tokenizer=False)
      hf_io.save_pretrained(Decoder(model.config, rngs=nnx.Rngs(5)), str(tmp_path / "v2"))
      pool.push(WeightUpdate(2, str(tmp_path / "v2")))      # the paused server is skipped, not waited for
    finally:
      os.kill(paused.process.process.pid, signal.SIGCONT)
    assert [r.token_ids for r in results] == [r.token_ids for r in expected]
    for result, reference in zip(results, expected):
      assert result.logprobs == pytest.approx(reference.logprobs, abs=1e-5)
    assert wait_until(lambda: paused.healthy, timeout_s=120)
    assert paused.restarts == 0 and paused.client.status()["version"] == 2   # back, with the latest weights


def test_a_server_that_stops_answering_mid_push_is_abandoned_and_caught_up(checkpoint, tmp_path, monkeypatch):
  """SIGSTOP a server that had just answered its probe: the push to it ends at push_timeout_s, the
  server is out of routing as hung and the other one has the version; after SIGCONT the pool pushes
  it the newest version and routes to it again. (Waits, no timing assertions.)"""
  from flax import nnx

  from copc_jax.models import hf_io
  from copc_jax.models.decoder import Decoder

  model, _ = hf_io.from_pretrained(checkpoint, load_tokenizer=False)
  hf_io.save_pretrained(Decoder(model.config, rngs=nnx.Rngs(7)), str(tmp_path / "v1"))
  with RolloutPool(checkpoint, num_servers=2, max_in_flight=2, slots=2, max_prefill_length=16, max_length=32,
                   push_timeout_s=3.0, probe_timeout_s=1.0) as pool:
    frozen = pool.servers[0]
    monkeypatch.setattr(pool._detector, "responds", lambda server: server is not frozen or not frozen.hung)
    os.kill(frozen.process.process.pid, signal.SIGSTOP)          # after its probe, before the push lands
    try:
      pool.push(WeightUpdate(1, str(tmp_path / "v1")))       # returns: the stopped server is abandoned
      assert frozen.hung and not frozen.healthy and frozen.hangs == 1
      assert pool.servers[1].client.status()["version"] == 1
      assert pool.generate([1, 5], max_tokens=2).versions == [1, 1]   # routed to the live server only
    finally:
      os.kill(frozen.process.process.pid, signal.SIGCONT)
    monkeypatch.undo()
    assert wait_until(lambda: frozen.healthy and not frozen.hung, timeout_s=120)
    assert frozen.client.status()["version"] == 1                # caught up on recovery
