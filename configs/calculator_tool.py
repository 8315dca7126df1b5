"""Multi-turn RL with a tool on a CPU: SmolLM2-135M-Instruct learns to use a calculator.

The policy is the packaged SmolLM2-135M-Instruct (as in configs/smollm2_rlvr.py). The
task is multiplication word problems with factors up to 30 ("Each of the 23 boxes holds
17 cards. How many cards are there altogether?"), which the model cannot do in its head,
and an environment with a calculator (`envs/calculator.py`): an assistant turn that
writes `<calc>23*17</calc>` gets a tool message with the value (391) rendered by the
model's own chat template, and the episode goes on; a turn without a call is the final
answer, scored 1 when its last number is the reference answer, else 0 (`math_verify`).
Only the model's own tokens are trained; the tool's tokens are context.

  python -m pipe_rlhf_jax.models.packaged smollm2-135m-instruct   # installs, prints the path
  python -m pipe_rlhf_jax.main --config=configs/calculator_tool.py

The starting model never writes the tag on its own, whatever its system message says
(0 calls in 64 answers tried). A short SFT on first turns that call the tool
(`data.word_problems.demo_style="calculator"`: "<calc>23*17</calc>") teaches the call's
format; RL (GRPO, 8 episodes per prompt, the k3 KL to the SFT policy in the loss) then
learns when to call and to answer with the result, in 8 steps. The summary scores the
held-out problems before and after RL (greedy episodes, with paired 95% intervals):
the environment's reward (`calculator`) and the share of episodes that called the tool
(`calculator_tool_calls`). `python -m experiments.learning_curves --config
configs/calculator_tool.py --page tool_use` runs it over seeds in both modes.

Episodes: up to 3 assistant turns of up to 24 tokens, 64 tokens in all after the prompt
(turns and tool messages); a tool call may take 5 s. The `:pipe` variant runs the three
stages concurrently on three devices, rollouts one version stale; `:tiny` is the CI
smoke run of the same phases.
"""

import ml_collections

from configs import smollm2_rlvr

SYSTEM_PROMPT = ("You have a calculator. To use it, write <calc>expression</calc> and end "
                 "your message; the result comes back. Then answer with the number only.")


def get_config(variant: str = "") -> ml_collections.ConfigDict:
  """The calculator-tool config; variants "pipe" and "tiny"."""
  if variant not in ("", "pipe", "tiny"):
    raise ValueError(f"configs/calculator_tool.py variant {variant!r}; choose '', 'pipe' or "
                     "'tiny'.")
  config = smollm2_rlvr.get_config()
  config.name = "calculator_tool"
  config.data.word_problems.update(operations="*", max_factor=30, system_prompt=SYSTEM_PROMPT,
                                   demo_style="calculator")
  config.data.num_demos = 512
  config.data.prompt_len = 96  # the system message and the problem: 75-90 tokens
  # Every turn and tool message of an episode: a call (about 12 tokens), the tool's
  # message (about 12) and the answer fit, with room for a second call.
  config.data.completion_len = 64

  # SFT on the tool call's format only, briefly: 96 demonstrations seen once.
  config.sft.update(steps=12, batch_size=8, learning_rate=1e-5, warmup_steps=4)

  config.env = ml_collections.ConfigDict(dict(
      name="calculator", max_turns=3, turn_tokens=24, tool_timeout_s=5.0,
      episode_timeout_s=0.0, failure_reward=0.0))
  config.reward.fn = "environment"
  config.reward.eval_fn = ""
  config.ppo.steps = 8
  config.log.eval_samples_per_prompt = 0  # greedy held-out episodes only

  if variant == "pipe":
    config.name = "calculator_tool-pipe"
    use_pipe_mode(config)
  if variant == "tiny":
    config.name = "calculator_tool-tiny"
    config.data.update(num_demos=32, completion_len=40)
    config.env.turn_tokens = 12
    config.sft.steps = 0  # the SFT phase has its own tests; this runs the episodes
    smollm2_rlvr.use_tiny_sizes(config)
  return config


def use_pipe_mode(config: ml_collections.ConfigDict, max_staleness: int = 1) -> None:
  """The three stages concurrently on devices 0 / 1 / 2 (`smollm2_rlvr.use_pipe_mode`),
  the trainer recomputing each layer's activations in the backward pass: its own device
  holds a third of the machine's memory, and the episodes' 160-token rows keep 4.9 GiB of
  activations otherwise (the planner's memory model). The mathematics is unchanged."""
  smollm2_rlvr.use_pipe_mode(config, max_staleness)
  config.stages.train.remat = "full"
