"""Architecture hyper-parameters of the Llama/Qwen2/Qwen3 decoder family, read from a Hugging Face config.

Qwen3 (dense) is Qwen2 without the q/k/v biases and with an RMSNorm over each head's queries and keys
before RoPE (`qk_norm`)."""

from __future__ import annotations

import dataclasses
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  model_type: str = "qwen2"
  vocab_size: int = 512
  hidden_size: int = 64
  intermediate_size: int = 128
  num_layers: int = 2
  num_heads: int = 4
  num_kv_heads: int = 2
  head_dim: int = 16
  rms_norm_eps: float = 1e-6
  rope_theta: float = 10000.0
  rope_scaling: tuple[tuple[str, Any], ...] | None = None   # sorted (key, value) pairs
  max_position_embeddings: int = 2048
  tie_word_embeddings: bool = True
  qkv_bias: bool = True
  o_bias: bool = False
  mlp_bias: bool = False
  qk_norm: bool = False          # Qwen3: RMSNorm over head_dim on each query and key head, before RoPE
  bos_token_id: int | None = None
  eos_token_id: int | None = None

  def __post_init__(self):
    if self.model_type not in SUPPORTED_MODEL_TYPES:
      raise ValueError(f"model_type must be one of {SUPPORTED_MODEL_TYPES}; got {self.model_type!r}")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                       f"({self.num_kv_heads})")
    rope_type = self.rope_kwargs.get("rope_type", "default")
    if rope_type not in SUPPORTED_ROPE_TYPES:
      raise ValueError(f"rope_scaling.rope_type must be one of {SUPPORTED_ROPE_TYPES}; got {rope_type!r}")

  @property
  def rope_kwargs(self) -> dict:
    return dict(self.rope_scaling or ())

  @classmethod
  def from_hf(cls, hf_config) -> ModelConfig:
    """From a `transformers` config object (LlamaConfig, Qwen2Config, Qwen3Config)."""
    get = lambda name, default=None: getattr(hf_config, name, default)
    model_type = get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
      raise ValueError(f"model_type must be one of {SUPPORTED_MODEL_TYPES}; got {model_type!r}")
    num_heads = get("num_attention_heads")
    rope_parameters = get("rope_parameters") or get("rope_scaling")
    rope_theta = get("rope_theta")
    if isinstance(rope_parameters, dict):
      rope_theta = rope_parameters.get("rope_theta", rope_theta)
      rope_parameters = {k: v for k, v in rope_parameters.items() if k != "rope_theta"}
      if rope_parameters.get("rope_type", rope_parameters.get("type", "default")) == "default":
        rope_parameters = None
      elif "type" in rope_parameters and "rope_type" not in rope_parameters:
        rope_parameters["rope_type"] = rope_parameters.pop("type")
    attention_bias = bool(get("attention_bias", False))
    eos = get("eos_token_id")
    return cls(
        model_type=model_type,
        vocab_size=get("vocab_size"),
        hidden_size=get("hidden_size"),
        intermediate_size=get("intermediate_size"),
        num_layers=get("num_hidden_layers"),
        num_heads=num_heads,
        num_kv_heads=get("num_key_value_heads") or num_heads,
        head_dim=get("head_dim") or get("hidden_size") // num_heads,
        rms_norm_eps=get("rms_norm_eps"),
        rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
        rope_scaling=tuple(sorted(rope_parameters.items())) if rope_parameters else None,
        max_position_embeddings=get("max_position_embeddings"),
        tie_word_embeddings=bool(get("tie_word_embeddings", False)),
        qkv_bias=True if model_type == "qwen2" else attention_bias,
        o_bias=False if model_type == "qwen2" else attention_bias,
        mlp_bias=bool(get("mlp_bias", False)),
        qk_norm=model_type == "qwen3",
        bos_token_id=get("bos_token_id"),
        eos_token_id=eos[0] if isinstance(eos, list) else eos,
    )

  def to_hf(self):
    """The matching `transformers` config object (for export)."""
    import transformers

    common = dict(
        vocab_size=self.vocab_size, hidden_size=self.hidden_size,
        intermediate_size=self.intermediate_size, num_hidden_layers=self.num_layers,
        num_attention_heads=self.num_heads, num_key_value_heads=self.num_kv_heads,
        rms_norm_eps=self.rms_norm_eps, max_position_embeddings=self.max_position_embeddings,
        tie_word_embeddings=self.tie_word_embeddings, bos_token_id=self.bos_token_id,
        eos_token_id=self.eos_token_id, head_dim=self.head_dim,
        rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta, **self.rope_kwargs},
    )
    if self.model_type == "qwen2":
      return transformers.Qwen2Config(**common)
    if self.model_type == "qwen3":
      return transformers.Qwen3Config(attention_bias=self.qkv_bias, **common)
    return transformers.LlamaConfig(attention_bias=self.qkv_bias, mlp_bias=self.mlp_bias, **common)
