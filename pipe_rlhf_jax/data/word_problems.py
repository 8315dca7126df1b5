"""The embedded chat task "word_problems": arithmetic word problems with integer answers.

A record is a one-turn conversation and its reference answer,

  {"messages": [{"role": "user", "content": "Mia has 12 apples and buys 7 more. How
   many apples does Mia have now?"}], "answer": "19"}

rendered through the policy's own chat template, so a pretrained chat model is prompted
the way it was trained, and scored by the `math_verify` rule (data/math_reward.py: the
last number of the answer, or a `\\boxed{}` / `####` answer, equal to the reference).
Problems add, take away or multiply one- and two-digit numbers in a few phrasings each;
the difficulty is chosen by the operand range and the operations (`WordProblemSettings`).

* Held-out problems never occur among the training prompts: no (phrasing, operation,
  operands) triple is shared, so a policy cannot pass the held-out split by memorising.
* Demonstrations (used only when SFT is on) are the short worked answer "12 + 7 = 19.
  The answer is 19.": exact, since a pretrained model needs the format, not the noise.
  With `demo_style="calculator"` they are instead the first turn of a calculator episode
  (`envs/calculator.py`), the call "<calc>12+7</calc>": SFT then teaches the tool's
  format and RL when and how to use its result.
* Everything is a pure function of the seed; the record kinds draw from independent
  streams, so changing `num_demos` does not change the prompts.

Runnable as `python -m pipe_rlhf_jax.data.word_problems --out_dir DIR`.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any, Mapping

import numpy as np

from pipe_rlhf_jax.checks import check_int, from_section
from pipe_rlhf_jax.data.task import write_task_files

NAMES = ("Mia", "Tom", "Ava", "Leo", "Zoe", "Sam", "Ivy", "Max", "Eva", "Ben", "Lily", "Omar")
ITEMS = ("apples", "stickers", "marbles", "books", "pencils", "cookies", "shells", "cards",
         "coins", "stamps", "flowers", "balloons")
CONTAINERS = ("boxes", "bags", "jars", "baskets", "packs", "rows")

# Operation -> phrasings; {n}: a name, {i}: items, {c}: containers, {a} / {b}: operands.
TEMPLATES = {
    "+": (
        "{n} has {a} {i} and gets {b} more. How many {i} does {n} have now?",
        "There are {a} {i} on a table. {n} puts {b} more on it. How many {i} are on the "
        "table now?",
        "{n} collected {a} {i} on Monday and {b} {i} on Tuesday. How many {i} did {n} "
        "collect in all?",
    ),
    "-": (
        "{n} has {a} {i} and gives away {b}. How many {i} does {n} have left?",
        "There were {a} {i} in a bag. {n} took {b} of them out. How many {i} are still in "
        "the bag?",
        "{n} needs {a} {i} and already has {b}. How many more {i} does {n} need?",
    ),
    "*": (
        "{n} has {a} {c} with {b} {i} in each. How many {i} does {n} have in all?",
        "Each of the {a} {c} holds {b} {i}. How many {i} are there altogether?",
    ),
}
OPERATIONS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}

# Files written by `write_word_problem_jsonl`, by role (the reward is a rule: no pairs).
WORD_PROBLEM_FILES = {
    "prompts": "prompts.jsonl",
    "demos": "demos.jsonl",
    "prompts_eval": "prompts_eval.jsonl",
}


@dataclasses.dataclass(frozen=True)
class WordProblemSettings:
  """What problems look like.

  Attributes:
    operations: the operations problems use, a non-empty subset of "+-*".
    max_operand: operands of "+" and "-" are drawn from 1..max_operand (a take-away never
      goes below zero: the larger operand comes first).
    max_factor: operands of "*" are drawn from 2..max_factor.
    system_prompt: an optional system message before the problem ("" for none).
    demo_style: "worked" (demonstrations answer "12 + 7 = 19. The answer is 19.") or
      "calculator" (they call the calculator tool: "<calc>12+7</calc>").
  """

  operations: str = "+-"
  max_operand: int = 49
  max_factor: int = 9
  system_prompt: str = ""
  demo_style: str = "worked"

  def __post_init__(self):
    self.check()

  def check(self, field: str = "word_problems") -> None:
    """Raises ValueError naming `field.<attribute>` for the first bad setting."""
    ops = self.operations
    if (not isinstance(ops, str) or not ops or len(set(ops)) != len(ops)
        or not set(ops) <= set(OPERATIONS)):
      raise ValueError(f"{field}.operations={ops!r} must be distinct symbols from "
                       f"{''.join(OPERATIONS)!r}, e.g. '+-'.")
    check_int(self.max_operand, f"{field}.max_operand", low=2)
    check_int(self.max_factor, f"{field}.max_factor", low=2)
    if not isinstance(self.system_prompt, str):
      raise ValueError(f"{field}.system_prompt must be a string (\"\" for none), got "
                       f"{self.system_prompt!r}.")
    if self.demo_style not in DEMO_STYLES:
      raise ValueError(f"{field}.demo_style={self.demo_style!r}; choose one of "
                       f"{DEMO_STYLES}.")

  @classmethod
  def from_config(cls, section: Mapping[str, Any],
                  field: str = "data.word_problems") -> "WordProblemSettings":
    """From a config section; errors name `field.<key>`."""
    return from_section(cls, section, field, "word_problems")

  def num_problems(self) -> int:
    """How many distinct (operation, phrasing, operands) problems the spec allows."""
    pairs = {"+": self.max_operand ** 2, "-": self.max_operand * (self.max_operand + 1) // 2,
             "*": (self.max_factor - 1) ** 2}
    return sum(pairs[op] * len(TEMPLATES[op]) for op in self.operations)


# (operation, phrasing index, a, b): what decides a problem's arithmetic and wording shape.
Problem = tuple[str, int, int, int]


def _problem(rng: np.random.Generator, spec: WordProblemSettings) -> Problem:
  op = spec.operations[int(rng.integers(0, len(spec.operations)))]
  template = int(rng.integers(0, len(TEMPLATES[op])))
  if op == "*":
    a, b = (int(x) for x in rng.integers(2, spec.max_factor + 1, size=2))
  else:
    a, b = (int(x) for x in rng.integers(1, spec.max_operand + 1, size=2))
    if op == "-" and a < b:
      a, b = b, a
  return op, template, a, b


def solve(problem: Problem) -> int:
  """The problem's integer answer."""
  op, _, a, b = problem
  return OPERATIONS[op](a, b)


def render(problem: Problem, rng: np.random.Generator) -> str:
  """The problem's text, with a name, items and containers drawn from `rng`."""
  op, template, a, b = problem
  return TEMPLATES[op][template].format(
      n=NAMES[int(rng.integers(0, len(NAMES)))], i=ITEMS[int(rng.integers(0, len(ITEMS)))],
      c=CONTAINERS[int(rng.integers(0, len(CONTAINERS)))], a=a, b=b)


def worked_answer(problem: Problem) -> str:
  """A demonstration's completion: the equation, then the answer."""
  op, _, a, b = problem
  symbol = {"+": "+", "-": "-", "*": "x"}[op]
  return f"{a} {symbol} {b} = {solve(problem)}. The answer is {solve(problem)}."


def calculator_call(problem: Problem) -> str:
  """A demonstration's completion in the calculator style: the tool call."""
  op, _, a, b = problem
  return f"<calc>{a}{op}{b}</calc>"


DEMO_STYLES = ("worked", "calculator")


def _messages(text: str, spec: WordProblemSettings) -> list[dict[str, str]]:
  system = [{"role": "system", "content": spec.system_prompt}] if spec.system_prompt else []
  return system + [{"role": "user", "content": text}]


def make_word_problem_records(num_prompts: int, num_demos: int, seed: int,
                              spec: WordProblemSettings = WordProblemSettings(), *,
                              num_eval: int = 0) -> dict[str, list[dict[str, Any]]]:
  """Generates the task's records deterministically from `seed`.

  Args:
    num_prompts: training prompts (for RL).
    num_demos: SFT demonstrations, on problems drawn like the training prompts.
    seed: master seed; each record kind uses its own derived stream.
    spec: operations and operand ranges.
    num_eval: held-out prompts, distinct and disjoint from the training problems.

  Returns:
    {"prompts": [{"messages", "answer"}], "demos": [{"messages", "completion"}],
     "prompts_eval": [{"messages", "answer"}]}.
  """
  for name, n in (("num_prompts", num_prompts), ("num_demos", num_demos),
                  ("num_eval", num_eval)):
    check_int(n, name, low=0)
  space = spec.num_problems()
  if num_eval > space // 2:
    raise ValueError(f"num_eval={num_eval} is too large for {space} distinct problems; "
                     "raise max_operand / max_factor, add operations, or lower num_eval.")
  eval_rng, prompt_rng, demo_rng = (
      np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(3))

  # Held-out problems first, so that training draws can reject them.
  held_out: list[Problem] = []
  seen: set[Problem] = set()
  while len(held_out) < num_eval:
    problem = _problem(eval_rng, spec)
    if problem not in seen:
      seen.add(problem)
      held_out.append(problem)

  def train_problem(rng: np.random.Generator) -> Problem:
    while True:
      problem = _problem(rng, spec)
      if problem not in seen:
        return problem

  def prompt_record(problem: Problem, rng: np.random.Generator) -> dict[str, Any]:
    return {"messages": _messages(render(problem, rng), spec), "answer": str(solve(problem))}

  prompts = [prompt_record(train_problem(prompt_rng), prompt_rng) for _ in range(num_prompts)]
  demos = []
  for _ in range(num_demos):
    problem = train_problem(demo_rng)
    demos.append({"messages": _messages(render(problem, demo_rng), spec),
                  "completion": (calculator_call(problem) if spec.demo_style == "calculator"
                                 else worked_answer(problem))})
  return {"prompts": prompts, "demos": demos,
          "prompts_eval": [prompt_record(p, eval_rng) for p in held_out]}


def word_problem_task_config(num_prompts: int, num_demos: int, seed: int,
                             spec: WordProblemSettings, num_eval: int) -> dict[str, Any]:
  """The arguments that determine the records, as written to `task_config.json`."""
  return dict(task="word_problems", num_prompts=num_prompts, num_demos=num_demos, seed=seed,
              num_eval=num_eval, **dataclasses.asdict(spec))


def write_word_problem_jsonl(out_dir: str, num_prompts: int = 4096, num_demos: int = 256,
                             seed: int = 0, spec: WordProblemSettings = WordProblemSettings(), *,
                             num_eval: int = 128) -> dict[str, str]:
  """Generates the task and writes its JSONL files into `out_dir`.

  Args: as `make_word_problem_records`.

  Returns:
    Role -> file path for the keys of `WORD_PROBLEM_FILES`; a `task_config.json`
    recording the arguments is written alongside.
  """
  records = make_word_problem_records(num_prompts, num_demos, seed, spec, num_eval=num_eval)
  return write_task_files(
      out_dir, records, WORD_PROBLEM_FILES,
      word_problem_task_config(num_prompts, num_demos, seed, spec, num_eval))


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description="Write the word-problem chat task as JSONL.")
  parser.add_argument("--out_dir", required=True)
  parser.add_argument("--num_prompts", type=int, default=4096)
  parser.add_argument("--num_demos", type=int, default=256)
  parser.add_argument("--num_eval", type=int, default=128)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--operations", default=WordProblemSettings.operations)
  parser.add_argument("--max_operand", type=int, default=WordProblemSettings.max_operand)
  parser.add_argument("--max_factor", type=int, default=WordProblemSettings.max_factor)
  args = parser.parse_args(argv)
  spec = WordProblemSettings(args.operations, args.max_operand, args.max_factor)
  paths = write_word_problem_jsonl(args.out_dir, args.num_prompts, args.num_demos, args.seed,
                                   spec, num_eval=args.num_eval)
  for role, path in paths.items():
    print(f"{role}: {path}")


if __name__ == "__main__":
  main()
