"""Llama/Qwen2 decoder (actor), value model and Hugging Face checkpoint I/O."""

from copc_jax.models.config import ModelConfig
from copc_jax.models.decoder import Decoder, KVCache, ValueModel
from copc_jax.models.hf_io import from_pretrained, save_pretrained

__all__ = ["ModelConfig", "Decoder", "KVCache", "ValueModel", "from_pretrained", "save_pretrained"]
