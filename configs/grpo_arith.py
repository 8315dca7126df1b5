"""GRPO with a verifiable reward: SFT on noisy arithmetic, then RL against exact match.

The embedded "arith" task (data/arith.py): the prompt `7*8=` asks for `56`, `3-9=` for
`-6`. SFT imitates demonstrations whose answer digits are each wrong with probability
0.3, so the warm-started policy samples the right answer only part of the time; RL then
optimises the rule `arith_exact_match` itself (1 for the exact result, else 0). No
preference pairs are generated, no reward model is trained, and GRPO needs no critic:
the inference stage computes reference log-probs and the rule only. `reward/mean` is
the exact-match accuracy of the sampled answers; `rule_reward/mean` logs the
partial-credit `arith_digit_accuracy`; the summary compares greedy answers to 64
held-out problems before and after RL.

  python -m pipe_rlhf_jax.main --config=configs/grpo_arith.py
  python -m pipe_rlhf_jax.main --config=configs/grpo_arith.py --config.plan.mode=sequential
  python -m pipe_rlhf_jax.main --config=configs/grpo_arith.py --config.ppo.advantage_estimator=gae \
      --config.ppo.group_size=1 --config.ppo.whiten_advantages=True --config.ppo.kl_in=reward
  python -m pipe_rlhf_jax.main --config=configs/grpo_arith.py:tiny   # seconds-long smoke run

GRPO settings: 4 samples per prompt and 64 prompts per step. The operands are single
digits, so the policy mostly memorises 236 training facts and RL sharpens each fact it
samples: how many distinct prompts a step covers matters more than the group size (8
samples of 16 prompts learned far less in the same number of steps),
and actor learning rates of 2e-3 made exact match fall; without the KL term (kl_coef=0)
two seeds learned no faster and their greedy held-out answers got worse. The plan (pipe
mode, 4 + 2 + 2 devices, staleness 1) and the model are the quickstart's.
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
  del config.data["hard_pairs"]  # a knob of the reverse task's pairs
  config.data.num_eval = 64  # held-out problems, never trained on
  config.data.prompt_len = 8  # BOS + "7*8=" with room for 2-digit operands
  config.data.completion_len = 4  # "-6" / "56" + EOS, and room for a wrong longer answer

  config.sft.steps = 300
  config.sft.learning_rate = 3e-3

  config.reward.fn = "arith_exact_match"
  config.reward.eval_fn = "arith_digit_accuracy"  # partial credit, logged, never optimised

  config.ppo.steps = 60
  config.ppo.advantage_estimator = "grpo"  # critic-free: no critic is built or trained
  config.ppo.group_size = 4  # completions per prompt, sampled together
  config.ppo.batch_size = 256  # 64 prompts x 4 samples per step
  config.ppo.minibatch_size = 128  # whole groups per minibatch
  config.ppo.whiten_advantages = False  # GRPO normalises within each group
  config.ppo.actor_lr = 1e-3
  config.ppo.kl_in = "loss"  # GRPO style: k3 KL to the SFT policy as a loss term
  config.ppo.kl_estimator = "k3"
  config.ppo.kl_coef = 0.05
  # No per-update early stop: the arith learning curves (docs/results/learning_curves.md)
  # were measured without one, and the drift it guards against came from a learned reward
  # model, which this task has not.
  config.ppo.target_kl = 0.0
  # No SFT term (the quickstart's 0.3): the arith learning curves were measured without it.
  config.ppo.ptx_coef = 0.0
  config.ppo.critic_init = "sft"  # used only by critic estimators (gae): no reward model
  if variant == "tiny":
    quickstart.shrink_to_tiny(config)
    config.name = "grpo_arith-tiny"
    config.ppo.update(batch_size=16, minibatch_size=8)  # 4 prompts x 4 samples
  return config
