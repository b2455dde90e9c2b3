import os
import shutil
import sys
import tempfile

# Tests run on CPU with several fake devices; set before jax is imported.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
# TPU topologies for the AOT tests (libtpu, no TPU): no metadata server, and libtpu's one-process lock
# does not stop the two test processes (or a study running beside them) from loading it.
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
sys.path.insert(0, os.path.dirname(__file__))

# Many tests compile the same small programs again: in fresh objects, in the pytest-xdist workers and
# in the processes they start (main runs, JetStream servers, multi-process workers, notebook kernels).
# One persistent compilation cache per test session, passed on through the environment (which those
# processes inherit, and which jax reads at import), turns the repeats into cache hits. The cache only
# skips XLA's compiler: a program is keyed by its HLO, devices and flags, so results are unchanged.
# Set by the pytest process that starts first (the xdist controller) and removed by it at the end.
OWN_CACHE = "JAX_COMPILATION_CACHE_DIR" not in os.environ
if OWN_CACHE:
  os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="copc_jax_test_cache_")
  os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0.2"

import jax  # noqa: E402, F401


def pytest_sessionfinish(session, exitstatus):
  if OWN_CACHE and not hasattr(session.config, "workerinput"):
    shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
