"""Run untrusted, model-written Python in a disposable sandbox.

    result = run_python("print(2 ** 100)", timeout_s=5, memory_mb=256, max_output_bytes=65536)
    result.status   # "ok" | "error" | "timeout" | "memory" | "output_limit"

Each run is a new process tree inside fresh Linux namespaces (`unshare`):

- network: an empty network namespace (not even loopback is up);
- processes: a PID namespace; killing its first process kills everything in it,
  so nothing outlives the timeout, and the caller's processes are invisible;
- files: the code runs as user `nobody`, in its own temporary directory (removed
  afterwards); /tmp, /var/tmp and /dev/shm are empty throwaway tmpfs mounts, and
  the rest of the filesystem is not writable by `nobody`;
- resources: address space, CPU time, file size and process count limits
  (`prlimit`), a wall-clock timeout enforced from outside, output cut at
  `max_output_bytes` (the run is stopped when it writes more).

The interpreter is this Python's base installation without site-packages
(`-I -S`): the standard library only. This needs root (or equivalent
privileges for mount and user namespaces) and util-linux; without them
`run_python` raises `SandboxUnavailable` rather than run code unprotected.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

STATUSES = ("ok", "error", "timeout", "memory", "output_limit")
NOBODY = 65534
MAX_PROCESSES = 32
_TOOLS = ("unshare", "setpriv", "prlimit", "mount")

# Runs as root inside the new namespaces, then drops to `nobody` and starts the interpreter.
_PREAMBLE = r"""
set -e
mount --make-rprivate /
mount -t tmpfs -o size=64m,mode=755 copc-sandbox /mnt
mkdir /mnt/python /mnt/box
mount --bind -o ro "$COPC_PYTHON_HOME" /mnt/python
mount --bind "$COPC_WORKDIR" /mnt/box
for d in /tmp /var/tmp /dev/shm; do
  if [ -d "$d" ]; then mount -t tmpfs -o size=1m copc-sandbox-tmp "$d"; fi
done
cd /mnt/box
exec prlimit --as="$COPC_MEMORY_BYTES" --cpu="$COPC_CPU_S" --fsize="$COPC_FILE_BYTES" \
  --nproc="$COPC_NPROC" --core=0 \
  setpriv --reuid=65534 --regid=65534 --clear-groups --inh-caps=-all --bounding-set=-all \
  --no-new-privs env -i HOME=/mnt/box PATH=/mnt/python/bin PYTHONDONTWRITEBYTECODE=1 \
  /mnt/python/bin/"$COPC_PYTHON_NAME" -I -S /mnt/box/main.py
"""


class SandboxUnavailable(RuntimeError):
  """This machine cannot create the namespaces the sandbox needs."""


@dataclasses.dataclass(frozen=True)
class SandboxResult:
  stdout: str
  stderr: str
  status: str
  returncode: int | None
  duration_s: float


def _check_available() -> None:
  missing = [tool for tool in _TOOLS if shutil.which(tool) is None]
  if missing:
    raise SandboxUnavailable(f"the sandbox needs util-linux tools {missing} on PATH")
  if os.geteuid() != 0:
    raise SandboxUnavailable("the sandbox needs root to create mount/PID/network namespaces and "
                             "drop to user nobody; run the tool executor as root (e.g. in its container)")


def _python_home() -> tuple[str, str]:
  """The base installation of this interpreter and the interpreter's file name in it."""
  executable = os.path.realpath(sys.executable)
  home = os.path.dirname(os.path.dirname(executable))
  return home, os.path.basename(executable)


def _children(pid: int) -> list[int]:
  try:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
      return [int(p) for p in f.read().split()]
  except OSError:
    return []


def _wait_gone(pids: list[int], timeout_s: float) -> None:
  """Wait until killed processes are fully gone (reaped), so none outlives the call."""
  deadline = time.monotonic() + timeout_s
  for pid in pids:
    while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
      time.sleep(0.01)


class _CappedReader(threading.Thread):
  """Reads a pipe into a buffer of at most `limit` bytes; sets `overflow` past it."""

  def __init__(self, pipe, limit: int, on_overflow):
    super().__init__(daemon=True)
    self.pipe, self.limit, self.on_overflow = pipe, limit, on_overflow
    self.chunks, self.size, self.overflow = [], 0, False

  def run(self):
    while True:
      chunk = self.pipe.read1(65536) if hasattr(self.pipe, "read1") else self.pipe.read(65536)
      if not chunk:
        return
      if self.size < self.limit:
        self.chunks.append(chunk[: self.limit - self.size])
      self.size += len(chunk)
      if self.size > self.limit and not self.overflow:
        self.overflow = True
        self.on_overflow()

  def text(self) -> str:
    return b"".join(self.chunks).decode("utf-8", errors="replace")


def run_python(code: str, *, timeout_s: float = 10.0, memory_mb: int = 512,
               max_output_bytes: int = 1 << 16, max_file_bytes: int = 16 << 20) -> SandboxResult:
  """Run `code` in a fresh sandbox; never raises for anything the code does."""
  _check_available()
  if timeout_s <= 0 or memory_mb <= 0 or max_output_bytes <= 0:
    raise ValueError("timeout_s, memory_mb and max_output_bytes must be > 0")
  workdir = tempfile.mkdtemp(prefix="copc_sandbox_")
  start = time.monotonic()
  try:
    os.chown(workdir, NOBODY, NOBODY)
    os.chmod(workdir, 0o700)
    with open(os.path.join(workdir, "main.py"), "w") as f:
      f.write(code)
    os.chown(os.path.join(workdir, "main.py"), NOBODY, NOBODY)
    home, name = _python_home()
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "COPC_PYTHON_HOME": home,
           "COPC_PYTHON_NAME": name, "COPC_WORKDIR": workdir,
           "COPC_MEMORY_BYTES": str(memory_mb << 20), "COPC_CPU_S": str(int(timeout_s) + 1),
           "COPC_FILE_BYTES": str(max_file_bytes), "COPC_NPROC": str(MAX_PROCESSES)}
    process = subprocess.Popen(
        ["unshare", "--net", "--pid", "--mount", "--ipc", "--uts", "--fork", "--kill-child",
         "sh", "-c", _PREAMBLE], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, env=env, start_new_session=True)

    namespace_init = []   # the namespace's first process: when it is gone, everything in it is

    def stop():
      namespace_init.extend(_children(process.pid))
      try:
        os.killpg(process.pid, signal.SIGKILL)
      except ProcessLookupError:
        pass

    readers = [_CappedReader(process.stdout, max_output_bytes, stop),
               _CappedReader(process.stderr, max_output_bytes, stop)]
    for reader in readers:
      reader.start()
    timed_out = False
    try:
      process.wait(timeout_s)
    except subprocess.TimeoutExpired:
      timed_out = True
      stop()
      process.wait()
    for reader in readers:
      reader.join(timeout=5)
    _wait_gone(namespace_init, timeout_s=5.0)
    stdout, stderr = readers[0].text(), readers[1].text()
    overflow = any(r.overflow for r in readers) or readers[0].size + readers[1].size > max_output_bytes
    if timed_out:
      status = "timeout"
    elif overflow:
      status = "output_limit"
    elif process.returncode == 0:
      status = "ok"
    elif "MemoryError" in stderr or "Cannot allocate memory" in stderr:
      status = "memory"
    elif process.returncode == -signal.SIGXCPU or process.returncode == 128 + signal.SIGXCPU:
      status = "timeout"
    else:
      status = "error"
    return SandboxResult(stdout=stdout, stderr=stderr, status=status, returncode=process.returncode,
                         duration_s=time.monotonic() - start)
  finally:
    shutil.rmtree(workdir, ignore_errors=True)


class SandboxPool:
  """Runs many sandboxes concurrently, at most `max_concurrent` at a time."""

  def __init__(self, max_concurrent: int = 4, **run_kwargs):
    self._executor = ThreadPoolExecutor(max_concurrent)
    self._run_kwargs = run_kwargs

  def run(self, code: str) -> SandboxResult:
    return self._executor.submit(run_python, code, **self._run_kwargs).result()

  def map(self, codes: list[str]) -> list[SandboxResult]:
    return list(self._executor.map(lambda c: run_python(c, **self._run_kwargs), codes))

  def close(self) -> None:
    self._executor.shutdown(wait=True)

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()
