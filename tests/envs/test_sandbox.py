"""Hostile inputs: each gets its status, runs are isolated from the host and from each other, and the
test process, the machine and the disk stay clean."""

import os
import signal
import socket
import threading
import time
import uuid

import pytest

from copc_jax.envs import sandbox

REASON = sandbox.unavailable_reason()
# As root (CI, containers) setup.sh installs bubblewrap, so a missing sandbox fails here, loudly.
pytestmark = pytest.mark.skipif(REASON is not None and os.geteuid() != 0, reason=f"{REASON}")


def processes_with(marker: str) -> list[int]:
  found = []
  for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
      with open(f"/proc/{pid}/cmdline", "rb") as f:
        if marker.encode() in f.read():
          found.append(int(pid))
    except OSError:
      pass
  return found


def my_bwrap_children() -> list[int]:
  children = []
  for task in os.listdir("/proc/self/task"):
    try:
      with open(f"/proc/self/task/{task}/children") as f:
        children += [int(p) for p in f.read().split()]
    except FileNotFoundError:
      pass                # a thread that ended between the listing and the read has no children
  return [pid for pid in children if pid in processes_with("--unshare-all")]


@pytest.fixture(autouse=True)
def marker(monkeypatch):
  """Tags this test's sandboxed interpreters (and whatever they fork) by a unique comment in the
  launcher's command line, so other sandboxes on the machine neither hide nor fake a leak."""
  tag = f"copc-test-{uuid.uuid4().hex}"
  monkeypatch.setattr(sandbox, "_LAUNCHER", f"# {tag}\n" + sandbox._LAUNCHER)
  yield tag
  assert not processes_with(tag), "a sandboxed process outlived its run"
  assert not my_bwrap_children(), "a bwrap process outlived its run"


def test_ordinary_code_and_errors():
  ok = sandbox.run_python("import math\nprint(math.factorial(20))")
  assert ok.status == "ok" and ok.stdout.strip() == "2432902008176640000"
  err = sandbox.run_python("print('before')\nraise ValueError('bad')")
  assert err.status == "error" and "ValueError: bad" in err.stderr and err.stdout == "before\n"
  assert err.stderr.startswith("Traceback") and 'File "main.py", line 2' in err.stderr
  assert sandbox.run_python("import sys; sys.exit(3)").returncode == 3


@pytest.mark.parametrize("code", ["print('\ud800')", "x = '\udcff'", "print(1)\x00", "\ufeffprint(1)",
                                  "# -*- coding: latin-1 -*-\nprint('é')", "", "\r\n" * 3, "'" * 10_000])
def test_any_code_string_gets_a_status_never_an_exception(code):
  result = sandbox.run_python(code)
  assert result.status in ("ok", "error")


def test_status_comes_from_how_the_run_ended_not_from_what_it_printed():
  spoof = sandbox.run_python("import sys\nprint('MemoryError', file=sys.stderr)\n"
                             "print('Cannot allocate memory', file=sys.stderr)\nsys.exit(1)")
  assert spoof.status == "error"
  real = sandbox.run_python("print('partial')\nx = bytearray(2 * 1024**3)", memory_mb=256)
  assert real.status == "memory" and real.stdout == "partial\n" and "MemoryError" in real.stderr


def test_infinite_loop_times_out():
  start = time.monotonic()
  result = sandbox.run_python("while True: pass", timeout_s=1.0)
  assert result.status == "timeout" and time.monotonic() - start < 30


def test_code_ignoring_sigterm_that_never_returns_is_killed():
  code = "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\nwhile True: time.sleep(1)"
  assert sandbox.run_python(code, timeout_s=1.0).status == "timeout"


def test_fork_bomb_is_contained():
  code = "import os\nwhile True:\n  try:\n    os.fork()\n  except OSError:\n    pass"
  result = sandbox.run_python(code, timeout_s=2.0)
  assert result.status in ("timeout", "error")


def test_children_do_not_outlive_the_timeout(marker):
  code = ("import subprocess, sys, time\n"
          f"subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)  # {marker}'])\n"
          "time.sleep(600)")
  assert sandbox.run_python(code, timeout_s=1.0).status == "timeout"


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


def test_it_sees_only_its_own_processes_and_no_host_files():
  code = ("import os, subprocess, sys\n"
          "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)'])\n"
          "print(sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))\n"
          "print(sorted(os.listdir('/')))\n"
          "print(os.getuid(), os.path.exists('/etc/passwd'), os.path.exists(os.path.expanduser('~root')))\n"
          "child.kill()")
  result = sandbox.run_python(code)
  assert result.status == "ok", result.stderr
  pids, top, identity = result.stdout.splitlines()
  assert len(eval(pids)) <= 4, pids          # bwrap's init, the interpreter, its child (+ none else)
  assert eval(top) == ["bin", "box", "dev", "lib", "lib64", "proc", "tmp", "usr"]
  assert identity == "65534 False False"


def test_two_live_runs_cannot_reach_each_other(marker):
  """Run A holds a secret in its files; while A is alive, run B searches everything it can
  see (its filesystem and every /proc entry it can open, other processes' roots included) for it."""
  secret = uuid.uuid4().hex
  holder = ("import signal\nsignal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})\n"
            f"key = '{secret[:16]}' + '{secret[16:]}'\n"
            "for path in ('/box/secret.txt', '/tmp/secret.txt', '/dev/shm/secret.txt'):\n"
            "  open(path, 'w').write(key)\n"
            "signal.sigwait({signal.SIGUSR1})\n"
            "print('released')")
  a_result = []
  a = threading.Thread(target=lambda: a_result.append(sandbox.run_python(holder, timeout_s=120)))
  a.start()
  a_pid = None
  while a_pid is None and a.is_alive():    # the host (root) sees A's files once A wrote them
    for pid in processes_with(marker):
      if os.path.exists(f"/proc/{pid}/root/dev/shm/secret.txt"):
        a_pid = pid
    time.sleep(0.05)
  assert a_pid is not None, a_result
  seeker = ("import os\n"
            f"needle = '{secret[:16]}' + '{secret[16:]}'\n"
            "open('/box/mine.txt', 'w').write(needle[::-1])\n"
            "found, seen = [], 0\n"
            "def scan(path):\n"
            "  global seen\n"
            "  try:\n"
            "    with open(path, 'rb') as f:\n"
            "      data = f.read(1 << 20)\n"
            "  except OSError:\n"
            "    return\n"
            "  seen += 1\n"
            "  if needle.encode() in data or needle[::-1].encode() in data:\n"
            "    found.append(path)\n"
            "for top in ('/box', '/tmp', '/dev/shm', '/proc'):\n"
            "  for root, dirs, files in os.walk(top):\n"
            "    if root.startswith('/proc/') and root.count('/') > 3:\n"
            "      dirs[:] = [d for d in dirs if d in ('root', 'cwd')] if root.count('/') == 3 else []\n"
            "    for name in files:\n"
            "      scan(os.path.join(root, name))\n"
            "for pid in filter(str.isdigit, os.listdir('/proc')):\n"
            "  for part in ('environ', 'cmdline', 'root/box/secret.txt', 'cwd/secret.txt'):\n"
            "    scan(f'/proc/{pid}/{part}')\n"
            "print(found, seen)")
  b = sandbox.run_python(seeker, timeout_s=60)
  os.kill(a_pid, signal.SIGUSR1)
  a.join()
  assert b.status == "ok", (b.returncode, b.stdout[-500:], b.stderr[-500:])
  found, seen = b.stdout.rsplit(" ", 1)
  assert eval(found) == ["/box/mine.txt"] and int(seen) > 10      # it finds its own file, not A's
  assert a_result[0].status == "ok" and a_result[0].stdout == "released\n", a_result


def test_sixteen_concurrent_runs_each_start_threads():
  code = ("import threading, time\n"
          "threads = [threading.Thread(target=time.sleep, args=(0.5,)) for _ in range(16)]\n"
          "[t.start() for t in threads]\n[t.join() for t in threads]\nprint('ok')")
  with sandbox.SandboxPool(max_concurrent=16, timeout_s=60) as pool:
    results = pool.map([code] * 16)
  assert [r.status for r in results] == ["ok"] * 16, [r.stderr[-300:] for r in results if r.status != "ok"]


def test_process_limit_is_per_run():
  code = ("import os, time\nn = 0\ntry:\n  for _ in range(200):\n    if os.fork() == 0:\n"
          "      time.sleep(5); os._exit(0)\n    n += 1\nexcept OSError:\n  pass\nprint(n)")
  result = sandbox.run_python(code, timeout_s=30)
  assert result.status == "ok" and int(result.stdout) < sandbox.MAX_PROCESSES


def test_writable_space_is_bounded_and_in_memory():
  code = ("import os\nwritten = 0\ntry:\n  for i in range(1000):\n"
          "    with open(f'fill{i}', 'wb') as f:\n      f.write(b'x' * (1 << 20))\n    written += 1\n"
          "except OSError as e:\n  print(written, e.errno)\n"
          "print([line.split()[:3] for line in open('/proc/self/mounts') if ' /box ' in line])")
  result = sandbox.run_python(code, disk_mb=8, timeout_s=30)
  assert result.status == "ok", result.stderr
  written, mounts = result.stdout.splitlines()
  assert written.split() == [str(int(written.split()[0])), "28"] and int(written.split()[0]) <= 8   # ENOSPC
  assert eval(mounts)[0][2] == "tmpfs"
  probe = ("import os\nwritable = []\nfor root, dirs, files in os.walk('/'):\n"
           "  if root.startswith(('/proc', '/sys')):\n    dirs[:] = []\n    continue\n"
           "  try:\n    open(os.path.join(root, '.probe'), 'w').close()\n    writable.append(root)\n"
           "  except OSError:\n    pass\nprint(writable)")
  assert eval(sandbox.run_python(probe, timeout_s=30).stdout) == ["/box", "/tmp", "/dev/shm"]


def test_no_ptrace_no_new_namespaces():
  code = ("import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
          "def call(f, *args):\n  r = f(*args)\n  return r, ctypes.get_errno()\n"
          "print([call(libc.ptrace, 16, 1, 0, 0), call(libc.ptrace, 0, 0, 0, 0),\n"
          "       call(libc.unshare, 0x10000000), call(libc.unshare, 0x00020000),\n"
          "       call(libc.syscall, 310, 1, 0, 0, 0, 0, 0)])")   # process_vm_readv on x86-64
  result = sandbox.run_python(code)
  assert result.status == "ok", result.stderr
  assert eval(result.stdout) == [(-1, 1)] * 5    # all EPERM


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
