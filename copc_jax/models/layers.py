"""Building blocks of the Llama/Qwen2 decoder in Flax NNX: RMSNorm, RoPE, GQA attention, SwiGLU.

Every parameter carries `logical_axes` metadata; `copc_jax.sharding` maps those
names to mesh axes with the rules of the config.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from copc_jax.models.attention import attention, check_implementation
from copc_jax.models.config import ModelConfig


def _param(rngs, init, shape, axes, dtype):
  return nnx.Param(init(rngs.params(), shape, dtype), logical_axes=axes)


class Linear(nnx.Module):
  """y = x W (+ b), W stored as [in, out] (the transpose of a Hugging Face weight)."""

  def __init__(self, in_features, out_features, *, axes, bias, rngs, dtype=jnp.float32):
    self.kernel = _param(rngs, nnx.initializers.normal(0.02), (in_features, out_features), axes, dtype)
    self.bias = _param(rngs, nnx.initializers.zeros, (out_features,), axes[1:], dtype) if bias else None

  def __call__(self, x):
    y = jnp.dot(x, self.kernel[...].astype(x.dtype))
    return y if self.bias is None else y + self.bias[...].astype(x.dtype)


class RMSNorm(nnx.Module):
  """x / sqrt(mean(x²) + ε) · w, computed in float32."""

  def __init__(self, size, eps, *, rngs, dtype=jnp.float32):
    del rngs
    self.weight = nnx.Param(jnp.ones((size,), dtype), logical_axes=("norm",))
    self.eps = eps

  def __call__(self, x):
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + self.eps)
    return (self.weight[...].astype(jnp.float32) * x32).astype(x.dtype)


def rope_inverse_frequencies(config: ModelConfig):
  """inv_freq_i = θ^(−2i/d), with the checkpoint's scaling ("linear" or Llama 3's)."""
  dim = config.head_dim
  inv_freq = 1.0 / (config.rope_theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))
  kw = config.rope_kwargs
  rope_type = kw.get("rope_type", "default")
  if rope_type == "linear":
    inv_freq = inv_freq / kw["factor"]
  elif rope_type == "llama3":
    factor, low, high = kw["factor"], kw["low_freq_factor"], kw["high_freq_factor"]
    original = kw["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = (original / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    inv_freq = jnp.where(wavelen > original / low, inv_freq / factor,
                         jnp.where(wavelen < original / high, inv_freq, smoothed))
  return inv_freq


def apply_rope(x_bthd, positions_bt, inv_freq):
  """Rotary embedding, Hugging Face's rotate-half layout: x cos + rotate_half(x) sin."""
  angles = positions_bt.astype(jnp.float32)[..., None] * inv_freq      # [B, T, D/2]
  angles = jnp.concatenate([angles, angles], axis=-1)[:, :, None, :]  # [B, T, 1, D]
  x32 = x_bthd.astype(jnp.float32)
  half = x32.shape[-1] // 2
  rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
  return (x32 * jnp.cos(angles) + rotated * jnp.sin(angles)).astype(x_bthd.dtype)


class Attention(nnx.Module):
  """Grouped-query attention with optional q/k/v biases (Qwen2) and per-head q/k RMSNorm (Qwen3)."""

  def __init__(self, config: ModelConfig, *, rngs, dtype=jnp.float32, implementation: str = "reference"):
    h, d = config.hidden_size, config.head_dim
    self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, d
    self.implementation = check_implementation(implementation)
    self.q_proj = Linear(h, config.num_heads * d, axes=("embed", "heads"), bias=config.qkv_bias,
                         rngs=rngs, dtype=dtype)
    self.k_proj = Linear(h, config.num_kv_heads * d, axes=("embed", "kv_heads"), bias=config.qkv_bias,
                         rngs=rngs, dtype=dtype)
    self.v_proj = Linear(h, config.num_kv_heads * d, axes=("embed", "kv_heads"), bias=config.qkv_bias,
                         rngs=rngs, dtype=dtype)
    self.o_proj = Linear(config.num_heads * d, h, axes=("heads", "embed"), bias=config.o_bias,
                         rngs=rngs, dtype=dtype)
    if config.qk_norm:
      self.q_norm = RMSNorm(d, config.rms_norm_eps, rngs=rngs, dtype=dtype)
      self.k_norm = RMSNorm(d, config.rms_norm_eps, rngs=rngs, dtype=dtype)
    self.qk_norm = config.qk_norm

  def _normed(self, norm_name: str, x_bthd):
    return getattr(self, norm_name)(x_bthd) if self.qk_norm else x_bthd

  def project_kv(self, x_btd, positions_bt, inv_freq):
    b, t, _ = x_btd.shape
    k = self._normed("k_norm", self.k_proj(x_btd).reshape(b, t, self.num_kv_heads, self.head_dim))
    v = self.v_proj(x_btd).reshape(b, t, self.num_kv_heads, self.head_dim)
    return apply_rope(k, positions_bt, inv_freq), v

  def __call__(self, x_btd, positions_bt, inv_freq, keys_bshd, values_bshd, visible_bts, segment_ids_bt=None):
    """Attend from x's queries to the given keys/values; `visible_bts[b, t, s]` says which (or, for
    the "splash" kernel, `segment_ids_bt`: causal within a segment)."""
    b, t, _ = x_btd.shape
    q = apply_rope(self._normed("q_norm", self.q_proj(x_btd).reshape(b, t, self.num_heads, self.head_dim)),
                   positions_bt, inv_freq)
    # a cache (decoding), no segment ids or a length the kernel's 128-blocks do not tile: the dense
    # mask, through XLA
    implementation = self.implementation
    if implementation == "splash" and (segment_ids_bt is None or keys_bshd.shape[1] != t or t % 128):
      implementation = "xla"
    out = attention(q, keys_bshd, values_bshd, visible_bts, segment_ids_bt=segment_ids_bt,
                    implementation=implementation)
    return self.o_proj(out.reshape(b, t, self.num_heads * self.head_dim))


class MLP(nnx.Module):
  """SwiGLU: down(silu(gate(x)) · up(x))."""

  def __init__(self, config: ModelConfig, *, rngs, dtype=jnp.float32):
    h, m, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
    self.gate_proj = Linear(h, m, axes=("embed", "mlp"), bias=bias, rngs=rngs, dtype=dtype)
    self.up_proj = Linear(h, m, axes=("embed", "mlp"), bias=bias, rngs=rngs, dtype=dtype)
    self.down_proj = Linear(m, h, axes=("mlp", "embed"), bias=bias, rngs=rngs, dtype=dtype)

  def __call__(self, x):
    return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nnx.Module):
  def __init__(self, config: ModelConfig, *, rngs, dtype=jnp.float32, attention: str = "reference"):
    self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, rngs=rngs, dtype=dtype)
    self.self_attn = Attention(config, rngs=rngs, dtype=dtype, implementation=attention)
    self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, rngs=rngs,
                                            dtype=dtype)
    self.mlp = MLP(config, rngs=rngs, dtype=dtype)
