"""Held-out evaluation: what the policy answers to prompts it never trained on.

Owns the rules scored on held-out prompts (`rule_rewards_to_report`), the answers at one
point of a run and their scores, per prompt and mean (`heldout_eval`, `HeldoutEval`):
greedy (temperature 0: what the policy answers without the luck of sampling) and, with
`log.eval_samples_per_prompt` = k > 0, k samples per prompt from PPO's own sampling
distribution (what PPO optimises, measured on many more answers than a training batch);
the paired comparison of two such points (`paired_change`: is "after" worse than
"before" beyond what the choice of prompts explains?); and the summary lines comparing
before and after PPO.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from flax import nnx
import jax
import numpy as np

from pipe_rlhf_jax import distributed
from pipe_rlhf_jax.generation.sampler import SamplingSettings, generate_repeated
from pipe_rlhf_jax.ppo.registry import REWARD_FUNCTIONS, score_rule
from pipe_rlhf_jax.ppo.types import decode_answers


def rule_rewards_to_report(settings) -> dict[str, Any]:
  """The rules scored on the held-out prompts (name -> function) of the experiment's
  settings (`config.ExperimentSettings`): none when `log.eval_prompts` is 0; else
  `reward.fn` when it is a rule, and `reward.eval_fn` when set. (With an environment
  the held-out episodes report its reward instead: `heldout_eval`'s `episodes`.)"""
  if not settings.log.eval_prompts:
    return {}
  reward = settings.reward
  names = [] if reward.uses_model or reward.uses_environment else [reward.fn]
  if reward.eval_fn and reward.eval_fn not in names:
    names.append(reward.eval_fn)
  return {name: REWARD_FUNCTIONS.get(name) for name in names}


@dataclasses.dataclass
class HeldoutEval:
  """The policy's completions of the held-out prompts at one point of the run.

  Attributes:
    samples: 'prompt -> completion' lines of the first `log.samples` prompts (their first
      completion).
    scores: rule name -> mean score over all `num_prompts` held-out prompts.
    num_prompts: how many held-out prompts were scored.
    per_prompt: rule name -> each prompt's score [num_prompts] (the mean over its
      completions), in the prompts' order (the same at every point of a run:
      `paired_change` pairs them).
    samples_per_prompt: 0 for greedy answers, else the completions drawn per prompt.
  """

  samples: list[str]
  scores: dict[str, float]
  num_prompts: int
  per_prompt: dict[str, list[float]] = dataclasses.field(default_factory=dict)
  samples_per_prompt: int = 0

  @property
  def decoding(self) -> str:
    """How the answers were made, as the summary names it."""
    return ("greedy" if not self.samples_per_prompt
            else f"sampled ({self.samples_per_prompt} per prompt)")


def heldout_eval(graphdef, params, batch, tokenizer, sampling: SamplingSettings,
                 rules: dict[str, Any], num_samples: int, samples_per_prompt: int = 0,
                 episodes=None) -> HeldoutEval:
  """Completions of a batch of held-out prompts, and their scores.

  `samples_per_prompt` = 0: one greedy (temperature 0) answer per prompt, what the
  policy has learned without the luck of sampling. k > 0: k completions per prompt from
  `sampling`'s distribution (temperature, top-k, top-p), each drawn with the key of its
  position in the batch (`sample_ids`), so the draws do not depend on the layout the
  model runs on and the before and after of a run share their random numbers (a paired
  comparison then sees the policy's change, not two draws' difference).

  With `episodes` (a `stages.episodes.EpisodeRunner`) each answer is a whole episode
  with the environment, scored by the environment's reward (named after it) and by
  whether the episode called a tool (`<env>_tool_calls`: the fraction of its episodes
  with a tool message); `rules` are not used.
  """
  model = nnx.merge(graphdef, params)
  k = max(samples_per_prompt, 1)
  # Greedy: temperature 0 (top-k / top-p then select nothing the argmax would not).
  decoding = sampling if samples_per_prompt else dataclasses.replace(sampling, temperature=0.0)
  if episodes is not None:
    return _episode_eval(model, batch, tokenizer, decoding, episodes, num_samples,
                         samples_per_prompt)
  prompt_tokens, prompt_mask, out = generate_repeated(
      model, batch["prompt_tokens"], batch["prompt_mask"], k, decoding, rng=jax.random.key(0))
  tokens, mask = distributed.fetch((out.tokens, out.mask))
  prompts = [tokenizer.decode(p[m]) for p, m in zip(prompt_tokens, prompt_mask)]
  completions = [tokenizer.decode(c[m]) for c, m in zip(tokens, mask)]
  lines = [f"{p!r} -> {c!r}"
           for p, c in zip(prompts[::k][:num_samples], completions[::k])]
  # Each prompt's reference answer (when the prompts carry them), for each of its k rows.
  answers = (np.repeat(decode_answers(batch["answer_bytes"]), k).tolist()
             if "answer_bytes" in batch else None)
  per_prompt = {name: score_rule(fn, prompts, completions, answers, np.float64)
                .reshape(-1, k).mean(1) for name, fn in rules.items()}
  return HeldoutEval(lines, {name: float(v.mean()) for name, v in per_prompt.items()},
                     len(prompts) // k, {name: v.tolist() for name, v in per_prompt.items()},
                     samples_per_prompt)


def _episode_eval(model, batch, tokenizer, decoding: SamplingSettings, runner,
                  num_samples: int, samples_per_prompt: int) -> HeldoutEval:
  """`heldout_eval` of multi-turn episodes (`runner`), k of each prompt."""
  from pipe_rlhf_jax.stages.episodes import model_turns
  k = max(samples_per_prompt, 1)
  first, following = model_turns(model, decoding, runner.turn_tokens, jax.random.key(0), k)
  out = runner.run(batch, k, first, following)
  prompts = [tokenizer.decode(p[m]) for p, m in zip(out.prompt_tokens, out.prompt_mask)]
  transcripts = [tokenizer.decode(c[m]) for c, m in zip(out.completion_tokens,
                                                        out.completion_mask)]
  lines = [f"{p!r} -> {c!r}" for p, c in zip(prompts[::k][:num_samples], transcripts[::k])]
  name = runner.settings.name
  called = np.asarray([any(r.role == "tool" for r in rs) for rs in out.replies], np.float64)
  per_prompt = {name: out.scores.astype(np.float64).reshape(-1, k).mean(1),
                f"{name}_tool_calls": called.reshape(-1, k).mean(1)}
  return HeldoutEval(lines, {n: float(v.mean()) for n, v in per_prompt.items()},
                     len(prompts) // k, {n: v.tolist() for n, v in per_prompt.items()},
                     samples_per_prompt)


@dataclasses.dataclass(frozen=True)
class PairedChange:
  """How one rule's per-prompt scores changed between two points of a run.

  Attributes:
    delta: mean of after - before over the prompts (= the change of the mean score).
    low, high: the 95% bootstrap interval of `delta` (prompts resampled with their pairs).
    worse, better: prompts whose score went down / up.
  """

  delta: float
  low: float
  high: float
  worse: int
  better: int

  @property
  def significantly_worse(self) -> bool:
    """The whole 95% interval is below 0: a drop that the held-out prompts' sampling
    does not explain."""
    return self.high < 0.0


def paired_change(before, after, resamples: int = 10_000, seed: int = 0) -> PairedChange:
  """The paired change of per-prompt scores `before` -> `after` (same prompts, same order).

  Greedy scores are deterministic, so a drop of the mean is real for these prompts; what
  it says about the task is another matter: with 256 prompts a few answers changing
  either way moves the mean by 0.01. The bootstrap interval over prompts (the pairs
  resampled together, a fixed seed so the result is reproducible) separates the two.
  """
  before, after = np.asarray(before, np.float64), np.asarray(after, np.float64)
  if before.shape != after.shape or before.ndim != 1 or not before.size:
    raise ValueError(f"paired_change needs two equally long, non-empty score lists, got "
                     f"shapes {before.shape} and {after.shape}")
  diff = after - before
  idx = np.random.default_rng(seed).integers(0, diff.size, (resamples, diff.size))
  means = diff[idx].mean(axis=1)
  low, high = np.quantile(means, [0.025, 0.975])
  return PairedChange(float(diff.mean()), float(low), float(high), int((diff < 0).sum()),
                      int((diff > 0).sum()))


def summary_lines(before: HeldoutEval, after: HeldoutEval) -> dict[str, str]:
  """Summary lines "held-out <decoding> <rule>": "before -> after (N prompts; the change,
  its 95% interval over prompts, how many prompts got worse / better)"."""
  lines = {}
  for name in after.scores:
    text = f"{before.scores[name]:.3f} -> {after.scores[name]:.3f} ({after.num_prompts} prompts"
    if before.per_prompt.get(name) and after.per_prompt.get(name):
      c = paired_change(before.per_prompt[name], after.per_prompt[name])
      text += (f"; change {c.delta:+.3f}, 95% interval [{c.low:+.3f}, {c.high:+.3f}], "
               f"{c.worse} worse / {c.better} better")
    lines[f"held-out {after.decoding} {name}"] = text + ")"
  return lines
