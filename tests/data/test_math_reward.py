"""The math_verify rule (data/math_reward.py): extraction, equivalence, bounded checks."""

import threading
import time

import numpy as np
import pytest

pytest.importorskip("math_verify")

from pipe_rlhf_jax.data import math_reward  # noqa: E402
from pipe_rlhf_jax.data.math_reward import AnswerChecker, extract_answer  # noqa: E402
from pipe_rlhf_jax.ppo.registry import REWARD_FUNCTIONS, rule_answers  # noqa: E402


@pytest.mark.parametrize("completion, answer", [
    (r"So the result is \boxed{\frac{1}{2}}.", r"\frac{1}{2}"),
    (r"\boxed{1} first, then \boxed{\sqrt{\frac{3}{4}}}", r"\sqrt{\frac{3}{4}}"),
    ("She has 5 + 7 = 12 apples.\n#### 12", "12"),
    ("#### $1,250.", "1,250"),
    ("the answer is 3.0", "3.0"),
    ("from 3-9 we get -6", "-6"),
    ("the temperature fell to -4 degrees", "-4"),
    ("3/4 of 8 is 6, so 3/4", "3/4"),
    ("no digits here", None),
    ("", None),
    (r"\boxed{unclosed 5", "5"),  # an unbalanced box is no box: the last number
])
def test_extract_answer(completion, answer):
  assert extract_answer(completion) == answer


RULE_CASES = [
    # (completion, reference, score)
    (r"The probability is \boxed{\frac{1}{2}}.", "0.5", 1.0),
    (r"\boxed{0.5}", r"\frac{1}{2}", 1.0),
    ("Each box holds 6, and 7 boxes hold 42.\n#### 42", "42", 1.0),
    ("the answer is 3.0", "3", 1.0),
    ("#### 1,000", "1000", 1.0),
    ("So he paid $18.", "18", 1.0),
    # A reference that is a worked solution counts by its final answer.
    ("72", "Natalia sold 48/2 = 24 clips in May.\n48+24 = 72\n#### 72", 1.0),
    (r"\boxed{\frac{\sqrt 3}{2}}", r"\frac{\sqrt{3}}{2}", 1.0),
    # Wrong answers.
    ("#### 41", "42", 0.0),
    ("the answer is 3.5", "3", 0.0),
    (r"\boxed{\frac{1}{3}}", "0.5", 0.0),
    ("I think it is 7, no wait, 8", "7", 0.0),  # the last number counts
    # Nothing to read.
    ("", "42", 0.0),
    ("}}{{\\boxed{ $$ \\frac{ #### ", "42", 0.0),
    ("\x00\ufffd" * 50, "1", 0.0),
]


def test_math_verify_rule_on_real_cases():
  assert "math_verify" in REWARD_FUNCTIONS
  rule = REWARD_FUNCTIONS.get("math_verify")
  assert rule_answers(rule) == "required"
  completions, answers, expected = zip(*RULE_CASES)
  scores = rule(["q"] * len(completions), list(completions), list(answers))
  assert scores.dtype == np.float32 and scores.shape == (len(RULE_CASES),)
  np.testing.assert_array_equal(scores, np.asarray(expected, np.float32))


def test_an_adversarial_answer_is_bounded_and_the_checker_recovers():
  checker = AnswerChecker(timeout_s=1.0)
  try:
    start = time.perf_counter()
    # sympy would evaluate the tower of powers for as long as it is allowed to.
    scores = checker.score(["5", "4"], [r"\boxed{9^{9^{9^{9}}}}", "#### 4"])
    elapsed = time.perf_counter() - start
    np.testing.assert_array_equal(scores, [0.0, 1.0])
    assert checker.timeouts == 1
    assert elapsed < 30, elapsed  # one deadline and a restart, not the computation
    np.testing.assert_array_equal(checker.score(["2"], ["2.0"]), [1.0])
  finally:
    checker.close()


def test_the_rule_works_from_a_worker_thread():
  # The inference stage of `pipe` mode runs in a thread, where signal-based timeouts
  # cannot be set; the checks run in the child process either way.
  result = {}
  thread = threading.Thread(target=lambda: result.update(
      scores=math_reward.math_verify(["q", "q"], [r"\boxed{2}", "#### 3"], ["2", "4"])))
  thread.start()
  thread.join(timeout=120)
  np.testing.assert_array_equal(result["scores"], [1.0, 0.0])


def test_batch_mismatches_are_errors():
  with pytest.raises(ValueError, match="2 reference answers for 1 completions"):
    math_reward.math_verify(["q"], ["1"], ["1", "2"])
  with pytest.raises(ValueError, match="timeout_s"):
    AnswerChecker(timeout_s=0)
