"""Hardware profiles: the peak numbers the cost and memory models extrapolate with.

Every figure is per device (chip / GPU) and cites the public document it comes from; the
ones marked "(unsure)" are recalled, not checked against the document, and
should be verified before publishing a projection that depends on them. Peaks are dense
(no structured sparsity). Link bandwidths are one direction, per device.

`cpu` is this machine: `--xla_force_host_platform_device_count` virtual devices that
SHARE the host's cores. There, splitting work over more devices adds no compute: the sum
of the work running at one moment, over all virtual devices, goes at the host's rate
(`shared_host=True`; the cost model divides by the host's throughput, not the device
count's, and the simulator shares it among concurrent stages). Programs spanning several
of its devices run one at a time even on disjoint devices (`serial_multi_device`,
measured by `experiments/bench_cpu_concurrency.py`), so `pipe` stages on multi-device
meshes do not overlap there. Its numbers are placeholders until `planner.calibrate`
measures them.
"""

from __future__ import annotations

import dataclasses

GB = 1e9
GIB = 2 ** 30
TFLOPS = 1e12


@dataclasses.dataclass(frozen=True)
class Hardware:
  """Peak capabilities of one device and its links.

  Attributes:
    name: profile name (`--hardware`).
    peak_flops: ((dtype, FLOP/s), ...) dense matmul peak per device.
    hbm_bw: device memory bandwidth, bytes/s.
    hbm_bytes: device memory capacity, bytes.
    intra_bw / intra_latency: per-device link bandwidth (bytes/s, one direction) and
      per-collective latency (s) between devices of one host / ICI slice.
    inter_bw / inter_latency: the same across hosts (GPU: the NIC share of one GPU;
      TPU: ICI, which joins every host of a slice; None = the intra-host values).
    devices_per_host: devices sharing one host (placement blocks align to it).
    shared_host: virtual devices sharing one host's compute (the cpu profile).
    serial_multi_device: programs spanning several devices run one at a time, even on
      disjoint devices (jax's CPU backend: `experiments/bench_cpu_concurrency.py`);
      single-device programs still overlap.
    serial_collectives: collectives are neither combined nor pipelined: every weight
      array gathered is a collective of its own (XLA:CPU's compiled programs gather a
      layer's nine weights one by one; XLA on GPU / TPU combines them per layer), and one
      over k devices is k - 1 exchanges, each paying the latency (all-gathers of 256
      bytes measured 16 / 94 / 203 us at k = 2 / 4 / 8 virtual devices of a 2-core CPU).
    source: where the numbers come from.
  """

  name: str
  peak_flops: tuple[tuple[str, float], ...]
  hbm_bw: float
  hbm_bytes: float
  intra_bw: float
  intra_latency: float
  inter_bw: float | None
  inter_latency: float | None
  devices_per_host: int
  shared_host: bool = False
  serial_multi_device: bool = False
  serial_collectives: bool = False
  source: str = ""

  def peak(self, dtype: str) -> float:
    """Peak matmul FLOP/s of `dtype` (float16 falls back to bfloat16)."""
    table = dict(self.peak_flops)
    if dtype not in table and dtype == "float16":
      dtype = "bfloat16"
    if dtype not in table:
      raise ValueError(f"hardware {self.name!r} has no peak for {dtype}; known: "
                       f"{sorted(table)}.")
    return table[dtype]

  def __post_init__(self):
    # None: the hosts share the intra-host fabric (TPU ICI across the hosts of a slice).
    if self.inter_bw is None:
      object.__setattr__(self, "inter_bw", self.intra_bw)
    if self.inter_latency is None:
      object.__setattr__(self, "inter_latency", self.intra_latency)

  def link(self, spans_hosts: bool) -> tuple[float, float]:
    """(bandwidth bytes/s, latency s) of a collective inside one host or across hosts."""
    return ((self.inter_bw, self.inter_latency) if spans_hosts
            else (self.intra_bw, self.intra_latency))


PROFILES: dict[str, Hardware] = {}


def _register(hw: Hardware) -> Hardware:
  PROFILES[hw.name] = hw
  return hw


# ---- Google Cloud TPUs ----------------------------------------------------------------
# Source for peak bf16 / int8 FLOP/s, HBM capacity and bandwidth, ICI bandwidth: the
# "System architecture" pages of the Cloud TPU documentation (cloud.google.com/tpu/docs/
# v4, /v5e, /v5p, /v6e), table "chip specifications". f32 matmuls on the MXU run as
# several bf16 passes; we take bf16 / 3 (unsure: XLA's default f32 precision on TPU is a
# single bf16 pass, which would be bf16 speed at reduced precision; calibrate on the chip).
# ICI figures in the docs are Gbit/s per chip, all links together, both directions: we use
# a quarter of it as one-direction bandwidth of one ring neighbour (unsure). The hosts of
# one slice are joined by the same ICI, so "inter-host" links inside a slice are ICI too;
# plans are for one slice (multislice over the data-centre network is not modelled).
# Latency: ~ 5 us per ICI collective step (assumed, unsure).

TPU_V4 = _register(Hardware(
    name="tpu-v4",
    peak_flops=(("bfloat16", 275 * TFLOPS), ("float32", 275 / 3 * TFLOPS)),
    hbm_bw=1200 * GB,                 # Cloud TPU v4 docs: 1200 GBps
    hbm_bytes=32 * GIB,               # Cloud TPU v4 docs: 32 GiB HBM2
    intra_bw=2400 / 8 / 4 * GB,       # ICI 2400 Gbps per chip (unsure) / 4 as above
    intra_latency=5e-6,
    inter_bw=None, inter_latency=None,
    devices_per_host=4,               # Cloud TPU v4 docs: 4 chips per host
    source="Cloud TPU docs, TPU v4 system architecture"))

TPU_V5E = _register(Hardware(
    name="tpu-v5e",
    peak_flops=(("bfloat16", 197 * TFLOPS), ("float32", 197 / 3 * TFLOPS)),
    hbm_bw=819 * GB,                  # Cloud TPU v5e docs: 819 GBps
    hbm_bytes=16 * GIB,               # Cloud TPU v5e docs: 16 GiB HBM2
    intra_bw=1600 / 8 / 4 * GB,       # ICI 1600 Gbps per chip
    intra_latency=5e-6,
    inter_bw=None, inter_latency=None,
    devices_per_host=4,               # ct5lp-hightpu-4t hosts (8t hosts exist too)
    source="Cloud TPU docs, TPU v5e system architecture"))

TPU_V5P = _register(Hardware(
    name="tpu-v5p",
    peak_flops=(("bfloat16", 459 * TFLOPS), ("float32", 459 / 3 * TFLOPS)),
    hbm_bw=2765 * GB,                 # Cloud TPU v5p docs: 2765 GBps
    hbm_bytes=95 * GIB,               # Cloud TPU v5p docs: 95 GiB HBM2e
    intra_bw=4800 / 8 / 4 * GB,       # ICI 4800 Gbps per chip
    intra_latency=5e-6,
    inter_bw=None, inter_latency=None,
    devices_per_host=4,               # Cloud TPU v5p docs: 4 chips per VM host
    source="Cloud TPU docs, TPU v5p system architecture"))

TPU_V6E = _register(Hardware(
    name="tpu-v6e",
    peak_flops=(("bfloat16", 918 * TFLOPS), ("float32", 918 / 3 * TFLOPS)),
    hbm_bw=1640 * GB,                 # Cloud TPU v6e (Trillium) docs: 1640 GBps
    hbm_bytes=32 * GIB,               # Cloud TPU v6e docs: 32 GiB
    intra_bw=3584 / 8 / 4 * GB,       # ICI 3584 Gbps per chip (unsure: 3200 in some pages)
    intra_latency=5e-6,
    inter_bw=None, inter_latency=None,
    devices_per_host=4,               # ct6e-standard-4t hosts (unsure; 8t hosts exist)
    source="Cloud TPU docs, TPU v6e system architecture"))

# ---- NVIDIA GPUs (SXM, 8 per node) ----------------------------------------------------
# Peak FLOP/s: NVIDIA datasheets, dense (the datasheets' headline numbers are with
# sparsity; dense is half). float32 is TF32 tensor-core throughput, which XLA uses for f32
# matmuls at default precision on Ampere and later. NVLink: datasheet totals are both
# directions; one direction is half. Inter-node: one 200 Gb/s HDR (A100, DGX A100) or
# 400 Gb/s NDR (H100/H200, DGX H100 user guide) InfiniBand NIC per GPU. Latencies: NCCL
# ring step ~ 10 us inside a node, ~ 20 us across nodes (assumed, unsure).

A100_80GB = _register(Hardware(
    name="a100-80gb",
    peak_flops=(("bfloat16", 312 * TFLOPS), ("float32", 156 * TFLOPS)),  # A100 datasheet
    hbm_bw=2039 * GB,                 # A100 80GB SXM datasheet: 2039 GB/s HBM2e
    hbm_bytes=80 * GB,                # A100 80GB datasheet
    intra_bw=300 * GB,                # NVLink 3: 600 GB/s total -> 300 one way
    intra_latency=10e-6,
    inter_bw=25 * GB,                 # HDR 200 Gb/s per GPU (DGX A100 datasheet)
    inter_latency=20e-6,
    devices_per_host=8,
    source="NVIDIA A100 Tensor Core GPU datasheet; DGX A100 datasheet"))

H100 = _register(Hardware(
    name="h100",
    peak_flops=(("bfloat16", 989 * TFLOPS), ("float32", 494.5 * TFLOPS)),  # H100 SXM
    hbm_bw=3350 * GB,                 # H100 SXM datasheet: 3.35 TB/s HBM3
    hbm_bytes=80 * GB,                # H100 SXM datasheet: 80 GB
    intra_bw=450 * GB,                # NVLink 4: 900 GB/s total -> 450 one way
    intra_latency=10e-6,
    inter_bw=50 * GB,                 # NDR 400 Gb/s per GPU (DGX H100 user guide)
    inter_latency=20e-6,
    devices_per_host=8,
    source="NVIDIA H100 Tensor Core GPU datasheet (SXM); DGX H100 user guide"))

H200 = _register(Hardware(
    name="h200",
    peak_flops=(("bfloat16", 989 * TFLOPS), ("float32", 494.5 * TFLOPS)),  # = H100 SXM
    hbm_bw=4800 * GB,                 # H200 datasheet: 4.8 TB/s HBM3e
    hbm_bytes=141 * GB,               # H200 datasheet: 141 GB
    intra_bw=450 * GB,                # NVLink 4: 900 GB/s total
    intra_latency=10e-6,
    inter_bw=50 * GB,                 # NDR 400 Gb/s per GPU (as DGX H100; unsure for HGX H200)
    inter_latency=20e-6,
    devices_per_host=8,
    source="NVIDIA H200 Tensor Core GPU datasheet"))

# ---- this machine ---------------------------------------------------------------------
# 2 shared Xeon cores; f32 matmul ~ 115 GFLOP/s measured (the project's bench_ppo_step on
# this machine); bf16 has no fast path on these cores (unsure: taken as f32 / 2). Memory
# bandwidth and "link" (copy between virtual devices = a host memcpy) are placeholders that
# `planner.calibrate` replaces: 10 GB/s each, 20 us per collective (assumed). Capacity:
# the host's 24 GB RAM (/proc/meminfo), shared by all virtual devices.
CPU = _register(Hardware(
    name="cpu",
    peak_flops=(("float32", 115e9), ("bfloat16", 57.5e9)),
    hbm_bw=10 * GB,
    hbm_bytes=24 * GB,
    intra_bw=10 * GB, intra_latency=20e-6,
    inter_bw=10 * GB, inter_latency=20e-6,
    devices_per_host=8,
    shared_host=True,
    serial_multi_device=True,
    serial_collectives=True,
    source="measured on this machine (bench_ppo_step); placeholders until calibrated"))


def get(name: str) -> Hardware:
  """The profile `name` (case-insensitive; "h100", "tpu-v5p", ...)."""
  key = name.lower().replace("_", "-")
  aliases = {"v4": "tpu-v4", "v5e": "tpu-v5e", "v5p": "tpu-v5p", "v6e": "tpu-v6e",
             "a100": "a100-80gb"}
  key = aliases.get(key, key)
  if key not in PROFILES:
    raise ValueError(f"unknown hardware {name!r}; choose one of {sorted(PROFILES)}.")
  return PROFILES[key]
