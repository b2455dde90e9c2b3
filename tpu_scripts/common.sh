#!/usr/bin/env bash
# Shared by the launch scripts: settings (environment variables), --dry-run, and helpers.
# Every script prints each command before running it; with --dry-run it only prints.

set -euo pipefail

# The TPU software (runtime) version of an accelerator type (cloud.google.com/tpu/docs/runtimes).
runtime_version_for() {
  case "$1" in
    v6e-*) echo "v2-alpha-tpuv6e" ;;
    v5p-*) echo "v2-alpha-tpuv5" ;;
    v5litepod-* | v5e-*) echo "v2-alpha-tpuv5-lite" ;;
    v4-* | v3-* | v2-*) echo "tpu-ubuntu2204-base" ;;
    *)
      echo "no TPU software version known for accelerator type '$1': set LEARNER_RUNTIME_VERSION or" \
        "SERVER_RUNTIME_VERSION" >&2
      return 1
      ;;
  esac
}

# The zones that offer each TPU generation (cloud.google.com/tpu/docs/regions-zones, North America and
# Europe as of 2026); SKIP_ZONE_CHECK=1 accepts a zone this table does not know yet.
zones_for() {
  case "$1" in
    v6e-*) echo "us-central1-b us-east1-d us-east5-a us-east5-b europe-west4-a" ;;
    v5p-*) echo "us-central1-a us-east5-a" ;;
    v5litepod-* | v5e-*) echo "us-central1-a us-south1-a us-west1-c us-west4-a" ;;
    v4-*) echo "us-central2-b" ;;
    *) echo "" ;;
  esac
}

# Refuse, in one line, an accelerator type in a zone that does not offer it (dry runs too).
check_zone() {
  local role="$1" type="$2" zone="$3" zones
  zones="$(zones_for "$type")"
  if [[ "${SKIP_ZONE_CHECK:-0}" != 1 && " $zones " != *" $zone "* ]]; then
    echo "${role}_ZONE=$zone does not offer $type (${role}_TYPE); zones that do: ${zones:-none known}" \
      "(SKIP_ZONE_CHECK=1 to try anyway)" >&2
    exit 2
  fi
}

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-$ROOT/.venv/bin/python}"          # reads the config (bash setup.sh installs it)
PROJECT="${PROJECT:-your-gcp-project}"
ZONE="${ZONE:-us-central1-a}"                       # offers v5p and v5e; each role may have its own
LEARNER_ZONE="${LEARNER_ZONE:-$ZONE}"
SERVER_ZONE="${SERVER_ZONE:-$ZONE}"
LEARNER_TPU="${LEARNER_TPU:-copc-learner}"          # a multi-host slice: one learner process per host
LEARNER_TYPE="${LEARNER_TYPE:-v5p-32}"
LEARNER_RUNTIME_VERSION="${LEARNER_RUNTIME_VERSION:-$(runtime_version_for "$LEARNER_TYPE")}"
SERVER_TPU_PREFIX="${SERVER_TPU_PREFIX:-copc-server}"  # single-host VMs, one JetStream server each
SERVER_TYPE="${SERVER_TYPE:-v5litepod-8}"
SERVER_RUNTIME_VERSION="${SERVER_RUNTIME_VERSION:-$(runtime_version_for "$SERVER_TYPE")}"
TIER="${TIER:-on-demand}"         # queued resources: on-demand | spot | reserved | best-effort
JAX_VERSION="${JAX_VERSION:-0.10.2}"   # jax[tpu] on the VMs: the version the tests ran with (pyproject's tpu extra)
UV_PYTHON="${UV_PYTHON:-3.12}"    # the VMs' Python, through uv (the images' own is 3.10; copc_jax needs 3.11+)
NUM_SERVERS="${NUM_SERVERS:-2}"
SERVER_PORT="${SERVER_PORT:-9000}"
REPO_URL="${REPO_URL:-https://github.com/copc-jax/copc_jax.git}"
REPO_REF="${REPO_REF:-main}"
REMOTE_DIR="${REMOTE_DIR:-copc_jax}"
CONFIG="${CONFIG:-configs/qwen2_5_math.py:7b}"
CHECKPOINT="${CHECKPOINT:-}"       # a Hugging Face directory on every host; default: CONFIG's model.checkpoint
WORKDIR="${WORKDIR:-/mnt/runs/copc_qwen2_5_7b_math}"    # shared by the learner hosts and the servers

DRY_RUN=0

usage() {
  sed -n '2,/^$/p' "$0" | sed 's/^# \{0,1\}//'
}

parse_flags() {
  for arg in "$@"; do
    case "$arg" in
      --dry-run) DRY_RUN=1 ;;
      -h | --help) usage; exit 0 ;;
      *) echo "unknown argument: $arg (allowed: --dry-run, --help)" >&2; exit 2 ;;
    esac
  done
  if [[ "$DRY_RUN" == 0 ]] && ! command -v gcloud >/dev/null; then
    echo "gcloud is not installed; install the Google Cloud CLI or use --dry-run" >&2
    exit 1
  fi
}

# Print a command, then run it unless --dry-run.
run() {
  echo "+ $*"
  if [[ "$DRY_RUN" == 0 ]]; then
    "$@"
  fi
}

# Values of CONFIG's fields, e.g. `config_values rollout.slots rollout.max_length` → "64 16384".
config_values() {
  if [[ ! -x "$PYTHON" ]]; then
    echo "cannot read $CONFIG: no Python at $PYTHON (run bash setup.sh, or set PYTHON)" >&2
    return 1
  fi
  (cd "$ROOT" && "$PYTHON" -m copc_jax.config_values "$CONFIG" "$@")
}

server_name() {
  echo "${SERVER_TPU_PREFIX}-$1"
}

# The zone of a VM of this run: the learner's or the servers'.
zone_of() {
  if [[ "$1" == "$LEARNER_TPU" ]]; then echo "$LEARNER_ZONE"; else echo "$SERVER_ZONE"; fi
}

# Run a shell command on one worker (or "all") of a TPU VM.
on_tpu() {
  local name="$1" worker="$2" command="$3"
  run gcloud compute tpus tpu-vm ssh "$name" --project="$PROJECT" --zone="$(zone_of "$name")" \
    --worker="$worker" --command="$command"
}

# A remote command that waits (READY_TIMEOUT_S, default 1800) until a server has written its ready file.
ready_wait() {
  local ready="$1" log="$2"
  echo "for i in \$(seq 1 $((${READY_TIMEOUT_S:-1800} / 10))); do test -s $ready && exit 0; sleep 10; done;" \
    "echo 'not ready: see $log'; tail -n 20 $log; exit 1"
}

# A command that runs on after the ssh session ends (a dropped connection must not stop a run).
detached() {
  local log="$1" command="$2"
  echo "nohup setsid bash -c $(printf %q "$command") > $log 2>&1 < /dev/null &"
}

# Internal IP address of a single-host TPU VM (a placeholder in --dry-run).
internal_ip() {
  if [[ "$DRY_RUN" == 1 ]]; then
    echo "IP_OF_$1"
  else
    gcloud compute tpus tpu-vm describe "$1" --project="$PROJECT" --zone="$(zone_of "$1")" \
      --format='value(networkEndpoints[0].ipAddress)'
  fi
}

# The shared token the servers require on every call (`copc_jax.rollout.auth`): created once on this
# machine (owner-only), copied to a TPU VM's workers as $REMOTE_DIR/auth_token (mode 600).
AUTH_TOKEN_FILE="${AUTH_TOKEN_FILE:-$HOME/.config/copc_jax/auth_token}"
REMOTE_TOKEN="$REMOTE_DIR/auth_token"

ensure_token() {
  if [[ ! -s "$AUTH_TOKEN_FILE" ]]; then
    echo "+ creating the servers' shared token in $AUTH_TOKEN_FILE"
    if [[ "$DRY_RUN" == 0 ]]; then
      (umask 077 && mkdir -p "$(dirname "$AUTH_TOKEN_FILE")" && head -c 32 /dev/urandom | base64 > "$AUTH_TOKEN_FILE")
    fi
  fi
}

# Copy the token to every given worker of a TPU VM, readable by its owner alone.
distribute_token() {
  local name="$1" worker="$2"
  run gcloud compute tpus tpu-vm scp "$AUTH_TOKEN_FILE" "$name:$REMOTE_TOKEN" --project="$PROJECT" \
    --zone="$(zone_of "$name")" --worker="$worker"
  on_tpu "$name" "$worker" "chmod 600 $REMOTE_TOKEN"
}
