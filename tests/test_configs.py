"""Every config file loads, validates, and (through its argument) covers every preset."""

import dataclasses
import importlib
import os
import subprocess
import sys

import pytest

from copc_jax import config as config_lib
from copc_jax import presets

ARGS = {
    "default": [None, *presets.PRESETS],
    "search": [None, *presets.PRESETS],
    "gradient_check": [None, "tis"],
    # sync PPO is defined by staleness 0 and refuses lag mode (tested in test_config.py)
    "staleness_sweep": [f"{p},{k}" for p in presets.PRESETS if p != "sync_ppo" for k in (0, 4, 16, 64)],
    "qwen2_5_math": ["1.5b", "7b", *(f"7b,{p}" for p in presets.PRESETS)],
    "qwen2_5_search": ["3b", "7b", "7b,async_ppo"],
}


@pytest.mark.parametrize("name,arg", [(n, a) for n, args in ARGS.items() for a in args])
def test_config_file_validates(name, arg):
  module = importlib.import_module(f"configs.{name}")
  config = config_lib.from_config_dict(module.get_config(arg))
  if arg and arg.split(",")[-1] in presets.PRESETS:
    assert config.preset == arg.split(",")[-1]
  if name == "staleness_sweep":
    assert config.trainer.mode == "lag" and config.trainer.lag == int(arg.split(",")[1])


def test_real_model_configs_use_a_tpu_mesh_and_remote_data():
  config = config_lib.from_config_dict(importlib.import_module("configs.qwen2_5_math").get_config("7b"))
  assert config.sharding.mesh_shape == (1, -1, 2) and config.task.name == "math"
  assert config.trainer.mode == "async" and config.rollout.max_length == 16384
  with pytest.raises(ValueError, match="size must be one of"):
    importlib.import_module("configs.qwen2_5_math").get_config("70b")


@pytest.mark.parametrize("section,field,value,message", [
    ("trainer", "mode", "semi", r"config.trainer.mode must be one of \('sync', 'async', 'lag'\); got 'semi'"),
    ("trainer", "batch_size", 0, r"config.trainer.batch_size must be >= 1; got 0"),
    ("rollout", "max_length", 32, r"config.rollout.max_length \(32\) must exceed max_prefill_length \(64\)"),
    ("task", "name", "chess", r"config.task.name must be one of .*got 'chess'"),
    ("task", "demo_tool_fraction", 1.5, r"config.task.demo_tool_fraction must be in \[0, 1\]; got 1.5"),
    ("warm_start", "learning_rate", -1.0, r"config.warm_start.learning_rate must be > 0; got -1.0"),
    ("model", "tiny_arch", "gpt", r"config.model.tiny_arch must be 'qwen2', 'qwen3' or 'llama'; got 'gpt'"),
    ("trainer", "speed", 2, r"config.trainer: unknown field\(s\) \['speed'\]"),
])
def test_bad_trainer_values_name_the_field(section, field, value, message):
  raw = importlib.import_module("configs.default").get_config()
  plain = raw.to_dict()
  plain[section][field] = value
  with pytest.raises(ValueError, match=message):
    config_lib.from_config_dict(plain)


def test_every_dataclass_field_is_a_config_field_at_its_default():
  raw = importlib.import_module("configs.common").train_config("copc")
  for name, cls in config_lib.SECTIONS.items():
    if name == "gradient_check":
      continue
    fields = {f.name for f in dataclasses.fields(cls)}
    assert set(raw[name].keys()) == fields, name
    if name not in config_lib.PRESET_SECTIONS:
      typed = config_lib.from_config_dict(raw)
      assert getattr(typed, name) == cls(), name
  raw.rollout.top_k = 20                    # any field, straight from the command line's view
  assert config_lib.from_config_dict(raw).rollout.sampling.top_k == 20


def test_configs_load_without_jetstream():
  code = ("import sys; import copc_jax.config, copc_jax.train.trainer, configs.default; "
          "loaded = [m for m in sys.modules if m.startswith(('jetstream', 'copc_jax.rollout.server'))]; "
          "assert not loaded, loaded")
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  result = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120)
  assert result.returncode == 0, result.stderr[-2000:]


def test_help_names_every_config_file_and_every_preset():
  import glob
  import subprocess
  import sys

  from copc_jax import main

  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  named = {name.split("[")[0].split(":")[0] for name in main.CONFIGS}
  files = {f"configs/{os.path.basename(p)}" for p in glob.glob(os.path.join(root, "configs", "*.py"))}
  assert named == files - {"configs/__init__.py", "configs/common.py"}
  out = subprocess.run([sys.executable, "-m", "copc_jax.main", "--help"], capture_output=True, text=True,
                       cwd=root, timeout=300).stdout
  text = " ".join(out.split())
  assert all(preset in text for preset in presets.PRESETS) and "configs/qwen2_5_math.py:<1.5b|7b>" in text
