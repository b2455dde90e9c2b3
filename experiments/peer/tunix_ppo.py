"""The peer side of `experiments/bench_peer.py`: Tunix's PPO on issue 17's workload, timed by phase.

Runs in its own environment (Tunix pins its own dependencies; see
`experiments/peer/requirements.txt`):

  python experiments/peer/tunix_ppo.py CHECKPOINT --prompts PROMPTS.json --steps 6 --out tunix.json

CHECKPOINT is the Hugging Face directory `bench_peer.py` writes (a random Qwen2-style model and its
tokenizer); both libraries load the same weights. One PPO step: Tunix's vanilla rollout generates
the batch, the actor's log-probs (π_old) and the critic's values are recomputed, then
`num_iterations` epochs of one minibatch update the actor and the critic. Each phase is timed at
the `RLCluster` method that runs it; the first `--warmup` steps (compilation) are left out.
"""

import argparse
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

# RLCluster method -> the phase it runs
PHASES = {"generate": "rollout_s", "get_old_per_token_logps": "forward_s", "get_values": "forward_s",
          "update_actor": "update_s", "update_critic": "update_s", "sync_weights": "weight_sync_s"}


class Critic(nnx.Module):
  """The actor's architecture with a scalar head in place of the language-model head: [B, L, 1]."""

  def __init__(self, config, backbone, *, rngs: nnx.Rngs):
    self.backbone = backbone
    self.value_head = nnx.Linear(config.embed_dim, 1, rngs=rngs)

  def __call__(self, input_tokens, positions, cache=None, attention_mask=None, **unused):
    from tunix.models.qwen2 import model as qwen2
    b = self.backbone
    x = b.embedder.encode(input_tokens)
    sin, cos = qwen2._generate_pos_embeddings(positions, b.config.head_dim, b.config.rope_theta)
    for layer in b.layers:
      _, x = layer(x, None, attention_mask, sin.astype(x.dtype), cos.astype(x.dtype))
    return self.value_head(b.final_norm(x)).astype(jnp.float32)


def model_config(hf: dict):
  from tunix.models.qwen2 import model as qwen2
  return qwen2.ModelConfig(
      num_layers=hf["num_hidden_layers"], vocab_size=hf["vocab_size"], embed_dim=hf["hidden_size"],
      hidden_dim=hf["intermediate_size"], num_heads=hf["num_attention_heads"], head_dim=hf["head_dim"],
      num_kv_heads=hf["num_key_value_heads"], rope_theta=int(hf["rope_parameters"]["rope_theta"]),
      norm_eps=hf["rms_norm_eps"], use_tied_embedding=hf["tie_word_embeddings"])


def timed(cluster, calls: list) -> None:
  """Record (phase, start, end, tokens returned) of every call of the phase methods of `cluster`
  (blocking on results)."""
  for name, phase in PHASES.items():
    method = getattr(cluster, name)

    def wrapper(*args, _method=method, _phase=phase, **kwargs):
      start = time.perf_counter()
      out = jax.block_until_ready(_method(*args, **kwargs))
      tokens = int(sum(len(t) for t in out.tokens)) if _phase == "rollout_s" else 0
      calls.append((_phase, start, time.perf_counter(), tokens))
      return out
    setattr(cluster, name, wrapper)


def per_step(calls: list, end: float, warmup: int) -> list[dict]:
  """Each step after `warmup`: from one rollout's start to the next (or `end`), with its phases' time."""
  starts = [c[1] for c in calls if c[0] == "rollout_s"] + [end]
  steps = []
  for begin, finish in zip(starts[warmup:-1], starts[warmup + 1:], strict=True):
    inside = [c for c in calls if begin <= c[1] < finish]
    step = {"step_s": finish - begin, "rollout_tokens": sum(c[3] for c in inside if c[0] == "rollout_s")}
    for phase in set(PHASES.values()):
      step[phase] = sum(c[2] - c[1] for c in inside if c[0] == phase)
    steps.append(step)
  return steps


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("checkpoint")
  parser.add_argument("--prompts", required=True, help="JSON list of prompt strings (one batch)")
  parser.add_argument("--new-tokens", type=int, default=32)
  parser.add_argument("--epochs", type=int, default=2)
  parser.add_argument("--steps", type=int, default=6)
  parser.add_argument("--warmup", type=int, default=2)
  parser.add_argument("--out", required=True)
  args = parser.parse_args()
  import optax
  import transformers
  from tunix.models.qwen2 import params as qwen2_params
  from tunix.rl import rl_cluster as rl_cluster_lib
  from tunix.rl.ppo import ppo_learner
  from tunix.rl.rollout import base_rollout

  with open(os.path.join(args.checkpoint, "config.json")) as f:
    config = model_config(json.load(f))
  with open(args.prompts) as f:
    prompts = json.load(f)
  mesh = jax.make_mesh((1, 1), ("fsdp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  actor = qwen2_params.create_model_from_safe_tensors(args.checkpoint, config, mesh)
  critic = Critic(config, qwen2_params.create_model_from_safe_tensors(args.checkpoint, config, mesh),
                  rngs=nnx.Rngs(1))
  tokenizer = transformers.AutoTokenizer.from_pretrained(args.checkpoint)
  prompt_length = max(len(tokenizer(p)["input_ids"]) for p in prompts)
  cluster_config = rl_cluster_lib.ClusterConfig(
      role_to_mesh={role: mesh for role in (rl_cluster_lib.Role.ACTOR, rl_cluster_lib.Role.CRITIC,
                                            rl_cluster_lib.Role.REFERENCE, rl_cluster_lib.Role.ROLLOUT)},
      rollout_engine="vanilla",
      training_config=rl_cluster_lib.RLTrainingConfig(
          actor_optimizer=optax.adamw(1e-6), critic_optimizer=optax.adamw(1e-5),
          eval_every_n_steps=10 ** 6, max_steps=(args.warmup + args.steps) * args.epochs,
          mini_batch_size=len(prompts)),
      rollout_config=base_rollout.RolloutConfig(
          max_tokens_to_generate=args.new_tokens, max_prompt_length=prompt_length, temperature=1.0,
          kv_cache_size=128, eos_tokens=[tokenizer.eos_token_id]))
  cluster = rl_cluster_lib.RLCluster(actor=actor, critic=critic, tokenizer=tokenizer,
                                     cluster_config=cluster_config)
  calls = []
  timed(cluster, calls)
  reward = lambda prompts, completions, **kwargs: [float(len(c)) / args.new_tokens for c in completions]
  learner = ppo_learner.PPOLearner(cluster, ppo_learner.PPOConfig(num_iterations=args.epochs, beta=0.0),
                                   reward_fns=[reward])
  learner.train([{"prompts": np.array(prompts)}] * (args.warmup + args.steps))
  steps = per_step(calls, time.perf_counter(), args.warmup)
  median = lambda key: float(np.median([s[key] for s in steps]))
  result = {
      "library": "tunix", "version": _version("google-tunix"), "jax": jax.__version__,
      "steps_timed": len(steps), "steps": steps,
      **{key: median(key) for key in ("step_s", "rollout_tokens", *sorted(set(PHASES.values())))},
      "peak_rss_gib": peak_rss_gib(),
  }
  result["rollout_tokens_per_s"] = float(np.median([s["rollout_tokens"] / s["rollout_s"] for s in steps]))
  with open(args.out, "w") as f:
    json.dump(result, f, indent=2)
  print(json.dumps(result))


def peak_rss_gib() -> float:
  """This process's peak resident memory (Linux VmHWM: unlike `ru_maxrss`, not inherited from the
  process that started this one)."""
  with open("/proc/self/status") as f:
    kib = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
  return kib / 2 ** 20


def _version(package: str) -> str:
  from importlib import metadata
  return metadata.version(package)


if __name__ == "__main__":
  main()
