#!/usr/bin/env bash
# One single-host TPU VM (e.g. v5litepod-8 or v6e-8) for the whole run: a JetStream server on the
# first half of its chips and the learner on the other half, each process seeing only its own chips.
#
#   PROJECT=my-project SINGLE_TPU=copc-one CONFIG=configs/qwen2_5_math.py:1.5b \
#     bash tpu_scripts/single_host.sh [--dry-run]
#
# The VM comes from create_tpu_vms.sh with NUM_SERVERS=0 and LEARNER_TPU/LEARNER_TYPE set to it, and
# install.sh / stage.sh as usual. Chips are split with libtpu's per-process settings (TPU_VISIBLE_CHIPS,
# TPU_CHIPS_PER_PROCESS_BOUNDS, TPU_PROCESS_BOUNDS, each process its own TPU_PROCESS_PORT); the
# server listens on 127.0.0.1 only. Settings (environment): SINGLE_TPU, SERVER_CHIPS (default 0,1,2,3),
# LEARNER_CHIPS (4,5,6,7), CHIPS_BOUNDS (each half's chip grid, default 2,2,1), CONFIG, WORKDIR.

# shellcheck source=tpu_scripts/common.sh
source "$(dirname "$0")/common.sh"
parse_flags "$@"

SINGLE_TPU="${SINGLE_TPU:-$LEARNER_TPU}"
SERVER_CHIPS="${SERVER_CHIPS:-0,1,2,3}"
LEARNER_CHIPS="${LEARNER_CHIPS:-4,5,6,7}"
CHIPS_BOUNDS="${CHIPS_BOUNDS:-2,2,1}"
values="$(config_values rollout.slots rollout.max_prefill_length rollout.max_length model.checkpoint \
  rollout.server_dtype)"
read -r slots prefill length checkpoint dtype <<<"$values"
chips() {   # libtpu settings of a process that sees only the chips $1, on port $2
  echo "TPU_VISIBLE_CHIPS=$1 TPU_CHIPS_PER_PROCESS_BOUNDS=$CHIPS_BOUNDS TPU_PROCESS_BOUNDS=1,1,1 TPU_PROCESS_PORT=$2"
}
server_command="cd $REMOTE_DIR && rm -f server.ready && $(chips "$SERVER_CHIPS" 8476) exec .venv/bin/python \
-m copc_jax.rollout.serve --checkpoint=$checkpoint --host=127.0.0.1 --port=$SERVER_PORT --slots=$slots \
--max_prefill_length=$prefill --max_length=$length --dtype=$dtype --version=-1 --weights_root=$WORKDIR \
--ready_file=server.ready"
learner_command="cd $REMOTE_DIR && $(chips "$LEARNER_CHIPS" 8477) exec .venv/bin/python -m copc_jax.main \
--config=$CONFIG --workdir=$WORKDIR --config.rollout.addresses=\"('127.0.0.1:$SERVER_PORT',)\""
LEARNER_TPU="$SINGLE_TPU"       # zone_of: this VM is in LEARNER_ZONE
on_tpu "$SINGLE_TPU" 0 "$(detached "$REMOTE_DIR/server.log" "$server_command")"
on_tpu "$SINGLE_TPU" 0 "$(ready_wait "$REMOTE_DIR/server.ready" "$REMOTE_DIR/server.log")"
on_tpu "$SINGLE_TPU" 0 "$(detached "$REMOTE_DIR/learner.log" "$learner_command")"
