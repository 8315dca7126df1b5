"""Rule-based rewards for the embedded tasks, registered in REWARD_FUNCTIONS.

The reverse task ("reverse_accuracy", "reverse_exact") parses the letters out of the
prompt text ("... rev abcd=") and compares the completion with their reverse; the arith
task ("arith_exact_match", "arith_digit_accuracy") parses the problem ("... 12+57=") and
compares the completion with the result (data/arith.py). All run on host over decoded
strings with the registry's signature `(prompts: list[str], completions: list[str]) ->
np.ndarray` (float32 [batch]). Completions are compared after stripping surrounding
whitespace, which answers never contain, so tokenizer decoding quirks (a leading space)
do not cost reward. A prompt of the wrong task raises a ValueError saying which rewards
apply to which task, rather than scoring 0 silently.
"""

from __future__ import annotations

import operator
import re

import numpy as np

from pipe_rlhf_jax.ppo.registry import REWARD_FUNCTIONS

# The last "rev <letters>=" in the prompt; letters are anything but whitespace and "=".
_PROMPT_RE = re.compile(r"rev ([^\s=]+)=")
# The arith task's operators. Kept apart from the generator's table (data/arith.py) on
# purpose: the reward checks the generated answers independently, and importing the
# generator here would load it twice under `python -m pipe_rlhf_jax.data.arith`.
_ARITH_OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul}
# The last "<digits><operator><digits>=" in the prompt.
_ARITH_RE = re.compile(r"(\d+)([" + re.escape("".join(_ARITH_OPS)) + r"])(\d+)=")


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


def arith_target(prompt: str) -> str:
  """The correct completion for an arith-task prompt ("12+57=" -> "69").

  Raises:
    ValueError: the prompt holds no "<digits><operator><digits>=" (the reward is
      configured for a dataset that is not the arith task).
  """
  matches = _ARITH_RE.findall(prompt)
  if not matches:
    raise ValueError(
        f"Prompt {prompt[:80]!r} is not an arith-task prompt ('<digits><op><digits>=' "
        f"with op in {''.join(_ARITH_OPS)!r}); the arith_* rewards only apply to "
        "data.task='arith'.")
  a, op, b = matches[-1]
  return str(_ARITH_OPS[op](int(a), int(b)))


@REWARD_FUNCTIONS.register("arith_exact_match")
def arith_exact_match(prompts: list[str], completions: list[str]) -> np.ndarray:
  """1.0 where the completion is exactly the result ("69"; "069" is wrong), else 0.0.

  Returns float32 [batch].
  """
  _check_batch(prompts, completions)
  scores = [float(c.strip() == arith_target(p)) for p, c in zip(prompts, completions)]
  return np.asarray(scores, dtype=np.float32).reshape(len(prompts))


@REWARD_FUNCTIONS.register("arith_digit_accuracy")
def arith_digit_accuracy(prompts: list[str], completions: list[str]) -> np.ndarray:
  """Partial credit: positional accuracy of the answer aligned at its last digit.

  Digits are compared units with units, tens with tens (right-aligned, so a missing
  leading digit does not shift the rest), over the longer of the two lengths, as
  `accuracy`: "68" for "69" scores 0.5, "9" scores 0.5, "169" scores 2/3. A smoother
  signal than the exact match for evaluation; float32 [batch] in [0, 1].
  """
  _check_batch(prompts, completions)
  scores = [accuracy(arith_target(p)[::-1], c.strip()[::-1])
            for p, c in zip(prompts, completions)]
  return np.asarray(scores, dtype=np.float32).reshape(len(prompts))
