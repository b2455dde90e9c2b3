"""The bare package installs on its own (`pip install .`: jax and numpy, nothing of the trainer) and
its estimator runs."""

import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

RUN = """
import importlib.util
import jax.numpy as jnp
from copc_jax import estimators, losses, presets

preset = presets.get_preset("copc")
rewards = jnp.zeros((2, 5)).at[:, -1].set(1.0)
mask = jnp.ones((2, 5), bool)
zeros = jnp.zeros((2, 5))
advantages, returns = estimators.coupled_advantages(rewards, zeros, zeros, zeros, mask,
                                                    **preset.estimator.estimator_kwargs())
assert advantages.shape == (2, 5) and float(returns[0, 0]) == 1.0, (advantages, returns)
missing = [m for m in ("flax", "optax", "transformers", "orbax") if importlib.util.find_spec(m)]
print("ok", missing)
"""


@pytest.mark.slow
def test_the_bare_package_installs_into_a_fresh_venv_and_runs_the_estimator(tmp_path):
  source = tmp_path / "src"
  source.mkdir()
  for name in ("pyproject.toml", "README.md"):
    shutil.copy(os.path.join(ROOT, name), source / name)
  shutil.copytree(os.path.join(ROOT, "copc_jax"), source / "copc_jax",
                  ignore=shutil.ignore_patterns("__pycache__"))
  venv = tmp_path / "venv"
  subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
  python = str(venv / "bin" / "python")
  install = subprocess.run([python, "-m", "pip", "install", "--quiet", str(source)], capture_output=True,
                           text=True, timeout=900)
  assert install.returncode == 0, install.stderr[-2000:]
  out = subprocess.run([python, "-c", RUN], capture_output=True, text=True, timeout=300, cwd=tmp_path)
  assert out.returncode == 0, out.stderr[-2000:]
  assert out.stdout.strip() == "ok []"          # the estimator ran, and no trainer dependency came along
