"""Joining a multi-process (multi-controller) JAX job, and the host-side agreements in it.

Owns `DistributedConfig` (where the coordinator is, how many processes, which one this is,
how fast a dead peer is noticed), `initialize` (the one call of `jax.distributed.initialize`
in the project), and the small cross-process agreements the main job needs on top of the
device collectives: who is the primary process (the only one that writes files), a
barrier over some or all processes, and a value the primary decides for everyone (through
the coordination service's key-value store, so no process needs devices to agree).

On one process (no coordinator given, no cluster detected) nothing is initialised and
every helper degrades to the obvious single-process answer, so the main job runs
unchanged.

Security: the coordinator listens on `coordinator_bind_address` (default: exactly the
host:port of `coordinator_address`, never all interfaces) and speaks unauthenticated gRPC;
it belongs on the cluster's private network.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from typing import Any, Sequence

from pipe_rlhf_jax.checks import check_int

log = logging.getLogger(__name__)

# The interface this process's transfer servers listen on, decided by `initialize`.
_listen_host = "127.0.0.1"

# jax's cluster detection methods that `cluster_detection` may name ("auto" tries all).
# (Kubernetes is found by "auto" only: jax gives it no name.)
CLUSTER_DETECTION = ("off", "auto", "tpu", "gcetpu", "gketpu", "slurm", "ompi", "mpi4py")


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
  """How this process joins a multi-process job.

  Attributes:
    coordinator_address: "host:port" of process 0's coordination service, reachable by
      every process (e.g. "127.0.0.1:12345" locally, the private IP of host 0 on a
      cluster). Empty: one process, unless `cluster_detection` finds a cluster.
    num_processes: processes in the job (one per host on TPU pods / GPU nodes).
    process_id: this process, in [0, num_processes).
    coordinator_bind_address: where process 0's service listens; empty = exactly
      `coordinator_address` (jax's own default would be every interface, [::]).
    cluster_detection: "off" (only the fields above), "auto" (jax's detection of TPU pods,
      SLURM, Open MPI, Kubernetes fills the fields left empty), or one method's name.
    listen_host: the interface this process's transfer servers listen on; empty = the
      local address that routes to the coordinator (127.0.0.1 when it is on loopback).
    cpu_devices: devices per process on the CPU backend (`jax_num_cpu_devices`); 0 keeps
      the platform default. For local multi-process runs and tests.
    heartbeat_timeout_s: a process silent this long is declared dead and every other
      process aborts (jax's default is 100 s; short values make faults stop a job fast).
    shutdown_timeout_s: how long a finishing process waits for the others at exit.
    init_timeout_s: how long to wait for every process to join.
  """

  coordinator_address: str = ""
  num_processes: int = 1
  process_id: int = 0
  coordinator_bind_address: str = ""
  cluster_detection: str = "off"
  listen_host: str = ""
  cpu_devices: int = 0
  heartbeat_timeout_s: int = 10
  shutdown_timeout_s: int = 30
  init_timeout_s: int = 120

  def __post_init__(self):
    f = "distributed."
    check_int(self.num_processes, f + "num_processes")
    check_int(self.process_id, f + "process_id", low=0)
    check_int(self.cpu_devices, f + "cpu_devices", low=0)
    for name in ("heartbeat_timeout_s", "shutdown_timeout_s", "init_timeout_s"):
      check_int(getattr(self, name), f + name)
    if self.cluster_detection not in CLUSTER_DETECTION:
      raise ValueError(f"{f}cluster_detection={self.cluster_detection!r}; choose one of "
                       f"{list(CLUSTER_DETECTION)}.")
    if self.process_id >= self.num_processes:
      raise ValueError(f"{f}process_id={self.process_id} must be < {f}num_processes="
                       f"{self.num_processes} (ids are 0-based).")
    if self.num_processes > 1 and not self.coordinator_address and not self.detects:
      raise ValueError(f"{f}num_processes={self.num_processes} needs "
                       f"{f}coordinator_address (host:port of process 0), or "
                       f"{f}cluster_detection='auto' on a TPU pod / SLURM allocation.")
    for name in ("coordinator_address", "coordinator_bind_address"):
      value = getattr(self, name)
      if value and (":" not in value or not value.rsplit(":", 1)[1].isdigit()):
        raise ValueError(f"{f}{name}={value!r} must be host:port, e.g. 127.0.0.1:12345.")

  @property
  def detects(self) -> bool:
    return self.cluster_detection != "off"

  @property
  def wanted(self) -> bool:
    """Whether this config asks for `jax.distributed` at all."""
    return bool(self.coordinator_address) or self.num_processes > 1 or self.detects



def initialize(config: DistributedConfig) -> bool:
  """Joins the job described by `config`; returns whether jax.distributed is now on.

  Must run before anything touches a JAX backend (devices are enumerated at the first
  use). Idempotent for the same process; a no-op when `config.wanted` is false.
  """
  import jax
  if config.cpu_devices:
    jax.config.update("jax_num_cpu_devices", config.cpu_devices)
  if not config.wanted:
    return False
  if jax.distributed.is_initialized():
    return True
  # With detection, fields left at their defaults are for jax to fill in.
  given = config.num_processes > 1 or not config.detects
  address, count, index = (config.coordinator_address or None,
                           config.num_processes if given else None,
                           config.process_id if given else None)
  local_devices = None
  if config.detects:
    # jax's detection fills what is left unset from the pod's / allocation's environment.
    # Done here rather than inside `initialize` so that the coordinator then binds to the
    # detected address instead of jax's default of every interface.
    from jax._src.clusters import ClusterEnv
    # (On GPU clusters jax then makes one process per GPU: `local_devices` = [local rank].)
    address, count, index, local_devices = ClusterEnv.auto_detect_unset_distributed_params(
        address, count, index, None,
        None if config.cluster_detection == "auto" else config.cluster_detection,
        config.init_timeout_s)
    if address is None or count is None or index is None:
      raise RuntimeError(
          f"distributed.cluster_detection={config.cluster_detection!r} found no cluster "
          "environment (TPU pod, SLURM, Open MPI, Kubernetes); give "
          "distributed.coordinator_address, num_processes and process_id instead.")
  bind = config.coordinator_bind_address or address
  global _listen_host
  _listen_host = config.listen_host or _route_to(address)
  for what, host in (("--coordinator_bind_address / --coordinator_address", bind),
                     ("--listen_host", _listen_host)):
    if is_wildcard(host):
      log.warning(
          "%s=%s listens on every interface: the coordination service (its key-value "
          "store) and the transfer servers are unauthenticated, so anyone who can reach "
          "them can read the model's weights or stop the job. Bind to the cluster's "
          "private interface instead, or keep the ports behind a firewall.", what, host)
  jax.distributed.initialize(
      coordinator_address=address, num_processes=count, process_id=index,
      local_device_ids=local_devices, coordinator_bind_address=bind,
      cluster_detection_method="deactivate",
      initialization_timeout=config.init_timeout_s,
      heartbeat_timeout_seconds=config.heartbeat_timeout_s,
      shutdown_timeout_seconds=config.shutdown_timeout_s)
  log.info("joined a job of %d processes as process %d", jax.process_count(),
           jax.process_index())
  return True


def is_wildcard(host_or_address: str) -> bool:
  """Whether a host (or host:port) means every interface (0.0.0.0, ::, [::], empty)."""
  host = host_or_address
  if host.count(":") == 1 or host.startswith("["):
    host = host.rsplit(":", 1)[0] if not host.endswith("]") else host
  return host.strip("[]") in ("0.0.0.0", "::", "")


def _route_to(address: str) -> str:
  """The local IP address of the interface that reaches `address` (host:port).

  A UDP `connect` only asks the kernel for a route; no packet is sent. A coordinator on
  loopback gives 127.0.0.1, one on the cluster's private network the local address on
  that network: never a wildcard.
  """
  import socket
  host, port = address.rsplit(":", 1)
  family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
  with socket.socket(family, socket.SOCK_DGRAM) as s:
    s.connect((host.strip("[]"), int(port)))
    return s.getsockname()[0]


def listen_host() -> str:
  """Where this process's own servers (transfer servers) listen: `listen_host`, or the
  interface that reaches the coordinator; 127.0.0.1 on one process."""
  return _listen_host


def _client():
  """The coordination-service client, or None on one process."""
  from jax._src import distributed as jax_distributed
  return jax_distributed.global_state.client


def process_index() -> int:
  import jax
  return jax.process_index()


def process_count() -> int:
  import jax
  return jax.process_count()


def is_primary() -> bool:
  """Whether this process writes the job's files (metrics, traces, exports): process 0."""
  return process_index() == 0


def barrier(name: str, *, timeout_s: float = 600.0,
            processes: Sequence[int] | None = None) -> None:
  """Waits until every process in `processes` (default: all) reached `barrier(name)`.

  Host-side, through the coordination service: it needs no devices and no program on
  them, so a group of processes can meet while others run something else. Each name may
  be used once per job.
  """
  client = _client()
  if client is None:
    return
  client.wait_at_barrier(name, int(timeout_s * 1000),
                         None if processes is None else list(processes))


def agree(key: str, value: Any = None, *, timeout_s: float = 600.0) -> Any:
  """The primary's `value` (JSON-able), returned on every process.

  The primary stores it under `key` in the key-value store; the others block until it
  is there. One process: `value` itself.
  """
  client = _client()
  if client is None:
    return value
  full = f"pipe_rlhf_jax/agree/{key}"
  if is_primary():
    client.key_value_set(full, json.dumps(value))
    return value
  return json.loads(client.blocking_key_value_get(full, int(timeout_s * 1000)))


def key_value_store():
  """The coordination service's key-value client (None on one process)."""
  return _client()
