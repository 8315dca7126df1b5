"""Malformed-record policy: what happens to a bad or over-long text record, and counting it.

Every record entering the code base (a JSONL line at dataset-build time, a TFDS
example at pipeline time) goes through a `RecordValidator`. It catches, on host and
before anything reaches a jitted function:

* structural problems (`on_invalid`): a line that is not valid UTF-8, not JSON or not a
  JSON object; a required field that is missing, not a string, or empty/whitespace-only;
  a field that tokenizes to nothing;
* over-long fields after tokenization (`on_overlong`), counted with the specials the
  pipeline adds: BOS before a prompt (when the tokenizer has one), EOS after a
  completion.

Policies: "skip" drops the record, "truncate" (over-long only) cuts it, "error" raises
a ValueError naming the file/source, the line/index and the field. Every skip and
truncation is counted in `stats` (keys like "skipped/missing_field",
"truncated/prompt") and logged, rate-limited per reason: nothing is lost silently.

Truncation keeps the END of a prompt (after its BOS), because the completion continues
from there, and the START of a completion, without EOS, so a cut demonstration never
teaches the policy to stop early.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Iterator, Mapping, Sequence

from pipe_rlhf_jax.checks import check_int

_log = logging.getLogger(__name__)

# Fields holding prompt text; every other required field is a completion.
PROMPT_FIELDS = ("prompt",)
# Required text fields of each dataset kind.
FIELDS_BY_KIND: dict[str, tuple[str, ...]] = {
    "prompts": ("prompt",),
    "demos": ("prompt", "completion"),
    "prefs": ("prompt", "chosen", "rejected"),
}
_INVALID_POLICIES = ("skip", "error")
_OVERLONG_POLICIES = ("truncate", "skip", "error")


class RecordValidator:
  """Checks records against required fields and token budgets, applying a policy.

  Args:
    required_fields: text fields every record must have ("prompt", "completion", ...).
    max_prompt_tokens: budget for a prompt field including BOS; None disables the check.
    max_completion_tokens: budget for each completion field including EOS; None disables.
    on_invalid: "skip" or "error" for structurally bad records.
    on_overlong: "truncate", "skip" or "error" for fields over budget.
    log_first_n: log this many occurrences of each reason, then every `log_every`-th.
    log_every: see `log_first_n`.

  Attributes:
    stats: reason -> count, plus "records/seen" and "records/kept".
  """

  def __init__(
      self,
      required_fields: Sequence[str],
      max_prompt_tokens: int | None = None,
      max_completion_tokens: int | None = None,
      on_invalid: str = "skip",
      on_overlong: str = "truncate",
      *,
      log_first_n: int = 5,
      log_every: int = 1000,
  ):
    if isinstance(required_fields, str) or not required_fields:
      raise ValueError(
          f"required_fields must be a non-empty list of names, got {required_fields!r}.")
    if on_invalid not in _INVALID_POLICIES:
      raise ValueError(f"on_invalid must be one of {_INVALID_POLICIES}, got {on_invalid!r}.")
    if on_overlong not in _OVERLONG_POLICIES:
      raise ValueError(f"on_overlong must be one of {_OVERLONG_POLICIES}, got {on_overlong!r}.")
    for name, value in (("max_prompt_tokens", max_prompt_tokens),
                        ("max_completion_tokens", max_completion_tokens)):
      check_int(value, name, allow_none=True)
    self.required_fields = tuple(required_fields)
    self.max_prompt_tokens = max_prompt_tokens
    self.max_completion_tokens = max_completion_tokens
    self.on_invalid = on_invalid
    self.on_overlong = on_overlong
    self.log_first_n = log_first_n
    self.log_every = log_every
    self.stats: dict[str, int] = {}

  @classmethod
  def for_kind(cls, kind: str, **kwargs) -> "RecordValidator":
    """A validator requiring the fields of dataset kind "prompts", "demos" or "prefs"."""
    if kind not in FIELDS_BY_KIND:
      raise ValueError(f"Unknown dataset kind {kind!r}; choose one of {sorted(FIELDS_BY_KIND)}.")
    return cls(FIELDS_BY_KIND[kind], **kwargs)

  def with_limits(self, max_prompt_tokens: int | None, max_completion_tokens: int | None):
    """A fresh validator (empty stats) with the same policy and the given budgets."""
    return RecordValidator(
        self.required_fields, max_prompt_tokens, max_completion_tokens, self.on_invalid,
        self.on_overlong, log_first_n=self.log_first_n, log_every=self.log_every,
    )

  def policy(self) -> dict[str, Any]:
    """The settings that decide which records survive (for fingerprints)."""
    return {
        "required_fields": list(self.required_fields),
        "max_prompt_tokens": self.max_prompt_tokens,
        "max_completion_tokens": self.max_completion_tokens,
        "on_invalid": self.on_invalid,
        "on_overlong": self.on_overlong,
    }

  # ---- bookkeeping -------------------------------------------------------------------

  def _count(self, key: str) -> int:
    self.stats[key] = self.stats.get(key, 0) + 1
    return self.stats[key]

  def _drop_or_raise(self, reason: str, where: str, field: str | None, detail: str, count: bool):
    """Applies `on_invalid` to a structural problem; returns None when skipping."""
    field_text = f" field {field!r}" if field else ""
    if self.on_invalid == "error":
      raise ValueError(
          f"{where}:{field_text} {detail}. Fix the record, or set on_invalid='skip' to drop "
          "such records (they are counted)."
      )
    if count:
      n = self._count(f"skipped/{reason}")
      self._log(n, "Skipping record %s:%s %s (skipped/%s #%d).", where, field_text, detail,
                reason, n)
    return None

  def _log(self, n: int, msg: str, *args) -> None:
    if n <= self.log_first_n or n % self.log_every == 0:
      _log.warning(msg, *args)

  # ---- checks ------------------------------------------------------------------------

  def check(self, record: Any, where: str, *, count: bool = True) -> dict[str, str] | None:
    """Structural checks of one record.

    Args:
      record: a mapping from field name to str (JSONL) or UTF-8 bytes (TFDS Text).
      where: location for messages, e.g. "prompts.jsonl:12" or "reverse_prompts[train][3]".
      count: count and log skips (False when re-reading a record already counted).

    Returns:
      Field -> text for the required fields, or None when the record is skipped.

    Raises:
      ValueError: a problem under on_invalid="error".
    """
    if not isinstance(record, Mapping):
      return self._drop_or_raise("not_object", where, None,
                                 f"is a {type(record).__name__}, not an object", count)
    fields: dict[str, str] = {}
    for field in self.required_fields:
      if field not in record:
        return self._drop_or_raise("missing_field", where, field, "is missing", count)
      value = record[field]
      if isinstance(value, (bytes, bytearray, memoryview)):
        try:
          value = bytes(value).decode("utf-8")
        except UnicodeDecodeError as e:
          return self._drop_or_raise(
              "invalid_utf8", where, field, f"is not valid UTF-8 ({e})", count)
      if not isinstance(value, str):
        return self._drop_or_raise("not_string", where, field,
                                   f"is a {type(value).__name__}, not a string", count)
      try:
        # JSON "\ud800" escapes decode to lone surrogates that no tokenizer can encode.
        value.encode("utf-8")
      except UnicodeEncodeError as e:
        return self._drop_or_raise("invalid_utf8", where, field, f"is not valid UTF-8 ({e})", count)
      if not value.strip():
        return self._drop_or_raise("empty", where, field, "is empty", count)
      fields[field] = value
    return fields

  def fit(self, fields: Mapping[str, str], tokenizer, where: str, *, count: bool = True):
    """Tokenizes checked fields and applies the token budgets.

    Prompts get BOS prepended (when the tokenizer has one), completions get EOS appended;
    the budgets include these specials.

    Args:
      fields: output of `check`.
      tokenizer: a `models.tokenizer.Tokenizer`.
      where: location for messages.
      count: count and log skips/truncations.

    Returns:
      Field -> list of ids, or None when the record is skipped.

    Raises:
      ValueError: an over-long field under on_overlong="error" (or an empty one under
        on_invalid="error").
    """
    out: dict[str, list[int]] = {}
    for field in self.required_fields:
      is_prompt = field in PROMPT_FIELDS
      if is_prompt:
        ids = list(tokenizer.encode(fields[field], add_bos=True))
        has_bos = tokenizer.bos_id is not None
        if len(ids) <= int(has_bos):
          return self._drop_or_raise("empty_tokens", where, field, "tokenizes to nothing", count)
        budget = self.max_prompt_tokens
      else:
        ids = list(tokenizer.encode(fields[field]))
        if not ids:
          return self._drop_or_raise("empty_tokens", where, field, "tokenizes to nothing", count)
        ids.append(tokenizer.eos_id)
        budget = self.max_completion_tokens
      if budget is not None and len(ids) > budget:
        detail = f"has {len(ids)} tokens (with specials), over the budget of {budget}"
        if self.on_overlong == "error":
          raise ValueError(
              f"{where}: field {field!r} {detail}. Raise the length, or set "
              "on_overlong='truncate' or 'skip'."
          )
        if self.on_overlong == "skip":
          if count:
            n = self._count(f"skipped/overlong_{field}")
            self._log(n, "Skipping record %s: field %r %s (#%d).", where, field, detail, n)
          return None
        if is_prompt:
          head = ids[:1] if has_bos else []
          ids = head + ids[len(ids) - (budget - len(head)):] if budget > len(head) else head
        else:
          ids = ids[:budget]
        if count:
          n = self._count(f"truncated/{field}")
          self._log(n, "Truncating record %s: field %r %s (#%d).", where, field, detail, n)
      out[field] = ids
    return out

  def process(self, record: Any, tokenizer, where: str, *, count: bool = True):
    """`check` then `fit`; counts "records/seen" and "records/kept".

    Returns:
      Field -> list of ids, or None when the record is skipped.
    """
    if count:
      self._count("records/seen")
    fields = self.check(record, where, count=count)
    if fields is None:
      return None
    ids = self.fit(fields, tokenizer, where, count=count)
    if ids is not None and count:
      self._count("records/kept")
    return ids

  def read_jsonl(self, path: str) -> Iterator[tuple[int, dict[str, str]]]:
    """Reads a JSONL file as bytes and yields the structurally valid records.

    Blank lines are not records and are passed over without counting.

    Args:
      path: the file.

    Yields:
      (line_index, fields): the 0-based line number and the checked text fields.
    """
    with open(path, "rb") as f:
      for line_index, raw in enumerate(f):
        if not raw.strip():
          continue
        where = f"{path}:{line_index + 1}"
        self._count("records/seen")
        try:
          text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
          self._drop_or_raise("invalid_utf8", where, None, f"is not valid UTF-8 ({e})", True)
          continue
        try:
          record = json.loads(text)
        except json.JSONDecodeError as e:
          self._drop_or_raise("invalid_json", where, None, f"is not valid JSON ({e})", True)
          continue
        fields = self.check(record, where)
        if fields is not None:
          self._count("records/kept")
          yield line_index, fields

  def summary(self) -> str:
    """One line with every non-zero counter, for logs."""
    return ", ".join(f"{k}={v}" for k, v in sorted(self.stats.items())) or "no records"
