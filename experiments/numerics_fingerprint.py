"""The training numerics of the default config, reduced to a fingerprint that CI compares.

  python -m experiments.numerics_fingerprint            # print the fingerprint of this commit
  python -m experiments.numerics_fingerprint --update   # record it in tests/fixtures/ (say why in the commit)
  python -m experiments.numerics_fingerprint --update --drop-other-cpus   # a change meant to move them

The default config (`configs/default.py`) with a short warm start (40 steps), then 4 lag-mode updates
(k = 2) of 8 episodes against two real JetStream servers, and a greedy evaluation on 8 held-out
problems: lag mode is reproducible bit for bit (`tests/train/test_reproducible.py`), so any change to
the model, the sampler, the estimator, the losses, the learner's defaults or the data order moves a
number here. `tests/test_numerics_fingerprint.py` fails on such a change until the fingerprint is
updated on purpose; a change that should not move the numerics must leave it alone.

Bit for bit holds on one CPU: XLA compiles for the host's vector instructions, and another instruction
set sums in another order. The fixture keeps one recording per instruction set (`cpu_signature`);
the test compares to this CPU's recording exactly (to float32 noise), and to another CPU's within the
drift measured between two CPUs (`CROSS_CPU_RTOL`).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import jax

from configs import default
from copc_jax import config as config_lib
from copc_jax.train import metrics, trainer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

FIXTURE = os.path.join(ROOT, "tests", "fixtures", "numerics_fingerprint.json")
# The vector instructions XLA's CPU code generation picks from (AVX-512 and AMX variants, AVX2, FMA).
ISA_FLAGS = ("avx2", "fma", "avx512", "amx", "avx_vnni")
# Measured between a recording on one CPU and a run of the same commit on another (AVX-512 with AMX):
# at most 1.5e-2 relative on a near-zero actor loss (2.6e-6 absolute), below 1e-3 on everything else.
CROSS_CPU_RTOL, CROSS_CPU_ATOL = 2e-3, 1e-5
KEYS = ("reward_mean", "actor_loss", "value_loss", "grad_norm", "critic_grad_norm", "advantage_raw_mean",
        "advantage_raw_std", "returns_mean", "kl_behavior", "clip_fraction", "entropy", "ratio_max",
        "value_explained_variance")


def config():
  raw = default.get_config()
  raw.warm_start.steps = 40
  raw.task.eval_size = 8
  raw.trainer.update(dict(mode="lag", lag=2, steps=4, batch_size=8, num_minibatches=2, critic_warmup_steps=2,
                          eval_every=4, checkpoint_every=4, progress_bar=False))
  raw.rollout.update(dict(slots=4, max_in_flight=4))
  return config_lib.from_config_dict(raw)


def fingerprint(workdir: str) -> dict:
  """Run the reduced default job in `workdir`; its rows' numbers that the fingerprint keeps."""

  trainer.train_and_evaluate(config(), workdir)
  rows = metrics.read_metrics(workdir)
  return {"cpu": cpu_signature(), "jax_version": jax.__version__,
          "evaluations": [[r["step"], r["eval_accuracy"]] for r in rows if "eval_accuracy" in r],
          "critic_warmup": [[r["critic_warmup_step"], r["value_loss"]] for r in rows
                            if "critic_warmup_step" in r],
          "updates": [{"step": r["step"], **{k: r.get(k) for k in KEYS}} for r in metrics.update_rows(rows)]}


def cpu_signature() -> str:
  """This CPU's vector instruction set, as `ISA_FLAGS` names it ("unknown" off Linux)."""
  try:
    with open("/proc/cpuinfo") as f:
      flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
  except OSError:
    return "unknown"
  return " ".join(sorted({flag for flag in flags if flag.startswith(ISA_FLAGS)})) or "unknown"


def recordings() -> list[dict]:
  with open(FIXTURE) as f:
    return json.load(f)["recordings"]


def record(result: dict, *, others: bool = True) -> None:
  """`result` into the fixture, replacing the recording of this CPU's instruction set; `others=False`
  drops every other CPU's as well (the numerics changed on purpose, so theirs hold the old ones)."""
  kept = [r for r in recordings() if r["cpu"] != result["cpu"]] if others and os.path.exists(FIXTURE) else []
  with open(FIXTURE, "w") as f:
    json.dump({"recordings": [*kept, result]}, f, indent=1)
    f.write("\n")


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--update", action="store_true",
                      help=f"record it for this CPU in {os.path.relpath(FIXTURE, ROOT)}")
  parser.add_argument("--drop-other-cpus", action="store_true",
                      help="with --update, after a change meant to move the numerics: drop the other CPUs' "
                           "recordings (until they record their own they compare to this one within the "
                           "cross-CPU drift)")
  parser.add_argument("--out", help="write it to this file")
  args = parser.parse_args()
  if jax_device_count() != 1:
    parser.error("run it on one device (XLA_FLAGS without --xla_force_host_platform_device_count)")
  with tempfile.TemporaryDirectory() as tmp:
    result = fingerprint(tmp)
  print(json.dumps(result, indent=1))
  if args.update:
    record(result, others=not args.drop_other_cpus)
  if args.out:
    with open(args.out, "w") as f:
      json.dump(result, f, indent=1)
      f.write("\n")


def jax_device_count() -> int:
  return jax.device_count()


if __name__ == "__main__":
  main()
