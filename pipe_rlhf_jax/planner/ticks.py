"""How many ticks of each kind generation runs under a plan: the counts the cost model
(`planner.cost.generate_terms`) prices.

A tick is one lock-step pass of every pipeline stage; what it costs depends only on how
many stages prefill and how many decode in it. So each decoder's schedule reduces to a
count of ticks per (prefilling, decoding) pair: the delayed schedule as the early-exiting
decoder runs it, the refilling pipelined decoder's, and the continuous-batching engine's
own timeline (`generation.slot_schedule`). The schedules themselves are the generation
package's; this module only counts them, memoised because the search prices the same
generation plan many times.
"""

from __future__ import annotations

import functools

import numpy as np

from pipe_rlhf_jax.generation import engine, slot_schedule
from pipe_rlhf_jax.generation import schedule as sched
from pipe_rlhf_jax.planner import lengths


@functools.lru_cache(maxsize=4096)
def tick_counts(num_stages: int, num_microbatches: int, gen_len: int, fraction: float,
                batch: int) -> tuple[tuple[tuple[int, int], int], ...]:
  """How many ticks generation runs with each (prefilling, decoding) count of stages.

  Pipelined (P > 1): the delayed schedule as the early-exiting decoder runs it
  (`schedule.early_exit_schedule`), each micro-batch running the passes of its expected
  longest row (`lengths.passes_per_microbatch`). Plain sampler (P = 1): one prefill, then
  decode steps until the batch's expected longest row is done.
  """
  if num_stages == 1:
    longest = lengths.passes_per_microbatch(fraction, gen_len, batch, 1)[0]
    return tuple(((pre, dec), n) for (pre, dec), n in (((1, 0), 1), ((0, 1), longest - 1))
                 if n)
  passes = lengths.passes_per_microbatch(fraction, gen_len, batch, num_microbatches)
  return _activity_counts(sched.early_exit_schedule(num_stages, num_microbatches, gen_len,
                                                   passes))


def _activity_counts(schedule: np.ndarray) -> tuple[tuple[tuple[int, int], int], ...]:
  """How many ticks of `schedule` have each (prefilling, decoding) count of stages."""
  activity = sched.tick_activity(schedule)  # [ticks, 2]
  pairs, counts = np.unique(activity, axis=0, return_counts=True)
  return tuple(((int(a), int(b)), int(c)) for (a, b), c in zip(pairs, counts))


@functools.lru_cache(maxsize=256)
def refill_counts(num_stages: int, num_microbatches: int, batch_lengths: tuple[int, ...],
                  rows_per_load: int) -> tuple[tuple[tuple[int, int], int], ...]:
  """`tick_counts` of a refilling pipelined decoder: loads of `rows_per_load` consecutive
  completions, each running its longest row's passes (`schedule.refill_schedule`)."""
  loads = np.asarray(batch_lengths).reshape(-1, rows_per_load).max(axis=1)
  return _activity_counts(sched.refill_schedule(num_stages, num_microbatches, loads))


@functools.lru_cache(maxsize=256)
def engine_timeline(batch_lengths: tuple[int, ...], slots: int, group_size: int,
                    prefill_chunk: int = 0, prompt_len: int = 0):
  """The continuous-batching engine's schedule over one batch (memoised: the search
  prices the same generation plan many times)."""
  spec = engine.EngineSpec(num_slots=slots, group_size=group_size,
                           prefill_chunk=prefill_chunk)
  return slot_schedule.simulate(batch_lengths, spec, prompt_len)
