"""Published model shapes: the one table of named Hugging Face configurations.

This module owns `SHAPES`, the `config.json` fields that fix the shape and numerics of
named published models (sizes, RoPE, norm eps, tying, biases, special-token ids), each
with the repository it was read from and the special tokens of its tokenizer. The
planner's size presets (`planner/presets.py`) and the random-weight checkpoint writer
(`models/random_checkpoint.py`) both read it; neither keeps a second list.

The fields are the published values, verified against each repository's config.json:
- smollm2-135m (HuggingFaceTB/SmolLM2-135M): LLaMA, 30 layers, hidden 576, 9 / 3 heads,
  mlp 1536, vocab 49152, tied, rope_theta 1e5, eps 1e-5, 8192 positions.
- qwen2.5-0.5b (Qwen/Qwen2.5-0.5B): Qwen2, 24 layers, hidden 896, 14 / 2 heads, mlp 4864,
  vocab 151936, tied, q/k/v bias, rope_theta 1e6, eps 1e-6, 32768 positions.
- qwen3-0.6b (Qwen/Qwen3-0.6B): Qwen3, 28 layers, hidden 1024, 16 / 8 heads, head_dim
  128, mlp 3072, vocab 151936, tied, q/k norm, rope_theta 1e6, eps 1e-6, 40960 positions.
- llama-3.2-1b (meta-llama/Llama-3.2-1B): LLaMA, 16 layers, hidden 2048, 32 / 8 heads,
  mlp 8192, vocab 128256, tied, llama3 RoPE (factor 32, low 1, high 4, original 8192),
  rope_theta 5e5, eps 1e-5, 131072 positions.
- mistral-7b-v0.3 (mistralai/Mistral-7B-v0.3): Mistral, 32 layers, hidden 4096, 32 / 8
  heads, mlp 14336, vocab 32768, untied, rope_theta 1e6, eps 1e-5, 32768 positions, no
  sliding window.
- gemma3-270m (google/gemma-3-270m): Gemma 3 text, 18 layers, hidden 640, 4 / 1 heads,
  head_dim 256, mlp 2048, vocab 262144, tied, q/k norm, query_pre_attn_scalar 256,
  layers 5 local (sliding window 512, RoPE base 1e4) to 1 global (RoPE base 1e6, no
  scaling), eps 1e-6, 32768 positions, pad 0 / eos 1 / bos 2. The published config
  lists `layer_types` one by one; here the same pattern is transformers' rule
  (`sliding_window_pattern` 6), so a variant with fewer layers keeps it.
- llama2-7b / 13b / 70b (meta-llama/Llama-2-*-hf) and llama2-34b (Code Llama 34B's shape,
  codellama/CodeLlama-34b-hf: 34B was not released as LLaMA-2): vocab 32000, eps 1e-5.

Usage:
  `hf_config("qwen3-0.6b")` is the config.json dict; `config("qwen3-0.6b",
  dtype="bfloat16")` the TransformerConfig, through `models.hf_config.config_from_hf`, so the
  table is held to the same loading policy as a downloaded checkpoint.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from pipe_rlhf_jax.models.config import TransformerConfig


@dataclasses.dataclass(frozen=True)
class Shape:
  """One published model's configuration.

  Attributes:
    source: the Hugging Face repository the fields were read from.
    fields: its config.json fields that matter to the math and to generation.
    special_tokens: the tokenizer's special tokens that the config's ids point at, as
      {token: id}.
    bos_token, eos_token, pad_token: which of `special_tokens` the tokenizer config names
      for each role (None: the published tokenizer has none).
    chat_format: the message format of a chat model ("chatml"), None for a base model.
  """

  source: str
  fields: Mapping[str, Any]
  special_tokens: Mapping[str, int]
  bos_token: str | None
  eos_token: str
  pad_token: str | None = None
  chat_format: str | None = None


_LLAMA = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu",
              attention_bias=False, mlp_bias=False)
_LLAMA2 = dict(_LLAMA, vocab_size=32000, rms_norm_eps=1e-5, max_position_embeddings=4096,
               rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
_SENTENCEPIECE_SPECIALS = {"<unk>": 0, "<s>": 1, "</s>": 2}
_QWEN_SPECIALS = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645}

SHAPES: dict[str, Shape] = {
    "smollm2-135m": Shape(
        source="HuggingFaceTB/SmolLM2-135M",
        fields=dict(_LLAMA, vocab_size=49152, hidden_size=576, intermediate_size=1536,
                    num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                    head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0,
                    max_position_embeddings=8192, tie_word_embeddings=True,
                    bos_token_id=0, eos_token_id=0),
        special_tokens={"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2},
        bos_token="<|endoftext|>", eos_token="<|endoftext|>"),
    "qwen2.5-0.5b": Shape(
        source="Qwen/Qwen2.5-0.5B",
        fields=dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2",
                    hidden_act="silu", vocab_size=151936, hidden_size=896,
                    intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                    num_key_value_heads=2, rms_norm_eps=1e-6, rope_theta=1000000.0,
                    max_position_embeddings=32768, tie_word_embeddings=True,
                    use_sliding_window=False, sliding_window=32768, max_window_layers=24,
                    bos_token_id=151643, eos_token_id=151643),
        special_tokens=_QWEN_SPECIALS, bos_token=None, eos_token="<|endoftext|>",
        pad_token="<|endoftext|>"),
    "qwen3-0.6b": Shape(
        source="Qwen/Qwen3-0.6B",
        fields=dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3",
                    hidden_act="silu", vocab_size=151936, hidden_size=1024,
                    intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                    num_key_value_heads=8, head_dim=128, attention_bias=False,
                    rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=40960,
                    tie_word_embeddings=True, use_sliding_window=False, sliding_window=None,
                    max_window_layers=28, bos_token_id=151643, eos_token_id=151645),
        special_tokens=_QWEN_SPECIALS, bos_token=None, eos_token="<|im_end|>",
        pad_token="<|endoftext|>", chat_format="chatml"),
    "llama-3.2-1b": Shape(
        source="meta-llama/Llama-3.2-1B",
        fields=dict(_LLAMA, vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                    num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                    head_dim=64, rms_norm_eps=1e-5, rope_theta=500000.0,
                    rope_scaling={"rope_type": "llama3", "factor": 32.0,
                                  "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                  "original_max_position_embeddings": 8192},
                    max_position_embeddings=131072, tie_word_embeddings=True,
                    bos_token_id=128000, eos_token_id=128001),
        special_tokens={"<|begin_of_text|>": 128000, "<|end_of_text|>": 128001,
                        "<|start_header_id|>": 128006, "<|end_header_id|>": 128007,
                        "<|eot_id|>": 128009},
        bos_token="<|begin_of_text|>", eos_token="<|end_of_text|>"),
    "mistral-7b-v0.3": Shape(
        source="mistralai/Mistral-7B-v0.3",
        fields=dict(architectures=["MistralForCausalLM"], model_type="mistral",
                    hidden_act="silu", vocab_size=32768, hidden_size=4096,
                    intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                    num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5,
                    rope_theta=1000000.0, max_position_embeddings=32768,
                    sliding_window=None, tie_word_embeddings=False, bos_token_id=1,
                    eos_token_id=2),
        special_tokens=_SENTENCEPIECE_SPECIALS, bos_token="<s>", eos_token="</s>"),
    "gemma3-270m": Shape(
        source="google/gemma-3-270m",
        fields=dict(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text",
                    hidden_activation="gelu_pytorch_tanh", vocab_size=262144,
                    hidden_size=640, intermediate_size=2048, num_hidden_layers=18,
                    num_attention_heads=4, num_key_value_heads=1, head_dim=256,
                    query_pre_attn_scalar=256, sliding_window=512, sliding_window_pattern=6,
                    rope_theta=1000000.0, rope_local_base_freq=10000.0, rope_scaling=None,
                    rms_norm_eps=1e-6, max_position_embeddings=32768,
                    tie_word_embeddings=True, attention_bias=False,
                    attn_logit_softcapping=None, final_logit_softcapping=None,
                    pad_token_id=0, eos_token_id=1, bos_token_id=2),
        special_tokens={"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3},
        bos_token="<bos>", eos_token="<eos>", pad_token="<pad>"),
    "llama2-7b": Shape(
        source="meta-llama/Llama-2-7b-hf",
        fields=dict(_LLAMA2, hidden_size=4096, intermediate_size=11008,
                    num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32),
        special_tokens=_SENTENCEPIECE_SPECIALS, bos_token="<s>", eos_token="</s>"),
    "llama2-13b": Shape(
        source="meta-llama/Llama-2-13b-hf",
        fields=dict(_LLAMA2, hidden_size=5120, intermediate_size=13824,
                    num_hidden_layers=40, num_attention_heads=40, num_key_value_heads=40),
        special_tokens=_SENTENCEPIECE_SPECIALS, bos_token="<s>", eos_token="</s>"),
    "llama2-34b": Shape(
        source="codellama/CodeLlama-34b-hf",
        fields=dict(_LLAMA2, hidden_size=8192, intermediate_size=22016,
                    num_hidden_layers=48, num_attention_heads=64, num_key_value_heads=8,
                    rope_theta=1000000.0, max_position_embeddings=16384),
        special_tokens=_SENTENCEPIECE_SPECIALS, bos_token="<s>", eos_token="</s>"),
    "llama2-70b": Shape(
        source="meta-llama/Llama-2-70b-hf",
        fields=dict(_LLAMA2, hidden_size=8192, intermediate_size=28672,
                    num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8),
        special_tokens=_SENTENCEPIECE_SPECIALS, bos_token="<s>", eos_token="</s>"),
}


def get(name: str) -> Shape:
  """The shape `name`; ValueError listing the known names otherwise."""
  if name not in SHAPES:
    raise ValueError(f"unknown model shape {name!r}; choose one of {sorted(SHAPES)}.")
  return SHAPES[name]


def hf_config(name: str, **overrides) -> dict[str, Any]:
  """The config.json dict of shape `name`, with `overrides` (config.json field names)."""
  fields = dict(get(name).fields)
  unknown = sorted(set(overrides) - _OVERRIDABLE)
  if unknown:
    raise ValueError(f"cannot override {unknown} of a shape; overridable config.json "
                     f"fields: {sorted(_OVERRIDABLE)}.")
  fields.update(overrides)
  return fields


# Sizes a test or a dry run may shrink; the architecture and its numerics stay.
_OVERRIDABLE = frozenset({
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
    "tie_word_embeddings",
})


def config(name: str, *, dtype: Any = "float32", param_dtype: Any = None,
           **overrides) -> TransformerConfig:
  """Shape `name` as a TransformerConfig with an LM head.

  Args:
    name: a key of SHAPES.
    dtype: compute dtype; param_dtype: storage dtype (default `dtype`).
    **overrides: config.json fields to change (sizes only; see `models/hf_config.py`).
  """
  # Imported here: the config mapping imports flax; keep this module light.
  from pipe_rlhf_jax.models.hf_config import config_from_hf
  return config_from_hf(hf_config(name, **overrides), dtype=dtype, param_dtype=param_dtype)
