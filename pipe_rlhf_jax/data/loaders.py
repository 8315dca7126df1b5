"""Grain data loaders: prompts (PPO), demonstrations (SFT), preference pairs (RM).

Each loader turns a random-access source of text records (a `tfds.data_source` of a
dataset from data/builders.py, or any sequence of dicts) into an endless or finite
stream of fixed-shape numpy batches in the layout of `ppo/types.py`: prompts LEFT-padded
to `prompt_len` with BOS first (when the tokenizer has one), completions RIGHT-padded to
`completion_len` with EOS appended and masks True through EOS. A prompt given as
"messages" is rendered by the tokenizer's chat template with its generation prompt (the
template writes its own BOS); prompt records with an "answer" add each prompt's
reference answer as NUL-padded UTF-8 bytes ("answer_bytes", read back by
`ppo.types.decode_answers`), which travel with the rollout to the rule reward. A
source's fields are its first record's (`records.RecordValidator.like`).

Order and resumption. At construction every record is validated and tokenized once
(`records.RecordValidator`: skip / truncate / error, counted in `stats()`); the kept
positions form a grain `MapDataset` that is shuffled per epoch (grain folds the epoch
into the seed: permutation seed + epoch), mapped to padded examples, batched within the
epoch with `drop_remainder`, and repeated `num_epochs` times (None: forever). Batch k
is therefore a pure function of (source, settings, k), and the iterator state is just
k ("next_index" of grain's iterator) plus a fingerprint of the settings: a fresh
loader given `set_state(state)` yields exactly the batches the original would have
yielded next, and refuses a state from a differently configured loader.

The one-off scan costs one tokenization pass over the source; it buys exact,
position-independent skip/truncation counts and early errors (never deep in jitted
code).
"""

from __future__ import annotations

import hashlib
import json
import logging
from typing import Any, Iterator, Mapping, Sequence

import numpy as np

from pipe_rlhf_jax.checks import check_int
from pipe_rlhf_jax.data.builders import load_source, make_task_datasets
from pipe_rlhf_jax.data.records import ANSWER_FIELD, FIELDS_BY_KIND, PROMPT_FIELDS, RecordValidator

_log = logging.getLogger(__name__)

__all__ = [
    "DemoLoader",
    "PreferenceLoader",
    "PromptLoader",
    "make_task_datasets",
    "pad_left",
    "pad_right",
]

_STATE_VERSION = 1
_SCAN_CHUNK = 1024
# Width of a prompt's reference answer in bytes (GSM8K's are numbers, MATH's short
# LaTeX expressions); longer answers are skipped, or raise under on_overlong="error".
DEFAULT_ANSWER_LEN = 256


def pad_left(ids: Sequence[int], length: int, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
  """Left-pads ids to `length`; returns (tokens int32 [length], mask bool [length])."""
  if len(ids) > length:
    raise ValueError(f"{len(ids)} ids do not fit in length {length}.")
  tokens = np.full((length,), pad_id, dtype=np.int32)
  mask = np.zeros((length,), dtype=bool)
  if ids:
    tokens[length - len(ids):] = ids
    mask[length - len(ids):] = True
  return tokens, mask


def pad_right(ids: Sequence[int], length: int, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
  """Right-pads ids to `length`; returns (tokens int32 [length], mask bool [length])."""
  if len(ids) > length:
    raise ValueError(f"{len(ids)} ids do not fit in length {length}.")
  tokens = np.full((length,), pad_id, dtype=np.int32)
  mask = np.zeros((length,), dtype=bool)
  tokens[: len(ids)] = ids
  mask[: len(ids)] = True
  return tokens, mask


class _Loader:
  """Shared machinery; subclasses set KIND and how fields become batch arrays."""

  KIND = ""

  def __init__(
      self,
      source: Sequence[Mapping[str, Any]],
      tokenizer,
      batch_size: int,
      prompt_len: int,
      completion_len: int | None,
      seed: int,
      shuffle: bool,
      validator: RecordValidator | None,
      num_epochs: int | None,
      name: str | None,
      num_threads: int,
      answer_len: int | None = None,
  ):
    import grain

    check_int(batch_size, "batch_size")
    check_int(prompt_len, "prompt_len")
    check_int(completion_len, "completion_len", allow_none=True)
    check_int(answer_len, "answer_len", allow_none=True)
    check_int(num_epochs, "num_epochs", allow_none=True, hint=" None repeats forever.")
    if not 0 <= seed < 2**32:
      raise ValueError(f"seed must be in [0, 2**32), got {seed}.")
    self.tokenizer = tokenizer
    self.batch_size = int(batch_size)
    self.prompt_len = int(prompt_len)
    self.completion_len = None if completion_len is None else int(completion_len)
    self.answer_len = answer_len
    self.seed = int(seed)
    self.shuffle = bool(shuffle)
    self.num_epochs = num_epochs
    self.name = name or f"{self.KIND} source"
    self._source = source
    self.validator = self._make_validator(validator)

    self._kept = self._scan()
    self.steps_per_epoch = len(self._kept) // self.batch_size
    if self.steps_per_epoch == 0:
      raise ValueError(
          f"{self.name}: only {len(self._kept)} valid records for batch_size="
          f"{self.batch_size} ({self.validator.summary()}); lower batch_size or fix the data."
      )

    ds = grain.MapDataset.source(self._kept)
    if self.shuffle:
      ds = ds.shuffle(seed=self.seed)
    ds = ds.map(self._example).batch(self.batch_size, drop_remainder=True)
    ds = ds.repeat(num_epochs)
    read_options = grain.ReadOptions(
        num_threads=num_threads, prefetch_buffer_size=max(1, 2 * num_threads))
    self._dataset = ds.to_iter_dataset(read_options)
    self._iterator = iter(self._dataset)
    self._fingerprint = self._settings_fingerprint()

  # ---- construction ------------------------------------------------------------------

  def _make_validator(self, validator: RecordValidator | None) -> RecordValidator:
    budget_t = self.completion_len
    # The fields (prompt form, answer) follow the source's first record; a prompt
    # loader carries answers exactly when it has an answer width.
    first = self._source[0] if len(self._source) else None
    answers = self.answer_len is not None
    if validator is None:
      return RecordValidator.for_kind(
          self.KIND, max_prompt_tokens=self.prompt_len, max_completion_tokens=budget_t,
          max_answer_bytes=self.answer_len).like(first, answers=answers)
    missing = set(FIELDS_BY_KIND[self.KIND]) - set(validator.required_fields)
    if missing:
      raise ValueError(
          f"validator.required_fields {validator.required_fields} lacks {sorted(missing)} "
          f"needed by a {self.KIND} loader.")
    max_p = validator.max_prompt_tokens or self.prompt_len
    max_t = validator.max_completion_tokens or budget_t
    if max_p > self.prompt_len:
      raise ValueError(
          f"validator.max_prompt_tokens={max_p} exceeds prompt_len={self.prompt_len}.")
    if budget_t is not None and max_t > budget_t:
      raise ValueError(
          f"validator.max_completion_tokens={max_t} exceeds completion_len={budget_t}.")
    # A fresh copy: its stats describe this loader's source only.
    return validator.with_limits(max_p, max_t, self.answer_len).like(first, answers=answers)

  def _where(self, position: int) -> str:
    return f"{self.name}[{position}]"

  def _scan(self) -> list[int]:
    """Validates every record once; returns the positions that survive."""
    kept = []
    total = len(self._source)
    getitems = getattr(self._source, "__getitems__", None)
    for start in range(0, total, _SCAN_CHUNK):
      positions = range(start, min(total, start + _SCAN_CHUNK))
      records = getitems(list(positions)) if getitems else [self._source[p] for p in positions]
      for position, record in zip(positions, records):
        if self.validator.process(record, self.tokenizer, self._where(position)) is not None:
          kept.append(position)
    if len(kept) < total:
      _log.warning("%s: kept %d of %d records (%s).", self.name, len(kept), total,
                   self.validator.summary())
    return kept

  def _settings_fingerprint(self) -> str:
    settings = dict(
        kind=self.KIND, source_len=len(self._source), kept=len(self._kept),
        kept_hash=hashlib.sha256(np.asarray(self._kept, np.int64).tobytes()).hexdigest(),
        batch_size=self.batch_size, prompt_len=self.prompt_len,
        completion_len=self.completion_len, seed=self.seed, shuffle=self.shuffle,
        num_epochs=self.num_epochs, vocab_size=self.tokenizer.vocab_size,
        policy=self.validator.policy(),
    )
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]

  # ---- per example -------------------------------------------------------------------

  def _example(self, position: int) -> dict[str, np.ndarray]:
    record = self._source[position]
    # Already counted by the scan; same record and tokenizer give the same ids.
    ids = self.validator.process(record, self.tokenizer, self._where(position), count=False)
    if ids is None:
      raise RuntimeError(f"{self._where(position)} changed since the loader scanned it.")
    pad = self.tokenizer.pad_id
    out = {}
    for field in self.validator.required_fields:
      if field == ANSWER_FIELD:
        out["answer_bytes"] = pad_right(ids[field], self.answer_len, 0)[0].astype(np.uint8)
      elif field in PROMPT_FIELDS:  # text or conversation: the same prompt arrays
        out["prompt_tokens"], out["prompt_mask"] = pad_left(ids[field], self.prompt_len, pad)
      elif field in FIELDS_BY_KIND[self.KIND]:
        tokens, mask = pad_right(ids[field], self.completion_len, pad)
        out[f"{field}_tokens"], out[f"{field}_mask"] = tokens, mask
    index = record.get("index", position) if isinstance(record, Mapping) else position
    out["index"] = np.asarray(index, dtype=np.int64)
    return out

  # ---- iteration and state -----------------------------------------------------------

  def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    return next(self._iterator)

  @property
  def step(self) -> int:
    """Number of batches this loader has yielded (after any `set_state`)."""
    return int(self._iterator.get_state()["next_index"])

  @property
  def epoch(self) -> int:
    """The epoch the next batch comes from (0-based)."""
    return self.step // self.steps_per_epoch

  @property
  def num_records(self) -> int:
    """Records that passed validation (one epoch's worth before drop_remainder)."""
    return len(self._kept)

  def as_arrays(self) -> dict[str, np.ndarray]:
    """Every kept record once, in source order, as one batch ([num_records, ...] arrays
    in the layout the loader yields): e.g. the demonstration pool of PPO's SFT term.
    Independent of the iterator: its position does not move."""
    examples = [self._example(position) for position in self._kept]
    return {k: np.stack([e[k] for e in examples]) for k in examples[0]}

  def get_state(self) -> dict[str, Any]:
    """A JSON-serialisable state to resume this exact stream with `set_state`."""
    return {
        "version": _STATE_VERSION,
        "kind": self.KIND,
        "fingerprint": self._fingerprint,
        "iterator": self._iterator.get_state(),
    }

  def set_state(self, state: Mapping[str, Any]) -> None:
    """Continues from `state` (from `get_state` of an identically configured loader).

    Raises:
      ValueError: the state is malformed or from a loader with other settings/data.
    """
    if not isinstance(state, Mapping) or state.get("version") != _STATE_VERSION:
      raise ValueError(f"Not a loader state of version {_STATE_VERSION}: {state!r}.")
    if state.get("kind") != self.KIND or state.get("fingerprint") != self._fingerprint:
      raise ValueError(
          f"Loader state is for a {state.get('kind')} loader with fingerprint "
          f"{state.get('fingerprint')}, but this is a {self.KIND} loader with "
          f"{self._fingerprint}: data, seed, batch size, lengths, epochs or validation "
          "policy differ, so the stream would not continue where it stopped.")
    self._iterator.set_state(dict(state["iterator"]))

  def stats(self) -> dict[str, int]:
    """Validator counts over the whole source (skips, truncations, seen, kept)."""
    return dict(self.validator.stats)

  @classmethod
  def from_tfds(cls, name: str, data_dir: str, split: str, *args, **kwargs):
    """Builds the loader on `tfds.data_source(name, data_dir=..., split=...)`."""
    kwargs.setdefault("name", f"{name}[{split}]")
    return cls(load_source(name, data_dir, split), *args, **kwargs)


class PromptLoader(_Loader):
  """Prompt batches for PPO generation.

  Args:
    source: random-access records with a "prompt" field (str or UTF-8 bytes) or a
      "messages" conversation (a list, or its JSON text), optionally "answer" and
      "index".
    tokenizer: a `models.tokenizer.Tokenizer` (with a chat template for "messages").
    batch_size: B.
    prompt_len: P, including BOS.
    seed: shuffle seed (epoch e uses permutation seed + e).
    shuffle: shuffle each epoch; False keeps source order.
    validator: malformed/over-long policy; default skips malformed records and truncates
      over-long prompts. Its budgets default to (and may not exceed) P.
    num_epochs: epochs to yield; None repeats forever.
    name: label of the source in messages.
    num_threads: grain prefetch threads (0: produce batches synchronously).
    answer_len: A, the bytes a reference answer may take (used when the records carry
      answers).

  Yields:
    {"prompt_tokens": int32 [B, P] left-padded with pad_id,
     "prompt_mask": bool [B, P], "index": int64 [B]}, and with answers
    "answer_bytes": uint8 [B, A], each answer's UTF-8 bytes, NUL-padded.
  """

  KIND = "prompts"

  def __init__(self, source, tokenizer, batch_size: int, prompt_len: int, seed: int,
               shuffle: bool = True, validator: RecordValidator | None = None, *,
               num_epochs: int | None = None, name: str | None = None, num_threads: int = 0,
               answer_len: int = DEFAULT_ANSWER_LEN):
    super().__init__(source, tokenizer, batch_size, prompt_len, None, seed, shuffle,
                     validator, num_epochs, name, num_threads, answer_len)


class DemoLoader(_Loader):
  """SFT demonstration batches; arguments as `PromptLoader` plus `completion_len`.

  Args:
    completion_len: T, including EOS. Over-long completions are truncated without EOS
      (mask True on all T) or skipped, per the validator.

  Yields:
    {"prompt_tokens": int32 [B, P], "prompt_mask": bool [B, P],
     "completion_tokens": int32 [B, T] right-padded, EOS after the text,
     "completion_mask": bool [B, T] True through EOS, "index": int64 [B]}.
  """

  KIND = "demos"

  def __init__(self, source, tokenizer, batch_size: int, prompt_len: int, completion_len: int,
               seed: int, shuffle: bool = True, validator: RecordValidator | None = None, *,
               num_epochs: int | None = None, name: str | None = None, num_threads: int = 0):
    super().__init__(source, tokenizer, batch_size, prompt_len, completion_len, seed, shuffle,
                     validator, num_epochs, name, num_threads)


class PreferenceLoader(_Loader):
  """Reward-model preference batches; arguments as `DemoLoader`.

  Yields:
    {"prompt_tokens": int32 [B, P], "prompt_mask": bool [B, P],
     "chosen_tokens": int32 [B, T], "chosen_mask": bool [B, T],
     "rejected_tokens": int32 [B, T], "rejected_mask": bool [B, T], "index": int64 [B]};
    chosen/rejected follow the completion layout (right-padded, EOS, mask through EOS).
  """

  KIND = "prefs"

  def __init__(self, source, tokenizer, batch_size: int, prompt_len: int, completion_len: int,
               seed: int, shuffle: bool = True, validator: RecordValidator | None = None, *,
               num_epochs: int | None = None, name: str | None = None, num_threads: int = 0):
    super().__init__(source, tokenizer, batch_size, prompt_len, completion_len, seed, shuffle,
                     validator, num_epochs, name, num_threads)
