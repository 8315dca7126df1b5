"""LoRA adapters: a fresh adapter changes nothing, an adapter computes W + (alpha/r) A B in
every decoder, the split into trained and frozen parameters, and the exports (merged
checkpoint; peft's layout, loaded by peft onto the base in transformers)."""

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pipe_rlhf_jax import models
from pipe_rlhf_jax.config import LoRASettings
from pipe_rlhf_jax.generation import generate
from pipe_rlhf_jax.models import hf, lora
from pipe_rlhf_jax.models.transformer import init_model
from pipe_rlhf_jax.system.system import graphdef_of

BASE = models.tiny_config(vocab_size=64, embed_dim=32, num_layers=2, num_heads=4,
                          num_kv_heads=2, head_dim=8, mlp_dim=64)


def adapted(targets="all", rank=4, alpha=8.0, seed=0, scale_b=0.05, base=BASE):
  """(base model, adapted model of the same weights with non-zero adapters)."""
  cfg = LoRASettings(rank=rank, alpha=alpha, targets=targets).apply(base)
  base_model = init_model(base, seed=seed)
  state = lora.with_adapters(nnx.state(base_model), cfg, seed=seed + 1)
  for i, target in enumerate(cfg.lora_targets):
    b = state["layers"][lora.names(target)[1]]
    value = scale_b * jax.random.normal(jax.random.key(100 + i), b.get_value().shape)
    state["layers"][lora.names(target)[1]] = b.replace(value=value)
  return base_model, nnx.merge(graphdef_of(cfg), state)


def tokens(batch=2, length=7, seed=0):
  return jnp.asarray(np.random.default_rng(seed).integers(0, BASE.vocab_size,
                                                          (batch, length)), jnp.int32)


def test_fresh_adapters_compute_the_base_model():
  cfg = LoRASettings(rank=4, targets="all").apply(BASE)
  base = init_model(BASE, seed=0)
  model = nnx.merge(graphdef_of(cfg), lora.with_adapters(nnx.state(base), cfg, seed=1))
  x = tokens()
  np.testing.assert_array_equal(np.asarray(model(x)), np.asarray(base(x)))
  assert cfg.num_adapter_params() == sum(
      v.size for v in jax.tree.leaves(lora.split_trainable(nnx.state(model))[0]))


@pytest.mark.parametrize("targets", ["all", "q_proj,v_proj", "o_proj,down_proj"])
def test_an_adapter_equals_its_merged_projection(targets):
  base, model = adapted(targets)
  x = tokens()
  merged_state = lora.merged(nnx.state(model), model.config)
  merged = nnx.merge(graphdef_of(BASE), merged_state)
  got, want = np.asarray(model(x)), np.asarray(merged(x))
  assert np.abs(got - np.asarray(base(x))).max() > 1e-2  # the adapters do something
  np.testing.assert_allclose(got, want, atol=2e-5)
  # The base of an adapted model is the model it started from, the same arrays.
  base_state = lora.base_of(nnx.state(model))
  assert jax.tree.structure(base_state) == jax.tree.structure(nnx.state(base))
  assert all(a is b for a, b in zip(jax.tree.leaves(base_state),
                                    jax.tree.leaves(nnx.state(base))))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_plain_decoder_with_adapters_equals_it_on_the_merged_model(temperature):
  _, model = adapted()
  merged = nnx.merge(graphdef_of(BASE), lora.merged(nnx.state(model), model.config))
  x = tokens(batch=4, length=5)
  mask = jnp.ones(x.shape, bool)
  kwargs = dict(rng=jax.random.key(3), temperature=temperature, eos_id=None, pad_id=0)
  out, ref = generate(model, x, mask, 6, **kwargs), generate(merged, x, mask, 6, **kwargs)
  np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ref.tokens))
  np.testing.assert_allclose(np.asarray(out.logprobs), np.asarray(ref.logprobs), atol=1e-4)


def test_the_trainable_part_is_the_adapters_and_a_value_head():
  _, model = adapted()
  trainable, frozen = lora.split_trainable(nnx.state(model))
  assert all(isinstance(v, lora.Adapter) for v in jax.tree.leaves(
      trainable, is_leaf=lambda x: isinstance(x, nnx.Variable)))
  assert not lora.has_adapters(frozen)
  whole = lora.merge(trainable, frozen)
  assert jax.tree.structure(whole) == jax.tree.structure(nnx.state(model))
  # A critic's value head is fresh: it trains beside the adapters.
  critic_cfg = model.config.replace(head="value")
  critic = init_model(critic_cfg.base, seed=0)
  state = lora.with_adapters(nnx.state(critic), critic_cfg, seed=1)
  trainable, _ = lora.split_trainable(state)
  assert "scalar_head" in trainable
  # Without adapters every parameter trains and nothing is frozen.
  trainable, frozen = lora.split_trainable(nnx.state(init_model(BASE)))
  assert jax.tree.leaves(frozen) == []


def test_settings_name_the_field():
  with pytest.raises(ValueError, match=r"lora.targets: 'qproj' is not a projection"):
    LoRASettings(rank=4, targets="qproj").apply(BASE)
  with pytest.raises(ValueError, match=r"lora.targets is empty"):
    LoRASettings(rank=4, targets=" ,").apply(BASE)
  with pytest.raises(ValueError, match=r"lora.alpha=0.0 must be > 0"):
    LoRASettings(rank=4, alpha=0.0).apply(BASE)
  with pytest.raises(ValueError, match=r"lora.rank=-1"):
    BASE.replace(lora_rank=-1)
  assert LoRASettings(rank=0).apply(BASE) is BASE
  assert LoRASettings(rank=2, targets="attention,down_proj").apply(BASE).lora_targets == (
      "q_proj", "k_proj", "v_proj", "o_proj", "down_proj")


def test_the_merged_export_is_a_plain_checkpoint_of_the_base(tmp_path):
  _, model = adapted("attention")
  hf.save_pretrained(model, tmp_path)
  loaded = models.from_pretrained(tmp_path)
  assert loaded.config.lora_rank == 0
  x = tokens()
  np.testing.assert_allclose(np.asarray(loaded(x)), np.asarray(model(x)), atol=2e-5)


def test_peft_loads_the_adapters_onto_the_base_in_transformers(tmp_path):
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  peft = pytest.importorskip("peft")
  base_cfg = BASE.replace(eos_token_id=1, bos_token_id=2, pad_token_id=0)
  base, model = adapted("q_proj,k_proj,o_proj,up_proj,down_proj", base=base_cfg)
  hf.save_pretrained(base, tmp_path / "base")
  hf.save_adapters(model, tmp_path / "adapter")
  ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base",
                                                          torch_dtype=torch.float32)
  ref = peft.PeftModel.from_pretrained(ref, tmp_path / "adapter").eval()
  x = tokens()
  with torch.no_grad():
    expected = ref(torch.tensor(np.asarray(x))).logits.numpy()
  got = np.asarray(model(x))
  assert np.abs(got - np.asarray(base(x))).max() > 1e-2
  np.testing.assert_allclose(got, expected, atol=1e-4)


def test_the_pipelined_decoder_with_adapters_equals_the_plain_one():
  # Layers and their adapters split over 2 pipeline stages, heads over 2 tensor devices.
  from pipe_rlhf_jax.generation.pipelined import pipelined_generate
  from pipe_rlhf_jax.parallel.mesh import MeshShape, make_mesh
  _, model = adapted("all", base=BASE.replace(num_layers=4))
  x = tokens(batch=4, length=5)
  mask = jnp.ones(x.shape, bool)
  kwargs = dict(rng=jax.random.key(3), temperature=0.8, eos_id=None)
  shape = MeshShape(pipeline=2, tensor=2)
  out, _ = pipelined_generate(model, x, mask, 5, mesh=make_mesh(shape, jax.devices()[:4]),
                              num_microbatches=2, **kwargs)
  ref = generate(model, x, mask, 5, pad_id=0, **kwargs)
  np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ref.tokens))
  np.testing.assert_allclose(np.asarray(out.logprobs), np.asarray(ref.logprobs), atol=1e-5)
