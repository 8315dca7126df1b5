"""Arrays between process groups: versioned weights and bounded queues over transfer servers.

In `pipe` mode across processes each stage's group of processes runs its own programs
(MPMD), so weights and rollouts cannot move by a collective or a cross-process
`jax.device_put` (which needs every process to issue every transfer in the same order).
This module moves them with `jax.experimental.transfer`: every process runs one transfer
server (listening on `cluster.listen_host()`, never a wildcard address), the sender makes
an array pytree available under an id (`await_pull`), and the receiver pulls that id into
arrays on its own devices. Addresses, ids, versions, layouts and back-pressure counters
travel through the coordination service's key-value store. No other networking.

A stage may span several processes (SPMD inside its group: every process of the group
runs the stage's programs in the same order). Its first process is the group's leader.
Sending from such a group, every process takes part in the same gather of each array to
a replicated copy on the group's mesh (`arrays.local_copy`, a program only the group
runs) and waits for the same back-pressure, and the leader alone offers the data.
Receiving into such a group, each process pulls only its own block of every array: the
part its devices hold, laid out on its sub-mesh with the array's partition spec
(`block_of`; the process's devices must be a rectangular block of the stage's mesh), and
assembles the global array from its shards (`jax.make_array_from_single_device_arrays`).
A stage within one process receives the whole array, as a block of itself.

The transfer copies shard i of the source to shard i of the destination: with different
mesh shapes, partition specs or blocks it would silently assemble a wrong array. So every
grant and every queue item carries the sender's layout of each receiving process's block
(`LeafLayout`: per leaf shape, dtype, mesh axis sizes, partition spec, start in the
global array), and that process checks it against its own target before it pulls
(`LayoutMismatch`, naming the leaf, before any data moves). The sender lays each block
out on a mesh of the receiving process's sub-mesh shape and specs built on its own
devices (`mirror_shardings`), which needs at least as many devices in the sending
process as the receiving process holds of the receiving stage's mesh. A staged block is
a copy the sender owns, never a buffer of the source (a training step donates its
parameters while a block may still wait to be pulled: an alias was seen to hang the
puller), and the sender keeps it until every receiving process has reported its pull
in the key-value store (`pulled` / `taken` counters).

* `WeightPublisher` / `WeightSubscriber`: the trainer publishes (params, version); a
  consuming stage's leader asks for "a version >= v" and every process of the stage
  receives the newest, the same one (the grant is per request, read by all of them).
  The publisher keeps only the newest version's staged blocks and serves requests from a
  thread; nothing is offered on the transfer server before a request grants it, so a
  skipped version's blocks are freed when the next one is published, and a granted
  block stays alive until its process has pulled it.
* `QueueSender` / `QueueReceiver`: an ordered stream of pytrees (rollouts, experience)
  with at most `capacity` items not yet pulled by every receiving process, and an end
  marker.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import secrets
import threading
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec
import numpy as np

from pipe_rlhf_jax.concurrency.queues import PipelineShutdown
from pipe_rlhf_jax.distributed import arrays, cluster

_PREFIX = "pipe_rlhf_jax/transfer"
DEFAULT_POLL_S = 0.005


class LayoutMismatch(ValueError):
  """A cross-process transfer whose sender and receiver layouts differ (refused)."""


class TransferClosed(PipelineShutdown):
  """A wait was abandoned because a stop was requested (a clean exit of a worker)."""


class StreamEnded(PipelineShutdown):
  """The sender closed the queue: no item follows."""


# ---- layouts ------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class LeafLayout:
  """What must agree between the two ends of a transfer for one array."""

  path: str
  shape: tuple[int, ...]
  dtype: str
  mesh: tuple[tuple[str, int], ...]  # (axis name, size) in mesh order
  spec: tuple[Any, ...]  # the PartitionSpec's entries (None, a name, or a tuple of names)
  # Where the block starts in the global array (zeros for a whole array): a receiving
  # process of a multi-process stage pulls only its own block (`block_of`).
  start: tuple[int, ...] = ()

  def as_json(self) -> list:
    return [self.path, list(self.shape), self.dtype, [list(a) for a in self.mesh],
            [list(e) if isinstance(e, tuple) else e for e in self.spec], list(self.start)]

  @classmethod
  def from_json(cls, value: list) -> "LeafLayout":
    path, shape, dtype, mesh, spec, start = value
    return cls(path, tuple(shape), dtype, tuple((a, int(n)) for a, n in mesh),
               tuple(tuple(e) if isinstance(e, list) else e for e in spec),
               tuple(int(i) for i in start))

  def __str__(self) -> str:
    mesh = ",".join(f"{a}={n}" for a, n in self.mesh)
    at = f" at {list(self.start)}" if any(self.start) else ""
    return f"{self.dtype}{list(self.shape)}{at} on mesh({mesh}) spec {self.spec}"


def _normalized_spec(spec: PartitionSpec, ndim: int) -> tuple[Any, ...]:
  """The spec padded to `ndim` entries, 1-tuples as plain names (equal layouts compare
  equal however they were written)."""
  entries = list(spec) + [None] * (ndim - len(spec))
  out = []
  for e in entries:
    if isinstance(e, (tuple, list)):
      e = tuple(e)
      e = e[0] if len(e) == 1 else (None if not e else e)
    out.append(e)
  return tuple(out)


def layout_of(tree: Any) -> list[LeafLayout]:
  """The layout of every array (or ShapeDtypeStruct with a NamedSharding) in `tree`."""
  out = []
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    name = jax.tree_util.keystr(path)
    sharding = getattr(leaf, "sharding", None)
    if not isinstance(sharding, NamedSharding):
      raise TypeError(f"leaf {name}: a cross-process transfer needs a NamedSharding, got "
                      f"{sharding!r}.")
    mesh = tuple((a, int(n)) for a, n in sharding.mesh.shape.items())
    out.append(LeafLayout(name, tuple(leaf.shape), str(np.dtype(leaf.dtype)), mesh,
                          _normalized_spec(sharding.spec, len(leaf.shape)),
                          (0,) * len(leaf.shape)))
  return out


def check_same_layout(sent: Sequence[LeafLayout], wanted: Sequence[LeafLayout],
                      what: str) -> None:
  """Raises `LayoutMismatch` naming the first differing leaf (or the structure)."""
  if [x.path for x in sent] != [x.path for x in wanted]:
    missing = sorted({x.path for x in wanted} - {x.path for x in sent})[:5]
    extra = sorted({x.path for x in sent} - {x.path for x in wanted})[:5]
    raise LayoutMismatch(f"{what}: the sender's pytree differs from the receiver's "
                         f"(missing {missing}, unexpected {extra}); nothing was moved.")
  for s, w in zip(sent, wanted):
    if s != w:
      raise LayoutMismatch(
          f"{what}: leaf {s.path} is sent as {s} but the receiver expects {w}; a transfer "
          "between different layouts would assemble a wrong array, so nothing was moved. "
          "Give the sender the receiving stage's shardings, built from the same plan "
          "and device order as the receiver's.")


def mirror_shardings(shardings: Any, devices: Sequence[Any]) -> Any:
  """The receiver's NamedShardings rebuilt on this side's `devices`: same mesh axes and
  sizes (on the first devices, in order), same specs.

  The sender builds the receiver's layout exactly as the receiver does (both read the
  same plan; `jax.devices()` lists every process's devices), mirrors it here, and
  reshards onto the mirror on its own devices before sending.
  """
  devices = tuple(devices)

  def one(sharding: NamedSharding) -> NamedSharding:
    return NamedSharding(_mirror_mesh(sharding.mesh, devices), sharding.spec)

  return jax.tree.map(one, shardings,
                      is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))


@functools.lru_cache(maxsize=256)
def _mirror_mesh(mesh: jax.sharding.Mesh, devices: tuple) -> jax.sharding.Mesh:
  """`mesh`'s axes and sizes on the first `mesh.size` of `devices` (made once)."""
  if mesh.size > len(devices):
    raise ValueError(f"the receiver's mesh {dict(mesh.shape)} has {mesh.size} devices "
                     f"but the sender has {len(devices)}: a transfer needs the same "
                     "mesh shape on both sides; give the sending stage at least as "
                     "many devices per process as a receiving process holds.")
  grid = np.empty(mesh.size, dtype=object)
  grid[:] = devices[:mesh.size]
  return jax.sharding.Mesh(grid.reshape(mesh.devices.shape), mesh.axis_names,
                           axis_types=mesh.axis_types)


# ---- blocks: the part of an array one process of a multi-process stage holds ---------
def is_rectangular(mask: np.ndarray) -> bool:
  """Whether the True cells of `mask` (a process's devices in a mesh-shaped grid) form a
  box: every combination of their coordinates along the axes is True."""
  where = np.argwhere(mask)
  return bool(len(where)) and int(np.prod([len(np.unique(where[:, k]))
                                           for k in range(mask.ndim)])) == len(where)


def process_of(device) -> int:
  """The process holding `device` (the default `owner` of the functions below; tests pass
  another to simulate several processes in one)."""
  return device.process_index


@functools.lru_cache(maxsize=256)
def process_submesh(mesh: jax.sharding.Mesh, process: int,
                    owner: Callable[[Any], int] = process_of) -> jax.sharding.Mesh:
  """`process`'s devices in `mesh` (`owner(device)` is a device's process), as a mesh with
  the same axes.

  They must form a rectangular block of the mesh (a box of coordinates along every
  axis): raises ValueError, naming plan.placement, otherwise.
  """
  owners = np.vectorize(owner, otypes=[int])(mesh.devices)
  where = np.argwhere(owners == process)  # [devices of the process, mesh.ndim]
  if not len(where):
    raise ValueError(f"process {process} holds no device of the mesh {dict(mesh.shape)}.")
  box = mesh.devices[np.ix_(*[np.unique(where[:, k]) for k in range(owners.ndim)])]
  if not is_rectangular(owners == process):
    raise ValueError(
        f"plan.placement: process {process}'s devices in the mesh {dict(mesh.shape)} "
        f"are not a rectangular block of it (at mesh coordinates {where.tolist()}), so it "
        "cannot receive its part of the stage's arrays as one block; give each process "
        "of a stage whole slices of the mesh's outer axes (e.g. a device count per "
        "process that the product of the inner axes' sizes divides).")
  return jax.sharding.Mesh(box, mesh.axis_names, axis_types=mesh.axis_types)


@dataclasses.dataclass(frozen=True)
class Block:
  """The part of a global array one process's devices hold: `shape` elements from
  `start` along every axis, laid out by `sharding` (the process's sub-mesh, the global
  array's partition spec), which puts on each of its devices that device's shard."""

  start: tuple[int, ...]
  shape: tuple[int, ...]
  sharding: NamedSharding

  @property
  def index(self) -> tuple[slice, ...]:
    return tuple(slice(a, a + n) for a, n in zip(self.start, self.shape))


def _bounds(index: tuple[slice, ...], shape: tuple[int, ...]) -> list[tuple[int, int]]:
  return [(s.start or 0, n if s.stop is None else s.stop) for s, n in zip(index, shape)]


@functools.lru_cache(maxsize=4096)
def block_of(sharding: NamedSharding, shape: tuple[int, ...], process: int,
             owner: Callable[[Any], int] = process_of) -> Block:
  """The block of a `shape` array laid out by `sharding` that `process` holds.

  A mesh wholly in `process` gives the whole array on `sharding` itself. Otherwise the
  block spans the process's shards and is laid out on its sub-mesh (`process_submesh`)
  with the same spec; raises ValueError when that layout would not put every device's
  own shard on it (an axis split over processes in an order a block cannot reproduce).
  """
  shape = tuple(shape)
  mesh = sharding.mesh
  if all(owner(d) == process for d in mesh.devices.flat):
    return Block((0,) * len(shape), shape, sharding)
  sub = NamedSharding(process_submesh(mesh, process, owner), sharding.spec)
  wanted = {d: _bounds(index, shape) for d, index in
            sharding.devices_indices_map(shape).items() if owner(d) == process}
  start = tuple(min(b[k][0] for b in wanted.values()) for k in range(len(shape)))
  stop = tuple(max(b[k][1] for b in wanted.values()) for k in range(len(shape)))
  block = tuple(b - a for a, b in zip(start, stop))
  got = sub.devices_indices_map(block)
  for device, bounds in wanted.items():
    if [(a + s, b + s) for (a, b), s in zip(_bounds(got[device], block), start)] != bounds:
      raise ValueError(
          f"plan.placement: the {list(shape)} array laid out as {sharding.spec} on the "
          f"mesh {dict(mesh.shape)} is not one block per process (process {process}'s "
          f"device {device.id} holds {bounds}, its block layout would give it another "
          "part), so it cannot be sent block by block; split the stage's processes "
          "along the mesh's outer axes.")
  return Block(start, block, sub)


def stage_blocks(tree: Any, targets: Any, consumers: Sequence[int],
                 devices: Sequence[Any]) -> dict[int, tuple[list, list]]:
  """Per consuming process: (its block of every leaf of `tree` laid out on a mirror of
  its sub-mesh on `devices`, the blocks' layouts as JSON for the receiver's check).

  `tree`: arrays this process holds wholly; `targets`: the receiving stage's (global)
  NamedSharding of every leaf. Equal blocks of several processes (replicated parts) are
  staged once, as copies that share no buffer with `tree`.
  """
  leaves, treedef = jax.tree.flatten(tree)
  shardings = treedef.flatten_up_to(targets)
  made: dict[Any, jax.Array] = {}
  out = {}
  for process in consumers:
    staged, starts = [], []
    for i, (x, sharding) in enumerate(zip(leaves, shardings)):
      block = block_of(sharding, tuple(x.shape), process)
      mirror = mirror_shardings(block.sharding, devices)
      key = (i, block.start, block.shape, mirror)
      if key not in made:
        # A copy this side owns, never sharing a buffer with the source: the source may be
        # donated (a training step donates its parameters) while the block waits on the
        # transfer server to be pulled. (`device_put(may_alias=False)` still reuses the
        # buffer of a shard that stays on its device; a slice is a new buffer already.)
        part = jnp.array(x, copy=True) if block.shape == tuple(x.shape) else x[block.index]
        made[key] = jax.device_put(part, mirror)
      staged.append(made[key])
      starts.append(block.start)
    layouts = [dataclasses.replace(x, start=s).as_json() for x, s in
               zip(layout_of(jax.tree.unflatten(treedef, staged)), starts)]
    out[process] = (staged, layouts)
  return out


# ---- the endpoint -------------------------------------------------------------------
class Endpoint:
  """This process's transfer server, its connections, and the key-value store.

  One per process (`Endpoint.get()`); the server's address is published under
  `<prefix>/server/<process>` so that peers can connect by process index.
  """

  _instance: "Endpoint | None" = None
  _lock = threading.Lock()

  def __init__(self):
    from jax.experimental import transfer
    self.client = cluster.key_value_store()
    if self.client is None:
      raise RuntimeError("distributed.transfer needs a multi-process job: call "
                         "distributed.initialize first (main.py does).")
    self.index = cluster.process_index()
    host = cluster.listen_host()
    backend = jax.local_devices()[0].client
    # Port 0: the OS picks free ports; the control and data sockets bind to `host` only.
    self.server = transfer.start_transfer_server(backend, f"{host}:0", [f"{host}:0"])
    self.client.key_value_set(f"{_PREFIX}/server/{self.index}", self.server.address(),
                              allow_overwrite=True)
    self._connections: dict[int, Any] = {}
    # The job's secret for transfer ids, chosen by process 0 (`transfer_id`).
    self.id_key = bytes.fromhex(cluster.agree("transfer_id_key", secrets.token_hex(32)))

  @classmethod
  def get(cls) -> "Endpoint":
    with cls._lock:
      if cls._instance is None:
        cls._instance = cls()
      return cls._instance

  @property
  def address(self) -> str:
    return self.server.address()

  def connection(self, process: int, timeout_s: float = 120.0):
    """A connection to `process`'s transfer server (made once)."""
    if process not in self._connections:
      address = self.client.blocking_key_value_get(f"{_PREFIX}/server/{process}",
                                                   int(timeout_s * 1000))
      self._connections[process] = self.server.connect(address)
    return self._connections[process]

  # Key-value helpers: JSON values, waits in slices so stop requests are noticed.
  def put(self, key: str, value: Any) -> None:
    self.client.key_value_set(f"{_PREFIX}/{key}", json.dumps(value), allow_overwrite=True)

  def try_get(self, key: str) -> Any:
    try:
      return json.loads(self.client.key_value_try_get(f"{_PREFIX}/{key}"))
    except Exception:  # pylint: disable=broad-except  (absent key: NOT_FOUND)
      return None

  def wait_get(self, key: str, *, stop: threading.Event | None, timeout_s: float | None,
               poll_s: float) -> Any:
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
      value = self.try_get(key)
      if value is not None:
        return value
      if stop is not None and stop.is_set():
        raise TransferClosed(f"wait for {key} abandoned: stop requested")
      if deadline is not None and time.monotonic() > deadline:
        raise TimeoutError(f"no value under {key} after {timeout_s}s")
      time.sleep(poll_s)


def transfer_id(stream: str, consumer: int, seq: int, key: bytes = b"") -> int:
  """A 63-bit id per (stream, consumer, sequence number), keyed by the job's secret.

  A transfer server hands an array to whoever asks for its id: with ids derived from a
  secret that only the job's processes read (`Endpoint.id_key`), a program that reaches
  the port cannot guess the id of the next weights or batch. (Distinct inputs collide
  with probability about 2^-63 per pair.)
  """
  digest = hashlib.blake2b(f"{stream}\0{consumer}\0{seq}".encode(), key=key[:64],
                           digest_size=8).digest()
  return int.from_bytes(digest, "big") & 0x7FFF_FFFF_FFFF_FFFF


def _receive(endpoint: Endpoint, source: int, uid: int, target: Any, sent: list,
             what: str) -> Any:
  """`target`'s arrays (ShapeDtypeStructs with the receiving stage's global shardings),
  of which this process pulls only its own block of every leaf (`block_of`) from
  `source`'s id `uid`, after checking the sender's layouts of those blocks (`sent`, JSON)
  against them; a leaf spanning processes is then assembled from this process's shards
  (its peers do the same with theirs)."""
  me = endpoint.index
  leaves, treedef = jax.tree.flatten(target)
  blocks = [block_of(x.sharding, tuple(x.shape), me) for x in leaves]
  local = [jax.ShapeDtypeStruct(b.shape, x.dtype, sharding=b.sharding)
           for x, b in zip(leaves, blocks)]
  wanted = [dataclasses.replace(x, start=b.start)
            for x, b in zip(layout_of(jax.tree.unflatten(treedef, local)), blocks)]
  check_same_layout([LeafLayout.from_json(x) for x in sent], wanted, what)
  # Complete before the caller reports the pull (the sender then frees the block).
  pulled = jax.block_until_ready(endpoint.connection(source).pull(uid, local))
  out = [p if x.sharding.is_fully_addressable else
         jax.make_array_from_single_device_arrays(
             tuple(x.shape), x.sharding, [s.data for s in p.addressable_shards])
         for x, p in zip(leaves, pulled)]
  return jax.tree.unflatten(treedef, out)


def _group(group: Sequence[int] | None, me: int) -> list[int]:
  """A stage's processes, leader first (default: this process alone)."""
  group = [me] if group is None else list(group)
  if me not in group:
    raise ValueError(f"process {me} is not in the stage's processes {group}.")
  return group


# ---- versioned weights ----------------------------------------------------------------
class WeightPublisher:
  """Serves the newest (params, version) of stream `name` to one consuming stage.

  Args:
    name: the stream ("actor", "critic").
    consumers: the consuming stage's processes. The first (its leader) asks for versions
      on behalf of all of them, so every process of a multi-process stage receives the
      same version for a step; each receives its own block of the params.
    targets: the consuming stage's NamedShardings of the params (on its mesh). Each
      process's block is laid out on a mirror of its sub-mesh on this process's devices
      (`stage_blocks`) when a version is published.
    group: the publishing stage's processes (default: this one). Every one of them calls
      `publish` (params spanning them are first gathered within their mesh); the first
      alone keeps the staged blocks and serves requests.
    poll_s: how often requests are looked for.
  """

  def __init__(self, name: str, consumers: Sequence[int], targets: Any, *,
               group: Sequence[int] | None = None, poll_s: float = DEFAULT_POLL_S):
    self.endpoint = Endpoint.get()
    self.name = name
    self.consumers = list(consumers)
    self.targets = targets
    self.group = _group(group, self.endpoint.index)
    self.leader = self.group[0] == self.endpoint.index
    self.poll_s = poll_s
    self._cond = threading.Condition()
    self._latest: tuple[dict, int] | None = None
    self._served = 0
    # Granted blocks by request, kept until every consuming process pulled them: the
    # transfer server does not keep a buffer alive, and a newer version replaces
    # `_latest` while an older grant may still be pulled.
    self._granted: dict[int, dict] = {}
    self._closed = threading.Event()
    self._thread = None
    if self.leader:
      self._thread = threading.Thread(target=self._serve, name=f"publish-{name}",
                                      daemon=True)
      self._thread.start()

  def publish(self, params: Any, version: int) -> None:
    """Makes `params` (any layout on the publishing stage) the newest version."""
    # A collective within the publishing stage when the params span its processes.
    params = arrays.local_copy(params)
    if not self.leader:
      return
    staged = stage_blocks(params, self.targets, self.consumers, jax.local_devices())
    jax.block_until_ready([a for leaves, _ in staged.values() for a in leaves])
    with self._cond:
      if self._latest is not None and version <= self._latest[1]:
        raise ValueError(f"{self.name}: versions must increase; got {version} after "
                         f"{self._latest[1]}.")
      # The previous version's blocks are dropped here unless a grant still waits for a
      # pull of them (`_granted` holds those until they are pulled).
      self._latest = (staged, version)
      self._cond.notify_all()
    self.endpoint.put(f"weights/{self.name}/latest", version)

  def _serve(self) -> None:
    leader = self.consumers[0]
    while not self._closed.wait(self.poll_s):
      if self._granted:
        pulled = min(self.endpoint.try_get(f"weights/{self.name}/pulled/{p}") or 0
                     for p in self.consumers)
        for seq in [q for q in self._granted if q <= pulled]:
          del self._granted[seq]
      request = self.endpoint.try_get(f"weights/{self.name}/want/{leader}")
      if request is None or request["seq"] <= self._served:
        continue
      with self._cond:
        latest = self._latest
      if latest is None or latest[1] < request["min_version"]:
        continue  # asked again at the next poll, once a new version is published
      staged, version = latest
      seq = request["seq"]
      self._granted[seq] = staged
      for process in self.consumers:
        self.endpoint.server.await_pull(
            transfer_id(self.name, process, seq, self.endpoint.id_key), staged[process][0])
      self.endpoint.put(f"weights/{self.name}/grant/{leader}/{seq}", {
          "version": version, "layouts": {str(p): staged[p][1] for p in self.consumers}})
      self._served = seq

  def close(self) -> None:
    self._closed.set()
    if self._thread is not None:
      self._thread.join(timeout=5)
    self._granted.clear()


class WeightSubscriber:
  """Receives versions of stream `name` from process `source` into `target`'s layout.

  Args:
    name: the stream.
    source: the publishing stage's leader.
    target: pytree of `jax.ShapeDtypeStruct`s with NamedShardings on this stage's mesh.
    group: this stage's processes (default: this one), which call `acquire` in the same
      order (SPMD); the first asks for a version and all receive the one it was granted,
      each pulling its own block.
  """

  def __init__(self, name: str, source: int, target: Any, *,
               group: Sequence[int] | None = None, poll_s: float = DEFAULT_POLL_S):
    self.endpoint = Endpoint.get()
    self.name = name
    self.source = source
    self.target = target
    self.group = _group(group, self.endpoint.index)
    self.poll_s = poll_s
    self._seq = 0

  def latest_version(self) -> int | None:
    return self.endpoint.try_get(f"weights/{self.name}/latest")

  def acquire(self, min_version: int, *, stop: threading.Event | None = None,
              timeout_s: float | None = None) -> tuple[Any, int]:
    """The newest published version, once it is >= `min_version`: (params, version).

    Raises:
      LayoutMismatch: the publisher's layout is not `target`'s (before any data moves).
    """
    self._seq += 1
    me, leader = self.endpoint.index, self.group[0]
    if me == leader:
      self.endpoint.put(f"weights/{self.name}/want/{leader}",
                        {"seq": self._seq, "min_version": int(min_version)})
    # The grant is per request: the leader's peers read the same version from it.
    grant = self.endpoint.wait_get(f"weights/{self.name}/grant/{leader}/{self._seq}",
                                   stop=stop, timeout_s=timeout_s, poll_s=self.poll_s)
    params = _receive(self.endpoint, self.source,
                      transfer_id(self.name, me, self._seq, self.endpoint.id_key),
                      self.target, grant["layouts"][str(me)],
                      f"weights {self.name!r} version {grant['version']} (process {me})")
    # The publisher may now drop this grant's blocks.
    self.endpoint.put(f"weights/{self.name}/pulled/{me}", self._seq)
    return params, int(grant["version"])


# ---- queues ---------------------------------------------------------------------------
class QueueSender:
  """The producing end of an ordered stream of pytrees to one consuming stage.

  At most `capacity` items may be sent and not yet pulled by every consuming process
  (back-pressure: `put` waits).

  Args:
    name: the stream.
    consumers: the consuming stage's processes; each pulls its own block of every item.
    capacity: items in flight at most.
    group: the producing stage's processes (default: this one). Every one of them calls
      `put` in the same order and waits for the same capacity (so none sits long in the
      gather of an item spanning them); the first alone offers the blocks.
  """

  def __init__(self, name: str, consumers: Sequence[int], capacity: int, *,
               group: Sequence[int] | None = None, poll_s: float = DEFAULT_POLL_S):
    self.endpoint = Endpoint.get()
    self.name, self.capacity, self.poll_s = name, capacity, poll_s
    self.consumers = list(consumers)
    self.group = _group(group, self.endpoint.index)
    self.leader = self.group[0] == self.endpoint.index
    self._sent = 0
    # Offered blocks by item, kept until every consuming process pulled them (the
    # transfer server does not keep a buffer alive).
    self._offered: dict[int, dict] = {}

  def in_flight(self) -> int:
    """Items sent and not yet pulled by every consuming process."""
    taken = min(self.endpoint.try_get(f"queue/{self.name}/taken/{p}") or 0
                for p in self.consumers)
    for seq in [q for q in self._offered if q <= taken]:
      del self._offered[seq]
    return self._sent - taken

  def put(self, tree: Any, targets: Any, meta: Any = None, *,
          stop: threading.Event | None = None, timeout_s: float | None = None) -> None:
    """Sends `tree` (any layout on the producing stage) with JSON `meta`; `targets` are
    the consuming stage's NamedShardings of its leaves (each process's block is laid out
    on a mirror of its sub-mesh here)."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while self.in_flight() >= self.capacity:
      if stop is not None and stop.is_set():
        raise TransferClosed(f"queue {self.name!r}: put abandoned: stop requested")
      if deadline is not None and time.monotonic() > deadline:
        raise TimeoutError(f"queue {self.name!r}: full for {timeout_s}s")
      time.sleep(self.poll_s)
    # A collective within the producing stage when the tree spans its processes.
    tree = arrays.local_copy(tree)
    self._sent += 1
    if not self.leader:
      return
    staged = stage_blocks(tree, targets, self.consumers, jax.local_devices())
    jax.block_until_ready([a for leaves, _ in staged.values() for a in leaves])
    self._offered[self._sent] = staged
    for process in self.consumers:
      self.endpoint.server.await_pull(
          transfer_id(self.name, process, self._sent, self.endpoint.id_key),
          staged[process][0])
    self.endpoint.put(f"queue/{self.name}/item/{self._sent}", {
        "layouts": {str(p): staged[p][1] for p in self.consumers}, "meta": meta})

  def close(self) -> None:
    """Marks the end of the stream (the receivers' iteration stops there)."""
    if self.leader:
      self.endpoint.put(f"queue/{self.name}/item/{self._sent + 1}", {"end": True})


class QueueReceiver:
  """The consuming end: yields (tree, meta) in order, pulled into `target_of(meta)` (this
  process's block of it, when the consuming stage spans several processes).

  Args:
    name: the stream.
    source: the producing stage's leader.
    target_of: meta -> pytree of ShapeDtypeStructs with the consuming stage's shardings.
  """

  def __init__(self, name: str, source: int, target_of: Callable[[Any], Any],
               poll_s: float = DEFAULT_POLL_S):
    self.endpoint = Endpoint.get()
    self.name, self.source, self.target_of, self.poll_s = name, source, target_of, poll_s
    self._taken = 0

  def get(self, *, stop: threading.Event | None = None, timeout_s: float | None = None
          ) -> tuple[Any, Any]:
    """The next item; raises `StreamEnded` at the end of the stream, `TransferClosed`
    when `stop` is set while waiting."""
    seq = self._taken + 1
    me = self.endpoint.index
    item = self.endpoint.wait_get(f"queue/{self.name}/item/{seq}", stop=stop,
                                  timeout_s=timeout_s, poll_s=self.poll_s)
    if item.get("end"):
      raise StreamEnded(f"queue {self.name!r} ended")
    tree = _receive(self.endpoint, self.source,
                    transfer_id(self.name, me, seq, self.endpoint.id_key),
                    self.target_of(item["meta"]), item["layouts"][str(me)],
                    f"queue {self.name!r} item {seq} (process {me})")
    self._taken = seq
    self.endpoint.put(f"queue/{self.name}/taken/{me}", seq)
    return tree, item["meta"]

  def __iter__(self):
    while True:
      try:
        yield self.get()
      except StreamEnded:
        return
