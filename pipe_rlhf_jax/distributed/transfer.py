"""Arrays between process groups: versioned weights and bounded queues over transfer servers.

In `pipe` mode across processes each stage's group of processes runs its own programs
(MPMD), so weights and rollouts cannot move by a collective or a cross-process
`jax.device_put` (which needs every process to issue every transfer in the same order).
This module moves them with `jax.experimental.transfer`: every process runs one transfer
server (listening on `cluster.listen_host()`, never a wildcard address), the sender makes
an array pytree available under an id (`await_pull`), and the receiver pulls that id into
arrays on its own devices. Addresses, ids, versions, layouts and back-pressure counters
travel through the coordination service's key-value store. No other networking.

The transfer copies shard i of the source to shard i of the destination: with different
mesh shapes or partition specs it would silently assemble a wrong array. So every grant
and every queue item carries the sender's layout (`Layout`: per leaf shape, dtype, mesh
axis sizes, partition spec), and the receiver checks it against its own target before it
pulls (`LayoutMismatch`, naming the leaf, before any data moves). The sender first lays
the pytree out on a mesh of the receiver's shape and specs built on its own devices
(`mirror_shardings`), which needs at least as many devices as the receiver's mesh.

* `WeightPublisher` / `WeightSubscriber`: the trainer publishes (params, version); a
  consumer asks for "a version >= v" and receives the newest. The publisher keeps only
  the newest params and serves requests from a thread: nothing is staged for a consumer
  that does not ask, so skipped versions hold no memory.
* `QueueSender` / `QueueReceiver`: an ordered stream of pytrees (rollouts, experience)
  with at most `capacity` items not yet pulled, and an end marker.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
import zlib
from typing import Any, Callable, Sequence

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from pipe_rlhf_jax.distributed import cluster
from pipe_rlhf_jax.runtime.queues import PipelineShutdown

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

  def as_json(self) -> list:
    return [self.path, list(self.shape), self.dtype, [list(a) for a in self.mesh],
            [list(e) if isinstance(e, tuple) else e for e in self.spec]]

  @classmethod
  def from_json(cls, value: list) -> "LeafLayout":
    path, shape, dtype, mesh, spec = value
    return cls(path, tuple(shape), dtype, tuple((a, int(n)) for a, n in mesh),
               tuple(tuple(e) if isinstance(e, list) else e for e in spec))

  def __str__(self) -> str:
    mesh = ",".join(f"{a}={n}" for a, n in self.mesh)
    return f"{self.dtype}{list(self.shape)} on mesh({mesh}) spec {self.spec}"


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
                          _normalized_spec(sharding.spec, len(leaf.shape))))
  return out


def check_same_layout(sent: Sequence[LeafLayout], wanted: Sequence[LeafLayout],
                      what: str) -> None:
  """Raises `LayoutMismatch` naming the first differing leaf (or the structure)."""
  if [l.path for l in sent] != [l.path for l in wanted]:
    missing = sorted({l.path for l in wanted} - {l.path for l in sent})[:5]
    extra = sorted({l.path for l in sent} - {l.path for l in wanted})[:5]
    raise LayoutMismatch(f"{what}: the sender's pytree differs from the receiver's "
                         f"(missing {missing}, unexpected {extra}); nothing was moved.")
  for s, w in zip(sent, wanted):
    if s != w:
      raise LayoutMismatch(
          f"{what}: leaf {s.path} is sent as {s} but the receiver expects {w}; a transfer "
          "between different layouts would assemble a wrong array, so nothing was moved. "
          "Lay the sender's arrays out with mirror_shardings(receiver's shardings).")


def mirror_shardings(shardings: Any, devices: Sequence[Any]) -> Any:
  """The receiver's NamedShardings rebuilt on this side's `devices`: same mesh axes and
  sizes (on the first devices, in order), same specs.

  The sender builds the receiver's layout exactly as the receiver does (both read the
  same plan; `jax.devices()` lists every process's devices), mirrors it here, and
  reshards onto the mirror on its own devices before sending.
  """
  devices = list(devices)
  meshes: dict[Any, jax.sharding.Mesh] = {}

  def one(sharding: NamedSharding) -> NamedSharding:
    mesh = sharding.mesh
    if mesh not in meshes:
      if mesh.size > len(devices):
        raise ValueError(f"the receiver's mesh {dict(mesh.shape)} has {mesh.size} devices "
                         f"but the sender has {len(devices)}: a transfer needs the same "
                         "mesh shape on both sides; give the sending stage at least as "
                         "many devices.")
      grid = np.empty(mesh.size, dtype=object)
      grid[:] = devices[:mesh.size]
      meshes[mesh] = jax.sharding.Mesh(grid.reshape(mesh.devices.shape), mesh.axis_names,
                                       axis_types=mesh.axis_types)
    return NamedSharding(meshes[mesh], sharding.spec)

  return jax.tree.map(one, shardings,
                      is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))


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


def transfer_id(stream: str, consumer: int, seq: int) -> int:
  """A 63-bit id unique per (stream, consumer, sequence number)."""
  return ((zlib.crc32(stream.encode()) & 0x7FFF) << 48) | ((consumer & 0xFFFF) << 32) | (
      seq & 0xFFFFFFFF)


def _pull(endpoint: Endpoint, source: int, uid: int, target: Any) -> Any:
  leaves, treedef = jax.tree.flatten(target)
  out = endpoint.connection(source).pull(uid, leaves)
  return jax.tree.unflatten(treedef, out)


# ---- versioned weights ----------------------------------------------------------------
class WeightPublisher:
  """Serves the newest (params, version) of stream `name` to consumer processes.

  Args:
    name: the stream ("actor", "critic").
    consumers: process indices that may ask.
    shardings: the consumers' layout mirrored on this side (`mirror_shardings`); the
      params are resharded to it (on this process's devices) when published.
    poll_s: how often requests are looked for.
  """

  def __init__(self, name: str, consumers: Sequence[int], shardings: Any,
               poll_s: float = DEFAULT_POLL_S):
    self.endpoint = Endpoint.get()
    self.name = name
    self.consumers = list(consumers)
    self.shardings = shardings
    self.poll_s = poll_s
    self._cond = threading.Condition()
    self._latest: tuple[Any, int, list] | None = None
    self._served = {c: 0 for c in self.consumers}
    self._closed = threading.Event()
    self._thread = threading.Thread(target=self._serve, name=f"publish-{name}", daemon=True)
    self._thread.start()

  def publish(self, params: Any, version: int) -> None:
    """Makes `params` (any layout on this process) the newest version."""
    staged = jax.device_put(params, self.shardings)
    jax.block_until_ready(staged)
    layout = [l.as_json() for l in layout_of(staged)]
    with self._cond:
      if self._latest is not None and version <= self._latest[1]:
        raise ValueError(f"{self.name}: versions must increase; got {version} after "
                         f"{self._latest[1]}.")
      self._latest = (staged, version, layout)
      self._cond.notify_all()
    self.endpoint.put(f"weights/{self.name}/latest", version)

  def _serve(self) -> None:
    while not self._closed.wait(self.poll_s):
      for consumer in self.consumers:
        request = self.endpoint.try_get(f"weights/{self.name}/want/{consumer}")
        if request is None or request["seq"] <= self._served[consumer]:
          continue
        with self._cond:
          latest = self._latest
        if latest is None or latest[1] < request["min_version"]:
          continue  # asked again at the next poll, once a new version is published
        params, version, layout = latest
        seq = request["seq"]
        self.endpoint.server.await_pull(transfer_id(self.name, consumer, seq),
                                        jax.tree.leaves(params))
        self.endpoint.put(f"weights/{self.name}/grant/{consumer}/{seq}",
                          {"version": version, "layout": layout})
        self._served[consumer] = seq

  def close(self) -> None:
    self._closed.set()
    self._thread.join(timeout=5)


class WeightSubscriber:
  """Receives versions of stream `name` from process `source` into `target`'s layout.

  Args:
    name: the stream.
    source: the publishing process.
    target: pytree of `jax.ShapeDtypeStruct`s with NamedShardings on this side's mesh.
  """

  def __init__(self, name: str, source: int, target: Any, poll_s: float = DEFAULT_POLL_S):
    self.endpoint = Endpoint.get()
    self.name = name
    self.source = source
    self.target = target
    self.layout = layout_of(target)
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
    me = self.endpoint.index
    self.endpoint.put(f"weights/{self.name}/want/{me}",
                      {"seq": self._seq, "min_version": int(min_version)})
    grant = self.endpoint.wait_get(f"weights/{self.name}/grant/{me}/{self._seq}", stop=stop,
                                   timeout_s=timeout_s, poll_s=self.poll_s)
    check_same_layout([LeafLayout.from_json(l) for l in grant["layout"]], self.layout,
                      f"weights {self.name!r} version {grant['version']}")
    params = _pull(self.endpoint, self.source, transfer_id(self.name, me, self._seq),
                   self.target)
    return params, int(grant["version"])


# ---- queues ---------------------------------------------------------------------------
class QueueSender:
  """The producing end of an ordered stream of pytrees to one consumer process.

  At most `capacity` items may be sent and not yet pulled (back-pressure: `put` waits).
  """

  def __init__(self, name: str, consumer: int, capacity: int,
               poll_s: float = DEFAULT_POLL_S):
    self.endpoint = Endpoint.get()
    self.name, self.consumer, self.capacity, self.poll_s = name, consumer, capacity, poll_s
    self._sent = 0

  def put(self, tree: Any, meta: Any = None, *, stop: threading.Event | None = None,
          timeout_s: float | None = None) -> None:
    """Sends `tree` (arrays already in the receiver's mirrored layout) with JSON `meta`."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while self._sent - (self.endpoint.try_get(f"queue/{self.name}/taken") or 0) >= \
        self.capacity:
      if stop is not None and stop.is_set():
        raise TransferClosed(f"queue {self.name!r}: put abandoned: stop requested")
      if deadline is not None and time.monotonic() > deadline:
        raise TimeoutError(f"queue {self.name!r}: full for {timeout_s}s")
      time.sleep(self.poll_s)
    self._sent += 1
    self.endpoint.server.await_pull(transfer_id(self.name, self.consumer, self._sent),
                                    jax.tree.leaves(tree))
    self.endpoint.put(f"queue/{self.name}/item/{self._sent}",
                      {"layout": [l.as_json() for l in layout_of(tree)], "meta": meta})

  def close(self) -> None:
    """Marks the end of the stream (the receiver's iteration stops there)."""
    self.endpoint.put(f"queue/{self.name}/item/{self._sent + 1}", {"end": True})


class QueueReceiver:
  """The consuming end: yields (tree, meta) in order, pulled into `target_of(meta)`."""

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
    item = self.endpoint.wait_get(f"queue/{self.name}/item/{seq}", stop=stop,
                                  timeout_s=timeout_s, poll_s=self.poll_s)
    if item.get("end"):
      raise StreamEnded(f"queue {self.name!r} ended")
    target = self.target_of(item["meta"])
    check_same_layout([LeafLayout.from_json(l) for l in item["layout"]], layout_of(target),
                      f"queue {self.name!r} item {seq}")
    tree = _pull(self.endpoint, self.source, transfer_id(self.name, self.endpoint.index, seq),
                 target)
    self._taken = seq
    self.endpoint.put(f"queue/{self.name}/taken", seq)
    return tree, item["meta"]

  def __iter__(self):
    while True:
      try:
        yield self.get()
      except StreamEnded:
        return
