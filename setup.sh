#!/usr/bin/env bash
# One setup command: a virtual environment in .venv with everything the project needs.
#   bash setup.sh          # the package (editable) with its train and dev extras, JetStream, CPU PyTorch
# JetStream 0.2.2 is installed with --no-deps: its declared requirements pull seqio and
# TensorFlow, which copc_jax never uses (see README).
set -euo pipefail
cd "$(dirname "$0")"
# The code sandbox (copc_jax/envs/sandbox.py) runs model-written code in bubblewrap with a seccomp
# filter from libseccomp; without them it refuses to run code.
if ! command -v bwrap >/dev/null || ! ldconfig -p 2>/dev/null | grep -q libseccomp.so.2; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    packages="bubblewrap libseccomp2"
    apt-get install -y -qq $packages >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq $packages >/dev/null; }
  else
    echo "setup: the code sandbox needs bubblewrap and libseccomp (e.g. sudo apt-get install bubblewrap libseccomp2)" >&2
  fi
fi
PYTHON="${PYTHON:-python3}"
VENV="${COPC_VENV:-.venv}"
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
pip=("$VENV/bin/python" -m pip install --quiet)
"${pip[@]}" --upgrade pip
"${pip[@]}" -r requirements-dev.txt                # the package, editable, with its train and dev extras
"${pip[@]}" --no-deps google-jetstream==0.2.2
# CPU PyTorch for the logits-parity tests (PyPI's Linux build is the multi-GB CUDA one): from a local
# wheel or the PyTorch CPU index; without it those tests skip.
"${pip[@]}" "torch==2.13.0+cpu" 2>/dev/null \
  || "${pip[@]}" "torch==2.13.0+cpu" --extra-index-url https://download.pytorch.org/whl/cpu \
  || echo "setup: no CPU PyTorch; the logits-parity tests against transformers will skip" >&2
echo "setup done: $VENV"
