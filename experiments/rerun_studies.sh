#!/usr/bin/env bash
# The studies rerun on the new learner (issue 27, item 7), in the order their readings matter: each step
# is resumable (a run already in the study's JSON from the seed's shipped warm start is read, not run
# again; one from another warm start is run again and kept as superseded_runs), so run this again in
# every session until it finishes. Hours: 4-13 minutes a run on 2 CPU cores, about 220 runs in all.
#
#   git worktree add ../copc-rerun HEAD && cd ../copc-rerun      # a fixed commit: later edits stay out
#   setsid nohup experiments/rerun_studies.sh ROOT > rerun.log 2>&1 &
#
# ROOT keeps the workdirs (the JSONs are enough to resume: a later session needs only them). Copy the
# JSONs (and experiments/warm_starts, if step 4 recorded the search config's) back to the main checkout,
# then render there (`run.py --rerun --render`, `run.py --render`).
set -euo pipefail
root=${1:?usage: experiments/rerun_studies.sh ROOT}
python=${PYTHON:-.venv/bin/python}
export JAX_PLATFORMS=cpu
cd "$(dirname "$0")/.."

presets() {
  "$python" -m experiments.presets_across_staleness.run --rerun --replace-other-warm-starts \
    --root "$root/presets_across_staleness" "$@"
}
# 1. Tool arithmetic at k = 64: the references, then the COPC readings, then the other baselines.
presets --cells sync_ppo_k0 async_ppo_k64
presets --cells copc_k64 copc_anchor_behavior_k64
presets --cells decoupled_ppo_k64 vtrace_k64 grpo_k64 tis_k64 icepop_k64 dr_grpo_k64 rloo_k64
# 2. Tool arithmetic at k = 16 (the whole grid: what ran above is read, not run).
presets
# 3. The joint sweep at k = 64 from the same warm starts: a cell's four seeds at a time, so each cell
#    that lands can be read; the spec's cell (h2_rho2) is copied from step 1.
joint_sweep() {
  for cell in h1.5_rho1.5 h1.5_rho2 h1.5_rho∞ h2_rho1.5 h2_rho∞ h∞_rho1.5 h∞_rho2 h∞_rho∞; do
    "$python" -m experiments.joint_sweep.run --rerun --replace-other-warm-starts --root "$root/joint_sweep" \
      --cells "${cell}_k$1"
  done
}
joint_sweep 64
# 4. Knowledge search (the second task): its warm starts recorded once (ship them: commit
#    experiments/warm_starts), then sync PPO, every preset at k = 64, and COPC and async PPO at k = 16.
"$python" - <<'EOF' || "$python" -m experiments.warm_start_store --config configs/search.py --seeds 0 1 2 3
import sys
from experiments import warm_start_store
sys.exit(0 if "search" in warm_start_store.manifest() else 1)
EOF
search() {
  "$python" -m experiments.search_stability.run --rerun --replace-other-warm-starts \
    --root "$root/search_stability" "$@"
}
#    A cell's four seeds at a time (a run takes 10-20 minutes here), so each cell that lands can be read:
#    the reference, the two COPC readings and async PPO at k = 64, the same three at k = 16 (with them
#    `copc_default --rerun` has every cell it needs), then the other baselines at k = 64.
for cell in sync_ppo_k0 copc_k64 copc_anchor_behavior_k64 async_ppo_k64 copc_k16 copc_anchor_behavior_k16 \
    async_ppo_k16 decoupled_ppo_k64 vtrace_k64 tis_k64 icepop_k64 grpo_k64 dr_grpo_k64 rloo_k64; do
  search --cells "$cell"
done
# 5. Advantage staleness of a lag-64 COPC learner of the new defaults, 4 seeds.
"$python" -m experiments.advantage_staleness.run --seeds 0 1 2 3 \
  --out experiments/advantage_staleness/results_rerun.json --root "$root/advantage_staleness"
# 6. The k = 16 halves: the joint sweep, then search (the whole grid: what ran above is read, not run).
joint_sweep 16
search
