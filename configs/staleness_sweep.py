"""One point of a staleness sweep: `lag` mode, every batch generated with weights exactly k updates old.

Run one point (preset, k):
  python -m copc_jax.main --config=configs/staleness_sweep.py:copc,16 --workdir=/tmp/sweep/copc_16
A sweep runs this for each method and k in (0, 4, 16, 64); the task and model are the default run's.
"""

from configs import default


def get_config(arg="copc,8"):
  preset, lag = (arg or "copc,8").split(",")
  config = default.get_config(preset)
  config.trainer.mode = "lag"
  config.trainer.lag = int(lag)
  return config
