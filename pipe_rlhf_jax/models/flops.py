"""Analytic work counts of the transformer: FLOPs of forward passes and bytes of decoding.

What benchmarks divide measured times by (achieved FLOP/s, decode bytes/s) and what a cost
model prices. Counts are of matrix multiplications (2 FLOPs per multiply-add); norms,
RoPE and softmax are left out (a few % at these widths). A backward pass is counted as
twice the forward (once with LoRA adapters: no base weight gradients); full per-layer
remat adds one more forward of the layers. What the
matmul counts leave out is counted as activation elements (`forward_elements`), which the
planner prices as traffic over the memory bandwidth.
"""

from __future__ import annotations

from pipe_rlhf_jax.models.config import TransformerConfig


def layer_matmul_params(cfg: TransformerConfig) -> int:
  """Weights one token multiplies through in one layer (q, k, v, o, gate, up, down, and
  their LoRA adapters' A and B)."""
  e, h, k, d, f = cfg.embed_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.mlp_dim
  adapters = cfg.num_adapter_params() // cfg.num_layers
  return e * (h + 2 * k) * d + h * d * e + 3 * e * f + adapters


def head_params(cfg: TransformerConfig) -> int:
  return cfg.embed_dim * (cfg.vocab_size if cfg.head == "lm" else 1)


def forward_flops(cfg: TransformerConfig, batch: int, length: int, context: int | None = None,
                  head_positions: int | None = None) -> float:
  """FLOPs of one forward pass of `batch` x `length` new tokens.

  Args:
    context: keys each query attends to on average; default causal over `length`
      (length / 2). A decode step over a cache of S slots has length 1, context S.
    head_positions: positions the head is applied to (default all `length`).
  """
  context = length / 2 if context is None else context
  head_positions = length if head_positions is None else head_positions
  per_token = 2 * cfg.num_layers * layer_matmul_params(cfg)
  # Q.K and P.V: 2 x 2 x heads x head_dim multiply-adds per (query, key) pair per layer.
  attention = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * context
  return batch * (length * (per_token + attention) + head_positions * 2 * head_params(cfg))


def layer_elements(cfg: TransformerConfig, context: float) -> float:
  """Activation elements one layer writes per token outside its matmuls: the two norms'
  and the two residual adds' outputs (4 x embed), RoPE on the query and key heads, the
  attention probabilities over `context` keys per query head (the softmax), and the
  gated MLP's activation and product (2 x mlp)."""
  return (4 * cfg.embed_dim + (cfg.num_heads + cfg.num_kv_heads) * cfg.head_dim
          + cfg.num_heads * context + 2 * cfg.mlp_dim)


def forward_elements(cfg: TransformerConfig, batch: int, length: int,
                     context: float | None = None, head_positions: int | None = None
                     ) -> float:
  """Activation elements of one forward pass outside its matmuls (`layer_elements` per
  layer per token, the final norm, and the head's log-softmax over the vocabulary at
  `head_positions`); arguments as `forward_flops`. The non-matmul work a step does
  (elementwise ops, softmax, norms, RoPE, the log-softmax) is roughly proportional."""
  context = length / 2 if context is None else context
  head_positions = length if head_positions is None else head_positions
  head = cfg.vocab_size if cfg.head == "lm" else 1
  return batch * (length * (cfg.num_layers * layer_elements(cfg, context) + cfg.embed_dim)
                  + head_positions * head)


def train_flops(cfg: TransformerConfig, batch: int, length: int, remat: str = "none",
                head_positions: int | None = None) -> float:
  """Forward + backward of one pass (backward = 2 forwards; full remat re-runs the layers).

  With LoRA adapters the backward computes the activations' gradients (one forward) and
  the adapters' weight gradients only: no base weight's gradient (the other forward).
  """
  fwd = forward_flops(cfg, batch, length, head_positions=head_positions)
  extra = forward_flops(cfg, batch, length, head_positions=0) if remat == "full" else 0.0
  if cfg.lora_rank:
    return 2 * fwd + 2 * batch * length * cfg.num_adapter_params() + extra
  return 3 * fwd + extra


def train_elements(cfg: TransformerConfig, batch: int, length: int, remat: str = "none",
                   head_positions: int | None = None) -> float:
  """Activation elements the update's passes are counted on: the forward's
  (`forward_elements`; the passes price forward and backward, about three forwards of
  work), plus a third of the layers' under full remat, which re-runs one forward of the
  layers (as `train_flops`)."""
  fwd = forward_elements(cfg, batch, length, head_positions=head_positions)
  extra = forward_elements(cfg, batch, length, head_positions=0) if remat == "full" else 0.0
  return fwd + extra / 3


def decode_step_bytes(cfg: TransformerConfig, batch: int, context: int) -> float:
  """Bytes one decode step must read: every weight once, plus the KV cache it attends to."""
  param_bytes = 2 if cfg.param_dtype in ("bfloat16", "float16") else 4
  act_bytes = 2 if cfg.dtype in ("bfloat16", "float16") else 4
  weights = (cfg.num_layers * layer_matmul_params(cfg) + head_params(cfg)) * param_bytes
  kv = 2 * cfg.num_layers * batch * context * cfg.num_kv_heads * cfg.head_dim * act_bytes
  return weights + kv
