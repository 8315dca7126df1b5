"""The memory model: bytes per device of each stage under a plan, and the fit check.

Per device and stage:
  generate: the actor's parameters; KV cache [B/(data*fsdp), S, layers/pipe,
    kv_heads/tensor, head_dim] x2 (k, v); one step's logits [B/(data*fsdp), vocab/tensor]
    f32; the prefill's layer activations.
  infer: parameters of the reference, the critic (and the reward model); one layer's
    activations of a forward over [B/(data*fsdp), L] (remat irrelevant: no backward); the
    head's logits / log-softmax over a chunk of positions (all completion positions when
    logits_chunk = 0) in f32.
  train: actor and critic parameters, their Adam moments (2 per parameter, in the
    parameter dtype) and gradients; activations saved for the backward of one
    minibatch [minibatch/(data*fsdp), L] (every layer's intermediates without remat, only
    the layer inputs plus one layer's intermediates with full remat); the head's logits.
Parameters are split over fsdp x tensor x pipe (data replicates); with fsdp > 1 one
model's weights are also held gathered (XLA gathers the scanned layer stack at once). In `sequential` and
`per_stage` modes the three stages share the devices, so the persistent state of all three
lives there at once, plus the largest transient. Shares of the host (cpu profile): all
virtual devices share the host's RAM, so each device gets capacity / devices_per_host.

Sizes are bytes; every estimate is a sum of named terms so a rejection can say which.
"""

from __future__ import annotations

import dataclasses

from pipe_rlhf_jax.models.config import TransformerConfig
from pipe_rlhf_jax.planner.hardware import GIB, Hardware
from pipe_rlhf_jax.planner.space import Workload
from pipe_rlhf_jax.system.settings import STAGES, RuntimeConfig, StagePlan

_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# Headroom XLA needs beyond what is modelled (fragmentation, small temporaries): the
# model's total must fit under this fraction of the capacity.
USABLE_FRACTION = 0.9


def param_bytes(cfg: TransformerConfig) -> float:
  return cfg.num_params() * _BYTES[cfg.param_dtype]


@dataclasses.dataclass(frozen=True)
class StageMemory:
  """Bytes per device of one stage: persistent (lives across steps) and transient."""

  persistent: tuple[tuple[str, float], ...]
  transient: tuple[tuple[str, float], ...]

  @property
  def persistent_bytes(self) -> float:
    return sum(v for _, v in self.persistent)

  @property
  def transient_bytes(self) -> float:
    return sum(v for _, v in self.transient)

  @property
  def total(self) -> float:
    return self.persistent_bytes + self.transient_bytes

  def describe(self) -> str:
    terms = self.persistent + self.transient
    return ", ".join(f"{k} {v / GIB:.2f}" for k, v in terms if v) + " GiB"


def _splits(plan: StagePlan, mesh_sizes: dict[str, int]) -> tuple[int, int]:
  """(batch ways data*fsdp, parameter ways fsdp*tensor*pipe)."""
  m = mesh_sizes
  return m["data"] * m["fsdp"], m["fsdp"] * m["tensor"] * m["pipe"]


def layer_activation_elems(cfg: TransformerConfig) -> int:
  """Elements per token one layer keeps for its backward without remat.

  The inputs of every matmul and nonlinearity: residual input and its norm (2 E), q, k, v
  and the attention output (2 h d + 2 kv d), the second residual and its norm (2 E), gate,
  up and their SwiGLU product (3 F).
  """
  e, h, k, d, f = (cfg.embed_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                   cfg.mlp_dim)
  return 4 * e + 2 * h * d + 2 * k * d + 3 * f


def stage_memory(stage: str, plan: StagePlan, mesh_sizes: dict[str, int],
                 work: Workload) -> StageMemory:
  """Bytes per device of `stage` run with `plan` on a mesh of `mesh_sizes`."""
  cfg = work.actor
  act = _BYTES[cfg.dtype]
  batch_ways, param_ways = _splits(plan, mesh_sizes)
  t, p = mesh_sizes["tensor"], mesh_sizes["pipe"]
  L = work.length
  vocab_dev = cfg.vocab_size / t
  params = param_bytes(cfg) / param_ways
  # fsdp: XLA gathers the whole scanned layer stack of a model at once (seen in
  # memory_analysis), so one model's weights exist unsharded over fsdp while it runs.
  gathered = param_bytes(cfg) / (t * p) if mesh_sizes["fsdp"] > 1 else 0.0
  if stage == "generate":
    b = work.batch_size / batch_ways
    kv = 2 * cfg.num_layers / p * b * L * cfg.num_kv_heads / min(t, cfg.num_kv_heads) \
        * cfg.head_dim * act
    prefill = b * work.prompt_len * layer_activation_elems(cfg) / t * act
    logits = b * vocab_dev * 4 * 2
    return StageMemory((("actor params", params),),
                       (("kv cache", kv), ("prefill activations", prefill),
                        ("logits", logits), ("fsdp-gathered weights", gathered)))
  if stage == "infer":
    models = 3 if work.reward_model else 2
    b = work.batch_size / batch_ways
    layer = b * L * layer_activation_elems(cfg) / t * act
    positions = plan.logits_chunk or work.gen_len
    logits = b * positions * vocab_dev * 4 * 2
    return StageMemory((("ref/critic/reward params", models * params),),
                       (("layer activations", layer), ("logits", logits),
                        ("fsdp-gathered weights", gathered)))
  if stage == "train":
    b = work.minibatch_size / batch_ways
    opt = 2 * 2 * params  # Adam m and v of actor and critic, parameter dtype
    grads = 2 * params
    per_layer = b * L * layer_activation_elems(cfg) / t * act
    if plan.remat == "full":
      saved = b * L * cfg.embed_dim * act * cfg.num_layers + per_layer
    else:
      saved = per_layer * cfg.num_layers
    positions = plan.logits_chunk or work.gen_len
    logits = b * positions * vocab_dev * 4 * 3  # logits, log-softmax, their gradient
    return StageMemory((("actor+critic params", 2 * params), ("adam moments", opt)),
                       (("gradients", grads), ("saved activations", saved),
                        ("logits", logits), ("fsdp-gathered weights", gathered)))
  raise ValueError(f"stage={stage!r}; choose one of {STAGES}.")


def capacity(hw: Hardware) -> float:
  """Usable bytes per device (a share of the host's RAM on shared hardware)."""
  total = hw.hbm_bytes / hw.devices_per_host if hw.shared_host else hw.hbm_bytes
  return total * USABLE_FRACTION


def plan_memory(runtime: RuntimeConfig, work: Workload) -> dict[str, float]:
  """Peak bytes per device of each device group ({stage: bytes} in pipe mode, else
  {"all": bytes}: the three stages' persistent state together plus the largest
  transient)."""
  from pipe_rlhf_jax.system.system import stage_mesh_shapes
  shapes = stage_mesh_shapes(runtime, work.num_devices)
  mems = {s: stage_memory(s, runtime.stage(s), shapes[s][0].as_dict(), work)
          for s in STAGES}
  return combine(runtime, mems)


def combine(runtime: RuntimeConfig, mems: dict[str, StageMemory]) -> dict[str, float]:
  """Peak bytes per device of each device group from the stages' memories."""
  if runtime.mode == "pipe":
    return {s: m.total for s, m in mems.items()}
  return {"all": sum(m.persistent_bytes for m in mems.values())
          + max(m.transient_bytes for m in mems.values())}


def memory_error(runtime: RuntimeConfig, work: Workload, hw: Hardware) -> str | None:
  """Why the plan does not fit in device memory (None: it fits)."""
  from pipe_rlhf_jax.system.system import stage_mesh_shapes
  limit = capacity(hw)
  shapes = stage_mesh_shapes(runtime, work.num_devices)
  for group, need in plan_memory(runtime, work).items():
    if need > limit:
      stages = [group] if group != "all" else list(STAGES)
      detail = "; ".join(
          f"{s}: " + stage_memory(s, runtime.stage(s), shapes[s][0].as_dict(),
                                  work).describe() for s in stages)
      return (f"needs {need / GIB:.2f} GiB per device on the {group} devices, over the "
              f"{limit / GIB:.2f} GiB usable of {hw.name} ({detail})")
  return None
