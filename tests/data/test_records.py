"""Tests for data/records.py: each malformed case under skip / truncate / error."""

import json

import pytest

from pipe_rlhf_jax.data.records import RecordValidator
from pipe_rlhf_jax.models.tokenizer import ByteTokenizer

TOK = ByteTokenizer()


def _write(path, lines: list[bytes]):
  path.write_bytes(b"\n".join(lines) + b"\n")
  return str(path)


def _bad_file(tmp_path):
  """A demos JSONL with one of each structural problem; returns (path, good line indices)."""
  good = lambda p, c: json.dumps({"prompt": p, "completion": c}).encode()
  lines = [
      good("rev abc=", "cba"),                                    # 0 ok
      json.dumps({"prompt": "", "completion": "x"}).encode(),      # 1 empty
      json.dumps({"prompt": "rev ab="}).encode(),                  # 2 missing completion
      b'{"prompt": "rev \xff\xfe=", "completion": "a"}',          # 3 invalid UTF-8
      json.dumps({"prompt": 5, "completion": "a"}).encode(),       # 4 not a string
      b'{"prompt": "rev ab=", "completion": ',                     # 5 invalid JSON
      b"",                                                         # 6 blank: not a record
      b'["rev ab=", "ba"]',                                        # 7 not an object
      b'{"prompt": "rev \\ud800=", "completion": "a"}',           # 8 lone surrogate
      json.dumps({"prompt": "   ", "completion": "a"}).encode(),   # 9 whitespace only
      good("rev é=", "é"),                                         # 10 ok (non-ASCII)
  ]
  return _write(tmp_path / "demos.jsonl", lines), [0, 10]


def test_skip_counts_every_malformed_case(tmp_path):
  path, good = _bad_file(tmp_path)
  v = RecordValidator(["prompt", "completion"], on_invalid="skip")
  out = list(v.read_jsonl(path))
  assert [i for i, _ in out] == good
  assert out[1][1] == {"prompt": "rev é=", "completion": "é"}
  assert v.stats == {
      "records/seen": 10,
      "records/kept": 2,
      "skipped/empty": 2,
      "skipped/missing_field": 1,
      "skipped/invalid_utf8": 2,
      "skipped/not_string": 1,
      "skipped/invalid_json": 1,
      "skipped/not_object": 1,
  }


@pytest.mark.parametrize(
    "line,field,match",
    [
        (1, "prompt", "is empty"),
        (3, None, "not valid UTF-8"),
        (4, "prompt", "not a string"),
        (5, None, "not valid JSON"),
        (7, None, "not an object"),
        (8, "prompt", "not valid UTF-8"),
    ],
)
def test_error_names_file_line_and_field(tmp_path, line, field, match):
  path, _ = _bad_file(tmp_path)
  # Keep the good first line and the one bad line under test.
  raw = open(path, "rb").read().split(b"\n")
  single = _write(tmp_path / "one.jsonl", [raw[0], raw[line]])
  v = RecordValidator(["prompt", "completion"], on_invalid="error")
  with pytest.raises(ValueError) as e:
    list(v.read_jsonl(single))
  msg = str(e.value)
  assert "one.jsonl:2" in msg and match in msg
  if field:
    assert repr(field) in msg


def test_error_on_missing_field_names_it(tmp_path):
  path = _write(tmp_path / "p.jsonl", [b'{"prompt": "rev ab="}'])
  v = RecordValidator(["prompt", "chosen", "rejected"], on_invalid="error")
  with pytest.raises(ValueError, match=r"p\.jsonl:1: field 'chosen' is missing"):
    list(v.read_jsonl(path))


def test_overlong_truncate_keeps_prompt_tail_and_completion_head():
  v = RecordValidator(["prompt", "completion"], max_prompt_tokens=6, max_completion_tokens=4,
                      on_overlong="truncate")
  ids = v.process({"prompt": "rev abcdef=", "completion": "fedcba"}, TOK, "x[0]")
  # BOS kept first, then the last 5 prompt bytes; completion cut to 4, without EOS.
  assert ids["prompt"] == [TOK.bos_id] + list(b"cdef=")
  assert ids["completion"] == list(b"fedc")
  assert v.stats == {"records/seen": 1, "records/kept": 1, "truncated/prompt": 1,
                     "truncated/completion": 1}
  # Exactly at budget: untouched, EOS present.
  ids = v.process({"prompt": "rev =", "completion": "abc"}, TOK, "x[1]")
  assert ids == {"prompt": [TOK.bos_id] + list(b"rev ="), "completion": list(b"abc") + [TOK.eos_id]}
  assert v.stats["truncated/prompt"] == 1 and v.stats["records/kept"] == 2


def test_overlong_skip_and_error():
  rec = {"prompt": "rev ab=", "chosen": "ba", "rejected": "bbbbbbbbbb"}
  skip = RecordValidator(["prompt", "chosen", "rejected"], 16, 4, on_overlong="skip")
  assert skip.process(rec, TOK, "prefs[3]") is None
  assert skip.stats == {"records/seen": 1, "skipped/overlong_rejected": 1}
  # count=False: same decision, nothing counted (used when re-reading scanned records).
  assert skip.process(rec, TOK, "prefs[3]", count=False) is None
  assert skip.stats == {"records/seen": 1, "skipped/overlong_rejected": 1}
  err = RecordValidator(["prompt", "chosen", "rejected"], 16, 4, on_overlong="error")
  with pytest.raises(ValueError, match=r"prefs\[3\]: field 'rejected' has 11 tokens"):
    err.process(rec, TOK, "prefs[3]")


def test_tfds_style_bytes_fields():
  v = RecordValidator(["prompt"], on_invalid="skip")
  assert v.check({"prompt": "rev é=".encode()}, "s[0]") == {"prompt": "rev é="}
  assert v.check({"prompt": b"rev \xff="}, "s[1]") is None
  assert v.stats == {"skipped/invalid_utf8": 1}


def test_bad_policy_arguments():
  with pytest.raises(ValueError, match="on_invalid"):
    RecordValidator(["prompt"], on_invalid="truncate")
  with pytest.raises(ValueError, match="on_overlong"):
    RecordValidator(["prompt"], on_overlong="ignore")
  with pytest.raises(ValueError, match="required_fields"):
    RecordValidator("prompt")
  with pytest.raises(ValueError, match="kind"):
    RecordValidator.for_kind("images")


def test_skip_logging_is_rate_limited(caplog):
  v = RecordValidator(["prompt"], log_first_n=2, log_every=5)
  with caplog.at_level("WARNING", logger="pipe_rlhf_jax.data.records"):
    for i in range(10):
      v.check({}, f"s[{i}]")
  assert v.stats["skipped/missing_field"] == 10
  # Occurrences 1, 2, 5 and 10 are logged.
  assert len(caplog.records) == 4
