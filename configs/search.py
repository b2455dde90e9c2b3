"""Asynchronous COPC on the synthetic knowledge-search task (BM25 over a made-up knowledge base), tiny model.

Run:
  python -m copc_jax.main --config=configs/search.py --workdir=/tmp/copc_search
Another preset: `configs/search.py:async_ppo`. Questions are 1-hop ("Where was X born?") and 2-hop
("Where was the founder of O born?"); the answers are only in the retrieved passages. Half of each
2-hop question's demonstrations chain the second search and half stop after the first and guess a
city, so the warm-started policy chains about half the time and RL has that to learn (held-out
questions are about entities that no training question names).
"""

from configs import common


def get_config(arg=None):
  config = common.train_config(arg or "copc")
  config.task.name = "knowledge_search"
  config.task.system_prompt = False
  config.task.topk = 1                       # one passage per search keeps contexts short
  config.task.eval_size = 64
  config.task.demo_chain_fraction = 0.5
  config.rollout.max_prefill_length = 256
  config.rollout.max_length = 320
  config.rollout.max_turns = 3
  config.rollout.max_tokens_per_turn = 48
  config.warm_start.steps = 800
  config.trainer.steps = 100
  config.trainer.actor_learning_rate = 3e-4
  return config
