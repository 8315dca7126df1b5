"""PPO with LoRA adapters: only adapters train and move, the reference is the base with
the adapters off, and the main job runs, exports and resumes with them."""

import json
import os

from flax import nnx
import jax
import numpy as np
import pytest

from pipe_rlhf_jax import models
from pipe_rlhf_jax.checkpoint import CheckpointError
from pipe_rlhf_jax.config import LoRASettings, MeshSpec, Plan, PPOSettings, StagePlan
from pipe_rlhf_jax.generation import SamplingSettings
from pipe_rlhf_jax.models import lora
from pipe_rlhf_jax.system import Models, PPOSystem, prompts_from_texts, run
from pipe_rlhf_jax.train import train
from tests.helpers.configs import tiny_quickstart
from tests.helpers.hf_helpers import write_tiny_llama

TIMING = ("time/", "tokens_per_s", "seconds", "bytes_per_second", "blocked_s", "wait_s")


def leaves(tree):
  return jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, nnx.Variable))


def test_only_the_adapters_train_and_move_between_stages(tmp_path):
  path = write_tiny_llama(tmp_path / "m")
  tok = models.load_tokenizer(path)
  policy = models.from_pretrained(path)
  base_before = jax.tree.map(np.asarray, nnx.state(policy))
  settings = LoRASettings(rank=4, alpha=8.0, targets="all")
  built = Models.from_policy(policy, lora_settings=settings)
  # per_stage: weights really move from the training mesh to the generation mesh.
  plan = Plan(mode="per_stage", generate=StagePlan(mesh=MeshSpec(data=-1)),
              train=StagePlan(mesh=MeshSpec(data=1, fsdp=-1)))
  system = PPOSystem(built, ppo=PPOSettings(steps=2, batch_size=8, minibatch_size=8,
                                            actor_lr=1e-2, critic_lr=1e-2),
                     sampling=SamplingSettings(max_new_tokens=4, eos_id=tok.eos_id,
                                               pad_id=tok.pad_id),
                     plan=plan, reward_fn=lambda p, c: [float(len(x)) for x in c],
                     decode=tok.decode)
  state = system.state
  # The trainer's state: the adapters (and the critic's value head), optimizer moments
  # for those alone.
  assert all(isinstance(v, lora.Adapter) for v in leaves(state.actor))
  adapter_size = built.actor_config.num_adapter_params()
  assert sum(x.size for x in jax.tree.leaves(state.actor)) == adapter_size
  assert sum(x.size for x in jax.tree.leaves(state.actor_opt)
             if x.ndim) == 2 * adapter_size  # Adam's two moments
  assert "scalar_head" in state.critic
  # What weight sync (and a cross-process weights link) carries: the trainable parts.
  moved = system.abstract_params()
  assert sum(x.size for x in jax.tree.leaves(moved["actor"])) == adapter_size
  assert jax.tree.structure(moved["critic"]) == jax.tree.structure(state.critic)
  # The reference is the base: no adapters, the policy's weights.
  assert not lora.has_adapters(system.reference)
  prompts = prompts_from_texts(["rev abc=", "rev bad=", "rev cab=", "rev dca="] * 4, tok,
                               prompt_len=10, batch_size=8)
  result = run(system, prompts, 2)
  assert len(result.metrics) == 2
  # Weight sync moved adapters only (float32; an adapter already laid out alike on both
  # meshes, replicated, is not moved), never the base.
  assert all(0 < r["transfer/actor_sync/bytes"] <= 4 * adapter_size for r in result.metrics)
  trained = jax.tree.map(np.asarray, system.trained_actor())
  base_after = lora.base_of(trained)
  for want, got in zip(jax.tree.leaves(base_before), jax.tree.leaves(base_after)):
    np.testing.assert_array_equal(got, want)  # the base never moves
  b = trained["layers"]["q_proj_lora_b"].get_value()
  assert np.abs(b).max() > 0  # the adapters did
  reference = jax.tree.map(np.asarray, system.reference)
  for want, got in zip(jax.tree.leaves(base_before), jax.tree.leaves(reference)):
    np.testing.assert_array_equal(got, want)
  # A checkpoint holds the adapters and names their base: other base weights are refused.
  meta = system.checkpoint_metadata()
  assert len(meta["base_fingerprint"]) == 64
  with pytest.raises(CheckpointError, match="adapters were trained on another base"):
    system.restore({"trainer": system.state}, {**meta, "base_fingerprint": "0" * 64})


def comparable(records):
  return [{k: v for k, v in r.items() if k != "time" and not any(t in k for t in TIMING)}
          for r in records]


def lora_tiny(mode="sequential", **overrides):
  return tiny_quickstart(mode, {"lora.rank": 4, "lora.alpha": 8.0, "ppo.steps": 3,
                                **overrides})


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
  return train(lora_tiny(), str(tmp_path_factory.mktemp("lora")), progress=False)


def test_the_main_job_trains_exports_and_resumes_with_adapters(tmp_path, lora_run):
  records = lora_run.ppo_metrics
  assert [r["step"] for r in records] == [0, 1, 2]
  assert all(np.isfinite(r["kl/mean"]) and np.isfinite(r["value_loss"]) for r in records)
  export = os.path.join(lora_run.workdir, "export")
  # The merged model is a plain checkpoint; the adapters alone are peft's layout.
  assert models.from_pretrained(export).config.lora_rank == 0
  adapter = json.load(open(os.path.join(export, "adapter", "adapter_config.json")))
  assert adapter["r"] == 4 and adapter["lora_alpha"] == 8.0 and adapter["peft_type"] == "LORA"
  part = str(tmp_path / "part")
  train(lora_tiny(), part, stop_after=1, progress=False)
  resumed = train(lora_tiny(), part, resume=True, progress=False).ppo_metrics
  assert comparable(resumed) == comparable(records)


@pytest.mark.slow
def test_pipe_mode_with_adapters_at_zero_staleness_equals_sequential(tmp_path, lora_run):
  config = lora_tiny("pipe", **{"plan.max_staleness": 0})
  piped = train(config, str(tmp_path), progress=False).ppo_metrics
  for got, want in zip(comparable(piped), comparable(lora_run.ppo_metrics)):
    for key in ("reward/mean", "kl/mean", "policy_loss", "value_loss"):
      assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), key
