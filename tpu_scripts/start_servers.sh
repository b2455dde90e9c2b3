#!/usr/bin/env bash
# Start one JetStream rollout server per server VM and print the addresses for the learner.
#
#   CHECKPOINT=/mnt/models/Qwen2.5-7B bash tpu_scripts/start_servers.sh [--dry-run]
#
# Settings (environment): CHECKPOINT (a Hugging Face directory on each VM), SERVER_PORT,
# SLOTS, MAX_PREFILL_LENGTH, MAX_LENGTH, plus those of create_tpu_vms.sh.
# The servers load new weights from paths under WORKDIR, which must be shared with the learner.

# shellcheck source=tpu_scripts/common.sh
source "$(dirname "$0")/common.sh"
parse_flags "$@"

SLOTS="${SLOTS:-64}"
MAX_PREFILL_LENGTH="${MAX_PREFILL_LENGTH:-1024}"
MAX_LENGTH="${MAX_LENGTH:-8192}"

addresses=()
for i in $(seq 0 $((NUM_SERVERS - 1))); do
  name="$(server_name "$i")"
  on_tpu "$name" 0 "cd $REMOTE_DIR && nohup .venv/bin/python -m copc_jax.rollout.serve \
--checkpoint=$CHECKPOINT --host=0.0.0.0 --port=$SERVER_PORT --slots=$SLOTS \
--max_prefill_length=$MAX_PREFILL_LENGTH --max_length=$MAX_LENGTH --seed=$i --version=-1 \
> server.log 2>&1 &"
  addresses+=("$(internal_ip "$name"):$SERVER_PORT")
done
echo "ADDRESSES=$(IFS=,; echo "${addresses[*]}")"
