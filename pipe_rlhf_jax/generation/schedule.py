"""The delayed inter-batch pipeline schedule for generation, as pure numpy.

Owns *which stage works on which (micro-batch, pass) at which tick*, its
dependency check, utilisation numbers, a picture, and the config validation for
pipelined generation. The JAX decoder consumes the closed form (`delayed_slot`)
or the table (`delayed_schedule`); nothing here imports jax.

Model: P pipeline stages each own a contiguous slice of layers. A batch is cut
into M micro-batches. Generating T new tokens takes T passes per micro-batch:
pass 0 is the prefill (it yields the first new token), passes 1..T-1 are decode
steps. A pass of a micro-batch flows stage 0 -> P-1; the token sampled after
stage P-1 goes back round the ring to stage 0 for the next pass.

Delayed inter-batch schedule: with W = max(M, P), stage s at tick t works on
u = t - s; if 0 <= u < T*W it processes micro-batch u % W in pass u // W (slots
with micro-batch >= M are bubbles, only when M < P). The last real work is
stage P-1 on (M-1, T-1) at tick (T-1)*W + M - 1 + P - 1, so the schedule has
(T-1)*W + M + P - 1 ticks; that is T*W + P - 1 when M >= P, and when M < P it
drops the P - M trailing ticks that would hold nothing but bubbles (so M = 1
costs exactly T*P ticks, like the naive schedule, rather than more).

Why W = max(M, P): stage 0 starts (mb, k) at tick k*W + mb, while stage P-1
finished (mb, k-1) at tick (k-1)*W + mb + P - 1. The token is back in time iff
k*W + mb > (k-1)*W + mb + P - 1, i.e. W >= P. With fewer micro-batches than
stages the ring is padded with bubbles up to P; with M >= P it is full and the
pipeline only pays its P - 1 fill/drain ticks once for all T passes.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

BUBBLE = -1


def _check_positive(**values: int) -> None:
  for name, value in values.items():
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
      raise ValueError(f"{name} must be a positive int, got {value!r}")


def ring_width(num_stages: int, num_microbatches: int) -> int:
  """W = max(M, P): slots per pass so a token returns before it is needed."""
  return max(int(num_microbatches), int(num_stages))


def num_ticks(num_stages: int, num_microbatches: int, num_passes: int,
              kind: str = "delayed") -> int:
  """Ticks a schedule takes.

  Args:
    num_stages: P.
    num_microbatches: M.
    num_passes: T (prefill + T-1 decode steps).
    kind: "delayed" ((T-1)*W + M + P - 1 with W = max(M, P); equals
      T*W + P - 1 when M >= P) or "naive" (M*T*P).

  Returns:
    Number of ticks.
  """
  _check_positive(num_stages=num_stages, num_microbatches=num_microbatches,
                  num_passes=num_passes)
  if kind == "delayed":
    width = ring_width(num_stages, num_microbatches)
    return (num_passes - 1) * width + num_microbatches + num_stages - 1
  if kind == "naive":
    return num_microbatches * num_passes * num_stages
  raise ValueError(f"kind must be 'delayed' or 'naive', got {kind!r}")


def delayed_slot(tick: Any, stage: Any, num_stages: int, num_microbatches: int,
                 num_passes: int) -> tuple[Any, Any, Any]:
  """Closed form of the delayed schedule; works on ints, numpy or jax arrays.

  Args:
    tick: tick index (scalar or array).
    stage: stage index (scalar or array, broadcast against `tick`).
    num_stages, num_microbatches, num_passes: P, M, T (Python ints).

  Returns:
    (microbatch, pass, active): `active` is False for bubbles and for ticks
    before the stage starts / after it drains; microbatch and pass are only
    meaningful where active.
  """
  width = ring_width(num_stages, num_microbatches)
  u = tick - stage
  microbatch = u % width
  step = u // width
  active = (u >= 0) & (u < num_passes * width) & (microbatch < num_microbatches)
  return microbatch, step, active


def delayed_schedule(num_stages: int, num_microbatches: int,
                     num_passes: int) -> np.ndarray:
  """The delayed inter-batch schedule as a table.

  Returns:
    int32 [ticks, stages, 2] of (microbatch, pass); (-1, -1) marks idle slots.
  """
  ticks = num_ticks(num_stages, num_microbatches, num_passes, "delayed")
  t = np.arange(ticks)[:, None]  # [ticks, 1]
  s = np.arange(num_stages)[None, :]  # [1, stages]
  microbatch, step, active = delayed_slot(t, s, num_stages, num_microbatches,
                                          num_passes)
  table = np.stack([np.where(active, microbatch, BUBBLE),
                    np.where(active, step, BUBBLE)], axis=-1)
  return table.astype(np.int32)  # [ticks, stages, 2]


def early_exit_ticks(num_stages: int, num_microbatches: int, num_passes: int,
                     passes, chunk_ticks: int | None = None) -> int:
  """Ticks the pipelined decoder runs when micro-batch mb stops after `passes[mb]` passes.

  Mirrors `generation/pipelined.py`: the M + P - 1 prefill ticks run as a block, then
  the decode ticks in chunks of `chunk_ticks` (default W) until a chunk ends with every
  micro-batch done on stage P-1 (at least one chunk; at most the full schedule, rounded
  up to a whole chunk). Stage P-1 finishes pass k of micro-batch mb at tick
  k*W + mb + P - 1.

  Args:
    num_stages, num_microbatches, num_passes: P, M, T.
    passes: [M] passes each micro-batch runs (1..T: its longest row's length).
    chunk_ticks: ticks per early-exit check.

  Returns:
    Ticks run (equals `num_ticks` when every micro-batch runs all T passes).
  """
  width = ring_width(num_stages, num_microbatches)
  chunk = chunk_ticks or width
  passes = np.asarray(passes)
  if passes.shape != (num_microbatches,) or passes.min() < 1 or passes.max() > num_passes:
    raise ValueError(f"passes must give 1..{num_passes} passes for each of the "
                     f"{num_microbatches} micro-batches, got {passes.tolist()}")
  total = num_ticks(num_stages, num_microbatches, num_passes)
  prefill = num_microbatches + num_stages - 1
  if total <= prefill:
    return total
  finish = int(np.max((passes - 1) * width + np.arange(num_microbatches))) + num_stages - 1
  chunks = max(1, -(-(finish + 1 - prefill) // chunk))
  return prefill + min(chunks, -(-(total - prefill) // chunk)) * chunk


def early_exit_schedule(num_stages: int, num_microbatches: int, num_passes: int,
                        passes, chunk_ticks: int | None = None) -> np.ndarray:
  """The delayed schedule as the early-exiting decoder runs it.

  Slots of passes a micro-batch no longer needs (pass >= passes[mb]) are idle, and the
  table has `early_exit_ticks` rows (ticks past the full schedule, run only to finish
  a chunk, are idle).

  Returns:
    int32 [ticks run, stages, 2] of (microbatch, pass); (-1, -1) marks idle slots.
  """
  ticks = early_exit_ticks(num_stages, num_microbatches, num_passes, passes, chunk_ticks)
  t = np.arange(ticks)[:, None]  # [ticks, 1]
  s = np.arange(num_stages)[None, :]  # [1, stages]
  microbatch, step, active = delayed_slot(t, s, num_stages, num_microbatches, num_passes)
  needed = np.asarray(passes)[np.minimum(microbatch, num_microbatches - 1)]
  active = active & (step < needed)
  table = np.stack([np.where(active, microbatch, BUBBLE),
                    np.where(active, step, BUBBLE)], axis=-1)
  return table.astype(np.int32)  # [ticks, stages, 2]


def refill_ticks_bound(num_stages: int, num_microbatches: int, num_loads: int,
                       num_passes: int) -> int:
  """Ticks within which the refilling decoder ends, whatever the lengths.

  Every visit round (W ticks) each micro-batch runs a pass while the queue has loads,
  so the queue is handed out within ceil(L * T / M) rounds and the last load ends at
  most T rounds later (list scheduling's bound); P ticks drain the last pass.
  """
  _check_positive(num_stages=num_stages, num_microbatches=num_microbatches,
                  num_loads=num_loads, num_passes=num_passes)
  rounds = -(-num_loads * num_passes // num_microbatches) + num_passes + 1
  return rounds * ring_width(num_stages, num_microbatches) + num_stages


def refill_schedule(num_stages: int, num_microbatches: int, passes) -> np.ndarray:
  """What the refilling pipelined decoder runs, for loads of known lengths.

  Mirrors `pipeline_ticks.decide`: stage 0 visits micro-batch t % W; it runs the next
  pass of the load the micro-batch holds while that load needs more passes, and
  otherwise hands it the next load of the queue (its prefill, pass 0) if one is left;
  stage s at tick t runs what stage 0 ran at t - s. With one load per micro-batch it is
  `early_exit_schedule` up to its last work.

  Args:
    num_stages, num_microbatches: P, M.
    passes: int [L] passes each load runs (1..T: its longest row's length), in queue
      order.

  Returns:
    int32 [ticks, stages, 2] of (microbatch, pass) up to the last stage's last work;
    (-1, -1) marks idle slots.
  """
  passes = np.asarray(passes, np.int64)
  if passes.ndim != 1 or passes.size < 1 or passes.min() < 1:
    raise ValueError(f"passes must give >= 1 passes per load, got {passes.tolist()}")
  width = ring_width(num_stages, num_microbatches)
  load_of = np.full(num_microbatches, -1)
  ran = np.zeros(num_microbatches, np.int64)
  next_load, actions, t = 0, [], 0
  while next_load < passes.size or (
      (load_of >= 0) & (ran < passes[np.maximum(load_of, 0)])).any():
    m = t % width
    action = (BUBBLE, BUBBLE)
    if m < num_microbatches:
      going = load_of[m] >= 0 and ran[m] < passes[load_of[m]]
      if not going and next_load < passes.size:
        load_of[m], ran[m], next_load = next_load, 0, next_load + 1
        going = True
      if going:
        action = (m, ran[m])
        ran[m] += 1
    actions.append(action)
    t += 1
  last = max(i for i, a in enumerate(actions) if a[0] >= 0)
  table = np.full((last + num_stages, num_stages, 2), BUBBLE, np.int32)
  for tick, action in enumerate(actions[:last + 1]):
    for stage in range(num_stages):
      table[tick + stage, stage] = action
  return table


def tick_activity(schedule: np.ndarray) -> np.ndarray:
  """Per tick, how many stages run a prefill (pass 0) and how many a decode pass.

  Returns:
    int [ticks, 2]: (prefilling stages, decoding stages); what a tick costs in lock step.
  """
  schedule = _check_table(schedule)
  step = schedule[..., 1]  # [ticks, stages]
  return np.stack([np.sum(step == 0, axis=1), np.sum(step > 0, axis=1)], axis=-1)


def naive_schedule(num_stages: int, num_microbatches: int,
                   num_passes: int) -> np.ndarray:
  """Baseline without overlap: one (micro-batch, pass) in flight at a time.

  Micro-batches run one after another; each pass walks stage 0..P-1 before the
  next pass starts, so exactly one stage is busy per tick (utilisation 1/P).

  Returns:
    int32 [M*T*P, stages, 2] of (microbatch, pass); (-1, -1) marks idle slots.
  """
  ticks = num_ticks(num_stages, num_microbatches, num_passes, "naive")
  table = np.full((ticks, num_stages, 2), BUBBLE, dtype=np.int32)
  tick = 0
  for microbatch in range(num_microbatches):
    for step in range(num_passes):
      for stage in range(num_stages):
        table[tick, stage] = (microbatch, step)
        tick += 1
  return table


def _check_table(schedule: np.ndarray) -> np.ndarray:
  schedule = np.asarray(schedule)
  if schedule.ndim != 3 or schedule.shape[-1] != 2:
    raise ValueError(
        f"schedule must have shape [ticks, stages, 2], got {schedule.shape}")
  return schedule


def utilization(schedule: np.ndarray) -> float:
  """Busy slots / all (tick, stage) slots."""
  schedule = _check_table(schedule)
  busy = np.count_nonzero(schedule[..., 0] >= 0)
  return float(busy) / float(schedule.shape[0] * schedule.shape[1])


def theoretical_utilization(num_stages: int, num_microbatches: int,
                            num_passes: int) -> float:
  """Closed-form utilisation of the delayed schedule: M*T*P / (P * ticks)."""
  ticks = num_ticks(num_stages, num_microbatches, num_passes, "delayed")
  return (num_microbatches * num_passes * num_stages) / (num_stages * ticks)


class ScheduleError(ValueError):
  """A schedule table breaks completeness or a data dependency."""


def check_dependencies(schedule: np.ndarray) -> None:
  """Verifies a schedule is complete and respects the pipeline's dependencies.

  Checks that every stage processes each (microbatch, pass) of the full
  M x T grid exactly once, that stage s handles (mb, k) strictly after stage s-1
  did (activations flow forward), and that stage 0 handles (mb, k) strictly
  after stage P-1 handled (mb, k-1) (the sampled token came back round the ring).

  Args:
    schedule: int [ticks, stages, 2] as from `delayed_schedule`.

  Raises:
    ScheduleError: describing the first violation found.
  """
  schedule = _check_table(schedule)
  ticks, stages = schedule.shape[:2]
  busy = schedule[..., 0] >= 0
  if not busy.any():
    raise ScheduleError("schedule has no work at all")
  num_mb = int(schedule[..., 0][busy].max()) + 1
  num_passes = int(schedule[..., 1][busy].max()) + 1

  # when[s][mb, k] = tick stage s processes (mb, k).
  when = np.full((stages, num_mb, num_passes), -1, dtype=np.int64)
  for t in range(ticks):
    for s in range(stages):
      mb, k = (int(v) for v in schedule[t, s])
      if mb < 0 and k < 0:
        continue
      if mb < 0 or k < 0:
        raise ScheduleError(f"tick {t} stage {s}: malformed slot ({mb}, {k})")
      if when[s, mb, k] >= 0:
        raise ScheduleError(
            f"stage {s} processes (microbatch {mb}, pass {k}) twice, at ticks"
            f" {when[s, mb, k]} and {t}")
      when[s, mb, k] = t
  missing = np.argwhere(when < 0)
  if missing.size:
    s, mb, k = missing[0]
    raise ScheduleError(
        f"stage {s} never processes (microbatch {mb}, pass {k});"
        f" {len(missing)} slots missing in total")

  for s in range(1, stages):
    bad = np.argwhere(when[s] <= when[s - 1])
    if bad.size:
      mb, k = bad[0]
      raise ScheduleError(
          f"stage {s} handles (microbatch {mb}, pass {k}) at tick"
          f" {when[s, mb, k]}, not after stage {s - 1} (tick {when[s - 1, mb, k]})")
  if num_passes > 1:
    bad = np.argwhere(when[0, :, 1:] <= when[stages - 1, :, :-1])
    if bad.size:
      mb, k = bad[0]
      k += 1
      raise ScheduleError(
          f"stage 0 starts (microbatch {mb}, pass {k}) at tick {when[0, mb, k]}"
          f" before stage {stages - 1} finished pass {k - 1} at tick"
          f" {when[stages - 1, mb, k - 1]}: its token is not back yet")


def draw_schedule(schedule: np.ndarray, path: str | os.PathLike,
                  title: str | None = None) -> str:
  """Renders a schedule as a PNG: ticks on x, stages on y, colour = micro-batch.

  Cells show the pass number when they are large enough to read; idle slots
  are light grey.

  Args:
    schedule: int [ticks, stages, 2].
    path: output .png path (parent dirs are created).
    title: optional figure title.

  Returns:
    The path written, as a string.
  """
  # Figure + Agg canvas directly: no pyplot global state, no backend switching.
  from matplotlib import colormaps
  from matplotlib.backends.backend_agg import FigureCanvasAgg
  from matplotlib.figure import Figure
  from matplotlib.patches import Patch
  from matplotlib.ticker import MaxNLocator

  schedule = _check_table(schedule)
  ticks, stages = schedule.shape[:2]
  microbatch = schedule[..., 0].T  # [stages, ticks]
  step = schedule[..., 1].T  # [stages, ticks]
  num_mb = max(int(microbatch.max()) + 1, 1)
  cmap = colormaps["tab20" if num_mb > 10 else "tab10"]
  colors = np.array([cmap(i % cmap.N)[:3] for i in range(num_mb)])
  image = np.full((stages, ticks, 3), 0.9)
  busy = microbatch >= 0
  image[busy] = colors[microbatch[busy]]

  width = float(np.clip(0.35 * ticks + 2.0, 6.0, 30.0))
  height = float(np.clip(0.45 * stages + 1.5, 2.5, 12.0))
  fig = Figure(figsize=(width, height), dpi=100)
  FigureCanvasAgg(fig)
  ax = fig.add_subplot()
  ax.imshow(image, aspect="auto", interpolation="nearest",
            extent=(-0.5, ticks - 0.5, stages - 0.5, -0.5))
  cell_points = 72.0 * (width - 2.0) / ticks
  if cell_points >= 9.0 and stages <= 32:
    for s, t in zip(*np.nonzero(busy)):
      ax.text(t, s, str(step[s, t]), ha="center", va="center", fontsize=7)
  ax.set_xlabel("tick (cell label = pass)")
  ax.xaxis.set_major_locator(MaxNLocator(integer=True))
  ax.set_ylabel("stage")
  ax.set_yticks(range(stages))
  ax.set_xticks(np.arange(-0.5, ticks, 1.0), minor=True)
  ax.set_yticks(np.arange(-0.5, stages, 1.0), minor=True)
  ax.grid(which="minor", color="white", linewidth=0.5)
  ax.tick_params(which="minor", length=0)
  if num_mb <= 20:
    handles = [Patch(color=colors[i], label=f"mb {i}") for i in range(num_mb)]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0),
              fontsize=7, frameon=False)
  ax.set_title(title or f"utilization {utilization(schedule):.2f}")
  fig.tight_layout()
  path = os.fspath(path)
  parent = os.path.dirname(path)
  if parent:
    os.makedirs(parent, exist_ok=True)
  fig.savefig(path, format="png")
  return path


def validate_pipeline_config(num_layers: int, num_stages: int,
                             num_microbatches: int, batch_size: int,
                             field_prefix: str = "generate") -> None:
  """Checks that pipelined generation can split layers and the batch evenly.

  Args:
    num_layers: transformer layers (split into `num_stages` equal slices).
    num_stages: P, the pipeline mesh axis size.
    num_microbatches: M.
    batch_size: prompts per generation batch (split into M micro-batches).
    field_prefix: config path used in messages, e.g. "stages.generate"; fields
      are reported as f"{field_prefix}.mesh.pipeline", ".num_microbatches",
      ".batch_size".

  Raises:
    ValueError: naming the offending field and how to fix it.
  """
  pipe_field = f"{field_prefix}.mesh.pipeline"
  mb_field = f"{field_prefix}.num_microbatches"
  batch_field = f"{field_prefix}.batch_size"
  if (isinstance(num_stages, bool) or not isinstance(num_stages, (int, np.integer))
      or num_stages < 1):
    raise ValueError(f"{pipe_field} must be a positive int, got {num_stages!r}")
  if num_layers < 1:
    raise ValueError(f"the model has num_layers={num_layers}; it must be >= 1")
  if num_layers % num_stages:
    ok = [d for d in range(1, num_layers + 1) if num_layers % d == 0]
    raise ValueError(
        f"{pipe_field} = {num_stages} does not divide num_layers = {num_layers};"
        f" each stage needs an equal slice of layers, use {pipe_field} in {ok}")
  if (isinstance(num_microbatches, bool) or
      not isinstance(num_microbatches, (int, np.integer)) or num_microbatches < 1):
    raise ValueError(f"{mb_field} must be an int >= 1, got {num_microbatches!r}")
  if batch_size < 1:
    raise ValueError(f"{batch_field} must be >= 1, got {batch_size}")
  if batch_size % num_microbatches:
    ok = [d for d in range(1, batch_size + 1) if batch_size % d == 0]
    raise ValueError(
        f"{batch_field} = {batch_size} is not divisible by {mb_field} ="
        f" {num_microbatches}; pad the batch to a multiple of {num_microbatches}"
        f" or choose {mb_field} dividing the batch (one of {ok})")
