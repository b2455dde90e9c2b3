"""Attention, one function with a kernel choice: softmax(q kᵀ / √d + mask) v with grouped-query heads.

    out_btnd = attention(q_btnd, k_bskd, v_bskd, visible_bts, implementation="xla")
    out_btnd = attention(q_btnd, k_bskd, v_bskd, segment_ids_bt=ids, implementation="splash")

Implementations:
  - "reference": the literal einsum; float32 scores [B, K, G, T, S] (HF parity tests, decode).
  - "xla": `jax.nn.dot_product_attention(implementation="xla")`; "cudnn": the same call with cuDNN's
    fused kernel (GPUs only).
  - "splash": the TPU Pallas kernel (`jax.experimental.pallas.ops.tpu.splash_attention`), causal
    and blockwise, so no [T, S] score matrix exists in HBM; it takes segment ids instead of a dense
    mask (tokens attend only to earlier tokens of their own segment: packed documents and padding
    never mix). `interpret=True` runs it on the CPU (tests).

Every implementation gives the same result where their masks agree (tested); `visible_bts` is a
dense mask for the first three, `segment_ids_bt` the causal-by-segment mask of "splash".
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

IMPLEMENTATIONS = ("reference", "xla", "cudnn", "splash")
NEG_INF = -1e30  # finite, so a query row with no visible key gives a uniform softmax, not NaN


def check_implementation(name: str) -> str:
  if name not in IMPLEMENTATIONS:
    raise ValueError(f"attention must be one of {IMPLEMENTATIONS}; got {name!r}")
  return name


def causal_segment_mask(segment_ids_bt):
  """visible[b, t, s] = s ≤ t and segment[b, s] == segment[b, t]: the dense mask "splash" computes."""
  t = segment_ids_bt.shape[1]
  causal_tt = jnp.tril(jnp.ones((t, t), bool))
  return causal_tt[None] & (segment_ids_bt[:, :, None] == segment_ids_bt[:, None, :])


def attention(q_btnd, k_bskd, v_bskd, visible_bts=None, *, segment_ids_bt=None,
              implementation: str = "reference", interpret: bool = False):
  """Grouped-query attention of N query heads over K key/value heads (N a multiple of K)."""
  check_implementation(implementation)
  if implementation == "splash":
    if segment_ids_bt is None:
      raise ValueError("attention='splash' needs segment_ids_bt (it is causal by segment, no dense mask)")
    return _splash(q_btnd, k_bskd, v_bskd, segment_ids_bt, interpret)
  if visible_bts is None:
    visible_bts = causal_segment_mask(segment_ids_bt)
  if implementation == "reference":
    return _reference(q_btnd, k_bskd, v_bskd, visible_bts)
  out = jax.nn.dot_product_attention(q_btnd, k_bskd, v_bskd, mask=visible_bts[:, None],
                                     implementation=implementation)
  return out.astype(q_btnd.dtype)


def _reference(q_btnd, k_bskd, v_bskd, visible_bts):
  b, t, n, d = q_btnd.shape
  kv_heads = k_bskd.shape[2]
  q = q_btnd.reshape(b, t, kv_heads, n // kv_heads, d)
  scores = jnp.einsum("btkgd,bskd->bkgts", q, k_bskd, preferred_element_type=jnp.float32) / math.sqrt(d)
  scores = jnp.where(visible_bts[:, None, None], scores, NEG_INF)
  probs = jax.nn.softmax(scores, axis=-1).astype(v_bskd.dtype)
  return jnp.einsum("bkgts,bskd->btkgd", probs, v_bskd).reshape(b, t, n, d)


@functools.lru_cache(maxsize=32)
def _splash_kernel(num_heads: int, length: int, interpret: bool):
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as kernel
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks
  block = min(512, length)
  sizes = kernel.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block,
                            block_kv_dkv=block, block_kv_dkv_compute=block, block_q_dq=block, block_kv_dq=block)
  mask = masks.MultiHeadMask([masks.CausalMask((length, length)) for _ in range(num_heads)])
  return kernel.make_splash_mha(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1, interpret=interpret)


def _splash(q_btnd, k_bskd, v_bskd, segment_ids_bt, interpret: bool):
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as kernel
  b, t, n, d = q_btnd.shape
  if k_bskd.shape[1] != t:
    raise ValueError("attention='splash' is self-attention over one sequence (no cache); use 'xla' to decode")
  if t % 128:
    raise ValueError(f"attention='splash' needs a sequence length that is a multiple of 128; got {t}")
  q_btnd = q_btnd / np.sqrt(d).astype(q_btnd.dtype)
  kv_heads = k_bskd.shape[2]

  def local(q_btnd, k_bskd, v_bskd, segment_ids_bt):
    splash = _splash_kernel(q_btnd.shape[2], t, interpret)
    q = q_btnd.transpose(0, 2, 1, 3)                                         # [B, N, T, D]
    k, v = k_bskd.transpose(0, 2, 1, 3), v_bskd.transpose(0, 2, 1, 3)      # [B, K, S, D]
    ids = segment_ids_bt.astype(jnp.int32)
    out = jax.vmap(lambda q, k, v, s: splash(q, k, v, segment_ids=kernel.SegmentIds(q=s, kv=s)))(q, k, v, ids)
    return out.transpose(0, 2, 1, 3)

  # A Pallas kernel is not partitioned by the compiler: under a mesh it runs per shard, rows over the
  # batch axes and heads over `tensor` where both head counts divide it.
  mesh = jax.sharding.get_abstract_mesh()
  if mesh is None or mesh.empty or mesh.size == 1:
    return local(q_btnd, k_bskd, v_bskd, segment_ids_bt).astype(q_btnd.dtype)
  sizes = dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))
  rows = tuple(a for a in ("data", "fsdp") if sizes.get(a, 1) > 1 and b % sizes[a] == 0) or None
  tensor = sizes.get("tensor", 1)
  heads = "tensor" if tensor > 1 and n % tensor == 0 and kv_heads % tensor == 0 else None
  spec = jax.sharding.PartitionSpec(rows, None, heads, None)
  out = jax.shard_map(local, mesh=mesh, in_specs=(spec, spec, spec, jax.sharding.PartitionSpec(rows, None)),
                      out_specs=spec, check_vma=False)(q_btnd, k_bskd, v_bskd, segment_ids_bt)
  return out.astype(q_btnd.dtype)
