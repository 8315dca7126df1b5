"""Model size presets for projections: the published shapes of `models/shapes.py` (the
LLaMA-2 family, LLaMA 3.2, Qwen2.5 / Qwen3, SmolLM2, Mistral), in bfloat16."""

from __future__ import annotations

from pipe_rlhf_jax.models import shapes
from pipe_rlhf_jax.models.config import TransformerConfig

PRESETS = shapes.SHAPES


def model(name: str) -> TransformerConfig:
  """The preset `name` as a TransformerConfig (an LM head, bf16 compute and storage)."""
  if name not in PRESETS:
    raise ValueError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}.")
  return shapes.config(name, dtype="bfloat16")
