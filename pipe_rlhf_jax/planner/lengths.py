"""Response lengths: how many passes generation really runs when rows stop at EOS.

The decoders stop early (`generation/sampler.py`: the whole batch's while_loop ends once
every row is done; `generation/pipelined.py`: a micro-batch whose rows are all done
skips its compute, and the loop ends once every micro-batch is done), so what a batch
costs depends on its *longest* rows, not on the mean. This module owns the length model
the planner prices that with:

  a row emits EOS after each token with the same probability q (a constant hazard), and
  is cut at T = max_new_tokens: its length is min(G, T), G ~ Geometric(q) on 1, 2, ...
  mean length = (1 - (1 - q)^T) / q;  P(length <= k) = 1 - (1 - q)^k for k < T.

One number sets it: the mean length as a fraction f of T (`Workload.response_fraction`;
1 = no row stops early, the model's default and what `eos_id=None` gives). f comes from
the config (`plan.response_fraction`) or from a finished run's metrics
(`fraction_from_metrics`: its mean `response_length/mean` over `data.completion_len`).

The expected longest of r independent rows is exact:
  E[max] = sum_{k=0}^{T-1} P(max > k) = sum_{k=0}^{T-1} 1 - (1 - (1 - q)^k)^r.
"""

from __future__ import annotations

import functools
import json

import numpy as np


def _mean_fraction(q: float, max_len: int) -> float:
  """Mean of min(Geometric(q), T) over T."""
  if q <= 0:
    return 1.0
  return (1 - (1 - q) ** max_len) / q / max_len


@functools.lru_cache(maxsize=4096)
def hazard(fraction: float, max_len: int) -> float:
  """The per-token EOS probability q whose truncated mean length is `fraction` x T.

  The mean falls monotonically from 1 (q = 0) to 1 / T (q = 1): bisection.
  """
  if not 0 < fraction <= 1:
    raise ValueError(f"response_fraction={fraction!r} must be in (0, 1] (the mean "
                     "response length over max_new_tokens; 1 = no early EOS).")
  if fraction >= 1 or max_len == 1:
    return 0.0
  if fraction <= 1 / max_len:
    return 1.0
  lo, hi = 0.0, 1.0
  for _ in range(100):
    mid = (lo + hi) / 2
    if _mean_fraction(mid, max_len) > fraction:
      lo = mid
    else:
      hi = mid
  return (lo + hi) / 2


@functools.lru_cache(maxsize=4096)
def expected_longest(fraction: float, max_len: int, rows: int) -> float:
  """E[longest of `rows` independent response lengths], in tokens (1..T)."""
  q = hazard(fraction, max_len)
  if q == 0.0:
    return float(max_len)
  k = np.arange(max_len)  # P(max > k) for k = 0 .. T-1
  below = 1.0 - (1.0 - q) ** k  # P(one row's length <= k)
  return float(np.sum(1.0 - below ** rows))


def passes_per_microbatch(fraction: float, max_len: int, batch: int,
                          num_microbatches: int) -> tuple[int, ...]:
  """Passes each micro-batch of the pipelined decoder runs (its longest row), rounded.

  Every micro-batch but the last gets the expected longest of its batch / M rows; the
  last gets the expected longest of the whole batch, since the loop runs until the
  batch's longest row is done (and which micro-batch holds it does not change the tick
  count by more than M - 1 of the (T - 1) W + M + P - 1 ticks).
  """
  rows = max(batch // num_microbatches, 1)
  each = min(max_len, max(1, round(expected_longest(fraction, max_len, rows))))
  last = min(max_len, max(1, round(expected_longest(fraction, max_len, batch))))
  return (each,) * (num_microbatches - 1) + (max(each, last),)


def fraction_from_metrics(path: str, max_len: int) -> float:
  """Mean response length over `max_len` of a run's PPO steps (its metrics.jsonl)."""
  means = []
  with open(path, encoding="utf-8") as f:
    for line in f:
      record = json.loads(line)
      if record.get("phase") == "ppo" and "response_length/mean" in record:
        means.append(record["response_length/mean"])
  if not means:
    raise ValueError(f"{path} has no PPO rows with response_length/mean; give a run's "
                     "metrics.jsonl, or the fraction itself (plan.response_fraction).")
  return min(1.0, max(1.0 / max_len, float(np.mean(means)) / max_len))


@functools.lru_cache(maxsize=1024)
def batch_lengths(fraction: float, max_len: int, count: int,
                  observed: tuple[int, ...] = ()) -> tuple[int, ...]:
  """`count` response lengths standing for one batch, in queue order.

  The (i + 1/2) / count quantiles of the length distribution: the observed lengths'
  empirical one when given (`Workload.response_lengths`, e.g. recorded from the model),
  else the constant-hazard model of mean `fraction` x T. The quantiles are put in a fixed
  random order, as a queue of prompts would meet them. The continuous-batching engine's
  cost depends on the whole distribution and on the order (its pure schedule,
  `generation.slot_schedule.simulate`, runs over these lengths), not on the mean alone.
  """
  u = (np.arange(count) + 0.5) / count
  if observed:
    out = np.quantile(np.asarray(observed, np.float64), u, method="inverted_cdf")
  else:
    q = hazard(fraction, max_len)
    if q == 0.0:
      out = np.full(count, max_len)
    elif q >= 1.0:
      out = np.ones(count)
    else:
      # P(length <= k) = 1 - (1 - q)^k below T: the smallest k reaching u.
      out = np.ceil(np.log1p(-u) / np.log1p(-q))
  out = np.clip(np.asarray(out, np.int64), 1, max_len)
  return tuple(int(x) for x in out[np.random.RandomState(0).permutation(count)])
