"""RL with a verifiable reward on math word problems: GRPO of a local chat model.

The policy is a Hugging Face chat model read from a local directory (config.json,
*.safetensors, tokenizer.json with a chat template, e.g. an instruct LLaMA-3 or Qwen2.5
download; nothing is fetched at run time). Prompts are JSONL conversations with a
reference answer,

  {"messages": [{"role": "system", "content": "..."}, {"role": "user", "content": "..."}],
   "answer": "\\frac{5}{8}"}

rendered through the model's chat template with the generation prompt, so each
completion is the assistant's answer. The rule `math_verify` (data/math_reward.py)
scores it 1 when its final answer (the last `\\boxed{...}`, else after `####`, else the
last number) equals the reference by the `math-verify` library, else 0. GRPO samples
8 completions per prompt and normalises the rewards within each group: no critic, no
reward model; the k3 KL to the starting policy enters the loss. `reward/mean` is the
accuracy of the sampled answers; with `log.eval_prompts` the summary compares greedy
(and sampled) answers to the held-out prompts before and after RL (`heldout/math_verify`).

The shipped data (configs/data/math_*.jsonl) are 32 grade-school problems written for
this project (24 training prompts with worked demonstrations, 8 held out), a sample of
the format; point `data.jsonl.*` at your own files (GSM8K: the question as the user
message, the text after "####" of its answer, or the whole solution, as "answer"). SFT
is off (`sft.steps=0`): a chat model already answers in its own format, and the
demonstrations (`{"messages", "completion"}`) are used only when you turn it on.

  python -m pipe_rlhf_jax.main --config=configs/rlvr_math.py \
      --config.model.path=/models/Qwen2.5-0.5B-Instruct --workdir=runs/rlvr
  python -m pipe_rlhf_jax.main --config=configs/rlvr_math.py \
      --config.model.path=/models/Qwen2.5-0.5B-Instruct \
      --config.data.jsonl.prompts=gsm8k_train.jsonl \
      --config.data.jsonl.prompts_eval=gsm8k_test.jsonl

How long it takes depends on the model and the accelerator and has not been measured
for a real model. The `:tiny` variant (a 2-layer model, 3 PPO steps of 8 prompts x 2
samples, 2 SFT steps on the demonstrations, completions of 16 tokens) is the CPU smoke
run; it needs a small model directory too, which tests/configs/test_rlvr_math.py writes
(`tests/helpers/hf_helpers.py`: `write_tiny_chat_llama`). From the command line,

  python -m pipe_rlhf_jax.main --config=configs/rlvr_math.py:tiny \
      --config.model.path=/tmp/tiny_chat

took 87 s (28 s of CPU time; 39 s of it the first PPO step, mostly compilation) on 2
CPU cores that other jobs were loading.

Plan: `plan.choose=auto`, the planner's choice for the devices the job sees (mode,
placement, meshes, micro-batches, remat), checked against their memory; the hand-written
plan below (`--config.plan.choose=manual`: one accelerator shared by every stage,
parameters sharded over fsdp) is what it falls back to. This config is sized for an
accelerator: on a CPU the planner prices a step of 64 rollouts of up to 448 tokens of
the converted SmolLM2-135M-Instruct in bfloat16 at about 1,700 s. For RL of a real model
on a CPU, see configs/smollm2_rlvr.py.
"""

import os

import ml_collections

from configs import quickstart  # the shared defaults

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")


def get_config(variant: str = "") -> ml_collections.ConfigDict:
  """The math RLVR config; variant "tiny" shrinks every phase to a CPU smoke run."""
  if variant not in ("", "tiny"):
    raise ValueError(f"configs/rlvr_math.py variant {variant!r}; choose '' or 'tiny'.")
  config = quickstart.get_config()
  config.name = "rlvr_math"
  config.model.path = ""  # required: --config.model.path=/path/to/hf_chat_model
  config.model.require_path = True
  config.model.dtype = "bfloat16"
  config.model.param_dtype = "float32"

  config.data.task = "jsonl"
  config.data.jsonl = ml_collections.ConfigDict(dict(
      prompts=os.path.join(DATA, "math_prompts.jsonl"),
      prompts_eval=os.path.join(DATA, "math_prompts_eval.jsonl"),
      demos=os.path.join(DATA, "math_demos.jsonl"), prefs="", prefs_eval=""))
  del config.data["hard_pairs"]  # a knob of the reverse task's pairs
  # A chat-templated word problem fits 192 tokens of a BPE tokenizer; a worked answer
  # 256 (longer prompts keep their end, longer answers are cut and score 0).
  config.data.prompt_len = 192
  config.data.completion_len = 256

  config.sft.steps = 0  # the chat model answers already; set > 0 to imitate the demos
  config.sft.learning_rate = 1e-5

  config.reward.fn = "math_verify"
  config.reward.eval_fn = ""
  config.reward.normalize_samples_per_prompt = 0  # a rule: nothing to standardise

  config.ppo.steps = 200
  config.ppo.advantage_estimator = "grpo"  # critic-free: no critic is built or trained
  config.ppo.group_size = 8  # completions per prompt, compared within their group
  config.ppo.batch_size = 64  # 8 prompts x 8 samples per step
  config.ppo.minibatch_size = 32  # whole groups per minibatch
  config.ppo.epochs = 1
  config.ppo.whiten_advantages = False  # GRPO normalises within each group
  config.ppo.actor_lr = 1e-6
  config.ppo.warmup_steps = 10
  config.ppo.kl_in = "loss"  # GRPO style: k3 KL to the starting policy as a loss term
  config.ppo.kl_estimator = "k3"
  config.ppo.kl_coef = 0.04
  config.ppo.target_kl = 0.0
  config.ppo.ptx_coef = 0.0
  config.ppo.critic_init = "sft"  # used only by critic estimators: there is no reward model
  config.ppo.temperature = 1.0

  config.log.eval_prompts = 8  # the held-out split, greedy before and after RL
  config.log.eval_samples_per_prompt = 4

  config.plan.choose = "auto"
  config.plan.mode = "sequential"
  config.mesh = ml_collections.ConfigDict(dict(data=1, fsdp=-1, tensor=1, pipeline=1))
  config.stages.generate = ml_collections.ConfigDict(
      dict(mesh=dict(data=1, fsdp=1, tensor=-1, pipeline=1), num_microbatches=1, num_slots=0))
  config.stages.infer = ml_collections.ConfigDict(dict(mesh=dict(data=-1), pack_tokens=0))
  config.stages.train = ml_collections.ConfigDict(dict(mesh=dict(fsdp=-1), pack_tokens=0))

  if variant == "tiny":
    quickstart.shrink_to_tiny(config)
    config.name = "rlvr_math-tiny"
    config.model.dtype = "float32"
    config.data.update(prompt_len=208, completion_len=16)  # character-level tokenizer
    config.sft.update(steps=2, batch_size=8, learning_rate=1e-3)
    config.ppo.update(steps=3, batch_size=16, minibatch_size=8, group_size=2,
                      actor_lr=1e-3, warmup_steps=1)
    config.log.update(eval_prompts=8, eval_samples_per_prompt=0)
    # shrink_to_tiny's pipe plan, undone: this config shares the devices, by hand.
    config.plan.choose = "manual"
    config.plan.mode = "sequential"
    config.stages.generate = ml_collections.ConfigDict(
        dict(mesh=dict(data=-1), num_microbatches=1, num_slots=0))
  return config
