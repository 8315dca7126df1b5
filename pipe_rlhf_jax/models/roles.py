"""The model configs of a run's three roles, from its model settings.

Owns `build_model_configs`: the actor's `TransformerConfig` (the embedded tiny model sized
to the tokenizer, or a local checkpoint's config: its `config.json` or a GGUF file's
metadata) and the critic's and reward model's, which share its body and differ in the
head. The main job, the planner's
calibration and `plan` all size their models here, so a plan is priced for the model the
run builds.
"""

from __future__ import annotations

from pipe_rlhf_jax.models import hf, load
from pipe_rlhf_jax.models.config import TransformerConfig, tiny_config


def _round_up(x: int, multiple: int) -> int:
  return -(-x // multiple) * multiple


def build_model_configs(m, tokenizer) -> dict[str, TransformerConfig]:
  """Actor/critic/reward configs: the embedded tiny model, or a local HF checkpoint.

  Args:
    m: the experiment's model settings (`config.ModelSettings`, or any object with its
      fields: path, dtype, param_dtype and the embedded model's sizes).
    tokenizer: the run's tokenizer (the embedded model's vocabulary and special ids).
  """
  if m.path:
    base = hf.config_from_hf(load.read_hf_config(m.path), dtype=m.dtype,
                             param_dtype=m.param_dtype)
    base = base.replace(head="lm")
  else:
    # A vocabulary padded to a multiple of 8 splits evenly over tensor axes of 2, 4, 8.
    base = tiny_config(vocab_size=_round_up(tokenizer.vocab_size, 8), embed_dim=m.embed_dim,
                       num_layers=m.num_layers, num_heads=m.num_heads,
                       num_kv_heads=m.num_kv_heads, head_dim=m.head_dim, mlp_dim=m.mlp_dim,
                       dtype=m.dtype, param_dtype=m.param_dtype,
                       eos_token_id=tokenizer.eos_id, bos_token_id=tokenizer.bos_id,
                       pad_token_id=tokenizer.pad_id)
  return {"actor": base, "critic": base.replace(head="value"),
          "reward": base.replace(head="score")}
