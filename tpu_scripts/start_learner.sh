#!/usr/bin/env bash
# Start the learner on every host of the slice (jax.distributed over the slice) against the servers.
#
#   ADDRESSES=10.0.0.2:9000,10.0.0.3:9000 CONFIG=configs/qwen2_5_math.py:7b \
#     bash tpu_scripts/start_learner.sh [--dry-run]
#
# Settings (environment): ADDRESSES (printed by start_servers.sh), CONFIG, WORKDIR, plus
# those of create_tpu_vms.sh. The learner runs detached (a dropped ssh connection does not stop it):
# logs.sh pulls its log, stop.sh stops it (SIGTERM: it saves a checkpoint first). Rerunning the same
# command resumes from WORKDIR's checkpoints.

# shellcheck source=tpu_scripts/common.sh
source "$(dirname "$0")/common.sh"
parse_flags "$@"

ADDRESSES="${ADDRESSES:-}"
if [[ -z "$ADDRESSES" ]]; then
  echo "ADDRESSES is empty: set it to the host:port list printed by start_servers.sh" >&2
  exit 2
fi
address_tuple="('${ADDRESSES//,/\',\'}',)"
checkpoint_flag="${CHECKPOINT:+ --config.model.checkpoint=$CHECKPOINT}"   # default: the config's

ensure_token
distribute_token "$LEARNER_TPU" all          # the servers' shared token (start_servers.sh created it)
learner_command="cd $REMOTE_DIR && exec .venv/bin/python -m copc_jax.main --distributed \
--config=$CONFIG --workdir=$WORKDIR$checkpoint_flag \
--config.rollout.addresses=\"$address_tuple\" --config.rollout.auth_token_file=$REMOTE_TOKEN"
on_tpu "$LEARNER_TPU" all "$(detached "$REMOTE_DIR/learner.log" "$learner_command")"
