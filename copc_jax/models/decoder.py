"""The Llama/Qwen2 decoder (actor) and the value model, in Flax NNX, with a KV cache.

    logits = Decoder(config, rngs=...)(input_ids_bt)                 # [B, T] → [B, T, V] float32
    logits, cache = model.decode(ids_bt, positions_bt, cache)       # incremental decoding
    values = ValueModel(config, rngs=...)(input_ids_bt)              # [B, T] float32

At scale (`Backbone`'s options): `dtype` computes (bfloat16 on accelerators), `param_dtype` stores
(float32 master weights); `remat` recomputes each block in the backward pass (a policy name of
`REMAT_POLICIES`); `scan_layers` runs the blocks as one `lax.scan` over their stacked weights, so
compile time does not grow with depth (the parameters stay one module per layer: checkpoints,
Hugging Face names and weight pushes do not change); `attention` picks the kernel
(`models/attention.py`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx, struct

from copc_jax.models.config import ModelConfig
from copc_jax.models.layers import Block, Linear, RMSNorm, rope_inverse_frequencies

# remat policy name → what the backward pass keeps of a block (None: nothing but its input)
REMAT_POLICIES = {"none": None, "full": None,
                  "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
                  "dots_saveable": jax.checkpoint_policies.dots_saveable}


def remat_policy_name(remat) -> str:
  """`remat` as a policy name: True → "full", False → "none"."""
  name = {True: "full", False: "none"}.get(remat, remat) if isinstance(remat, bool) else remat
  if name not in REMAT_POLICIES:
    raise ValueError(f"remat must be one of {sorted(REMAT_POLICIES)}; got {remat!r}")
  return name


@struct.dataclass
class KVCache:
  """Keys/values of every layer for `max_length` slots; slot s is visible once written."""

  keys: jax.Array     # [L, B, S, KV, D]
  values: jax.Array   # [L, B, S, KV, D]
  valid: jax.Array    # [B, S] bool: slot holds a real (non-padding) token
  index: jax.Array    # [] int32: next slot to write (shared by the batch)

  @classmethod
  def create(cls, config: ModelConfig, batch: int, max_length: int, dtype=jnp.float32) -> KVCache:
    shape = (config.num_layers, batch, max_length, config.num_kv_heads, config.head_dim)
    return cls(keys=jnp.zeros(shape, dtype), values=jnp.zeros(shape, dtype),
               valid=jnp.zeros((batch, max_length), bool), index=jnp.zeros((), jnp.int32))


def default_positions(attention_mask_bt):
  """Position ids that skip padding: cumsum(mask) − 1, clipped at 0 (Hugging Face's convention)."""
  return jnp.maximum(jnp.cumsum(attention_mask_bt.astype(jnp.int32), axis=1) - 1, 0)


def _write_at_index(past, new, index):
  """Cache [B, S, KV, D] with new [B, T, KV, D] at slots [index, index + T) of every row."""
  return jax.lax.dynamic_update_slice(past, new.astype(past.dtype), (0, index, 0, 0))


def _write_at_rows(past, new, slots_b):
  """Cache [B, S, KV, D] with new [B, 1, KV, D] at slot slots_b[b] of row b."""
  return past.at[jnp.arange(past.shape[0]), slots_b].set(new[:, 0].astype(past.dtype))


def _block_forward(block: Block, x, positions, inv_freq, visible, past_kv=None, where=None, segment_ids=None):
  """One pre-norm block; with `past_kv` the new keys/values are first written into it.

  `where` is an int (one slot index for the whole batch) or an int array [B] (one slot per row).
  """
  h = block.input_layernorm(x)
  k, v = block.self_attn.project_kv(h, positions, inv_freq)
  if past_kv is not None:
    write = _write_at_index if jnp.ndim(where) == 0 else _write_at_rows
    k, v = write(past_kv[0], k, where), write(past_kv[1], v, where)
  x = x + block.self_attn(h, positions, inv_freq, k, v, visible, segment_ids)
  x = x + block.mlp(block.post_attention_layernorm(x))
  return x, (k, v)


class Backbone(nnx.Module):
  """Embedding, decoder blocks and final norm: token ids → hidden states."""

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, dtype=jnp.float32, param_dtype=None,
               remat=False, scan_layers: bool = False, attention: str = "reference"):
    self.config = config
    self.dtype = jnp.dtype(dtype)
    self.param_dtype = jnp.dtype(param_dtype or dtype)
    self.remat = remat_policy_name(remat)
    self.scan_layers = scan_layers
    self.attention = attention
    self.embed_tokens = nnx.Param(
        nnx.initializers.normal(0.02)(rngs.params(), (config.vocab_size, config.hidden_size), self.param_dtype),
        logical_axes=("vocab", "embed"))
    self.layers = nnx.List([Block(config, rngs=rngs, dtype=self.param_dtype, attention=attention)
                            for _ in range(config.num_layers)])
    self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, rngs=rngs, dtype=self.param_dtype)

  @property
  def options(self) -> dict:
    """The keyword arguments that build a backbone computing like this one."""
    return dict(dtype=self.dtype, param_dtype=self.param_dtype, remat=self.remat,
                scan_layers=self.scan_layers, attention=self.attention)

  def _run(self, input_ids_bt, positions_bt, visible_bts, cache: KVCache | None, where=None,
           segment_ids_bt=None):
    inv_freq = rope_inverse_frequencies(self.config)
    x = jnp.take(self.embed_tokens[...], input_ids_bt, axis=0).astype(self.dtype)
    if self.scan_layers:
      x, keys, values = self._scan(x, positions_bt, inv_freq, visible_bts, cache, where, segment_ids_bt)
      return self.norm(x), keys, values
    forward = _block_forward
    if self.remat != "none":
      forward = nnx.remat(_block_forward, policy=REMAT_POLICIES[self.remat])
    # the cache [L, ...] is updated one layer at a time in place (a donated cache is not copied)
    keys, values = (None, None) if cache is None else (cache.keys, cache.values)
    for i, block in enumerate(self.layers):
      past = None if cache is None else (keys[i], values[i])
      x, (k, v) = forward(block, x, positions_bt, inv_freq, visible_bts, past, where, segment_ids_bt)
      if cache is not None:
        keys, values = keys.at[i].set(k), values.at[i].set(v)
    return self.norm(x), keys, values

  def _scan(self, x, positions_bt, inv_freq, visible_bts, cache, where, segment_ids_bt):
    """The blocks as one `lax.scan` over their weights stacked on a leading layer axis [L, ...]
    (cast to the compute dtype first, so the stacked copy is half the float32 weights in bf16)."""
    graphdef, _ = nnx.split(self.layers[0])
    cast = lambda w: w.astype(self.dtype) if jnp.issubdtype(w.dtype, jnp.floating) else w
    stacked = jax.tree.map(lambda *ws: jnp.stack([cast(w) for w in ws]),
                           *[nnx.state(block) for block in self.layers])

    def block(x, weights, past):
      return _block_forward(nnx.merge(graphdef, weights), x, positions_bt, inv_freq, visible_bts, past, where,
                            segment_ids_bt)

    if self.remat != "none":
      block = jax.checkpoint(block, policy=REMAT_POLICIES[self.remat], prevent_cse=False)
    if cache is None:
      x, _ = jax.lax.scan(lambda x, weights: (block(x, weights, None)[0], None), x, stacked)
      return x, None, None

    def body(carry, layer):       # the whole cache in the carry: each layer's slice updated in place
      x, keys, values = carry
      i, weights = layer
      x, (k, v) = block(x, weights, (keys[i], values[i]))
      return (x, keys.at[i].set(k), values.at[i].set(v)), None

    (x, keys, values), _ = jax.lax.scan(body, (x, cache.keys, cache.values),
                                        (jnp.arange(self.config.num_layers), stacked))
    return x, keys, values

  def __call__(self, input_ids_bt, *, positions_bt=None, attention_mask_bt=None, segment_ids_bt=None):
    """Hidden states [B, T, H] of a whole sequence: causal, padding keys hidden. With
    `segment_ids_bt` (packed sequences) a token sees only earlier tokens of its own segment; give
    each document's positions in `positions_bt` then."""
    b, t = input_ids_bt.shape
    if attention_mask_bt is None:
      attention_mask_bt = jnp.ones((b, t), bool)
    attention_mask_bt = attention_mask_bt.astype(bool)
    if positions_bt is None:
      positions_bt = default_positions(attention_mask_bt)
    if segment_ids_bt is None and self.attention == "splash":
      segment_ids_bt = attention_mask_bt.astype(jnp.int32)   # padding is a segment of its own
    if self.attention == "splash":
      visible_bts = None                                       # the kernel masks by segment
    else:
      causal_tt = jnp.tril(jnp.ones((t, t), bool))
      visible_bts = causal_tt[None] & attention_mask_bt[:, None, :]
      if segment_ids_bt is not None:
        visible_bts = visible_bts & (segment_ids_bt[:, :, None] == segment_ids_bt[:, None, :])
    hidden, _, _ = self._run(input_ids_bt, positions_bt, visible_bts, None, segment_ids_bt=segment_ids_bt)
    return hidden

  def decode(self, input_ids_bt, positions_bt, cache: KVCache, token_valid_bt=None):
    """Hidden states of T new tokens written at slots [index, index + T) of the cache."""
    b, t = input_ids_bt.shape
    if token_valid_bt is None:
      token_valid_bt = jnp.ones((b, t), bool)
    valid_bs = jax.lax.dynamic_update_slice(cache.valid, token_valid_bt.astype(bool), (0, cache.index))
    slots_s = jnp.arange(cache.valid.shape[1])
    query_slots_t = cache.index + jnp.arange(t)
    visible_bts = valid_bs[:, None, :] & (slots_s[None, None, :] <= query_slots_t[None, :, None])
    hidden, keys, values = self._run(input_ids_bt, positions_bt, visible_bts, cache, cache.index)
    new_cache = KVCache(keys=keys, values=values, valid=valid_bs, index=cache.index + t)
    return hidden, new_cache

  def decode_rows(self, input_ids_b, slots_b, cache: KVCache):
    """Hidden states [B, 1, H] of one new token per row, written at the row's own slot.

    For continuous batching: each row (a server slot) is at its own length. The
    slot of a token is its position; keys at slots ≤ slots_b[b] that are valid are visible.
    """
    valid_bs = cache.valid.at[jnp.arange(cache.valid.shape[0]), slots_b].set(True)
    slots_s = jnp.arange(cache.valid.shape[1])
    visible_bts = (valid_bs & (slots_s[None] <= slots_b[:, None]))[:, None, :]
    hidden, keys, values = self._run(input_ids_b[:, None], slots_b[:, None], visible_bts, cache, slots_b)
    new_cache = KVCache(keys=keys, values=values, valid=valid_bs, index=cache.index)
    return hidden, new_cache


class Decoder(nnx.Module):
  """The actor: a causal LM returning float32 logits."""

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, dtype=jnp.float32, **options):
    """`options`: `Backbone`'s (param_dtype, remat, scan_layers, attention)."""
    self.config = config
    self.model = Backbone(config, rngs=rngs, dtype=dtype, **options)
    self.lm_head = None if config.tie_word_embeddings else Linear(
        config.hidden_size, config.vocab_size, axes=("embed", "vocab"), bias=False, rngs=rngs,
        dtype=self.model.param_dtype)

  def logits(self, hidden_btd):
    if self.lm_head is None:
      return jnp.einsum("btd,vd->btv", hidden_btd, self.model.embed_tokens[...].astype(hidden_btd.dtype),
                        preferred_element_type=jnp.float32)
    return self.lm_head(hidden_btd).astype(jnp.float32)

  def __call__(self, input_ids_bt, *, positions_bt=None, attention_mask_bt=None, segment_ids_bt=None):
    hidden = self.model(input_ids_bt, positions_bt=positions_bt, attention_mask_bt=attention_mask_bt,
                        segment_ids_bt=segment_ids_bt)
    return self.logits(hidden)

  def decode(self, input_ids_bt, positions_bt, cache: KVCache, token_valid_bt=None):
    hidden, cache = self.model.decode(input_ids_bt, positions_bt, cache, token_valid_bt)
    return self.logits(hidden), cache

  def decode_rows(self, input_ids_b, slots_b, cache: KVCache):
    """Logits [B, V] of one new token per row at its own slot (see `Backbone.decode_rows`)."""
    hidden, cache = self.model.decode_rows(input_ids_b, slots_b, cache)
    return self.logits(hidden)[:, 0], cache


class ValueModel(nnx.Module):
  """The critic: its own backbone (no submodule shared with the actor) and a scalar head."""

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, dtype=jnp.float32, **options):
    """`options`: `Backbone`'s (param_dtype, remat, scan_layers, attention)."""
    self.config = config
    self.model = Backbone(config, rngs=rngs, dtype=dtype, **options)
    self.value_head = Linear(config.hidden_size, 1, axes=("embed", None), bias=True, rngs=rngs,
                             dtype=self.model.param_dtype)

  def __call__(self, input_ids_bt, *, positions_bt=None, attention_mask_bt=None, segment_ids_bt=None):
    """V at every position [B, T], float32."""
    hidden = self.model(input_ids_bt, positions_bt=positions_bt, attention_mask_bt=attention_mask_bt,
                        segment_ids_bt=segment_ids_bt)
    return self.value_head(hidden.astype(jnp.float32))[..., 0]

  @classmethod
  def from_policy(cls, policy: Decoder, *, rngs: nnx.Rngs) -> ValueModel:
    """A critic whose backbone starts as a copy of the policy's (computing as it does), with a fresh head."""
    critic = cls(policy.config, rngs=rngs, **policy.model.options)
    copied = jax.tree.map(jnp.array, nnx.state(policy.model, nnx.Param))  # new buffers, not aliases
    nnx.update(critic.model, copied)
    return critic
