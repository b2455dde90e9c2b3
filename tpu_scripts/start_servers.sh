#!/usr/bin/env bash
# Start one JetStream rollout server per server VM and print the addresses for the learner.
#
#   CONFIG=configs/qwen2_5_math.py:7b bash tpu_scripts/start_servers.sh [--dry-run]
#
# Settings (environment): CONFIG (the learner's: the servers' slots, prompt and total lengths and
# checkpoint are its rollout.slots, max_prefill_length, max_length and model.checkpoint unless SLOTS,
# MAX_PREFILL_LENGTH, MAX_LENGTH, CHECKPOINT are set; CHECKPOINT is a Hugging Face directory on each
# VM; the dtype and the split of each VM's chips, data groups x tensor, are its rollout.server_dtype,
# server_data_parallelism and server_tensor_parallelism), SERVER_PORT, AUTH_TOKEN_FILE (the shared token, created if missing), plus those of
# create_tpu_vms.sh. The servers load new weights only from paths under WORKDIR, which must be shared
# with the learner, and answer only calls that carry the token. Each server runs detached and the
# script waits (READY_TIMEOUT_S, default 1800) until every one has written its ready file (it accepts
# requests once compiled); stop.sh stops them.

# shellcheck source=tpu_scripts/common.sh
source "$(dirname "$0")/common.sh"
parse_flags "$@"

values="$(config_values rollout.slots rollout.max_prefill_length rollout.max_length model.checkpoint \
  rollout.server_dtype rollout.server_data_parallelism rollout.server_tensor_parallelism)"
read -r config_slots config_prefill config_length config_checkpoint SERVER_DTYPE DATA_PARALLELISM \
  TENSOR_PARALLELISM <<<"$values"
SLOTS="${SLOTS:-$config_slots}"
MAX_PREFILL_LENGTH="${MAX_PREFILL_LENGTH:-$config_prefill}"
MAX_LENGTH="${MAX_LENGTH:-$config_length}"
CHECKPOINT="${CHECKPOINT:-$config_checkpoint}"
echo "servers for $CONFIG: $CHECKPOINT, slots $SLOTS, max_prefill_length $MAX_PREFILL_LENGTH," \
  "max_length $MAX_LENGTH, $SERVER_DTYPE, data $DATA_PARALLELISM x tensor $TENSOR_PARALLELISM"

ensure_token
addresses=()
for i in $(seq 0 $((NUM_SERVERS - 1))); do
  name="$(server_name "$i")"
  distribute_token "$name" 0
  # Every call must carry the shared token; weights are read only from the run's WORKDIR.
  server_command="cd $REMOTE_DIR && rm -f server.ready && exec .venv/bin/python -m copc_jax.rollout.serve \
--checkpoint=$CHECKPOINT --host=0.0.0.0 --port=$SERVER_PORT --slots=$SLOTS \
--max_prefill_length=$MAX_PREFILL_LENGTH --max_length=$MAX_LENGTH --seed=$i --version=-1 \
--dtype=$SERVER_DTYPE --data_parallelism=$DATA_PARALLELISM --tensor_parallelism=$TENSOR_PARALLELISM \
--auth_token_file=$REMOTE_TOKEN --weights_root=$WORKDIR --ready_file=server.ready"
  on_tpu "$name" 0 "$(detached "$REMOTE_DIR/server.log" "$server_command")"
  addresses+=("$(internal_ip "$name"):$SERVER_PORT")
done
for i in $(seq 0 $((NUM_SERVERS - 1))); do
  on_tpu "$(server_name "$i")" 0 "$(ready_wait "$REMOTE_DIR/server.ready" "$REMOTE_DIR/server.log")"
done
echo "ADDRESSES=$(IFS=,; echo "${addresses[*]}")"
