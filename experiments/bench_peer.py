"""copc_jax next to a peer JAX RL library (Tunix) on issue 17's workload, in alternating runs.

  python -m experiments.bench_peer --peer-python PEER_ENV/bin/python --out experiments/bench_peer.json
  python -m experiments.bench_peer --render        # docs/results.md table from experiments/bench_peer.json

The peer runs in its own environment (`experiments/peer/requirements.txt`; Tunix pins its own
dependencies), as a subprocess: `experiments/peer/tunix_ppo.py`. The workload: one random
Qwen2-style model (4 layers, d = 128, the tiny character tokenizer), written once and loaded by
both libraries; 8 prompts of 16 tokens; 32 new tokens at temperature 1 (a generation may end early
on EOS, and tokens/s count what was returned); PPO with a critic, 2 epochs of one minibatch, no KL.

Each repeat runs the peer's PPO steps, then copc_jax's phases on the same batch shape:
rollout (the 8 prompts through one JetStream server over gRPC, `decode_steps` tokens per engine
call; or, `--backend in_process`, through the in-process backend in the learner's process),
learner (the jitted train step: π_prox and V forward, estimator, 2 epochs of actor and critic
updates, `sync_ppo` preset) and weight sync (a push of the learner's weights to the server through
shared memory; in-process: a device copy of the learner's arrays). The peer's rollout shares the
actor's weights in its process, so it has no weight sync. Step = rollout + learner + weight sync
on both sides (Tunix's measured step from one rollout to the next is reported too). Medians over
steps within a repeat, then the median and range over repeats; the ratios are copc_jax / peer for
throughput, peer / copc_jax for time.
"""

import argparse
import json
import os
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import jax
import numpy as np
from flax import nnx

from copc_jax import presets
from copc_jax.models import hf_io, tiny
from copc_jax.models.decoder import ValueModel
from copc_jax.rollout.in_process import InProcessBackend
from copc_jax.rollout.pool import RolloutPool
from copc_jax.train import Learner, LearnerConfig
from copc_jax.train.fake_data import random_batch
from copc_jax.train.weights import WeightStore
from experiments import study
from experiments.peer import tunix_ppo

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = study.beside(__file__)
RESULTS_IN_PROCESS = study.beside(__file__, "_in_process.json")     # --backend in_process
README = os.path.join(os.path.dirname(HERE), "docs", "results.md")
CHARACTERS = "abcdefghijklmnopqrstuvwxyz0123456789"


def write_workload(directory: str, prompts: int, prompt_length: int, hidden: int = 128, layers: int = 4):
  """The shared checkpoint (weights + tokenizer) in `directory`/model; the prompt strings."""
  tiny.make_tiny_checkpoint(os.path.join(directory, "model"), "qwen2", hidden_size=hidden,
                            intermediate_size=4 * hidden, num_layers=layers, head_dim=hidden // 4)
  rng = np.random.default_rng(0)
  texts = ["".join(rng.choice(list(CHARACTERS), prompt_length)) for _ in range(prompts)]
  with open(os.path.join(directory, "prompts.json"), "w") as f:
    json.dump(texts, f)
  return texts


def run_peer(python: str, directory: str, args) -> dict:
  out = os.path.join(directory, "peer.json")
  command = [python, os.path.join(HERE, "peer", "tunix_ppo.py"), os.path.join(directory, "model"),
             "--prompts", os.path.join(directory, "prompts.json"), "--new-tokens", str(args.new_tokens),
             "--epochs", str(args.epochs), "--steps", str(args.steps), "--out", out]
  env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "XLA_FLAGS")}
  done = subprocess.run(command, capture_output=True, text=True, env=env)
  if done.returncode:
    raise SystemExit(f"the peer run failed ({' '.join(command)}):\n{done.stderr[-3000:]}")
  with open(out) as f:
    return json.load(f)


class Ours:
  """copc_jax's rollout, learner step and weight push on the workload, one server kept up across repeats."""

  def __init__(self, directory: str, prompts: list[str], args):
    self.args, self.directory = args, directory
    model_dir = os.path.join(directory, "model")
    actor, tokenizer = hf_io.from_pretrained(model_dir)
    self.prompt_ids = [tokenizer(p)["input_ids"] for p in prompts]
    critic = ValueModel.from_policy(actor, rngs=nnx.Rngs(1))
    preset = presets.get_preset("sync_ppo")
    self.learner = Learner(actor, critic, LearnerConfig(estimator=preset.estimator, actor=preset.actor,
                                                        epochs=args.epochs, num_minibatches=1))
    prompt_length = max(len(ids) for ids in self.prompt_ids)
    self.batch = random_batch(actor, batch_size=len(prompts), prompt_length=prompt_length,
                              response_length=args.new_tokens, tool_span=0)
    if args.backend == "in_process":
      self.pool = InProcessBackend(actor, slots=len(prompts), max_prefill_length=32, max_length=128,
                                   steps_per_call=args.new_tokens, version=0)
    else:
      self.pool = RolloutPool(model_dir, num_servers=1, slots=len(prompts), max_in_flight=len(prompts),
                              max_prefill_length=32, max_length=128, decode_steps=args.decode_steps)
    self.weights = WeightStore(os.path.join(directory, "weights"), self.pool,
                               transfer="arrays" if args.backend == "in_process" else "shm")
    self.version = 0

  def one_step(self) -> dict:
    requests = [dict(token_ids=ids, max_tokens=self.args.new_tokens, temperature=1.0)
                for ids in self.prompt_ids]
    start = time.perf_counter()
    with ThreadPoolExecutor(len(requests)) as executor:        # one thread per episode, as the trainer
      outs = list(executor.map(lambda r: self.pool.generate(**r), requests))
    rollout_s = time.perf_counter() - start
    start = time.perf_counter()
    jax.block_until_ready(self.learner.train_step(self.batch)["actor_loss"])
    learner_s = time.perf_counter() - start
    self.version += 1
    start = time.perf_counter()
    self.weights.push(self.version, self.learner.actor)
    sync_s = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outs)
    return {"rollout_s": rollout_s, "rollout_tokens": tokens, "learner_s": learner_s, "weight_sync_s": sync_s}

  def run(self, steps: int, warmup: int) -> dict:
    measured = [self.one_step() for _ in range(warmup + steps)][warmup:]
    median = lambda key: float(np.median([m[key] for m in measured]))
    return {"steps": measured, **{k: median(k) for k in ("rollout_s", "rollout_tokens", "learner_s",
                                                             "weight_sync_s")},
            "rollout_tokens_per_s": float(np.median([m["rollout_tokens"] / m["rollout_s"] for m in measured]))}

  def peak_gib(self) -> dict:
    server = max((s.report.get("memory", {}).get("peak_resident_bytes", 0) for s in self.pool.status()),
                 default=0) / 2**30
    return {"learner_process": tunix_ppo.peak_rss_gib(), "server": server}

  def close(self) -> None:
    self.weights.close()
    self.pool.close()


def summarise(ours: list[dict], peer: list[dict], tokens_per_step: int) -> dict:
  """Per repeat: throughputs and times of both sides and their ratios; median and range over repeats."""
  ratio = lambda key, a, b: None if not (a and b) else a / b if key.endswith("per_s") else b / a
  rows = []
  for o, p in zip(ours, peer, strict=True):
    peer_learner_s = p["forward_s"] + p["update_s"]
    row = {"rollout_tokens_per_s": (o["rollout_tokens_per_s"], p["rollout_tokens_per_s"]),
           "learner_tokens_per_s": (tokens_per_step / o["learner_s"], tokens_per_step / peer_learner_s),
           "step_s": (o["rollout_s"] + o["learner_s"] + o["weight_sync_s"],
                      p["rollout_s"] + peer_learner_s + p["weight_sync_s"]),
           "rollout_s": (o["rollout_s"], p["rollout_s"]), "learner_s": (o["learner_s"], peer_learner_s),
           "weight_sync_s": (o["weight_sync_s"], p["weight_sync_s"])}
    rows.append({k: {"copc_jax": a, "peer": b, "ratio": ratio(k, a, b)} for k, (a, b) in row.items()})
  summary = {}
  for key in rows[0]:
    ratios = [r[key]["ratio"] for r in rows if r[key]["ratio"] is not None]
    summary[key] = {side: float(np.median([r[key][side] for r in rows])) for side in ("copc_jax", "peer")}
    if ratios:
      summary[key].update(ratio=float(np.median(ratios)), ratio_range=[float(min(ratios)), float(max(ratios))])
  summary["peer_measured_step_s"] = float(np.median([p["step_s"] for p in peer]))
  return {"repeats": rows, "summary": summary}


LABELS = {"rollout_tokens_per_s": "rollout tokens/s", "learner_tokens_per_s": "learner tokens/s (forward + "
          "2 epochs)", "step_s": "step (rollout + learner + weight sync), s", "weight_sync_s": "weight sync, s"}


def render(results_path: str = RESULTS, readme: str = README) -> str:
  """docs/results.md's side-by-side table, from the benchmark's JSON (marker `peer`, or `peer_in_process`
  for a run with `--backend in_process`)."""
  with open(results_path) as f:
    r = json.load(f)
  s = r["summary"]
  backend = r.get("backend", "jetstream")
  lines = [f"copc_jax's rollout backend: {backend}. Tunix {r['peer']['version']} (jax {r['peer']['jax']}) "
           f"and copc_jax on one random "
           f"{r['parameters'] / 1e6:.2f}M-parameter Qwen2-style model, {r['prompts']} prompts of "
           f"{r['prompt_length']} tokens, {r['new_tokens']} new tokens, PPO with a critic, {r['epochs']} "
           f"epochs; {r['repeats_run']} alternating repeats of {r['steps']} steps after {r['warmup']} warm-up "
           f"steps (commit {r['git_commit'][:10]}; `{r['command']}`).", "",
           "| | copc_jax | Tunix | copc_jax vs Tunix (range over repeats) |", "|---|---:|---:|---|"]
  for key, label in LABELS.items():
    x = s[key]
    ratio = (f"{x['ratio']:.2f}× ({x['ratio_range'][0]:.2f}–{x['ratio_range'][1]:.2f})" if "ratio" in x
             else "–")
    digits = 0 if key.endswith("per_s") else 3
    lines.append(f"| {label} | {x['copc_jax']:.{digits}f} | {x['peer']:.{digits}f} | {ratio} |")
  m = r["peak_memory_gib"]
  lines += ["", f"Ratios above 1 favour copc_jax (throughput: ours / Tunix; time: Tunix / ours). Tunix's own "
            f"step, timed from one rollout to the next: {s['peer_measured_step_s']:.3f} s. Peak resident "
            f"memory: copc_jax's learner process {m['copc_jax_learner_process']:.2f} GiB and its server "
            f"{m['copc_jax_server']:.2f} GiB; Tunix's one process {m['peer']:.2f} GiB."]
  text = "\n".join(lines)
  study.write_between_markers(readme, "peer" if backend == "jetstream" else "peer_in_process", text)
  return text


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--peer-python", help="the Python of the peer's environment (with google-tunix)")
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--steps", type=int, default=5, help="timed steps per repeat (each side)")
  parser.add_argument("--warmup", type=int, default=2, help="untimed steps before them (compilation)")
  parser.add_argument("--prompts", type=int, default=8)
  parser.add_argument("--prompt-length", type=int, default=16)
  parser.add_argument("--new-tokens", type=int, default=32)
  parser.add_argument("--epochs", type=int, default=2)
  parser.add_argument("--decode-steps", type=int, default=1, help="tokens per slot per engine call (ours)")
  parser.add_argument("--backend", choices=("jetstream", "in_process"), default="jetstream",
                      help="our rollout backend (in_process: no server; weights as arrays)")
  parser.add_argument("--out", help="also write the numbers here (JSON, with provenance)")
  parser.add_argument("--render", action="store_true", help="only rewrite the docs table from " + RESULTS)
  args = parser.parse_args()
  if args.render:
    print(render())
    if os.path.exists(RESULTS_IN_PROCESS):
      print(render(RESULTS_IN_PROCESS))
    return
  if not args.peer_python:
    parser.error("--peer-python is required: the Python of an environment made from "
                 "experiments/peer/requirements.txt")
  with tempfile.TemporaryDirectory() as directory:
    prompts = write_workload(directory, args.prompts, args.prompt_length)
    ours_side, peer_side = [], []
    ours = Ours(directory, prompts, args)
    try:
      for repeat in range(args.repeats):
        peer_side.append(run_peer(args.peer_python, directory, args))
        ours_side.append(ours.run(args.steps, args.warmup))
        o, p = ours_side[-1], peer_side[-1]
        print(f"repeat {repeat}: rollout tokens/s ours {o['rollout_tokens_per_s']:.0f}, Tunix "
              f"{p['rollout_tokens_per_s']:.0f}; learner s ours {o['learner_s']:.3f}, Tunix "
              f"{p['forward_s'] + p['update_s']:.3f}", flush=True)
      peaks = ours.peak_gib()
    finally:
      ours.close()
    parameters = sum(x.size for x in jax.tree.leaves(nnx.state(ours.learner.actor, nnx.Param)))
  tokens_per_step = args.prompts * (args.prompt_length + args.new_tokens)
  result = summarise(ours_side, peer_side, tokens_per_step)
  for key, label in LABELS.items():
    x = result["summary"][key]
    print(f"{label:>45}: copc_jax {x['copc_jax']:.3f}, Tunix {x['peer']:.3f}"
          + (f", ratio {x['ratio']:.2f} ({x['ratio_range'][0]:.2f}-{x['ratio_range'][1]:.2f})" if "ratio" in x
             else ""))
  if args.out:
    study.write_benchmark(args.out, {
        "description": __doc__.splitlines()[0], "parameters": int(parameters), "prompts": args.prompts,
        "prompt_length": args.prompt_length, "new_tokens": args.new_tokens, "epochs": args.epochs,
        "steps": args.steps, "warmup": args.warmup, "repeats_run": args.repeats,
        "decode_steps": args.decode_steps, "backend": args.backend,
        "peer": {k: peer_side[0][k] for k in ("library", "version", "jax")},
        "peak_memory_gib": {"copc_jax_learner_process": peaks["learner_process"],
                            "copc_jax_server": peaks["server"],
                            "peer": max(p["peak_rss_gib"] for p in peer_side)},
        "ours": ours_side, "peer_runs": peer_side, **result})


if __name__ == "__main__":
  main()
