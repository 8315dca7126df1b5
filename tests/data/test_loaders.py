"""Tests for data/loaders.py: layout, epochs, determinism, validation, exact resumption."""

import json

import numpy as np
import pytest

from pipe_rlhf_jax.data.builders import make_task_datasets
from pipe_rlhf_jax.data.loaders import DemoLoader, PreferenceLoader, PromptLoader
from pipe_rlhf_jax.data.records import RecordValidator
from pipe_rlhf_jax.data.task import make_task_records
from pipe_rlhf_jax.models.tokenizer import ByteTokenizer

TOK = ByteTokenizer()
P, T = 16, 8


@pytest.fixture(scope="module")
def task_data(tmp_path_factory):
  data_dir = str(tmp_path_factory.mktemp("tfds"))
  return make_task_datasets(data_dir, seed=0, num_prompts=50, num_demos=40, num_pairs=30,
                            num_eval=8)


def _take(loader, n):
  return [next(loader) for _ in range(n)]


def _assert_batches_equal(a, b):
  assert len(a) == len(b)
  for x, y in zip(a, b):
    assert x.keys() == y.keys()
    for k in x:
      np.testing.assert_array_equal(x[k], y[k], err_msg=k)


def test_prompt_batch_layout(task_data):
  p = PromptLoader.from_tfds("reverse_prompts", task_data["data_dir"], "train", TOK,
                               batch_size=4, prompt_len=P, seed=1)
  b = next(p)
  assert set(b) == {"prompt_tokens", "prompt_mask", "index"}
  assert b["prompt_tokens"].dtype == np.int32 and b["prompt_tokens"].shape == (4, P)
  assert b["prompt_mask"].dtype == bool and b["prompt_mask"].shape == (4, P)
  assert b["index"].dtype == np.int64 and b["index"].shape == (4,)
  prompts = make_task_records(50, 40, 30, 0, num_eval=8)["prompts"]
  for row in range(4):
    tokens, mask = b["prompt_tokens"][row], b["prompt_mask"][row]
    text = prompts[b["index"][row]]["prompt"]
    n = len(text) + 1  # BOS
    # Left padding: pads then BOS then the prompt bytes, mask marks exactly the real part.
    assert mask.tolist() == [False] * (P - n) + [True] * n
    assert np.all(tokens[: P - n] == TOK.pad_id)
    assert tokens[P - n] == TOK.bos_id
    assert TOK.decode(tokens) == text


def test_demo_and_preference_layout(task_data):
  recs = make_task_records(50, 40, 30, 0, num_eval=8)
  d = DemoLoader.from_tfds("reverse_demos", task_data["data_dir"], "train", TOK, 5, P, T, seed=0)
  b = next(d)
  assert set(b) == {"prompt_tokens", "prompt_mask", "completion_tokens", "completion_mask", "index"}
  assert b["completion_tokens"].shape == (5, T) and b["completion_tokens"].dtype == np.int32
  for row in range(5):
    want = recs["demos"][b["index"][row]]
    tokens, mask = b["completion_tokens"][row], b["completion_mask"][row]
    n = len(want["completion"]) + 1  # EOS
    assert mask.tolist() == [True] * n + [False] * (T - n)
    assert tokens[n - 1] == TOK.eos_id and np.all(tokens[n:] == TOK.pad_id)
    assert TOK.decode(tokens) == want["completion"]
    assert TOK.decode(b["prompt_tokens"][row]) == want["prompt"]

  pp = PreferenceLoader.from_tfds("reverse_prefs", task_data["data_dir"], "eval", TOK, 4, P, T,
                                    seed=0, shuffle=False)
  b = next(pp)
  assert set(b) == {"prompt_tokens", "prompt_mask", "chosen_tokens", "chosen_mask",
                    "rejected_tokens", "rejected_mask", "index"}
  assert b["index"].tolist() == [0, 1, 2, 3]  # shuffle=False keeps source order
  for row in range(4):
    want = recs["prefs_eval"][row]
    for field in ("chosen", "rejected"):
      assert TOK.decode(b[f"{field}_tokens"][row]) == want[field]
      assert b[f"{field}_mask"][row].sum() == len(want[field]) + 1


def test_epochs_reshuffle_drop_remainder_and_stop():
  letters = "abcdefgh"
  source = [{"prompt": f"rev {letters[i % 8]}{letters[i // 8]}=", "index": i} for i in range(22)]
  p = PromptLoader(source, TOK, batch_size=5, prompt_len=P, seed=7, num_epochs=3)
  assert p.steps_per_epoch == 4 and p.num_records == 22
  batches = list(p)
  assert len(batches) == 12 and p.epoch == 3
  epochs = [np.concatenate([b["index"] for b in batches[e * 4:(e + 1) * 4]]) for e in range(3)]
  for order in epochs:
    assert len(set(order.tolist())) == 20  # no repeats inside an epoch, 2 dropped
  assert epochs[0].tolist() != epochs[1].tolist() and epochs[1].tolist() != epochs[2].tolist()
  # Deterministic: same seed same stream, another seed another one.
  again = list(PromptLoader(source, TOK, 5, P, seed=7, num_epochs=3))
  _assert_batches_equal(batches, again)
  other = next(PromptLoader(source, TOK, 5, P, seed=8))
  assert other["index"].tolist() != batches[0]["index"].tolist()


@pytest.mark.parametrize("kind", ["prompts", "demos", "prefs"])
def test_resume_is_exact(task_data, kind):
  name, cls, extra = {
      "prompts": ("reverse_prompts", PromptLoader, ()),
      "demos": ("reverse_demos", DemoLoader, (T,)),
      "prefs": ("reverse_prefs", PreferenceLoader, (T,)),
  }[kind]

  def make():
    return cls.from_tfds(name, task_data["data_dir"], "train", TOK, 8, P, *extra, seed=5)

  original = make()
  steps = original.steps_per_epoch
  _take(original, steps - 1)  # stop one batch before an epoch boundary
  state = json.loads(json.dumps(original.get_state()))
  expected = _take(original, steps + 2)  # continues across the boundary

  resumed = make()
  resumed.set_state(state)
  assert resumed.step == steps - 1
  _assert_batches_equal(_take(resumed, steps + 2), expected)


def test_set_state_rejects_other_settings(task_data):
  args = ("reverse_prompts", task_data["data_dir"], "train", TOK, 8, P)
  state = PromptLoader.from_tfds(*args, seed=5).get_state()
  with pytest.raises(ValueError, match="fingerprint"):
    PromptLoader.from_tfds(*args, seed=6).set_state(state)
  with pytest.raises(ValueError, match="version"):
    PromptLoader.from_tfds(*args, seed=5).set_state({"next_index": 3})


def test_malformed_and_overlong_records_are_counted_not_batched():
  source = [
      {"prompt": "rev abc=", "completion": "cba", "index": 0},
      {"prompt": "", "completion": "x", "index": 1},                         # empty
      {"prompt": b"rev \xff=", "completion": b"a", "index": 2},             # invalid UTF-8
      {"prompt": "rev abcdefghijklmnop=", "completion": "p", "index": 3},   # prompt too long
      {"prompt": "rev ab=", "completion": "abcdefghij", "index": 4},        # completion too long
      {"completion": "ba", "index": 5},                                     # missing prompt
      {"prompt": "rev ba=", "completion": "ab", "index": 6},
  ]
  skip = DemoLoader(source, TOK, 2, P, T, seed=0, num_epochs=1,
                      validator=RecordValidator(["prompt", "completion"], on_overlong="skip"))
  assert sorted(np.concatenate([b["index"] for b in skip]).tolist()) == [0, 6]
  assert skip.stats() == {"records/seen": 7, "records/kept": 2, "skipped/empty": 1,
                          "skipped/invalid_utf8": 1, "skipped/missing_field": 1,
                          "skipped/overlong_prompt": 1, "skipped/overlong_completion": 1}

  trunc = DemoLoader(source, TOK, 4, P, T, seed=0, shuffle=False, num_epochs=1)
  (b,) = list(trunc)
  assert b["index"].tolist() == [0, 3, 4, 6]
  assert trunc.stats()["truncated/prompt"] == 1 and trunc.stats()["truncated/completion"] == 1
  # Prompt: BOS then the last P-1 bytes; completion: first T bytes, no EOS, mask all True.
  assert b["prompt_tokens"][1].tolist() == [TOK.bos_id] + list(b"rev abcdefghijklmnop=")[-(P - 1):]
  assert b["prompt_mask"][1].all()
  assert TOK.decode(b["completion_tokens"][2]) == "abcdefgh"
  assert b["completion_mask"][2].all() and TOK.eos_id not in b["completion_tokens"][2]

  # Every kept record once, in source order, as the batches lay it out (the pool of PPO's
  # SFT term), without moving the shuffled stream.
  shuffled = DemoLoader(source, TOK, 2, P, T, seed=0, num_epochs=1,
                          validator=RecordValidator(["prompt", "completion"],
                                                    on_overlong="skip"))
  first = next(shuffled)
  pool = shuffled.as_arrays()
  assert pool["index"].tolist() == [0, 6] and shuffled.step == 1
  row = pool["index"].tolist().index(first["index"][0])
  for key in first:
    np.testing.assert_array_equal(pool[key][row], first[key][0])

  with pytest.raises(ValueError, match=r"demos source\[1\]: field 'prompt' has 22 tokens"):
    DemoLoader(source[:1] + source[3:4], TOK, 1, P, T, seed=0,
                 validator=RecordValidator(["prompt", "completion"], on_overlong="error"))


def test_argument_errors():
  source = [{"prompt": "rev ab="}] * 3
  with pytest.raises(ValueError, match="batch_size"):
    PromptLoader(source, TOK, 4, P, seed=0)
  with pytest.raises(ValueError, match="exceeds prompt_len"):
    PromptLoader(source, TOK, 1, P, seed=0, validator=RecordValidator(["prompt"], P + 1))
  with pytest.raises(ValueError, match="lacks"):
    DemoLoader(source, TOK, 1, P, T, seed=0, validator=RecordValidator(["prompt"]))


def test_tokenizer_without_bos(tmp_path):
  tokenizers = pytest.importorskip("tokenizers")
  from tokenizers import models, pre_tokenizers, trainers

  from pipe_rlhf_jax.models.tokenizer import HFTokenizer

  raw = tokenizers.Tokenizer(models.WordLevel(unk_token="[UNK]"))
  raw.pre_tokenizer = pre_tokenizers.Whitespace()
  raw.train_from_iterator(["rev a b c = c b a"], trainers.WordLevelTrainer(
      special_tokens=["[UNK]", "</s>"]))
  raw.save(str(tmp_path / "tokenizer.json"))
  tok = HFTokenizer(str(tmp_path), eos_token="</s>")
  source = [{"prompt": "rev a b =", "completion": "b a"}]
  b = next(DemoLoader(source, tok, 1, 6, 4, seed=0))
  eos = tok.eos_id
  # No BOS: the prompt is only its 4 tokens; pad falls back to EOS, masks tell them apart.
  assert b["prompt_mask"][0].tolist() == [False, False, True, True, True, True]
  assert b["prompt_tokens"][0, :2].tolist() == [eos, eos]
  assert b["completion_tokens"][0].tolist()[:3] == tok.encode("b a") + [eos]
  assert b["completion_mask"][0].tolist() == [True, True, True, False]
