"""The embedded toy RLHF task "reverse": generate its prompts, demos and preferences.

A prompt is `"rev " + letters + "="` with letters drawn from a small alphabet; the
correct completion is the letters reversed (then EOS, added by the pipeline). The data
are built so that every RLHF stage has something to learn:

* SFT demonstrations are noisy: each answer character is replaced, with probability
  `demo_noise`, by a *different* alphabet letter, so the SFT policy is mediocre and PPO
  has headroom.
* Preference pairs are two corruptions of the right answer with different numbers of
  substitutions; the one with fewer is "chosen". With probability `length_noise` the
  rejected answer additionally loses or gains its last character, so a reward model
  also sees that stopping early or late is worse. With probability `hard_pairs` a pair
  is instead "hard": the rejected answer is the chosen one with one more error, a letter
  replaced by a copy of its neighbour ('dcba' -> 'dcca'). That is the error a sampling
  policy makes most and the one a reward model trained on random substitutions alone
  cannot see (PPO against such a reward model learned to make that error:
  docs/design_notes.md). Chosen is always strictly
  better under the positional accuracy of data/rewards.py.
* Held-out eval prompts (and eval pairs built on them) never occur among the training
  prompts.

Everything is a pure function of the seed; the RNG streams of the record kinds are
independent, so changing `num_demos` does not change the prompts. Runnable as
`python -m pipe_rlhf_jax.data.task --out_dir DIR`.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

import numpy as np

from pipe_rlhf_jax.checks import check_int

DEFAULT_ALPHABET = "abcdefgh"
PROMPT_PREFIX = "rev "
PROMPT_SUFFIX = "="

# Files written by `write_task_jsonl`, by role.
TASK_FILES = {
    "prompts": "prompts.jsonl",
    "demos": "demos.jsonl",
    "prefs": "prefs.jsonl",
    "prefs_eval": "prefs_eval.jsonl",
    "prompts_eval": "prompts_eval.jsonl",
}


def make_prompt(letters: str) -> str:
  """The prompt text for `letters`: "rev abcd="."""
  return f"{PROMPT_PREFIX}{letters}{PROMPT_SUFFIX}"


def reverse_answer(letters: str) -> str:
  """The correct completion for `letters` (without EOS)."""
  return letters[::-1]


def _check_args(alphabet: str, min_len: int, max_len: int, demo_noise: float, length_noise: float,
                hard_pairs: float):
  if len(set(alphabet)) < 2 or len(set(alphabet)) != len(alphabet):
    raise ValueError(f"alphabet must have >= 2 distinct characters, got {alphabet!r}.")
  if any(c.isspace() or c == PROMPT_SUFFIX for c in alphabet):
    raise ValueError(f"alphabet must not contain whitespace or {PROMPT_SUFFIX!r}: {alphabet!r}.")
  if not 1 <= min_len <= max_len:
    raise ValueError(f"Need 1 <= min_len <= max_len, got min_len={min_len}, max_len={max_len}.")
  for name, p in (("demo_noise", demo_noise), ("length_noise", length_noise),
                  ("hard_pairs", hard_pairs)):
    if not 0.0 <= p <= 1.0:
      raise ValueError(f"{name} must be in [0, 1], got {p}.")


def _random_letters(rng: np.random.Generator, alphabet: str, min_len: int, max_len: int) -> str:
  n = int(rng.integers(min_len, max_len + 1))
  return "".join(alphabet[i] for i in rng.integers(0, len(alphabet), size=n))


def _substitute(rng: np.random.Generator, text: str, positions, alphabet: str) -> str:
  """Replaces the characters at `positions` with a different alphabet letter each."""
  chars = list(text)
  for p in positions:
    others = [c for c in alphabet if c != chars[p]]
    chars[p] = others[int(rng.integers(0, len(others)))]
  return "".join(chars)


def _noisy_demo(rng: np.random.Generator, answer: str, alphabet: str, noise: float) -> str:
  positions = np.flatnonzero(rng.random(len(answer)) < noise)
  return _substitute(rng, answer, positions, alphabet)


def _corrupt(rng: np.random.Generator, answer: str, num_errors: int, alphabet: str) -> str:
  positions = rng.choice(len(answer), size=num_errors, replace=False)
  return _substitute(rng, answer, positions, alphabet)


def _change_length(rng: np.random.Generator, text: str, alphabet: str) -> str:
  """Drops the last letter (when one remains) or appends a random one.

  Only the end changes, so the aligned prefix is untouched: a wrong length can only
  lower positional accuracy, and the chosen answer of a pair stays strictly better.
  """
  if len(text) > 1 and rng.random() < 0.5:
    return text[:-1]
  return text + alphabet[int(rng.integers(0, len(alphabet)))]


def _neighbour_copy(rng: np.random.Generator, text: str, answer: str, alphabet: str) -> str:
  """One more error in `text`: a still-correct letter becomes a copy of a neighbour.

  The neighbour is one whose letter differs from the right one (so the copy is an
  error); with none such (or a one-letter answer) the letter becomes a random other one.
  """
  correct = [i for i, (a, b) in enumerate(zip(text, answer)) if a == b]
  i = correct[int(rng.integers(0, len(correct)))]
  copies = [text[j] for j in (i - 1, i + 1) if 0 <= j < len(text) and text[j] != answer[i]]
  if not copies:
    return _substitute(rng, text, [i], alphabet)
  return text[:i] + copies[int(rng.integers(0, len(copies)))] + text[i + 1:]


def _pair(rng: np.random.Generator, letters: str, alphabet: str, length_noise: float,
          hard_pairs: float = 0.0):
  answer = reverse_answer(letters)
  # The draw happens only when hard pairs are asked for, so that hard_pairs=0 keeps the
  # records (and every warm start made from them) of before the option existed.
  if hard_pairs > 0 and rng.random() < hard_pairs:
    chosen = _corrupt(rng, answer, int(rng.integers(0, len(answer))), alphabet)
    rejected = _neighbour_copy(rng, chosen, answer, alphabet)
    return {"prompt": make_prompt(letters), "chosen": chosen, "rejected": rejected}
  # Two distinct error counts in [0, len]; the smaller one is the better answer.
  few, many = sorted(rng.choice(len(answer) + 1, size=2, replace=False).tolist())
  chosen = _corrupt(rng, answer, few, alphabet)
  rejected = _corrupt(rng, answer, many, alphabet)
  if rng.random() < length_noise:
    rejected = _change_length(rng, rejected, alphabet)
  return {"prompt": make_prompt(letters), "chosen": chosen, "rejected": rejected}


def make_task_records(
    num_prompts: int,
    num_demos: int,
    num_pairs: int,
    seed: int,
    alphabet: str = DEFAULT_ALPHABET,
    min_len: int = 3,
    max_len: int = 6,
    demo_noise: float = 0.3,
    *,
    num_eval: int = 0,
    length_noise: float = 0.2,
    hard_pairs: float = 0.0,
) -> dict[str, list[dict[str, Any]]]:
  """Generates the reverse task's records deterministically from `seed`.

  Args:
    num_prompts: training prompts (for PPO).
    num_demos: SFT demonstrations, on letters drawn like the training prompts.
    num_pairs: training preference pairs.
    seed: master seed; each record kind uses its own derived stream.
    alphabet: letters the prompts are made of.
    min_len / max_len: inclusive range of the number of letters per prompt.
    demo_noise: per-character probability that a demo answer character is wrong.
    num_eval: held-out prompts and held-out pairs (each), disjoint from training prompts.
    length_noise: probability that a rejected answer also has a wrong length.
    hard_pairs: probability that a pair differs by one neighbour-copy error (module
      docstring), in the training and the held-out pairs alike.

  Returns:
    {"prompts": [{"prompt"}], "demos": [{"prompt", "completion"}],
     "prefs": [{"prompt", "chosen", "rejected"}], "prompts_eval": [...], "prefs_eval": [...]}.
  """
  _check_args(alphabet, min_len, max_len, demo_noise, length_noise, hard_pairs)
  for name, n in (("num_prompts", num_prompts), ("num_demos", num_demos),
                  ("num_pairs", num_pairs), ("num_eval", num_eval)):
    check_int(n, name, low=0)
  space = sum(len(alphabet) ** n for n in range(min_len, max_len + 1))
  if num_eval > space // 2:
    raise ValueError(
        f"num_eval={num_eval} is too large for {space} distinct prompts; widen "
        "alphabet/max_len or lower num_eval."
    )
  streams = [np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(5)]
  eval_rng, prompt_rng, demo_rng, pair_rng, eval_pair_rng = streams

  # Held-out letters first, so training draws can reject them.
  eval_letters: list[str] = []
  seen: set[str] = set()
  while len(eval_letters) < num_eval:
    letters = _random_letters(eval_rng, alphabet, min_len, max_len)
    if letters not in seen:
      seen.add(letters)
      eval_letters.append(letters)

  def train_letters(rng: np.random.Generator) -> str:
    while True:
      letters = _random_letters(rng, alphabet, min_len, max_len)
      if letters not in seen:
        return letters

  prompts = [{"prompt": make_prompt(train_letters(prompt_rng))} for _ in range(num_prompts)]
  demos = []
  for _ in range(num_demos):
    letters = train_letters(demo_rng)
    completion = _noisy_demo(demo_rng, reverse_answer(letters), alphabet, demo_noise)
    demos.append({"prompt": make_prompt(letters), "completion": completion})
  prefs = [_pair(pair_rng, train_letters(pair_rng), alphabet, length_noise, hard_pairs)
           for _ in range(num_pairs)]
  prefs_eval = []
  for _ in range(num_eval):
    letters = eval_letters[int(eval_pair_rng.integers(0, num_eval))]
    prefs_eval.append(_pair(eval_pair_rng, letters, alphabet, length_noise, hard_pairs))
  return {
      "prompts": prompts,
      "demos": demos,
      "prefs": prefs,
      "prompts_eval": [{"prompt": make_prompt(w)} for w in eval_letters],
      "prefs_eval": prefs_eval,
  }


def write_jsonl(path: str, records: list[dict[str, Any]]) -> None:
  """Writes one JSON object per line (UTF-8), atomically via a temporary file."""
  tmp = f"{path}.tmp-{os.getpid()}"
  with open(tmp, "w", encoding="utf-8") as f:
    for record in records:
      f.write(json.dumps(record, ensure_ascii=False) + "\n")
  os.replace(tmp, path)


def task_settings(num_prompts: int, num_demos: int, num_pairs: int, seed: int, alphabet: str,
                  min_len: int, max_len: int, demo_noise: float, *, num_eval: int,
                  length_noise: float, hard_pairs: float) -> dict[str, Any]:
  """The arguments that decide the records, as `task_config.json` records them."""
  config = dict(num_prompts=num_prompts, num_demos=num_demos, num_pairs=num_pairs, seed=seed,
                alphabet=alphabet, min_len=min_len, max_len=max_len, demo_noise=demo_noise,
                num_eval=num_eval, length_noise=length_noise)
  if hard_pairs:  # absent when off: the task_config.json of older data stays current
    config["hard_pairs"] = hard_pairs
  return config


def write_task_jsonl(
    out_dir: str,
    num_prompts: int = 4096,
    num_demos: int = 4096,
    num_pairs: int = 4096,
    seed: int = 0,
    alphabet: str = DEFAULT_ALPHABET,
    min_len: int = 3,
    max_len: int = 6,
    demo_noise: float = 0.3,
    *,
    num_eval: int = 256,
    length_noise: float = 0.2,
    hard_pairs: float = 0.0,
) -> dict[str, str]:
  """Generates the task and writes its JSONL files into `out_dir`.

  Args: as `make_task_records`.

  Returns:
    Role -> file path for the keys of `TASK_FILES` (prompts, demos, prefs, prefs_eval,
    prompts_eval); a `task_config.json` recording the arguments is written alongside.
  """
  records = make_task_records(
      num_prompts, num_demos, num_pairs, seed, alphabet, min_len, max_len, demo_noise,
      num_eval=num_eval, length_noise=length_noise, hard_pairs=hard_pairs,
  )
  config = task_settings(num_prompts, num_demos, num_pairs, seed, alphabet, min_len, max_len,
                         demo_noise, num_eval=num_eval, length_noise=length_noise,
                         hard_pairs=hard_pairs)
  return write_task_files(out_dir, records, TASK_FILES, config)


def write_task_files(out_dir: str, records: dict[str, list[dict[str, Any]]],
                     files: dict[str, str], config: dict[str, Any]) -> dict[str, str]:
  """Writes a generated task: each role's records to its JSONL file in `out_dir`, and the
  generator's arguments to `task_config.json` beside them (what decides whether the files
  are current, `builders._generated_datasets`).

  Returns:
    Role -> file path, for the roles of `files`.
  """
  os.makedirs(out_dir, exist_ok=True)
  paths = {}
  for role, name in files.items():
    paths[role] = os.path.join(out_dir, name)
    write_jsonl(paths[role], records[role])
  with open(os.path.join(out_dir, "task_config.json"), "w", encoding="utf-8") as f:
    json.dump(config, f, indent=2, sort_keys=True)
  return paths


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description="Write the reverse toy RLHF task as JSONL.")
  parser.add_argument("--out_dir", required=True)
  parser.add_argument("--num_prompts", type=int, default=4096)
  parser.add_argument("--num_demos", type=int, default=4096)
  parser.add_argument("--num_pairs", type=int, default=4096)
  parser.add_argument("--num_eval", type=int, default=256)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--alphabet", default=DEFAULT_ALPHABET)
  parser.add_argument("--min_len", type=int, default=3)
  parser.add_argument("--max_len", type=int, default=6)
  parser.add_argument("--demo_noise", type=float, default=0.3)
  parser.add_argument("--length_noise", type=float, default=0.2)
  parser.add_argument("--hard_pairs", type=float, default=0.0)
  args = parser.parse_args(argv)
  paths = write_task_jsonl(
      args.out_dir, args.num_prompts, args.num_demos, args.num_pairs, args.seed, args.alphabet,
      args.min_len, args.max_len, args.demo_noise, num_eval=args.num_eval,
      length_noise=args.length_noise, hard_pairs=args.hard_pairs,
  )
  for role, path in paths.items():
    print(f"{role}: {path}")


if __name__ == "__main__":
  main()
