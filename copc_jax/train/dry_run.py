"""`--dry_run_rollouts=N`: episodes of the start policy, printed, and what they say about the task's format.

Nothing is trained and no training history is written: the servers and weights of the dry run live in
DIR/dry_run, and the warm start (if the config has one) is cached in DIR/warm_start as a training run
caches it.
"""

from __future__ import annotations

import json
import os

from etils import epath

from copc_jax.train import build as build_lib
from copc_jax.train import workdir as workdir_lib
from copc_jax.train.episodes import Episode
from copc_jax.train.episodes import collect as collect_episodes
from copc_jax.train.trainer import start_policy


def sample_start_policy(parts: build_lib.Parts, count: int) -> list[Episode]:
  """`count` episodes of the actor as it starts RL, on the first training prompts that fit, sampled
  as training samples them (on its servers, with its tools and rewards); nothing is trained."""
  with build_lib.sampling(parts) as (runner, _):
    records = [{**r, "draw": i} for i, r in enumerate(r for r in parts.task.train if runner.fits(r))][:count]
    return collect_episodes(runner, records, parts.config.rollout.concurrency)


def dry_run_rollouts(config, workdir: str, count: int) -> dict:
  """`--dry_run_rollouts=N`: N episodes of the start policy (after the warm start, if the config has
  one; cached in DIR/warm_start as a training run caches it), each printed with its reward, and what
  they say about the task's format written to DIR/dry_run_rollouts.json: mean reward, accuracy, the
  share of episodes that called the tool, turns and finish reasons. The servers and weights of the
  dry run live in DIR/dry_run; nothing is trained and no training history is written."""
  workdir = workdir_lib.resolve(workdir)
  task, actor_checkpoint = start_policy(config, workdir)
  parts = build_lib.build(config, os.path.join(workdir, "dry_run"), actor_checkpoint=actor_checkpoint,
                          task=task)
  episodes = sample_start_policy(parts, count)
  tool_output_opening = task.tool_output[0]      # in the response only where the tool answered a call
  rows = []
  for i, episode in enumerate(episodes):
    response = parts.tokenizer.decode(episode.trajectory.token_ids, skip_special_tokens=True)
    rows.append({"question": episode.record["question"], "response": response,
                 "reward": episode.trajectory.reward, "correct": episode.correct,
                 "called_tool": tool_output_opening in response, "turns": episode.trajectory.num_turns,
                 "finish_reason": episode.trajectory.finish_reason})
    print(f"--- episode {i}: reward {episode.trajectory.reward:.3f}, correct {episode.correct}, "
          f"turns {episode.trajectory.num_turns}, {episode.trajectory.finish_reason}\n{response}",
          flush=True)
  n = max(len(rows), 1)
  start = actor_checkpoint or build_lib.base_checkpoint(config, workdir)
  summary = {"episodes": len(rows), "start_policy": start,
             "mean_reward": sum(r["reward"] for r in rows) / n, "accuracy": sum(r["correct"] for r in rows) / n,
             "tool_call_rate": sum(r["called_tool"] for r in rows) / n,
             "mean_turns": sum(r["turns"] for r in rows) / n,
             "finish_reasons": {k: sum(r["finish_reason"] == k for r in rows)
                                for k in sorted({str(r["finish_reason"]) for r in rows})},
             "rows": rows}
  (epath.Path(workdir) / "dry_run_rollouts.json").write_text(json.dumps(summary, indent=1))
  print(f"dry run: {len(rows)} episodes, mean reward {summary['mean_reward']:.3f}, accuracy "
        f"{summary['accuracy']:.3f}, tool calls {summary['tool_call_rate']:.3f}; "
        f"{os.path.join(workdir, 'dry_run_rollouts.json')}", flush=True)
  return summary

