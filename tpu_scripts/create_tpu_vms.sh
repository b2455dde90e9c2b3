#!/usr/bin/env bash
# Create the TPU VMs of a run: one multi-host learner slice and NUM_SERVERS server VMs.
#
#   PROJECT=my-project ZONE=us-east5-a bash tpu_scripts/create_tpu_vms.sh [--dry-run]
#
# Settings (environment): LEARNER_TPU, LEARNER_TYPE, SERVER_TPU_PREFIX, SERVER_TYPE,
# NUM_SERVERS; LEARNER_RUNTIME_VERSION and SERVER_RUNTIME_VERSION default to the TPU software version of
# each accelerator type (see tpu_scripts/common.sh).

# shellcheck source=tpu_scripts/common.sh
source "$(dirname "$0")/common.sh"
parse_flags "$@"

run gcloud compute tpus tpu-vm create "$LEARNER_TPU" --project="$PROJECT" --zone="$ZONE" \
  --accelerator-type="$LEARNER_TYPE" --version="$LEARNER_RUNTIME_VERSION"
for i in $(seq 0 $((NUM_SERVERS - 1))); do
  run gcloud compute tpus tpu-vm create "$(server_name "$i")" --project="$PROJECT" --zone="$ZONE" \
    --accelerator-type="$SERVER_TYPE" --version="$SERVER_RUNTIME_VERSION"
done
