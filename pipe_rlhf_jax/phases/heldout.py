"""Held-out greedy evaluation: what the policy answers without the luck of sampling.

Owns the rules scored on held-out prompts (`rule_rewards_to_report`), the greedy
(temperature 0) answers and their mean scores at one point of a run (`greedy_eval`,
`GreedyEval`), and the summary lines comparing before and after PPO.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np
from flax import nnx

from pipe_rlhf_jax import distributed
from pipe_rlhf_jax.generation.sampler import SamplingParams, generate
from pipe_rlhf_jax.phases.warm_start import uses_reward_model
from pipe_rlhf_jax.ppo.registry import REWARD_FUNCTIONS


def rule_rewards_to_report(config) -> dict[str, Any]:
  """The rules scored on the held-out prompts (name -> function): none when
  `log.eval_prompts` is 0 (or absent); else `reward.fn` when it is a rule, and
  `reward.eval_fn` when set."""
  if not config.log.get("eval_prompts", 0):
    return {}
  names = [] if uses_reward_model(config) else [config.reward.fn]
  if config.reward.eval_fn and config.reward.eval_fn not in names:
    names.append(config.reward.eval_fn)
  return {name: REWARD_FUNCTIONS.get(name) for name in names}


@dataclasses.dataclass
class GreedyEval:
  """Greedy completions of the held-out prompts at one point of the run.

  Attributes:
    samples: 'prompt -> completion' lines of the first `log.samples` prompts.
    scores: rule name -> mean score over all `num_prompts` held-out prompts.
    num_prompts: how many held-out prompts were scored.
  """

  samples: list[str]
  scores: dict[str, float]
  num_prompts: int


def greedy_eval(graphdef, params, batch, tokenizer, sampling: SamplingParams,
                rules: dict[str, Any], num_samples: int) -> GreedyEval:
  """Greedy (temperature 0) completions of a batch of held-out prompts, and their scores.

  Greedy answers say what the policy has learned without the luck of sampling: the
  number to compare before and after RL.
  """
  model = nnx.merge(graphdef, params)
  out = generate(model, batch["prompt_tokens"], batch["prompt_mask"], sampling.max_new_tokens,
                 rng=jax.random.key(0), temperature=0.0, eos_id=sampling.eos_id,
                 pad_id=sampling.pad_id)
  tokens, mask = distributed.fetch((out.tokens, out.mask))
  prompts = [tokenizer.decode(p[m]) for p, m in zip(batch["prompt_tokens"], batch["prompt_mask"])]
  completions = [tokenizer.decode(c[m]) for c, m in zip(tokens, mask)]
  lines = [f"{p!r} -> {c!r}" for p, c in zip(prompts[:num_samples], completions)]
  scores = {name: float(np.mean(fn(prompts, completions))) for name, fn in rules.items()}
  return GreedyEval(lines, scores, len(prompts))


def summary_lines(before: GreedyEval, after: GreedyEval) -> dict[str, str]:
  """Summary lines "held-out greedy <rule>": "before -> after (N prompts)"."""
  return {f"held-out greedy {name}": f"{before.scores[name]:.3f} -> {after.scores[name]:.3f} "
                                     f"({after.num_prompts} prompts)"
          for name in after.scores}
