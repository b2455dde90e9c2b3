#!/usr/bin/env bash
# Pull the run's logs back: learner.log of every host of the slice and server.log of every server,
# into LOG_DIR (default: ./tpu_logs).
#
#   PROJECT=my-project bash tpu_scripts/logs.sh [--dry-run]

# shellcheck source=tpu_scripts/common.sh
source "$(dirname "$0")/common.sh"
parse_flags "$@"

LOG_DIR="${LOG_DIR:-tpu_logs}"
run mkdir -p "$LOG_DIR"
run gcloud compute tpus tpu-vm scp "$LEARNER_TPU:$REMOTE_DIR/learner.log" "$LOG_DIR/" --project="$PROJECT" \
  --zone="$LEARNER_ZONE" --worker=0
for i in $(seq 0 $((NUM_SERVERS - 1))); do
  run gcloud compute tpus tpu-vm scp "$(server_name "$i"):$REMOTE_DIR/server.log" \
    "$LOG_DIR/server_$i.log" --project="$PROJECT" --zone="$SERVER_ZONE" --worker=0
done
