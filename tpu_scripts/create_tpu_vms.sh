#!/usr/bin/env bash
# Request the TPU VMs of a run as queued resources (one multi-host learner slice and NUM_SERVERS
# single-host server VMs), and wait until every one is ACTIVE.
#
#   PROJECT=my-project TIER=spot bash tpu_scripts/create_tpu_vms.sh [--dry-run]
#
# Settings (environment): LEARNER_TPU, LEARNER_TYPE, LEARNER_ZONE, SERVER_TPU_PREFIX, SERVER_TYPE,
# SERVER_ZONE (both zones default to ZONE, us-central1-a, which offers v5p and v5e), NUM_SERVERS, TIER
# (on-demand | spot | reserved | best-effort); LEARNER_RUNTIME_VERSION and SERVER_RUNTIME_VERSION
# default to the TPU software version of each accelerator type. A zone that does not offer its
# accelerator type is refused before anything is requested (see tpu_scripts/common.sh).

# shellcheck source=tpu_scripts/common.sh
source "$(dirname "$0")/common.sh"
parse_flags "$@"
check_zone LEARNER "$LEARNER_TYPE" "$LEARNER_ZONE"
check_zone SERVER "$SERVER_TYPE" "$SERVER_ZONE"

gcloud_tpus=(gcloud compute tpus)
case "$TIER" in
  on-demand) tier_flags=() ;;
  spot) tier_flags=(--spot) ;;
  reserved) tier_flags=(--reserved) ;;
  best-effort) tier_flags=(--best-effort); gcloud_tpus=(gcloud alpha compute tpus) ;;   # alpha only
  *) echo "TIER=$TIER: allowed: on-demand, spot, reserved, best-effort" >&2; exit 2 ;;
esac

request() {
  local name="$1" type="$2" zone="$3" version="$4"
  run "${gcloud_tpus[@]}" queued-resources create "$name" --node-id="$name" --project="$PROJECT" \
    --zone="$zone" --accelerator-type="$type" --runtime-version="$version" "${tier_flags[@]}"
}

# Poll a queued resource until it is ACTIVE (FAILED or SUSPENDED end the script).
wait_active() {
  local name="$1" zone="$2" state=""
  echo "+ waiting for $name to be ACTIVE"
  [[ "$DRY_RUN" == 1 ]] && return 0
  while [[ "$state" != ACTIVE ]]; do
    state="$(gcloud compute tpus queued-resources describe "$name" --project="$PROJECT" --zone="$zone" \
      --format='value(state.state)')"
    case "$state" in
      FAILED | SUSPENDED) echo "$name is $state: see gcloud compute tpus queued-resources describe $name" >&2
        exit 1 ;;
    esac
    [[ "$state" == ACTIVE ]] || sleep 30
  done
}

request "$LEARNER_TPU" "$LEARNER_TYPE" "$LEARNER_ZONE" "$LEARNER_RUNTIME_VERSION"
for i in $(seq 0 $((NUM_SERVERS - 1))); do
  request "$(server_name "$i")" "$SERVER_TYPE" "$SERVER_ZONE" "$SERVER_RUNTIME_VERSION"
done
wait_active "$LEARNER_TPU" "$LEARNER_ZONE"
for i in $(seq 0 $((NUM_SERVERS - 1))); do
  wait_active "$(server_name "$i")" "$SERVER_ZONE"
done
