"""Entry point: `python -m copc_jax.main --config=configs/default.py --workdir=DIR`."""

import dataclasses
import json
import platform
import sys

import flax
import jax
import optax
from absl import app, flags, logging
from ml_collections import config_flags

from copc_jax import config as config_lib
from copc_jax import synthetic
from copc_jax.train import trainer

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file("config", None, "Config file (configs/*.py[:arg]).", lock_config=True)
flags.DEFINE_string("workdir", None, "Directory for outputs (metrics, checkpoints).")
flags.DEFINE_bool("distributed", False, "Call jax.distributed.initialize() first: one process per host "
                  "of a multi-host slice (on TPU VMs it finds the coordinator itself).")
flags.mark_flags_as_required(["config", "workdir"])

JOBS = {"train": trainer.run, "gradient_check": synthetic.run}


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  if not FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)     # orbax and JetStream log every save and step at INFO
  config = config_lib.from_config_dict(FLAGS.config)
  if FLAGS.distributed:
    jax.distributed.initialize()
  if jax.process_index() == 0 or FLAGS["verbosity"].present:
    print(f"python {platform.python_version()}, jax {jax.__version__}, flax {flax.__version__}, "
          f"optax {optax.__version__}\nprocess {jax.process_index()}/{jax.process_count()}, "
          f"devices: {jax.devices()}\nconfig (resolved): {json.dumps(dataclasses.asdict(config), default=str)}",
          file=sys.stderr, flush=True)
  try:
    JOBS[config.job](config, FLAGS.workdir)
  except (trainer.TrainingError, FileNotFoundError) as err:
    logging.error("%s", err)
    raise SystemExit(f"error: {err}") from None


if __name__ == "__main__":
  app.run(main)
