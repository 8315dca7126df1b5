"""A verifiable math reward: the completion's final answer against the reference answer.

Registered as "math_verify" in `ppo.registry.REWARD_FUNCTIONS`, with the rule signature
`(prompts, completions, answers) -> float32 [batch]` (answers: each prompt record's
"answer", carried with the rollout; see data/records.py). A completion scores 1.0 when
its final answer is mathematically equal to the reference, else 0.0.

Two steps, and who does what:

* Extraction (`extract_answer`, here, plain regular expressions): the content of the
  last `\\boxed{...}` (or `\\fbox{...}`), else what follows GSM8K's last `#### `, else the
  last number in the text ("the answer is 3.0" -> "3.0"; "1,234", "-7", "3/4", ".5").
  A reference that is itself a worked solution ("... #### 72") is reduced the same
  way; a bare reference ("72", "\\frac{1}{2}") is used as it is.
* Equivalence: the `math-verify` library (`math_verify.parse` then `verify`, on both
  answers as inline LaTeX), which reads LaTeX and plain numbers into sympy and compares
  them numerically and symbolically (`\\frac{1}{2}` = `0.5`, `3.0` = `3`, `1,000` =
  `1000`). A well-kept library rather than a LaTeX parser of our own: answer formats
  have a long tail, and a reward that misreads them trains the policy on noise.

Bounded cost. sympy can take unboundedly long on adversarial answers (`9^{9^{9^9}}`),
inside C code that no Python signal interrupts, and math-verify's own timeouts use
SIGALRM, which only works in a main thread (the inference stage of `pipe` mode runs in a
worker thread). So the checks run in a child process (data/math_verify_worker.py,
started on first use, kept for the run) with a deadline per answer: an answer that
overruns scores 0.0, the child is killed and restarted, and the overrun is logged.
Extracted answers longer than `MAX_ANSWER_CHARS` score 0.0 without a check. Repeated
(reference, answer) pairs in a batch, as the samples of one prompt often give, are
checked once.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import re
import select
import subprocess
import sys
import threading
import time
from typing import Sequence

import numpy as np

from pipe_rlhf_jax.ppo.registry import REWARD_FUNCTIONS

_log = logging.getLogger(__name__)

# Seconds one (reference, answer) check may take; math-verify's own default per call.
DEFAULT_TIMEOUT_S = 5.0
# Seconds the child may take to import math-verify (sympy) on a loaded host.
STARTUP_TIMEOUT_S = 120.0
# Longer "answers" are not final answers (e.g. a box around a whole derivation).
MAX_ANSWER_CHARS = 512

_WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "math_verify_worker.py")
_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_GSM8K = re.compile(r"####[ \t]*([^\n]*)")
# A number not glued to a preceding word or digit by its minus sign ("3-9" ends in "9"),
# with thousands separators, decimals or a simple fraction.
_NUMBER = re.compile(r"(?:(?<![\w)\]])-)?(?:\d+(?:,\d{3})*(?:\.\d+)?(?:/\d+)?|\.\d+)")


def _last_boxed(text: str) -> str | None:
  """The content of the last `\\boxed{...}` with balanced braces, or None."""
  for match in reversed(list(_BOXED.finditer(text))):
    depth, start = 1, match.end()
    for i in range(start, len(text)):
      depth += {"{": 1, "}": -1}.get(text[i], 0)
      if depth == 0:
        return text[start:i]
  return None


def _clean(answer: str) -> str:
  return answer.strip().strip("$").strip().rstrip(".").strip()


def extract_answer(text: str) -> str | None:
  """The final answer of a completion (see the module docstring), or None."""
  boxed = _last_boxed(text)
  if boxed is not None and _clean(boxed):
    return _clean(boxed)
  marked = _GSM8K.findall(text)
  if marked and _clean(marked[-1]):
    return _clean(marked[-1])
  numbers = _NUMBER.findall(text)
  return numbers[-1] if numbers else None


def reference_answer(answer: str) -> str:
  """The reference to compare with: a worked solution's final answer, else `answer`."""
  if "####" in answer or _BOXED.search(answer):
    return extract_answer(answer) or _clean(answer)
  return _clean(answer)


class AnswerChecker:
  """Equivalence of answer pairs by math-verify, in a child process, each under a deadline.

  Thread-safe (one check at a time); the child starts on first use and is stopped at
  interpreter exit or by `close`.

  Args:
    timeout_s: seconds one check may take before it scores False and the child is
      restarted.
  """

  def __init__(self, timeout_s: float = DEFAULT_TIMEOUT_S):
    if not timeout_s > 0:
      raise ValueError(f"timeout_s={timeout_s!r} must be > 0.")
    self.timeout_s = float(timeout_s)
    self.timeouts = 0  # checks that overran their deadline
    self._proc: subprocess.Popen | None = None
    self._buffer = b""
    self._lock = threading.Lock()
    self._closing_registered = False

  # ---- the child ---------------------------------------------------------------------

  def _start(self) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, _WORKER], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, bufsize=0)
    self._proc, self._buffer = proc, b""
    if not self._closing_registered:
      atexit.register(self.close)
      self._closing_registered = True
    line = self._readline(STARTUP_TIMEOUT_S)
    if line != b"ready":
      self._kill()
      detail = line.decode(errors="replace") if line else "no answer"
      raise RuntimeError(f"The math-verify checker process did not start ({detail}); "
                         f"run {sys.executable} {_WORKER} to see why.")
    return proc

  def _readline(self, timeout_s: float) -> bytes | None:
    """The child's next line, or None when it does not come in time (or the child died)."""
    deadline = time.monotonic() + timeout_s
    fd = self._proc.stdout.fileno()
    while b"\n" not in self._buffer:
      remaining = deadline - time.monotonic()
      if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
        return None
      chunk = os.read(fd, 4096)
      if not chunk:  # the child exited
        return None
      self._buffer += chunk
    line, self._buffer = self._buffer.split(b"\n", 1)
    return line.strip()

  def _kill(self) -> None:
    if self._proc is not None:
      self._proc.kill()
      self._proc.wait()
      for pipe in (self._proc.stdin, self._proc.stdout):
        pipe.close()
    self._proc, self._buffer = None, b""

  def close(self) -> None:
    """Stops the child (a later check starts a new one)."""
    with self._lock:
      self._kill()

  # ---- checks ------------------------------------------------------------------------

  def _check(self, gold: str, pred: str) -> bool:
    if self._proc is None:
      self._start()
    request = json.dumps({"gold": gold, "pred": pred}).encode() + b"\n"
    try:
      self._proc.stdin.write(request)
    except BrokenPipeError:
      line = None
    else:
      line = self._readline(self.timeout_s)
    if line is None:
      self.timeouts += 1
      _log.warning("math-verify did not compare %r with %r within %.1fs; scored 0 and "
                   "restarting its process (%d so far).", gold[:80], pred[:80],
                   self.timeout_s, self.timeouts)
      self._kill()
      return False
    return line == b"1"

  def equivalent(self, pairs: Sequence[tuple[str, str]]) -> list[bool]:
    """For each (reference, answer) pair, whether math-verify finds them equal."""
    with self._lock:
      memo: dict[tuple[str, str], bool] = {}
      for pair in pairs:
        if pair not in memo:
          memo[pair] = self._check(*pair)
      return [memo[pair] for pair in pairs]

  def score(self, answers: Sequence[str], completions: Sequence[str]) -> np.ndarray:
    """1.0 where a completion's final answer equals its reference, else 0.0; f32 [batch]."""
    if len(answers) != len(completions):
      raise ValueError(f"{len(answers)} reference answers for {len(completions)} "
                       "completions.")
    pairs, rows = [], []
    for row, (answer, completion) in enumerate(zip(answers, completions)):
      pred = extract_answer(completion)
      gold = reference_answer(answer)
      if pred and gold and len(pred) <= MAX_ANSWER_CHARS:
        pairs.append((gold, pred))
        rows.append(row)
    scores = np.zeros(len(completions), np.float32)
    scores[rows] = np.asarray(self.equivalent(pairs), np.float32)
    return scores


_CHECKER: AnswerChecker | None = None
_CHECKER_LOCK = threading.Lock()


def default_checker() -> AnswerChecker:
  """The process's shared checker (one child process), created on first use."""
  global _CHECKER
  with _CHECKER_LOCK:
    if _CHECKER is None:
      _CHECKER = AnswerChecker()
    return _CHECKER


@REWARD_FUNCTIONS.register("math_verify")
def math_verify(prompts: list[str], completions: list[str], answers: list[str]) -> np.ndarray:
  """1.0 where the completion's final answer equals the prompt's reference answer by
  math-verify, else 0.0 (garbage, no answer, an overrun check); float32 [batch]."""
  if len(prompts) != len(completions):
    raise ValueError(f"Reward got {len(prompts)} prompts but {len(completions)} completions.")
  return default_checker().score(answers, completions)
