#!/usr/bin/env bash
# Install copc_jax with TPU jax on every host of the learner slice and on every server VM.
#
#   PROJECT=my-project bash tpu_scripts/install.sh [--dry-run]
#
# Settings (environment): REPO_URL, REPO_REF, REMOTE_DIR, plus those of create_tpu_vms.sh.

# shellcheck source=tpu_scripts/common.sh
source "$(dirname "$0")/common.sh"
parse_flags "$@"

install_command="set -e; if [ ! -d $REMOTE_DIR ]; then git clone $REPO_URL $REMOTE_DIR; fi; \
cd $REMOTE_DIR && git fetch -q origin && git checkout -q $REPO_REF && bash setup.sh && \
.venv/bin/pip install -q 'jax[tpu]'"

on_tpu "$LEARNER_TPU" all "$install_command"
for i in $(seq 0 $((NUM_SERVERS - 1))); do
  on_tpu "$(server_name "$i")" 0 "$install_command"
done
