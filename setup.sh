#!/usr/bin/env bash
# One setup command: a virtual environment in .venv with everything the project needs.
#   bash setup.sh          # runtime + test dependencies
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
"$VENV/bin/python" -m pip install --quiet --upgrade pip
"$VENV/bin/python" -m pip install --quiet -r requirements-dev.txt
"$VENV/bin/python" -m pip install --quiet --no-deps google-jetstream==0.2.2
"$VENV/bin/python" -m pip install --quiet --no-deps -e .
echo "setup done: $VENV"
