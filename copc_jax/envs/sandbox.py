"""Run untrusted, model-written Python in a disposable bubblewrap sandbox.

    result = run_python("print(2 ** 100)", timeout_s=5, memory_mb=256, max_output_bytes=65536)
    result.status   # "ok" | "error" | "timeout" | "memory" | "output_limit"

Each run is a fresh `bwrap` (bubblewrap) container, isolated from the host and from every other
run, including runs that are alive at the same time:

- namespaces: its own user, PID, mount, network, IPC, UTS and cgroup namespaces (`--unshare-all`);
  it sees only its own processes (a fresh `/proc`), no network, not even loopback;
- identity: the code runs as `nobody` (uid 65534), and so does bubblewrap itself when the caller is
  root, so the kernel counts the run's processes in the run's own user namespace: the process and
  thread limit is per run, and one run's fork bomb does not starve another;
- files: only `/usr` (and the interpreter's installation) read-only; `/box` (the working directory,
  `disk_mb` in all), `/tmp` and `/dev/shm` are size-limited tmpfs mounts that live in memory and
  vanish with the run: nothing reaches the host disk, nothing is left behind;
- system calls: no new user namespaces (`--disable-userns`); a seccomp filter (compiled by
  libseccomp) refuses ptrace, cross-process memory access, mount and namespace calls, keyrings,
  BPF and perf events with EPERM;
- resources: address space, CPU time, file size and process count (`resource.setrlimit` in a
  small trusted launcher before the code starts), a wall-clock timeout enforced from outside, output
  cut at `max_output_bytes` (the run is stopped when it writes more).

The status comes from how the run ended, never from what it printed: the launcher reports an
uncaught `MemoryError` with exit status `MEMORY_EXIT_STATUS`, the CPU limit ends the run with
SIGXCPU. The interpreter is the standard library only (`-I -S`). Without `bwrap` or libseccomp
(`apt-get install bubblewrap libseccomp2`; `setup.sh` does it), `run_python` raises
`SandboxUnavailable` rather than run code unprotected.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import functools
import os
import shutil
import signal
import stat
import subprocess
import sys
import sysconfig
import threading
import time
from concurrent.futures import ThreadPoolExecutor

STATUSES = ("ok", "error", "timeout", "memory", "output_limit")
NOBODY = 65534
MAX_PROCESSES = 32            # processes and threads of one run, counted in its own user namespace
MEMORY_EXIT_STATUS = 86       # the launcher's exit status for an uncaught MemoryError
SMALL_TMPFS_BYTES = 1 << 20   # /tmp and /dev/shm
BLOCKED_SYSCALLS = (
    "ptrace", "process_vm_readv", "process_vm_writev", "pidfd_getfd", "kcmp",
    "mount", "umount2", "pivot_root", "move_mount", "open_tree", "fsopen", "fsmount", "fsconfig",
    "unshare", "setns", "keyctl", "add_key", "request_key", "bpf", "perf_event_open", "userfaultfd",
    "open_by_handle_at", "name_to_handle_at", "personality")

# Trusted code that runs first inside the sandbox: limits, then the model's code as __main__.
_LAUNCHER = r"""
import os, resource, sys
limits = {"AS": %(memory)d, "CPU": %(cpu)d, "FSIZE": %(fsize)d, "NPROC": %(nproc)d, "CORE": 0}
for name, value in limits.items():
    resource.setrlimit(getattr(resource, "RLIMIT_" + name), (value, value))
def excepthook(kind, error, tb):
    import traceback
    traceback.print_exception(kind, error, tb.tb_next if tb is not None else None)
    sys.stdout.flush(); sys.stderr.flush()
    os._exit(%(memory_exit)d if issubclass(kind, MemoryError) else 1)
sys.excepthook = excepthook
sys.argv = ["main.py"]
with open("main.py", "rb") as f:
    source = f.read()
namespace = {"__name__": "__main__", "__file__": "main.py", "__builtins__": __builtins__}
del f, name, value, limits, excepthook
exec(compile(source, "main.py", "exec"), namespace)
"""


class SandboxUnavailable(RuntimeError):
  """This machine cannot create the sandbox (bubblewrap or libseccomp missing, namespaces refused)."""


@dataclasses.dataclass(frozen=True)
class SandboxResult:
  stdout: str
  stderr: str
  status: str
  returncode: int | None
  duration_s: float


@functools.cache
def seccomp_filter() -> bytes:
  """The BPF program (libseccomp's export) that refuses `BLOCKED_SYSCALLS` with EPERM."""
  path = ctypes.util.find_library("seccomp")
  if path is None:
    raise SandboxUnavailable("the sandbox needs libseccomp (apt-get install libseccomp2)")
  lib = ctypes.CDLL(path, use_errno=True)
  lib.seccomp_init.restype = ctypes.c_void_p
  lib.seccomp_init.argtypes = [ctypes.c_uint32]
  lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
  lib.seccomp_rule_add.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint]
  lib.seccomp_export_bpf.argtypes = [ctypes.c_void_p, ctypes.c_int]
  lib.seccomp_release.argtypes = [ctypes.c_void_p]
  allow, deny_eperm = 0x7FFF0000, 0x00050000 | 1        # SCMP_ACT_ALLOW, SCMP_ACT_ERRNO(EPERM)
  context = lib.seccomp_init(allow)
  read_fd, write_fd = os.pipe()
  try:
    for name in BLOCKED_SYSCALLS:
      number = lib.seccomp_syscall_resolve_name(name.encode())
      if number >= 0 and lib.seccomp_rule_add(context, deny_eperm, number, 0) != 0:
        raise SandboxUnavailable(f"libseccomp refused a rule for {name}")
    if lib.seccomp_export_bpf(context, write_fd) != 0:
      raise SandboxUnavailable("libseccomp could not export the filter")
    os.close(write_fd)
    write_fd = -1
    with os.fdopen(read_fd, "rb") as f:
      read_fd = -1
      return f.read()
  finally:
    lib.seccomp_release(context)
    for fd in (read_fd, write_fd):
      if fd >= 0:
        os.close(fd)


def _reachable_by(path: str, uid: int) -> bool:
  """Whether user `uid` (not the owner of anything here) may traverse to and execute `path`."""
  if uid == os.geteuid():
    return os.access(path, os.X_OK)
  parts = os.path.realpath(path).split(os.sep)
  for i in range(2, len(parts) + 1):
    mode = os.stat(os.sep.join(parts[:i]) or os.sep).st_mode
    if not mode & stat.S_IXOTH:
      return False
  return True


@functools.cache
def _interpreter(uid: int) -> tuple[str, str]:
  """(installation prefix, interpreter) for the sandbox: this Python's base installation when the
  sandbox user can reach it, else the system's python3."""
  candidates = [(sys.base_prefix, os.path.realpath(getattr(sys, "_base_executable", sys.executable))),
                ("/usr", os.path.realpath("/usr/bin/python3"))]
  for prefix, executable in candidates:
    if os.path.exists(executable) and _reachable_by(executable, uid) and _reachable_by(
        sysconfig.get_paths()["stdlib"] if prefix == sys.base_prefix else prefix, uid):
      return prefix, executable
  raise SandboxUnavailable(f"no Python interpreter that uid {uid} can run: tried {[c[1] for c in candidates]}")


def _sandbox_uid() -> int:
  """Root hands the sandbox to `nobody`; anyone else runs it as themselves."""
  return NOBODY if os.geteuid() == 0 else os.geteuid()


def sandbox_interpreter() -> str:
  """The Python interpreter that sandboxed code runs with (for comparing against a bare start)."""
  return _interpreter(_sandbox_uid())[1]


def bwrap_command(code_fd: int, seccomp_fd: int, *, launcher: str, disk_bytes: int, uid: int) -> list[str]:
  """The bubblewrap command line of one run (see the module docstring for what each part is for)."""
  prefix, executable = _interpreter(uid)
  command = [shutil.which("bwrap") or "bwrap", "--unshare-all", "--unshare-user", "--disable-userns",
             "--die-with-parent", "--new-session", "--uid", str(NOBODY), "--gid", str(NOBODY),
             "--ro-bind", "/usr", "/usr", "--symlink", "usr/lib", "/lib", "--symlink", "usr/lib64", "/lib64",
             "--symlink", "usr/bin", "/bin"]
  if prefix != "/usr" and not prefix.startswith("/usr/"):
    command += ["--ro-bind", prefix, prefix]
  command += ["--proc", "/proc", "--dev", "/dev",
              "--size", str(SMALL_TMPFS_BYTES), "--tmpfs", "/dev/shm",
              "--size", str(SMALL_TMPFS_BYTES), "--tmpfs", "/tmp",
              "--size", str(disk_bytes), "--tmpfs", "/box",
              "--perms", "0644", "--file", str(code_fd), "/box/main.py",
              "--remount-ro", "/dev", "--remount-ro", "/",      # writable: /box, /tmp, /dev/shm only
              "--seccomp", str(seccomp_fd), "--chdir", "/box", "--clearenv",
              "--setenv", "HOME", "/box", "--setenv", "PATH", "/usr/bin",
              "--setenv", "PYTHONDONTWRITEBYTECODE", "1",
              "--setenv", "MALLOC_ARENA_MAX", "2",   # threads reserve 8 MB of stack, not 64 MB of arena
              executable, "-I", "-S", "-c", launcher]
  return command


def _check_available() -> None:
  if shutil.which("bwrap") is None:
    raise SandboxUnavailable("the sandbox needs bubblewrap: `apt-get install bubblewrap` (setup.sh does it)")
  if _sandbox_uid() != os.geteuid() and shutil.which("setpriv") is None:
    raise SandboxUnavailable("the sandbox needs util-linux's setpriv to hand the run to user nobody")
  seccomp_filter()
  _interpreter(_sandbox_uid())


def unavailable_reason() -> str | None:
  """Why this machine cannot run the sandbox, or None when it can."""
  try:
    _check_available()
  except SandboxUnavailable as error:
    return str(error)
  return None


def _memfd(name: str, data: bytes) -> int:
  fd = os.memfd_create(name, 0)
  os.write(fd, data)
  os.lseek(fd, 0, os.SEEK_SET)
  return fd


def _children(pid: int) -> list[int]:
  try:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
      return [int(p) for p in f.read().split()]
  except OSError:
    return []


def _alive(pid: int) -> bool:
  """A zombie is dead: a PID namespace's first process only becomes one once all else in it is gone."""
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().rsplit(")", 1)[1].split()[0] != "Z"
  except OSError:
    return False


def _wait_gone(pids: list[int], timeout_s: float) -> None:
  """Wait until killed processes are dead, so none outlives the call."""
  deadline = time.monotonic() + timeout_s
  for pid in pids:
    while _alive(pid) and time.monotonic() < deadline:
      time.sleep(0.005)


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


def _status(returncode: int, timed_out: bool, overflow: bool) -> str:
  """How the run ended → status. bwrap passes the code's exit status on, and 128 + N for signal N."""
  if timed_out:
    return "timeout"
  if overflow:
    return "output_limit"
  if returncode == 0:
    return "ok"
  if returncode == MEMORY_EXIT_STATUS:
    return "memory"
  if returncode in (-signal.SIGXCPU, 128 + signal.SIGXCPU):
    return "timeout"
  return "error"


def run_python(code: str, *, timeout_s: float = 10.0, memory_mb: int = 512, max_output_bytes: int = 1 << 16,
               max_file_bytes: int = 16 << 20, disk_mb: int = 64) -> SandboxResult:
  """Run `code` in a fresh sandbox; never raises for anything the code is or does."""
  _check_available()
  if timeout_s <= 0 or memory_mb <= 0 or max_output_bytes <= 0 or disk_mb <= 0:
    raise ValueError("timeout_s, memory_mb, max_output_bytes and disk_mb must be > 0")
  start = time.monotonic()
  uid = _sandbox_uid()
  launcher = _LAUNCHER % dict(memory=memory_mb << 20, cpu=int(timeout_s) + 1, fsize=max_file_bytes,
                              nproc=MAX_PROCESSES, memory_exit=MEMORY_EXIT_STATUS)
  # Any str: a lone surrogate reaches the interpreter as invalid UTF-8 and is its SyntaxError.
  code_fd = _memfd("main.py", code.encode("utf-8", errors="surrogatepass"))
  seccomp_fd = _memfd("seccomp", seccomp_filter())
  try:
    command = bwrap_command(code_fd, seccomp_fd, launcher=launcher, disk_bytes=disk_mb << 20, uid=uid)
    if uid != os.geteuid():
      # setpriv, not Popen(user=...): that would make Python fork() instead of vfork(), and a fork()
      # while gRPC threads are busy (a trainer's rollout workers) loses in-flight calls.
      command = [shutil.which("setpriv") or "setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups",
                 "--", *command]
    process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, pass_fds=(code_fd, seccomp_fd), env={},
                               start_new_session=True)
  finally:
    os.close(code_fd)
    os.close(seccomp_fd)

  inside = []   # bwrap's child, the PID namespace's first process: when it is gone, everything in it is

  def stop():           # killing the namespace's first process kills everything in the namespace
    inside.extend(_children(process.pid))
    for pid in [*inside, None]:
      try:
        os.kill(pid, signal.SIGKILL) if pid else os.killpg(process.pid, signal.SIGKILL)
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
  _wait_gone(inside, timeout_s=5.0)
  overflow = any(r.overflow for r in readers) or readers[0].size + readers[1].size > max_output_bytes
  return SandboxResult(stdout=readers[0].text(), stderr=readers[1].text(),
                       status=_status(process.returncode, timed_out, overflow),
                       returncode=process.returncode, duration_s=time.monotonic() - start)


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
