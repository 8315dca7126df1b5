"""Tests for mesh construction, device splits and logical axis rules (8 CPU devices)."""

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import ml_collections
import numpy as np
import pytest

from pipe_rlhf_jax.parallel import logical
from pipe_rlhf_jax.parallel import mesh as mesh_lib
from pipe_rlhf_jax.parallel.logical import DEFAULT_RULES, STAGE_RULES


def test_eight_devices():
  assert jax.device_count() == 8


# ----------------------------------------------------------------- MeshShape


def test_mesh_shape_from_dict_and_configdict():
  shape = mesh_lib.MeshShape.from_config({"data": 2, "tensor": 4}, num_devices=8)
  assert shape == mesh_lib.MeshShape(data=2, fsdp=1, tensor=4, pipeline=1)
  assert shape.size == 8
  cfg = ml_collections.ConfigDict({"fsdp": -1, "pipeline": 2})
  shape = mesh_lib.MeshShape.from_config(cfg, num_devices=8)
  assert (shape.data, shape.fsdp, shape.tensor, shape.pipeline) == (1, 4, 1, 2)
  # Default device count comes from jax.
  assert mesh_lib.MeshShape.from_config({"data": -1}).data == 8
  assert mesh_lib.MeshShape.from_config({}, num_devices=1).size == 1


@pytest.mark.parametrize("config,match", [
    ({"data": 2, "tensr": 4}, r"stages\.generate\.mesh has unknown mesh axes \['tensr'\]"),
    ({"data": 0, "tensor": 8}, r"stages\.generate\.mesh\.data = 0"),
    ({"data": -2}, r"stages\.generate\.mesh\.data = -2"),
    ({"data": 2.0}, r"stages\.generate\.mesh\.data must be an int"),
    ({"data": -1, "tensor": -1}, r"several axes"),
    ({"data": 4, "tensor": 4}, r"= 16 but 8 devices were given; make the product 8"),
    ({"tensor": 3, "data": -1}, r"multiply to 3.*divide"),
])
def test_mesh_shape_errors_name_field(config, match):
  with pytest.raises(ValueError, match=match):
    mesh_lib.MeshShape.from_config(config, num_devices=8, field="stages.generate.mesh")


def test_make_mesh_axis_order_and_devices():
  devices = jax.devices()
  mesh = mesh_lib.make_mesh(mesh_lib.MeshShape(data=2, tensor=2), devices[4:8])
  assert mesh.axis_names == mesh_lib.MESH_AXES
  assert dict(mesh.shape) == {"data": 2, "fsdp": 1, "pipeline": 1, "tensor": 2}
  ids = np.vectorize(lambda d: d.id)(mesh.devices)
  # Tensor is innermost: consecutive devices form a tensor group.
  np.testing.assert_array_equal(ids.reshape(2, 2), [[4, 5], [6, 7]])
  assert mesh_lib.describe(mesh) == "data=2 fsdp=1 pipeline=1 tensor=2 on devices [4..7]"
  full = mesh_lib.make_mesh({"fsdp": -1})
  assert mesh_lib.describe(full) == "data=1 fsdp=8 pipeline=1 tensor=1 on devices [0..7]"
  odd = mesh_lib.make_mesh({"data": 2}, [devices[0], devices[3]])
  assert mesh_lib.describe(odd).endswith("on devices [0,3]")
  with pytest.raises(ValueError, match="needs 4 devices but 2"):
    mesh_lib.make_mesh(mesh_lib.MeshShape(tensor=4), devices[:2])


def test_split_devices():
  devices = jax.devices()
  groups = mesh_lib.split_devices(devices, {"generate": 4, "infer": 2, "train": 2})
  assert [d.id for d in groups["generate"]] == [0, 1, 2, 3]
  assert [d.id for d in groups["infer"]] == [4, 5]
  assert [d.id for d in groups["train"]] == [6, 7]
  partial = mesh_lib.split_devices(devices, {"a": 3})
  assert [d.id for d in partial["a"]] == [0, 1, 2]
  with pytest.raises(ValueError, match=r"generate=4 \+ infer=4 \+ train=2 = 10 exceeds the 8"):
    mesh_lib.split_devices(devices, {"generate": 4, "infer": 4, "train": 2})
  with pytest.raises(ValueError, match="device count for 'infer'=0 must be an integer >= 1"):
    mesh_lib.split_devices(devices, {"generate": 4, "infer": 0})


# ------------------------------------------------------------ logical rules


def test_logical_to_spec_without_mesh():
  assert logical.logical_to_spec(("batch", "length", "embed"), DEFAULT_RULES) == P(
      ("data", "fsdp"), None, None)  # fsdp is taken by batch, so embed stays whole
  assert logical.logical_to_spec(("embed", "heads", "head_dim"), DEFAULT_RULES) == P(
      "fsdp", "tensor", None)
  assert logical.logical_to_spec(("layers", "embed", "mlp"), DEFAULT_RULES) == P(
      "pipeline", "fsdp", "tensor")
  assert logical.logical_to_spec(("layers", "embed", "mlp"), STAGE_RULES["train"]) == P(
      None, "fsdp", "tensor")
  assert logical.logical_to_spec((None, "vocab"), DEFAULT_RULES) == P(None, "tensor")
  assert logical.logical_to_spec((), DEFAULT_RULES) == P()


def test_first_unused_rule_wins():
  rules = (("a", "tensor"), ("b", "tensor"), ("b", "fsdp"))
  assert logical.logical_to_spec(("a", "b"), rules) == P("tensor", "fsdp")
  assert logical.logical_to_spec(("b", "a"), rules) == P("tensor", None)


def test_logical_to_spec_drops_size_one_axes():
  mesh = mesh_lib.make_mesh(mesh_lib.MeshShape(fsdp=2, tensor=4))
  assert logical.logical_to_spec(("batch", "length", "embed"), DEFAULT_RULES, mesh) == P(
      "fsdp", None, None)
  assert logical.logical_to_spec(("layers", "embed", "heads", "head_dim"), DEFAULT_RULES,
                                 mesh) == P(None, "fsdp", "tensor", None)
  sharding = logical.logical_sharding(mesh, ("embed", "mlp"), DEFAULT_RULES)
  assert sharding == NamedSharding(mesh, P("fsdp", "tensor"))


def test_unknown_logical_name_raises():
  with pytest.raises(ValueError, match="logical axis 'embd' has no rule"):
    logical.logical_to_spec(("embd",), DEFAULT_RULES)
  with pytest.raises(TypeError, match="tuple of names"):
    logical.logical_to_spec("embed", DEFAULT_RULES)


def test_tree_shardings_treats_tuples_as_leaves():
  mesh = mesh_lib.make_mesh(mesh_lib.MeshShape(data=2, tensor=4))
  tree = {"embed": {"embedding": ("vocab", "embed")},
          "layers": [{"kernel": ("layers", "embed", "mlp")}, {"scale": ("embed",)}],
          "step": ()}
  out = logical.tree_shardings(mesh, tree, DEFAULT_RULES)
  assert out["embed"]["embedding"] == NamedSharding(mesh, P("tensor", None))
  assert out["layers"][0]["kernel"] == NamedSharding(mesh, P(None, None, "tensor"))
  assert out["layers"][1]["scale"] == NamedSharding(mesh, P(None))
  assert out["step"] == NamedSharding(mesh, P())


def test_check_divisible_message():
  mesh = mesh_lib.make_mesh(mesh_lib.MeshShape(data=2, tensor=4))
  logical_tree = {"layers": {"attn": {
      "k_proj": {"kernel": ("embed", "kv_heads", "head_dim")},
      "q_proj": {"kernel": ("embed", "heads", "head_dim")}}}}
  good = {"layers": {"attn": {
      "k_proj": {"kernel": jax.ShapeDtypeStruct((16, 4, 8), jnp.float32)},
      "q_proj": {"kernel": np.zeros((16, 8, 8))}}}}
  logical.check_divisible(good, logical_tree, mesh, DEFAULT_RULES)
  bad = {"layers": {"attn": {
      "k_proj": {"kernel": jax.ShapeDtypeStruct((16, 2, 8), jnp.float32)},
      "q_proj": {"kernel": jax.ShapeDtypeStruct((16, 8, 8), jnp.float32)}}}}
  with pytest.raises(ValueError) as info:
    logical.check_divisible(bad, logical_tree, mesh, DEFAULT_RULES)
  message = str(info.value)
  assert ("kv_heads=2 is not divisible by tensor=4 at layers/attn/k_proj/kernel"
          in message)
  assert "use tensor in {1,2}" in message
  assert "q_proj" not in message
  with pytest.raises(ValueError, match="has 2 dims but logical axes"):
    logical.check_divisible({"w": (4, 4)}, {"w": ("embed", "mlp", "vocab")}, mesh,
                            DEFAULT_RULES)
  # Multi-axis entries: batch over data*fsdp.
  fsdp_mesh = mesh_lib.make_mesh(mesh_lib.MeshShape(data=2, fsdp=4))
  with pytest.raises(ValueError, match=r"batch=6 is not divisible by data\*fsdp=8"):
    logical.check_divisible({"x": (6, 3)}, {"x": ("batch", "length")}, fsdp_mesh,
                            DEFAULT_RULES)


# ------------------------------------------------------ activation constraints


def test_constrain_is_noop_without_context():
  x = jnp.ones((4, 8))
  assert logical.constrain(x, ("batch", "embed")) is x
  assert logical.current_axis_rules() is None


def test_constrain_applies_sharding_in_context():
  mesh = mesh_lib.make_mesh(mesh_lib.MeshShape(data=2, tensor=4))

  @jax.jit
  def f(x):
    return logical.constrain(x * 2.0, ("batch", "mlp"))

  x = jnp.arange(32.0).reshape(4, 8)
  with logical.axis_rules(mesh, DEFAULT_RULES):
    assert logical.current_axis_rules()[0] is mesh
    y = f(x)
  assert logical.current_axis_rules() is None
  np.testing.assert_array_equal(np.asarray(y), np.asarray(x) * 2.0)
  assert y.sharding.is_equivalent_to(NamedSharding(mesh, P("data", "tensor")), 2)


def test_constrain_drops_indivisible_axes():
  mesh = mesh_lib.make_mesh(mesh_lib.MeshShape(data=2, tensor=4))
  assert logical.activation_spec((1, 8), ("batch", "mlp"), mesh, DEFAULT_RULES) == P(
      None, "tensor")
  assert logical.activation_spec((2, 6), ("batch", "mlp"), mesh, DEFAULT_RULES) == P(
      "data", None)
  both = mesh_lib.make_mesh(mesh_lib.MeshShape(data=2, fsdp=4))
  # Longest dividing prefix of (data, fsdp) is kept.
  assert logical.activation_spec((2, 3), ("batch", None), both, DEFAULT_RULES) == P(
      "data", None)

  @jax.jit
  def f(x):
    return logical.constrain(x + 1.0, ("batch", "mlp"))

  with logical.axis_rules(mesh, DEFAULT_RULES):
    y = f(jnp.zeros((1, 8)))
  np.testing.assert_array_equal(np.asarray(y), np.ones((1, 8)))
  assert y.sharding.is_equivalent_to(NamedSharding(mesh, P(None, "tensor")), 2)


def test_constrain_rank_mismatch_raises_in_context():
  mesh = mesh_lib.make_mesh(mesh_lib.MeshShape(tensor=8))
  with logical.axis_rules(mesh, DEFAULT_RULES):
    with pytest.raises(ValueError, match="one name"):
      logical.constrain(jnp.ones((2, 2)), ("batch",))


def test_constrain_is_noop_inside_shard_map():
  mesh = mesh_lib.make_mesh(mesh_lib.MeshShape(tensor=4), jax.devices()[:4])

  def body(x):  # x: [2] per device
    return logical.constrain(x * 3.0, ("mlp",))

  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("tensor"), out_specs=P("tensor")))
  with logical.axis_rules(mesh, DEFAULT_RULES):
    y = f(jnp.arange(8.0))
  np.testing.assert_array_equal(np.asarray(y), np.arange(8.0) * 3.0)


def test_rules_from_config():
  rules = logical.rules_from_config({"layers": None, "embed": ["data", "fsdp"]})
  assert logical.logical_to_spec(("layers", "embed"), rules) == P(None, ("data", "fsdp"))
  with pytest.raises(ValueError, match=r"stage\.rules\.embed names mesh axis 'model'"):
    logical.rules_from_config({"embed": "model"}, field="stage.rules")
