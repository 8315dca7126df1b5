"""RLHF of a real model read from a local Hugging Face directory (meant for GPU / TPU).

The directory holds config.json, *.safetensors and tokenizer.json, e.g. a LLaMA-3.2-1B or
Qwen2.5-0.5B download; nothing is fetched at run time. The task is the same "reverse"
task as the quickstart, tokenized with the model's own tokenizer; the reward model and
critic start from the policy's backbone.

  python -m pipe_rlhf_jax.main --config=configs/hf_model.py \
      --config.model.path=/models/Qwen2.5-0.5B --workdir=runs/qwen

On one accelerator every stage shares it (`sequential`); on a pod slice set
`plan.mode=pipe` with `plan.placement` and per-stage meshes, e.g. on 8 chips:
  --config.plan.mode=pipe --config.plan.placement.generate=4 \
  --config.plan.placement.infer=2 --config.plan.placement.train=2
"""

import ml_collections

from configs import quickstart  # the shared defaults


def get_config(variant: str = "") -> ml_collections.ConfigDict:
  """A real-model config; variant "tiny" shrinks the phases for a smoke test."""
  config = quickstart.get_config("tiny" if variant == "tiny" else "")
  config.name = "hf_model"
  config.model.path = ""  # required: --config.model.path=/path/to/hf_dir
  config.model.require_path = True
  config.model.dtype = "bfloat16"
  config.model.param_dtype = "float32"
  config.data.prompt_len = 32
  config.data.completion_len = 16
  config.sft.learning_rate = 1e-5
  config.reward_model.learning_rate = 1e-5
  config.ppo.actor_lr = 1e-6
  config.ppo.critic_lr = 5e-6
  config.ppo.kl_coef = 0.05
  config.ppo.critic_init = "sft"
  config.plan.mode = "sequential"
  config.mesh = ml_collections.ConfigDict(dict(data=1, fsdp=-1, tensor=1, pipeline=1))
  config.stages.generate = ml_collections.ConfigDict(
      dict(mesh=dict(data=1, fsdp=1, tensor=-1, pipeline=1), num_microbatches=1, num_slots=0))
  config.stages.infer = ml_collections.ConfigDict(dict(mesh=dict(data=-1), pack_tokens=0))
  config.stages.train = ml_collections.ConfigDict(dict(mesh=dict(fsdp=-1), pack_tokens=0))
  if variant == "tiny":
    config.model.dtype = "float32"
    config.sft.learning_rate = 1e-3
    config.reward_model.learning_rate = 1e-3
    config.ppo.actor_lr = 1e-3
    config.ppo.critic_lr = 1e-3
  return config
