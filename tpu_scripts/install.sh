#!/usr/bin/env bash
# Install copc_jax with TPU jax on every host of the learner slice and on every server VM.
#
#   PROJECT=my-project bash tpu_scripts/install.sh [--dry-run]
#
# On each host: the code sandbox's bubblewrap and libseccomp (sudo apt-get), uv, a Python $UV_PYTHON
# venv (the TPU images' Python is 3.10), the package with its train and tpu extras (jax[tpu]
# pinned to JAX_VERSION) and JetStream without its TensorFlow requirements. Nothing of the dev extra
# (no torch). Settings (environment): REPO_URL, REPO_REF, REMOTE_DIR, UV_PYTHON, JAX_VERSION, plus those
# of create_tpu_vms.sh.

# shellcheck source=tpu_scripts/common.sh
source "$(dirname "$0")/common.sh"
parse_flags "$@"

install_command="set -e; sudo apt-get update -qq && sudo apt-get install -y -qq bubblewrap libseccomp2; \
command -v uv >/dev/null || curl -LsSf https://astral.sh/uv/install.sh | sh; export PATH=\$HOME/.local/bin:\$PATH; \
if [ ! -d $REMOTE_DIR ]; then git clone $REPO_URL $REMOTE_DIR; fi; \
cd $REMOTE_DIR && git fetch -q origin && git checkout -q $REPO_REF && \
uv venv --python $UV_PYTHON .venv && uv pip install --python .venv/bin/python -e '.[train,tpu]' \
'jax[tpu]==$JAX_VERSION' && uv pip install --python .venv/bin/python --no-deps google-jetstream==0.2.2"

on_tpu "$LEARNER_TPU" all "$install_command"
for i in $(seq 0 $((NUM_SERVERS - 1))); do
  on_tpu "$(server_name "$i")" 0 "$install_command"
done
