"""The calculator environment: expressions, replies, rewards, and its demonstrations."""

import pytest

from pipe_rlhf_jax.data.word_problems import WordProblemSettings, make_word_problem_records
from pipe_rlhf_jax.envs import Reply, Turn, make_environment
from pipe_rlhf_jax.envs.calculator import evaluate


def turn(text, index=0):
  return Turn(text=text, tokens=(), index=index, ended=True)


@pytest.mark.parametrize("expression, value", [
    ("12*7", 84), (" 23 x 17 ", 391), ("(2+3)*4", 20), ("7/2", 3.5), ("2^10", 1024),
    ("-3+5", 2), ("17 // 5", 3)])
def test_expressions_evaluate_exactly(expression, value):
  assert evaluate(expression) == value


@pytest.mark.parametrize("expression, message", [
    ("import os", "cannot parse"), ("__import__('os')", "cannot evaluate"),
    ("1/0", "division by zero"), ("2**999", "exponent"), ("", "characters"),
    ("9" * 300, "characters")])
def test_bad_expressions_are_errors_not_evaluations(expression, message):
  with pytest.raises(ValueError, match=message):
    evaluate(expression)


def test_a_call_gets_its_value_and_a_final_answer_is_scored():
  env = make_environment("calculator")
  state = env.start("Each of the 23 boxes holds 17 cards.", "391")
  assert env.step(state, turn("<calc>23*17</calc>")) == Reply("391", role="tool")
  assert env.step(state, turn("<calc>1/0</calc> and <calc>2+2</calc>")) == Reply(
      "error: division by zero\n4", role="tool")
  assert env.step(state, turn("The answer is 391.", 1)) is None
  assert env.reward(state, [turn("<calc>23*17</calc>"), turn("391", 1)]) == 1.0
  assert env.reward(state, [turn("<calc>23*17</calc>"), turn("390", 1)]) == 0.0
  # An episode that ended on a call gave no answer.
  assert env.reward(state, [turn("<calc>391</calc>")]) == 0.0


def test_calculator_demonstrations_are_tool_calls():
  spec = WordProblemSettings(operations="*", max_factor=30, demo_style="calculator")
  demos = make_word_problem_records(0, 4, seed=0, spec=spec)["demos"]
  for demo in demos:
    text = demo["messages"][-1]["content"]
    a, b = (int(x) for x in demo["completion"][len("<calc>"):-len("</calc>")].split("*"))
    assert f"{a}" in text and f"{b}" in text
  with pytest.raises(ValueError, match="word_problems.demo_style"):
    WordProblemSettings(demo_style="essay")
