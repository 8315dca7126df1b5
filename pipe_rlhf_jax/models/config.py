"""Transformer hyper-parameters: one frozen dataclass for the LLaMA 2/3, Qwen2/3,
Mistral and Gemma 3 family.

This module owns the description of a model's shape and numerics, its validation, and the
embedded default sizes. Conversion from and to Hugging Face `config.json` lives in
`models/hf_config.py`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from flax.core import FrozenDict
import jax.numpy as jnp

ARCHITECTURES = ("llama", "qwen2", "qwen3", "mistral", "gemma3")
# Attention kind of one layer (Hugging Face's `layer_types` names): "sliding_attention"
# layers see the last `sliding_window` slots only and use the local RoPE base.
LAYER_TYPES = ("full_attention", "sliding_attention")
HEADS = ("lm", "value", "score")
ROPE_TYPES = ("default", "linear", "llama3")
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
# How attention is computed (equal results within float tolerance; see
# models/attention.py): "auto" picks per backend and length.
ATTENTION_IMPLS = ("auto", "dense", "blockwise", "dot_product")
# What each layer keeps for the backward pass: everything ("none"), nothing ("full":
# recompute the layer), or the projection matmul outputs ("save_matmuls").
REMAT_POLICIES = ("none", "full", "save_matmuls")
# Execution fields: how the model is computed, never what. They are not exported to
# Hugging Face and a stage may change them (`with_execution`).
EXECUTION_FIELDS = ("attention", "attention_block_size", "remat", "logits_chunk_size",
                    "scan_unroll")


def dtype_name(value: Any, field: str = "dtype") -> str:
  """The canonical name of a supported dtype given as a name or a dtype object.

  Accepts what the JAX ecosystem passes around (`jnp.bfloat16`, `np.dtype("float32")`,
  `"bfloat16"`), so configs stay plain strings and Python callers need not convert.
  """
  try:
    name = jnp.dtype(value).name if not isinstance(value, str) else value
  except TypeError:
    name = repr(value)
  if name not in DTYPES:
    raise ValueError(f"{field}={value!r}; choose one of {sorted(DTYPES)} (a name or the "
                     "jnp dtype).")
  return name


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
  """Shape and numerics of a decoder-only transformer.

  Attributes:
    vocab_size: rows of the embedding table (and columns of the LM head).
    embed_dim: width of the residual stream.
    num_layers: transformer blocks, stored stacked along a leading `layers` axis.
    num_heads: query heads.
    num_kv_heads: key/value heads (grouped-query attention when < num_heads).
    head_dim: width of one attention head.
    mlp_dim: hidden width of the gated MLP (SwiGLU; GELU-tanh gated for Gemma 3).
    norm_eps: RMSNorm epsilon.
    rope_theta: RoPE base frequency.
    rope_scaling: None, or a dict with "rope_type" in ROPE_TYPES and its parameters
      ("factor"; for llama3 also "low_freq_factor", "high_freq_factor",
      "original_max_position_embeddings").
    tie_embeddings: the LM head reuses the embedding table.
    qkv_bias: biases on the q/k/v projections (Qwen2).
    out_bias: bias on the attention output projection (LLaMA `attention_bias=True`).
    qk_norm: RMSNorm over head_dim on each query and key head, after the projection
      (and its bias) and before RoPE, with one weight per layer shared by the heads
      (Qwen3).
    architecture: one of ARCHITECTURES; decides the Hugging Face export class. "gemma3"
      also selects Gemma's block: RMSNorm weights applied as `1 + w` (normalised and
      scaled in f32), a norm after attention and after the MLP besides the two before,
      a GELU-tanh gated MLP, and embeddings scaled by sqrt(embed_dim) (rounded to the
      compute dtype, as transformers does).
    sliding_window: keys a "sliding_attention" layer sees, counted in cache slots: a
      query at slot q sees slot k iff k <= q and q - k < sliding_window. None: no window
      (every layer attends to the whole causal context).
    layer_types: one of LAYER_TYPES per layer, or None: every layer "sliding_attention"
      when `sliding_window` is set (Mistral), else "full_attention".
    rope_local_theta: RoPE base of the "sliding_attention" layers (Gemma 3's
      `rope_local_base_freq`, unscaled); None: they share the global RoPE.
    query_pre_attn_scalar: attention scores are scaled by `query_pre_attn_scalar ** -0.5`
      (Gemma 3); None: `head_dim ** -0.5`.
    head: "lm" (logits over the vocabulary), "value" (critic: one scalar per token) or
      "score" (reward model: one scalar per token, read at the last valid token).
    dtype: compute dtype name ("float32" / "bfloat16").
    param_dtype: storage dtype name of the parameters.
    max_position_embeddings: the context length the model was trained for (recorded for
      export; RoPE itself has no table to outgrow).
    bos_token_id, eos_token_id, pad_token_id: recorded for export and generation defaults.
    attention: one of ATTENTION_IMPLS (execution only).
    attention_block_size: keys per block of the blockwise attention (execution only).
    remat: one of REMAT_POLICIES, applied to each layer inside the layer scan (execution
      only; training wants it at long lengths, generation never needs it).
    logits_chunk_size: positions per chunk when log-probs are read from the LM head
      (`stages.common.completion_logprobs`); 0 = all at once (execution only).
    scan_unroll: layers per iteration of the layer scan (execution only). 0 (the
      default) unrolls every layer, so that each layer's weights are sliced and its
      gradients written at static offsets instead of through dynamic slices and updates
      of the stacked arrays: faster steps, longer compiles (the layer is compiled once
      per layer). An integer >= 1 asks for a loop of that many layers per iteration
      (1: a loop over the stacked layers, the shortest compile).
    lora_rank: 0 (no adapters) or the rank of the LoRA adapters on `lora_targets`
      (`models/lora.py`): a pair of weights beside each adapted projection, trained while
      the base stays frozen.
    lora_alpha: the adapters' scale is `lora_alpha / lora_rank` (peft's convention).
    lora_targets: the adapted projections, a subset of `models.lora.TARGETS`.
  """

  vocab_size: int
  embed_dim: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  mlp_dim: int
  norm_eps: float = 1e-5
  rope_theta: float = 10000.0
  rope_scaling: Mapping[str, Any] | None = None
  tie_embeddings: bool = False
  qkv_bias: bool = False
  out_bias: bool = False
  qk_norm: bool = False
  architecture: str = "llama"
  head: str = "lm"
  dtype: str = "float32"
  param_dtype: str = "float32"
  max_position_embeddings: int = 2048
  sliding_window: int | None = None
  layer_types: tuple[str, ...] | None = None
  rope_local_theta: float | None = None
  query_pre_attn_scalar: float | None = None
  bos_token_id: int | None = None
  eos_token_id: int | None = None
  pad_token_id: int | None = None
  attention: str = "auto"
  attention_block_size: int = 512
  remat: str = "none"
  logits_chunk_size: int = 0
  scan_unroll: int = 0
  lora_rank: int = 0
  lora_alpha: float = 16.0
  lora_targets: tuple[str, ...] = ()

  def __post_init__(self):
    if self.rope_scaling is not None and not isinstance(self.rope_scaling, FrozenDict):
      # Hashable, so the config (part of every graphdef) can key jit caches.
      object.__setattr__(self, "rope_scaling", FrozenDict(self.rope_scaling))
    if self.layer_types is not None and not isinstance(self.layer_types, tuple):
      object.__setattr__(self, "layer_types", tuple(self.layer_types))
    if not isinstance(self.lora_targets, tuple):
      object.__setattr__(self, "lora_targets", tuple(self.lora_targets))
    self.validate()

  def validate(self) -> None:
    """Raises ValueError naming the first inconsistent field."""
    for name in ("vocab_size", "embed_dim", "num_layers", "num_heads", "num_kv_heads",
                 "head_dim", "mlp_dim"):
      value = getattr(self, name)
      if not isinstance(value, int) or value < 1:
        raise ValueError(f"model.{name} must be a positive integer, got {value!r}.")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(
          f"model.num_heads={self.num_heads} must be a multiple of "
          f"model.num_kv_heads={self.num_kv_heads} (grouped-query attention).")
    for name in ("tie_embeddings", "qkv_bias", "out_bias", "qk_norm"):
      if not isinstance(getattr(self, name), bool):
        raise ValueError(f"model.{name} must be True or False, got {getattr(self, name)!r}.")
    if self.architecture not in ARCHITECTURES:
      raise ValueError(
          f"model.architecture={self.architecture!r}; choose one of {ARCHITECTURES}.")
    if self.head not in HEADS:
      raise ValueError(f"model.head={self.head!r}; choose one of {HEADS}.")
    for name in ("dtype", "param_dtype"):
      # Stored as names: hashable, JSON-serialisable, equal whichever form was given.
      object.__setattr__(self, name, dtype_name(getattr(self, name), f"model.{name}"))
    if self.rope_scaling is not None:
      kind = self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default"))
      if kind not in ROPE_TYPES:
        raise ValueError(
            f"model.rope_scaling rope_type={kind!r} is not supported; supported: "
            f"{ROPE_TYPES}. Other scalings change the math and are refused, not ignored.")
    if self.attention not in ATTENTION_IMPLS:
      raise ValueError(f"model.attention={self.attention!r}; choose one of {ATTENTION_IMPLS}.")
    if self.remat not in REMAT_POLICIES:
      raise ValueError(f"model.remat={self.remat!r}; choose one of {REMAT_POLICIES}.")
    if isinstance(self.attention_block_size, bool) or not isinstance(
        self.attention_block_size, int) or self.attention_block_size < 1:
      raise ValueError(f"model.attention_block_size={self.attention_block_size!r} must be "
                       "an integer >= 1.")
    if isinstance(self.logits_chunk_size, bool) or not isinstance(
        self.logits_chunk_size, int) or self.logits_chunk_size < 0:
      raise ValueError(f"model.logits_chunk_size={self.logits_chunk_size!r} must be an "
                       "integer >= 0 (0: no chunking).")
    if isinstance(self.scan_unroll, bool) or not isinstance(
        self.scan_unroll, int) or self.scan_unroll < 0:
      raise ValueError(f"model.scan_unroll={self.scan_unroll!r} must be an integer >= 0 "
                       "(0: every layer unrolled; n >= 1: a loop of n layers per "
                       "iteration).")
    if self.norm_eps <= 0:
      raise ValueError(f"model.norm_eps must be > 0, got {self.norm_eps}.")
    if self.sliding_window is not None and (
        isinstance(self.sliding_window, bool) or not isinstance(self.sliding_window, int)
        or self.sliding_window < 1):
      raise ValueError(f"model.sliding_window={self.sliding_window!r} must be None or an "
                       "integer >= 1.")
    if self.layer_types is not None:
      if len(self.layer_types) != self.num_layers:
        raise ValueError(f"model.layer_types has {len(self.layer_types)} entries for "
                         f"num_layers={self.num_layers}.")
      bad = sorted(set(self.layer_types) - set(LAYER_TYPES))
      if bad:
        raise ValueError(f"model.layer_types contains {bad}; choose from {LAYER_TYPES}.")
    for name in ("rope_local_theta", "query_pre_attn_scalar"):
      value = getattr(self, name)
      if value is not None and not value > 0:
        raise ValueError(f"model.{name}={value!r} must be None or > 0.")
    if isinstance(self.lora_rank, bool) or not isinstance(self.lora_rank, int) or (
        self.lora_rank < 0):
      raise ValueError(f"lora.rank={self.lora_rank!r} must be an integer >= 0 (0: no "
                       "adapters).")
    if self.lora_rank:
      from pipe_rlhf_jax.models.lora import TARGETS
      bad = sorted(set(self.lora_targets) - set(TARGETS))
      if bad or not self.lora_targets:
        raise ValueError(f"lora.targets={list(self.lora_targets)}: name at least one of "
                         f"{TARGETS}.")
      if not self.lora_alpha > 0:
        raise ValueError(f"lora.alpha={self.lora_alpha!r} must be > 0.")
    elif self.lora_targets:
      raise ValueError(f"lora.targets={list(self.lora_targets)} without lora.rank: set a "
                       "rank > 0, or no targets.")

  @property
  def is_gemma(self) -> bool:
    """Gemma's block: `1 + w` norms, four norms per layer, GELU-tanh, scaled embeddings."""
    return self.architecture == "gemma3"

  @property
  def local_layers(self) -> tuple[bool, ...]:
    """Per layer: True where it is a "sliding_attention" layer."""
    if self.layer_types is None:
      return (self.sliding_window is not None,) * self.num_layers
    return tuple(kind == "sliding_attention" for kind in self.layer_types)

  @property
  def has_local_layers(self) -> bool:
    """Some layer attends differently from a global one (a window or its own RoPE)."""
    return any(self.local_layers) and (self.sliding_window is not None
                                       or self.rope_local_theta is not None)

  @property
  def attention_scale(self) -> float:
    """The factor on q.k scores."""
    scalar = self.head_dim if self.query_pre_attn_scalar is None else self.query_pre_attn_scalar
    return float(scalar) ** -0.5

  @property
  def lora_scale(self) -> float:
    """The factor on each adapter's output, alpha / rank."""
    return float(self.lora_alpha) / self.lora_rank if self.lora_rank else 0.0

  @property
  def base(self) -> "TransformerConfig":
    """The same model without adapters (the reference policy, the merged export)."""
    return self.replace(lora_rank=0, lora_targets=())

  def num_adapter_params(self) -> int:
    """Adapter weights (0 without adapters): rank x (fan_in + fan_out) per projection."""
    if not self.lora_rank:
      return 0
    e, f, h, k, d = (self.embed_dim, self.mlp_dim, self.num_heads, self.num_kv_heads,
                     self.head_dim)
    fans = {"q_proj": (e, h * d), "k_proj": (e, k * d), "v_proj": (e, k * d),
            "o_proj": (h * d, e), "gate_proj": (e, f), "up_proj": (e, f),
            "down_proj": (f, e)}
    return self.num_layers * self.lora_rank * sum(sum(fans[t]) for t in self.lora_targets)

  @property
  def compute_dtype(self):
    return DTYPES[self.dtype]

  @property
  def storage_dtype(self):
    return DTYPES[self.param_dtype]

  def replace(self, **changes) -> "TransformerConfig":
    return dataclasses.replace(self, **changes)

  def num_params(self) -> int:
    """Parameter count (for the planner and for logging)."""
    e, f, h, k, d = (self.embed_dim, self.mlp_dim, self.num_heads, self.num_kv_heads,
                     self.head_dim)
    per_layer = e * d * (h + 2 * k) + h * d * e + 3 * e * f + 2 * e
    per_layer += d * (h + 2 * k) if self.qkv_bias else 0
    per_layer += e if self.out_bias else 0
    per_layer += 2 * d if self.qk_norm else 0
    per_layer += 2 * e if self.is_gemma else 0
    total = self.vocab_size * e + self.num_layers * per_layer + e
    if self.head == "lm" and not self.tie_embeddings:
      total += e * self.vocab_size
    elif self.head != "lm":
      total += e
    return total

  def num_param_arrays(self) -> tuple[int, int]:
    """(arrays per layer, arrays outside the layers): how many separate weights a
    collective over sharded parameters moves one by one (the planner prices each one's
    latency)."""
    per_layer = (9 + (3 if self.qkv_bias else 0) + (1 if self.out_bias else 0)
                 + (2 if self.qk_norm else 0) + (2 if self.is_gemma else 0))
    head = 0 if self.head == "lm" and self.tie_embeddings else 1
    return per_layer, 2 + head  # embedding and final norm, and the head


def tiny_config(vocab_size: int = 264, **overrides) -> TransformerConfig:
  """The embedded default: a 4-layer GQA model that trains in minutes on 2 CPU cores."""
  base = dict(vocab_size=vocab_size, embed_dim=128, num_layers=4, num_heads=4,
              num_kv_heads=2, head_dim=32, mlp_dim=384, rope_theta=10000.0,
              max_position_embeddings=256)
  base.update(overrides)
  return TransformerConfig(**base)
