"""The slot engine's schedule as a pure function of known completion lengths.

This module owns what every slot does at every decode step, for the continuous-batching
engine (`simulate`, mirroring `engine._run`'s admission rule) and for static batches
(`static_timeline`), and the picture of both (`draw_timelines`). No model runs here: the
tests hold the engine to these schedules exactly, the planner prices a length
distribution with them (`planner/cost.py`), and the benchmark predicts its seconds.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np

from pipe_rlhf_jax.generation.engine import FREE, EngineSpec


@dataclasses.dataclass(frozen=True)
class SlotTimeline:
  """What every slot does at every decode step, as the engine schedules it.

  Attributes:
    rows: int [decode_steps, S]: the completion each slot decodes at each step (FREE
      when idle); a completion's first token comes from its admission's prefill.
    admissions: per decode step, the prompts admitted just before it (0: none).
    prefill_widths: every admission's width, in order (including any that no decode
      step follows: a queue ending in one-token completions).
  """

  rows: np.ndarray
  admissions: tuple[int, ...]
  prefill_widths: tuple[int, ...]

  @property
  def decode_steps(self) -> int:
    return int(self.rows.shape[0])

  @property
  def busy_slot_steps(self) -> int:
    return int((self.rows != FREE).sum())

  def peak_paged_columns(self, prompt_len: int, page: int) -> int:
    """The most KV-cache columns a paged cache would hold at one decode step: every busy
    slot's prompt and tokens so far, in whole pages of `page` columns, a finished row's
    pages freed at once (a contiguous cache holds S x (P + T) columns throughout)."""
    if not self.busy_slot_steps:
      return 0
    busy = self.rows != FREE
    step = np.broadcast_to(np.arange(self.decode_steps)[:, None], self.rows.shape)
    first = np.full(int(self.rows.max()) + 1, self.decode_steps, np.int64)
    np.minimum.at(first, self.rows[busy], step[busy])
    # At its j-th decode step a completion holds its P prompt columns, its first token's
    # (from the prefill) and the j tokens written since.
    held = prompt_len + 1 + step - first[np.maximum(self.rows, 0)]  # [steps, S]
    pages = np.where(busy, -(-held // page), 0)
    return int(pages.sum(axis=1).max()) * page

  @property
  def occupancy(self) -> float:
    """Busy slot-steps over all slot-steps of the decode."""
    return self.busy_slot_steps / max(self.rows.size, 1)


def simulate(lengths, spec: EngineSpec, prompt_len: int = 0) -> SlotTimeline:
  """The engine's schedule for completions of known lengths (a pure function).

  Mirrors `engine._run`'s admission rule (widest allowed width, free slots in index order,
  a completion of length 1 ends at its prefill) so that the tests can check the engine
  against it and the planner can price a length distribution without running a model.
  With `spec.prefill_chunk`, an admission's passes (`EngineSpec.chunk_starts`) each but
  the last are followed by one decode step of the decoding slots, and its prompts take
  their slots (the free ones then, in index order) after the last pass.

  Args:
    lengths: int [Q * n] completion lengths (>= 1), completion k being sample k % n of
      prompt k // n.
    spec: slot count, group size, admission widths and prefill chunk.
    prompt_len: P, the prompt columns (needed with `spec.prefill_chunk`).
  """
  lengths = np.asarray(lengths, np.int64)
  n, slots = spec.group_size, spec.num_slots
  if lengths.ndim != 1 or lengths.size % n or (lengths < 1).any():
    raise ValueError(f"lengths must be {n} per prompt, each >= 1; got shape "
                     f"{lengths.shape}, min {lengths.min() if lengths.size else None}")
  if spec.prefill_chunk and prompt_len < 1:
    raise ValueError("simulate needs prompt_len (the prompt columns) when the spec "
                     f"prefills in chunks (prefill_chunk={spec.prefill_chunk})")
  passes = len(spec.chunk_starts(prompt_len))
  num_prompts = lengths.size // n
  row = np.full(slots, FREE, np.int64)
  emitted = np.zeros(slots, np.int64)
  next_prompt, timeline, admissions, widths = 0, [], [], []
  pending = 0

  def decode_step():
    nonlocal pending
    timeline.append(row.copy())
    admissions.append(pending)
    pending = 0
    busy = row != FREE
    emitted[busy] += 1
    row[busy & (emitted >= lengths[np.maximum(row, 0)])] = FREE

  while (row != FREE).any() or next_prompt < num_prompts:
    while True:  # admissions, while one is due
      free = np.flatnonzero(row == FREE)
      left = num_prompts - next_prompt
      room = min(len(free) // n, left)
      floor = spec.floor if (row != FREE).any() and left >= spec.floor else 1
      if room < floor or room == 0:
        break
      width = max(w for w in spec.widths if w <= room)
      for _ in range(passes - 1):  # the decoding slots step between two passes
        if (row != FREE).any():
          decode_step()
      pending += width
      widths.append(width)
      for j, slot in enumerate(np.flatnonzero(row == FREE)[:width * n]):
        k = (next_prompt + j // n) * n + j % n
        row[slot], emitted[slot] = (k if lengths[k] > 1 else FREE), 1
      next_prompt += width
    if (row != FREE).any():
      decode_step()
  rows = np.stack(timeline) if timeline else np.zeros((0, slots), np.int64)
  return SlotTimeline(rows=rows, admissions=tuple(admissions), prefill_widths=tuple(widths))


def static_timeline(lengths, batch_rows: int) -> SlotTimeline:
  """The static sampler's schedule over the same queue, in consecutive batches of
  `batch_rows` rows: each batch decodes until its longest row ends, a finished row
  holding its slot idle (its first token comes from the batch's prefill)."""
  lengths = np.asarray(lengths, np.int64)
  blocks, admissions, widths = [], [], []
  for start in range(0, lengths.size, batch_rows):
    chunk = lengths[start:start + batch_rows]
    steps = int(chunk.max()) - 1
    widths.append(len(chunk))
    if steps == 0:
      continue
    ids = np.full((steps, batch_rows), FREE, np.int64)
    step = np.arange(steps)[:, None]
    live = step < chunk[None, :] - 1  # [steps, rows]: token step + 1 still to decode
    ids[:, :len(chunk)] = np.where(live, start + np.arange(len(chunk))[None, :], FREE)
    blocks.append(ids)
    admissions += [len(chunk)] + [0] * (steps - 1)
  rows = np.concatenate(blocks) if blocks else np.zeros((0, batch_rows), np.int64)
  return SlotTimeline(rows=rows, admissions=tuple(admissions), prefill_widths=tuple(widths))


def draw_timelines(timelines: dict[str, SlotTimeline], path: str | os.PathLike,
                   title: str | None = None) -> str:
  """Renders slot timelines as one PNG, a panel each: decode steps on x, slots on y,
  colour = the completion a slot decodes, white = an idle slot-step; a tick on top marks
  each admission (prefill). Returns the path written."""
  from matplotlib import colormaps
  from matplotlib.backends.backend_agg import FigureCanvasAgg
  from matplotlib.figure import Figure

  longest = max(t.decode_steps for t in timelines.values())
  fig = Figure(figsize=(float(np.clip(0.06 * longest + 3, 8, 24)),
                        1.2 + 1.9 * len(timelines)), dpi=100)
  FigureCanvasAgg(fig)
  cmap = colormaps["tab20"]
  axes = fig.subplots(len(timelines), 1, squeeze=False)[:, 0]
  for ax, (name, t) in zip(axes, timelines.items()):
    rows = t.rows.T  # [slots, steps]
    image = np.ones(rows.shape + (3,))
    busy = rows != FREE
    image[busy] = np.array([cmap(i % cmap.N)[:3] for i in range(20)])[rows[busy] % 20]
    ax.imshow(image, aspect="auto", interpolation="nearest",
              extent=(-0.5, t.decode_steps - 0.5, rows.shape[0] - 0.5, -0.5))
    ax.set_xlim(-0.5, longest - 0.5)
    steps = [i for i, w in enumerate(t.admissions) if w]
    ax.plot(steps, [-0.5] * len(steps), "v", color="black", markersize=4, clip_on=False)
    ax.set_ylabel("slot")
    ax.set_title(f"{name}: {t.decode_steps} decode steps, occupancy {t.occupancy:.2f}",
                 fontsize=10)
  axes[-1].set_xlabel("decode step")
  if title:
    fig.suptitle(title)
  fig.tight_layout()
  os.makedirs(os.path.dirname(os.path.abspath(path)) or ".", exist_ok=True)
  fig.savefig(path)
  return str(path)
