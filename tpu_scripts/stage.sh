#!/usr/bin/env bash
# Stage the model and the data on every host: where CONFIG says they are (model.checkpoint, and the
# directory of task.train_path / eval_path), from MODEL_SOURCE and DATA_SOURCE.
#
#   MODEL_SOURCE=gs://my-bucket/Qwen2.5-7B-Instruct DATA_SOURCE=gs://my-bucket/data \
#     CONFIG=configs/qwen2_5_math.py:7b bash tpu_scripts/stage.sh [--dry-run]
#
# MODEL_SOURCE: a gs:// directory (gcloud storage) or hf:<repo id> (the Hugging Face hub, through
# `hf download`); DATA_SOURCE: a gs:// directory holding the prepared task files
# (python -m copc_jax.data.prepare). Settings (environment): plus those of create_tpu_vms.sh.

# shellcheck source=tpu_scripts/common.sh
source "$(dirname "$0")/common.sh"
parse_flags "$@"

MODEL_SOURCE="${MODEL_SOURCE:?set MODEL_SOURCE to gs://... or hf:<repo id>}"
DATA_SOURCE="${DATA_SOURCE:-}"
read -r checkpoint train_path <<<"$(config_values model.checkpoint task.train_path)"
data_dir="$(dirname "$train_path")"
case "$MODEL_SOURCE" in
  gs://*) model_command="gcloud storage cp -r '$MODEL_SOURCE/*' $checkpoint/" ;;
  hf:*) model_command="$REMOTE_DIR/.venv/bin/hf download ${MODEL_SOURCE#hf:} --local-dir $checkpoint" ;;
  *) echo "MODEL_SOURCE=$MODEL_SOURCE: allowed: gs://<bucket>/<dir> or hf:<repo id>" >&2; exit 2 ;;
esac
stage_command="set -e; sudo mkdir -p $checkpoint $data_dir && sudo chown \$USER $checkpoint $data_dir; $model_command"
if [[ -n "$DATA_SOURCE" ]]; then
  stage_command+="; gcloud storage cp -r '$DATA_SOURCE/*' $data_dir/"
fi
on_tpu "$LEARNER_TPU" all "$stage_command"
for i in $(seq 0 $((NUM_SERVERS - 1))); do
  on_tpu "$(server_name "$i")" 0 "$stage_command"
done
