"""Models: the LLaMA / Qwen2 / Qwen3 / Mistral / Gemma 3 transformer family, its config,
published shapes, tokenizers, and Hugging Face and GGUF interop."""

from pipe_rlhf_jax.models.config import TransformerConfig, tiny_config
from pipe_rlhf_jax.models.hf import save_pretrained
from pipe_rlhf_jax.models.hf_config import config_from_hf, config_to_hf
from pipe_rlhf_jax.models.load import from_pretrained, load_tokenizer
from pipe_rlhf_jax.models.tokenizer import ByteTokenizer, HFTokenizer
from pipe_rlhf_jax.models.transformer import (
                                              KVCache,
                                              Transformer,
                                              default_positions,
                                              init_model,
                                              param_axes,
)

__all__ = ["ByteTokenizer", "HFTokenizer", "KVCache", "Transformer", "TransformerConfig",
           "config_from_hf", "config_to_hf", "default_positions", "from_pretrained",
           "init_model", "load_tokenizer", "param_axes", "save_pretrained", "tiny_config"]
