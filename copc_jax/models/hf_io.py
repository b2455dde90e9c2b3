"""Hugging Face checkpoints in and out: `config.json` + `*.safetensors` (+ tokenizer files).

    model, tokenizer = from_pretrained("path/to/qwen2-dir")
    save_pretrained(model, "out/dir", tokenizer=tokenizer)

Nothing is downloaded: paths are local directories (`local_files_only=True`).
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save as save_safetensors_bytes
from safetensors.numpy import save_file

from copc_jax import sharding
from copc_jax.models.config import ModelConfig
from copc_jax.models.decoder import Decoder

SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_SINGLE = "model.safetensors"
# A weight push between copc_jax processes: the parameters under their own paths and layouts (no
# transposes on either side), not a Hugging Face checkpoint (`save_params`).
PARAMS_FILE = "params.safetensors"


def hf_parameter_names(config: ModelConfig) -> dict[str, tuple[str, bool]]:
  """Hugging Face tensor name → (our parameter path, transposed?)."""
  names = {"model.embed_tokens.weight": ("model/embed_tokens", False),
           "model.norm.weight": ("model/norm/weight", False)}
  if not config.tie_word_embeddings:
    names["lm_head.weight"] = ("lm_head/kernel", True)
  projections = [("self_attn", p, config.qkv_bias) for p in ("q_proj", "k_proj", "v_proj")]
  projections += [("self_attn", "o_proj", config.o_bias)]
  projections += [("mlp", p, config.mlp_bias) for p in ("gate_proj", "up_proj", "down_proj")]
  for i in range(config.num_layers):
    hf, ours = f"model.layers.{i}", f"model/layers/{i}"
    for norm in ("input_layernorm", "post_attention_layernorm"):
      names[f"{hf}.{norm}.weight"] = (f"{ours}/{norm}/weight", False)
    if config.qk_norm:
      for norm in ("q_norm", "k_norm"):
        names[f"{hf}.self_attn.{norm}.weight"] = (f"{ours}/self_attn/{norm}/weight", False)
    for group, proj, bias in projections:
      names[f"{hf}.{group}.{proj}.weight"] = (f"{ours}/{group}/{proj}/kernel", True)
      if bias:
        names[f"{hf}.{group}.{proj}.bias"] = (f"{ours}/{group}/{proj}/bias", False)
  return names


def _path_string(path) -> str:
  parts = []
  for key in path:
    parts.append(str(getattr(key, "key", getattr(key, "idx", getattr(key, "name", key)))))
  return "/".join(parts)


def tensor_files(directory: str) -> dict[str, str]:
  """Tensor name → the safetensors file that holds it (single file, or sharded with an index; or a
  `save_params` push, whose names are parameter paths)."""
  params = os.path.join(directory, PARAMS_FILE)
  if os.path.exists(params):
    with safe_open(params, framework="numpy") as f:
      return {name: params for name in f.keys()}
  index_path = os.path.join(directory, SAFETENSORS_INDEX)
  if os.path.exists(index_path):
    with open(index_path) as f:
      return {name: os.path.join(directory, file) for name, file in json.load(f)["weight_map"].items()}
  single = os.path.join(directory, SAFETENSORS_SINGLE)
  if not os.path.exists(single):
    raise FileNotFoundError(f"no {SAFETENSORS_SINGLE} or {SAFETENSORS_INDEX} in {directory}")
  with safe_open(single, framework="numpy") as f:
    return {name: single for name in f.keys()}


def read_safetensors(directory: str) -> dict[str, jax.Array]:
  """All tensors of a checkpoint directory (single file or sharded with an index)."""
  files = sorted(set(tensor_files(directory).values()))
  tensors = {}
  for name in files:
    with safe_open(name, framework="flax") as f:
      for key in f.keys():
        tensors[key] = f.get_tensor(key)
  return tensors


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


class MissingTokenizer(FileNotFoundError):
  """A tokenizer is needed and the directory has none."""


def has_tokenizer(path: str) -> bool:
  """Whether `path` holds tokenizer files (model-only checkpoints, e.g. critics, have none)."""
  return any(os.path.exists(os.path.join(path, name)) for name in TOKENIZER_FILES)


def load_tokenizer(path: str, needed_for: str):
  """The tokenizer of `path`; one clear error if it has none."""
  if not has_tokenizer(path):
    raise MissingTokenizer(f"{path} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}); {needed_for} "
                           f"needs one: set config.model.tokenizer to a directory that has it (e.g. the base "
                           f"model's)")
  return _load_tokenizer(path)


def _place_tensor(tensor, hf_name: str, transpose: bool, shape, dtype, placement) -> jax.Array:
  """One parameter put straight into its sharding: each device's block is sliced from `tensor` (a
  safetensors slice of an open file, or an array in memory; the transposed block for a transposed
  tensor), so no process holds more of it than its own shards."""
  stored = tuple(tensor.get_shape()) if hasattr(tensor, "get_shape") else tuple(tensor.shape)
  expected = tuple(reversed(shape)) if transpose else tuple(shape)
  if stored != expected:
    raise ValueError(f"{hf_name}: checkpoint shape {stored} != model shape {tuple(shape)}")

  def block(index):
    index = tuple(index) + (slice(None),) * (len(shape) - len(index))
    part = tensor[tuple(reversed(index))].T if transpose else tensor[index]
    return np.asarray(part, dtype)
  return jax.make_array_from_callback(tuple(shape), placement, block)


def load_sharded(model: Decoder, source: str | dict[str, np.ndarray], placements) -> None:
  """Fill the abstract `model` (`nnx.eval_shape`) from `source`, a checkpoint directory or tensors in
  memory (name → array, e.g. `safetensors.numpy.load` of pushed bytes; Hugging Face names, or parameter
  paths from `params_bytes`): every parameter is created with its placement (`placements`: the tree
  of `nnx.state(model)` with a Sharding per leaf)."""
  files = tensor_files(source) if isinstance(source, str) else None
  names = hf_parameter_names(model.config)
  if _in_params_layout(source):                              # a `save_params` or `params_bytes` push
    names = {ours: (ours, False) for ours, _ in names.values()}
  missing = sorted(set(names) - set(files if files is not None else source))
  if missing:
    raise ValueError(f"checkpoint lacks {len(missing)} tensor(s), e.g. {missing[:3]}")
  by_path = {ours: (hf_name, transpose) for hf_name, (ours, transpose) in names.items()}
  state = nnx.state(model)
  key = lambda path: _path_string(path).removesuffix("/value")    # a Variable's array is its `value`
  by_key = {key(path): placement for path, placement in jax.tree_util.tree_leaves_with_path(placements)}

  def load(path, variable):
    ours = key(path)
    placement = by_key[ours]
    if ours not in by_path:
      return jax.device_put(jnp.zeros(variable.shape, variable.dtype), placement)   # not a weight
    hf_name, transpose = by_path[ours]
    if files is None:
      return _place_tensor(source[hf_name], hf_name, transpose, variable.shape, variable.dtype, placement)
    with safe_open(files[hf_name], framework="numpy") as f:
      return _place_tensor(f.get_slice(hf_name), hf_name, transpose, variable.shape, variable.dtype, placement)
  nnx.update(model, jax.tree_util.tree_map_with_path(load, state))


def _in_params_layout(source: str | dict) -> bool:
  """Whether `source` names its tensors by parameter path ("model/norm/weight"), not Hugging Face's."""
  if isinstance(source, str):
    return os.path.exists(os.path.join(source, PARAMS_FILE))
  return any("/" in name for name in source)


def read_like(model: Decoder, source: str | dict[str, np.ndarray]) -> Decoder:
  """A new model with `model`'s structure, dtypes and placements and the weights of `source` (a
  checkpoint directory, or Hugging Face tensors in memory); `model` is left as it is. Each tensor is
  read once, straight into its placement: no zero-filled model, no transposes on the device."""
  graphdef, state = nnx.split(model)
  abstract = nnx.merge(graphdef, jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state))
  load_sharded(abstract, source, jax.tree.map(lambda x: x.sharding, state))
  return abstract


def from_pretrained(path: str, *, dtype=jnp.float32, load_tokenizer: bool = True, mesh=None, rules=None,
                    **options):
  """A `Decoder` with the checkpoint's weights, and its tokenizer: None where `load_tokenizer` is
  False or the directory has no tokenizer files (a model-only checkpoint). `dtype` and `options`
  (param_dtype, remat, scan_layers, attention): how the model computes and stores (`Backbone`).

  Each tensor goes straight to where it lives: with `mesh` (and sharding `rules`, default
  `sharding.DEFAULT_RULES`) into its sharding over the mesh, otherwise onto the first device. The
  model is built from shapes first, so no full copy of it exists on the host or on one device."""
  import transformers

  if not os.path.isdir(path):
    raise FileNotFoundError(f"checkpoint directory not found: {path}")
  hf_config = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
  if getattr(hf_config, "use_sliding_window", False):
    raise ValueError(f"{path}: sliding-window attention is not supported")
  config = ModelConfig.from_hf(hf_config)
  model = nnx.eval_shape(lambda: Decoder(config, rngs=nnx.Rngs(0), dtype=dtype, **options))
  state = nnx.state(model)
  if mesh is None:
    placements = jax.tree.map(lambda _: jax.sharding.SingleDeviceSharding(jax.devices()[0]), state)
  else:
    placements = sharding.state_shardings(state, mesh, rules or sharding.DEFAULT_RULES)
  load_sharded(model, path, placements)
  return model, _load_tokenizer(path) if load_tokenizer and has_tokenizer(path) else None


GENERIC_TOKENIZER_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def _load_tokenizer(path: str):
  """The checkpoint's tokenizer, exactly as its tokenizer.json defines it.

  transformers 5 maps a generic tokenizer (class `TokenizersBackend`) of a checkpoint
  whose model type is e.g. qwen2 to that model's tokenizer class, which replaces the
  pre-tokenizer and decoder of tokenizer.json with its own; a generic one is loaded
  as what it is.
  """
  import transformers

  config_path = os.path.join(path, "tokenizer_config.json")
  tokenizer_class = None
  if os.path.exists(config_path):
    with open(config_path) as f:
      tokenizer_class = json.load(f).get("tokenizer_class")
  if tokenizer_class in GENERIC_TOKENIZER_CLASSES:
    return transformers.PreTrainedTokenizerFast.from_pretrained(path, local_files_only=True)
  return transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)


def _params_by_path(model: Decoder) -> dict:
  """Parameter path ("model/layers/0/mlp/up_proj/kernel") → its Variable."""
  leaves = jax.tree_util.tree_leaves_with_path(nnx.state(model, nnx.Param),
                                               is_leaf=lambda x: isinstance(x, nnx.Variable))
  return {_path_string(path): variable for path, variable in leaves}


def hf_tensors(model: Decoder, dtype=np.float32) -> dict[str, np.ndarray]:
  """The model's weights under their Hugging Face names and layouts, on the host."""
  flat = _params_by_path(model)
  tensors = {}
  for hf_name, (ours, transpose) in hf_parameter_names(model.config).items():
    value = np.asarray(jax.device_get(flat[ours][...]), dtype)
    tensors[hf_name] = np.ascontiguousarray(value.T if transpose else value)
  return tensors


def save_params(model: Decoder, path: str) -> None:
  """Write the model's weights as `PARAMS_FILE` under their parameter paths, in the model's own
  layout and dtypes: what `read_like` loads fastest (a weight push to servers of the same model)."""
  os.makedirs(path, exist_ok=True)
  save_file(_params_tensors(model), os.path.join(path, PARAMS_FILE), metadata=_PARAMS_METADATA)


def params_bytes(model: Decoder) -> bytes:
  """The bytes of the file `save_params` writes, without the disk (a weight push over gRPC)."""
  return save_safetensors_bytes(_params_tensors(model), metadata=_PARAMS_METADATA)


_PARAMS_METADATA = {"format": "copc_jax.params"}


def _params_tensors(model: Decoder) -> dict[str, np.ndarray]:
  return {name: np.asarray(jax.device_get(v[...])) for name, v in _params_by_path(model).items()}


def save_pretrained(model: Decoder, path: str, *, tokenizer=None, dtype=np.float32) -> None:
  """Write `config.json` and `model.safetensors` (and the tokenizer) in Hugging Face's format."""
  os.makedirs(path, exist_ok=True)
  model.config.to_hf().save_pretrained(path)
  save_file(hf_tensors(model, dtype), os.path.join(path, SAFETENSORS_SINGLE), metadata={"format": "pt"})
  if tokenizer is not None:
    tokenizer.save_pretrained(path)
