#!/usr/bin/env bash
# Stop the run: the learner on every host of the slice (SIGTERM: it saves a checkpoint before it
# exits, and the same start_learner.sh command resumes it), then the servers.
#
#   PROJECT=my-project bash tpu_scripts/stop.sh [--dry-run]
#
# Settings (environment): those of create_tpu_vms.sh. The VMs stay; delete_tpu_vms.sh removes them.

# shellcheck source=tpu_scripts/common.sh
source "$(dirname "$0")/common.sh"
parse_flags "$@"

# Wait up to 10 minutes for the checkpoint the SIGTERM saves.
on_tpu "$LEARNER_TPU" all "pkill -TERM -f 'copc_jax.main' || true; for i in \$(seq 1 120); do \
pgrep -f 'copc_jax.main' >/dev/null || exit 0; sleep 5; done; echo 'learner still running'; exit 1"
for i in $(seq 0 $((NUM_SERVERS - 1))); do
  on_tpu "$(server_name "$i")" 0 "pkill -TERM -f 'copc_jax.rollout.serve' || true"
done
