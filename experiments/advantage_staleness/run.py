"""Study: advantage staleness on the real task, against Monte-Carlo advantages of the current policy.

  python -m experiments.advantage_staleness.run              # seeds 0 1 2, lags 0 1 4 16 64, M = 8
  python -m experiments.advantage_staleness.run --seeds 3    # one more seed (finished seeds are kept)
  python -m experiments.advantage_staleness.run --render     # table and figure from results.json
  python -m experiments.advantage_staleness.run --seeds 0 1 2 3 \
      --out experiments/advantage_staleness/results_rerun.json
      # the learner as the field runs it (the default config's minibatches, critic warm-up, centred
      # whitening), from the shipped warm starts; rendered between the README's results_rerun markers

1. Per seed, a lag-64 COPC run (`LEARNER`: the PPO clip on μ) of the default task (`--updates` updates
   from the shared warm start of that seed) leaves the learner at version U and keeps the weights of
   versions U − 64 … U.
2. For each lag k, episodes of `--episodes` training prompts are generated with version U − k
   (μ) through a JetStream server, and the learner at version U (π, its critic V) computes each
   estimator's advantages on them, before whitening, as in a training step.
3. On chosen policy tokens (the first two tokens of every turn: the tool-or-answer decision, and one
   more at random), A^π(s_t, a_t) = Q^π − V^π is estimated by Monte Carlo: M continuations of π
   (version U, a second server, the real sandboxed tool and reward) from the prefix with a_t, and M
   from the prefix alone. Its noise variance, Var(Q̂)/M + Var(V̂)/M, is subtracted from the squared
   error, so the MSE column estimates E[(Â − A^π)²].
4. The tokens of every seed whose learner has not collapsed are pooled per lag; 95% CIs come from a
   bootstrap over episodes (the tokens of one episode share its continuations' randomness), and each
   seed's own numbers are kept. A learner has collapsed when its own episodes (k = 0) earn more than
   `study.COLLAPSE_DROP` less reward than the best of its earlier versions measured (U − k): its
   critic and policy then describe a different task, and it is reported apart, not pooled.

Each corrected estimator is paired with its uncorrected control on the same tokens (`CONTROL`: the
difference of squared errors, whose MC noise cancels, bootstrapped over episodes): GAE with λ = 1
for V-trace and COPC's defaults, GAE with λ = 0.8 for the toy's best COPC setting (λ = 0.8,
truncated traces, `vtrace_pg`): what both gain over λ = 1 is the shorter trace, and only a gap that
opens between them as k grows is the correction of staleness.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import tempfile
import warnings
from concurrent.futures import ThreadPoolExecutor

import jax
import numpy as np

from copc_jax import estimators, presets
from copc_jax.envs import data
from copc_jax.rollout import agent
from copc_jax.rollout.pool import RolloutPool
from copc_jax.rollout.protocol import WeightUpdate
from copc_jax.sampling import token_logprobs_and_entropy
from copc_jax.train import trainer
from copc_jax.train.batch import TrajectoryBatch
from copc_jax.train.episodes import EpisodeRunner
from copc_jax.train.episodes import collect as collect_episodes
from copc_jax.train.learner import state_values
from experiments import figures, study

HERE = os.path.dirname(os.path.abspath(__file__))

LAGS = (0, 1, 4, 16, 64)
# the preset whose colour an estimator's curves take (GAE is decoupled PPO's estimator)
ESTIMATOR_PRESET = {"GAE": "decoupled_ppo", "V-trace": "vtrace", "COPC": "copc"}
SEEDS = (0, 1, 2)
# The lag run's learner: the spec's COPC with the PPO clip on μ (the default `copc`). The spec's own setting
# collapses at lag 64 by update 20-40 on every seed of the rerun (presets_across_staleness,
# results_rerun.json), which would leave no learner to pool; the anchor changes only the policy loss, so
# the estimators compared below, computed from this learner's π and critic, are the spec's.
LEARNER = {"preset": "copc_spec", "actor.anchor": "behavior"}


def estimators_compared():

  copc = presets.get_preset("copc_spec").estimator
  gae = presets.get_preset("decoupled_ppo").estimator
  return {"GAE (no correction)": gae,
          "GAE λ = 0.8 (no correction)": dataclasses.replace(gae, lam=0.8),
          "V-trace": presets.get_preset("vtrace").estimator,
          "COPC (defaults)": copc,
          "COPC (toy's best)": dataclasses.replace(copc, rho_clip=(0.0, float("inf")), trace_clip=(0.0, 1.0),
                                                   lam=0.8, advantage_form="vtrace_pg")}


# each corrected estimator's control: the same trace length, no correction
CONTROL = {"V-trace": "GAE (no correction)", "COPC (defaults)": "GAE (no correction)",
           "COPC (toy's best)": "GAE λ = 0.8 (no correction)"}


def chosen_positions(trajectory, rng: random.Random, extra: int = 1) -> list[int]:
  """Indices into token_ids: the first two policy tokens of every turn, and `extra` random others."""
  mask = trajectory.mask
  starts = [i for i, m in enumerate(mask) if m and (i == 0 or not mask[i - 1])]
  chosen = {i + d for i in starts for d in (0, 1) if i + d < len(mask) and mask[i + d]}
  others = [i for i, m in enumerate(mask) if m and i not in chosen]
  return sorted(chosen | set(rng.sample(others, min(extra, len(others)))))


def mc_advantage(runner, episode, index: int, m: int, key) -> dict:
  """Q̂ from M continuations with a_t, V̂ from M without; the estimate and its noise variance."""
  with_action, without = agent.prefix(episode.trajectory, index + 1), agent.prefix(episode.trajectory, index)
  play = lambda start, tag, j: runner.continue_from(start, episode.record,
                                                    seed=agent.request_seed(*key, tag, j)).trajectory.reward
  q = [play(with_action, "q", j) for j in range(m)]
  v = [play(without, "v", j) for j in range(m)]
  return {"mc_advantage": float(np.mean(q) - np.mean(v)),
          "mc_variance": float(np.var(q, ddof=1) / m + np.var(v, ddof=1) / m), "q": float(np.mean(q)),
          "v": float(np.mean(v))}


def measure_seed(args, seed: int) -> dict:
  """One learner (a lag-max(lags) run of `seed`): per lag, the behaviour episodes and the MC targets."""

  config, lags = "configs/default.py", sorted(args.lags)
  overrides = {**LEARNER, "trainer.mode": "lag", "trainer.lag": max(lags),
               "trainer.steps": args.updates,
               "trainer.eval_every": 0, "trainer.checkpoint_every": args.updates, **args.common}
  warm = study.shared_warm_start(config, args.common, seed, args.root)
  train_dir = os.path.join(args.root, f"lag{max(lags)}_updates{args.updates}_seed{seed}")
  if not os.path.exists(os.path.join(train_dir, "summary.json")):
    print(f"seed {seed}: training {args.updates} updates at lag {max(lags)}...", flush=True)
    study.run_cell(config, overrides, seed, train_dir, warm)
  typed = study.load_config(config, {**overrides, "model.checkpoint": warm, "warm_start.steps": 0}, seed)
  run = trainer.Trainer(trainer.build(typed, train_dir))              # restores the learner at version U
  version = run.step
  actor, critic = run.learner.actor, run.learner.critic
  c = typed.rollout
  records = data.PromptIterator(run.task.train, seed=1234 + seed)
  records = [next(records) for _ in range(args.episodes)]
  pool_args = dict(num_servers=1, max_in_flight=c.max_in_flight, slots=c.slots,
                   max_prefill_length=c.max_prefill_length, max_length=c.max_length, version=-1,
                   log_dir=os.path.join(args.root, "logs"))
  weights = lambda v: os.path.join(train_dir, "weights", f"v{v}")
  rows = {}
  with RolloutPool(warm, **pool_args) as behaviour, RolloutPool(warm, **pool_args) as current:
    current.push(WeightUpdate(version, weights(version)))
    runner_pi = EpisodeRunner(current.generate, run.task, run.tokenizer, c, seed=("pi", seed))
    for lag in reversed(lags):          # the behaviour server's versions only move forward
      behaviour.push(WeightUpdate(version - lag, weights(version - lag)))
      runner_mu = EpisodeRunner(behaviour.generate, run.task, run.tokenizer, c, seed=("mu", seed, lag))
      episodes = collect_episodes(runner_mu, records, c.concurrency)
      batch = TrajectoryBatch.from_episodes([e.trajectory for e in episodes], length=c.max_length)
      logits = actor(batch.tokens, attention_mask_bt=batch.attention_mask)
      logp_prox, _ = token_logprobs_and_entropy(logits, batch.tokens, c.sampling)
      values = state_values(critic, batch)
      advantages = {name: np.asarray(estimators.coupled_advantages(
          batch.rewards, values, logp_prox, batch.behavior_logprobs, batch.mask, **e.estimator_kwargs())[0])
          for name, e in estimators_compared().items()}
      log_ratio = np.asarray(logp_prox - batch.behavior_logprobs)
      rng = random.Random(lag)
      jobs = [(i, index) for i, e in enumerate(episodes) for index in chosen_positions(e.trajectory, rng)]
      print(f"seed {seed}, lag {lag}: {len(jobs)} tokens × 2 × {args.mc} continuations", flush=True)
      with ThreadPoolExecutor(c.concurrency) as executor:
        mc = list(executor.map(mc_advantage, [runner_pi] * len(jobs), [episodes[i] for i, _ in jobs],
                               [index for _, index in jobs], [args.mc] * len(jobs),
                               [(seed, lag, i, index) for i, index in jobs]))
      tokens = []
      for (i, index), estimate in zip(jobs, mc, strict=True):
        position = len(episodes[i].trajectory.prompt_ids) + index
        tokens.append({**estimate, "episode": i, "index": index, "log_ratio": float(log_ratio[i, position]),
                       "estimators": {name: float(a[i, position]) for name, a in advantages.items()}})
      policy = np.asarray(batch.mask)
      rows[str(lag)] = {"behaviour_version": version - lag, "tokens": tokens,
                        "abs_log_ratio_mean": float(np.abs(log_ratio[policy]).mean()),
                        "outside_default_mask": float((np.abs(log_ratio[policy]) > np.log(2)).mean()),
                        "reward_mean": float(np.mean([e.trajectory.reward for e in episodes])),
                        "metrics": summarise(tokens, resamples=args.resamples)}
  return {"learner_version": version, "git_commit": study.git_commit(), "lags": rows}


def learner_collapsed(seed_result: dict, drop: float = study.COLLAPSE_DROP) -> bool:
  """Whether the learner (version U) earns on its own episodes (lag 0) more than `drop` less reward
  than the best of the versions U − k measured (None: no lag-0 episodes to tell)."""
  rewards = {int(k): row["reward_mean"] for k, row in seed_result["lags"].items()}
  if 0 not in rewards:
    return None
  return rewards[0] < max(rewards.values()) - drop


def pooled(per_seed: dict, resamples: int = 2000) -> dict:
  """Per lag: the tokens of every seed in `per_seed` together (episodes keep their seed), ratios
  averaged over seeds."""
  lags = sorted(set.intersection(*(set(r["lags"]) for r in per_seed.values())), key=int)
  out = {}
  for lag in lags:
    rows = [r["lags"][lag] for r in per_seed.values()]
    tokens = [{**t, "episode": f"{seed}/{t['episode']}"} for seed, r in per_seed.items()
              for t in r["lags"][lag]["tokens"]]
    out[lag] = {"tokens": len(tokens), "metrics": summarise(tokens, resamples),
                **{key: float(np.mean([row[key] for row in rows]))
                   for key in ("abs_log_ratio_mean", "outside_default_mask", "reward_mean")}}
  return out


def measure(args, results: dict) -> dict:
  """Run every seed not in `results` yet (writing after each); then pool."""
  args.common = {"warm_start.steps": args.warm_start_steps} if args.warm_start_steps is not None else {}
  per_seed = results.setdefault("seeds", {})
  for seed in args.seeds:
    done = per_seed.get(str(seed))
    if done and set(map(str, args.lags)) <= set(done["lags"]):
      continue
    per_seed[str(seed)] = measure_seed(args, seed)
    results.update({"description": __doc__.splitlines()[0], "episodes": args.episodes,
                    "mc_continuations": args.mc, "updates": args.updates, "lag_of_training_run": max(args.lags),
                    "learner_overrides": LEARNER,
                    "estimators": list(estimators_compared()), "jax_version": jax.__version__,
                    "git_commit": study.git_commit(), **study.provenance()})
    pool(results, args.resamples)
    study.write_json(args.out, results)
  return results


def pool(results: dict, resamples: int = 2000) -> None:
  """`results["lags"]`: the seeds whose learner has not collapsed, pooled; `collapsed_seeds` names the
  others (their own numbers stay under `seeds`)."""
  per_seed = results["seeds"]
  collapsed = [s for s, r in per_seed.items() if learner_collapsed(r)]
  healthy = {s: r for s, r in per_seed.items() if s not in collapsed}
  results["collapsed_seeds"] = sorted(collapsed, key=int)
  results["lags"] = pooled(healthy or per_seed, resamples)


def summarise(tokens: list[dict], resamples: int = 2000) -> dict:
  """Per estimator: bias, noise-corrected MSE and correlation against the MC advantage, and for the
  corrected ones the paired MSE difference against `CONTROL` (mean over tokens of (Â − A)² − (Â_c − A)²),
  with 95% CIs from a bootstrap over episodes (a token without an `episode` is its own)."""
  target = np.array([t["mc_advantage"] for t in tokens])
  noise = np.array([t["mc_variance"] for t in tokens])
  groups: dict = {}
  for i, t in enumerate(tokens):
    groups.setdefault(str(t.get("episode", f"token{i}")), []).append(i)
  groups = [np.array(g) for g in groups.values()]
  rng = np.random.default_rng(0)
  boot = [np.concatenate([groups[j] for j in rng.integers(0, len(groups), len(groups))])
          for _ in range(resamples)]
  out = {}
  estimates = {name: np.array([t["estimators"][name] for t in tokens]) for name in tokens[0]["estimators"]}
  errors = {name: estimate - target for name, estimate in estimates.items()}
  for name, estimate in estimates.items():
    error = errors[name]
    stats = lambda idx, error=error, estimate=estimate: (
        error[idx].mean(), (error[idx] ** 2 - noise[idx]).mean(),
        np.corrcoef(estimate[idx], target[idx])[0, 1] if target[idx].std() > 0 else np.nan)
    point = stats(np.arange(len(tokens)))
    with warnings.catch_warnings():          # a resample whose targets are all equal has no correlation
      warnings.simplefilter("ignore", RuntimeWarning)
      draws = np.array([stats(idx) for idx in boot])
      ci = [(np.nanpercentile(draws[:, j], 2.5), np.nanpercentile(draws[:, j], 97.5)) for j in range(3)]
    out[name] = {key: {"value": float(p), "ci95": [float(ci[j][0]), float(ci[j][1])]}
                 for j, (key, p) in enumerate(zip(("bias", "mse", "correlation"), point, strict=True))}
    if CONTROL.get(name) in errors:
      gap = error ** 2 - errors[CONTROL[name]] ** 2
      draws = [gap[idx].mean() for idx in boot]
      out[name]["mse_minus_control"] = {"value": float(gap.mean()), "control": CONTROL[name],
                                        "ci95": [float(np.percentile(draws, q)) for q in (2.5, 97.5)]}
  return out


def render(results: dict, here: str = HERE, name: str = "results") -> None:
  """Table and figure into README.md between the `name` markers (`results` or `results_rerun`, the
  study on the learner as the field runs it); the figure is `advantage_error.png` or
  `advantage_error_rerun.png`."""
  figure = study.figure_file("advantage_error", name)
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  lags = sorted(results["lags"], key=int)
  names = list(results["lags"][lags[0]]["metrics"])
  fig, axes = plt.subplots(1, 3, figsize=(15, 3.6))
  styles = figures.line_styles(names, {n: ESTIMATOR_PRESET.get(n.split(" ")[0], n) for n in names})
  for offset, estimator in enumerate(names):
    for ax, key in zip(axes, ("bias", "mse", "correlation"), strict=True):
      stats = [results["lags"][k]["metrics"][estimator][key] for k in lags]
      x = np.arange(len(lags)) + 0.08 * (offset - len(names) / 2)
      value = np.array([s["value"] for s in stats])
      low = value - np.array([s["ci95"][0] for s in stats])
      high = np.array([s["ci95"][1] for s in stats]) - value
      ax.errorbar(x, value, yerr=[low, high], marker="o", capsize=3, label=estimator, **styles[estimator])
      ax.set_xticks(np.arange(len(lags)), [f"k = {k}" for k in lags])
      ax.set_title({"bias": "bias E[Â − A^π]", "mse": "MSE E[(Â − A^π)²] (MC noise removed)",
                    "correlation": "correlation with A^π"}[key])
      ax.grid(alpha=0.3)
  figures.legend_outside(axes[2])
  fig.tight_layout()
  fig.savefig(os.path.join(here, figure), dpi=110)
  plt.close(fig)
  r, seeds = results, sorted(results["seeds"], key=int)
  collapsed = r.get("collapsed_seeds", [])
  healthy = [s for s in seeds if s not in collapsed]
  versions = ", ".join(str(r["seeds"][s]["learner_version"]) for s in seeds)
  rewards = "; ".join(f"seed {s}: " + ", ".join(f"{r['seeds'][s]['lags'][k]['reward_mean']:.2f}" for k in lags
                                                if k in r["seeds"][s]["lags"]) for s in seeds)
  apart = (f" Seed{'s' * (len(collapsed) > 1)} {', '.join(collapsed)}: the learner collapsed (its own "
           f"episodes, k = 0, earn more than {study.COLLAPSE_DROP} less reward than its best earlier version), "
           f"reported apart below, not pooled." if collapsed else " No learner collapsed.")
  setting = (" (" + ", ".join(f"{k}={v}" for k, v in r["learner_overrides"].items()) + ")"
             if "learner_overrides" in r else "")        # before it was recorded: the spec's setting
  lines = [f"Seeds {', '.join(seeds)}: the learner of a lag-{r['lag_of_training_run']} COPC run{setting} after "
           f"{r['updates']} updates (versions {versions}), its critic; {r['episodes']} episodes per lag and "
           f"seed, M = {r['mc_continuations']}. Reward of the behaviour episodes at k = {', '.join(lags)} "
           f"({rewards}).{apart} Pooled: the tokens of seeds {', '.join(healthy)}. Brackets: 95% bootstrap "
           f"CIs over episodes; last column: each pooled seed's own MSE. Commit {r['git_commit'][:10]}, "
           f"jax {r['jax_version']}.", "",
           *error_table(results["lags"], r, healthy, lags, names, per_seed=True),
           "", f"![advantage error against lag, pooled seeds]({figure})"]
  for s in collapsed:
    lines += ["", f"Seed {s}, whose learner collapsed, on its own:", "",
              *error_table(r["seeds"][s]["lags"], r, [s], lags, names, per_seed=False)]
  study.write_between_markers(os.path.join(here, "README.md"), name, "\n".join(lines))


def error_table(rows: dict, results: dict, seeds: list[str], lags: list[str], names: list[str], *,
                per_seed: bool) -> list[str]:
  """Markdown rows: per lag and estimator, bias / MSE / correlation with CIs, the paired MSE difference
  against the estimator's control where the JSON has it, and each seed's MSE."""
  f = lambda s: f"{s['value']:.3f} [{s['ci95'][0]:.3f}, {s['ci95'][1]:.3f}]"
  paired = any("mse_minus_control" in m for row in rows.values() for m in row["metrics"].values())
  lines = ["| k | tokens | mean abs log r | tokens outside (0.5, 2) | estimator | bias | MSE | correlation |"
           + " MSE − its control's (paired) |" * paired + " MSE per seed |" * per_seed,
           "|---:|---:|---:|---:|---|---:|---:|---:|" + "---:|" * paired + "---:|" * per_seed]
  for k in [k for k in lags if k in rows]:
    row = rows[k]
    tokens = row["tokens"] if isinstance(row["tokens"], int) else len(row["tokens"])
    for j, name in enumerate(names):
      m = row["metrics"][name]
      head = (f"| {k} | {tokens} | {row['abs_log_ratio_mean']:.3f} | "
              f"{row['outside_default_mask']:.3f} |") if j == 0 else "| | | | |"
      line = f"{head} {name} | {f(m['bias'])} | {f(m['mse'])} | {f(m['correlation'])} |"
      if paired:
        line += (" " + f(m["mse_minus_control"]).replace("-0.000", "0.000") + " |"   # identical estimates
                 if "mse_minus_control" in m else " – |")
      if per_seed:
        line += " " + " / ".join(f"{results['seeds'][s]['lags'][k]['metrics'][name]['mse']['value']:.3f}"
                                 for s in seeds if k in results["seeds"][s]["lags"]) + " |"
      lines.append(line)
  return lines


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS))
  parser.add_argument("--lags", type=int, nargs="+", default=list(LAGS))
  parser.add_argument("--episodes", type=int, default=24, help="behaviour episodes per lag and seed")
  parser.add_argument("--mc", type=int, default=8, help="continuations per estimate (M)")
  parser.add_argument("--updates", type=int, default=80, help="updates of each seed's lag run")
  parser.add_argument("--warm_start_steps", type=int, help="override the config's (smoke runs)")
  parser.add_argument("--resamples", type=int, default=2000, help="bootstrap resamples")
  parser.add_argument("--render", action="store_true")
  parser.add_argument("--root", default=os.path.join(tempfile.gettempdir(), "copc_advantage_staleness"))
  parser.add_argument("--out", default=os.path.join(HERE, "results.json"))
  args = parser.parse_args()
  if min(args.lags) < 0 or args.updates < max(args.lags):
    parser.error(f"--lags must be >= 0 and at most --updates ({args.updates}); got {args.lags}")
  if args.render and not os.path.exists(args.out):
    parser.error(f"--render: {args.out} does not exist; run the study first (without --render)")
  results = {}
  if os.path.exists(args.out):
    with open(args.out) as f:
      results = json.load(f)
    if "seeds" not in results or results.get("updates") != args.updates:   # another design: start over
      results = {}
  if not args.render:
    results = measure(args, results)
  elif "collapsed_seeds" not in results:        # a JSON written before collapsed learners were set apart
    pool(results, args.resamples)
    study.write_json(args.out, results)
  directory, file = os.path.split(os.path.abspath(args.out))
  if directory == HERE and file in ("results.json", "results_rerun.json"):
    render(results, name=file.removesuffix(".json"))


if __name__ == "__main__":
  main()
