"""Model size presets for projections: LLaMA-2 shapes from their public Hugging Face
`config.json`s (meta-llama/Llama-2-{7b,13b,70b}-hf; 34B was not released as LLaMA-2, so
its shape is Code Llama 34B's, codellama/CodeLlama-34b-hf), in bfloat16."""

from __future__ import annotations

from pipe_rlhf_jax.models.config import TransformerConfig

_COMMON = dict(vocab_size=32000, dtype="bfloat16", param_dtype="bfloat16", norm_eps=1e-5,
               max_position_embeddings=4096)

PRESETS: dict[str, dict] = {
    # hidden_size, num_hidden_layers, num_attention_heads, num_key_value_heads,
    # intermediate_size of each config.json; head_dim = hidden / heads.
    "llama2-7b": dict(embed_dim=4096, num_layers=32, num_heads=32, num_kv_heads=32,
                      head_dim=128, mlp_dim=11008),
    "llama2-13b": dict(embed_dim=5120, num_layers=40, num_heads=40, num_kv_heads=40,
                       head_dim=128, mlp_dim=13824),
    "llama2-34b": dict(embed_dim=8192, num_layers=48, num_heads=64, num_kv_heads=8,
                       head_dim=128, mlp_dim=22016, rope_theta=1e6, vocab_size=32000),
    "llama2-70b": dict(embed_dim=8192, num_layers=80, num_heads=64, num_kv_heads=8,
                       head_dim=128, mlp_dim=28672),
}


def model(name: str) -> TransformerConfig:
  """The preset `name` as a TransformerConfig (an LM head)."""
  if name not in PRESETS:
    raise ValueError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}.")
  return TransformerConfig(**{**_COMMON, **PRESETS[name]})
