#!/usr/bin/env bash
# Delete the queued resources (and their TPU VMs) created by create_tpu_vms.sh.
#
#   PROJECT=my-project bash tpu_scripts/delete_tpu_vms.sh [--dry-run]

# shellcheck source=tpu_scripts/common.sh
source "$(dirname "$0")/common.sh"
parse_flags "$@"

run gcloud compute tpus queued-resources delete "$LEARNER_TPU" --project="$PROJECT" --zone="$LEARNER_ZONE" \
  --force --quiet
for i in $(seq 0 $((NUM_SERVERS - 1))); do
  run gcloud compute tpus queued-resources delete "$(server_name "$i")" --project="$PROJECT" \
    --zone="$SERVER_ZONE" --force --quiet
done
