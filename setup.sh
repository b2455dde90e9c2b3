#!/usr/bin/env bash
# One setup command: a virtual environment in .venv with everything the project needs.
#   bash setup.sh          # runtime + test dependencies
# JetStream 0.2.2 is installed with --no-deps: its declared requirements pull seqio and
# TensorFlow, which copc_jax never uses (see README).
set -euo pipefail
cd "$(dirname "$0")"
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
