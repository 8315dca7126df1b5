"""The run's data: its tokenizer, the task's datasets and their loaders.

Owns `run_tokenizer` (the tokenizer a run uses, and `check_vocab`, which refuses one the
model cannot embed), `make_data` (the TFDS datasets of `data.task` and the grain loaders
each phase reads) and `build_data` (the same once per job: process 0 builds, the others
read). Split from job.py, which owns the phases' order.
"""

from __future__ import annotations

import os
from typing import Any

from pipe_rlhf_jax import distributed
from pipe_rlhf_jax.config.experiment import ExperimentSettings, ModelSettings
from pipe_rlhf_jax.data import builders, loaders
from pipe_rlhf_jax.data.records import RecordValidator
from pipe_rlhf_jax.distributed.faults import set_activity
from pipe_rlhf_jax.metrics import say
from pipe_rlhf_jax.models.config import TransformerConfig
from pipe_rlhf_jax.models.load import load_tokenizer
from pipe_rlhf_jax.phases.run_state import RunSetup

# Prompts the reward model's scale is measured on (times reward.normalize_samples_per_prompt).
REWARD_NORM_PROMPTS = 256


def run_tokenizer(m: ModelSettings):
  """The run's tokenizer: `model.path`'s own when set (saying so when `model.tokenizer`
  names another, which is then ignored), else `model.tokenizer`."""
  if m.path and m.tokenizer not in ("", "byte"):
    say(f"model.tokenizer={m.tokenizer!r} is ignored: model.path is set, and its own "
        f"tokenizer (from {m.path}) is used")
  return load_tokenizer(m.path or m.tokenizer)


def check_vocab(m: ModelSettings, tokenizer, cfg: TransformerConfig) -> None:
  """Raises when the tokenizer produces ids the model has no embedding row for.

  An id at or past `vocab_size` (e.g. a token added to the tokenizer after the model was
  saved) would embed as NaN (`jnp.take` fills rows out of range) and stop SFT far from
  the cause.
  """
  if tokenizer.vocab_size <= cfg.vocab_size:
    return
  source = (f"model.path={m.path!r}: its tokenizer" if m.path
            else f"model.tokenizer={m.tokenizer!r}")
  raise ValueError(
      f"{source} has {tokenizer.vocab_size} ids (added tokens included) but the model "
      f"embeds {cfg.vocab_size} (vocab_size); ids from {cfg.vocab_size} on have no "
      "embedding row. Use the tokenizer the model was saved with, or resize the model's "
      f"embeddings to at least {tokenizer.vocab_size} rows (transformers: "
      "model.resize_token_embeddings(len(tokenizer)), then save_pretrained) and point "
      "model.path at that directory.")


def make_data(settings: ExperimentSettings, workdir: str, tokenizer
              ) -> tuple[dict[str, float], dict[str, Any]]:
  """Builds the TFDS datasets and their grain loaders.

  Preference pipelines ("prefs", "prefs_eval") are made only when a reward model is
  trained; the arith task has no preference pairs at all.

  Returns:
    (counts of records skipped or truncated while building, {role: loader}).
  """
  d = settings.data
  import tensorflow_datasets as tfds
  tfds.disable_progress_bar()  # TFDS's per-split bars would drown the run's own output
  data_dir = d.dir or os.path.join(workdir, "data")
  use_rm = settings.reward.uses_model
  if d.task == "reverse":
    built = builders.make_task_datasets(data_dir, seed=settings.seed, num_prompts=d.num_prompts,
                                        num_demos=d.num_demos, num_pairs=d.num_pairs,
                                        num_eval=d.num_eval, hard_pairs=d.hard_pairs)
  elif d.task == "arith":
    built = builders.make_arith_datasets(data_dir, seed=settings.seed,
                                         spec=d.arith, num_prompts=d.num_prompts,
                                         num_demos=d.num_demos, num_eval=d.num_eval)
  elif d.task == "word_problems":
    built = builders.make_word_problem_datasets(
        data_dir, seed=settings.seed, spec=d.word_problems, num_prompts=d.num_prompts,
        num_demos=d.num_demos, num_eval=d.num_eval)
  else:  # "jsonl": the user's own files, one TFDS dataset per kind
    files = d.jsonl
    built = {
        "prompts": builders.build_dataset(
            "prompts", {"train": files.prompts, "eval": files.prompts_eval}, data_dir,
            name="user_prompts", on_invalid=d.on_invalid, overwrite=True),
    }
    if settings.uses_demos:
      built["demos"] = builders.build_dataset("demos", {"train": files.demos}, data_dir,
                                              name="user_demos", on_invalid=d.on_invalid,
                                              overwrite=True)
    if use_rm:
      built["prefs"] = builders.build_dataset(
          "prefs", {"train": files.prefs, "eval": files.prefs_eval}, data_dir,
          name="user_prefs", on_invalid=d.on_invalid, overwrite=True)

  def validator(kind: str):
    return RecordValidator.for_kind(kind, on_invalid=d.on_invalid, on_overlong=d.on_overlong)

  seed = settings.seed
  # Demonstrations are read only by SFT and PPO-ptx: a run with neither needs none, and
  # is not refused for having too few to fill an SFT batch.
  kinds = (("prompts",) + (("demos",) if settings.uses_demos else ())
           + (("prefs",) if use_rm else ()))
  # Records dropped while building the datasets (malformed JSONL lines), per kind and split.
  build_stats = {f"build/{kind}/{split}/{key}": float(value)
                 for kind in kinds
                 for split, counts in built[kind].stats.items()
                 for key, value in counts.items()}
  data = {
      "demos": (loaders.DemoLoader(built["demos"].source("train"), tokenizer,
                                   settings.sft.batch_size, d.prompt_len, d.completion_len,
                                   seed, validator=validator("demos"))
                if settings.uses_demos else None),
      # A PPO step takes batch_size / group_size prompts, each sampled group_size times.
      "prompts": loaders.PromptLoader(built["prompts"].source("train"), tokenizer,
                                         settings.ppo.batch_size // settings.ppo.group_size,
                                         d.prompt_len, seed,
                                         validator=validator("prompts")),
      # One batch of held-out prompts, in file order: the samples shown and the prompts
      # scored greedily before and after PPO (at most the whole eval split).
      "prompts_eval": loaders.PromptLoader(
          built["prompts"].source("eval"), tokenizer,
          min(max(settings.log.samples, settings.log.eval_prompts, 1),
              built["prompts"].splits["eval"]),
          d.prompt_len, seed, shuffle=False, validator=validator("prompts")),
  }
  if use_rm and settings.reward.normalize_samples_per_prompt:
    # The first training prompts, in file order: the answers the reward model's scale is
    # measured on before PPO (`phases.reward_norm`), the same in every run of a seed.
    data["prompts_norm"] = loaders.PromptLoader(
        built["prompts"].source("train"), tokenizer,
        min(REWARD_NORM_PROMPTS, built["prompts"].splits["train"]), d.prompt_len, seed,
        shuffle=False, validator=validator("prompts"))
  if use_rm:
    data["prefs"] = loaders.PreferenceLoader(
        built["prefs"].source("train"), tokenizer, settings.reward_model.batch_size,
        d.prompt_len, d.completion_len, seed, validator=validator("prefs"))
    data["prefs_eval"] = loaders.PreferenceLoader(
        built["prefs"].source("eval"), tokenizer, settings.reward_model.batch_size,
        d.prompt_len, d.completion_len, seed, shuffle=False, validator=validator("prefs"))
  return build_stats, data




def build_data(setup: RunSetup) -> tuple[dict[str, float], dict[str, Any]]:
  """`make_data`, once per job: process 0 builds the datasets, the others then read them."""
  set_activity("building datasets")
  # Process 0 may take long (a large JSONL file): the others wait up to the one-off
  # deadline (plan.progress_timeout_s), not a fixed time.
  timeout_s = setup.deadline.one_off()
  if not distributed.is_primary():
    distributed.barrier("datasets_built", timeout_s=timeout_s)
  result = make_data(setup.experiment.settings, setup.workdir, setup.tokenizer)
  if distributed.is_primary():
    distributed.barrier("datasets_built", timeout_s=timeout_s)
  return result
