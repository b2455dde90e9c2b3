import os
import sys

# Tests run on CPU with several fake devices; set before jax is imported.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, os.path.dirname(__file__))

# Many tests build the same small jitted functions in fresh objects; a per-session persistent
# compilation cache turns the repeated compilations into cache hits.
import tempfile  # noqa: E402

import jax  # noqa: E402

jax.config.update("jax_compilation_cache_dir", tempfile.mkdtemp(prefix="copc_jax_test_cache_"))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)
