"""Does every Qwen2.5 config fit the TPU slices it names? The compiler's own per-chip memory plan.

    .venv/bin/python -m experiments.fit_tpu                      # every config; writes experiments/fit_tpu.json
    .venv/bin/python -m experiments.fit_tpu --only math:7b        # one config
    .venv/bin/python -m experiments.fit_tpu --render              # docs/internals.md table from the JSON

For each config (`configs/qwen2_5_math.py`, `configs/qwen2_5_search.py`, each size) and the hardware
it names (`HARDWARE` in the config file), on this CPU machine with libtpu installed
(`jax.experimental.topologies`: no TPU is needed, nothing is allocated):

- the learner's train step (actor + critic + their AdamW states, the KL reference where the preset
  has one; the config's batch, minibatches, lengths, mesh, compute dtype, remat, scanned layers,
  attention kernel and log-prob chunk) lowered from shapes and compiled for the learner slice;
- the server's two bodies on the server slice: prefill of one prompt at the config's prefill bucket,
  and one decode step of every slot (the model's `decode_rows` and the sampling of
  `copc_jax.sampling`, as the engine's generate body), weights and KV cache in bfloat16, the cache
  placed as the engine places it (`engine.cache_partition`) over the config's server topology
  (`rollout.server_data_parallelism` × `server_tensor_parallelism`).

Written per body: the compiler's per-chip argument / output / temporary bytes (`memory_analysis`;
donated arguments counted once), the chip's HBM and the headroom, FLOPs per chip counted from the
model (`learner_flops`, `forward_flops_per_token`: the compiler's `cost_analysis` counts a scanned
loop's body once), compile time, and a step-time lower bound: those FLOPs at the chip's peak bf16
rate. Target: >= 10% of HBM left on every chip.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import time
from importlib import metadata

from jax.experimental import topologies

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")          # libtpu asks no metadata server
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")   # other jax processes may hold libtpu's lock

HERE = os.path.dirname(os.path.abspath(__file__))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from copc_jax import config as config_lib  # noqa: E402
from copc_jax import sampling, sharding  # noqa: E402
from copc_jax.models.config import ModelConfig  # noqa: E402
from copc_jax.models.decoder import Decoder, KVCache, ValueModel  # noqa: E402
from copc_jax.rollout import engine  # noqa: E402
from copc_jax.rollout.engine import SERVING_RULES  # noqa: E402
from copc_jax.train import learner as learner_lib  # noqa: E402
from copc_jax.train import setup  # noqa: E402
from experiments import study  # noqa: E402

OUT = study.beside(__file__)
GIB = 2**30
# Per chip: HBM (GiB) and peak bf16 FLOP/s (Cloud TPU documentation).
CHIPS = {"v4": (32, 275e12), "v5e": (16, 197e12), "v5p": (95, 459e12), "v6e": (32, 918e12)}
# Qwen2.5 architectures, as their config.json on the Hugging Face hub (head_dim = hidden / heads = 128).
ARCHITECTURES = {
    "1.5b": ModelConfig(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_layers=28,
                        num_heads=12, num_kv_heads=2, head_dim=128, rope_theta=1e6, tie_word_embeddings=True,
                        max_position_embeddings=32768),
    "3b": ModelConfig(vocab_size=151936, hidden_size=2048, intermediate_size=11008, num_layers=36,
                      num_heads=16, num_kv_heads=2, head_dim=128, rope_theta=1e6, tie_word_embeddings=True,
                      max_position_embeddings=32768),
    "7b": ModelConfig(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_layers=28,
                      num_heads=28, num_kv_heads=4, head_dim=128, rope_theta=1e6, tie_word_embeddings=False,
                      max_position_embeddings=32768),
}
CONFIGS = {"math": "configs/qwen2_5_math.py", "search": "configs/qwen2_5_search.py"}


def config_module(path: str):
  spec = importlib.util.spec_from_file_location("fit_config", os.path.join(study.ROOT, path))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def topology_devices(name: str, chips_per_host_bounds=None):
  """The devices of a TPU slice that is not there, e.g. "v5p:2x2x4" (16 chips)."""
  kwargs = {} if chips_per_host_bounds is None else {"chips_per_host_bounds": tuple(chips_per_host_bounds)}
  return topologies.get_topology_desc(topology_name=name, platform="tpu", **kwargs).devices


def mesh_over(devices, mesh_shape) -> jax.sharding.Mesh:
  shape = sharding.mesh_shape_for(sharding.ShardingConfig(mesh_shape=tuple(mesh_shape)), len(devices))
  return jax.make_mesh(shape, sharding.MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * 3,
                       devices=devices)


def forward_flops_per_token(architecture: ModelConfig, context: float, logits: bool = True) -> float:
  """Matmul FLOPs of one token's forward pass (as PaLM's appendix B counts them): 2 per weight of each
  layer's projections and MLP, 4·H·D·context for QKᵀ and PV over `context` keys, and 2·h·V for the
  vocabulary projection when `logits` (the value head's h·1 is negligible)."""
  a = architecture
  projections = a.hidden_size * a.head_dim * 2 * (a.num_heads + a.num_kv_heads)
  mlp = 3 * a.hidden_size * a.intermediate_size
  per_layer = 2 * (projections + mlp) + 4 * a.num_heads * a.head_dim * context
  return a.num_layers * per_layer + (2 * a.hidden_size * a.vocab_size if logits else 0.0)


def learner_flops(architecture: ModelConfig, typed) -> float:
  """One train step on a full batch (every row `max_length` long, causal: mean context length / 2):
  the π_prox, V (and π_ref with a KL term) forwards, then per epoch the actor's and the critic's
  forward, backward (2 forwards) and, under remat, the forward again."""
  t = typed.trainer
  tokens, context = t.batch_size * typed.rollout.max_length, typed.rollout.max_length / 2
  actor, critic = (forward_flops_per_token(architecture, context, logits) for logits in (True, False))
  per_epoch = 3 + (typed.model.remat not in ("none", False))
  reference = 1 if typed.actor.kl_coef > 0 else 0
  return tokens * (actor * (1 + reference + t.epochs * per_epoch) + critic * (1 + t.epochs * per_epoch))


def plan(compiled, chip: str, seconds: float, flops: float, chips: int) -> dict:
  """The compiler's per-chip memory plan of one compiled body, against the chip's HBM, and the body's
  FLOPs (counted from the model: the compiler's `cost_analysis` counts a loop body once, not once per
  iteration, so it undercounts scanned layers and minibatches) spread over `chips`."""
  memory = compiled.memory_analysis()
  hbm, peak = CHIPS[chip]
  # donated arguments are aliased to outputs: they occupy HBM once
  total = (memory.argument_size_in_bytes + memory.output_size_in_bytes - memory.alias_size_in_bytes
           + memory.temp_size_in_bytes)
  return {"fits": total <= hbm * GIB, "argument_gib": memory.argument_size_in_bytes / GIB,
          "output_gib": memory.output_size_in_bytes / GIB,
          "alias_gib": memory.alias_size_in_bytes / GIB, "temp_gib": memory.temp_size_in_bytes / GIB,
          "total_gib": total / GIB, "hbm_gib": hbm, "headroom": 1.0 - total / (hbm * GIB),
          "flops_per_chip": flops / chips, "step_time_lower_bound_s": flops / chips / peak,
          "compile_s": seconds}


def compile_learner(typed, architecture: ModelConfig, devices) -> object:
  """The config's train step (one update: π_prox/V pass, minibatch actor and critic updates)."""
  options = typed.model.compute_options("tpu")
  mesh = mesh_over(devices, typed.sharding.mesh_shape)

  def make_models():
    actor = Decoder(architecture, rngs=nnx.Rngs(0), **options)
    return actor, ValueModel.from_policy(actor, rngs=nnx.Rngs(1))

  lowered = learner_lib.lower_train_step(make_models, setup.learner_config(typed), mesh, typed.sharding.rules,
                                         batch_size=typed.trainer.batch_size, length=typed.rollout.max_length)
  return lowered.compile()


def compile_server(typed, architecture: ModelConfig, devices, server_mesh) -> tuple[object, object]:
  """(prefill, decode) of the served model on the server slice, bfloat16 weights and cache."""
  mesh = mesh_over(devices, server_mesh)
  model = nnx.eval_shape(lambda: Decoder(architecture, rngs=nnx.Rngs(0), dtype=jnp.bfloat16,
                                         param_dtype=jnp.bfloat16))
  graphdef, params = nnx.split(model)
  param_shardings = sharding.state_shardings(params, mesh, SERVING_RULES)
  slots, length, bucket = typed.rollout.slots, typed.rollout.max_length, typed.rollout.max_prefill_length
  shape = (architecture.num_layers, slots, length, architecture.num_kv_heads, architecture.head_dim)
  spec = jax.ShapeDtypeStruct
  named = lambda partition: jax.sharding.NamedSharding(mesh, partition)
  cache_partition = engine.cache_partition(architecture, mesh, slots)      # as the engine places it
  rows, replicated = named(jax.sharding.PartitionSpec(cache_partition[1])), named(jax.sharding.PartitionSpec())
  cache = KVCache(keys=spec(shape, jnp.bfloat16), values=spec(shape, jnp.bfloat16),
                  valid=spec((slots, length), jnp.bool_), index=spec((), jnp.int32))
  cache_shardings = KVCache(keys=named(cache_partition), values=named(cache_partition), valid=rows,
                            index=replicated)

  def decode(params, cache, logits_sv, lengths_s, keys_s):
    """One generate step of every slot: sample from the stored logits, run the model on the tokens."""
    served = nnx.merge(graphdef, params)
    temperature, top_p, top_k = jnp.ones(slots), jnp.ones(slots), jnp.zeros(slots, jnp.int32)
    tokens, logprobs = sampling.sample(jax.random.wrap_key_data(keys_s), logits_sv, temperature, top_p, top_k)
    logits, cache = served.decode_rows(tokens, jnp.minimum(lengths_s, length - 1), cache)
    return logits, cache, tokens, logprobs

  def prefill(params, tokens_p, true_length):
    served = nnx.merge(graphdef, params)
    one = KVCache.create(architecture, batch=1, max_length=bucket, dtype=jnp.bfloat16)
    valid = (jnp.arange(bucket) < true_length)[None]
    logits, one = served.decode(tokens_p[None], jnp.arange(bucket)[None], one, valid)
    return one.keys, one.values, logits[0, true_length - 1]

  key_data = jax.eval_shape(lambda: jax.random.key_data(jax.random.split(jax.random.key(0), slots)))
  decode_compiled = jax.jit(
      decode, donate_argnums=(1,), in_shardings=(param_shardings, cache_shardings, rows, rows, rows),
      out_shardings=(rows, cache_shardings, rows, rows)).lower(
          params, cache, spec((slots, architecture.vocab_size), jnp.float32), spec((slots,), jnp.int32),
          spec(key_data.shape, key_data.dtype)).compile()
  prefill_compiled = jax.jit(prefill, in_shardings=(param_shardings, replicated, replicated)).lower(
      params, spec((bucket,), jnp.int32), spec((), jnp.int32)).compile()
  return prefill_compiled, decode_compiled


def fit(task: str, size: str, layers: int | None = None) -> dict:
  module = config_module(CONFIGS[task])
  hardware = module.HARDWARE[size]
  typed = config_lib.from_config_dict(module.get_config(size))
  architecture = ARCHITECTURES[size]
  if layers:
    architecture = dataclasses.replace(architecture, num_layers=layers)
  entry = {"config": f"{CONFIGS[task]}:{size}", "hardware": hardware,
           "server_mesh": [typed.rollout.server_data_parallelism, 1, typed.rollout.server_tensor_parallelism],
           "gradient_accumulation": typed.trainer.gradient_accumulation,
           "batch_size": typed.trainer.batch_size, "num_minibatches": typed.trainer.num_minibatches,
           "max_length": typed.rollout.max_length, "mesh_shape": list(typed.sharding.mesh_shape),
           "model": {k: str(v) for k, v in typed.model.compute_options("tpu").items()},
           "logits_chunk": typed.trainer.logits_chunk, "num_layers": architecture.num_layers}
  learner_chip = hardware["learner"].split(":")[0]
  start = time.time()
  print(f"[{time.strftime('%H:%M:%S')}] {task}:{size} learner on {hardware['learner']}", flush=True)
  devices = topology_devices(hardware["learner"])
  try:
    entry["learner"] = plan(compile_learner(typed, architecture, devices), learner_chip, time.time() - start,
                            learner_flops(architecture, typed), len(devices))
  except jax.errors.JaxRuntimeError as err:      # the compiler refuses a plan above HBM, saying by how much
    entry["learner"] = refused(err, learner_chip, time.time() - start)
  print(json.dumps(entry["learner"]), flush=True)
  server_chip = hardware["server"].split(":")[0]
  devices = topology_devices(hardware["server"], hardware.get("server_chips_per_host"))
  start = time.time()
  print(f"[{time.strftime('%H:%M:%S')}] {task}:{size} server on {hardware['server']}", flush=True)
  try:
    server_mesh = (typed.rollout.server_data_parallelism, 1, typed.rollout.server_tensor_parallelism)
    prefill, decode = compile_server(typed, architecture, devices, server_mesh)
    seconds = time.time() - start
    r = typed.rollout
    prefill_flops = r.max_prefill_length * forward_flops_per_token(architecture, r.max_prefill_length / 2)
    entry["server_prefill"] = plan(prefill, server_chip, seconds, prefill_flops, len(devices))
    # one token per slot, attending over the whole cache (the decode computes every position, masked)
    entry["server_decode"] = plan(decode, server_chip, seconds,
                                  r.slots * forward_flops_per_token(architecture, r.max_length), len(devices))
  except jax.errors.JaxRuntimeError as err:
    entry["server_decode"] = refused(err, server_chip, time.time() - start)
  print(json.dumps(entry["server_decode"]), flush=True)
  return entry


def refused(err: Exception, chip: str, seconds: float) -> dict:
  """A body the compiler would not place on the chip (RESOURCE_EXHAUSTED names what it needed)."""
  if "RESOURCE_EXHAUSTED" not in str(err):
    raise err
  return {"fits": False, "error": str(err).splitlines()[0][:400], "hbm_gib": CHIPS[chip][0],
          "compile_s": seconds}


def table(results: dict) -> str:
  lines = ["| config | body | slice | per chip: arguments / temporaries / outputs (GiB) | total / HBM "
           "| headroom | FLOPs per chip | lower bound at peak | compile |",
           "|---|---|---|---|---|---:|---:|---:|---:|"]
  for name, entry in results["configs"].items():
    for body, where in (("learner", "learner"), ("server_prefill", "server"), ("server_decode", "server")):
      if body not in entry:
        continue
      p = entry[body]
      if not p.get("fits", True) and "total_gib" not in p:
        lines.append(f"| {name} | {body.replace('_', ' ')} | {entry['hardware'][where]} | refused by the "
                     f"compiler: {p['error']} | – / {p['hbm_gib']} | < 0% | – | – | {p['compile_s']:.0f} s |")
        continue
      lines.append(f"| {name} | {body.replace('_', ' ')} | {entry['hardware'][where]} | "
                   f"{p['argument_gib']:.2f} / {p['temp_gib']:.2f} / {p['output_gib']:.2f} | "
                   f"{p['total_gib']:.1f} / {p['hbm_gib']} | "
                   f"{100 * p['headroom']:.0f}% | {p['flops_per_chip']:.2e} | "
                   f"{p['step_time_lower_bound_s']:.3f} s | {p['compile_s']:.0f} s |")
  return "\n".join(lines)


def render(results: dict) -> None:
  text = (f"`{results['command']}` at commit {results['git_commit'][:10]}, jax {results['jax_version']} with "
          f"libtpu {results['libtpu_version']} (compiled on {results['machine']}, no TPU). Memory is the "
          f"compiler's plan per chip; the lower bound is FLOPs at the chip's peak bf16 rate.\n\n"
          + table(results))
  study.write_between_markers(os.path.join(study.ROOT, "docs", "internals.md"), "tpu_fit", text)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--only", nargs="+", help="task:size, e.g. math:7b (default: every config)")
  parser.add_argument("--layers", type=int, help="compile this many layers instead (a quick check)")
  parser.add_argument("--out", default=OUT)
  parser.add_argument("--render", action="store_true")
  args = parser.parse_args()
  if args.render:
    with open(args.out) as f:
      render(json.load(f))
    return
  names = args.only or [f"{task}:{size}" for task in CONFIGS for size in config_module(CONFIGS[task]).HARDWARE]
  results = {"configs": {}}
  if os.path.exists(args.out):     # configs measured before keep their entry
    with open(args.out) as f:
      results["configs"] = json.load(f).get("configs", {})
  for name in names:
    task, size = name.split(":")
    results["configs"][name] = {**fit(task, size, args.layers), "git_commit": study.git_commit()}
    study.write_benchmark(args.out, {**results, "libtpu_version": metadata.version("libtpu")})
    with open(args.out) as f:
      results = {"configs": json.load(f)["configs"]}


if __name__ == "__main__":
  main()
