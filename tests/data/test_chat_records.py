"""Conversation prompts and reference answers: records, TFDS datasets and pipelines.

`{"messages": [...]}` records are checked (role, content), stored as their JSON text and
rendered through the tokenizer's chat template with the generation prompt; prompt
records with an `"answer"` carry it as NUL-padded bytes; plain `{"prompt"}` records are
unchanged.
"""

import json
import pathlib

import numpy as np
import pytest

from pipe_rlhf_jax.data.builders import build_dataset
from pipe_rlhf_jax.data.loaders import DemoLoader, PromptLoader
from pipe_rlhf_jax.data.records import RecordValidator, jsonl_fields
from pipe_rlhf_jax.models.tokenizer import ByteTokenizer, HFTokenizer
from pipe_rlhf_jax.ppo.types import decode_answers
from tests.helpers.hf_helpers import write_chat_tokenizer

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
STRICT = ("{% if messages[-1]['role'] != 'user' %}{{ raise_exception('the last message must "
          "be the user\\'s') }}{% endif %}" + CHATML)
CORPUS = "abcdefghijklmnopqrstuvwxyz0123456789 ?=+#\n"


def _write(path, records):
  path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in records) + "\n")
  return str(path)


def _chat_tokenizer(tmp_path, template=CHATML):
  path = str(tmp_path / "tok")
  write_chat_tokenizer(path, CORPUS, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                       eos="<|im_end|>", pad="<|endoftext|>", chat_template=template)
  return HFTokenizer(path)


def _chat(question, system=None):
  turns = [{"role": "system", "content": system}] if system else []
  return turns + [{"role": "user", "content": question}]


@pytest.mark.parametrize("message, detail", [
    ({"content": "hi"}, "message 0 has no 'role'"),
    ({"role": "user"}, "message 0 has no 'content'"),
    ({"role": "robot", "content": "hi"}, "message 0 has role 'robot'; roles are system, user, "
                                         "assistant, tool"),
    ({"role": "user", "content": ["hi"]}, "message 0 has a list 'content'"),
])
def test_bad_messages_name_file_line_and_field(tmp_path, message, detail):
  path = _write(tmp_path / "p.jsonl", [{"messages": _chat("what is 1+1?")},
                                       {"messages": [message]}])
  v = RecordValidator(jsonl_fields("prompts", [path]), on_invalid="error")
  with pytest.raises(ValueError) as e:
    list(v.read_jsonl(path))
  assert f"p.jsonl:2: field 'messages' {detail}" in str(e.value)


def test_prompt_forms_and_answers_are_one_per_dataset(tmp_path):
  path = _write(tmp_path / "p.jsonl", [
      {"messages": _chat("what is 1+1?"), "answer": "2"},
      {"prompt": "what is 2+2?", "answer": "4"},              # the other prompt form
      {"messages": _chat("what is 3+3?")},                    # no answer
      {"messages": _chat("what is 4+4?"), "answer": 8},       # a JSON number
      {"messages": [], "answer": "0"},                        # empty conversation
      {"messages": _chat("x"), "prompt": "x", "answer": "1"},  # both forms
      {"messages": _chat("what is 5+5?"), "answer": "1\u00000"},  # NUL inside
  ])
  fields = jsonl_fields("prompts", [path])
  assert fields == ("messages", "answer")
  skip = RecordValidator(fields)
  kept = list(skip.read_jsonl(path))
  assert [i for i, _ in kept] == [0, 3]
  assert kept[1][1]["answer"] == "8"
  assert json.loads(kept[0][1]["messages"]) == _chat("what is 1+1?")
  assert skip.stats == {"records/seen": 7, "records/kept": 2, "skipped/missing_field": 2,
                        "skipped/invalid_messages": 1, "skipped/both_prompt_forms": 1,
                        "skipped/invalid_answer": 1}
  err = RecordValidator(fields, on_invalid="error")
  with pytest.raises(ValueError, match=r"p\.jsonl:2: field 'messages' is missing \(this "
                                       r"dataset gives prompts as 'messages'.*has 'prompt'"):
    list(err.read_jsonl(path))
  one = _write(tmp_path / "one.jsonl", [{"prompt": "a", "answer": "1"}, {"prompt": "b"}])
  with pytest.raises(ValueError, match=r"one\.jsonl:2: field 'answer' is missing \(other "
                                       r"records of this dataset carry an 'answer'"):
    list(RecordValidator(jsonl_fields("prompts", [one]), on_invalid="error").read_jsonl(one))
  # Demonstrations and pairs never carry answers; plain prompts keep their one field.
  assert jsonl_fields("demos", [one]) == ("prompt", "completion")
  plain = _write(tmp_path / "plain.jsonl", [{"prompt": "a"}])
  assert jsonl_fields("prompts", [plain]) == ("prompt",)


def test_messages_need_a_tokenizer_with_a_chat_template(tmp_path):
  record = {"messages": _chat("what is 1+1?")}
  v = RecordValidator(["messages"])  # the skip policy: still an error, it is a setting
  with pytest.raises(ValueError, match=r"user_prompts\[train\]\[0\]: field 'messages' is a "
                                       r"conversation, but the tokenizer \(ByteTokenizer\)"):
    v.process(record, ByteTokenizer(), "user_prompts[train][0]")
  plain = str(tmp_path / "plain")
  write_chat_tokenizer(plain, CORPUS, ["</s>"], eos="</s>")
  with pytest.raises(ValueError, match=f"HFTokenizer of {plain}.*chat_template"):
    PromptLoader([record], HFTokenizer(plain), 1, 64, seed=0)


def test_a_conversation_the_template_refuses_follows_the_policy(tmp_path):
  tok = _chat_tokenizer(tmp_path, STRICT)
  refused = {"messages": _chat("hi") + [{"role": "assistant", "content": "2"}]}
  v = RecordValidator(["messages"])
  assert v.process(refused, tok, "s[1]") is None
  assert v.stats["skipped/template_refused"] == 1
  with pytest.raises(ValueError, match=r"s\[1\]: field 'messages' was refused by the chat "
                                       r"template.*last message must be the user's"):
    RecordValidator(["messages"], on_invalid="error").process(refused, tok, "s[1]")


def test_dataset_and_pipelines_render_conversations_and_carry_answers(tmp_path):
  tok = _chat_tokenizer(tmp_path)
  questions = [f"what is {i}+{i}?" for i in range(6)]
  prompts = _write(tmp_path / "p.jsonl", [
      {"messages": _chat(q, "be brief" if i % 2 else None), "answer": str(2 * i)}
      for i, q in enumerate(questions)])
  held = _write(tmp_path / "e.jsonl", [{"messages": _chat("what is 9+9?"), "answer": "18"}])
  built = build_dataset("prompts", {"train": prompts, "eval": held}, str(tmp_path / "tfds"),
                        name="chat_prompts")
  assert built.fields == ("messages", "answer") and built.splits == {"train": 6, "eval": 1}
  # The same files build the same dataset: same fingerprint, byte-identical shards.
  again = build_dataset("prompts", {"train": prompts, "eval": held}, str(tmp_path / "tfds2"),
                        name="chat_prompts")
  assert again.fingerprint == built.fingerprint
  shard = lambda b: pathlib.Path(b.path, "chat_prompts-train.array_record-00000-of-00001"
                                 ).read_bytes()
  assert shard(again) == shard(built)

  pipe = PromptLoader(built.source("train"), tok, 6, 64, seed=0, shuffle=False,
                        num_epochs=1, answer_len=4)
  (batch,) = list(pipe)
  assert batch["answer_bytes"].dtype == np.uint8 and batch["answer_bytes"].shape == (6, 4)
  assert decode_answers(batch["answer_bytes"]) == [str(2 * i) for i in range(6)]
  for row, i in enumerate(batch["index"]):
    expected = tok.apply_chat_template(_chat(questions[i], "be brief" if i % 2 else None))
    got = batch["prompt_tokens"][row][batch["prompt_mask"][row]].tolist()
    assert got == expected  # no BOS added (this template has none), generation prompt last
    assert tok.decode(got).endswith("assistant\n")
  # An answer longer than its width is skipped (never cut), or raises under "error".
  short = PromptLoader(built.source("train"), tok, 1, 64, seed=0, answer_len=1)
  assert short.stats()["skipped/overlong_answer"] == 1  # "10"
  with pytest.raises(ValueError, match=r"field 'answer' has 2 UTF-8 bytes, over the budget "
                                       r"of 1.*never truncated"):
    PromptLoader(built.source("train"), tok, 1, 64, seed=0, answer_len=1,
                   validator=RecordValidator(["prompt"], on_overlong="error"))

  # Demonstrations as conversations with their completion (the assistant's turn).
  demos = _write(tmp_path / "d.jsonl", [{"messages": _chat(q), "completion": f"#### {2 * i}"}
                                        for i, q in enumerate(questions)])
  built_demos = build_dataset("demos", demos, str(tmp_path / "tfds"), name="chat_demos")
  assert built_demos.fields == ("messages", "completion")
  (demo,) = list(DemoLoader(built_demos.source("train"), tok, 6, 64, 8, seed=0,
                              shuffle=False, num_epochs=1))
  assert "answer_bytes" not in demo
  assert demo["completion_tokens"][3][demo["completion_mask"][3]].tolist() == (
      tok.encode("#### 6") + [tok.eos_id])
  assert demo["prompt_tokens"][3][demo["prompt_mask"][3]].tolist() == (
      tok.apply_chat_template(_chat(questions[3])))


def test_plain_prompt_records_are_unchanged():
  tok = ByteTokenizer()
  (batch,) = list(PromptLoader([{"prompt": "rev ab="}] * 2, tok, 2, 8, seed=0,
                                 num_epochs=1))
  assert set(batch) == {"prompt_tokens", "prompt_mask", "index"}
  assert batch["prompt_tokens"][0][batch["prompt_mask"][0]].tolist() == (
      tok.encode("rev ab=", add_bos=True))
