"""The warm start (SFT + reward model) is independent of the PPO plan, and runs in other
modes can start PPO from one shared warm-start checkpoint."""

import json
import os

from flax import nnx
import jax
import numpy as np
import pytest

from pipe_rlhf_jax.checkpoint import (
  Checkpointer,  # noqa: E402
  CheckpointError,  # noqa: E402
)
from pipe_rlhf_jax.config.experiment import ModelSettings  # noqa: E402
from pipe_rlhf_jax.models.tokenizer import load_tokenizer  # noqa: E402
from pipe_rlhf_jax.models.transformer import init_model  # noqa: E402
from pipe_rlhf_jax.train import prepare_warm_start, train  # noqa: E402
from tests.helpers.configs import tiny_quickstart  # noqa: E402


def tiny(mode: str, **overrides):
  """The tiny quickstart on the plain sampler (less to compile) for 2 PPO steps."""
  return tiny_quickstart(mode, {"stages.generate.mesh": dict(data=-1), "ppo.steps": 2,
                                **overrides})


def read_warm_start(directory):
  """The warm-start checkpoint's {"actor", "reward"} parameters (on one device) and
  metadata."""
  cfgs = ModelSettings.from_config(tiny("sequential").model).role_configs(load_tokenizer("byte"))
  target = {name: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                               nnx.state(nnx.eval_shape(lambda c=cfgs[name]: init_model(c))))
            for name in ("actor", "reward")}
  with Checkpointer(directory, async_save=False) as ckpt:
    state, meta = ckpt.restore(target=target)
  return jax.device_get(state), meta


@pytest.fixture(scope="module")
def warm_starts(tmp_path_factory):
  """The tiny warm start prepared under two PPO plans whose training stages differ:
  sequential (PPO trains on data=8) and pipe (fsdp=4 on devices 4-7). One task dataset
  (`data.dir` is a location, outside the warm start's fingerprint)."""
  data = str(tmp_path_factory.mktemp("data"))
  return {"data": data, **{mode: prepare_warm_start(tiny(mode, **{"data.dir": data}),
                                                    str(tmp_path_factory.mktemp(mode)),
                                                    progress=False)
                           for mode in ("sequential", "pipe")}}


def test_warm_start_is_identical_in_every_mode(warm_starts):
  reference, meta = read_warm_start(warm_starts["sequential"]["checkpoint"])
  state, other_meta = read_warm_start(warm_starts["pipe"]["checkpoint"])
  assert jax.tree.structure(state) == jax.tree.structure(reference)
  for a, b in zip(jax.tree.leaves(reference), jax.tree.leaves(state)):
    np.testing.assert_array_equal(a, b)  # to the last bit, not within a tolerance
  assert other_meta == meta
  assert warm_starts["pipe"]["rm_eval"] == warm_starts["sequential"]["rm_eval"]


@pytest.mark.slow
def test_ppo_starts_from_a_shared_warm_start(tmp_path, warm_starts):
  shared = warm_starts["sequential"]["checkpoint"]
  workdir = str(tmp_path / "pipe")
  # log.eval_prompts: held-out greedy answers scored before and after PPO (off in tiny).
  # And 2 sampled answers per held-out prompt; the reward model standardised over 2
  # answers per prompt of the warm-start policy.
  result = train(tiny("pipe", **{"warm_start.checkpoint": shared, "log.eval_prompts": 16,
                                 "log.eval_samples_per_prompt": 2,
                                 "reward.normalize_samples_per_prompt": 2,
                                 "data.dir": warm_starts["data"]}), workdir, progress=False)
  phases = [json.loads(line)["phase"] for line in open(os.path.join(workdir,
                                                                     "metrics.jsonl"))]
  assert "sft" not in phases and "reward_model" not in phases  # restored, not trained
  assert not os.path.exists(os.path.join(workdir, "warmstart"))
  assert result.rm_eval == warm_starts["sequential"]["rm_eval"]
  assert [r["step"] for r in result.ppo_metrics] == [0, 1]
  assert result.heldout_prompts == 16
  for scores in (result.heldout_before, result.heldout_after):
    assert list(scores) == ["reverse_accuracy"] and 0 <= scores["reverse_accuracy"] <= 1
  assert "held-out greedy reverse_accuracy" in result.summary
  assert "(16 prompts; change " in result.summary  # and its interval over the prompts
  assert "held-out sampled (2 per prompt) reverse_accuracy" in result.summary
  stats = result.reward_stats
  assert stats["std"] > 0 and stats["samples"] % 2 == 0
  assert f"score mean {stats['mean']:.4g}, std {stats['std']:.4g}" in result.summary
  for when in ("before", "after"):
    per_prompt = result.heldout_per_prompt[when]["reverse_accuracy"]
    assert len(per_prompt) == 16
    scores = getattr(result, f"heldout_{when}")
    assert np.mean(per_prompt) == pytest.approx(scores["reverse_accuracy"], abs=1e-6)


def test_shared_warm_start_of_another_seed_is_refused(tmp_path, warm_starts):
  config = tiny("sequential", **{"warm_start.checkpoint": warm_starts["pipe"]["checkpoint"]})
  config.seed = 1
  with pytest.raises(CheckpointError, match="warm_start.checkpoint=.*another seed"):
    train(config, str(tmp_path), progress=False)
  assert not os.path.exists(tmp_path / "data")  # refused before any data are built


def test_bad_warm_start_fields_name_the_field(tmp_path):
  with pytest.raises(ValueError, match="warm_start.checkpoint='/nonexistent' is not a dir"):
    train(tiny("sequential", **{"warm_start.checkpoint": "/nonexistent"}), str(tmp_path),
          progress=False)
  with pytest.raises(FileNotFoundError, match="holds no warm-start checkpoint"):
    train(tiny("sequential", **{"warm_start.checkpoint": str(tmp_path)}),
          str(tmp_path / "run"), progress=False)
  config = tiny("sequential")
  config.warm_start.mesh = dict(data=16)
  with pytest.raises(ValueError, match="warm_start.mesh=.* needs 16 devices but the job has 8"):
    train(config, str(tmp_path / "mesh"), progress=False)
  config = tiny("sequential")
  config.sft.batch_size = 15  # 2 batch shards on fsdp=2
  with pytest.raises(ValueError, match=r"sft.batch_size=15 does not split over the 2 .*"
                                       r"warm_start.mesh"):
    train(config, str(tmp_path / "batch"), progress=False)
  assert not os.path.exists(tmp_path / "batch" / "data")  # all before any data are built


def test_warm_start_devices_come_from_every_process():
  # A multi-process job: an explicit warm_start.mesh takes as many devices from each
  # process (each process runs the warm start's programs), in process order.
  from types import SimpleNamespace

  from pipe_rlhf_jax.phases.supervised import _warm_start_devices
  devices = [SimpleNamespace(id=i, process_index=p) for p, i in
             [(1, 4), (1, 5), (1, 6), (1, 7), (0, 0), (0, 1), (0, 2), (0, 3)]]
  assert [d.id for d in _warm_start_devices(devices, 2)] == [0, 4]
  assert [d.id for d in _warm_start_devices(devices, 4)] == [0, 1, 4, 5]
  assert [d.id for d in _warm_start_devices(devices[4:], 2)] == [0, 1]  # one process
  with pytest.raises(ValueError, match="warm_start.mesh needs 3 devices"):
    _warm_start_devices(devices, 3)


def test_reward_model_can_start_from_the_sft_backbone(tmp_path, monkeypatch):
  # reward_model.init="sft": the reward phase starts from the SFT result's backbone (to
  # the bit) with a fresh score head; "base" from the freshly initialised model.
  from pipe_rlhf_jax.phases import supervised
  real_fit, started = supervised.fit, {}

  def recording_fit(loss_fn, params, layout, batches, **kw):
    before = jax.device_get(params)  # fit donates its input
    trained = real_fit(loss_fn, params, layout, batches, **kw)
    started[kw["phase"]] = (before, jax.device_get(trained[0]))
    return trained

  monkeypatch.setattr(supervised, "fit", recording_fit)
  for init in ("sft", "base"):
    prepare_warm_start(tiny("sequential", **{"reward_model.init": init}),
                       str(tmp_path / init), progress=False)
    _, sft = started["sft"]
    reward_start, _ = started["reward_model"]
    for key in ("embedding", "layers", "final_norm"):
      same = [np.array_equal(a, b) for a, b in zip(jax.tree.leaves(sft[key]),
                                                   jax.tree.leaves(reward_start[key]))]
      assert all(same) if init == "sft" else not any(same), (init, key)
  config = tiny("sequential", **{"reward_model.init": "policy"})
  with pytest.raises(ValueError, match=r"reward_model.init='policy'; choose one of"):
    train(config, str(tmp_path / "bad"), progress=False)


def test_a_warm_start_whose_demonstrations_changed_is_refused(tmp_path):
  # The user's files edited in place: the run's own warm start and a shared one were
  # trained on other demonstrations than the file now holds.
  from pipe_rlhf_jax.data import task
  paths = task.write_task_jsonl(str(tmp_path / "jsonl"), num_prompts=64, num_demos=64,
                                num_pairs=64, seed=1, num_eval=16)
  config = tiny("sequential", **{"data.task": "jsonl", "reward.eval_fn": "",
                                 **{f"data.jsonl.{role}": path
                                    for role, path in paths.items()}})
  workdir = str(tmp_path / "run")
  prepare_warm_start(config, workdir, progress=False)
  with open(paths["demos"], "ab") as f:
    f.write(b'{"prompt": "rev zz=", "completion": "zz"}\n')
  with pytest.raises(CheckpointError, match=r"the warm start in .*run/warmstart was trained "
                                            r"on other data: data.jsonl.demos='.*demos.jsonl' "
                                            r"holds other data .*Restore the file, or use a "
                                            r"new workdir"):
    prepare_warm_start(config, workdir, progress=False)
  shared = tiny("sequential", **{"warm_start.checkpoint": os.path.join(workdir, "warmstart")})
  shared.data, shared.reward = config.data, config.reward
  with pytest.raises(CheckpointError, match=r"data.jsonl.demos=.*Restore the file, or set "
                                            r"--config.warm_start.checkpoint=''"):
    train(shared, str(tmp_path / "other"), progress=False)
  assert not os.path.exists(tmp_path / "other" / "data")  # before any data are built
