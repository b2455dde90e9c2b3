"""Held-out evaluation of the learner's weights: greedy episodes on the evaluation split."""

from __future__ import annotations

import numpy as np

from copc_jax.train import multihost
from copc_jax.train.episodes import EpisodeRunner, collect
from copc_jax.train.weights import WeightStore


class Evaluator:
  """Greedy accuracy on the held-out split of the learner's weights at `version` (pushed first)."""

  def __init__(self, runner: EpisodeRunner, records: list[dict], weights: WeightStore, workers: int):
    self.runner, self.records, self.weights, self.workers = runner, records, weights, workers

  def __call__(self, version: int, actor) -> dict:
    self.weights.push(version, actor)
    result = {}
    if multihost.is_chief():
      episodes = collect(self.runner, self.records, self.workers, greedy=True)
      result = {"eval_accuracy": float(np.mean([e.correct for e in episodes])),
                "eval_reward": float(np.mean([e.trajectory.reward for e in episodes])),
                "eval_version": version}
    multihost.barrier(f"evaluation {version}")     # the others wait here, not inside the next collective
    return result
