"""The decoder-only transformer (LLaMA 2/3, Qwen2/3, Mistral, Gemma 3) with stacked layers
and logical axes.

This module owns the model math: embeddings, RMSNorm, RoPE (with llama3 / linear
frequency scaling), grouped-query attention with an optional KV cache, optional
per-head q/k RMSNorm (Qwen3, Gemma 3) and sliding-window (local) layers, the gated MLP
(SwiGLU; GELU-tanh for Gemma 3), Gemma's `1 + w` norms around attention and MLP, and the
three heads on one backbone (LM logits, critic value, reward score).

Design points a reader should know:
- All transformer blocks live in ONE `Layers` module whose parameters carry a leading
  `layers` axis and are applied with `lax.scan`. A pipeline stage owns a contiguous slice
  of layers simply by sharding that axis over the `pipe` mesh axis; inside `shard_map` the
  same `Layers.__call__` runs on the local slice.
- Every parameter is an `nnx.Param` with `axes=` metadata naming its logical axes, and
  activations are constrained with `parallel.logical.constrain`; a per-stage rules table
  maps the names to mesh axes. Outside a rules context the constraints are no-ops.
- Batches are left-padded: `attention_mask` marks real tokens, positions default to the
  running count of real tokens, and padded keys are never attended to. The no-cache
  forward also takes packed rows (`segment_ids`, 0 = padding): several sequences side by
  side in one row, each attending causally within itself, positions restarting at each
  (`stages/packing.py` builds them).
- The KV cache is indexed by *slot* (column in the `[prompt | completion]` layout) and
  kept head-major, `[layers, batch, kv_heads, slots, head_dim]`: a decode step's
  attention reads each head's keys and values as contiguous `[slots, head_dim]` matrices,
  as its matmuls take them, where a slot-major cache made XLA:CPU transpose every layer's
  whole cache at every token (`docs/pipelined_generation.md` has the measurement). The
  static decoders write the same slot for every row at each step (one
  `dynamic_update_slice`); the continuous-batching engine gives each row its own slot
  (`slot` an int [batch]: one scatter per step), because its rows are at different
  completion positions.
- Local ("sliding_attention") and global layers share the stacked parameters; which
  kind a layer is comes from the config (a static pattern), looked up inside the layer
  scan from the layer's global index (`layer_offset` + local index, so a pipeline stage
  holding a slice of the layers gets its own slice of the pattern). Sliding windows are
  measured in cache slots, as transformers measures them in cache positions (left
  padding included). The cache keeps every slot for local layers too.
- LoRA adapters (`config.lora_rank` > 0, `models/lora.py`) are two more stacked arrays
  per adapted projection, `<proj>_lora_a` / `<proj>_lora_b`, added to its output inside
  the block; every decoder, the pipeline's layer slices and the shardings carry them as
  they carry the projection.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from flax import nnx
import jax
import jax.numpy as jnp

from pipe_rlhf_jax.models import attention as attention_lib
from pipe_rlhf_jax.models import lora
from pipe_rlhf_jax.models.config import EXECUTION_FIELDS, TransformerConfig
from pipe_rlhf_jax.parallel.logical import constrain

# Logical axes of each stacked per-layer parameter (leading `layers` axis included).
LAYER_PARAM_AXES = {
    "attn_norm": ("layers", "embed"),
    "q_proj": ("layers", "embed", "heads", "head_dim"),
    "k_proj": ("layers", "embed", "kv_heads", "head_dim"),
    "v_proj": ("layers", "embed", "kv_heads", "head_dim"),
    "o_proj": ("layers", "heads", "head_dim", "embed"),
    "q_bias": ("layers", "heads", "head_dim"),
    "k_bias": ("layers", "kv_heads", "head_dim"),
    "v_bias": ("layers", "kv_heads", "head_dim"),
    "q_norm": ("layers", "head_dim"),
    "k_norm": ("layers", "head_dim"),
    "o_bias": ("layers", "embed"),
    "mlp_norm": ("layers", "embed"),
    "post_attn_norm": ("layers", "embed"),
    "post_mlp_norm": ("layers", "embed"),
    "gate_proj": ("layers", "embed", "mlp"),
    "up_proj": ("layers", "embed", "mlp"),
    "down_proj": ("layers", "mlp", "embed"),
}
CACHE_AXES = ("layers", "batch", "kv_heads", "length", "head_dim")


class KVCache(NamedTuple):
  """Keys and values of every layer, indexed by sequence slot.

  k, v: [layers, batch, kv_heads, slots, head_dim] (head-major: see the module docstring),
  or, unstacked, a tuple of one [batch, kv_heads, slots, head_dim] array per layer.

  The decode loops carry the unstacked form (`unstack` once before the loop, `stack` once
  after): a layer then writes and reads an array of its own, where a slice of the stacked
  array is copied out at every token for the attention's matmuls (XLA:CPU: two copies
  of the layer's whole cache per layer and step; 39.5 against 42.5 ms a decode step at
  576 slots, `docs/pipelined_generation.md`).
  The scanned forward (prefill, fsdp) needs the stacked form.
  """

  k: jax.Array | tuple[jax.Array, ...]
  v: jax.Array | tuple[jax.Array, ...]

  @property
  def unstacked(self) -> bool:
    return isinstance(self.k, tuple)

  def unstack(self) -> "KVCache":
    """One array per layer (a copy of the cache)."""
    if self.unstacked:
      return self
    split = lambda c: tuple(constrain(c[i], CACHE_AXES[1:]) for i in range(c.shape[0]))
    return KVCache(split(self.k), split(self.v))

  def stack(self) -> "KVCache":
    """The stacked form (a copy of the cache)."""
    if not self.unstacked:
      return self
    join = lambda c: constrain(jnp.stack(c), CACHE_AXES)
    return KVCache(join(self.k), join(self.v))

  @classmethod
  def zeros(cls, config: TransformerConfig, batch: int, slots: int,
            num_layers: int | None = None) -> "KVCache":
    shape = (num_layers or config.num_layers, batch, config.num_kv_heads, slots,
             config.head_dim)
    zeros = jnp.zeros(shape, config.compute_dtype)
    return cls(constrain(zeros, CACHE_AXES), constrain(zeros, CACHE_AXES))


def default_positions(mask: jax.Array) -> jax.Array:
  """Position ids for a left-padded batch: count of real tokens before each slot."""
  # [batch, length]
  return jnp.maximum(jnp.cumsum(mask.astype(jnp.int32), axis=-1) - 1, 0)


def segment_positions(segment_ids: jax.Array) -> jax.Array:
  """Position ids for packed rows: the column's distance from its segment's first column.

  `segment_ids` int [batch, length], each segment contiguous; padding columns (id 0)
  get whatever their run gives, unread since no query attends to them.
  """
  length = segment_ids.shape[-1]
  columns = jnp.broadcast_to(jnp.arange(length), segment_ids.shape)
  starts = jnp.concatenate([jnp.ones_like(segment_ids[..., :1], bool),
                            segment_ids[..., 1:] != segment_ids[..., :-1]], axis=-1)
  # [batch, length]: the first column of the run each column belongs to.
  first = jax.lax.cummax(jnp.where(starts, columns, 0), axis=segment_ids.ndim - 1)
  return columns - first


def rope_inv_freq(config: TransformerConfig, local: bool = False) -> jax.Array:
  """Inverse RoPE frequencies [head_dim // 2], with the configured scaling applied.

  `local`: the frequencies of the "sliding_attention" layers (`rope_local_theta`,
  unscaled, when the config sets it).
  """
  dim = config.head_dim
  local = local and config.rope_local_theta is not None
  theta = config.rope_local_theta if local else config.rope_theta
  inv_freq = 1.0 / (theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))
  scaling = None if local else config.rope_scaling
  if not scaling:
    return inv_freq
  kind = scaling.get("rope_type", scaling.get("type", "default"))
  if kind == "default":
    return inv_freq
  factor = float(scaling["factor"])
  if kind == "linear":
    return inv_freq / factor
  # llama3: long wavelengths are slowed by `factor`, short ones kept, and the band in
  # between interpolated smoothly, so the model extends its context without retuning.
  low = float(scaling["low_freq_factor"])
  high = float(scaling["high_freq_factor"])
  original = float(scaling["original_max_position_embeddings"])
  wavelen = 2 * math.pi / inv_freq
  scaled = jnp.where(wavelen > original / low, inv_freq / factor, inv_freq)
  smooth = (original / wavelen - low) / (high - low)
  smoothed = (1 - smooth) * scaled / factor + smooth * scaled
  medium = (wavelen >= original / high) & (wavelen <= original / low)
  return jnp.where(medium, smoothed, scaled)


def rope_tables(config: TransformerConfig, positions: jax.Array, local: bool = False):
  """cos/sin tables [batch, length, head_dim // 2] for integer positions [batch, length]
  (one entry per rotated pair: the half-split convention uses each angle twice)."""
  angles = positions[..., None].astype(jnp.float32) * rope_inv_freq(config, local)
  return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
  """Rotates x [batch, length, heads, head_dim] (half-split convention, as in HF).

  Pair i is (x[i], x[i + head_dim // 2]); rotating the two halves directly computes
  HF's `x * cos + rotate_half(x) * sin` value for value, without materialising the
  rotated copy of x or the duplicated tables.
  """
  half = x.shape[-1] // 2
  x1 = x[..., :half].astype(jnp.float32)
  x2 = x[..., half:].astype(jnp.float32)
  cos, sin = cos[:, :, None, :], sin[:, :, None, :]
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def dense(x: jax.Array, w: jax.Array, num_in: int = 1) -> jax.Array:
  """`x [..., *in] @ w [*in, *out]` computed as one 2-D matmul `[tokens, in] x [in, out]`.

  Why not `jnp.einsum("ble,ef->blf", ...)`: XLA:CPU lowers the weight gradient of a
  3-D einsum through a loop fusion that transposes the `[batch, length, out]` cotangent
  element by element, and that fusion took longer than the matmuls themselves (the
  backward pass ran at 8x the forward's time instead of 2x; see docs/design_notes.md).
  Flattening the token dimensions first gives plain row-major matmuls in both passes.
  The reshapes merge a sharded leading dimension with unsharded ones, which keeps every
  `batch` / `heads` / `mlp` sharding.

  Args:
    x: [..., *in] activations.
    w: [*in, *out] weights, `num_in` contracting dimensions first.
    num_in: how many trailing dimensions of `x` (leading of `w`) are contracted.

  Returns:
    [..., *out].
  """
  in_shape, out_shape = w.shape[:num_in], w.shape[num_in:]
  if tuple(x.shape[x.ndim - num_in:]) != tuple(in_shape):
    raise ValueError(f"dense: input {x.shape} does not end with the weight's input "
                     f"dimensions {in_shape}.")
  lead = x.shape[:x.ndim - num_in]
  fan_in, fan_out = math.prod(in_shape), math.prod(out_shape)
  y = x.reshape(math.prod(lead), fan_in) @ w.reshape(fan_in, fan_out)
  return y.reshape(*lead, *out_shape)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, gemma: bool = False) -> jax.Array:
  """RMSNorm computed in f32, scaled in the input dtype (matches HF LLaMA / Qwen2).

  `gemma`: Gemma's variant, the weight applied as `1 + w` and in f32 before the cast back
  (a zero weight is the identity scale).
  """
  xf = x.astype(jnp.float32)
  normed = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
  if gemma:
    return (normed * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)
  return weight.astype(x.dtype) * normed.astype(x.dtype)


def window_allowed(allowed: jax.Array, query_slots: jax.Array, window: int) -> jax.Array:
  """`allowed` [batch, length, keys] narrowed to the last `window` slots of each query.

  A query at slot q keeps key slot k iff q - k < window (with the causal k <= q already
  in `allowed`): transformers' sliding-window rule, in slots. `query_slots` is [length]
  (every row at the same slots) or [batch, length].
  """
  keys = allowed.shape[-1]
  near = query_slots[..., None] - jnp.arange(keys) < window  # [(batch,) length, keys]
  return allowed & near


def _param(rngs: nnx.Rngs, shape, axes, dtype, init="normal") -> nnx.Param:
  if init == "ones":
    value = jnp.ones(shape, dtype)
  elif init == "zeros":
    value = jnp.zeros(shape, dtype)
  else:
    value = (0.02 * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)
  return nnx.Param(value, axes=axes)


class Layers(nnx.Module):
  """All transformer blocks, parameters stacked on a leading `layers` axis."""

  def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
    self.config = config
    c, n, dt = config, config.num_layers, config.storage_dtype
    e, h, k, d, f = c.embed_dim, c.num_heads, c.num_kv_heads, c.head_dim, c.mlp_dim
    shapes = {
        "attn_norm": (n, e), "q_proj": (n, e, h, d), "k_proj": (n, e, k, d),
        "v_proj": (n, e, k, d), "o_proj": (n, h, d, e), "mlp_norm": (n, e),
        "gate_proj": (n, e, f), "up_proj": (n, e, f), "down_proj": (n, f, e),
    }
    if c.qkv_bias:
      shapes.update(q_bias=(n, h, d), k_bias=(n, k, d), v_bias=(n, k, d))
    if c.out_bias:
      shapes.update(o_bias=(n, e))
    if c.qk_norm:
      shapes.update(q_norm=(n, d), k_norm=(n, d))
    if c.is_gemma:
      shapes.update(post_attn_norm=(n, e), post_mlp_norm=(n, e))
    # Gemma norms scale by 1 + w: zero is their identity.
    norm_init = "zeros" if c.is_gemma else "ones"
    for name, shape in shapes.items():
      init = norm_init if name.endswith("norm") else "zeros" if "bias" in name else "normal"
      setattr(self, name, _param(rngs, shape, LAYER_PARAM_AXES[name], dt, init))
    for target in c.lora_targets:
      a, b = lora.init_adapter(rngs.params(), target, shapes[target], c.lora_rank, dt)
      a_axes, b_axes = lora.adapter_axes(target, LAYER_PARAM_AXES[target])
      a_name, b_name = lora.names(target)
      setattr(self, a_name, lora.Adapter(a, axes=a_axes))
      setattr(self, b_name, lora.Adapter(b, axes=b_axes))

  def param_names(self) -> list[str]:
    names = [name for name in LAYER_PARAM_AXES if hasattr(self, name)]
    return names + [n for t in self.config.lora_targets for n in lora.names(t)]

  def per_layer(self) -> tuple[dict[str, jax.Array], ...]:
    """Each local layer's parameters as arrays of their own, `({name: [...]}, ...)`.

    Inside a loop that runs the layers many times (the decode loop), slicing one layer
    out of the stacked `[layers, ...]` arrays copies its weights at every step; XLA:CPU
    streams a layer scan's weights at about 0.6x the rate of arrays of their own
    (`python -m experiments.bench_decode_weights`: 8 layers of SmolLM2-135M's MLP, batch
    8). Taken once before the loop, these copies cost one read of the weights per call
    and the loop reads them in place.
    """
    params = {name: getattr(self, name).get_value() for name in self.param_names()}
    num_local = params["q_proj"].shape[0]
    return tuple({name: value[i] for name, value in params.items()}
                 for i in range(num_local))

  def __call__(self, h: jax.Array, positions: jax.Array, key_mask: jax.Array,
               cache: KVCache | None = None, slot: jax.Array | int = 0,
               cache_stride: int = 1, cache_offset: jax.Array | int = 0,
               layer_params: tuple[dict[str, jax.Array], ...] | None = None,
               layer_offset: jax.Array | int = 0,
               segment_ids: jax.Array | None = None,
               ) -> tuple[jax.Array, KVCache | None]:
    """Applies every (local) layer in order.

    Args:
      h: [batch, length, embed] residual stream entering the first local layer.
      positions: [batch, length] RoPE positions of the query tokens.
      key_mask: bool [batch, keys]: which keys hold real tokens. Without a cache the keys
        are the query tokens themselves (keys == length); with a cache they are the
        cache slots (keys == slots), and keys beyond the query's own slot are masked
        causally on top.
      cache: optional KV cache for the local layers, [local_layers, batch, slots, ...].
      slot: the cache slot of the first query token; the queries occupy
        [slot, slot + length). An int [batch] gives each row its own slot (the
        continuous-batching engine, whose rows are at different positions).
      cache_stride, cache_offset: local layer i reads and writes cache row
        `i * cache_stride + cache_offset` (default: row i). The pipelined decoder keeps
        all its micro-batches' caches in one array, [local_layers * M, mb, ...], and
        addresses micro-batch m with stride M and offset m, in place.
      layer_params: `per_layer()`'s arrays, taken outside the caller's loop: the layers
        then run one after another (unrolled) on them instead of scanning the stacked
        weights. The same blocks in the same order: equal results.
      layer_offset: the model-wide index of the first local layer (a pipeline stage's
        `stage * local_layers`): local layer i is of kind `config.layer_types[offset + i]`
        (its window and RoPE base).
      segment_ids: int [batch, length], no cache only: packed rows, a query attending
        only to keys of its own segment (0 = padding, never a key). Each segment is
        contiguous, so a sliding window in columns is its window in positions.

    Returns:
      The residual stream after the local layers, and the updated cache (or None).
    """
    c = self.config
    params = {name: getattr(self, name).get_value() for name in self.param_names()}
    num_local = len(layer_params) if layer_params is not None else params["q_proj"].shape[0]
    length = h.shape[1]
    keys = key_mask.shape[1]
    # [(batch,) length]: per-row slots when `slot` is [batch].
    query_slots = jnp.asarray(slot)[..., None] + jnp.arange(length)
    # [(batch,) length, keys]: causal in slot order; with left padding, slot order is time
    # order.
    causal = jnp.arange(keys) <= query_slots[..., None]
    # [batch, length, keys]
    allowed = causal & key_mask[:, None, :].astype(bool)
    if segment_ids is not None:
      if cache is not None:
        raise ValueError("Layers: segment_ids are for the no-cache forward only.")
      allowed = allowed & (segment_ids[:, :, None] == segment_ids[:, None, :])
    # What a layer attends with: (mask, cos, sin), one set per layer kind.
    full = (allowed, *rope_tables(c, positions))
    kinds = c.local_layers
    if c.has_local_layers:
      local = (allowed if c.sliding_window is None
               else window_allowed(allowed, query_slots, c.sliding_window),
               *rope_tables(c, positions, local=True))
    if not c.has_local_layers or all(kinds):
      # One kind for every layer: no per-layer choice to make.
      shared = local if c.has_local_layers else full
      flags = jnp.zeros((num_local,), bool)
    else:
      shared = None
      # bool [local_layers]: this call's slice of the model's static pattern.
      flags = jnp.asarray(kinds)[layer_offset + jnp.arange(num_local)]

    def block(carry, xs):
      # cache_k, cache_v: the stacked cache (layer `index` at row index * stride +
      # offset), or with `index` None one layer's own arrays.
      h, cache_k, cache_v = carry
      p, index, is_local = xs
      if shared is not None:
        mask, cos, sin = shared
      else:
        # Selected per layer in the scan (the pattern is data, the loop body one
        # program): selects over the mask and tables, tiny next to attention itself.
        mask, cos, sin = (jnp.where(is_local, a, b) for a, b in zip(local, full))
      row = None if index is None else index * cache_stride + cache_offset
      h, cache_k, cache_v = self._block(p, h, cos, sin, mask, cache_k, cache_v, row, slot)
      return (h, cache_k, cache_v), None

    if c.remat != "none":
      # Each layer's activations are recomputed in the backward pass instead of kept for
      # all layers at once; "save_matmuls" keeps the projections' outputs (the dots
      # without batch dimensions) and recomputes attention and elementwise work.
      policy = (None if c.remat == "full"
                else jax.checkpoint_policies.dots_with_no_batch_dims_saveable)
      block = jax.checkpoint(block, policy=policy, prevent_cse=False)

    cache_k = cache.k if cache is not None else None
    cache_v = cache.v if cache is not None else None
    if cache is not None and cache.unstacked:
      if layer_params is None or cache_stride != 1 or len(cache_k) != num_local:
        raise ValueError("Layers: an unstacked KV cache needs layer_params and one array "
                         "per local layer (no stride).")
      ks, vs = list(cache_k), list(cache_v)
      for index, p in enumerate(layer_params):
        (h, ks[index], vs[index]), _ = block((h, ks[index], vs[index]),
                                             (p, None, flags[index]))
      return h, KVCache(tuple(ks), tuple(vs))
    if layer_params is not None:
      for index, p in enumerate(layer_params):
        (h, cache_k, cache_v), _ = block((h, cache_k, cache_v), (p, index, flags[index]))
      return h, (KVCache(cache_k, cache_v) if cache is not None else None)
    (h, cache_k, cache_v), _ = jax.lax.scan(
        block, (h, cache_k, cache_v), (params, jnp.arange(num_local), flags),
        # 0: every layer unrolled (`TransformerConfig.scan_unroll`).
        unroll=min(c.scan_unroll or num_local, num_local))
    return h, (KVCache(cache_k, cache_v) if cache is not None else None)

  def _block(self, p, h, cos, sin, allowed, cache_k, cache_v, row, slot):
    """One transformer block on one layer's parameters `p` (the scan slice); its keys
    and values go to row `row` of the stacked cache, or with `row` None to the layer's
    own cache arrays."""
    c = self.config
    dt = c.compute_dtype
    w = {name: value.astype(dt) for name, value in p.items()}
    batch, length, _ = h.shape
    groups = c.num_heads // c.num_kv_heads

    gemma = c.is_gemma

    def project(x, name, num_in=1):
      y = dense(x, w[name], num_in)
      if name in c.lora_targets:
        a_name, b_name = lora.names(name)
        # [..., rank]: the adapter's narrow path, x @ A then @ B, never A @ B itself.
        low = dense(x, w[a_name], num_in)
        y = y + dense(low, w[b_name]) * jnp.asarray(c.lora_scale, y.dtype)
      return y

    x = rms_norm(h, w["attn_norm"], c.norm_eps, gemma)
    q = project(x, "q_proj")  # [batch, length, heads, head_dim]
    k = project(x, "k_proj")  # [batch, length, kv_heads, head_dim]
    v = project(x, "v_proj")
    if c.qkv_bias:
      q, k, v = q + w["q_bias"], k + w["k_bias"], v + w["v_bias"]
    if c.qk_norm:
      # Over head_dim, one weight shared by all heads, before RoPE: the cache then holds
      # normalised, rotated keys, exactly what every later query attends to.
      q = rms_norm(q, w["q_norm"], c.norm_eps, gemma)
      k = rms_norm(k, w["k_norm"], c.norm_eps, gemma)
    q = constrain(apply_rope(q, cos, sin), ("batch", "length", "heads", "head_dim"))
    k = constrain(apply_rope(k, cos, sin), ("batch", "length", "kv_heads", "head_dim"))
    v = constrain(v, ("batch", "length", "kv_heads", "head_dim"))

    if cache_k is not None:
      lead = () if row is None else (row,)

      def put(c, x):  # x [batch, length, kv_heads, head_dim]
        if jnp.ndim(slot) == 0:
          # [(1,) batch, kv_heads, length, head_dim]: the cache's head-major layout.
          x = x.swapaxes(1, 2).reshape((1,) * len(lead) + x.swapaxes(1, 2).shape)
          return jax.lax.dynamic_update_slice(c, x.astype(c.dtype), (*lead, 0, 0, slot, 0))
        # Row b's tokens go to its own slots [slot[b], slot[b] + length); slots past the
        # cache are dropped (a free engine slot may point there; its output is
        # discarded). The indexed positions [batch, length] lead and the kv_heads slice
        # follows, so the update is laid out as x is.
        rows = jnp.arange(batch)[:, None]  # [batch, 1]
        cols = slot[:, None] + jnp.arange(length)  # [batch, length]
        return c.at[(*lead, rows, slice(None), cols)].set(x.astype(c.dtype), mode="drop")

      cache_k, cache_v = put(cache_k, k), put(cache_v, v)
      # [batch, kv_heads, slots, head_dim]
      keys, values = (cache_k, cache_v) if row is None else (cache_k[row], cache_v[row])
    else:
      keys, values = k.swapaxes(1, 2), v.swapaxes(1, 2)  # [batch, kv_heads, length, head_dim]

    q = q.reshape(batch, length, c.num_kv_heads, groups, c.head_dim)
    # [batch, length, kv_heads, groups, head_dim]
    scale = None if c.query_pre_attn_scalar is None else c.attention_scale
    attn = attention_lib.attention(q, keys.astype(dt), values.astype(dt), allowed,
                                   impl=c.attention, block_size=c.attention_block_size,
                                   scale=scale)
    attn = attn.reshape(batch, length, c.num_heads, c.head_dim)
    out = project(attn, "o_proj", num_in=2)
    if c.out_bias:
      out = out + w["o_bias"]
    if gemma:  # Gemma normalises each branch's output before adding it back
      out = rms_norm(out, w["post_attn_norm"], c.norm_eps, True)
    h = constrain(h + out, ("batch", "length", "embed"))

    x = rms_norm(h, w["mlp_norm"], c.norm_eps, gemma)
    gate = project(x, "gate_proj")
    up = project(x, "up_proj")
    # GELU with the tanh approximation: transformers' gelu_pytorch_tanh.
    act = jax.nn.gelu(gate, approximate=True) if gemma else jax.nn.silu(gate)
    hidden = constrain(act * up, ("batch", "length", "mlp"))
    out = project(hidden, "down_proj")
    if gemma:
      out = rms_norm(out, w["post_mlp_norm"], c.norm_eps, True)
    h = h + out
    return constrain(h, ("batch", "length", "embed")), cache_k, cache_v


class Transformer(nnx.Module):
  """Embedding, stacked layers, final norm, and one head (LM, value or score).

  Calling the model runs the full forward pass:
    `model(tokens, attention_mask=None, positions=None)` -> `[batch, length, vocab]`
    f32 logits for an LM head, or `[batch, length]` f32 scalars for a value/score head.
  """

  def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
    self.config = config
    dt = config.storage_dtype
    e, vocab = config.embed_dim, config.vocab_size
    self.embedding = _param(rngs, (vocab, e), ("vocab", "embed"), dt)
    self.layers = Layers(config, rngs=rngs)
    self.final_norm = _param(rngs, (e,), ("embed",), dt,
                             "zeros" if config.is_gemma else "ones")
    if config.head == "lm":
      self.lm_head = (None if config.tie_embeddings
                      else _param(rngs, (e, vocab), ("embed", "vocab"), dt))
    else:
      # One scalar per token: V(s_t) for the critic, r(x, y_<=t) for the reward model.
      self.scalar_head = _param(rngs, (e, 1), ("embed", None), dt)

  def embed(self, tokens: jax.Array) -> jax.Array:
    """[batch, length] int -> [batch, length, embed] in the compute dtype."""
    dt = self.config.compute_dtype
    h = jnp.take(self.embedding.get_value(), tokens, axis=0).astype(dt)
    if self.config.is_gemma:
      # sqrt(embed) rounded to the compute dtype first, as transformers does (in bf16
      # sqrt(640) = 25.30 becomes 25.25).
      h = h * jnp.asarray(math.sqrt(self.config.embed_dim), jnp.float32).astype(dt)
    return constrain(h, ("batch", "length", "embed"))

  def head(self, h: jax.Array) -> jax.Array:
    """Final norm and head: [batch, length, embed] -> logits [.., vocab] or scalars."""
    c = self.config
    x = rms_norm(h, self.final_norm.get_value(), c.norm_eps, c.is_gemma)
    dt = c.compute_dtype
    if c.head == "lm":
      kernel = (self.embedding.get_value().T if c.tie_embeddings else self.lm_head.get_value())
      logits = dense(x, kernel.astype(dt)).astype(jnp.float32)
      return constrain(logits, ("batch", "length", "vocab"))
    out = dense(x, self.scalar_head.get_value().astype(dt))
    return out[..., 0].astype(jnp.float32)

  def __call__(self, tokens: jax.Array, attention_mask: jax.Array | None = None,
               positions: jax.Array | None = None,
               segment_ids: jax.Array | None = None) -> jax.Array:
    return self.head(self.hidden(tokens, attention_mask, positions, segment_ids))

  def hidden(self, tokens: jax.Array, attention_mask: jax.Array | None = None,
             positions: jax.Array | None = None,
             segment_ids: jax.Array | None = None) -> jax.Array:
    """The residual stream after the last layer, [batch, length, embed] (before the head:
    a caller that needs few positions slices first and applies `head` to those only).

    With `segment_ids` (int [batch, length], 0 = padding) the rows are packed: each
    segment is a sequence of its own (causal within itself, blind to its neighbours),
    `attention_mask` defaults to the non-zero ids and `positions` restart per segment.
    """
    if attention_mask is None:
      attention_mask = (segment_ids != 0 if segment_ids is not None
                        else jnp.ones(tokens.shape, bool))
    if positions is None:
      positions = (segment_positions(segment_ids) if segment_ids is not None
                   else default_positions(attention_mask))
    h, _ = self.layers(self.embed(tokens), positions, attention_mask,
                       segment_ids=segment_ids)
    return h

  def forward_cached(self, tokens: jax.Array, positions: jax.Array, key_mask: jax.Array,
                     cache: KVCache, slot: jax.Array | int,
                     layer_params: tuple[dict[str, jax.Array], ...] | None = None,
                     last_only: bool = False) -> tuple[jax.Array, KVCache]:
    """Forward over `tokens` placed at cache slots [slot, slot + length).

    Used by prefill (the whole prompt at slot 0) and by each decode step (one token).

    Args:
      tokens: [batch, length] int.
      positions: [batch, length] RoPE positions.
      key_mask: bool [batch, slots], True where a slot holds (or will hold) a real token.
      cache: the model's KVCache with `slots` columns.
      slot: first slot written by these tokens.
      layer_params: `self.layers.per_layer()`, taken once outside a decode loop.
      last_only: apply the head at the last position only (a prefill needs no other:
        an LM head over every prompt position is [batch, length, vocab] f32 for nothing).

    Returns:
      Head outputs for `tokens` ([batch, 1, ...] with `last_only`) and the updated cache.
    """
    h, cache = self.layers(self.embed(tokens), positions, key_mask, cache, slot,
                           layer_params=layer_params)
    return self.head(h[:, -1:] if last_only else h), cache


def init_model(config: TransformerConfig, seed: int = 0) -> Transformer:
  """Builds a randomly initialised model (the usual entry point for tests and tiny runs)."""
  return Transformer(config, rngs=nnx.Rngs(seed))


def with_execution(graphdef: nnx.GraphDef, params: nnx.State, **changes) -> nnx.GraphDef:
  """The same model computed differently: `changes` of execution fields only.

  A stage uses it to choose its own attention implementation and remat policy for a
  model it was handed; parameters (and so checkpoints) are unaffected.
  """
  bad = sorted(set(changes) - set(EXECUTION_FIELDS))
  if bad:
    raise ValueError(f"with_execution changes execution fields {EXECUTION_FIELDS} only, "
                     f"got {bad}.")
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
  config = nnx.merge(graphdef, abstract).config.replace(**changes)
  return nnx.split(nnx.eval_shape(lambda: init_model(config)))[0]


def param_axes(model: nnx.Module):
  """The logical-axes pytree matching `nnx.state(model, nnx.Param)` (tuples as leaves)."""
  state = nnx.state(model, nnx.Param)
  return jax.tree.map(lambda v: v.get_metadata()["axes"], state,
                      is_leaf=lambda x: isinstance(x, nnx.Variable))
