"""Study: advantage staleness on the real task, against Monte-Carlo advantages of the current policy.

  python experiments/advantage_staleness/run.py              # lags 0 1 4 16 64, 24 episodes, M = 8
  python experiments/advantage_staleness/run.py --render     # table and figure from results.json

1. A lag-64 COPC run of the default task (`--updates` updates from the shared warm start of seed 0)
   leaves the learner at version U and keeps the weights of versions U − 64 … U.
2. For each lag k, episodes of `--episodes` training prompts are generated with version U − k
   (μ) through a JetStream server, and the learner at version U (π, its critic V) computes each
   estimator's advantages on them, before whitening, as in a training step.
3. On chosen policy tokens (the first two tokens of every turn: the tool-or-answer decision, and one
   more at random), A^π(s_t, a_t) = Q^π − V^π is estimated by Monte Carlo: M continuations of π
   (version U, a second server, the real sandboxed tool and reward) from the prefix with a_t, and M
   from the prefix alone. Its noise variance, Var(Q̂)/M + Var(V̂)/M, is subtracted from the squared
   error, so the MSE column estimates E[(Â − A^π)²].
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import study  # noqa: E402

LAGS = (64, 16, 4, 1, 0)        # in this order: the behaviour server's versions only move forward


def estimators_compared():
  import dataclasses

  from copc_jax import presets
  copc = presets.get_preset("copc").estimator
  return {"GAE (no correction)": presets.get_preset("decoupled_ppo").estimator,
          "V-trace": presets.get_preset("vtrace").estimator,
          "COPC (defaults)": copc,
          "COPC (toy's best)": dataclasses.replace(copc, rho_clip=(0.0, float("inf")), trace_clip=(0.0, 1.0),
                                                   lam=0.8, advantage_form="vtrace_pg")}


def chosen_positions(trajectory, rng: random.Random, extra: int = 1) -> list[int]:
  """Indices into token_ids: the first two policy tokens of every turn, and `extra` random others."""
  mask = trajectory.mask
  starts = [i for i, m in enumerate(mask) if m and (i == 0 or not mask[i - 1])]
  chosen = {i + d for i in starts for d in (0, 1) if i + d < len(mask) and mask[i + d]}
  others = [i for i, m in enumerate(mask) if m and i not in chosen]
  return sorted(chosen | set(rng.sample(others, min(extra, len(others)))))


def mc_advantage(runner, episode, index: int, m: int, key) -> dict:
  """Q̂ from M continuations with a_t, V̂ from M without; the estimate and its noise variance."""
  from copc_jax.rollout import agent
  with_action, without = agent.prefix(episode.trajectory, index + 1), agent.prefix(episode.trajectory, index)
  play = lambda start, tag, j: runner.continue_from(start, episode.record,
                                                    seed=agent.request_seed(*key, tag, j)).trajectory.reward
  q = [play(with_action, "q", j) for j in range(m)]
  v = [play(without, "v", j) for j in range(m)]
  return {"mc_advantage": float(np.mean(q) - np.mean(v)),
          "mc_variance": float(np.var(q, ddof=1) / m + np.var(v, ddof=1) / m), "q": float(np.mean(q)),
          "v": float(np.mean(v))}


def measure(args) -> dict:
  import jax

  from copc_jax import estimators
  from copc_jax.envs import data
  from copc_jax.rollout.agent import to_batch
  from copc_jax.rollout.pool import RolloutPool
  from copc_jax.sampling import token_logprobs_and_entropy
  from copc_jax.train import rollouts, trainer
  from copc_jax.train.learner import state_values

  config = "configs/default.py"
  overrides = {"preset": "copc", "trainer.mode": "lag", "trainer.lag": max(LAGS), "trainer.steps": args.updates,
               "trainer.eval_every": 0, "trainer.checkpoint_every": args.updates}
  warm = study.shared_warm_start(config, {}, args.seed, args.root)
  train_dir = os.path.join(args.root, f"lag{max(LAGS)}_seed{args.seed}")
  if not os.path.exists(os.path.join(train_dir, "summary.json")):
    print(f"training {args.updates} updates at lag {max(LAGS)}...", flush=True)
    study.run_cell(config, overrides, args.seed, train_dir, warm)
  typed = study.load_config(config, {**overrides, "model.checkpoint": warm, "warm_start.steps": 0}, args.seed)
  run = trainer.Trainer(typed, train_dir)              # restores the learner at version U
  version = run.step
  actor, critic = run.learner.actor, run.learner.critic
  c = typed.rollout
  records = data.PromptIterator(run.task.train, seed=1234)
  records = [next(records) for _ in range(args.episodes)]
  pool_args = dict(num_servers=1, max_in_flight=c.max_in_flight, slots=c.slots,
                   max_prefill_length=c.max_prefill_length, max_length=c.max_length, version=-1,
                   log_dir=os.path.join(args.root, "logs"))
  weights = lambda v: os.path.join(train_dir, "weights", f"v{v}")
  rows = {}
  with RolloutPool(warm, **pool_args) as behaviour, RolloutPool(warm, **pool_args) as current:
    current.update_weights(weights(version), version)
    runner_pi = rollouts.EpisodeRunner(current.generate, run.task, run.tokenizer, c, seed=("pi",))
    for lag in LAGS:
      behaviour.update_weights(weights(version - lag), version - lag)
      runner_mu = rollouts.EpisodeRunner(behaviour.generate, run.task, run.tokenizer, c, seed=("mu", lag))
      episodes = rollouts.collect(runner_mu, records, c.concurrency)
      batch = to_batch([e.trajectory for e in episodes], length=c.max_length)
      logits = actor(batch.tokens, attention_mask_bt=batch.attention_mask)
      logp_prox, _ = token_logprobs_and_entropy(logits, batch.tokens, c.sampling)
      values = state_values(critic, batch)
      advantages = {name: np.asarray(estimators.coupled_advantages(
          batch.rewards, values, logp_prox, batch.behavior_logprobs, batch.mask, **e.estimator_kwargs())[0])
          for name, e in estimators_compared().items()}
      log_ratio = np.asarray(logp_prox - batch.behavior_logprobs)
      rng = random.Random(lag)
      jobs = [(i, index) for i, e in enumerate(episodes) for index in chosen_positions(e.trajectory, rng)]
      print(f"lag {lag}: {len(jobs)} tokens × 2 × {args.mc} continuations", flush=True)
      with ThreadPoolExecutor(c.concurrency) as executor:
        mc = list(executor.map(mc_advantage, [runner_pi] * len(jobs), [episodes[i] for i, _ in jobs],
                               [index for _, index in jobs], [args.mc] * len(jobs),
                               [(lag, i, index) for i, index in jobs]))
      tokens = []
      for (i, index), estimate in zip(jobs, mc, strict=True):
        position = len(episodes[i].trajectory.prompt_ids) + index
        tokens.append({**estimate, "episode": i, "index": index, "log_ratio": float(log_ratio[i, position]),
                       "estimators": {name: float(a[i, position]) for name, a in advantages.items()}})
      policy = np.asarray(batch.mask)
      rows[str(lag)] = {"behaviour_version": version - lag, "learner_version": version, "tokens": tokens,
                        "abs_log_ratio_mean": float(np.abs(log_ratio[policy]).mean()),
                        "outside_default_mask": float((np.abs(log_ratio[policy]) > np.log(2)).mean()),
                        "reward_mean": float(np.mean([e.trajectory.reward for e in episodes])),
                        "metrics": summarise(tokens)}
      print(json.dumps(rows[str(lag)]["metrics"]["COPC (defaults)"]), flush=True)
  return {"description": __doc__.splitlines()[0], "learner_version": version, "episodes": args.episodes,
          "mc_continuations": args.mc, "seed": args.seed, "updates": args.updates,
          "git_commit": study.git_commit(), "jax_version": jax.__version__, "lags": rows}


def summarise(tokens: list[dict], resamples: int = 2000) -> dict:
  """Per estimator: bias, noise-corrected MSE and correlation against the MC advantage, with 95% CIs."""
  target = np.array([t["mc_advantage"] for t in tokens])
  noise = np.array([t["mc_variance"] for t in tokens])
  rng = np.random.default_rng(0)
  boot = rng.integers(0, len(tokens), size=(resamples, len(tokens)))
  out = {}
  for name in tokens[0]["estimators"]:
    estimate = np.array([t["estimators"][name] for t in tokens])
    error = estimate - target
    stats = lambda idx, error=error, estimate=estimate: (
        error[idx].mean(), (error[idx] ** 2 - noise[idx]).mean(),
        np.corrcoef(estimate[idx], target[idx])[0, 1] if target[idx].std() > 0 else np.nan)
    point = stats(np.arange(len(tokens)))
    draws = np.array([stats(idx) for idx in boot])
    out[name] = {key: {"value": float(p), "ci95": [float(np.nanpercentile(draws[:, j], 2.5)),
                                                    float(np.nanpercentile(draws[:, j], 97.5))]}
                 for j, (key, p) in enumerate(zip(("bias", "mse", "correlation"), point, strict=True))}
  return out


def render(results: dict, here: str = HERE) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  lags = sorted(results["lags"], key=int)
  names = list(results["lags"][lags[0]]["metrics"])
  fig, axes = plt.subplots(1, 3, figsize=(15, 3.6))
  for offset, name in enumerate(names):
    for ax, key in zip(axes, ("bias", "mse", "correlation"), strict=True):
      stats = [results["lags"][k]["metrics"][name][key] for k in lags]
      x = np.arange(len(lags)) + 0.08 * (offset - len(names) / 2)
      value = np.array([s["value"] for s in stats])
      low = value - np.array([s["ci95"][0] for s in stats])
      high = np.array([s["ci95"][1] for s in stats]) - value
      ax.errorbar(x, value, yerr=[low, high], marker="o", capsize=3, label=name)
      ax.set_xticks(np.arange(len(lags)), [f"k = {k}" for k in lags])
      ax.set_title({"bias": "bias E[Â − A^π]", "mse": "MSE E[(Â − A^π)²] (MC noise removed)",
                    "correlation": "correlation with A^π"}[key])
      ax.grid(alpha=0.3)
  axes[2].legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(os.path.join(here, "advantage_error.png"), dpi=110)
  plt.close(fig)
  f = lambda s: f"{s['value']:.3f} [{s['ci95'][0]:.3f}, {s['ci95'][1]:.3f}]"
  r = results
  lines = [f"Learner version {r['learner_version']} of a lag-64 COPC run ({r['updates']} updates, "
           f"seed {r['seed']}); {r['episodes']} episodes per lag, M = {r['mc_continuations']}; "
           f"commit {r['git_commit'][:10]}, jax {r['jax_version']}. Brackets: 95% bootstrap CIs.", "",
           "| k | tokens | mean abs log r | tokens outside (0.5, 2) | estimator | bias | MSE | correlation |",
           "|---:|---:|---:|---:|---|---:|---:|---:|"]
  for k in lags:
    row = results["lags"][k]
    for j, name in enumerate(names):
      m = row["metrics"][name]
      head = (f"| {k} | {len(row['tokens'])} | {row['abs_log_ratio_mean']:.3f} | "
              f"{row['outside_default_mask']:.3f} |") if j == 0 else "| | | | |"
      lines.append(f"{head} {name} | {f(m['bias'])} | {f(m['mse'])} | {f(m['correlation'])} |")
  lines += ["", "![advantage error against lag](advantage_error.png)"]
  study.write_between_markers(os.path.join(here, "README.md"), "results", "\n".join(lines))


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--episodes", type=int, default=24)
  parser.add_argument("--mc", type=int, default=8, help="continuations per estimate (M)")
  parser.add_argument("--updates", type=int, default=80)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--render", action="store_true")
  parser.add_argument("--root", default=os.path.join(tempfile.gettempdir(), "copc_advantage_staleness"))
  parser.add_argument("--out", default=os.path.join(HERE, "results.json"))
  args = parser.parse_args()
  if not args.render:
    study.write_json(args.out, measure(args))
  with open(args.out) as f:
    results = json.load(f)
  if os.path.exists(os.path.join(HERE, "README.md")):
    render(results)


if __name__ == "__main__":
  main()
