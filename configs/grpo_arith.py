"""RL with a verifiable reward: SFT on noisy sums, then RL against the exact-match rule.

The embedded "arith" task (data/arith.py): the prompt `12+57=` asks for `69`. SFT
imitates demonstrations whose answer digits are each wrong with probability 0.3, so the
warm-started policy is right only part of the time; RL then optimises the rule
`arith_exact_match` itself (1 for the exact result, else 0). No preference pairs are
generated and no reward model is trained; `rule_reward/mean` logs the partial-credit
`arith_digit_accuracy` beside it. `reward/mean` is the exact-match accuracy of the
sampled answers. Runs in a few minutes on 2 CPU cores with 8 virtual devices.

  python -m pipe_rlhf_jax.main --config=configs/grpo_arith.py
  python -m pipe_rlhf_jax.main --config=configs/grpo_arith.py --config.runtime.mode=sequential
  python -m pipe_rlhf_jax.main --config=configs/grpo_arith.py --config.data.arith.operators=+-
  python -m pipe_rlhf_jax.main --config=configs/grpo_arith.py:tiny   # seconds-long smoke run

The plan (pipe mode, 4 + 2 + 2 devices, staleness 1) and the model are the quickstart's.
"""

import ml_collections

from configs import quickstart  # the shared defaults


def get_config(variant: str = "") -> ml_collections.ConfigDict:
  """The arith config; variant "tiny" shrinks every phase to a smoke run."""
  if variant not in ("", "tiny"):
    raise ValueError(f"configs/grpo_arith.py variant {variant!r}; choose '' or 'tiny'.")
  config = quickstart.get_config()
  config.name = "grpo_arith"

  config.data.task = "arith"
  # One-digit operands, three operators: "7*8=" -> "56", "3-9=" -> "-6" (300 problems).
  config.data.arith = ml_collections.ConfigDict(
      dict(operators="+-*", min_digits=1, max_digits=1, demo_noise=0.3))
  config.data.num_prompts = 4096
  config.data.num_demos = 4096
  config.data.num_pairs = 0  # unused: a rule reward needs no preference pairs
  config.data.num_eval = 64  # held-out problems, never trained on
  config.data.prompt_len = 8  # BOS + "7*8=" with room for 2-digit operands
  config.data.completion_len = 4  # "-6" / "56" + EOS, and room for a wrong longer answer

  config.sft.steps = 300
  config.sft.learning_rate = 3e-3

  config.reward.fn = "arith_exact_match"
  config.reward.eval_fn = "arith_digit_accuracy"  # partial credit, logged, never optimised

  config.ppo.steps = 60
  config.ppo.critic_init = "sft"  # there is no reward model to start the critic from
  config.ppo.kl_coef = 0.05
  if variant == "tiny":
    quickstart.shrink_to_tiny(config)
    config.name = "grpo_arith-tiny"
  return config
