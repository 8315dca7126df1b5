"""Rule-based rewards for the embedded "reverse" task, registered in REWARD_FUNCTIONS.

Both functions parse the letters out of the prompt text ("... rev abcd=") and compare
the completion with their reverse. They run on host over decoded strings with the
registry's signature `(prompts: list[str], completions: list[str]) -> np.ndarray`
(float32 [batch]). Completions are compared after stripping surrounding whitespace,
which the letters never contain, so tokenizer decoding quirks (a leading space) do not
cost reward.
"""

from __future__ import annotations

import re

import numpy as np

from pipe_rlhf_jax.ppo.registry import REWARD_FUNCTIONS

# The last "rev <letters>=" in the prompt; letters are anything but whitespace and "=".
_PROMPT_RE = re.compile(r"rev ([^\s=]+)=")


def reverse_target(prompt: str) -> str:
  """The correct completion for a reverse-task prompt.

  Raises:
    ValueError: the prompt holds no "rev <letters>=" (the reward is configured for a
      dataset that is not the reverse task).
  """
  matches = _PROMPT_RE.findall(prompt)
  if not matches:
    raise ValueError(
        f"Prompt {prompt[:80]!r} is not a reverse-task prompt ('rev <letters>='); the "
        "reverse_* rewards only apply to the embedded reverse task."
    )
  return matches[-1][::-1]


def _check_batch(prompts, completions) -> None:
  if len(prompts) != len(completions):
    raise ValueError(
        f"Reward got {len(prompts)} prompts but {len(completions)} completions."
    )


def accuracy(target: str, completion: str) -> float:
  """Fraction of aligned positions that match, over the longer of the two lengths.

  Missing characters count as wrong and extra characters enlarge the denominator, so a
  wrong length is penalised; unrelated text scores ~0 and an empty completion 0.
  """
  completion = completion.strip()
  denom = max(len(target), len(completion))
  if denom == 0:
    return 0.0
  hits = sum(a == b for a, b in zip(target, completion))
  return hits / denom


@REWARD_FUNCTIONS.register("reverse_accuracy")
def reverse_accuracy(prompts: list[str], completions: list[str]) -> np.ndarray:
  """Per-example positional accuracy of the reversed letters, float32 [batch] in [0, 1]."""
  _check_batch(prompts, completions)
  scores = [accuracy(reverse_target(p), c) for p, c in zip(prompts, completions)]
  return np.asarray(scores, dtype=np.float32).reshape(len(prompts))


@REWARD_FUNCTIONS.register("reverse_exact")
def reverse_exact(prompts: list[str], completions: list[str]) -> np.ndarray:
  """1.0 where the completion is exactly the reversed letters, else 0.0; float32 [batch]."""
  _check_batch(prompts, completions)
  scores = [float(c.strip() == reverse_target(p)) for p, c in zip(prompts, completions)]
  return np.asarray(scores, dtype=np.float32).reshape(len(prompts))
