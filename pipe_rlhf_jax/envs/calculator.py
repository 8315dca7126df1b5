"""The "calculator" environment: arithmetic word problems with a calculator tool.

An assistant turn that holds `<calc>EXPRESSION</calc>` calls the calculator: the reply,
a tool message, is the value of each call in the turn ("84"; several calls: one value
per line; an expression it cannot evaluate: "error: ..."), and the episode goes on. A
turn without a call is the final answer: the episode ends, and its reward is 1 when the
answer's last number (or its boxed / `####` answer) equals the prompt's reference
answer, by the `math_verify` rule (`data/math_reward.py`), else 0. An episode that ends
otherwise (on a tool call at its last turn, out of tokens) is scored on its last turn
the same way.

Expressions are integers and decimals with + - * / // % ** and parentheses, evaluated
exactly on the parsed syntax tree (Python's `ast`), never by `eval`; a power's exponent is
bounded, so no expression can run long.

The embedded task is `data.task="word_problems"` with a system message describing the
tool (`configs/calculator_tool.py`), and demonstrations that are a first tool call
(`data.word_problems.demo_style="calculator"`), which SFT teaches before RL.
"""

from __future__ import annotations

import ast
import operator
import re
from typing import Any, Sequence

from pipe_rlhf_jax.data.math_reward import math_verify
from pipe_rlhf_jax.envs.base import ENVIRONMENTS, Environment, Reply, Turn

CALL_RE = re.compile(r"<calc>(.*?)</calc>", re.DOTALL)
MAX_CALLS = 4  # per turn: values after these are not computed
MAX_EXPRESSION = 200  # characters
MAX_EXPONENT = 64

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
           ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def evaluate(expression: str) -> int | float:
  """The value of an arithmetic expression ("12*7" -> 84; "x" or 2**999 raise ValueError)."""
  text = expression.strip().replace("×", "*").replace("x", "*").replace("^", "**")
  if not text or len(text) > MAX_EXPRESSION:
    raise ValueError(f"expression of {len(text)} characters (1 to {MAX_EXPRESSION})")
  try:
    tree = ast.parse(text, mode="eval")
  except SyntaxError:
    raise ValueError(f"cannot parse {expression.strip()!r}") from None

  def value(node: ast.AST):
    if isinstance(node, ast.Expression):
      return value(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
      return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
      return _UNARY[type(node.op)](value(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
      left, right = value(node.left), value(node.right)
      if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
        raise ValueError(f"exponent {right} is over {MAX_EXPONENT}")
      try:
        return _BINARY[type(node.op)](left, right)
      except ZeroDivisionError:
        raise ValueError("division by zero") from None
    raise ValueError(f"cannot evaluate {expression.strip()!r}: numbers and + - * / // % ** "
                     "( ) only")

  return value(tree)


def format_value(x: int | float) -> str:
  """A value as the tool writes it: integers without a decimal point."""
  if isinstance(x, float) and x.is_integer() and abs(x) < 1e15:
    return str(int(x))
  return str(x) if isinstance(x, int) else f"{x:.6g}"


def calls(text: str) -> list[str]:
  """The expressions of the calculator calls in `text`, in order."""
  return CALL_RE.findall(text)


@ENVIRONMENTS.register("calculator")
class Calculator(Environment):
  """A calculator tool for arithmetic problems (see the module docstring)."""

  def step(self, state: Any, turn: Turn) -> Reply | None:
    expressions = calls(turn.text)
    if not expressions:
      return None  # the final answer
    values = []
    for expression in expressions[:MAX_CALLS]:
      try:
        values.append(format_value(evaluate(expression)))
      except (ValueError, OverflowError) as e:
        values.append(f"error: {e}")
    return Reply("\n".join(values), role="tool")

  def reward(self, state: Any, turns: Sequence[Turn]) -> float:
    if not turns or state.get("answer") is None:
      return 0.0
    last = turns[-1].text
    if calls(last):  # ended on a call: no answer given
      return 0.0
    return float(math_verify([state["prompt"]], [last], answers=[state["answer"]])[0])
