"""Default job: asynchronous COPC on synthetic tool arithmetic, tiny model, two local JetStream servers.

Run (about 5½ minutes on 2 CPU cores, warm start included):
  python -m copc_jax.main --config=configs/default.py --workdir=/tmp/copc_default
Another preset: `configs/default.py:async_ppo` (any name in copc_jax/presets.py). Another mode:
`--config.trainer.mode=sync`, or `--config.trainer.mode=lag --config.trainer.lag=16`.

The warm start imitates demonstrations of which only half use the tool (the rest
answer from a 2-significant-digit estimate, which is almost never exact), so the
warm-started policy calls the tool about half the time; RL has to find out that
the tool pays.
"""

from configs import common


def get_config(arg=None):
  config = common.train_config(arg or "copc")
  config.task.name = "tool_arithmetic"
  config.task.system_prompt = False          # the tiny model learns the format from the demonstrations
  config.task.demo_tool_fraction = 0.5
  config.warm_start.steps = 1500
  config.trainer.mode = common.mode_for(config.preset, "async")
  config.trainer.steps = 150
  config.trainer.batch_size = 32
  config.trainer.max_staleness = 4
  config.trainer.eval_every = 25
  config.trainer.actor_learning_rate = 3e-4
  config.trainer.critic_learning_rate = 1e-3
  return config
