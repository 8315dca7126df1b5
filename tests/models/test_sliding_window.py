"""Sliding-window attention: the kernels, Mistral and Qwen2/3 windows against transformers,
and the pipelined decoder (stages holding different local / global layer patterns).

The window rule is transformers': a query at slot q sees key slot k iff k <= q and
q - k < window, slots counted with the left padding.
"""

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from pipe_rlhf_jax.generation.pipelined import pipelined_generate  # noqa: E402
from pipe_rlhf_jax.generation.sampler import generate  # noqa: E402
from pipe_rlhf_jax.models import attention as attention_lib  # noqa: E402
from pipe_rlhf_jax.models import hf  # noqa: E402
from pipe_rlhf_jax.models.config import tiny_config  # noqa: E402
from pipe_rlhf_jax.models.transformer import init_model, window_allowed  # noqa: E402
from pipe_rlhf_jax.parallel.mesh import MeshShape, make_mesh  # noqa: E402

torch.set_num_threads(1)

VOCAB, PAD, BOS, EOS = 97, 0, 1, 2
TOL = 1e-4
NEW = 8
S, F = "sliding_attention", "full_attention"


@pytest.mark.parametrize("impl,block", [("dense", 0), ("blockwise", 3), ("dot_product", 0)])
@pytest.mark.parametrize("window", [1, 3, 20])
def test_kernels_apply_the_window(impl, block, window):
  rng = np.random.default_rng(0)
  batch, length, kv, groups, d = 2, 11, 2, 2, 8
  q = jnp.asarray(rng.normal(size=(batch, length, kv, groups, d)), jnp.float32)
  # Head-major keys and values, as the cache keeps them.
  k = jnp.asarray(rng.normal(size=(batch, kv, length, d)), jnp.float32)
  v = jnp.asarray(rng.normal(size=(batch, kv, length, d)), jnp.float32)
  key_mask = np.arange(length)[None] >= np.array([[0], [4]])  # row 1 left-padded by 4
  causal = np.tril(np.ones((length, length), bool))
  allowed = window_allowed(jnp.asarray(causal[None] & key_mask[:, None]),
                           jnp.arange(length), window)
  got = attention_lib.attention(q, k, v, allowed, impl=impl, block_size=block or 512)
  # Reference: per query, a plain softmax over the keys of its window.
  scores = np.einsum("blkgd,bksd->bkgls", q, k) / np.sqrt(d)
  for row in range(batch):
    for i in range(length):
      keys = [j for j in range(length) if key_mask[row, j] and j <= i and i - j < window]
      if not keys:
        continue  # a padding query sees nothing; never read downstream
      s = scores[row][:, :, i][..., keys]  # [kv, groups, keys]
      p = np.exp(s - s.max(-1, keepdims=True))
      p /= p.sum(-1, keepdims=True)
      want = np.einsum("kgs,ksd->kgd", p, np.asarray(v)[row][:, keys])
      np.testing.assert_allclose(np.asarray(got)[row, i], want, atol=2e-5)


def _hf_model(arch, seed=0, scale=0.08, **overrides):
  prefix = {"mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3"}[arch]
  kwargs = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6,
                max_position_embeddings=64, pad_token_id=PAD, bos_token_id=BOS,
                eos_token_id=EOS)
  kwargs.update(overrides)
  config = getattr(transformers, prefix + "Config")(**kwargs)
  torch.manual_seed(seed)
  model = getattr(transformers, prefix + "ForCausalLM")._from_config(
      config, attn_implementation="eager")
  with torch.no_grad():
    for name, p in model.named_parameters():
      if "norm" in name:
        p.copy_(1.0 + 0.1 * torch.randn_like(p))
      elif name.endswith("bias"):
        p.copy_(0.1 * torch.randn_like(p))
      else:
        p.copy_(scale * torch.randn_like(p))
  return model.eval()


def _batch(length=9, pads=(0, 3, 5), seed=0):
  rng = np.random.RandomState(seed)
  tokens = rng.randint(3, VOCAB, size=(len(pads), length))
  mask = np.ones(tokens.shape, bool)
  for row, pad in enumerate(pads):
    tokens[row, :pad] = PAD
    mask[row, :pad] = False
  return tokens, mask


def _torch_logits(model, tokens, mask):
  positions = np.maximum(np.cumsum(mask, -1) - 1, 0)
  with torch.no_grad():
    return model(torch.tensor(tokens), attention_mask=torch.tensor(mask.astype(np.int64)),
                 position_ids=torch.tensor(positions)).logits.float().numpy()


def _ours(model, tokens, mask, **execution):
  if execution:
    model.config = model.layers.config = model.config.replace(**execution)
  return np.asarray(model(jnp.asarray(tokens), jnp.asarray(mask)))


def _diff(a, b, mask):
  return float(np.abs(a - b)[mask].max())


# (arch, overrides, expected per-layer locality)
WINDOWED = {
    # Mistral-7B-v0.1's form: one window on every layer, shorter than the context.
    "mistral": ("mistral", dict(sliding_window=3, head_dim=24), (True, True, True)),
    # transformers' rule: layers i >= max_window_layers slide.
    "qwen2_max_window_layers": ("qwen2", dict(use_sliding_window=True, sliding_window=3,
                                              max_window_layers=1), (False, True, True)),
    "qwen3_layer_types": ("qwen3", dict(use_sliding_window=True, sliding_window=4,
                                        head_dim=16, layer_types=[S, F, S]),
                          (True, False, True)),
}


@pytest.mark.parametrize("case", sorted(WINDOWED))
def test_windowed_checkpoints_match_transformers(tmp_path, case):
  arch, overrides, local = WINDOWED[case]
  model = _hf_model(arch, **overrides)
  model.save_pretrained(tmp_path)
  tokens, mask = _batch()
  ref = _torch_logits(model, tokens, mask)
  for execution in (dict(attention="dense"),
                    dict(attention="blockwise", attention_block_size=4),
                    dict(attention="dot_product")):
    ours = hf.from_pretrained(tmp_path)
    assert ours.config.local_layers == local
    assert ours.config.sliding_window == overrides["sliding_window"]
    assert _diff(_ours(ours, tokens, mask, **execution), ref, mask) <= TOL, execution
  ours = hf.from_pretrained(tmp_path)
  assert _diff(_ours(ours, tokens, mask, sliding_window=None), ref, mask) > 1e-3

  # Export: transformers reads our config.json with the same window and pattern.
  out = tmp_path / "export"
  hf.save_pretrained(hf.from_pretrained(tmp_path), out)
  theirs = type(model).from_pretrained(out, attn_implementation="eager").eval()
  assert _diff(_torch_logits(theirs, tokens, mask), ref, mask) <= TOL
  assert hf.from_pretrained(out).config == hf.from_pretrained(tmp_path).config


@pytest.mark.parametrize("case", ["mistral", "qwen2_max_window_layers"])
def test_greedy_generation_matches_hf_generate(tmp_path, case):
  arch, overrides, _ = WINDOWED[case]
  model = _hf_model(arch, scale=0.15, **overrides)
  model.save_pretrained(tmp_path)
  ours = hf.from_pretrained(tmp_path)
  tokens, mask = _batch(length=7, pads=(0, 2, 4))
  with torch.no_grad():
    out = model.generate(torch.tensor(tokens),
                         attention_mask=torch.tensor(mask.astype(np.int64)),
                         do_sample=False, max_new_tokens=NEW, eos_token_id=None,
                         pad_token_id=PAD, output_scores=True, return_dict_in_generate=True,
                         temperature=None, top_k=None, top_p=None)
  expected = out.sequences[:, tokens.shape[1]:].numpy()
  top2 = np.sort(torch.stack(out.scores, 1).numpy(), -1)[..., -2:]
  assert float((top2[..., 1] - top2[..., 0]).min()) > 1e-3  # argmax well posed
  got = generate(ours, jnp.asarray(tokens), jnp.asarray(mask), NEW, rng=jax.random.key(0),
                 temperature=0.0, top_k=0, top_p=1.0, eos_id=None, pad_id=PAD)
  np.testing.assert_array_equal(np.asarray(got.tokens), expected)


def test_a_window_adds_no_state():
  # The pattern is static config: parameters (checkpoints, optimizer state) are those of
  # the same model without a window.
  base = tiny_config(vocab_size=64, num_layers=4)
  windowed = base.replace(sliding_window=2, layer_types=(S, F, S, S), rope_local_theta=100.0)
  for kind in (nnx.Param, ...):  # parameters, and every variable of any other kind
    shape = lambda c: jax.tree.map(  # noqa: E731
        lambda x: (x.shape, x.dtype),
        nnx.state(nnx.eval_shape(lambda: init_model(c)), kind))  # noqa: B023
    assert shape(windowed) == shape(base)


def _random_params(model, seed):
  rng = np.random.default_rng(seed)
  for _, var in nnx.iter_graph(model):
    if isinstance(var, nnx.Param):
      value = np.asarray(var.get_value())
      var.set_value(jnp.asarray(0.2 * rng.normal(size=value.shape), value.dtype))
  return model


BATCH, PLEN, STEPS = 8, 6, 5


@pytest.fixture(scope="module")
def prompts():
  rs = np.random.RandomState(1)
  prompt = np.zeros((BATCH, PLEN), np.int32)
  mask = np.zeros((BATCH, PLEN), bool)
  for row, n in enumerate([6, 3, 5, 6, 1, 4, 6, 2]):
    prompt[row, PLEN - n:] = rs.randint(1, 64, n)
    mask[row, PLEN - n:] = True
  return prompt, mask


@pytest.mark.parametrize("architecture,layer_types,pipe,num_mb,sampling", [
    # Gemma's interleaving: with 2 stages one holds [local, global], the other two locals.
    # (Slow: the Qwen case below splits local and global layers over the stages too.)
    pytest.param("gemma3", (S, F, S, S), 2, 2, "greedy", marks=pytest.mark.slow),
    pytest.param("gemma3", (S, F, S, S), 4, 4, "sampled", marks=pytest.mark.slow),
    # Qwen's rule: stage 0 all global, stage 1 all local.
    ("qwen3", (F, F, S, S), 2, 4, "sampled"),
])
def test_pipelined_decoder_equals_the_plain_sampler(prompts, architecture, layer_types,
                                                    pipe, num_mb, sampling):
  prompt, mask = prompts
  gemma = architecture == "gemma3"
  config = tiny_config(vocab_size=64, embed_dim=32, num_layers=4, num_heads=4,
                       num_kv_heads=2, head_dim=8, mlp_dim=64, architecture=architecture,
                       qk_norm=True, sliding_window=2, layer_types=layer_types,
                       rope_local_theta=100.0 if gemma else None,
                       query_pre_attn_scalar=12 if gemma else None)
  model = _random_params(init_model(config, seed=2), seed=3)
  kw = (dict(temperature=0.0) if sampling == "greedy"
        else dict(temperature=0.8, top_k=20, top_p=0.95))
  rng = jax.random.key(5)
  want = generate(model, prompt, mask, STEPS, rng=rng, eos_id=None, **kw)
  shape = MeshShape(pipeline=pipe)
  got, _ = pipelined_generate(model, prompt, mask, STEPS,
                              mesh=make_mesh(shape, jax.devices()[:shape.size]),
                              num_microbatches=num_mb, rng=rng, eos_id=None, **kw)
  np.testing.assert_array_equal(got.tokens, want.tokens)
  np.testing.assert_allclose(got.logprobs, want.logprobs, atol=1e-5, rtol=0)
  # The window shapes these completions (prompt and completion exceed it).
  unwindowed = model
  unwindowed.config = unwindowed.layers.config = config.replace(sliding_window=None)
  plain = generate(unwindowed, prompt, mask, STEPS, rng=rng, eos_id=None, **kw)
  assert float(np.abs(np.asarray(plain.logprobs) - np.asarray(want.logprobs)).max()) > 1e-3
