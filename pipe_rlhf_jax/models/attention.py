"""Grouped-query attention over an arbitrary key mask, three ways with one signature.

- `dense`: scores `[batch, kv_heads, groups, length, keys]` materialised in f32, one
  softmax. Fastest at short lengths; memory quadratic in length. Both products run as
  batched matmuls on head-major operands (queries `[batch, kv_heads, groups * length,
  head_dim]`, keys and values `[batch, kv_heads, keys, head_dim]`, the KV cache's own
  layout), which XLA:CPU multiplies without re-laying out keys, values or scores.
- `blockwise`: the keys in blocks of `block_size`, an online softmax (running max and
  denominator) carried through a `lax.scan`, each block's body rematerialised for the
  backward pass. Memory linear in length (one block of scores at a time, also in the
  gradient); pure JAX, so it runs on every backend, CPU included.
- `dot_product`: `jax.nn.dot_product_attention`, which lets XLA / cuDNN choose a fused
  kernel where the backend has one for this mask.

A sliding window (a query sees only the last W slots) is part of the key mask the caller
builds (`models.transformer.Layers`), so every implementation supports it unchanged.

All three agree within float tolerance on every query row that can see at least one
key. A row that sees none (a left-padding position) is never read downstream; `dense`
and `dot_product` average all values there, `blockwise` returns zeros.

`auto` (the default of `TransformerConfig.attention`) is `dense` when its scores are no
larger than one block's of a whole-length query (queries x keys <= block_size^2), and
`blockwise` beyond. For self-attention (queries = keys) that is all keys in one block, where
the two are the same computation. A decode step (one query over the cache) is always
dense: its scores are one row per head, and blockwise would pad the whole cache to a
multiple of the block and scan it, a copy of every layer's cache at every token (at
P + T = 576 keys that was most of a decode step).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

_MIN = float(jnp.finfo(jnp.float32).min)  # finite: masked rows stay free of NaN


def resolve(impl: str, num_keys: int, block_size: int, num_queries: int | None = None) -> str:
  """The implementation `impl` stands for at `num_keys` keys and `num_queries` queries
  per row (default: as many as keys, self-attention)."""
  if impl != "auto":
    return impl
  queries = num_keys if num_queries is None else num_queries
  return "dense" if queries * num_keys <= block_size * block_size else "blockwise"


def attention(q: jax.Array, k: jax.Array, v: jax.Array, allowed: jax.Array, *,
              impl: str = "auto", block_size: int = 512,
              scale: float | None = None) -> jax.Array:
  """Softmax attention of grouped queries.

  Args:
    q: [batch, length, kv_heads, groups, head_dim] queries (RoPE applied, unscaled).
    k, v: [batch, kv_heads, keys, head_dim] (head-major, as `models.transformer.KVCache`
      keeps them).
    allowed: bool [batch, length, keys]: which keys each query may attend to.
    impl: "auto", "dense", "blockwise" or "dot_product".
    block_size: keys per block of `blockwise`.
    scale: the factor on q.k scores; default `head_dim ** -0.5`.

  Returns:
    [batch, length, kv_heads, groups, head_dim] in q's dtype.
  """
  impl = resolve(impl, k.shape[2], block_size, q.shape[1])
  if scale is None:
    scale = 1.0 / math.sqrt(q.shape[-1])
  if impl == "dense":
    return _dense(q, k, v, allowed, scale)
  if impl == "blockwise":
    return _blockwise(q, k, v, allowed, block_size, scale)
  if impl == "dot_product":
    return _dot_product(q, k, v, allowed, scale)
  raise ValueError(f"attention impl={impl!r}; choose auto, dense, blockwise or dot_product.")


def _dense(q, k, v, allowed, scale):
  dt = q.dtype
  batch, length, kv_heads, groups, head_dim = q.shape
  keys = k.shape[2]
  # Head-major operands, so both products are plain batched matmuls over
  # (batch, kv_heads) with a group's queries stacked along the rows: XLA:CPU then runs
  # them without re-laying out keys, values or scores. The scale is folded into q
  # (length x head_dim values rather than length x keys scores).
  q = (q * scale).astype(dt)
  q = q.transpose(0, 2, 3, 1, 4).reshape(batch, kv_heads, groups * length, head_dim)
  # [batch, kv_heads, groups, length, keys]: q . k over head_dim, k as laid out.
  scores = jnp.einsum("bkqd,bksd->bkqs", q, k.astype(dt)).astype(jnp.float32).reshape(
      batch, kv_heads, groups, length, keys)
  scores = jnp.where(allowed[:, None, None], scores, _MIN)
  probs = jax.nn.softmax(scores, axis=-1).astype(dt)
  out = jnp.matmul(probs.reshape(batch, kv_heads, groups * length, keys), v.astype(dt))
  # [batch, length, kv_heads, groups, head_dim]
  return out.reshape(batch, kv_heads, groups, length, head_dim).transpose(0, 3, 1, 2, 4)


def _blockwise(q, k, v, allowed, block_size, scale):
  dt = q.dtype
  batch, length, kv_heads, groups, head_dim = q.shape
  keys = k.shape[2]
  num_blocks = -(-keys // block_size)
  pad = num_blocks * block_size - keys
  if pad:  # padded keys are masked out
    k = jnp.pad(k, ((0, 0), (0, 0), (0, pad), (0, 0)))
    v = jnp.pad(v, ((0, 0), (0, 0), (0, pad), (0, 0)))
    allowed = jnp.pad(allowed, ((0, 0), (0, 0), (0, pad)))
  # [blocks, batch, kv_heads, block, head_dim] and [blocks, batch, length, block]
  blocks = lambda x: x.reshape(batch, kv_heads, num_blocks, block_size, head_dim
                               ).transpose(2, 0, 1, 3, 4)
  k_blocks, v_blocks = blocks(k), blocks(v)
  m_blocks = allowed.reshape(batch, length, num_blocks, block_size).transpose(2, 0, 1, 3)

  def step(carry, xs):
    # running max, denominator [batch, kv_heads, groups, length]; numerator [..., head_dim]
    running_max, denom, numer = carry
    k_blk, v_blk, mask = xs
    scores = jnp.einsum("blkgd,bksd->bkgls", q, k_blk.astype(dt)).astype(jnp.float32)
    mask = mask[:, None, None]  # [batch, 1, 1, length, block]
    scores = jnp.where(mask, scores * scale, _MIN)
    new_max = jnp.maximum(running_max, jnp.max(scores, axis=-1))
    probs = jnp.where(mask, jnp.exp(scores - new_max[..., None]), 0.0)
    correction = jnp.exp(running_max - new_max)
    denom = denom * correction + jnp.sum(probs, axis=-1)
    numer = numer * correction[..., None] + jnp.einsum(
        "bkgls,bksd->bkgld", probs.astype(dt), v_blk.astype(dt)).astype(jnp.float32)
    return (new_max, denom, numer), None

  stats_shape = (batch, kv_heads, groups, length)
  init = (jnp.full(stats_shape, _MIN, jnp.float32), jnp.zeros(stats_shape, jnp.float32),
          jnp.zeros(stats_shape + (head_dim,), jnp.float32))
  # Rematerialised: the backward pass recomputes one block's scores at a time instead of
  # keeping every block's (which would be the dense matrix again).
  (_, denom, numer), _ = jax.lax.scan(jax.checkpoint(step, prevent_cse=False), init,
                                      (k_blocks, v_blocks, m_blocks))
  out = numer / jnp.maximum(denom, jnp.finfo(jnp.float32).tiny)[..., None]
  return jnp.einsum("bkgld->blkgd", out).astype(dt)


def _dot_product(q, k, v, allowed, scale):
  batch, length, kv_heads, groups, head_dim = q.shape
  # Its keys and values are [batch, keys, kv_heads, head_dim].
  out = jax.nn.dot_product_attention(
      q.reshape(batch, length, kv_heads * groups, head_dim), k.swapaxes(1, 2).astype(q.dtype),
      v.swapaxes(1, 2).astype(q.dtype), mask=allowed[:, None], scale=scale)
  return out.reshape(batch, length, kv_heads, groups, head_dim)
