"""Host-side timeline tracing for concurrently running stage workers.

Owns: the `Span` record, the thread-safe `Tracer` that collects spans from any
thread, and the derived views of a run: Chrome/Perfetto trace JSON, a Gantt PNG (one
row per stage), per-stage busy fractions and pairwise overlap, and the measured steady
seconds per PPO step (`steady_step_time`, from when each batch's update ended). The busy
and overlap views are how the asynchronous system proves that stages really ran at the
same time rather than taking turns.

A stage may also record *lanes* inside its spans (`Tracer.add_lane`): rows under the
stage's own in the Chrome trace, such as the generation engine's slots, each bar one
completion decoding. Lanes are drawn only in the trace: the stage accounting (busy
fractions, overlaps, the summary, the Gantt chart) reads spans alone.

Times are `time.perf_counter()` seconds measured from the tracer's origin, so
spans from different threads share one clock.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import threading
import time
from typing import Any, Iterator, Sequence

Interval = tuple[float, float]


@dataclasses.dataclass(frozen=True)
class Span:
  """One timed piece of work of a stage.

  Attributes:
    stage: Stage (row) name, e.g. "generate"; also the span's display name.
    start: Start time in seconds relative to the tracer origin.
    end: End time in seconds relative to the tracer origin (>= start).
    batch: Rollout batch index the work belongs to, if any.
    version: Policy weight version used or produced, if any.
    thread: Name of the thread (worker) that recorded the span.
    args: Extra JSON-friendly key/values shown in trace viewers.
  """

  stage: str
  start: float
  end: float
  batch: int | None = None
  version: int | None = None
  thread: str = ""
  args: dict[str, Any] = dataclasses.field(default_factory=dict)

  @property
  def name(self) -> str:
    """Alias of `stage` (trace viewers call it the event name)."""
    return self.stage

  @property
  def duration(self) -> float:
    """Span length in seconds."""
    return self.end - self.start


def _union(intervals: Sequence[Interval]) -> list[Interval]:
  """Merges overlapping intervals into a sorted disjoint list."""
  merged: list[list[float]] = []
  for lo, hi in sorted(intervals):
    if hi <= lo:
      continue
    if merged and lo <= merged[-1][1]:
      merged[-1][1] = max(merged[-1][1], hi)
    else:
      merged.append([lo, hi])
  return [(lo, hi) for lo, hi in merged]


def _length(intervals: Sequence[Interval]) -> float:
  return sum(hi - lo for lo, hi in intervals)


def _intersect(a: Sequence[Interval], b: Sequence[Interval]) -> list[Interval]:
  """Intersection of two sorted disjoint interval lists (two-pointer sweep)."""
  out: list[Interval] = []
  i = j = 0
  while i < len(a) and j < len(b):
    lo = max(a[i][0], b[j][0])
    hi = min(a[i][1], b[j][1])
    if hi > lo:
      out.append((lo, hi))
    # Advance whichever interval ends first; the other may still overlap more.
    if a[i][1] < b[j][1]:
      i += 1
    else:
      j += 1
  return out


def _jsonable(value: Any) -> Any:
  """Best-effort conversion so trace args never break json.dump."""
  if value is None or isinstance(value, (bool, int, float, str)):
    return value
  if isinstance(value, (list, tuple)):
    return [_jsonable(v) for v in value]
  if isinstance(value, dict):
    return {str(k): _jsonable(v) for k, v in value.items()}
  try:  # numpy / jax scalars
    return value.item()
  except Exception:  # pylint: disable=broad-except
    return repr(value)


class Tracer:
  """Thread-safe collector of stage spans.

  Usage:
    tracer = Tracer()
    with tracer.span("generate", batch=3, version=1, tokens=512):
      ...

  Args:
    enabled: When False every method is a cheap no-op and nothing is stored.
    origin: `time.perf_counter()` value that maps to t=0; defaults to now.
  """

  def __init__(self, enabled: bool = True, origin: float | None = None):
    self.enabled = enabled
    self.origin = time.perf_counter() if origin is None else origin
    self._lock = threading.Lock()
    self._spans: list[Span] = []
    # Spans entered and not yet left: what each stage is working on right now (the
    # progress watchdog names the one that has held its item longest).
    self._open: dict[int, tuple[str, int | None, float, str]] = {}
    self._lanes: list[tuple[str, str, Span]] = []  # (stage, lane, bar)

  def now(self) -> float:
    """Current time in tracer coordinates (seconds since origin)."""
    return time.perf_counter() - self.origin

  @contextlib.contextmanager
  def span(
      self,
      stage: str,
      batch: int | None = None,
      version: int | None = None,
      **args: Any,
  ) -> Iterator[dict[str, Any]]:
    """Times the enclosed block as one span of `stage`.

    The span is recorded even if the block raises (with `args["error"]` set to
    the exception type), so a failing stage still shows up on the timeline.

    Args:
      stage: Row name.
      batch: Rollout batch index, if any.
      version: Weight version, if any.
      **args: Extra annotations.

    Yields:
      The mutable args dict, so the block can add results (e.g. a loss).
    """
    if not self.enabled:
      yield dict(args)
      return
    start = self.now()
    token = object()
    with self._lock:
      self._open[id(token)] = (stage, batch, start, threading.current_thread().name)
    try:
      yield args
    except BaseException as e:
      args["error"] = type(e).__name__
      raise
    finally:
      with self._lock:
        del self._open[id(token)]
      self.add(stage, start, self.now(), batch=batch, version=version, **args)

  def open_spans(self) -> list[tuple[str, int | None, float, str]]:
    """(stage, batch, seconds inside, thread) of every span not yet ended, longest first."""
    now = self.now()
    with self._lock:
      spans = list(self._open.values())
    return sorted(((stage, batch, now - start, thread) for stage, batch, start, thread
                   in spans), key=lambda s: -s[2])

  def add(
      self,
      stage: str,
      start: float,
      end: float,
      batch: int | None = None,
      version: int | None = None,
      thread: str | None = None,
      **args: Any,
  ) -> Span | None:
    """Records an already-timed span (tracer-relative seconds).

    Args:
      stage: Row name.
      start: Start, seconds since origin.
      end: End, seconds since origin; must be >= start.
      batch: Rollout batch index, if any.
      version: Weight version, if any.
      thread: Recording thread name; defaults to the calling thread's.
      **args: Extra annotations.

    Returns:
      The stored span, or None when the tracer is disabled.

    Raises:
      ValueError: if `end < start` or `stage` is empty.
    """
    if not self.enabled:
      return None
    if not stage:
      raise ValueError("Tracer.add: `stage` must be a non-empty string.")
    if end < start:
      raise ValueError(
          f"Tracer.add: span {stage!r} ends before it starts "
          f"(start={start}, end={end}); pass tracer-relative times."
      )
    span = Span(
        stage=str(stage),
        start=float(start),
        end=float(end),
        batch=None if batch is None else int(batch),
        version=None if version is None else int(version),
        thread=threading.current_thread().name if thread is None else thread,
        args=dict(args),
    )
    with self._lock:
      self._spans.append(span)
    return span

  def add_lane(self, stage: str, lane: str, start: float, end: float,
               batch: int | None = None, **args: Any) -> None:
    """Records one bar of `lane`, a row under `stage`'s in the Chrome trace.

    Args:
      stage: The stage the lane belongs to (its spans enclose the bars).
      lane: The lane's name within the stage, e.g. "slot 3".
      start, end: Tracer-relative seconds, end >= start.
      batch: Rollout batch index, if any.
      **args: Annotations shown in trace viewers.
    """
    if not self.enabled:
      return
    if end < start:
      raise ValueError(f"Tracer.add_lane: {stage} {lane} ends before it starts "
                       f"(start={start}, end={end}).")
    bar = Span(stage=f"{stage} {lane}", start=float(start), end=float(end),
               batch=None if batch is None else int(batch),
               thread=threading.current_thread().name, args=dict(args))
    with self._lock:
      self._lanes.append((stage, lane, bar))

  def lanes(self, stage: str | None = None) -> list[tuple[str, str, Span]]:
    """(stage, lane, bar) of every recorded lane bar, sorted by start."""
    with self._lock:
      out = list(self._lanes)
    return sorted((x for x in out if stage is None or x[0] == stage),
                  key=lambda x: (x[2].start, x[1]))

  def spans(self, stage: str | None = None) -> list[Span]:
    """Snapshot of recorded spans sorted by start, optionally of one stage."""
    with self._lock:
      out = list(self._spans)
    if stage is not None:
      out = [s for s in out if s.stage == stage]
    return sorted(out, key=lambda s: (s.start, s.end))

  def clear(self) -> None:
    """Drops all recorded spans (origin is kept)."""
    with self._lock:
      self._spans.clear()
      self._lanes.clear()

  def stages(self) -> list[str]:
    """Stage names ordered by their first span's start."""
    order: dict[str, None] = {}
    for s in self.spans():
      order.setdefault(s.stage, None)
    return list(order)

  def window(self) -> Interval:
    """(first start, last end) over all spans; (0, 0) when empty."""
    spans = self.spans()
    if not spans:
      return (0.0, 0.0)
    return (min(s.start for s in spans), max(s.end for s in spans))

  def _busy(self, stage: str, window: Interval | None = None) -> list[Interval]:
    intervals = _union([(s.start, s.end) for s in self.spans(stage)])
    if window is not None:
      intervals = _intersect(intervals, [window])
    return intervals

  def busy_fraction(self, window: Interval | None = None) -> dict[str, float]:
    """Fraction of the wall window each stage had at least one span open.

    Args:
      window: (start, end) in tracer seconds; defaults to `self.window()`.

    Returns:
      {stage: busy seconds / window length}; 0.0 for an empty window.
    """
    lo, hi = self.window() if window is None else window
    length = hi - lo
    return {
        stage: (_length(self._busy(stage, (lo, hi))) / length if length > 0 else 0.0)
        for stage in self.stages()
    }

  def overlap(self, stage_a: str, stage_b: str, window: Interval | None = None) -> float:
    """Seconds during which both stages were busy at the same time (within `window`)."""
    return _length(_intersect(self._busy(stage_a, window), self._busy(stage_b, window)))

  def summary(self) -> dict[str, Any]:
    """Per-stage counts and timing plus pairwise overlaps.

    Returns:
      {"wall_s": float, "stages": {stage: {"count", "busy_s", "busy_fraction",
      "mean_s", "max_s"}}, "overlap_s": {"a|b": seconds}}.
    """
    lo, hi = self.window()
    fractions = self.busy_fraction()
    stages = self.stages()
    per_stage = {}
    for stage in stages:
      durations = [s.duration for s in self.spans(stage)]
      per_stage[stage] = {
          "count": len(durations),
          "busy_s": _length(self._busy(stage)),
          "busy_fraction": fractions[stage],
          "mean_s": sum(durations) / len(durations),
          "max_s": max(durations),
      }
    overlaps = {
        f"{a}|{b}": self.overlap(a, b)
        for i, a in enumerate(stages)
        for b in stages[i + 1:]
    }
    return {"wall_s": hi - lo, "stages": per_stage, "overlap_s": overlaps}

  def to_chrome_trace(self, path: str | os.PathLike[str]) -> str:
    """Writes Chrome / Perfetto trace-event JSON (open in ui.perfetto.dev).

    Each stage gets its own tid (named via thread_name metadata) so every
    stage is one timeline row, and each of its lanes a row just below it; spans are
    complete ("X") events in microseconds.

    Args:
      path: Output file; parent directories are created.

    Returns:
      The path written, as a string.
    """
    lanes = self.lanes()
    rows: list[tuple[str, str]] = []  # (row name, category), a stage before its lanes
    for stage in self.stages():
      rows.append((stage, stage))
      names = sorted({lane for st, lane, _ in lanes if st == stage},
                     key=lambda n: (len(n), n))  # "slot 2" before "slot 10"
      rows += [(f"{stage} {lane}", stage) for lane in names]
    tids = {name: i + 1 for i, (name, _) in enumerate(rows)}
    events: list[dict[str, Any]] = [{
        "name": "process_name", "ph": "M", "pid": 0, "tid": 0,
        "args": {"name": "pipe_rlhf_jax"},
    }]
    for name, tid in tids.items():
      events.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": tid,
                     "args": {"name": name}})
      events.append({"name": "thread_sort_index", "ph": "M", "pid": 0,
                     "tid": tid, "args": {"sort_index": tid}})
    bars = [(s.stage, s) for s in self.spans()]
    bars += [(stage, bar) for stage, _, bar in lanes if bar.stage in tids]
    for category, s in bars:
      label = s.stage if s.batch is None else f"{s.stage} b{s.batch}"
      events.append({
          "name": label,
          "cat": category,
          "ph": "X",
          "pid": 0,
          "tid": tids[s.stage],
          "ts": s.start * 1e6,
          "dur": s.duration * 1e6,
          "args": _jsonable({"batch": s.batch, "version": s.version,
                             "thread": s.thread, **s.args}),
      })
    path = os.fspath(path)
    parent = os.path.dirname(path)
    if parent:
      os.makedirs(parent, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
      json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)
    return path

  def gantt(self, path: str | os.PathLike[str], title: str | None = None) -> str:
    """Draws a PNG Gantt chart: one row per stage, bars coloured by batch.

    Uses the Agg canvas directly (no pyplot global state), so it is safe to
    call from any thread and needs no display.

    Args:
      path: Output PNG file; parent directories are created.
      title: Optional figure title.

    Returns:
      The path written, as a string.
    """
    # Imported lazily: matplotlib is slow to import and only needed here.
    from matplotlib import colormaps
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    spans = self.spans()
    stages = self.stages()
    rows = {stage: i for i, stage in enumerate(stages)}
    lo, hi = self.window()
    wall = max(hi - lo, 1e-9)
    cmap = colormaps["tab10"]

    fig = Figure(figsize=(10, 1.0 + 0.6 * max(len(stages), 1)), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    for s in spans:
      colour = "0.6" if s.batch is None else cmap(s.batch % 10)
      y = rows[s.stage]
      ax.barh(y, s.duration, left=s.start, height=0.6, color=colour,
              edgecolor="black", linewidth=0.5)
      # Only label bars wide enough to hold text legibly.
      if s.duration / wall > 0.03 and (s.batch is not None or s.version is not None):
        parts = []
        if s.batch is not None:
          parts.append(f"b{s.batch}")
        if s.version is not None:
          parts.append(f"v{s.version}")
        ax.text(s.start + s.duration / 2, y, "/".join(parts), ha="center",
                va="center", fontsize=7)
    ax.set_yticks(range(len(stages)))
    ax.set_yticklabels(stages)
    ax.invert_yaxis()
    ax.set_xlabel("time (s)")
    if spans:
      ax.set_xlim(lo, hi)
    if title:
      ax.set_title(title)
    fig.tight_layout()
    path = os.fspath(path)
    parent = os.path.dirname(path)
    if parent:
      os.makedirs(parent, exist_ok=True)
    fig.savefig(path, format="png")
    return path


def completion_times(tracer) -> list[float]:
  """When each traced batch finished: the end of its last train / sync span (seconds)."""
  ends: dict[int, float] = {}
  for span in tracer.spans():
    if span.batch is not None and span.stage in ("train", "sync"):
      ends[span.batch] = max(ends.get(span.batch, 0.0), span.end)
  return [ends[k] for k in sorted(ends)]


def steady_step_time(tracer, warmup: int = 2) -> float | None:
  """Measured steady seconds per step: the mean gap between batch completions after the
  first `warmup` (compilation), fewer when the run is short; None below 2 batches."""
  done = completion_times(tracer)
  if len(done) < 2:
    return None
  skip = min(warmup, len(done) - 2)
  return (done[-1] - done[skip]) / (len(done) - 1 - skip)
