"""Reward-model blind spots on the reverse task, and whether PPO exploits them.

A reward model can have a good held-out pairwise accuracy and still rank a wrong answer
above the right one for one kind of mistake; PPO then finds that mistake (the
quickstart's greedy answers got worse while its reward rose, before its reward model
saw hard pairs: docs/design_notes.md). This probe measures, on
the held-out prompts of a warm start:

* P(score(right answer) > score(near-miss)) for five near-misses: one random letter
  substitution, one neighbour copy (a letter replaced by its left neighbour's, 'dcba' ->
  'dcca'), the last letter dropped, two random substitutions, one letter appended;
* with `--policy EXPORT_DIR` (a PPO run's `export/`): the greedy answers of the warm
  start's policy and of that policy, how many changed, how many got worse or better by
  the rule, and how often the reward model scores the worse answer higher.

  python -m experiments.rm_probe --warm DIR [--seed 1] [--set PATH=VALUE ...] \
      [--policy RUN/export ...]

DIR is a warm-start run directory, holding `warmstart/` and `data/` (the learning
curves keep them under experiments/out/learning_curves/warm_starts/<fingerprint>/run);
`--seed` and `--set` must be the ones it was made with (its fingerprint is checked).
Writes the result as JSON to experiments/out/rm_probe/<fingerprint>.json and prints it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

from pipe_rlhf_jax.host_devices import use_virtual_cpu_devices

# Before jax starts its backend: the runs' meshes need 8 devices on a CPU.
use_virtual_cpu_devices()

from flax import nnx
import jax
import numpy as np

from experiments import common
from pipe_rlhf_jax import job
from pipe_rlhf_jax.data.loaders import PreferenceLoader, pad_left
from pipe_rlhf_jax.data.rewards import reverse_accuracy, reverse_target
from pipe_rlhf_jax.generation.sampler import generate
from pipe_rlhf_jax.models import hf
from pipe_rlhf_jax.models.transformer import init_model
from pipe_rlhf_jax.phases import supervised
from pipe_rlhf_jax.phases import warm_start as warm_lib
from pipe_rlhf_jax.train import experiment_of

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

BATCH = 64


def near_misses(answers: list[str], alphabet: str, rng: np.random.Generator
                ) -> dict[str, list[str]]:
  """Each kind of near-miss of every answer (answers of one letter keep a substitution)."""
  def substitute(text: str, copy_neighbour: bool) -> str:
    i = int(rng.integers(len(text)))
    if copy_neighbour and len(text) > 1:
      letter = text[i - 1] if i > 0 else text[i + 1]
      if letter != text[i]:
        return text[:i] + letter + text[i + 1:]
    others = [c for c in alphabet if c != text[i]]
    return text[:i] + others[int(rng.integers(len(others)))] + text[i + 1:]

  return {
      "1 random substitution": [substitute(a, False) for a in answers],
      "1 neighbour copy": [substitute(a, True) for a in answers],
      "last letter dropped": [a[:-1] if len(a) > 1 else substitute(a, False)
                              for a in answers],
      "2 random substitutions": [substitute(substitute(a, False), False) for a in answers],
      # Too long: the pairs show the reward model short answers as wrong ("last letter
      # dropped") but never long ones, and PPO's worse greedy answers ran on past the end.
      "1 letter appended": [a + alphabet[int(rng.integers(len(alphabet)))] for a in answers],
  }


class Probe:
  """The warm start's reward model and policy, and the experiment's data shapes."""

  def __init__(self, config, workdir: str):
    experiment = experiment_of(config)
    setup = job.set_up(experiment, workdir, resume=False)
    self.settings, self.tokenizer = experiment.settings, setup.tokenizer
    warm = warm_lib.fit_or_restore(self.settings, setup.workdir, setup.warm_source, None,
                                   setup.cfgs, None, setup.warm_layout, False)
    self.rm_eval = warm["rm_eval"]
    reward_gd = nnx.split(init_model(setup.cfgs["reward"], seed=config.seed + 1))[0]
    self.reward_params = warm["reward"]
    self.score_fn = jax.jit(
        lambda params, batch: supervised.preference_scores(reward_gd, params, batch)[0])
    actor_gd = nnx.split(warm_lib.init_policy(self.settings.model, self.settings.seed,
                                              setup.cfgs["actor"]))[0]
    self.warm_policy = nnx.merge(actor_gd, warm["actor"])

  def scores(self, prompts: list[str], completions: list[str]) -> np.ndarray:
    """The reward model's score [N] of each (prompt, completion)."""
    records = [{"prompt": p, "chosen": c, "rejected": c} for p, c in zip(prompts, completions)]
    data = self.settings.data
    # Padded to whole batches with copies of the first record; their scores are dropped.
    padded = records + records[:1] * (-len(records) % BATCH)
    batches = PreferenceLoader(padded, self.tokenizer, BATCH, data.prompt_len,
                                 data.completion_len, 0, shuffle=False, num_epochs=1)
    out = [np.asarray(self.score_fn(self.reward_params, batch)) for batch in batches]
    return np.concatenate(out)[:len(records)]

  def greedy(self, model, prompts: list[str]) -> list[str]:
    """Greedy answers (as the held-out evaluation of a run makes them)."""
    data, tok = self.settings.data, self.tokenizer
    answers = []
    for k in range(0, len(prompts), BATCH):
      rows = [pad_left(tok.encode(p, add_bos=True), data.prompt_len, tok.pad_id)
              for p in prompts[k:k + BATCH]]
      out = generate(model, np.stack([t for t, _ in rows]), np.stack([m for _, m in rows]),
                     data.completion_len, rng=jax.random.key(0), temperature=0.0,
                     eos_id=tok.eos_id, pad_id=tok.pad_id)
      tokens, mask = jax.device_get((out.tokens, out.mask))
      answers.extend(tok.decode(t[m]) for t, m in zip(tokens, mask))
    return answers


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--warm", required=True, help="a warm-start run directory")
  parser.add_argument("--config", default=os.path.join(_ROOT, "configs", "quickstart.py"))
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--set", action="append", default=[], metavar="PATH=VALUE")
  parser.add_argument("--policy", action="append", default=[], metavar="EXPORT_DIR",
                      help="an exported PPO policy (a run's export/); repeatable")
  parser.add_argument("--out", default=os.path.join(_ROOT, "experiments", "out",
                                                    "rm_probe"))
  args = parser.parse_args(argv)
  config = common.load_config(args.config)
  if config.data.task != "reverse" or config.reward.fn != "model":
    raise SystemExit(f"--config {args.config}: the probe needs the reverse task with a "
                     "reward model (data.task='reverse', reward.fn='model').")
  config.seed = args.seed
  for item in args.set:
    path, sep, value = item.partition("=")
    if not sep:
      raise SystemExit(f"--set {item!r}: write PATH=VALUE, e.g. --set data.hard_pairs=0.5")
    common.apply_overrides(config, {path.strip(): common.parse_value(value.strip())})
  config.warm_start.checkpoint = os.path.join(args.warm, "warmstart")
  config.data.dir = os.path.join(args.warm, "data")
  probe = Probe(config, tempfile.mkdtemp(prefix="rm_probe_"))

  with open(os.path.join(args.warm, "data", "reverse_jsonl", "prompts_eval.jsonl"),
            encoding="utf-8") as f:
    prompts = [json.loads(line)["prompt"] for line in f]
  answers = [reverse_target(p) for p in prompts]
  alphabet = "".join(sorted(set("".join(answers))))
  right = probe.scores(prompts, answers)
  result = {"warm": args.warm, "seed": args.seed, "overrides": args.set,
            "heldout_prompts": len(prompts), "rm_eval": probe.rm_eval,
            "P(right > near-miss)": {}}
  for kind, wrong in near_misses(answers, alphabet, np.random.default_rng(0)).items():
    result["P(right > near-miss)"][kind] = float(np.mean(right > probe.scores(prompts, wrong)))

  before = probe.greedy(probe.warm_policy, prompts)
  score_before = probe.scores(prompts, before)
  acc_before = reverse_accuracy(prompts, before)
  result["greedy warm start: reverse_accuracy"] = float(acc_before.mean())
  for export in args.policy:
    after = probe.greedy(hf.from_pretrained(export), prompts)
    score_after = probe.scores(prompts, after)
    acc_after = reverse_accuracy(prompts, after)
    changed = np.asarray([a != b for a, b in zip(after, before)])
    worse, better = changed & (acc_after < acc_before), changed & (acc_after > acc_before)
    result[export] = {
        "greedy: reverse_accuracy": float(acc_after.mean()),
        "answers changed": int(changed.sum()),
        "worse / better": [int(worse.sum()), int(better.sum())],
        "P(RM prefers the answer | it got worse)":
            float(np.mean(score_after[worse] > score_before[worse])) if worse.any() else None,
        "worse examples (prompt, before, after)":
            [(prompts[i], before[i], after[i]) for i in np.flatnonzero(worse)[:8]],
    }
  os.makedirs(args.out, exist_ok=True)
  path = os.path.join(args.out, warm_lib.warm_start_fingerprint(probe.settings) + ".json")
  with open(path, "w", encoding="utf-8") as f:
    json.dump(result, f, indent=1)
  print(json.dumps(result, indent=1))
  print(f"wrote {path}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
