"""Entry point: `python -m copc_jax.main --config=configs/default.py --workdir=DIR`.

A mistake on the command line (a bad value, an unknown field, a missing config file, a workdir that
is a file or is in use) is one line on stderr naming the flag or field, the value and what is
allowed, with exit status 2; `--verbose` shows the traceback instead.
"""

import dataclasses
import importlib.util
import json
import os
import platform
import sys

import flax
import jax
import optax
from absl import app, flags, logging
from ml_collections import config_flags

from copc_jax import config as config_lib
from copc_jax import presets, synthetic
from copc_jax.train import checkpoint, dry_run, trainer, workdir
from copc_jax.train.workdir import WorkdirError

FLAGS = flags.FLAGS
CONFIGS = {  # the config files and what their argument after ':' picks
    "configs/default.py[:<preset>]": "async COPC on tool arithmetic, tiny model (the default job)",
    "configs/search.py[:<preset>]": "synthetic knowledge search, tiny model",
    "configs/staleness_sweep.py:<preset>,<k>": "lag mode: every batch from the weights k updates old",
    "configs/gradient_check.py": "the synthetic off-policy gradient check of every preset",
    "configs/qwen2_5_math.py:<1.5b|7b>[,<preset>]": "Qwen2.5 on math with a Python tool (TPU slice)",
    "configs/qwen2_5_search.py:<3b|7b>[,<preset>]": "Qwen2.5 on search (TPU slice)",
}
config_flags.DEFINE_config_file(
    "config", None, "Config file, e.g. configs/default.py:tis; any field is overridden with "
    "--config.<section>.<field>=value (--print_config shows them all). Configs: "
    + "; ".join(f"{name}: {what}" for name, what in CONFIGS.items())
    + f". Presets: {', '.join(sorted(presets.PRESETS))}.", lock_config=True)
flags.DEFINE_string("workdir", None, "Directory for outputs (metrics, checkpoints).")
flags.DEFINE_bool("distributed", False, "Call jax.distributed.initialize() first: one process per host "
                  "of a multi-host slice (on TPU VMs it finds the coordinator itself).")
flags.DEFINE_bool("fresh_start", False, "Start over: move a previous run's files in --workdir into "
                  "previous_<time>/ (without it, a run resumes from the workdir's checkpoint).")
flags.DEFINE_integer("dry_run_rollouts", 0, "Instead of training: print this many episodes of the start "
                     "policy with their rewards, and their reward, accuracy and tool-call rate "
                     "(DIR/dry_run_rollouts.json).", lower_bound=0)
flags.DEFINE_bool("print_config", False, "Print the resolved, validated config as JSON and exit (no workdir "
                  "needed).")
flags.DEFINE_bool("verbose", False, "Show tracebacks of command-line and config mistakes.")
flags.mark_flag_as_required("config")

JOBS = {"train": trainer.run, "gradient_check": synthetic.run}
USAGE_ERROR = 2


def _argument(argv: list[str], name: str) -> str | None:
  for i, arg in enumerate(argv):
    if arg.startswith(f"--{name}="):
      return arg.split("=", 1)[1]
    if arg == f"--{name}" and i + 1 < len(argv):
      return argv[i + 1]
  return None


def _config_fields(config_arg: str) -> dict | None:
  """The config file's own fields (for naming what is allowed), or None if it cannot be read."""
  try:
    path, _, arg = config_arg.partition(":")
    spec = importlib.util.spec_from_file_location("copc_cli_config", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(arg) if arg else module.get_config()
  except Exception:  # noqa: BLE001 - only used to explain another error
    return None


def explain_flag_error(err: Exception, argv: list[str]) -> str:
  """One line for an error raised while absl parsed the flags (config_flags applies overrides there)."""
  config_arg = _argument(argv, "config")
  if config_arg is not None and not os.path.exists(config_arg.partition(":")[0]):
    return f"--config={config_arg}: no such file"
  fields = _config_fields(config_arg) if config_arg else None
  for arg in argv:
    if not arg.startswith("--config."):
      continue
    dotted, _, value = arg[len("--config."):].partition("=")
    node, parts = fields, dotted.split(".")
    for depth, part in enumerate(parts):
      if node is None or not hasattr(node, "keys"):
        break
      if part not in node:
        where = ".".join(["config", *parts[:depth]])
        return f"--config.{dotted}: {where} has no field {part!r}; allowed: {sorted(node.keys())}"
      node = node[part]
  message = " ".join(str(err).split())
  if config_arg is not None and (fields is None or isinstance(err, OSError | SyntaxError)):
    return f"--config={config_arg}: cannot be loaded: {message}"
  return message if message.startswith("--") else f"flags: {message}"


def _usage_error(message: str):
  """One line on stderr, exit status 2."""
  print(f"error: {message}", file=sys.stderr)
  sys.exit(USAGE_ERROR)


def put_configs_package_on_path(argv: list[str]) -> None:
  """The config files import their shared `configs.common`: the folder that holds the named config's
  `configs/` package goes on sys.path, so `--config=/path/to/clone/configs/x.py` loads from anywhere."""
  config_arg = _argument(argv, "config")
  if config_arg:
    folder = os.path.dirname(os.path.abspath(config_arg.partition(":")[0]))
    if os.path.basename(folder) == "configs" and os.path.dirname(folder) not in sys.path:
      sys.path.insert(0, os.path.dirname(folder))


def parse_flags(argv: list[str]) -> list[str]:
  put_configs_package_on_path(argv)
  try:
    return FLAGS(argv)
  except Exception as err:  # noqa: BLE001 - every mistake gets one line
    if "--verbose" in argv:
      raise
    _usage_error(explain_flag_error(err, argv))


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  if not FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)     # orbax and JetStream log every save and step at INFO
  try:
    try:
      raw = FLAGS.config
      raw.keys()                               # loaded lazily: a missing or broken file fails here
    except OSError as err:
      raise ValueError(explain_flag_error(err, sys.argv)) from err
    config = config_lib.from_config_dict(raw)
    if FLAGS.print_config:
      print(json.dumps(dataclasses.asdict(config), indent=1, default=str))
      return
    if not FLAGS.workdir:
      raise ValueError("--workdir is required (a directory for metrics, checkpoints and weights)")
    if FLAGS.dry_run_rollouts and config.job != "train":
      raise ValueError(f"--dry_run_rollouts runs the train job's start policy; config.job is {config.job!r}")
    if config.job == "train":
      config.rollout.check_installed()
    if config.job == "train" and not FLAGS.distributed and not FLAGS.dry_run_rollouts:
      workdir.check(FLAGS.workdir, fresh_start=FLAGS.fresh_start)
    elif os.path.exists(FLAGS.workdir) and not os.path.isdir(FLAGS.workdir):
      raise WorkdirError(f"--workdir={FLAGS.workdir}: exists and is not a directory")
  except (ValueError, TypeError, WorkdirError) as err:
    if FLAGS.verbose:
      raise
    _usage_error(str(err))
  if FLAGS.distributed:
    jax.distributed.initialize()
  if jax.process_index() == 0 or FLAGS["verbosity"].present:
    print(f"python {platform.python_version()}, jax {jax.__version__}, flax {flax.__version__}, "
          f"optax {optax.__version__}\nprocess {jax.process_index()}/{jax.process_count()}, "
          f"devices: {jax.devices()}\nconfig (resolved): {json.dumps(dataclasses.asdict(config), default=str)}",
          file=sys.stderr, flush=True)
  try:
    if FLAGS.dry_run_rollouts:
      dry_run.dry_run_rollouts(config, FLAGS.workdir, FLAGS.dry_run_rollouts)
    elif config.job == "train":
      trainer.run(config, FLAGS.workdir, fresh_start=FLAGS.fresh_start)
    else:
      JOBS[config.job](config, FLAGS.workdir)
  except WorkdirError as err:           # another run took the workdir since the check above
    if FLAGS.verbose:
      raise
    _usage_error(str(err))
  except (trainer.TrainingError, checkpoint.CheckpointError, FileNotFoundError) as err:
    if FLAGS.verbose:
      raise
    logging.error("%s", err)
    raise SystemExit(f"error: {err}") from None


if __name__ == "__main__":
  app.run(main, flags_parser=parse_flags)
