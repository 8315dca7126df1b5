"""The embedded verifiable-reward task "arith": generate its prompts and demonstrations.

A prompt is a problem such as `"12+57="`; the correct completion is the decimal result
(`"69"`, then EOS, added by the pipeline). The operators (`+`, `-`, `*`) and the number
of digits of each operand are configurable (`ArithSettings`), so the difficulty, and with it
how imperfect the supervised warm start is, can be chosen. The answer is checked by a
rule (`arith_exact_match` in data/rewards.py), so no preference pairs are generated and
no reward model is trained: RL optimises the rule itself.

* SFT demonstrations are noisy: each digit of the answer is replaced, with probability
  `demo_noise`, by a *different* digit (a minus sign is never touched), so imitation
  alone does not reach perfect accuracy and RL has headroom.
* Held-out eval problems never occur among the training prompts or demonstrations.
* Subtraction may give a negative result (`"3-17="` -> `"-14"`): the arithmetic is not
  bent to the tokenizer.

Everything is a pure function of the seed; the record kinds draw from independent RNG
streams, so changing `num_demos` does not change the prompts. Runnable as
`python -m pipe_rlhf_jax.data.arith --out_dir DIR`.
"""

from __future__ import annotations

import argparse
import dataclasses
import operator
from typing import Any, Mapping

import numpy as np

from pipe_rlhf_jax.checks import check_int, check_number, from_section
from pipe_rlhf_jax.data.task import write_task_files

# Operator symbol -> the integer function it names.
OPERATORS = {"+": operator.add, "-": operator.sub, "*": operator.mul}
PROMPT_SUFFIX = "="
DIGITS = "0123456789"

# Files written by `write_arith_jsonl`, by role (no preference pairs: the reward is a rule).
ARITH_FILES = {
    "prompts": "prompts.jsonl",
    "demos": "demos.jsonl",
    "prompts_eval": "prompts_eval.jsonl",
}


@dataclasses.dataclass(frozen=True)
class ArithSettings:
  """What problems look like and how noisy the demonstrations are.

  Attributes:
    operators: the operator symbols problems use, a non-empty subset of "+-*", e.g. "+-".
    min_digits / max_digits: inclusive range of the number of decimal digits of each
      operand; 1 digit means 0-9, d > 1 digits means 10**(d-1) .. 10**d - 1.
    demo_noise: per-digit probability that a demonstration's answer digit is wrong.
  """

  operators: str = "+"
  min_digits: int = 1
  max_digits: int = 2
  demo_noise: float = 0.3

  def __post_init__(self):
    self.check()

  def check(self, field: str = "arith") -> None:
    """Raises ValueError naming `field.<attribute>` for the first bad setting."""
    ops = self.operators
    if not isinstance(ops, str) or not ops or len(set(ops)) != len(ops) or \
        not set(ops) <= set(OPERATORS):
      raise ValueError(f"{field}.operators={ops!r} must be distinct symbols from "
                       f"{''.join(OPERATORS)!r}, e.g. '+' or '+-'.")
    check_int(self.min_digits, f"{field}.min_digits")
    check_int(self.max_digits, f"{field}.max_digits", low=self.min_digits,
              hint=f" It must be >= {field}.min_digits.")
    if self.max_digits > 9:
      raise ValueError(f"{field}.max_digits={self.max_digits} is beyond any model this "
                       "task is for; use at most 9 digits per operand.")
    check_number(self.demo_noise, f"{field}.demo_noise", allow_zero=True, at_most=1.0,
                 what="a probability")

  @classmethod
  def from_config(cls, section: Mapping[str, Any], field: str = "data.arith") -> "ArithSettings":
    """From a config section (e.g. `config.data.arith`); errors name `field.<key>`."""
    return from_section(cls, section, field, "arith")

  def num_problems(self) -> int:
    """How many distinct problems the spec allows (operand pairs x operators)."""
    return _num_operands(self.min_digits, self.max_digits) ** 2 * len(self.operators)


def _num_operands(min_digits: int, max_digits: int) -> int:
  low = 0 if min_digits == 1 else 10 ** (min_digits - 1)
  return 10 ** max_digits - low


def make_prompt(a: int, op: str, b: int) -> str:
  """The prompt text of a problem: "12+57="."""
  return f"{a}{op}{b}{PROMPT_SUFFIX}"


def solve(a: int, op: str, b: int) -> str:
  """The correct completion of a problem (without EOS): the decimal result."""
  if op not in OPERATORS:
    raise ValueError(f"Unknown operator {op!r}; choose one of {sorted(OPERATORS)}.")
  return str(OPERATORS[op](int(a), int(b)))


def _operand(rng: np.random.Generator, spec: ArithSettings) -> int:
  """Number of digits uniform in the range, then the value uniform among those."""
  digits = int(rng.integers(spec.min_digits, spec.max_digits + 1))
  low = 0 if digits == 1 else 10 ** (digits - 1)
  return int(rng.integers(low, 10 ** digits))


def _problem(rng: np.random.Generator, spec: ArithSettings) -> tuple[int, str, int]:
  a = _operand(rng, spec)
  op = spec.operators[int(rng.integers(0, len(spec.operators)))]
  return a, op, _operand(rng, spec)


def _noisy_answer(rng: np.random.Generator, answer: str, noise: float) -> str:
  """Each digit replaced, with probability `noise`, by one of the 9 other digits."""
  chars = list(answer)
  wrong = rng.random(len(chars)) < noise  # drawn for every character: a fixed stream
  for i, c in enumerate(chars):
    if wrong[i] and c in DIGITS:
      others = DIGITS.replace(c, "")
      chars[i] = others[int(rng.integers(0, len(others)))]
  return "".join(chars)


def make_arith_records(num_prompts: int, num_demos: int, seed: int,
                       spec: ArithSettings = ArithSettings(), *, num_eval: int = 0
                       ) -> dict[str, list[dict[str, Any]]]:
  """Generates the arith task's records deterministically from `seed`.

  Args:
    num_prompts: training prompts (for RL).
    num_demos: SFT demonstrations, on problems drawn like the training prompts.
    seed: master seed; each record kind uses its own derived stream.
    spec: operators, operand sizes and demonstration noise.
    num_eval: held-out prompts, distinct and disjoint from the training problems.

  Returns:
    {"prompts": [{"prompt"}], "demos": [{"prompt", "completion"}],
     "prompts_eval": [{"prompt"}]}.
  """
  for name, n in (("num_prompts", num_prompts), ("num_demos", num_demos),
                  ("num_eval", num_eval)):
    check_int(n, name, low=0)
  space = spec.num_problems()
  if num_eval > space // 2:
    raise ValueError(f"num_eval={num_eval} is too large for {space} distinct problems; "
                     "allow more digits or operators, or lower num_eval.")
  eval_rng, prompt_rng, demo_rng = (
      np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(3))

  # Held-out problems first, so that training draws can reject them.
  held_out: list[tuple[int, str, int]] = []
  seen: set[tuple[int, str, int]] = set()
  while len(held_out) < num_eval:
    problem = _problem(eval_rng, spec)
    if problem not in seen:
      seen.add(problem)
      held_out.append(problem)

  def train_problem(rng: np.random.Generator) -> tuple[int, str, int]:
    while True:
      problem = _problem(rng, spec)
      if problem not in seen:
        return problem

  prompts = [{"prompt": make_prompt(*train_problem(prompt_rng))} for _ in range(num_prompts)]
  demos = []
  for _ in range(num_demos):
    problem = train_problem(demo_rng)
    demos.append({"prompt": make_prompt(*problem),
                  "completion": _noisy_answer(demo_rng, solve(*problem), spec.demo_noise)})
  return {"prompts": prompts, "demos": demos,
          "prompts_eval": [{"prompt": make_prompt(*p)} for p in held_out]}


def arith_task_config(num_prompts: int, num_demos: int, seed: int, spec: ArithSettings,
                      num_eval: int) -> dict[str, Any]:
  """The arguments that determine the records, as written to `task_config.json`."""
  return dict(task="arith", num_prompts=num_prompts, num_demos=num_demos, seed=seed,
              num_eval=num_eval, **dataclasses.asdict(spec))


def write_arith_jsonl(out_dir: str, num_prompts: int = 4096, num_demos: int = 4096,
                      seed: int = 0, spec: ArithSettings = ArithSettings(), *, num_eval: int = 256
                      ) -> dict[str, str]:
  """Generates the task and writes its JSONL files into `out_dir`.

  Args: as `make_arith_records`.

  Returns:
    Role -> file path for the keys of `ARITH_FILES`; a `task_config.json` recording the
    arguments (`arith_task_config`) is written alongside.
  """
  records = make_arith_records(num_prompts, num_demos, seed, spec, num_eval=num_eval)
  return write_task_files(out_dir, records, ARITH_FILES,
                          arith_task_config(num_prompts, num_demos, seed, spec, num_eval))


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description="Write the arith verifiable-reward task as JSONL.")
  parser.add_argument("--out_dir", required=True)
  parser.add_argument("--num_prompts", type=int, default=4096)
  parser.add_argument("--num_demos", type=int, default=4096)
  parser.add_argument("--num_eval", type=int, default=256)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--operators", default=ArithSettings.operators)
  parser.add_argument("--min_digits", type=int, default=ArithSettings.min_digits)
  parser.add_argument("--max_digits", type=int, default=ArithSettings.max_digits)
  parser.add_argument("--demo_noise", type=float, default=ArithSettings.demo_noise)
  args = parser.parse_args(argv)
  spec = ArithSettings(args.operators, args.min_digits, args.max_digits, args.demo_noise)
  paths = write_arith_jsonl(args.out_dir, args.num_prompts, args.num_demos, args.seed, spec,
                            num_eval=args.num_eval)
  for role, path in paths.items():
    print(f"{role}: {path}")


if __name__ == "__main__":
  main()
