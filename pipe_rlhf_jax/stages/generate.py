"""The generation stage: sampling rollouts with behaviour log-probs on its own mesh.

When the stage's mesh has a `pipeline` axis larger than one, decoding runs the delayed
inter-batch pipeline (`generation/pipelined.py`) with `num_microbatches`; otherwise the
plain KV-cache sampler, with data / fsdp / tensor parallelism from the mesh and rules,
either as one static batch or, with `num_slots` > 0, as a queue over that many slots
with continuous batching (`generation/engine.py`: same completions, fewer idle
slot-steps on long-tailed lengths). The pipelined decoder takes `num_slots` too: its
micro-batches of num_slots / num_microbatches rows are refilled from the batch as they
finish. Either way the output is a `Rollout` in the shared `[prompt | completion]`
layout.

With the engine, the stage also gives the call's slot timeline (`slot_timeline`: which
completion every slot decoded at every decode step, the engine's pure schedule
`slot_schedule.simulate` of the lengths it produced, checked against the engine's own
step count, simulated only when asked) and draws it into a run's trace (`trace_slots`):
a row per slot under the generate stage's, each bar one completion.

Group sampling (`ppo.group_size = n`): each prompt of the batch is repeated n times,
consecutively, before decoding, so the n completions of one prompt are generated in the
same call (by the same pipelined schedule) and sit in rows [g * n, (g + 1) * n) of the
rollout, where the group estimators (`ppo/critic_free.py`) expect them. Sample j of the
prompt with global id i draws its tokens with key id i * n + j: distinct for every
completion, and equal to i when n = 1. The plain sampler prefills each prompt once and
copies its KV cache to the group's n rows (`sampler.prefill_fn`'s `group_size`): the
prefill costs the prompts, not the samples; the engine admits a group whole, likewise.
(The pipelined decoder prefills every row: its micro-batches need not hold whole groups.)
"""

from __future__ import annotations

import time

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

from pipe_rlhf_jax.concurrency.tracing import Tracer
from pipe_rlhf_jax.distributed.arrays import fetch, put_global
from pipe_rlhf_jax.generation import sampler, slot_schedule
from pipe_rlhf_jax.generation.engine import FREE, EngineSpec
from pipe_rlhf_jax.ppo.types import Rollout
from pipe_rlhf_jax.stages.common import StageLayout


class GenerateStage:
  """Samples completions for prompt batches.

  Args:
    layout: the generation stage's mesh and rules.
    graphdef: the actor's structure.
    sampling: static sampling settings (length, temperature, top-k/p, EOS, pad).
    num_microbatches: micro-batches of the pipelined decoder (used when pipeline > 1).
    group_size: completions sampled per prompt.
    num_slots: 0 for one static batch; S > 0 for continuous batching over S slots.
    prefill_chunk: the engine's prompt columns per prefill pass (0: whole prompts;
      `EngineSpec.prefill_chunk`); needs `num_slots` > 0 and no pipeline axis.
  """

  def __init__(self, layout: StageLayout, graphdef: nnx.GraphDef,
               sampling: sampler.SamplingSettings, num_microbatches: int = 1,
               group_size: int = 1, num_slots: int = 0, prefill_chunk: int = 0):
    self.layout = layout
    self.group_size = group_size
    self.graphdef = graphdef
    self.sampling = sampling
    self.num_microbatches = num_microbatches
    self.num_slots = num_slots
    self.prefill_chunk = prefill_chunk
    self.pipeline = layout.mesh.shape.get("pipeline", 1)
    if prefill_chunk and (self.pipeline > 1 or not num_slots):  # `Plan` refuses it first
      raise ValueError(f"prefill_chunk={prefill_chunk} needs the plain engine (num_slots > 0, "
                       f"no pipeline axis); got num_slots={num_slots}, "
                       f"pipeline={self.pipeline}")
    if num_slots and self.pipeline > 1 and num_slots % num_microbatches:
      raise ValueError(f"stages.generate.num_slots={num_slots} is not a multiple of "
                       f"stages.generate.num_microbatches={num_microbatches}: the pipelined "
                       "decoder refills micro-batches of num_slots / num_microbatches rows.")
    if self.pipeline == 1 and not num_slots:
      self._prefill, self._decode = sampler.make_generate_fns(graphdef, sampling,
                                                              group_size=group_size)
    self._engines: dict[int, tuple[EngineSpec, object]] = {}
    # The last engine call's (completion lengths, spec, decode steps): what its slot
    # timeline is simulated from when a trace asks (None after a static batch or the
    # pipelined decoder), so that a run without a trace does no host work for it.
    self._last_engine_call: tuple[np.ndarray, EngineSpec, int, int] | None = None

  def __call__(self, actor: nnx.State, batch: dict, rng: jax.Array, version: int
               ) -> tuple[Rollout, dict]:
    """Generates one rollout batch.

    Args:
      actor: actor parameters, already in this stage's layout.
      batch: host prompt batch with "prompt_tokens", "prompt_mask" and "index", and
        optionally "answer_bytes" (the reference answers, carried into the rollout) and
        "max_new_tokens" (int [prompts]: each prompt's own length budget, at most the
        sampling settings'; benchmarks force length distributions with it); each prompt
        yields `group_size` completions.
      rng: key of this PPO step; token keys fold in each sample's global index.
      version: policy version of `actor`.

    Returns:
      The Rollout (on this stage's mesh) and timing metrics.
    """
    start = time.perf_counter()
    queue = batch
    batch = repeat_for_groups(batch, self.group_size)
    prompts = self.layout.put_batch({k: batch[k] for k in ("prompt_tokens", "prompt_mask")})
    tokens, mask = prompts["prompt_tokens"], prompts["prompt_mask"].astype(bool)
    sample_ids = self.layout.put_batch(np.asarray(batch["index"], np.int32))
    limits = budgets(batch, len(tokens), self.sampling.max_new_tokens)
    metrics = {}
    executed = spec = None
    self._last_engine_call = None
    if self.pipeline > 1:
      from pipe_rlhf_jax.generation import pipelined
      slots = self._pipe_slots(len(tokens))
      out, executed = pipelined.pipelined_generate(
          self.graphdef, actor, tokens, mask, self.sampling, mesh=self.layout.mesh,
          num_microbatches=self.num_microbatches, rng=rng, sample_ids=sample_ids,
          limits=self.layout.put_batch(limits), num_slots=slots, rules=self.layout.rules)
    elif self.num_slots:
      spec, out, stats = self._continuous(actor, queue, rng, sample_ids, limits)
      busy, steps = (int(x) for x in fetch((stats.busy_slot_steps, stats.decode_steps)))
      metrics["generate/slot_occupancy"] = busy / max(steps * self._slots(len(tokens)), 1)
    else:
      with self.layout.rules_context():
        state = self._prefill(actor, tokens, mask, rng, sample_ids,
                              self.layout.put_batch(limits))
        out = self._decode(actor, state, mask, rng, sample_ids).output()
    answers = (self.layout.put_batch(np.asarray(batch["answer_bytes"], np.uint8))
               if "answer_bytes" in batch else None)
    rollout = Rollout(prompt_tokens=tokens, prompt_mask=mask, completion_tokens=out.tokens,
                      completion_mask=out.mask, behaviour_logprobs=out.logprobs,
                      policy_version=jnp.asarray(version, jnp.int32), answer_bytes=answers)
    # Counted on the host: a device reduction here could queue behind another stage's
    # program and pollute the timing (seen on virtual CPU devices sharing cores).
    completion_mask = fetch(out.mask)  # [B, T] on the host
    new_tokens = float(completion_mask.sum())
    if spec is not None:
      self._last_engine_call = completion_mask.sum(-1), spec, steps, tokens.shape[1]
    if executed is not None and self.num_slots:
      # Stage 0's passes, each over one micro-batch of rows: the slot-steps decoded.
      passes = int((fetch(executed)[:, 0, 0] >= 0).sum())
      rows = (self._pipe_slots(len(tokens)) or len(tokens)) // self.num_microbatches
      metrics["generate/slot_occupancy"] = new_tokens / max(passes * rows, 1)
    seconds = time.perf_counter() - start
    return rollout, {"time/generate_s": seconds,
                     "generate/tokens_per_s": new_tokens / max(seconds, 1e-9), **metrics}

  @property
  def slot_timeline(self) -> slot_schedule.SlotTimeline | None:
    """The last engine call's schedule (the engine's pure schedule of the lengths it
    produced), or None: after a static batch or the pipelined decoder, or when the
    simulated schedule's step count is not the engine's."""
    if self._last_engine_call is None:
      return None
    lengths, spec, steps, prompt_len = self._last_engine_call
    timeline = slot_schedule.simulate(lengths, spec, prompt_len)
    return timeline if timeline.decode_steps == steps else None

  def trace_slots(self, tracer: Tracer, batch: int | None = None) -> None:
    """Draws the last call's slots under its generate span (the tracer's latest).

    One lane per slot, one bar per completion it decoded (annotated with the completion's
    row and decode steps). The engine runs on device without per-step timestamps, so a
    bar's times place its decode steps evenly over the span: the picture of who used
    which slot when, not a per-step measurement. Nothing is drawn without an engine call.
    """
    spans = tracer.spans("generate") if tracer.enabled else []
    timeline = self.slot_timeline if spans else None
    if timeline is None or not timeline.decode_steps:
      return
    span = spans[-1]
    per_step = span.duration / timeline.decode_steps
    rows = timeline.rows  # [decode_steps, S]
    for slot in range(rows.shape[1]):
      column = rows[:, slot]
      # Runs of one completion: where the row held changes, a bar ends.
      edges = np.flatnonzero(np.diff(column)) + 1
      for lo, hi in zip(np.r_[0, edges], np.r_[edges, len(column)]):
        if column[lo] == FREE:
          continue
        tracer.add_lane("generate", f"slot {slot}", span.start + lo * per_step,
                        span.start + hi * per_step, batch=batch, completion=int(column[lo]),
                        decode_steps=[int(lo), int(hi)])

  def _pipe_slots(self, rows: int) -> int:
    """Slots the pipelined decoder runs: 0 (one static load per micro-batch) when the
    setting is off or would hold the whole batch."""
    return self.num_slots if 0 < self.num_slots < rows else 0

  def _slots(self, rows: int) -> int:
    """Slots the engine runs: more than the batch's rows would never fill."""
    return max(min(self.num_slots, rows), self.group_size)

  def _continuous(self, actor: nnx.State, queue: dict, rng: jax.Array,
                  sample_ids: jax.Array, limits: np.ndarray):
    """The batch's prompts as the engine's queue, each prompt once (not per sample)."""
    from pipe_rlhf_jax.generation import engine
    rows = len(queue["prompt_tokens"]) * self.group_size
    slots = self._slots(rows)
    if slots not in self._engines:
      spec = engine.EngineSpec(num_slots=slots, group_size=self.group_size,
                               prefill_chunk=self.prefill_chunk)
      self._engines[slots] = spec, engine.make_engine_fn(self.graphdef, self.sampling, spec)
    spec, run = self._engines[slots]
    # The queue is read by every slot wherever it sits: replicated, not split over batch.
    prompts = put_global({k: np.asarray(queue[k]) for k in ("prompt_tokens", "prompt_mask")},
                         self.layout.replicated)
    limits = put_global(limits, self.layout.replicated)
    with self.layout.rules_context():
      out, stats = run(actor, prompts["prompt_tokens"], prompts["prompt_mask"].astype(bool),
                       rng, sample_ids, limits)
    return spec, out, stats


def budgets(batch: dict, rows: int, steps: int) -> np.ndarray:
  """int32 [rows]: each completion's length budget (a repeated batch's
  "max_new_tokens", capped at `steps`; `steps` without one)."""
  if "max_new_tokens" not in batch:
    return np.full((rows,), steps, np.int32)
  limits = np.asarray(batch["max_new_tokens"])
  if limits.shape != (rows,) or (limits < 1).any():
    raise ValueError(f"the prompt batch's max_new_tokens must be one integer >= 1 per "
                     f"prompt; got shape {limits.shape}, min {limits.min()}.")
  return np.minimum(limits, steps).astype(np.int32)


def repeat_for_groups(batch: dict, group_size: int) -> dict:
  """Each prompt `group_size` times in a row, with per-sample ids index * n + j.

  Args:
    batch: host arrays {"prompt_tokens": [prompts, prompt_len], "prompt_mask": same,
      "index": [prompts]} (other keys are repeated alike).
    group_size: n.

  Returns:
    The same keys with [prompts * n, ...] arrays; the batch itself when n = 1.
  """
  if group_size == 1:
    return batch
  out = {k: np.repeat(np.asarray(v), group_size, axis=0) for k, v in batch.items()}
  index = np.asarray(batch["index"], np.int64)
  out["index"] = (index[:, None] * group_size + np.arange(group_size)).reshape(-1)
  return out
