"""Parity with `transformers`' PyTorch models on tiny random checkpoints (CPU torch)."""

import dataclasses
import os

import jax
import numpy as np
import pytest
import transformers
from flax import nnx
from jax.sharding import PartitionSpec as P

from copc_jax import sharding
from copc_jax.models import hf_io, tiny
from copc_jax.models.decoder import Decoder

torch = pytest.importorskip("torch", reason="CPU PyTorch (setup.sh) runs transformers' reference models")

TOL = 1e-4


def hf_config(arch):
  common = dict(vocab_size=len(tiny.make_tokenizer()), hidden_size=64, intermediate_size=96,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=256, bos_token_id=1, eos_token_id=2)
  if arch == "qwen2":
    return transformers.Qwen2Config(tie_word_embeddings=True, rms_norm_eps=1e-6,
                                    rope_parameters={"rope_type": "default", "rope_theta": 1e6}, **common)
  if arch == "qwen3":       # head_dim 32 with 4 heads: q_proj is wider than the hidden size, as in Qwen3
    return transformers.Qwen3Config(tie_word_embeddings=True, rms_norm_eps=1e-6, head_dim=32,
                                    rope_parameters={"rope_type": "default", "rope_theta": 1e6}, **common)
  return transformers.LlamaConfig(
      tie_word_embeddings=False, rms_norm_eps=1e-5,
      rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                       "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 64}, **common)


def write_torch_checkpoint(path, arch, **save_kw):
  torch.manual_seed(0)
  model = transformers.AutoModelForCausalLM.from_config(hf_config(arch)).float().eval()
  with torch.no_grad():  # HF zero-inits biases and one-inits norms; make them non-trivial so they are tested
    for name, param in model.named_parameters():
      if name.endswith("bias"):
        param.normal_(0, 0.1)
      if name.endswith("norm.weight"):
        param.uniform_(0.5, 1.5)
  model.save_pretrained(path, **save_kw)
  tiny.make_tokenizer().save_pretrained(path)
  return model


def torch_logits(model, ids, attention_mask=None):
  with torch.no_grad():
    mask = None if attention_mask is None else torch.tensor(attention_mask, dtype=torch.long)
    return model(torch.tensor(ids), attention_mask=mask).logits.numpy()


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "llama"])
def test_logits_match_pytorch(tmp_path, arch):
  reference = write_torch_checkpoint(tmp_path, arch)
  model, tokenizer = hf_io.from_pretrained(str(tmp_path))
  text = "What is 12 * 34?\n<code>print(12 * 34)</code>\n<output>\n408\n</output>"
  ids = tokenizer(text, add_special_tokens=False)["input_ids"]
  assert ids == tiny.make_tokenizer()(text, add_special_tokens=False)["input_ids"]   # spaces kept
  assert tokenizer.decode(ids) == text
  ids = np.random.default_rng(0).integers(0, model.config.vocab_size, size=(3, 40))
  np.testing.assert_allclose(np.asarray(model(ids)), torch_logits(reference, ids), atol=TOL, rtol=0)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "llama"])
def test_logits_match_pytorch_with_left_padding(tmp_path, arch):
  reference = write_torch_checkpoint(tmp_path, arch)
  model, _ = hf_io.from_pretrained(str(tmp_path), load_tokenizer=False)
  ids = np.random.default_rng(1).integers(3, model.config.vocab_size, size=(2, 12))
  mask = np.ones_like(ids)
  mask[0, :5] = 0
  ours = np.asarray(model(ids, attention_mask_bt=mask))
  theirs = torch_logits(reference, ids, mask)
  np.testing.assert_allclose(ours[mask == 1], theirs[mask == 1], atol=TOL, rtol=0)


def test_sharded_checkpoint_loads(tmp_path):
  reference = write_torch_checkpoint(tmp_path, "qwen2", max_shard_size="100KB")
  assert (tmp_path / hf_io.SAFETENSORS_INDEX).exists()
  model, _ = hf_io.from_pretrained(str(tmp_path), load_tokenizer=False)
  ids = np.arange(20)[None] % model.config.vocab_size
  np.testing.assert_allclose(np.asarray(model(ids)), torch_logits(reference, ids), atol=TOL, rtol=0)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "llama"])
def test_export_is_read_back_by_transformers(tmp_path, arch):
  tiny.make_tiny_checkpoint(str(tmp_path / "ours"), arch)
  model, _ = hf_io.from_pretrained(str(tmp_path / "ours"))
  hf_io.save_pretrained(model, str(tmp_path / "exported"))
  reference = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "exported")).float()
  ids = np.random.default_rng(2).integers(0, model.config.vocab_size, size=(2, 16))
  np.testing.assert_allclose(np.asarray(model(ids)), torch_logits(reference.eval(), ids), atol=TOL,
                             rtol=0)


def test_missing_directory_and_mismatched_tensors_are_reported(tmp_path):
  with pytest.raises(FileNotFoundError, match="checkpoint directory not found"):
    hf_io.from_pretrained(str(tmp_path / "nope"))
  write_torch_checkpoint(tmp_path, "qwen2")
  model, _ = hf_io.from_pretrained(str(tmp_path), load_tokenizer=False)
  tensors = hf_io.read_safetensors(str(tmp_path))
  tensors["model.norm.weight"] = tensors["model.norm.weight"][:-1]
  with pytest.raises(ValueError, match=r"model.norm.weight: checkpoint shape \(63,\)"):
    hf_io.read_like(model, tensors)
  del tensors["model.layers.0.mlp.up_proj.weight"]
  with pytest.raises(ValueError, match="lacks 1 tensor"):
    hf_io.read_like(model, tensors)


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (fake) devices")
def test_logits_match_pytorch_on_8_devices(tmp_path):
  reference = write_torch_checkpoint(tmp_path, "qwen2")
  model, _ = hf_io.from_pretrained(str(tmp_path), load_tokenizer=False)
  mesh = sharding.make_mesh(sharding.ShardingConfig(mesh_shape=(2, 2, 2)))
  sharding.shard_model(model, mesh, sharding.DEFAULT_RULES)
  assert model.model.layers[0].mlp.gate_proj.kernel[...].sharding.spec == P("fsdp", "tensor")
  ids = np.random.default_rng(3).integers(0, model.config.vocab_size, size=(8, 24))
  logits = nnx.jit(lambda m, x: m(x))(
      model, jax.device_put(ids, sharding.batch_sharding(mesh, sharding.DEFAULT_RULES)))
  np.testing.assert_allclose(np.asarray(logits), torch_logits(reference, ids), atol=TOL, rtol=0)


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_a_model_only_checkpoint_loads_without_a_tokenizer(tmp_path, arch):
  """Critics and intermediate checkpoints have config and weights only: the model loads, the tokenizer
  is None (before: Llama asked for sentencepiece, Qwen2 got an empty tokenizer), and where one is
  needed the error names the directory and config.model.tokenizer."""
  from configs import default
  from copc_jax import config as config_lib
  from copc_jax.train import trainer

  write_torch_checkpoint(tmp_path / "full", arch)
  model, _ = hf_io.from_pretrained(str(tmp_path / "full"), load_tokenizer=False)
  hf_io.save_pretrained(model, str(tmp_path / "model_only"))
  assert not hf_io.has_tokenizer(str(tmp_path / "model_only")) and hf_io.has_tokenizer(str(tmp_path / "full"))
  loaded, tokenizer = hf_io.from_pretrained(str(tmp_path / "model_only"))
  assert tokenizer is None and loaded.config == model.config
  with pytest.raises(hf_io.MissingTokenizer, match=r"model_only has no tokenizer .* the trainer needs one: set "
                                                   r"config.model.tokenizer"):
    hf_io.load_tokenizer(str(tmp_path / "model_only"), needed_for="the trainer")
  config = config_lib.from_config_dict(default.get_config())
  paths = str(tmp_path / "model_only"), str(tmp_path / "full")
  assert trainer.tokenizer_dir(config, *paths) == paths[1]        # the first that has one
  named = dataclasses.replace(config, model=dataclasses.replace(config.model, tokenizer="/tok"))
  assert trainer.tokenizer_dir(named, *paths) == "/tok"


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (fake) devices")
@pytest.mark.parametrize("shard_size", [None, "40KB"])
def test_sharded_loading_puts_every_parameter_where_the_rules_say(tmp_path, shard_size):
  """`from_pretrained(path, mesh=...)`: each tensor (of a single or an index-sharded checkpoint) lands
  in the sharding its logical axes give, with the values of the single-device load."""
  write_torch_checkpoint(tmp_path, "qwen2", **({"max_shard_size": shard_size} if shard_size else {}))
  assert (tmp_path / hf_io.SAFETENSORS_INDEX).exists() == bool(shard_size)
  mesh = sharding.make_mesh(sharding.ShardingConfig(mesh_shape=(2, 2, 2)))
  model, _ = hf_io.from_pretrained(str(tmp_path), load_tokenizer=False, mesh=mesh)
  reference, _ = hf_io.from_pretrained(str(tmp_path), load_tokenizer=False)
  abstract = nnx.eval_shape(lambda: type(reference)(reference.config, rngs=nnx.Rngs(0)))
  expected = jax.tree.leaves(sharding.state_shardings(nnx.state(abstract), mesh, sharding.DEFAULT_RULES))
  loaded = jax.tree.leaves(nnx.state(model))
  assert len(loaded) == len(expected) == len(jax.tree.leaves(nnx.state(reference)))
  for array, want, value in zip(loaded, expected, jax.tree.leaves(nnx.state(reference)), strict=True):
    assert array.sharding.is_equivalent_to(want, array.ndim), (array.sharding, want)
    np.testing.assert_array_equal(np.asarray(array), np.asarray(value))
  assert model.model.layers[0].mlp.gate_proj.kernel[...].sharding.spec == P("fsdp", "tensor")


LOAD_MEMORY = """
import json, os, sys, numpy as np
from copc_jax import sharding
from copc_jax.models import hf_io
def status(field):
  with open("/proc/self/status") as f:
    return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))
mesh = sharding.make_mesh(sharding.ShardingConfig(mesh_shape=(1, 4, 2)))
before = status("VmRSS")
model, _ = hf_io.from_pretrained(sys.argv[1], load_tokenizer=False, mesh=mesh)
print(json.dumps({"before": before, "after": status("VmRSS"), "peak": status("VmHWM")}))
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads /proc/self/status")
def test_sharded_loading_never_holds_a_full_copy_of_a_100m_model(tmp_path):
  """Peak resident memory during the load exceeds what the loaded shards need by well under the size
  of the model (the old loader held a zero-filled model and every tensor of the file at once)."""
  import json
  import subprocess
  import sys

  config = tiny.tiny_config("qwen2", vocab_size=32000, hidden_size=768, intermediate_size=2048, num_layers=12,
                            num_heads=12, num_kv_heads=4, head_dim=64)
  hf_io.save_pretrained(Decoder(config, rngs=nnx.Rngs(0)), str(tmp_path))
  size = os.path.getsize(tmp_path / hf_io.SAFETENSORS_SINGLE)
  assert size > 300e6                                      # about 100M float32 parameters
  devices = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
  result = subprocess.run([sys.executable, "-c", LOAD_MEMORY, str(tmp_path)], capture_output=True, text=True,
                          timeout=600, env={**os.environ, **devices})
  assert result.returncode == 0, result.stderr[-2000:]
  memory = json.loads(result.stdout.strip().splitlines()[-1])
  held = memory["after"] - memory["before"]               # the shards (replicas included) stay resident
  transient = memory["peak"] - memory["after"]
  assert held > 0.9 * size and transient < 0.25 * size, (memory, size)


def test_read_like_gives_the_weights_of_a_checkpoint_tensors_in_memory_or_a_params_push(tmp_path):
  """Hugging Face files or tensors, and our own layout in a directory (shm push) or bytes (memory push)."""
  from copc_jax.models.decoder import Decoder

  config = tiny.tiny_config("qwen2")
  served, pushed = (Decoder(config, rngs=nnx.Rngs(seed)) for seed in (0, 1))
  before = [np.asarray(x) for x in jax.tree.leaves(nnx.state(served))]
  hf_io.save_pretrained(pushed, str(tmp_path / "hf"))
  hf_io.save_params(pushed, str(tmp_path / "params"))          # the served layout: nothing transposed
  from safetensors.numpy import load as load_bytes

  in_memory = load_bytes(hf_io.params_bytes(pushed))          # what a "memory" push sends, parsed
  for source in (str(tmp_path / "hf"), hf_io.hf_tensors(pushed), str(tmp_path / "params"), in_memory):
    loaded = hf_io.read_like(served, source)
    for got, want in zip(jax.tree.leaves(nnx.state(loaded)), jax.tree.leaves(nnx.state(pushed)), strict=True):
      np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  for got, want in zip(jax.tree.leaves(nnx.state(served)), before, strict=True):
    np.testing.assert_array_equal(np.asarray(got), want)        # the served model is untouched
