"""Hugging Face `config.json` <-> `TransformerConfig`: which checkpoints load, and as what.

This module owns the config policy of the Hugging Face interop (`models/hf.py` owns the
tensors): the architectures supported, the mapping of each config field
(`config_from_hf`, `parse_config`, `config_to_hf`) and the rule that refuses a field
whose value would change the mathematics.

Config policy (one rule: a checkpoint never loads with silently different math):
- MAPPED fields become `TransformerConfig` fields (sizes, eps, RoPE, biases, tying, ids).
- MATH_CHANGING fields are accepted only at their neutral value (`MATH_CHANGING`, e.g.
  `mlp_bias=False`, `hidden_act="silu"`, `partial_rotary_factor=1.0`,
  `quantization_config=None`); any other value raises ValueError naming the field.
- Sliding-window attention loads as it is (`TransformerConfig.sliding_window` and
  `layer_types`; a query at slot q sees key slot k iff k <= q and q - k < window).
  Qwen2 / Qwen3: the window applies only with `use_sliding_window=True`, to the layers
  `layer_types` marks "sliding_attention", or without `layer_types` to the layers
  i >= `max_window_layers` (transformers' rule). Mistral: transformers reads
  `sliding_window` alone (no switch) and applies it to every layer (Mistral-7B-v0.1's
  4096 of 32768 positions; v0.3's null is full attention). A `layer_types` entry other
  than full / sliding attention is refused. `attention_bias=True` on Mistral is refused:
  transformers' Mistral ignores it, so such a config and its checkpoint disagree about
  which tensors exist.
- Qwen3's q/k norm is not optional in transformers: `use_qk_norm`, if present, must be
  true (or null) there (and on Gemma 3); on the other families it must be false.
- Fields a config.json omits take transformers' per-class defaults where those matter
  (Qwen3: head_dim 128, 32 kv heads, 32768 positions; Mistral: 8 kv heads, 131072
  positions, a 4096-key sliding window, bos 1 / eos 2; Gemma 3: head_dim 256, 4 kv
  heads, 131072 positions, a 4096-key window, RoPE bases 1e6 / 1e4,
  query_pre_attn_scalar 256, tied, pad 0 / eos 1 / bos 2), so an abbreviated config
  means what it means to transformers.
- RoPE: transformers 4.x `rope_scaling` + top-level `rope_theta` and 5.x
  `rope_parameters` {rope_type, rope_theta, ...} both load; types "default", "linear",
  "llama3" are supported, anything else (yarn, dynamic, longrope, ...) raises ValueError
  naming the field. A llama3 dict without `original_max_position_embeddings` falls back
  to `max_position_embeddings`, as transformers does.
- Dropout fields (`attention_dropout`, ...) are ignored: our model has no dropout. A
  value > 0 warns, because fine-tuning here will not reproduce HF's training-time noise.
- NEUTRAL fields (bookkeeping, generation defaults, `pretraining_tp` which only splits
  matmuls, `initializer_range`, ...) are ignored silently.
- Any other field warns (UserWarning) naming it: it is not known to be math-neutral.
- `eos_token_id` may be a list (LLaMA 3 instruct); `TransformerConfig.eos_token_id` keeps
  the first, and `hf_eos_token_ids(hf_config)` returns all of them for generation stops.
"""

from __future__ import annotations

import logging
from typing import Any, Mapping
import warnings

from flax.core import FrozenDict

from pipe_rlhf_jax.models.config import ROPE_TYPES, TransformerConfig, dtype_name

logger = logging.getLogger(__name__)

__all__ = ["DROPOUT_FIELDS", "MAPPED", "MATH_CHANGING", "NEUTRAL", "SUPPORTED_ARCHITECTURES",
           "config_from_hf", "config_to_hf", "hf_eos_token_ids", "parse_config"]

# HF class name -> (our architecture, the head the checkpoint carries).
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": ("llama", "lm"),
    "Qwen2ForCausalLM": ("qwen2", "lm"),
    "LlamaForSequenceClassification": ("llama", "score"),
    "Qwen2ForSequenceClassification": ("qwen2", "score"),
    "Qwen3ForCausalLM": ("qwen3", "lm"),
    "Qwen3ForSequenceClassification": ("qwen3", "score"),
    "MistralForCausalLM": ("mistral", "lm"),
    "MistralForSequenceClassification": ("mistral", "score"),
    "Gemma3ForCausalLM": ("gemma3", "lm"),
    "Gemma3TextForSequenceClassification": ("gemma3", "score"),
}
_MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "mistral": "mistral",
                "gemma3_text": "gemma3"}
# Our architecture -> (config.json model_type, causal LM class, sequence-classification class).
_EXPORT_CLASSES = {
    "llama": ("llama", "LlamaForCausalLM", "LlamaForSequenceClassification"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM", "Qwen2ForSequenceClassification"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM", "Qwen3ForSequenceClassification"),
    "mistral": ("mistral", "MistralForCausalLM", "MistralForSequenceClassification"),
    "gemma3": ("gemma3_text", "Gemma3ForCausalLM", "Gemma3TextForSequenceClassification"),
}

# transformers' class defaults for math-relevant fields a config.json may omit, where
# they differ from what the parsing below assumes (num_kv_heads = heads, head_dim =
# hidden / heads, no sliding window).
_ABSENT_DEFAULTS = {
    "qwen3": {"head_dim": 128, "num_key_value_heads": 32, "max_position_embeddings": 32768,
              "max_window_layers": 28, "sliding_window": 4096},
    "mistral": {"num_key_value_heads": 8, "max_position_embeddings": 131072,
                "sliding_window": 4096, "bos_token_id": 1, "eos_token_id": 2},
    "gemma3": {"head_dim": 256, "num_key_value_heads": 4, "max_position_embeddings": 131072,
               "sliding_window": 4096, "rope_theta": 1_000_000.0,
               "rope_local_base_freq": 10_000.0, "query_pre_attn_scalar": 256,
               "tie_word_embeddings": True, "hidden_activation": "gelu_pytorch_tanh",
               "pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2},
}

# Fields turned into TransformerConfig fields (or validated together with them).
MAPPED = frozenset({
    "architectures", "model_type", "vocab_size", "hidden_size", "intermediate_size",
    "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
    "rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters", "tie_word_embeddings",
    "attention_bias", "max_position_embeddings", "bos_token_id", "eos_token_id",
    "pad_token_id", "num_labels", "id2label", "label2id", "use_sliding_window",
    "sliding_window", "max_window_layers", "layer_types", "torch_dtype", "dtype",
    "pipe_rlhf_head", "query_pre_attn_scalar", "rope_local_base_freq",
    "sliding_window_pattern", "hidden_activation",
})

# Fields that change the computation, with the values under which they do not.
MATH_CHANGING = {
    "hidden_act": ("silu", "swish"),
    "mlp_bias": (False, None),
    "partial_rotary_factor": (1.0, None),
    "quantization_config": (None,),
    "attn_logit_softcapping": (None,),
    "final_logit_softcapping": (None,),
    "logits_scaling": (1.0, None),
    "embedding_multiplier": (1.0, None),
    "residual_multiplier": (1.0, None),
    "use_qk_norm": (False, None),
    "use_mrope": (False, None),
    "use_bidirectional_attention": (False, None),
}
# Per-architecture exceptions to MATH_CHANGING's neutral values.
_NEUTRAL_BY_ARCHITECTURE = {"qwen3": {"use_qk_norm": (True, None)},
                            "gemma3": {"use_qk_norm": (True, None)}}

# Dropout probabilities: ignored (no dropout here); > 0 warns.
DROPOUT_FIELDS = ("attention_dropout", "hidden_dropout", "resid_pdrop", "embd_pdrop",
                  "attn_pdrop", "dropout")

# Bookkeeping and generation defaults that never change the forward pass.
NEUTRAL = frozenset({
    "transformers_version", "use_cache", "initializer_range", "pretraining_tp",
    "problem_type", "_name_or_path", "name_or_path", "_attn_implementation",
    "attn_implementation", "tokenizer_class", "return_dict", "output_hidden_states",
    "output_attentions", "torchscript", "use_return_dict", "chunk_size_feed_forward",
    "is_encoder_decoder", "is_decoder", "add_cross_attention", "tie_encoder_decoder",
    "pruned_heads", "finetuning_task", "task_specific_params", "prefix", "sep_token_id",
    "decoder_start_token_id", "cross_attention_hidden_size", "tf_legacy_loss",
    "use_bfloat16", "max_length", "min_length", "do_sample", "early_stopping", "num_beams",
    "num_beam_groups", "diversity_penalty", "temperature", "top_k", "top_p", "typical_p",
    "repetition_penalty", "length_penalty", "no_repeat_ngram_size",
    "encoder_no_repeat_ngram_size", "bad_words_ids", "num_return_sequences",
    "output_scores", "return_dict_in_generate", "forced_bos_token_id",
    "forced_eos_token_id", "remove_invalid_values", "exponential_decay_length_penalty",
    "suppress_tokens", "begin_suppress_tokens",
    # transformers 5.x writes Gemma 3's pattern here for the record; `layer_types` beside
    # it is what counts (and without it, transformers reads `sliding_window_pattern`).
    "_sliding_window_pattern",
})

# Keys a rope dict may carry per supported type (besides rope_type/type/rope_theta).
_ROPE_KEYS = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor",
               "original_max_position_embeddings"),
}

# --------------------------------------------------------------------------- config


def _checkpoint_kind(hf: Mapping[str, Any]) -> tuple[str, str]:
  """(architecture, checkpoint head) from `architectures` (or `model_type` alone)."""
  archs = hf.get("architectures")
  supported = sorted(SUPPORTED_ARCHITECTURES)
  if not archs:
    model_type = hf.get("model_type")
    if model_type in _MODEL_TYPES:
      warnings.warn(f"config.json has no 'architectures'; assuming a causal LM from "
                    f"model_type={model_type!r}.")
      return _MODEL_TYPES[model_type], "lm"
    raise ValueError(f"config.json has no 'architectures' and model_type={model_type!r}; "
                     f"supported architectures: {supported}.")
  if isinstance(archs, str):
    archs = [archs]
  if len(archs) != 1 or archs[0] not in SUPPORTED_ARCHITECTURES:
    raise ValueError(f"Unsupported architectures={list(archs)}; supported architectures: "
                     f"{supported}.")
  return SUPPORTED_ARCHITECTURES[archs[0]]


def _rope_from_hf(hf: Mapping[str, Any], max_positions: int,
                  layer_types) -> tuple[float, dict | None]:
  """(rope_theta, rope_scaling for TransformerConfig) from either config format."""
  scaling = hf.get("rope_scaling") or None
  params = hf.get("rope_parameters") or None
  if params is not None and layer_types and all(k in set(layer_types) for k in params):
    # 5.x nests per layer type; one shared RoPE is all our model has.
    nested = list(params.values())
    if any(n != nested[0] for n in nested):
      raise ValueError(f"rope_parameters differs per layer type ({params}); only one RoPE "
                       f"for all layers is supported.")
    params = nested[0]
  source = "rope_parameters" if params is not None else "rope_scaling"
  if params is not None and scaling is not None:
    a = {k: v for k, v in params.items() if k != "rope_theta"}
    b = dict(scaling)
    if (a.get("rope_type", a.get("type", "default"))
        != b.get("rope_type", b.get("type", "default")) or
        any(a.get(k) != b.get(k) for k in ("factor", "low_freq_factor", "high_freq_factor"))):
      raise ValueError(f"config.json has both rope_parameters={params} and "
                       f"rope_scaling={scaling} and they disagree; keep one.")
  rope = dict(params if params is not None else (scaling or {}))
  theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
  kind = rope.get("rope_type", rope.get("type", "default"))
  if kind not in ROPE_TYPES:
    raise ValueError(f"{source}.rope_type={kind!r} is not supported (it changes the "
                     f"positional math); supported rope types: {ROPE_TYPES}.")
  prf = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor"))
  if prf not in (None, 1.0):
    raise ValueError(f"partial_rotary_factor={prf} is not supported (only full-width "
                     f"RoPE, partial_rotary_factor=1.0).")
  known = {"rope_type", "type", "rope_theta", "partial_rotary_factor", *_ROPE_KEYS[kind]}
  if kind == "default":
    known |= {"factor"}  # transformers ignores a factor on default RoPE; so do we
  extra = sorted(set(rope) - known)
  if extra:
    warnings.warn(f"{source} fields {extra} are not used by rope_type={kind!r}; ignored.")
  if kind == "default":
    return float(theta), None
  out = {"rope_type": kind}
  for key in _ROPE_KEYS[kind]:
    if key == "original_max_position_embeddings" and key not in rope:
      out[key] = int(max_positions)
    elif key not in rope:
      raise ValueError(f"{source}.{key} is required for rope_type={kind!r}.")
    else:
      out[key] = rope[key]
  for key in ("factor", "low_freq_factor", "high_freq_factor"):
    if key in out:
      out[key] = float(out[key])
  if "original_max_position_embeddings" in out:
    out["original_max_position_embeddings"] = int(out["original_max_position_embeddings"])
  # Hashable: the config is a static attribute of the model's graphdef, which jit caches
  # (and the sampler's function cache) hash.
  return float(theta), FrozenDict(out)


def _gemma_rope(hf: Mapping[str, Any], max_positions: int) -> tuple[float, Any, float]:
  """(global rope_theta, global rope_scaling, local RoPE base) of a Gemma 3 config.

  4.x: `rope_theta` + `rope_scaling` (global layers) and `rope_local_base_freq`; 5.x:
  `rope_parameters` nested per layer type. Local layers must use default RoPE.
  """
  params = hf.get("rope_parameters") or None
  if params is not None and set(params) & {"full_attention", "sliding_attention"}:
    full = dict(params.get("full_attention") or {})
    full.setdefault("rope_theta", hf.get("rope_theta", 1_000_000.0))
    sliding = dict(params.get("sliding_attention") or {})
    local_theta = sliding.get("rope_theta", hf.get("rope_local_base_freq", 10_000.0))
    glob = {"rope_parameters": full}
  else:
    glob = {key: hf[key] for key in ("rope_parameters", "rope_scaling", "rope_theta")
            if key in hf}
    sliding = {}
    local_theta = hf.get("rope_local_base_freq", 10_000.0)
  kind = sliding.get("rope_type", sliding.get("type", "default"))
  extra = sorted(set(sliding) - {"rope_type", "type", "rope_theta"})
  if kind != "default" or extra:
    raise ValueError(f"rope_parameters.sliding_attention={sliding}: only default RoPE "
                     f"(a base, no scaling) is supported on Gemma 3's local layers.")
  theta, scaling = _rope_from_hf(glob, max_positions, None)
  return theta, scaling, float(local_theta)


S_ATTN = "sliding_attention"


def _window_from_hf(hf: Mapping[str, Any], architecture: str,
                    num_layers: int) -> tuple[int | None, tuple[str, ...] | None]:
  """(sliding_window, layer_types) as transformers reads them for `architecture`."""
  layer_types = hf.get("layer_types")
  if architecture == "mistral":
    # Mistral has no switch and no per-layer kinds: the window is every layer's.
    window = hf.get("sliding_window")
    return (None if window is None else int(window)), None
  if architecture == "llama":
    return None, None
  if architecture == "gemma3":
    window = hf.get("sliding_window")
    if layer_types is None:
      pattern = hf.get("sliding_window_pattern", 6)
      layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention"
                     for i in range(num_layers)]
  else:  # Qwen2 / Qwen3: the window exists only when switched on
    window = hf.get("sliding_window") if hf.get("use_sliding_window") else None
    if layer_types is None:
      first = hf.get("max_window_layers", num_layers)
      layer_types = ["sliding_attention" if window is not None and i >= first
                     else "full_attention" for i in range(num_layers)]
  layer_types = tuple(layer_types)
  bad = sorted(set(layer_types) - {"full_attention", "sliding_attention"})
  if bad:
    raise ValueError(f"layer_types contains {bad}; supported layer types: "
                     f"'full_attention', 'sliding_attention'.")
  if len(layer_types) != num_layers:
    raise ValueError(f"layer_types has {len(layer_types)} entries for num_hidden_layers="
                     f"{num_layers}.")
  if architecture != "gemma3":
    if window is None or S_ATTN not in layer_types:
      return None, None  # sliding layers without a window attend like full ones
    if all(kind == S_ATTN for kind in layer_types):
      return int(window), None  # the config's spelling of "every layer"
  return (None if window is None else int(window)), layer_types


def _check_fields(hf: Mapping[str, Any], architecture: str) -> None:
  exceptions = _NEUTRAL_BY_ARCHITECTURE.get(architecture, {})
  for name, neutral in MATH_CHANGING.items():
    neutral = exceptions.get(name, neutral)
    if name in hf and hf[name] not in neutral:
      raise ValueError(f"config.json field {name}={hf[name]!r} changes the model math and "
                       f"is not supported; supported value(s): {list(neutral)}.")
  for name in DROPOUT_FIELDS:
    if (hf.get(name) or 0) > 0:
      warnings.warn(f"config.json field {name}={hf[name]} is ignored: this model has no "
                    f"dropout (inference is unaffected; fine-tuning runs without it).")
  known = MAPPED | NEUTRAL | set(MATH_CHANGING) | set(DROPOUT_FIELDS)
  unknown = sorted(set(hf) - known)
  if unknown:
    warnings.warn(f"config.json fields {unknown} are not known to this loader and were "
                  f"ignored; check that they do not change the model math.")


def hf_eos_token_ids(hf_config: Mapping[str, Any]) -> tuple[int, ...]:
  """All end-of-sequence ids of a config (`eos_token_id` may be an int or a list)."""
  eos = hf_config.get("eos_token_id")
  if eos is None:
    return ()
  return tuple(int(e) for e in eos) if isinstance(eos, (list, tuple)) else (int(eos),)


def config_from_hf(hf_config: Mapping[str, Any], *, head: str | None = None,
                   dtype: Any = None,
                   param_dtype: Any = None) -> TransformerConfig:
  """Maps a Hugging Face `config.json` dict to a TransformerConfig.

  Args:
    hf_config: the parsed config.json (a transformers config object also works).
    head: override of the head ("lm", "value", "score"); default: the checkpoint's.
    dtype: compute dtype, a name or a dtype object; default "float32".
    param_dtype: parameter storage dtype, likewise; default: `dtype`.

  Returns:
    The TransformerConfig. Raises ValueError on anything that would change the math
    (see the module docstring for the policy).
  """
  return parse_config(hf_config, head, dtype, param_dtype)[0]


def parse_config(hf_config, head, dtype, param_dtype) -> tuple[TransformerConfig, str]:
  """(config, the head the checkpoint itself carries); see `config_from_hf`."""
  hf = dict(hf_config.to_dict() if hasattr(hf_config, "to_dict") else hf_config)
  architecture, ckpt_head = _checkpoint_kind(hf)
  hf = {**_ABSENT_DEFAULTS.get(architecture, {}), **hf}
  if ckpt_head == "score":
    num_labels = hf.get("num_labels", len(hf.get("id2label") or {}) or 2)
    if num_labels != 1:
      raise ValueError(f"{hf['architectures'][0]} with num_labels={num_labels}: only "
                       f"num_labels=1 (a scalar score) is supported.")
    if hf.get("pipe_rlhf_head") == "value":
      ckpt_head = "value"
  _check_fields(hf, architecture)
  for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
               "num_attention_heads"):
    if name not in hf:
      raise ValueError(f"config.json lacks the required field {name!r}.")
  hidden, heads = hf["hidden_size"], hf["num_attention_heads"]
  head_dim = hf.get("head_dim")
  if architecture == "mistral" and not head_dim:
    head_dim = None  # transformers' Mistral reads a head_dim of 0 as absent too
  if head_dim is None:
    if hidden % heads:
      raise ValueError(f"hidden_size={hidden} is not a multiple of num_attention_heads="
                       f"{heads} and config.json has no head_dim.")
    head_dim = hidden // heads
  max_positions = int(hf.get("max_position_embeddings", 2048))
  num_layers = hf["num_hidden_layers"]
  window, layer_types = _window_from_hf(hf, architecture, num_layers)
  local_theta = pre_attn_scalar = None
  if architecture == "gemma3":
    activation = hf.get("hidden_activation")
    if activation != "gelu_pytorch_tanh":
      raise ValueError(f"config.json field hidden_activation={activation!r} changes the "
                       f"model math and is not supported; supported value(s): "
                       f"['gelu_pytorch_tanh'].")
    theta, scaling, local_theta = _gemma_rope(hf, max_positions)
    pre_attn_scalar = hf["query_pre_attn_scalar"]
  else:
    theta, scaling = _rope_from_hf(hf, max_positions, hf.get("layer_types"))
  if architecture == "qwen2":
    qkv_bias, out_bias = True, False
  elif architecture == "mistral":
    if hf.get("attention_bias"):
      raise ValueError(
          "attention_bias=True on a Mistral config: transformers' Mistral has no attention "
          "biases and ignores the field, so the config and its checkpoint disagree; "
          "supported value(s): [False, None].")
    qkv_bias = out_bias = False
  else:
    qkv_bias = out_bias = bool(hf.get("attention_bias", False))
  eos = hf_eos_token_ids(hf)
  dtype = "float32" if dtype is None else dtype
  config = TransformerConfig(
      vocab_size=hf["vocab_size"], embed_dim=hidden, num_layers=num_layers,
      num_heads=heads, num_kv_heads=hf.get("num_key_value_heads") or heads,
      head_dim=head_dim, mlp_dim=hf["intermediate_size"],
      norm_eps=float(hf.get("rms_norm_eps", 1e-6)), rope_theta=theta, rope_scaling=scaling,
      tie_embeddings=bool(hf.get("tie_word_embeddings", False)), qkv_bias=qkv_bias,
      out_bias=out_bias, qk_norm=architecture in ("qwen3", "gemma3"),
      architecture=architecture, sliding_window=window, layer_types=layer_types,
      rope_local_theta=local_theta, query_pre_attn_scalar=pre_attn_scalar,
      head=head or ckpt_head, dtype=dtype,
      param_dtype=dtype if param_dtype is None else param_dtype,
      max_position_embeddings=max_positions,
      bos_token_id=hf.get("bos_token_id"), eos_token_id=eos[0] if eos else None,
      pad_token_id=hf.get("pad_token_id"))
  return config, ckpt_head


def config_to_hf(config: TransformerConfig, *, dtype: Any = None) -> dict[str, Any]:
  """A transformers-loadable config.json dict (4.x `rope_scaling` + `rope_theta` format).

  "lm" heads export as *ForCausalLM; "value"/"score" heads as *ForSequenceClassification
  with num_labels=1 (plus `pipe_rlhf_head` so that a critic reloads as "value").

  Args:
    config: the model config.
    dtype: the dtype name written as `torch_dtype`/`dtype`; default `config.param_dtype`.
  """
  c = config
  model_type, lm_class, score_class = _EXPORT_CLASSES[c.architecture]
  if c.architecture == "qwen2" and (not c.qkv_bias or c.out_bias):
    raise ValueError(f"architecture='qwen2' needs qkv_bias=True and out_bias=False, got "
                     f"qkv_bias={c.qkv_bias}, out_bias={c.out_bias}; use 'llama' instead.")
  if c.architecture in ("llama", "qwen3", "gemma3") and c.qkv_bias != c.out_bias:
    raise ValueError(f"architecture={c.architecture!r} has one attention_bias for q/k/v/o, "
                     f"but qkv_bias={c.qkv_bias} != out_bias={c.out_bias}.")
  if c.architecture == "mistral" and (c.qkv_bias or c.out_bias):
    raise ValueError(f"architecture='mistral' has no attention biases, got qkv_bias="
                     f"{c.qkv_bias}, out_bias={c.out_bias}; use 'llama' instead.")
  if c.qk_norm != (c.architecture in ("qwen3", "gemma3")):
    raise ValueError(f"qk_norm={c.qk_norm} with architecture={c.architecture!r}: in "
                     f"transformers only (and always) Qwen3 and Gemma 3 normalise q and k.")
  if c.architecture != "gemma3":
    for name in ("rope_local_theta", "query_pre_attn_scalar"):
      if getattr(c, name) is not None:
        raise ValueError(f"{name}={getattr(c, name)} with architecture="
                         f"{c.architecture!r}: only Gemma 3 has it in transformers.")
  local = c.local_layers
  if c.sliding_window is not None and c.architecture == "llama":
    raise ValueError("architecture='llama' has no sliding window in transformers; export "
                     "it as 'mistral' (every layer) or 'qwen2' / 'qwen3' (per layer).")
  if c.sliding_window is not None and c.architecture == "mistral" and not all(local):
    raise ValueError("architecture='mistral' applies its sliding window to every layer; "
                     f"layer_types={c.layer_types} mixes local and global layers.")
  dtype = c.param_dtype if dtype is None else dtype_name(dtype)
  hf: dict[str, Any] = {
      "architectures": [lm_class if c.head == "lm" else score_class],
      "model_type": model_type,
      "vocab_size": c.vocab_size, "hidden_size": c.embed_dim,
      "intermediate_size": c.mlp_dim, "num_hidden_layers": c.num_layers,
      "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads,
      "head_dim": c.head_dim, "hidden_act": "silu",
      "max_position_embeddings": c.max_position_embeddings, "rms_norm_eps": c.norm_eps,
      "rope_theta": c.rope_theta,
      "rope_scaling": dict(c.rope_scaling) if c.rope_scaling else None,
      "tie_word_embeddings": c.tie_embeddings,
      "bos_token_id": c.bos_token_id, "eos_token_id": c.eos_token_id,
      "pad_token_id": c.pad_token_id, "torch_dtype": dtype, "dtype": dtype,
      "use_cache": True, "initializer_range": 0.02, "attention_dropout": 0.0,
  }
  if c.architecture == "llama":
    hf.update(attention_bias=c.qkv_bias, mlp_bias=False, pretraining_tp=1)
  elif c.architecture == "mistral":
    hf.update(sliding_window=c.sliding_window)
  elif c.architecture == "gemma3":
    del hf["hidden_act"]
    hf.update(hidden_activation="gelu_pytorch_tanh", attention_bias=c.qkv_bias,
              # transformers' strict config wants an int where the value is one.
              query_pre_attn_scalar=(int(c.query_pre_attn_scalar)
                                     if float(c.query_pre_attn_scalar).is_integer()
                                     else c.query_pre_attn_scalar),
              rope_local_base_freq=(c.rope_theta if c.rope_local_theta is None
                                    else c.rope_local_theta),
              sliding_window=c.sliding_window,
              layer_types=["sliding_attention" if x else "full_attention" for x in local],
              attn_logit_softcapping=None, final_logit_softcapping=None,
              use_bidirectional_attention=False)
  elif c.sliding_window is None:
    hf.update(use_sliding_window=False, sliding_window=None,
              max_window_layers=c.num_layers)
  else:
    # `layer_types` is what transformers reads; `max_window_layers` says the same for
    # loaders without it whenever the local layers are the last ones.
    first = local.index(True) if any(local) else c.num_layers
    hf.update(use_sliding_window=True, sliding_window=c.sliding_window,
              max_window_layers=first if all(local[first:]) else c.num_layers,
              layer_types=["sliding_attention" if x else "full_attention" for x in local])
  if c.architecture == "qwen3":
    hf.update(attention_bias=c.qkv_bias)
  if c.head != "lm":
    hf.update(num_labels=1, id2label={"0": "LABEL_0"}, label2id={"LABEL_0": 0},
              pipe_rlhf_head=c.head)
  return hf
