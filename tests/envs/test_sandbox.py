"""Hostile inputs: each gets its status, and the test process, the machine and the disk stay clean."""

import glob
import os
import socket
import tempfile
import threading
import time

import pytest

from copc_jax.envs import sandbox

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the sandbox needs root namespaces")


def sandbox_dirs():
  return set(glob.glob(os.path.join(tempfile.gettempdir(), "copc_sandbox_*")))


def nobody_processes():
  count = 0
  for status in glob.glob("/proc/[0-9]*/status"):
    try:
      with open(status) as f:
        if any(line.startswith("Uid:") and line.split()[1] == "65534" for line in f):
          count += 1
    except OSError:
      pass
  return count


@pytest.fixture(autouse=True)
def nothing_leaks(tmp_path, monkeypatch):
  # Runs of this test make their directories in a temp dir of its own: other sandboxes on the
  # machine (a concurrent training run) neither hide nor fake a leak.
  monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
  before_dirs, before_procs = sandbox_dirs(), nobody_processes()
  yield
  assert sandbox_dirs() == before_dirs, "a sandbox directory was left behind"
  assert nobody_processes() <= before_procs, "a sandboxed process outlived its run"


def test_ordinary_code_and_errors():
  ok = sandbox.run_python("import math\nprint(math.factorial(20))")
  assert ok.status == "ok" and ok.stdout.strip() == "2432902008176640000"
  err = sandbox.run_python("raise ValueError('bad')")
  assert err.status == "error" and "ValueError: bad" in err.stderr


def test_infinite_loop_times_out():
  start = time.monotonic()
  result = sandbox.run_python("while True: pass", timeout_s=1.0)
  assert result.status == "timeout" and time.monotonic() - start < 5


def test_code_ignoring_sigterm_that_never_returns_is_killed():
  code = "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\nwhile True: time.sleep(1)"
  assert sandbox.run_python(code, timeout_s=1.0).status == "timeout"


def test_fork_bomb_is_contained():
  code = "import os\nwhile True:\n  try:\n    os.fork()\n  except OSError:\n    pass"
  result = sandbox.run_python(code, timeout_s=2.0)
  assert result.status in ("timeout", "error")


def test_children_do_not_outlive_the_timeout():
  code = ("import subprocess, sys, time\n"
          "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
          "time.sleep(600)")
  assert sandbox.run_python(code, timeout_s=1.0).status == "timeout"


def test_memory_bomb_is_stopped():
  result = sandbox.run_python("x = bytearray(2 * 1024**3)", memory_mb=256)
  assert result.status == "memory"


def test_huge_output_is_cut():
  result = sandbox.run_python("import sys\nsys.stdout.write('x' * 100_000_000)", max_output_bytes=4096,
                              timeout_s=10)
  assert result.status == "output_limit" and len(result.stdout) <= 4096


def test_no_network_even_to_loopback():
  listener = socket.socket()
  listener.bind(("127.0.0.1", 0))
  listener.listen()
  port = listener.getsockname()[1]
  accepted = []
  threading.Thread(target=lambda: accepted.append(listener.accept()), daemon=True).start()
  code = (f"import socket\ns = socket.socket()\ns.settimeout(2)\n"
          f"print(s.connect_ex(('127.0.0.1', {port})))")
  result = sandbox.run_python(code, timeout_s=5)
  assert result.status in ("ok", "error") and result.stdout.strip() != "0"
  assert not accepted
  listener.close()


def test_writes_outside_its_directory_do_not_happen(tmp_path):
  target = tmp_path / "escaped.txt"
  os.chmod(tmp_path, 0o777)
  code = (f"open('inside.txt', 'w').write('ok')\n"
          f"for path in [{str(target)!r}, '/tmp/copc_escape.txt', '/etc/copc_escape', "
          f"'/dev/shm/copc_escape', {os.getcwd() + '/copc_escape'!r}]:\n"
          f"  try:\n    open(path, 'w').write('x')\n  except OSError as e:\n    print('blocked', path)\n")
  result = sandbox.run_python(code)
  assert result.status == "ok"
  assert not target.exists() and not os.path.exists("/tmp/copc_escape.txt")
  assert not os.path.exists("/etc/copc_escape") and not os.path.exists("/dev/shm/copc_escape")
  assert not os.path.exists(os.path.join(os.getcwd(), "copc_escape"))


def test_killing_the_parent_is_impossible():
  code = (f"import os, signal\nfor pid in (os.getppid(), 1, {os.getpid()}):\n"
          "  try:\n    os.kill(pid, signal.SIGKILL)\n  except Exception as e:\n    print(type(e).__name__)\n")
  result = sandbox.run_python(code)
  assert result.status in ("ok", "error")
  assert os.getpid()   # still here


def test_pool_runs_concurrently_with_a_bound():
  with sandbox.SandboxPool(max_concurrent=3, timeout_s=5) as pool:
    results = pool.map([f"print({i} * {i})" for i in range(8)])
  assert [r.stdout.strip() for r in results] == [str(i * i) for i in range(8)]
