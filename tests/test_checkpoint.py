"""Tests for pipe_rlhf_jax.checkpoint: Orbax save/restore and its safety checks."""

import hashlib
import os
import pathlib

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import ml_collections
import numpy as np
import optax
import pytest

from pipe_rlhf_jax import checkpoint as ckpt_lib
from pipe_rlhf_jax.checkpoint import Checkpointer, CheckpointError, CheckpointExistsError


def _make_state(scale=1.0):
  """Tiny train-state-like pytree sharded on a 4x2 mesh."""
  mesh = jax.make_mesh((4, 2), ("data", "tensor"))
  params = {
      "w": jax.device_put(
          scale * jnp.arange(32.0, dtype=jnp.float32).reshape(8, 4),
          NamedSharding(mesh, P("data", "tensor")),
      ),
      "b": (scale * jnp.arange(4)).astype(jnp.bfloat16),
  }
  opt_state = optax.adam(1e-3).init(params)
  return {
      "params": params,
      "opt": opt_state,
      "rng": jax.random.key_data(jax.random.key(7)),
      "step": jnp.asarray(5, jnp.int32),
  }


def _abstract_on(state, mesh, spec_for_w=P(None, "x")):
  """Abstract target on `mesh`: replicated except params/w."""
  def leaf(path, x):
    names = [getattr(e, "key", getattr(e, "name", None)) for e in path]
    spec = spec_for_w if names[-2:] == ["params", "w"] else P()
    return jax.ShapeDtypeStruct(x.shape, x.dtype,
                                sharding=NamedSharding(mesh, spec))
  return jax.tree_util.tree_map_with_path(leaf, jax.eval_shape(lambda: state))


def _plain_target(state):
  """Abstract target without shardings (restored onto the first device)."""
  return jax.tree_util.tree_map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)


def _assert_trees_equal(a, b):
  la, ta = jax.tree_util.tree_flatten(a)
  lb, tb = jax.tree_util.tree_flatten(b)
  assert ta == tb
  for x, y in zip(la, lb):
    assert x.dtype == y.dtype
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _snapshot(directory):
  """Relative path -> sha256 of every file under `directory`."""
  out = {}
  for root, _, files in os.walk(directory):
    for f in files:
      p = pathlib.Path(root) / f
      out[str(p.relative_to(directory))] = hashlib.sha256(
          p.read_bytes()).hexdigest()
  return out


def test_round_trip_to_different_mesh(tmp_path):
  state = _make_state()
  meta = {"config_fingerprint": "abc", "data": {"epoch": 1, "index": [3, 4]}}
  with Checkpointer(tmp_path / "ckpt") as ckpt:
    ckpt.save(10, state, metadata=meta)
    ckpt.wait()
    mesh2 = jax.make_mesh((2, 4), ("x", "y"))
    target = _abstract_on(state, mesh2)
    restored, got_meta = ckpt.restore(target=target)
  _assert_trees_equal(restored, state)
  assert got_meta == meta
  # Arrays land in the requested shardings of the new mesh, not the saved ones.
  w = restored["params"]["w"]
  assert w.sharding == target["params"]["w"].sharding
  assert w.sharding.mesh.axis_names == ("x", "y")
  # Optimizer state keeps its NamedTuple type.
  assert type(restored["opt"][0]) is type(state["opt"][0])


def test_small_replicated_arrays_save_without_compiling_a_slice_per_device(
    tmp_path, caplog):
  # Orbax's default would slice each replicated array into one part per replica, compiling
  # an eager slice per (shape, device); below REPLICA_PARALLEL_MIN_BYTES one replica
  # writes it whole. The replicated state still round-trips.
  mesh = jax.make_mesh((8,), ("data",))
  replicated = NamedSharding(mesh, P())
  state = {name: jax.device_put(jnp.arange(n, dtype=jnp.float32) * 0.5, replicated)
           for name, n in (("a", 96), ("b", 40), ("c", 7))}
  with jax.log_compiles(True), caplog.at_level("WARNING", "jax._src.interpreters.pxla"):
    with Checkpointer(tmp_path, async_save=False) as ckpt:
      ckpt.save(0, state, metadata={})
  compiled = [r.getMessage() for r in caplog.records if "Compiling" in r.getMessage()]
  assert not [m for m in compiled if "slice" in m], compiled
  target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=replicated)
            for k, v in state.items()}
  with Checkpointer(tmp_path) as ckpt:
    restored, _ = ckpt.restore(target=target)
  _assert_trees_equal(restored, state)


def test_typed_prng_key_round_trip(tmp_path):
  state = {"key": jax.random.key(3), "x": jnp.ones(2)}
  with Checkpointer(tmp_path, async_save=False) as ckpt:
    ckpt.save(0, state, metadata={})
    restored, _ = ckpt.restore(target=jax.eval_shape(lambda: state))
  np.testing.assert_array_equal(
      jax.random.key_data(restored["key"]), jax.random.key_data(state["key"]))


def test_keep_last_n_and_latest_step(tmp_path):
  ckpt = Checkpointer(tmp_path, max_to_keep=2)
  assert ckpt.latest_step() is None
  assert ckpt.all_steps() == []
  state = {"x": jnp.zeros(3)}
  for step in (1, 2, 3, 4):
    ckpt.save(step, {"x": state["x"] + step}, metadata={"step": step})
  ckpt.wait()
  assert ckpt.all_steps() == [3, 4]
  assert ckpt.latest_step() == 4
  assert not (tmp_path / "1").exists() and not (tmp_path / "2").exists()
  restored, meta = ckpt.restore(target=jax.eval_shape(lambda: state))
  np.testing.assert_array_equal(restored["x"], np.full(3, 4.0))
  assert meta == {"step": 4}
  ckpt.close()
  # A new process sees the same steps.
  reopened = Checkpointer(tmp_path, max_to_keep=2)
  assert reopened.all_steps() == [3, 4]
  restored, _ = reopened.restore(3, target=jax.eval_shape(lambda: state))
  np.testing.assert_array_equal(restored["x"], np.full(3, 3.0))
  reopened.close()


def test_refuses_to_overwrite(tmp_path):
  target = jax.eval_shape(lambda: {"x": jnp.zeros(2)})
  with Checkpointer(tmp_path) as ckpt:
    ckpt.save(3, {"x": jnp.ones(2)}, metadata={"v": 1})
    # Even while the first save may still be in flight.
    with pytest.raises(CheckpointExistsError, match="already exists"):
      ckpt.save(3, {"x": jnp.zeros(2)}, metadata={"v": 2})
    ckpt.wait()
  before = _snapshot(tmp_path)
  with Checkpointer(tmp_path) as ckpt:
    with pytest.raises(FileExistsError, match=str(tmp_path / "3")):
      ckpt.save(3, {"x": jnp.zeros(2)}, metadata={"v": 2})
    restored, meta = ckpt.restore(target=target)
  np.testing.assert_array_equal(restored["x"], np.ones(2))
  assert meta == {"v": 1}
  assert _snapshot(tmp_path) == before


def test_missing_checkpoint_raises_file_not_found(tmp_path):
  target = jax.eval_shape(lambda: {"x": jnp.zeros(2)})
  with Checkpointer(tmp_path / "empty") as ckpt:
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "empty")):
      ckpt.restore(target=target)
    ckpt.save(1, {"x": jnp.ones(2)}, metadata={})
    ckpt.wait()
    with pytest.raises(FileNotFoundError, match=r"step 2 .*available steps: \[1\]"):
      ckpt.restore(2, target=target)


@pytest.fixture(name="saved")
def _saved(tmp_path):
  state = _make_state()
  with Checkpointer(tmp_path, async_save=False) as ckpt:
    ckpt.save(1, state, metadata={"config_fingerprint": "fp1"})
  return tmp_path, state


def test_shape_mismatch_names_leaf(saved):
  directory, state = saved
  target = _plain_target(state)
  target["params"]["w"] = jax.ShapeDtypeStruct((8, 2), jnp.float32)
  before = _snapshot(directory)
  with Checkpointer(directory) as ckpt:
    with pytest.raises(CheckpointError) as e:
      ckpt.restore(target=target)
  msg = str(e.value)
  assert "params/w" in msg
  assert "(8, 4)" in msg and "(8, 2)" in msg
  assert "incompatible with the current config" in msg
  assert _snapshot(directory) == before


def test_dtype_mismatch_is_an_error_not_a_cast(saved):
  directory, state = saved
  target = _plain_target(state)
  target["params"]["b"] = jax.ShapeDtypeStruct((4,), jnp.float32)
  with Checkpointer(directory) as ckpt:
    with pytest.raises(CheckpointError) as e:
      ckpt.restore(target=target)
  msg = str(e.value)
  assert "params/b" in msg and "bfloat16" in msg and "float32" in msg


@pytest.mark.parametrize("change", ["missing", "extra"])
def test_structure_mismatch(saved, change):
  directory, state = saved
  target = _plain_target(state)
  if change == "missing":
    del target["rng"]
    expected = "not expected: rng"
  else:
    target["params"]["new_head"] = jax.ShapeDtypeStruct((2,), jnp.float32)
    expected = "not in the checkpoint: params/new_head"
  with Checkpointer(directory) as ckpt:
    with pytest.raises(CheckpointError, match="different structure") as e:
      ckpt.restore(target=target)
  assert expected in str(e.value)
  assert "new workdir" in str(e.value)


def test_abstract_mesh_target_rejected(saved):
  directory, state = saved
  with Checkpointer(directory) as ckpt:
    with pytest.raises(ValueError, match=r"leaf '[\w/]*/w' has a sharding on an AbstractMesh"):
      ckpt.restore(target=jax.eval_shape(lambda: state))


def test_expect_metadata(saved):
  directory, state = saved
  target = _plain_target(state)
  with Checkpointer(directory) as ckpt:
    _, meta = ckpt.restore(target=target,
                           expect_metadata={"config_fingerprint": "fp1"})
    assert meta["config_fingerprint"] == "fp1"
    assert ckpt.read_metadata() == {"config_fingerprint": "fp1"}
    with pytest.raises(CheckpointError, match="'config_fingerprint'.*'fp2'"):
      ckpt.restore(target=target, expect_metadata={"config_fingerprint": "fp2"})
    with pytest.raises(CheckpointError, match="'data_state'"):
      ckpt.restore(target=target, expect_metadata={"data_state": 1})


def _garble(path):
  data = path.read_bytes()
  path.write_bytes(bytes(b ^ 0x5A for b in data) or b"\x00garbage")


# Orbax's reader leaves an "Event loop is closed" message behind on failure.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("damage", [
    "garble_array_data", "truncate_manifest", "delete_manifest",
    "garble_json_metadata", "garble_tree_metadata",
])
def test_corrupt_checkpoint(saved, damage):
  directory, state = saved
  step_dir = directory / "1"
  if damage == "garble_array_data":
    files = list((step_dir / "state" / "d").iterdir())
    assert files
    for f in files:
      _garble(f)
  elif damage == "truncate_manifest":
    f = step_dir / "state" / "manifest.ocdbt"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
  elif damage == "delete_manifest":
    (step_dir / "state" / "manifest.ocdbt").unlink()
  elif damage == "garble_json_metadata":
    _garble(step_dir / "metadata" / "metadata")
  elif damage == "garble_tree_metadata":
    _garble(step_dir / "state" / "_METADATA")
  before = _snapshot(directory)
  with Checkpointer(directory) as ckpt:
    with pytest.raises(CheckpointError, match="corrupt") as e:
      ckpt.restore(target=_plain_target(state))
  assert str(step_dir) in str(e.value)
  # Nothing was deleted, repaired or rewritten.
  assert _snapshot(directory) == before


def test_non_json_metadata_rejected_before_writing(tmp_path):
  with Checkpointer(tmp_path) as ckpt:
    with pytest.raises(TypeError, match="JSON"):
      ckpt.save(1, {"x": jnp.ones(1)}, metadata={"bad": object()})
    assert ckpt.all_steps() == []


def test_config_fingerprint():
  base = {"model": {"layers": 2, "dim": 16}, "ppo": {"lr": 1e-5, "clip": 0.2},
          "workdir": "/tmp/a", "seed": 0}
  fp = ckpt_lib.config_fingerprint(base)
  assert isinstance(fp, str) and len(fp) == 16
  reordered = {"seed": 0, "workdir": "/elsewhere",
               "ppo": {"clip": 0.2, "lr": 1e-5}, "model": {"dim": 16, "layers": 2}}
  assert ckpt_lib.config_fingerprint(reordered) == fp
  assert ckpt_lib.config_fingerprint(ml_collections.ConfigDict(base)) == fp
  changed = {**base, "ppo": {"lr": 2e-5, "clip": 0.2}}
  assert ckpt_lib.config_fingerprint(changed) != fp
  assert ckpt_lib.config_fingerprint({**base, "seed": 1}) != fp
  # Dotted-path ignore.
  assert (ckpt_lib.config_fingerprint(changed, ignore=("workdir", "ppo.lr"))
          == ckpt_lib.config_fingerprint(base, ignore=("workdir", "ppo.lr")))


def test_config_fingerprint_ignores_the_run_plan():
  # A run preempted on one slice resumes on another: devices, meshes and mode do
  # not change the mathematics (job.py warns where the staleness bound changes).
  base = {"ppo": {"lr": 1e-5}, "plan": {"mode": "pipe", "num_devices": 0},
          "mesh": {"data": -1}, "stages": {"train": {"mesh": {"fsdp": -1}}}}
  other_plan = {"ppo": {"lr": 1e-5}, "plan": {"mode": "sequential", "num_devices": 4},
                "mesh": {"data": 2, "fsdp": 2}, "stages": {"train": {"mesh": {"data": 4}}}}
  assert ckpt_lib.config_fingerprint(base) == ckpt_lib.config_fingerprint(other_plan)
  assert (ckpt_lib.config_fingerprint(base)
          != ckpt_lib.config_fingerprint({**base, "ppo": {"lr": 2e-5}}))


def test_jsonl_files_count_by_content_in_the_fingerprints(tmp_path):
  # A file edited in place changes both fingerprints; the same bytes under another path
  # change neither; a generated task's config keeps the fingerprint it always had.
  from pipe_rlhf_jax.config import ExperimentSettings
  from pipe_rlhf_jax.data import digests
  from pipe_rlhf_jax.phases.warm_start import warm_start_fingerprint
  from tests.helpers.configs import tiny_quickstart

  def fingerprints(config):
    settings = ExperimentSettings.from_config(config)
    files = digests.file_digests(settings.data_files())
    return (ckpt_lib.config_fingerprint(digests.with_content(settings.to_dict(), files)),
            warm_start_fingerprint(settings))

  file_digests = lambda config: digests.file_digests(
      ExperimentSettings.from_config(config).data_files())
  generated = tiny_quickstart()
  assert file_digests(generated) == {}
  assert digests.with_content(generated.to_dict(), {}) == generated.to_dict()
  config = tiny_quickstart()
  config.data.task = "jsonl"
  config.reward.eval_fn = ""  # the reverse task's rule cannot score the user's prompts
  for role in digests.JSONL_ROLES:
    (tmp_path / f"{role}.jsonl").write_text(f'{{"prompt": "{role}"}}\n')
    config.data.jsonl[role] = str(tmp_path / f"{role}.jsonl")
  first = fingerprints(config)
  moved = tmp_path / "elsewhere.jsonl"
  moved.write_bytes((tmp_path / "demos.jsonl").read_bytes())
  config.data.jsonl.demos = str(moved)
  assert fingerprints(config) == first
  saved = file_digests(config)
  moved.write_text('{"prompt": "edited"}\n')
  edited = fingerprints(config)
  assert edited[0] != first[0] and edited[1] != first[1]
  assert digests.changed_file(saved, file_digests(config)).startswith(
      f"data.jsonl.demos={str(moved)!r} holds other data than it was made from: sha256 ")
  assert digests.changed_file(saved, saved) is None
  assert digests.changed_file(None, saved) is None  # a checkpoint that recorded none
  # The prompts decide PPO, not the warm start.
  (tmp_path / "prompts.jsonl").write_text('{"prompt": "other"}\n')
  assert fingerprints(config)[1] == edited[1] and fingerprints(config)[0] != edited[0]
