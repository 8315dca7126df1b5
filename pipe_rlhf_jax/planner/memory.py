"""The memory model: bytes per device of each stage under a plan, and the fit check.

Per device and stage (b = rows per device, L = prompt + completion tokens):
  generate: the actor's parameters; the KV cache [layers/pipeline, b, L slots,
    kv_heads/tensor, head_dim] x2 (k, v); the prefill's forward activations of one layer
    (`forward_activation_bytes`, over b x prompt tokens attending to L slots) and its f32
    logits on every prompt position; with fsdp, two layers' gathered weights.
  infer: parameters of the reference, the critic and the reward model (each with its
    own head); one layer's forward activations over [b, L] (one per model when the
    layers are unrolled: XLA's default CPU order then runs the models' forwards side by
    side); the head's logits and log-softmax over a chunk of positions (all completion
    positions when logits_chunk = 0) in f32.
  train: actor and critic parameters, their Adam moments (2 per parameter, in the
    parameter dtype), gradients and the optimizer's updates; the residuals every layer
    saves for the backward (`layer_activation_bytes`: by remat policy and attention
    implementation, counted from `jax.checkpoint`'s saved residuals) for BOTH models at
    once (XLA runs the actor's and the critic's forward before either backward), plus
    the layer being recomputed under remat; the head's logits.
Parameters are split over fsdp x tensor x pipeline (data replicates). In `sequential` and
`per_stage` modes the three stages share the devices, so the persistent state of all three
lives there at once, plus the largest transient.
With LoRA adapters (`actor.lora_rank` > 0) the models carry their adapters beside the
base; the reference is the actor's base; the trainer's moments, gradients and updates
cover the trained parameters only (adapters, and the critic's value head); and in
`sequential` mode (one mesh) the stages share one copy of each frozen base
(`PPOSystem` places each from the stage before it), so the terms marked "shared" count
once. Shares of the host (cpu profile): all
virtual devices share the host's RAM, so each device gets capacity / devices_per_host.
Checked against XLA's `compiled.memory_analysis()` of the real train, infer and generate
programs (tests/planner/test_memory.py: within 25%, the measured ratios listed there),
with each stage's layer scan as `StagePlan.unroll_for` resolves it: unrolled without fsdp
or remat, a loop with them (unrolled, XLA gathers every layer's weights and schedules the
recomputation ahead, which this model does not count: a plan that asks for that with an
explicit `scan_unroll` is sized as if it looped).

Sizes are bytes; every estimate is a sum of named terms so a rejection can say which.
"""

from __future__ import annotations

import dataclasses

from pipe_rlhf_jax.config import STAGES, Plan, StagePlan
from pipe_rlhf_jax.models import flops
from pipe_rlhf_jax.models.config import TransformerConfig
from pipe_rlhf_jax.planner.hardware import GIB, Hardware
from pipe_rlhf_jax.planner.space import Workload

_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# Headroom XLA needs beyond what is modelled (fragmentation, small temporaries): the
# model's total must fit under this fraction of the capacity.
USABLE_FRACTION = 0.9


def param_bytes(cfg: TransformerConfig) -> float:
  """Every parameter of `cfg`'s model, its adapters included."""
  return (cfg.num_params() + cfg.num_adapter_params()) * _BYTES[cfg.param_dtype]


def trained_bytes(cfg: TransformerConfig) -> float:
  """The parameters an update trains: all of them, or with adapters those and a value
  head (`models.lora.trainable_filter`)."""
  if not cfg.lora_rank:
    return param_bytes(cfg)
  head = cfg.embed_dim if cfg.head == "value" else 0
  return (cfg.num_adapter_params() + head) * _BYTES[cfg.param_dtype]


# Terms of a frozen base another stage also holds: in `sequential` mode the same arrays.
SHARED = "shared "


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
  """(batch ways data*fsdp, parameter ways fsdp*tensor*pipeline)."""
  m = mesh_sizes
  return m["data"] * m["fsdp"], m["fsdp"] * m["tensor"] * m["pipeline"]


def _attention_impl(cfg: TransformerConfig, plan: StagePlan, keys: int,
                    queries: int | None = None) -> str:
  """The attention implementation a stage runs for `queries` queries (default: as many
  as keys) over `keys` keys (`models.attention`)."""
  from pipe_rlhf_jax.models.attention import resolve
  impl = cfg.attention if plan.attention == "auto" else plan.attention
  return resolve(impl, keys, cfg.attention_block_size, queries)


def layer_activation_bytes(cfg: TransformerConfig, tensor: int, keys: int, impl: str,
                           remat: str = "none") -> float:
  """Bytes per token one layer keeps for its backward pass (`jax.checkpoint` residuals
  of `models.transformer.Layers._block`, counted with `saved_residuals`).

  remat "none": every intermediate: the residual stream and both norms (4 E in the
  compute dtype, 2 E in f32: RMSNorm computes in f32), q and the attention output
  (2 H d), k and v (2 K d), the SwiGLU inputs, activations and products (6 F), and the
  attention path: dense keeps f32 scores and probabilities [H, keys] (+ 2 H row
  statistics); blockwise keeps each key block's running output and statistics
  (ceil(keys / block) x (H d + 2 H) in f32) and recomputes the scores. With q/k norm
  (Qwen3) each query and key head adds its input (compute dtype), its normalised value
  and two row statistics (f32): (H + K) (d (act + 4) + 8) bytes.
  "save_matmuls": the layer input and the projections' outputs only (3 E + (H + 2 K) d
  + 2 F). "full": the layer input (E). Heads, kv heads and mlp split over tensor.
  """
  act = _BYTES[cfg.dtype]
  e, d = cfg.embed_dim, cfg.head_dim
  h, k, f = (cfg.num_heads / tensor, max(cfg.num_kv_heads / tensor, 1),
             cfg.mlp_dim / tensor)
  if remat == "full":
    return e * act
  if remat == "save_matmuls":
    return (3 * e + (h + 2 * k) * d + 2 * f) * act
  if impl == "blockwise":
    blocks = -(-keys // cfg.attention_block_size)
    attention = blocks * (h * d + 2 * h) * 4
  else:  # dense, and dot_product where the backend materialises the scores (CPU)
    attention = (2 * h * keys + 2 * h) * 4
  qk_norm = (h + k) * (d * (act + 4) + 2 * 4) if cfg.qk_norm else 0
  return (4 * e + 2 * h * d + 2 * k * d + 6 * f) * act + 2 * e * 4 + attention + qk_norm


def forward_activation_bytes(cfg: TransformerConfig, tensor: int, keys: int,
                             impl: str) -> float:
  """Bytes per token one layer holds at once in a forward pass without gradients: the
  residual and its norm (2 E), q, k, v / the attention output ((H + 2 K) d), gate and up
  (2 F), and one set of f32 scores (dense: [H, keys]; blockwise: one key block). XLA
  fuses the rest away and frees each layer's values before the next."""
  act = _BYTES[cfg.dtype]
  e, d = cfg.embed_dim, cfg.head_dim
  h, k, f = (cfg.num_heads / tensor, max(cfg.num_kv_heads / tensor, 1),
             cfg.mlp_dim / tensor)
  scores = h * (cfg.attention_block_size if impl == "blockwise" else keys) * 4
  return (2 * e + (h + 2 * k) * d + 2 * f) * act + scores


def model_activation_bytes(cfg: TransformerConfig, tensor: int, keys: int,
                           impl: str) -> float:
  """Bytes per token one model keeps outside its layer scan: the f32 RoPE tables (cos,
  sin and their broadcasts: 4 head_dim) and, for dense attention, the [H, keys] f32 mask
  bias with its bool mask."""
  h = cfg.num_heads / tensor
  mask = h * keys * 5 if impl != "blockwise" else 0.0
  return 4 * cfg.head_dim * 4 + mask


def _layer_params(cfg: TransformerConfig) -> float:
  return flops.layer_matmul_params(cfg) * _BYTES[cfg.param_dtype]


def stage_memory(stage: str, plan: StagePlan, mesh_sizes: dict[str, int],
                 work: Workload) -> StageMemory:
  """Bytes per device of `stage` run with `plan` on a mesh of `mesh_sizes`."""
  cfg = work.actor
  act = _BYTES[cfg.dtype]
  batch_ways, param_ways = _splits(plan, mesh_sizes)
  t, p = mesh_sizes["tensor"], mesh_sizes["pipeline"]
  L = work.length
  vocab_dev = cfg.vocab_size / t
  fsdp = mesh_sizes["fsdp"] > 1
  if stage == "generate":
    engine_slots = plan.num_slots if p == 1 else 0
    if engine_slots:
      engine_slots = max(min(engine_slots, work.batch_size), work.group_size)
    # A refilling pipelined decoder keeps S rows' caches, not the batch's.
    pipe_slots = plan.num_slots if p > 1 and 0 < plan.num_slots < work.batch_size else 0
    b = (engine_slots or pipe_slots or work.batch_size) / batch_ways
    slots = L  # prompt + completion: the cache every step attends over
    # The prefill's queries are the prompt's columns, over the whole cache.
    impl = _attention_impl(cfg, plan, slots, work.prompt_len)
    kv = 2 * cfg.num_layers / p * b * slots * cfg.num_kv_heads / min(t, cfg.num_kv_heads) \
        * cfg.head_dim * act
    # The engine's widest admission builds its newcomers' cache regions (up to every
    # slot's) before placing them, once per prompt and once per slot: up to 2x the cache.
    admission = 2 * kv if engine_slots else 0.0
    tokens = work.prefill_rows(b, p) * work.prompt_len
    prefill = tokens * (forward_activation_bytes(cfg, t, slots, impl)
                        + model_activation_bytes(cfg, t, slots, impl))
    # The prefill applies the LM head at each row's last prompt position only (f32).
    logits = b * vocab_dev * 4
    # fsdp: the scan gathers one layer's weights at a time (and prefetches the next), and
    # each decode step's LM head its whole [embed, vocab / tensor] weight (4.2 MB of
    # XLA's 10.1 MB peak in tests/planner/test_memory.py's fsdp=4 x tensor=2 case).
    gathered = (2 * _layer_params(cfg) / t + flops.head_params(cfg) * _BYTES[cfg.param_dtype]
                / t) if fsdp else 0.0
    # The plain decoder without fsdp copies each layer's weights out of the stacked arrays
    # once per call (`Layers.per_layer`); the pipelined decoder (pipeline > 1) and fsdp read
    # them in place. The copies live in the decode program, after the prefill's
    # activations and logits are gone: only what they add beyond those raises the peak.
    copies = cfg.num_layers * _layer_params(cfg) / param_ways if p == 1 and not fsdp else 0.0
    # Those decode loops also carry the cache as one array per layer (`KVCache.unstack`)
    # beside the stacked one they return: a second copy of it.
    unstacked = kv if p == 1 and not fsdp else 0.0
    per_layer = max(0.0, copies + unstacked - prefill - logits)
    return StageMemory((("actor params", param_bytes(cfg) / param_ways),),
                       (("kv cache", kv), ("engine admission cache", admission),
                        ("prefill activations", prefill),
                        ("logits", logits), ("fsdp-gathered weights", gathered),
                        ("decode's per-layer weight and cache copies", per_layer)))
  impl = _attention_impl(cfg, plan, L)
  per_model = model_activation_bytes(cfg, t, L, impl)
  positions = plan.logits_chunk or work.gen_len
  if stage == "infer":
    models = work.models("infer")
    b = work.batch_size / batch_ways
    if cfg.lora_rank:  # the reference is the actor's base: the generation stage's
      shared = sum(param_bytes(c) for c in models if c.head == "lm") / param_ways
      persistent = ((SHARED + "reference (the actor's base)", shared),
                    ("critic/reward params",
                     sum(param_bytes(c) for c in models if c.head != "lm") / param_ways))
    else:
      persistent = (("ref/critic/reward params",
                     sum(param_bytes(c) for c in models) / param_ways),)
    # Forward only: one layer's intermediates at a time, one model at a time in a loop;
    # unrolled, XLA's default CPU order interleaves the models' layers (at the tests'
    # activation-dominated size 34.9 MiB against 19.7 MiB looped; 17.1 MiB under the
    # memory-lean order).
    rolled = plan.unroll_for(mesh_sizes["fsdp"]) == 1
    layer = (1 if rolled else len(models)) * b * L * (
        forward_activation_bytes(cfg, t, L, impl) + per_model)
    logits = b * positions * vocab_dev * 4 * 2  # logits and log-softmax, f32
    gathered = 2 * _layer_params(cfg) / t if fsdp else 0.0
    return StageMemory(
        persistent,
        (("layer activations", layer), ("logits", logits),
         ("fsdp-gathered weights", gathered)))
  if stage == "train":
    b = work.minibatch_size / batch_ways
    trained = work.models("train")  # the actor, and the critic when there is one
    params = sum(param_bytes(c) for c in trained) / param_ways
    learned = sum(trained_bytes(c) for c in trained) / param_ways
    opt = 2 * learned  # Adam m and v of what trains, parameter dtype
    grads = learned
    updates = learned  # the optimizer's updates, alive with the gradients until applied
    # The SFT term's demonstrations (ppo.ptx_coef) are more rows of the actor's forward.
    ptx = work.ptx_rows / batch_ways
    tokens = b * L
    # Actor and critic are differentiated in one program: XLA runs both forwards before
    # either backward, so both models' saved activations are alive at the peak
    # (memory_analysis of the PPO update: twice one model's residuals).
    saved = (len(trained) * tokens + ptx * L) * (
        cfg.num_layers * layer_activation_bytes(cfg, t, L, impl, plan.remat) + per_model)
    if plan.remat != "none":  # the layer being recomputed in the backward
      saved += tokens * layer_activation_bytes(cfg, t, L, impl)
    logits = (b + ptx) * positions * vocab_dev * 4 * 3  # logits, log-softmax, their gradient
    # fsdp: the scan gathers a layer's weights at a time (and prefetches the next).
    gathered = 2 * _layer_params(cfg) / t if fsdp else 0.0
    held = ((("actor+critic params", params),) if not cfg.lora_rank else
            ((SHARED + "actor and critic bases", params - learned),
             ("trained params", learned)))
    return StageMemory(held + (("adam moments", opt),),
                       (("gradients", grads), ("optimizer updates", updates),
                        ("saved activations", saved),
                        ("logits", logits), ("fsdp-gathered weights", gathered)))
  raise ValueError(f"stage={stage!r}; choose one of {STAGES}.")


def capacity(hw: Hardware, devices: int | None = None) -> float:
  """Usable bytes per device: on shared hardware (virtual CPU devices) the host's RAM split
  over the `devices` a job uses (all of the host's when None), else the device's own."""
  if hw.shared_host:
    total = hw.hbm_bytes / min(hw.devices_per_host, devices or hw.devices_per_host)
  else:
    total = hw.hbm_bytes
  return total * USABLE_FRACTION


def plan_memory(plan: Plan, work: Workload) -> dict[str, float]:
  """Peak bytes per device of each device group ({stage: bytes} in pipe mode, else
  {"all": bytes}: the three stages' persistent state together plus the largest
  transient)."""
  from pipe_rlhf_jax.system.system import stage_mesh_shapes
  shapes = stage_mesh_shapes(plan, work.num_devices)
  mems = {s: stage_memory(s, plan.stage(s), shapes[s][0].as_dict(), work)
          for s in STAGES}
  return combine(plan, mems)


def combine(plan: Plan, mems: dict[str, StageMemory]) -> dict[str, float]:
  """Peak bytes per device of each device group from the stages' memories."""
  if plan.mode == "pipe":
    return {s: m.total for s, m in mems.items()}
  # One mesh: a frozen base another stage holds is that stage's arrays.
  shared = sum(v for m in mems.values() for k, v in m.persistent if k.startswith(SHARED)
               ) if plan.mode == "sequential" else 0.0
  return {"all": sum(m.persistent_bytes for m in mems.values()) - shared
          + max(m.transient_bytes for m in mems.values())}


def memory_error(plan: Plan, work: Workload, hw: Hardware) -> str | None:
  """Why the plan does not fit in device memory (None: it fits)."""
  from pipe_rlhf_jax.system.system import stage_mesh_shapes
  limit = capacity(hw, work.num_devices)
  shapes = stage_mesh_shapes(plan, work.num_devices)
  for group, need in plan_memory(plan, work).items():
    if need > limit:
      stages = [group] if group != "all" else list(STAGES)
      detail = "; ".join(
          f"{s}: " + stage_memory(s, plan.stage(s), shapes[s][0].as_dict(),
                                  work).describe() for s in stages)
      return (f"needs {need / GIB:.2f} GiB per device on the {group} devices, over the "
              f"{limit / GIB:.2f} GiB usable of {hw.name} ({detail})")
  return None
