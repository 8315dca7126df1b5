"""The generation stage: sampling rollouts with behaviour log-probs on its own mesh.

When the stage's mesh has a `pipe` axis larger than one, decoding runs the delayed
inter-batch pipeline (`generation/pipelined.py`) with `num_microbatches`; otherwise the
plain KV-cache sampler, with data / fsdp / tensor parallelism from the mesh and rules,
either as one static batch or, with `num_slots` > 0, as a queue over that many slots
with continuous batching (`generation/engine.py`: same completions, fewer idle
slot-steps on long-tailed lengths). The pipelined decoder takes `num_slots` too: its
micro-batches of num_slots / num_microbatches rows are refilled from the batch as they
finish. Either way the output is a `Rollout` in the shared `[prompt | completion]`
layout.

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

from pipe_rlhf_jax.distributed.arrays import fetch, put_global
from pipe_rlhf_jax.generation import sampler
from pipe_rlhf_jax.ppo.types import Rollout
from pipe_rlhf_jax.stages.common import StageLayout


class GenerateStage:
  """Samples completions for prompt batches.

  Args:
    layout: the generation stage's mesh and rules.
    graphdef: the actor's structure.
    sampling: static sampling settings (length, temperature, top-k/p, EOS, pad).
    num_microbatches: micro-batches of the pipelined decoder (used when pipe > 1).
    group_size: completions sampled per prompt.
    num_slots: 0 for one static batch; S > 0 for continuous batching over S slots.
  """

  def __init__(self, layout: StageLayout, graphdef: nnx.GraphDef,
               sampling: sampler.SamplingParams, num_microbatches: int = 1,
               group_size: int = 1, num_slots: int = 0):
    self.layout = layout
    self.group_size = group_size
    self.graphdef = graphdef
    self.sampling = sampling
    self.num_microbatches = num_microbatches
    self.num_slots = num_slots
    self.pipe = layout.mesh.shape.get("pipe", 1)
    if num_slots and self.pipe > 1 and num_slots % num_microbatches:
      raise ValueError(f"stages.generate.num_slots={num_slots} is not a multiple of "
                       f"stages.generate.num_microbatches={num_microbatches}: the pipelined "
                       "decoder refills micro-batches of num_slots / num_microbatches rows.")
    if self.pipe == 1 and not num_slots:
      self._prefill, self._decode = sampler.make_generate_fns(graphdef, sampling,
                                                              group_size=group_size)
    self._engines: dict[int, object] = {}

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
    executed = None
    if self.pipe > 1:
      from pipe_rlhf_jax.generation import pipelined
      slots = self._pipe_slots(len(tokens))
      out, executed = pipelined.pipelined_generate(
          self.graphdef, actor, tokens, mask, self.sampling, mesh=self.layout.mesh,
          num_microbatches=self.num_microbatches, rng=rng, sample_ids=sample_ids,
          limits=self.layout.put_batch(limits), num_slots=slots, rules=self.layout.rules)
    elif self.num_slots:
      out, stats = self._continuous(actor, queue, rng, sample_ids, limits)
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
    new_tokens = float(fetch(out.mask).sum())
    if executed is not None and self.num_slots:
      # Stage 0's passes, each over one micro-batch of rows: the slot-steps decoded.
      passes = int((fetch(executed)[:, 0, 0] >= 0).sum())
      rows = (self._pipe_slots(len(tokens)) or len(tokens)) // self.num_microbatches
      metrics["generate/slot_occupancy"] = new_tokens / max(passes * rows, 1)
    seconds = time.perf_counter() - start
    return rollout, {"time/generate_s": seconds,
                     "generate/tokens_per_s": new_tokens / max(seconds, 1e-9), **metrics}

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
      spec = engine.EngineSpec(num_slots=slots, group_size=self.group_size)
      self._engines[slots] = engine.make_engine_fn(self.graphdef, self.sampling, spec)
    # The queue is read by every slot wherever it sits: replicated, not split over batch.
    prompts = put_global({k: np.asarray(queue[k]) for k in ("prompt_tokens", "prompt_mask")},
                         self.layout.replicated)
    limits = put_global(limits, self.layout.replicated)
    with self.layout.rules_context():
      return self._engines[slots](actor, prompts["prompt_tokens"],
                                  prompts["prompt_mask"].astype(bool), rng, sample_ids,
                                  limits)


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
