"""Hugging Face interop: `config.json` + safetensors <-> `Transformer`, without torch.

This module owns the tensors of Hugging Face LLaMA / Qwen2 / Qwen3 / Mistral / Gemma 3
(text) checkpoints against our stacked-layer `Transformer`: the tensor layout mapping
(`LAYER_TENSORS`, shared with the GGUF reader), `from_pretrained` / `save_pretrained`, and
the export of LoRA adapters in peft's layout (`save_adapters`). What a `config.json` may
say, and what it maps to, is `models/hf_config.py`'s (its config policy).

Supported architectures: {Llama, Qwen2, Qwen3, Mistral}ForCausalLM (head "lm") and
{Llama, Qwen2, Qwen3, Mistral}ForSequenceClassification with `num_labels == 1` (head
"score"; a `"pipe_rlhf_head": "value"` field written by `save_pretrained` restores a
critic's "value" head), and Gemma3ForCausalLM / Gemma3TextForSequenceClassification
(model_type "gemma3_text"; the multimodal Gemma3ForConditionalGeneration is not a text
checkpoint and is refused). What each family adds to the LLaMA block:
- Qwen2: biases on q/k/v (never on o), whatever `attention_bias` says.
- Qwen3: per-head RMSNorm on q and k (`q_norm` / `k_norm`, size head_dim, eps
  `rms_norm_eps`) after the projection and before RoPE; `head_dim` independent of
  hidden / heads; `attention_bias` puts biases on q/k/v/o as in LLaMA.
- Mistral: no attention biases at all; `head_dim` independent of hidden / heads (null
  or absent: hidden / heads).
- Gemma 3: RMSNorm weights applied as `1 + w`, four norms per layer (input, post
  attention, pre and post feed-forward), q/k RMSNorm, a GELU-tanh gated MLP
  (`hidden_activation` must be "gelu_pytorch_tanh"), embeddings scaled by sqrt(hidden),
  scores scaled by `query_pre_attn_scalar ** -0.5`, `head_dim` independent of the width,
  and interleaved local / global layers (`layer_types`, else transformers' pattern of
  `sliding_window_pattern` (default 6): every sixth layer global), local layers with
  their own RoPE base (`rope_local_base_freq`, or 5.x `rope_parameters` nested per layer
  type) and global ones with `rope_theta` and `rope_scaling`. `attn_logit_softcapping`,
  `final_logit_softcapping` and `use_bidirectional_attention` must be null / false.

Tensor policy: every tensor the config implies must be present with the HF shape, and
every tensor in the checkpoint must be used; violations raise one ValueError listing each
tensor with its expected and actual shape. Ignored: rotary `inv_freq` buffers, a tied
`lm_head.weight` identical to the embedding, and the checkpoint's own head when `head=`
replaces it (an LM checkpoint loaded as "value"/"score" gets a freshly initialised scalar
head; a "score" checkpoint loaded as "value" reuses `score.weight`).

Files: `config.json` and `model.safetensors`, or shards listed in
`model.safetensors.index.json` (the single file wins when both exist). The bytes are
`models/safetensors_io.py`'s: damaged files and indices whose shards leave the directory
are refused there, naming the file and the tensor.

A model with LoRA adapters exports as its merged model (`save_pretrained`: every adapter
folded into its projection, a plain checkpoint of the base architecture), and its adapters
alone as peft writes them (`save_adapters`: `adapter_config.json` and
`adapter_model.safetensors`, keys `base_model.model.<module>.lora_A.weight` [rank, in] and
`lora_B.weight` [out, rank]), which `peft.PeftModel.from_pretrained` loads onto the base.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from pathlib import Path
from typing import Any, Callable, Mapping

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

from pipe_rlhf_jax.models import lora
from pipe_rlhf_jax.models.checkpoint_files import is_gguf
from pipe_rlhf_jax.models.config import DTYPES, TransformerConfig, dtype_name
from pipe_rlhf_jax.models.hf_config import config_to_hf, parse_config
from pipe_rlhf_jax.models.safetensors_io import (
  load_checkpoint_tensors,
  read_safetensors,
  write_safetensors,
)
from pipe_rlhf_jax.models.transformer import Transformer, init_model

logger = logging.getLogger(__name__)

# The file format's reader and writer, re-exported: callers of this module use them.
__all__ = ["from_hf_tensors", "from_pretrained", "hf_tensor_shapes", "read_safetensors",
           "save_adapters", "save_pretrained", "write_safetensors"]

# ------------------------------------------------------------------ tensor layouts


@dataclasses.dataclass(frozen=True)
class LayerTensor:
  """One per-layer tensor, under each of its names, and how its layouts relate.

  Attributes:
    ours: the stacked parameter of `Layers` (one slice per layer).
    hf: the Hugging Face suffix (`model.layers.N.<hf>`).
    gguf: the llama.cpp suffix (`blk.N.<gguf>`).
    hf_shape / our_shape: its per-layer shape in each, as a function of the config.
    transposed: a Linear weight: HF's [out, in] is our [in, out], split into heads;
      otherwise the same values, reshaped.
    needs: the config flag it exists under ("" always; "qkv_bias", "out_bias",
      "qk_norm"); family: "gemma" / "llama" (every other family) / "" both.
  """

  ours: str
  hf: str
  gguf: str
  hf_shape: Callable[[TransformerConfig], tuple[int, ...]]
  our_shape: Callable[[TransformerConfig], tuple[int, ...]]
  transposed: bool = False
  needs: str = ""
  family: str = ""

  def applies(self, c: TransformerConfig) -> bool:
    return ((not self.needs or getattr(c, self.needs))
            and self.family in ("", "gemma" if c.is_gemma else "llama"))

  def to_ours(self, w: np.ndarray, c: TransformerConfig) -> np.ndarray:
    """HF layout -> ours, for one layer."""
    return (w.T if self.transposed else w).reshape(self.our_shape(c))

  def to_hf(self, w: np.ndarray, c: TransformerConfig) -> np.ndarray:
    """Ours -> HF layout, for one layer."""
    shape = self.hf_shape(c)
    return w.reshape(shape[::-1]).T if self.transposed else w.reshape(shape)


def _vector(c: TransformerConfig) -> tuple[int, ...]:
  return (c.embed_dim,)


def _head_vector(c: TransformerConfig) -> tuple[int, ...]:
  return (c.head_dim,)


# The one table of per-layer tensors: import (safetensors and GGUF), export and the
# expected shapes all read it. Gemma's post_attention_layernorm normalises the attention
# output (LLaMA's is the norm before the MLP, which Gemma calls pre_feedforward_layernorm;
# llama.cpp's `ffn_norm` is that pre-MLP norm in both).
LAYER_TENSORS = (
    LayerTensor("attn_norm", "input_layernorm.weight", "attn_norm.weight", _vector, _vector),
    LayerTensor("mlp_norm", "post_attention_layernorm.weight", "ffn_norm.weight", _vector,
                _vector, family="llama"),
    LayerTensor("mlp_norm", "pre_feedforward_layernorm.weight", "ffn_norm.weight", _vector,
                _vector, family="gemma"),
    LayerTensor("post_attn_norm", "post_attention_layernorm.weight",
                "post_attention_norm.weight", _vector, _vector, family="gemma"),
    LayerTensor("post_mlp_norm", "post_feedforward_layernorm.weight", "post_ffw_norm.weight",
                _vector, _vector, family="gemma"),
    LayerTensor("q_proj", "self_attn.q_proj.weight", "attn_q.weight",
                lambda c: (c.num_heads * c.head_dim, c.embed_dim),
                lambda c: (c.embed_dim, c.num_heads, c.head_dim), transposed=True),
    LayerTensor("k_proj", "self_attn.k_proj.weight", "attn_k.weight",
                lambda c: (c.num_kv_heads * c.head_dim, c.embed_dim),
                lambda c: (c.embed_dim, c.num_kv_heads, c.head_dim), transposed=True),
    LayerTensor("v_proj", "self_attn.v_proj.weight", "attn_v.weight",
                lambda c: (c.num_kv_heads * c.head_dim, c.embed_dim),
                lambda c: (c.embed_dim, c.num_kv_heads, c.head_dim), transposed=True),
    LayerTensor("o_proj", "self_attn.o_proj.weight", "attn_output.weight",
                lambda c: (c.embed_dim, c.num_heads * c.head_dim),
                lambda c: (c.num_heads, c.head_dim, c.embed_dim), transposed=True),
    LayerTensor("gate_proj", "mlp.gate_proj.weight", "ffn_gate.weight",
                lambda c: (c.mlp_dim, c.embed_dim), lambda c: (c.embed_dim, c.mlp_dim),
                transposed=True),
    LayerTensor("up_proj", "mlp.up_proj.weight", "ffn_up.weight",
                lambda c: (c.mlp_dim, c.embed_dim), lambda c: (c.embed_dim, c.mlp_dim),
                transposed=True),
    LayerTensor("down_proj", "mlp.down_proj.weight", "ffn_down.weight",
                lambda c: (c.embed_dim, c.mlp_dim), lambda c: (c.mlp_dim, c.embed_dim),
                transposed=True),
    LayerTensor("q_bias", "self_attn.q_proj.bias", "attn_q.bias",
                lambda c: (c.num_heads * c.head_dim,), lambda c: (c.num_heads, c.head_dim),
                needs="qkv_bias"),
    LayerTensor("k_bias", "self_attn.k_proj.bias", "attn_k.bias",
                lambda c: (c.num_kv_heads * c.head_dim,),
                lambda c: (c.num_kv_heads, c.head_dim), needs="qkv_bias"),
    LayerTensor("v_bias", "self_attn.v_proj.bias", "attn_v.bias",
                lambda c: (c.num_kv_heads * c.head_dim,),
                lambda c: (c.num_kv_heads, c.head_dim), needs="qkv_bias"),
    LayerTensor("o_bias", "self_attn.o_proj.bias", "attn_output.bias", _vector, _vector,
                needs="out_bias"),
    LayerTensor("q_norm", "self_attn.q_norm.weight", "attn_q_norm.weight", _head_vector,
                _head_vector, needs="qk_norm"),
    LayerTensor("k_norm", "self_attn.k_norm.weight", "attn_k_norm.weight", _head_vector,
                _head_vector, needs="qk_norm"),
)


def layer_tensors(c: TransformerConfig) -> tuple[LayerTensor, ...]:
  """The per-layer tensors a model of `c` has."""
  return tuple(t for t in LAYER_TENSORS if t.applies(c))


def gguf_layer_names(gemma: bool) -> dict[str, str]:
  """llama.cpp per-layer suffix -> Hugging Face suffix, over every optional tensor."""
  family = "gemma" if gemma else "llama"
  return {t.gguf: t.hf for t in LAYER_TENSORS if t.family in ("", family)}


def hf_tensor_shapes(c: TransformerConfig,
                     ckpt_head: str | None = None) -> dict[str, tuple[int, ...]]:
  """Every tensor a Hugging Face checkpoint of `c` holds, with its HF shape.

  Args:
    c: the model config.
    ckpt_head: the head the checkpoint carries; default `c.head`.

  Returns:
    Tensor name -> shape, in the order embedding, layers, final norm, head.
  """
  ckpt_head = c.head if ckpt_head is None else ckpt_head
  expected = {"model.embed_tokens.weight": (c.vocab_size, c.embed_dim)}
  for i in range(c.num_layers):
    for t in layer_tensors(c):
      expected[f"model.layers.{i}.{t.hf}"] = t.hf_shape(c)
  expected["model.norm.weight"] = (c.embed_dim,)
  if ckpt_head == "lm" and not c.tie_embeddings:
    expected["lm_head.weight"] = (c.vocab_size, c.embed_dim)
  elif ckpt_head in ("value", "score"):
    expected["score.weight"] = (1, c.embed_dim)
  return expected


def _validate_tensors(tensors: Mapping[str, np.ndarray],
                      expected: Mapping[str, tuple[int, ...]], ignorable: set[str]):
  problems = []
  for name, shape in expected.items():
    if name not in tensors:
      problems.append(f"missing tensor {name!r} (expected shape {shape})")
    elif tuple(tensors[name].shape) != shape:
      problems.append(f"tensor {name!r}: expected shape {shape}, got "
                      f"{tuple(tensors[name].shape)}")
  for name in sorted(set(tensors) - set(expected) - ignorable):
    if not name.endswith("rotary_emb.inv_freq"):
      problems.append(f"unexpected tensor {name!r} (shape {tuple(tensors[name].shape)}) "
                      f"is not used by this config")
  if problems:
    raise ValueError("Checkpoint does not match its config:\n  " + "\n  ".join(problems))


# ---------------------------------------------------------------- load and save


def from_pretrained(path: str | os.PathLike, *, dtype: Any = "float32",
                    param_dtype: Any = None, head: str | None = None,
                    seed: int = 0) -> Transformer:
  """Loads a Hugging Face LLaMA / Qwen2 / Qwen3 / Mistral / Gemma 3 checkpoint.

  Args:
    path: directory with config.json and model.safetensors (or a sharded index); a GGUF
      file loads through `models.load.from_pretrained`.
    dtype: compute dtype, a name or a dtype object (`jnp.bfloat16`, "bfloat16").
    param_dtype: parameter storage dtype, likewise; default `dtype` (a bf16 checkpoint
      then loads as exact f32 upcasts).
    head: override of the checkpoint's head. "value"/"score" on an LM checkpoint loads
      the backbone and freshly initialises the scalar head (critic / reward-model init
      from the SFT policy); the LM head tensor is then dropped.
    seed: PRNG seed of a freshly initialised scalar head.

  Returns:
    The model with every parameter set from the checkpoint (axes metadata kept).
  """
  path = Path(path)
  if is_gguf(path):
    raise ValueError(f"{path} is a GGUF checkpoint; load it with "
                     "pipe_rlhf_jax.models.from_pretrained (models/load.py), which reads "
                     "both formats.")
  config_file = path / "config.json"
  if not config_file.exists():
    raise FileNotFoundError(f"{config_file} does not exist.")
  hf = json.loads(config_file.read_text())
  return from_hf_tensors(hf, lambda: load_checkpoint_tensors(path), dtype=dtype,
                         param_dtype=param_dtype, head=head, seed=seed, source=path)


def from_hf_tensors(hf: Mapping[str, Any],
                    tensors: Mapping[str, np.ndarray] | Callable[[], Mapping[str, np.ndarray]],
                    *, dtype: Any = "float32", param_dtype: Any = None,
                    head: str | None = None, seed: int = 0,
                    source: Any = "checkpoint") -> Transformer:
  """Builds a Transformer from a Hugging Face config dict and tensors named as in HF.

  The one place where the config policy and the tensor policy meet the weights: every
  checkpoint format (safetensors, GGUF) ends here.

  Args:
    hf: the config.json dict.
    tensors: HF tensor name -> array, or a function returning that mapping (called only
      once the config passed its checks, so a refused config reads no tensor bytes).
    dtype / param_dtype / head / seed: as in `from_pretrained`.
    source: what the tensors came from, for log messages.

  Returns:
    The model with every parameter set from the tensors (axes metadata kept).
  """
  config, ckpt_head = parse_config(hf, head, dtype, param_dtype)
  if callable(tensors):
    tensors = tensors()
  path = source

  ignorable: set[str] = set()
  if config.head == "lm" and ckpt_head != "lm":
    if not config.tie_embeddings:
      raise ValueError(f"head='lm' needs an LM head, but this checkpoint is a "
                       f"{hf['architectures'][0]} without lm_head.weight and with "
                       f"tie_word_embeddings=False.")
    ignorable.add("score.weight")
  fresh_head = config.head != "lm" and ckpt_head == "lm"
  expected = hf_tensor_shapes(config, ckpt_head)
  if fresh_head:
    ignorable.add("lm_head.weight")
  if (config.tie_embeddings and ckpt_head == "lm" and "lm_head.weight" in tensors
      and "model.embed_tokens.weight" in tensors):
    # Some exporters write the tied head anyway; it must be the embedding itself.
    if not np.array_equal(tensors["lm_head.weight"], tensors["model.embed_tokens.weight"]):
      raise ValueError("tie_word_embeddings=True but the checkpoint's lm_head.weight "
                       "differs from model.embed_tokens.weight.")
    ignorable.add("lm_head.weight")
  _validate_tensors(tensors, expected, ignorable)

  storage = config.storage_dtype

  def put(param: nnx.Param, value: np.ndarray):
    param.set_value(jnp.asarray(value.astype(np.float32), dtype=storage))

  model = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(seed)))
  put(model.embedding, tensors["model.embed_tokens.weight"])
  put(model.final_norm, tensors["model.norm.weight"])
  for t in layer_tensors(config):
    stacked = np.stack([t.to_ours(tensors[f"model.layers.{i}.{t.hf}"], config)
                        for i in range(config.num_layers)])
    put(getattr(model.layers, t.ours), stacked)
  if config.head == "lm":
    if not config.tie_embeddings:
      put(model.lm_head, tensors["lm_head.weight"].T)
  elif fresh_head:
    logger.info("Initialised a fresh %r head (seed %d) on the backbone of %s.",
                config.head, seed, path)
    init = 0.02 * jax.random.normal(jax.random.key(seed), (config.embed_dim, 1),
                                    jnp.float32)
    model.scalar_head.set_value(init.astype(storage))
  else:
    put(model.scalar_head, tensors["score.weight"].T)
  unset = [path for path, var in nnx.iter_graph(model)
           if isinstance(var, nnx.Param) and isinstance(var.get_value(), jax.ShapeDtypeStruct)]
  if unset:  # a parameter the mapping does not cover: a bug here, never a silent init
    raise RuntimeError(f"from_pretrained left parameters unset: {unset}")
  return model


def save_pretrained(model: Transformer, path: str | os.PathLike, *,
                    dtype: Any = None) -> Path:
  """Writes config.json and model.safetensors that transformers (4.x and 5.x) loads.

  A model with LoRA adapters is written merged (`models.lora.merged`): the base
  architecture's checkpoint, which computes what the adapted model computes.

  Args:
    model: the Transformer.
    path: output directory (created if missing).
    dtype: storage dtype name of the written tensors; default the model's param dtype.

  Returns:
    The output directory.
  """
  if model.config.lora_rank:
    base = model.config.base
    graphdef = nnx.split(nnx.eval_shape(lambda: init_model(base)))[0]
    model = nnx.merge(graphdef, lora.merged(nnx.state(model), model.config))
  c = model.config
  dtype = c.param_dtype if dtype is None else dtype_name(dtype)
  np_dtype = np.dtype(DTYPES[dtype])
  hf_config = config_to_hf(c, dtype=dtype)
  path = Path(path)
  path.mkdir(parents=True, exist_ok=True)

  def host(param: nnx.Param) -> np.ndarray:
    return np.asarray(jax.device_get(param.get_value())).astype(np_dtype)

  tensors = {"model.embed_tokens.weight": host(model.embedding),
             "model.norm.weight": host(model.final_norm)}
  for t in layer_tensors(c):
    stacked = host(getattr(model.layers, t.ours))
    for i in range(c.num_layers):
      tensors[f"model.layers.{i}.{t.hf}"] = t.to_hf(stacked[i], c)
  if c.head == "lm":
    if not c.tie_embeddings:
      tensors["lm_head.weight"] = host(model.lm_head).T
  else:
    tensors["score.weight"] = host(model.scalar_head).T
  write_safetensors(path / "model.safetensors", tensors)
  (path / "config.json").write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")
  return path


def save_adapters(model: Transformer, path: str | os.PathLike, *,
                  base_model_name_or_path: str = "") -> Path:
  """Writes the model's LoRA adapters alone as peft does: `adapter_config.json` and
  `adapter_model.safetensors` (float32), for `peft.PeftModel.from_pretrained(base, path)`
  on the Hugging Face export of the base model.

  Our A [*in, rank] is peft's `lora_A.weight` [rank, in] transposed (the input dimensions
  flattened), our B [rank, *out] its `lora_B.weight` [out, rank]; `lora_alpha` and `r` keep
  the scale alpha / rank.
  """
  c = model.config
  if not c.lora_rank:
    raise ValueError("save_adapters: the model has no LoRA adapters (lora_rank=0).")
  path = Path(path)
  path.mkdir(parents=True, exist_ok=True)
  hf_module = {t.ours: t.hf[:-len(".weight")] for t in layer_tensors(c)}
  tensors = {}
  for target in c.lora_targets:
    a_name, b_name = lora.names(target)
    a = np.asarray(jax.device_get(getattr(model.layers, a_name).get_value()), np.float32)
    b = np.asarray(jax.device_get(getattr(model.layers, b_name).get_value()), np.float32)
    for i in range(c.num_layers):
      prefix = f"base_model.model.model.layers.{i}.{hf_module[target]}"
      tensors[f"{prefix}.lora_A.weight"] = np.ascontiguousarray(
          a[i].reshape(-1, c.lora_rank).T)
      tensors[f"{prefix}.lora_B.weight"] = np.ascontiguousarray(
          b[i].reshape(c.lora_rank, -1).T)
  write_safetensors(path / "adapter_model.safetensors", tensors)
  adapter_config = {
      "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": c.lora_rank,
      "lora_alpha": float(c.lora_alpha), "target_modules": sorted(c.lora_targets),
      "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False, "use_rslora": False,
      "inference_mode": True, "base_model_name_or_path": base_model_name_or_path or None,
  }
  (path / "adapter_config.json").write_text(
      json.dumps(adapter_config, indent=2, sort_keys=True) + "\n")
  return path
