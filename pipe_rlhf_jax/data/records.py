"""Malformed-record policy: what happens to a bad or over-long text record, and counting it.

Every record entering the code base (a JSONL line when the datasets are built, a TFDS
example when it is read) goes through a `RecordValidator`. It catches, on host and before
anything reaches a jitted function:

* structural problems (`on_invalid`): a line that is not valid UTF-8, not JSON or not a
  JSON object; a required field that is missing, not a string, or empty/whitespace-only;
  a field that tokenizes to nothing;
* over-long fields after tokenization (`on_overlong`), counted with the specials the
  data loaders add: BOS before a prompt (when the tokenizer has one), EOS after a
  completion.

Policies: "skip" drops the record, "truncate" (over-long only) cuts it, "error" raises
a ValueError naming the file/source, the line/index and the field. Every skip and
truncation is counted in `stats` (keys like "skipped/missing_field",
"truncated/prompt") and logged, rate-limited per reason: nothing is lost silently.

Truncation keeps the END of a prompt (after its BOS), because the completion continues
from there, and the START of a completion, without EOS, so a cut demonstration never
teaches the policy to stop early.

Prompt forms. A record gives its prompt either as text (`"prompt": "..."`) or as a
conversation (`"messages": [{"role": "system" | "user" | "assistant" | "tool",
"content": "..."}, ...]`), which `fit` renders with the tokenizer's chat template and
its generation prompt (`models.tokenizer.HFTokenizer.apply_chat_template`), so that the
completion is the assistant's next turn. The chat template writes its own BOS, so none
is added to a conversation. A dataset uses one form: its first record's (`fields_like`);
a record of the other form is malformed. Conversations are checked here (a list of
objects, each with a known `role` and a string `content`) and held as their JSON text,
which is what a TFDS dataset stores.

Reference answers. Prompt records may carry `"answer"` (a string, or a JSON number),
the reference a verifiable rule reward checks the completion against (data/math_reward.py).
When any record of a prompt dataset has one, every record needs one. An answer is
never tokenized: `fit` returns its UTF-8 bytes, within `max_answer_bytes`; an over-long
answer is skipped (or raises under on_overlong="error"), never cut, since a cut answer
would be a different answer.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Iterator, Mapping, Sequence

from pipe_rlhf_jax.checks import check_int

_log = logging.getLogger(__name__)

# Fields holding a prompt: text, or a conversation rendered by the chat template. A
# record has one of them; every other required field but the answer is a completion.
PROMPT_FIELDS = ("prompt", "messages")
# A prompt's reference answer (prompt datasets only), kept as text, never tokenized.
ANSWER_FIELD = "answer"
MESSAGE_ROLES = ("system", "user", "assistant", "tool")
# Required text fields of each dataset kind.
FIELDS_BY_KIND: dict[str, tuple[str, ...]] = {
    "prompts": ("prompt",),
    "demos": ("prompt", "completion"),
    "prefs": ("prompt", "chosen", "rejected"),
}
_INVALID_POLICIES = ("skip", "error")
_OVERLONG_POLICIES = ("truncate", "skip", "error")


def fields_like(fields: Sequence[str], record: Any, *, answers: bool) -> tuple[str, ...]:
  """The fields of a dataset whose records are shaped like `record`.

  Args:
    fields: the kind's fields (`FIELDS_BY_KIND`), with the prompt as "prompt".
    record: a sample record (the dataset's first); anything but a mapping leaves
      `fields` as they are.
    answers: add "answer" (a prompt dataset whose records carry reference answers).

  Returns:
    `fields` with "prompt" given as "messages" when `record` is a conversation, plus
    "answer" when `answers`.
  """
  out = list(fields)
  if (isinstance(record, Mapping) and "prompt" in out and "messages" in record
      and "prompt" not in record):
    out[out.index("prompt")] = "messages"
  if answers and ANSWER_FIELD not in out:
    out.append(ANSWER_FIELD)
  return tuple(out)


def jsonl_fields(kind: str, paths: Sequence[str]) -> tuple[str, ...]:
  """The fields of a dataset of `kind` built from the JSONL files `paths` (in order).

  The prompt form is that of the first JSON object in the files; a prompt dataset has
  "answer" when any of its records carries one (then every record needs one, and
  those without are reported at their line rather than their answers lost).
  """
  first = None
  with_answer = False
  for path in paths:
    with open(path, "rb") as f:
      for raw in f:
        try:
          record = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
          continue  # reported when the records are read
        if not isinstance(record, dict):
          continue
        first = record if first is None else first
        with_answer = with_answer or ANSWER_FIELD in record
  return fields_like(FIELDS_BY_KIND[kind], first, answers=kind == "prompts" and with_answer)


class RecordValidator:
  """Checks records against required fields and token budgets, applying a policy.

  Args:
    required_fields: fields every record must have ("prompt" or "messages",
      "completion", ..., "answer").
    max_prompt_tokens: budget for a prompt field including BOS; None disables the check.
    max_completion_tokens: budget for each completion field including EOS; None disables.
    max_answer_bytes: budget for the answer's UTF-8 bytes; None disables.
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
      max_answer_bytes: int | None = None,
  ):
    if isinstance(required_fields, str) or not required_fields:
      raise ValueError(
          f"required_fields must be a non-empty list of names, got {required_fields!r}.")
    if on_invalid not in _INVALID_POLICIES:
      raise ValueError(f"on_invalid must be one of {_INVALID_POLICIES}, got {on_invalid!r}.")
    if on_overlong not in _OVERLONG_POLICIES:
      raise ValueError(f"on_overlong must be one of {_OVERLONG_POLICIES}, got {on_overlong!r}.")
    for name, value in (("max_prompt_tokens", max_prompt_tokens),
                        ("max_completion_tokens", max_completion_tokens),
                        ("max_answer_bytes", max_answer_bytes)):
      check_int(value, name, allow_none=True)
    if all(f in required_fields for f in PROMPT_FIELDS):
      raise ValueError(f"required_fields {list(required_fields)} names both prompt forms "
                       f"{PROMPT_FIELDS}; a record has one of them.")
    self.required_fields = tuple(required_fields)
    self.max_prompt_tokens = max_prompt_tokens
    self.max_completion_tokens = max_completion_tokens
    self.max_answer_bytes = max_answer_bytes
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

  def with_limits(self, max_prompt_tokens: int | None, max_completion_tokens: int | None,
                  max_answer_bytes: int | None = None, *,
                  fields: Sequence[str] | None = None):
    """A fresh validator (empty stats) with the same policy and the given budgets (and
    `fields` instead of the required fields, when given)."""
    return RecordValidator(
        self.required_fields if fields is None else fields, max_prompt_tokens,
        max_completion_tokens, self.on_invalid, self.on_overlong,
        log_first_n=self.log_first_n, log_every=self.log_every,
        max_answer_bytes=max_answer_bytes,
    )

  def like(self, record: Any, *, answers: bool) -> "RecordValidator":
    """A fresh validator for records shaped like `record` (see `fields_like`): the prompt
    in its form, and the answer when `answers` and `record` has one."""
    fields = fields_like(self.required_fields, record,
                         answers=answers and isinstance(record, Mapping)
                         and ANSWER_FIELD in record)
    return self.with_limits(self.max_prompt_tokens, self.max_completion_tokens,
                            self.max_answer_bytes, fields=fields)

  def policy(self) -> dict[str, Any]:
    """The settings that decide which records survive (for fingerprints)."""
    policy = {
        "required_fields": list(self.required_fields),
        "max_prompt_tokens": self.max_prompt_tokens,
        "max_completion_tokens": self.max_completion_tokens,
        "on_invalid": self.on_invalid,
        "on_overlong": self.on_overlong,
    }
    if ANSWER_FIELD in self.required_fields:  # absent otherwise: older fingerprints hold
      policy["max_answer_bytes"] = self.max_answer_bytes
    return policy

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
      Field -> text for the required fields (a conversation as its JSON text), or None
      when the record is skipped.

    Raises:
      ValueError: a problem under on_invalid="error".
    """
    if not isinstance(record, Mapping):
      return self._drop_or_raise("not_object", where, None,
                                 f"is a {type(record).__name__}, not an object", count)
    if all(f in record for f in PROMPT_FIELDS):
      return self._drop_or_raise("both_prompt_forms", where, None,
                                 f"gives both {PROMPT_FIELDS[0]!r} and {PROMPT_FIELDS[1]!r};"
                                 " give the prompt one way", count)
    fields: dict[str, str] = {}
    for field in self.required_fields:
      if field not in record:
        return self._drop_or_raise("missing_field", where, field,
                                   "is missing" + self._missing_hint(field, record), count)
      value = record[field]
      if field == "messages":
        value = self._check_messages(value, where, count)
        if value is None:
          return None
        fields[field] = value
        continue
      if (field == ANSWER_FIELD and isinstance(value, (int, float))
          and not isinstance(value, bool)):
        value = str(value)  # {"answer": 42}: the number as written in JSON
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
      if field == ANSWER_FIELD and "\0" in value:
        # Answers travel NUL-padded (ppo/types.py): a NUL inside one would cut it.
        return self._drop_or_raise("invalid_answer", where, field, "contains a NUL character",
                                   count)
      fields[field] = value
    return fields

  def _missing_hint(self, field: str, record: Mapping) -> str:
    """Why a field is required when a record of another shape lacks it."""
    if field in PROMPT_FIELDS:
      other = PROMPT_FIELDS[1 - PROMPT_FIELDS.index(field)]
      if other in record:
        return (f" (this dataset gives prompts as {field!r}, as its first record does, but "
                f"this record has {other!r}; give every record the same form)")
    if field == ANSWER_FIELD:
      return (" (other records of this dataset carry an 'answer': give every record its "
              "reference answer)")
    return ""

  def _check_messages(self, value: Any, where: str, count: bool) -> str | None:
    """A conversation's structure; its JSON text, or None when the record is skipped."""
    drop = lambda reason, detail: self._drop_or_raise(reason, where, "messages", detail, count)
    if isinstance(value, (bytes, bytearray, memoryview)):  # TFDS: the stored JSON text
      try:
        value = bytes(value).decode("utf-8")
      except UnicodeDecodeError as e:
        return drop("invalid_utf8", f"is not valid UTF-8 ({e})")
    if isinstance(value, str):
      try:
        value = json.loads(value)
      except json.JSONDecodeError as e:
        return drop("invalid_messages", f"is not the JSON text of a list of messages ({e})")
    if not isinstance(value, list) or not value:
      got = "an empty list" if isinstance(value, list) else f"a {type(value).__name__}"
      return drop("invalid_messages", "must be a non-empty list of {'role': ..., 'content': "
                  f"...}} objects, got {got}")
    for i, message in enumerate(value):
      if not isinstance(message, Mapping):
        return drop("invalid_messages",
                    f"message {i} is a {type(message).__name__}, not an object")
      for key in ("role", "content"):
        if key not in message:
          return drop("invalid_messages", f"message {i} has no {key!r}")
      role, content = message["role"], message["content"]
      if role not in MESSAGE_ROLES:
        return drop("invalid_messages",
                    f"message {i} has role {role!r}; roles are {', '.join(MESSAGE_ROLES)}")
      if not isinstance(content, str):
        return drop("invalid_messages", f"message {i} has a {type(content).__name__} "
                    "'content'; it must be a string")
    if not any(m["content"].strip() for m in value):
      return drop("empty", "has no message with content")
    try:
      # Held as one canonical text (key order kept): what a TFDS example stores.
      text = json.dumps(value, ensure_ascii=False)
      text.encode("utf-8")
    except UnicodeEncodeError as e:  # lone surrogates from "\ud800" escapes
      return drop("invalid_utf8", f"is not valid UTF-8 ({e})")
    return text

  def fit(self, fields: Mapping[str, str], tokenizer, where: str, *, count: bool = True):
    """Tokenizes checked fields and applies the token budgets.

    Text prompts get BOS prepended (when the tokenizer has one), conversations are
    rendered by the tokenizer's chat template with the generation prompt (its own BOS
    included), completions get EOS appended; the budgets include these specials. The
    answer becomes its UTF-8 bytes.

    Args:
      fields: output of `check`.
      tokenizer: a `models.tokenizer.Tokenizer`.
      where: location for messages.
      count: count and log skips/truncations.

    Returns:
      Field -> list of ids, or None when the record is skipped.

    Raises:
      ValueError: an over-long field under on_overlong="error" (or an empty one, or a
        conversation the chat template refuses, under on_invalid="error"); a
        conversation on a tokenizer without a chat template, whatever the policy.
    """
    out: dict[str, list[int]] = {}
    for field in self.required_fields:
      is_prompt = field in PROMPT_FIELDS
      if field == ANSWER_FIELD:
        ids = list(fields[field].encode("utf-8"))
        if self.max_answer_bytes is not None and len(ids) > self.max_answer_bytes:
          detail = (f"has {len(ids)} UTF-8 bytes, over the budget of "
                    f"{self.max_answer_bytes}")
          if self.on_overlong == "error":
            raise ValueError(f"{where}: field {field!r} {detail}. Raise the answer length, "
                             "or set on_overlong='skip' (answers are never truncated).")
          if count:
            n = self._count(f"skipped/overlong_{field}")
            self._log(n, "Skipping record %s: field %r %s (#%d).", where, field, detail, n)
          return None
        out[field] = ids
        continue
      if field == "messages":
        ids = self._render(fields[field], tokenizer, where, count)
        if ids is None:
          return None
        has_bos = tokenizer.bos_id is not None and ids[:1] == [tokenizer.bos_id]
        if len(ids) <= int(has_bos):
          return self._drop_or_raise("empty_tokens", where, field, "tokenizes to nothing", count)
        budget = self.max_prompt_tokens
      elif is_prompt:
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

  def _render(self, text: str, tokenizer, where: str, count: bool) -> list[int] | None:
    """A checked conversation through the tokenizer's chat template, with the generation
    prompt; None when the template refuses it and the record is skipped."""
    # Imported here: the models package (and jax with it) is not needed to read records.
    from pipe_rlhf_jax.models.chat_template import ChatTemplateError
    if (not callable(getattr(tokenizer, "apply_chat_template", None))
        or getattr(tokenizer, "chat_template", "") is None):
      # A setting, not a bad record: every conversation would fail the same way.
      directory = getattr(tokenizer, "directory", None)
      owner = type(tokenizer).__name__ + (f" of {directory}" if directory else "")
      raise ValueError(
          f"{where}: field 'messages' is a conversation, but the tokenizer ({owner}) has no "
          "chat template to render it with. Use the tokenizer of a chat model (one with a "
          "chat_template in tokenizer_config.json or a chat_template.jinja file), or give "
          "the prompts as 'prompt' text.")
    try:
      return list(tokenizer.apply_chat_template(json.loads(text), add_generation_prompt=True))
    except ChatTemplateError as e:
      return self._drop_or_raise("template_refused", where, "messages",
                                 f"was refused by the chat template ({e})", count)

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
      (line_index, fields): the 0-based line number and the checked text fields (a
      conversation as its JSON text).
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
