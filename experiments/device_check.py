"""On an accelerator (GPU or TPU): what runs where, and how fast. Run it when a machine has one.

    .venv/bin/pip install -r requirements-cuda.txt       # on a GPU machine (TPU VMs: jax[tpu])
    .venv/bin/python -m experiments.device_check          # writes experiments/device_check.json
    .venv/bin/python -m experiments.device_check --skip_run   # learner step and decode only (a minute)

1. The learner step at the platform's settings (`model.compute_options`: bf16 compute over float32
   weights, the platform's attention kernel, scanned layers, chunked log π) on a 4-layer, d = 512
   model, batch 32 × 512: compile and median step time, checked finite.
2. The server's decode: a `CopcEngine` on a tiny checkpoint in the same dtype, 64 steps of 8 slots:
   tokens per second, and its log-probs against the learner's recomputation (the sampling contract).
3. The main job, 20 updates of `configs/default.py` with the learner and the servers on the
   accelerator (`rollout.server_platform=""`): held-out accuracy before and after, from its summary;
   and the same with the in-process backend (`rollout.backend=in_process`: no servers). Each run is
   stopped after `--run_timeout_s`, and what it printed is kept.

Every number goes to the JSON with the platform, device kinds and versions; none is asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from copc_jax import presets
from copc_jax.models import attention as attention_lib
from copc_jax.models import hf_io, tiny
from copc_jax.models.config import ModelConfig
from copc_jax.models.decoder import Decoder, ValueModel
from copc_jax.rollout.engine import SamplingOptions
from copc_jax.rollout.jetstream_adapter import CopcEngine, SampledPrompt
from copc_jax.sampling import sampling_logprobs
from copc_jax.train import Learner, LearnerConfig
from copc_jax.train.fake_data import random_batch
from copc_jax.train.setup import ModelSource
from experiments import study

HERE = os.path.dirname(os.path.abspath(__file__))

OUT = study.beside(__file__)


def learner_step(platform: str, attention: str = "auto") -> dict:
  options = ModelSource(scan_layers=True, remat="full", attention=attention).compute_options(platform)
  config = ModelConfig(vocab_size=8192, hidden_size=512, intermediate_size=1536, num_layers=4, num_heads=8,
                       num_kv_heads=4, head_dim=64)
  actor = Decoder(config, rngs=nnx.Rngs(0), **options)
  preset = presets.get_preset("copc")
  learner = Learner(actor, ValueModel.from_policy(actor, rngs=nnx.Rngs(1)),
                    LearnerConfig(estimator=preset.estimator, actor=preset.actor, num_minibatches=4,
                                  logits_chunk=128))
  batch = random_batch(Decoder(config, rngs=nnx.Rngs(0)), batch_size=32, prompt_length=64, response_length=448)
  start = time.perf_counter()
  jax.block_until_ready(learner.train_step(batch))
  compile_s = time.perf_counter() - start
  times, metrics = [], None
  for _ in range(5):
    start = time.perf_counter()
    metrics = jax.device_get(learner.train_step(batch))
    times.append(time.perf_counter() - start)
  return {"options": {k: str(v) for k, v in options.items()}, "compile_and_first_step_s": compile_s,
          "median_step_s": float(np.median(times)), "tokens_per_s": 32 * 512 / float(np.median(times)),
          "finite": bool(all(np.isfinite(float(metrics[k])) for k in ("actor_loss", "value_loss")))}


def attention_kernels(shape=(4, 512, 8, 4, 64)) -> dict:
  """On a GPU: cuDNN's fused attention against XLA's on one packed bf16 batch (two documents and
  padding per row, the dense causal-by-segment mask), outputs and input gradients each against the
  float32 reference; then the learner step with cuDNN's kernel."""
  b, t, n, k, d = shape
  rng = np.random.default_rng(0)
  q, kk, v = (jnp.asarray(rng.normal(size=s), jnp.bfloat16) for s in ((b, t, n, d), (b, t, k, d), (b, t, k, d)))
  segments = np.zeros((b, t), np.int32)
  segments[:, : t // 3], segments[:, t // 3: t - 40] = 1, 2
  visible = attention_lib.causal_segment_mask(jnp.asarray(segments))
  out = {}
  for name in ("reference", "xla", "cudnn"):
    def loss(q, kk, v, name=name):
      return jnp.sum(attention_lib.attention(q, kk, v, visible, implementation=name).astype(jnp.float32) ** 2)
    try:
      out[name] = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(
          *(x.astype(jnp.float32) if name == "reference" else x for x in (q, kk, v)))
    except Exception as err:                       # cuDNN refuses some shapes and masks: say which
      return {"cudnn_error": f"{type(err).__name__}: {str(err)[:500]}"}
  reference_value, reference_grads = out["reference"]
  result = {}
  for name in ("xla", "cudnn"):
    value, grads = out[name]
    result[name] = {"loss_relative_error": float(abs(value - reference_value) / abs(reference_value)),
                    "max_grad_error": float(max(jnp.max(jnp.abs(g.astype(jnp.float32) - r))
                                                for g, r in zip(grads, reference_grads)))}
  result["learner_step_cudnn"] = learner_step("gpu", attention="cudnn")
  return result


def server_decode(platform: str, directory: str) -> dict:

  path = os.path.join(directory, "tiny")
  tiny.make_tiny_checkpoint(path, "qwen2", seed=0)
  dtype = ModelSource().compute_options(platform)["dtype"]
  model, _ = hf_io.from_pretrained(path, load_tokenizer=False, dtype=dtype)
  slots, steps = 8, 64
  engine = CopcEngine(model, max_concurrent_decodes=slots, max_prefill_length=16, max_length=96)
  store, state = engine.load_params(), engine.init_decode_state()
  prompts = [[1, 5 + i, 9, 12] for i in range(slots)]
  for slot, prompt in enumerate(prompts):
    padded = np.zeros(16, np.int32)
    padded[:len(prompt)] = prompt
    options = SamplingOptions(seed=slot)
    prefix = engine.prefill(params=store, padded_tokens=SampledPrompt(padded, options), true_length=len(prompt))
    state = engine.insert(prefix, state, slot)
  state, result = engine.generate(store, state)          # compiles
  jax.block_until_ready(result.data)
  rows, start = [np.asarray(result.data)], time.perf_counter()
  for _ in range(steps - 1):
    state, result = engine.generate(store, state)
    rows.append(np.asarray(result.data))
  seconds = time.perf_counter() - start
  data = np.stack(rows)                                   # [steps, slots, 5]
  tokens = data[:, :, 0].T
  recorded = data[:, :, 3].astype(np.int32).view(np.float32).T
  sequence = np.array([prompts[0] + list(tokens[0])])
  recomputed = np.asarray(sampling_logprobs(model(sequence), sequence))[0, len(prompts[0]):]
  return {"dtype": str(dtype), "tokens_per_s": slots * (steps - 1) / seconds,
          "max_logprob_difference_slot0": float(np.max(np.abs(recorded[0] - recomputed)))}


def default_run(directory: str, backend: str, timeout_s: float) -> dict:
  workdir = os.path.join(directory, f"run_{backend}")
  command = [sys.executable, "-m", "copc_jax.main", "--config=configs/default.py", f"--workdir={workdir}",
             "--config.trainer.steps=20", "--config.rollout.server_platform=",
             f"--config.rollout.backend={backend}"]
  start = time.time()
  try:
    done = subprocess.run(command, cwd=study.ROOT, capture_output=True, text=True, timeout=timeout_s)
    returncode, stderr = done.returncode, done.stderr
  except subprocess.TimeoutExpired as err:
    output = err.stderr or b""
    returncode, stderr = "timeout", output.decode(errors="replace") if isinstance(output, bytes) else output
  summary_path = os.path.join(workdir, "summary.json")
  summary = json.load(open(summary_path)) if os.path.exists(summary_path) else {}
  return {"command": " ".join(["python", *command[1:]]).replace(directory, "$TMP"), "returncode": returncode,
          "wall_s": time.time() - start, "summary": summary,
          "stderr_tail": stderr[-2000:].replace(directory, "$TMP") if returncode else ""}


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--skip_run", action="store_true", help="without the 20-update main job")
  parser.add_argument("--skip_decode", action="store_true", help="without the server decode")
  parser.add_argument("--backends", nargs="*", default=["jetstream", "in_process"],
                      help="the main job's runs, one per rollout backend")
  parser.add_argument("--run_timeout_s", type=float, default=240)
  parser.add_argument("--out", default=OUT)
  args = parser.parse_args()
  platform = jax.default_backend()
  results = {"platform": platform, "devices": [d.device_kind for d in jax.devices()]}
  print(f"platform {platform}: {results['devices']}", flush=True)
  with tempfile.TemporaryDirectory() as directory:
    results["learner_step"] = learner_step(platform)
    print("learner step:", json.dumps(results["learner_step"]), flush=True)
    if platform == "gpu":
      results["attention_kernels"] = attention_kernels()
      print("attention kernels:", json.dumps(results["attention_kernels"]), flush=True)
    if not args.skip_decode:
      results["server_decode"] = server_decode(platform, directory)
      print("server decode:", json.dumps(results["server_decode"]), flush=True)
    for backend in [] if args.skip_run else args.backends:
      run = results.setdefault("default_run", {})[backend] = default_run(directory, backend, args.run_timeout_s)
      print(f"default run ({backend}):", json.dumps(run), flush=True)
      study.write_benchmark(args.out, results)        # kept if a later run is cut off
  study.write_benchmark(args.out, results)


if __name__ == "__main__":
  main()
