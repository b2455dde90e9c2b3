"""Print values of a config file, for the launch scripts (the servers' limits come from the config).

  python -m copc_jax.config_values configs/qwen2_5_math.py:7b rollout.slots rollout.max_length
  64 16384

The config is loaded and validated as the main job does (`configs/<name>.py[:arg]`, `get_config(arg)`);
each field is printed on one line, separated by spaces.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import sys


def load(spec: str):
  """The validated config of `path[:arg]`."""
  from copc_jax import config as config_lib

  path, _, arg = spec.partition(":")
  if not os.path.isfile(path):
    raise FileNotFoundError(f"config file not found: {path}")
  root = os.path.dirname(os.path.dirname(os.path.abspath(path)))
  if root not in sys.path:
    sys.path.insert(0, root)                 # configs/*.py import `configs.common`
  module_spec = importlib.util.spec_from_file_location("launched_config", path)
  module = importlib.util.module_from_spec(module_spec)
  module_spec.loader.exec_module(module)
  return config_lib.from_config_dict(module.get_config(arg) if arg else module.get_config())


def value(config, field: str):
  section, _, name = field.partition(".")
  holder = getattr(config, section, None)
  if holder is None or not name or not dataclasses.is_dataclass(holder) or not hasattr(holder, name):
    raise ValueError(f"no config field {field!r} (a field is <section>.<name>, e.g. rollout.max_length)")
  return getattr(holder, name)


def main(argv: list[str]) -> int:
  if len(argv) < 2:
    print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
    return 2
  try:
    config = load(argv[0])
    print(" ".join(str(value(config, field)) for field in argv[1:]))
  except (FileNotFoundError, ValueError) as err:
    print(f"config_values: {err}", file=sys.stderr)
    return 2
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
