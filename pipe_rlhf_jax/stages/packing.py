"""Packing a padded `[prompt | completion]` batch into rows of real tokens only.

The padded layout (`ppo/types.py`) gives every sequence P + T columns; on real rollouts
most of them are padding, and a forward pass pays for every one. This module plans the
other layout: whole sequences placed side by side in rows of a token budget L (first-fit
decreasing), each a segment of its own (`models.transformer` attends within a segment
only and restarts positions at each), and the gather indices that read the padded
layout's outputs back out of the packed rows. The plan is pure numpy over the host
masks, computed once per batch; the tokens themselves stay on the device and are
gathered there through `PackPlan.source`.

The row count is rounded up to a few sizes per octave (and to the stage's batch ways),
so a run compiles a handful of packed shapes rather than one per batch; so is the count
of real completion tokens, the positions the LM head runs on (`PackPlan.head_index`).

The inference stage packs each batch (`plan_packing`); the training stage packs each
minibatch of an update, all of them to one row count (`plan_minibatches`): the update
scans over its minibatches, so their packed rows must share a shape.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


class PackPlan(NamedTuple):
  """Where every real token of a padded batch goes in packed rows, and back.

  A pytree of int32 arrays (a NamedTuple), so it is placed on a stage like a batch:
  every field is split over its leading dimension.

  Attributes:
    source: [rows, budget] flat index into the padded `[prompt | completion]` tokens
      `[batch * (P + T)]` of the token at each packed column (0 on padding columns).
    positions: [rows, budget] position of each column within its sequence (0 on padding).
    segment_ids: [rows, budget] 1 + the padded row of the sequence a column holds
      (0 = padding).
    completion_rows, completion_cols: [batch, T] the packed (row, column) of the hidden
      state that predicts completion token t of row b, i.e. of the token before it;
      (0, 0) where the completion mask is False (read, then masked out).
    last_rows, last_cols: [batch] the packed (row, column) of each sequence's last real
      token (where a reward model reads its score).
    head_index: [K] flat index (row * budget + column) into the packed rows of the
      state that predicts each real completion token, in (batch row, token) order; 0 on
      the spare entries. The LM head runs on these K states only: not on the prompts'
      columns, the rows' spare columns, or a padded layout's completion padding.
    head_targets: [K] flat index (b * T + t) into the padded completion tokens of the
      token each of those states scores (0 on the spare entries).
    completion_slot: [batch, T] the entry of `head_index` that scores completion token t
      of row b (0 where the completion mask is False: read, then masked out).
  """

  source: np.ndarray
  positions: np.ndarray
  segment_ids: np.ndarray
  completion_rows: np.ndarray
  completion_cols: np.ndarray
  last_rows: np.ndarray
  last_cols: np.ndarray
  head_index: np.ndarray
  head_targets: np.ndarray
  completion_slot: np.ndarray


def round_rows(needed: int, multiple: int = 1) -> int:
  """The row count packed shapes use for `needed` rows: the next of 1, 2, 3, then
  m * 2^k for m in 4..7 (under 25% spare rows, four shapes an octave), rounded up to a
  multiple of `multiple` (the stage's batch ways)."""
  if needed < 1 or multiple < 1:
    raise ValueError(f"round_rows: needed={needed} and multiple={multiple} must be >= 1.")
  rows = needed
  if rows > 3:
    shift = max(rows.bit_length() - 3, 0)  # rows >> shift in 4..7
    rows = -(-rows >> shift) << shift if rows & ((1 << shift) - 1) else rows
  return -(-rows // multiple) * multiple


def _check_layout(prompt_mask: np.ndarray, completion_mask: np.ndarray,
                  field: str) -> tuple[np.ndarray, np.ndarray]:
  """Real-token counts per row, after checking the padded layout's convention: a
  non-empty prompt left-padded, a completion right-padded (a sliding window in columns
  then means the same in both layouts)."""
  prompt_len, completion_len = prompt_mask.shape[1], completion_mask.shape[1]
  prompt_counts = prompt_mask.sum(axis=1)
  completion_counts = completion_mask.sum(axis=1)
  left = np.arange(prompt_len) >= prompt_len - prompt_counts[:, None]
  right = np.arange(completion_len) < completion_counts[:, None]
  bad = np.flatnonzero((left != prompt_mask).any(axis=1) | (right != completion_mask).any(axis=1)
                       | (prompt_counts == 0))
  if bad.size:
    raise ValueError(f"{field}: row {bad[0]} is not a non-empty left-padded prompt followed "
                     "by a right-padded completion; packing needs that layout "
                     "(ppo/types.py).")
  return prompt_counts, completion_counts


def plan_packing(prompt_mask, completion_mask, budget: int, row_multiple: int = 1,
                 field: str = "stages.infer.pack_tokens") -> PackPlan:
  """Packs each row's real tokens into rows of `budget` columns, first-fit decreasing.

  Args:
    prompt_mask: bool [batch, P], left-padded, at least one real token per row.
    completion_mask: bool [batch, T], right-padded (possibly empty or full).
    budget: L, the columns of a packed row; a row holds whole sequences.
    row_multiple: the packed row count is a multiple of this (the stage's batch ways).
    field: the setting `budget` came from, named in errors.

  Returns:
    The plan; its row count is `round_rows` of the rows first-fit needed, at most the
    batch (rounded to `row_multiple`): every sequence fits a row of its own.

  Raises:
    ValueError: a sequence longer than `budget`, or masks not in the padded layout.
  """
  prompt_mask = np.asarray(prompt_mask, bool)
  completion_mask = np.asarray(completion_mask, bool)
  batch, prompt_len = prompt_mask.shape
  completion_len = completion_mask.shape[1]
  if budget < 1:
    raise ValueError(f"{field}={budget}: a packed row needs at least one column.")
  prompt_counts, completion_counts = _check_layout(prompt_mask, completion_mask, field)
  lengths = prompt_counts + completion_counts  # [batch]
  longest = int(lengths.max(initial=0))
  if longest > budget:
    row = int(np.argmax(lengths))
    raise ValueError(f"{field}={budget}: sequence {row} has {longest} real tokens (prompt "
                     f"{prompt_counts[row]} + completion {completion_counts[row]}), more "
                     f"than a packed row holds; set {field} to at least {longest} (the "
                     f"padded width P + T = {prompt_len + completion_len} always fits), or "
                     "0 for the padded layout.")

  # First-fit decreasing: longest first (ties in row order), each into the first row
  # with room.
  free: list[int] = []
  row_of = np.zeros(batch, np.int64)
  start_of = np.zeros(batch, np.int64)
  for b in np.argsort(-lengths, kind="stable"):
    n = int(lengths[b])
    row = next((r for r, room in enumerate(free) if room >= n), len(free))
    if row == len(free):
      free.append(budget)
    row_of[b], start_of[b] = row, budget - free[row]
    free[row] -= n
  rows = min(round_rows(max(len(free), 1), row_multiple),
             -(-batch // row_multiple) * row_multiple)

  width = prompt_len + completion_len
  source = np.zeros((rows, budget), np.int32)
  positions = np.zeros((rows, budget), np.int32)
  segment_ids = np.zeros((rows, budget), np.int32)
  completion_rows = np.zeros((batch, completion_len), np.int32)
  completion_cols = np.zeros((batch, completion_len), np.int32)
  for b in range(batch):
    row, start, n = row_of[b], start_of[b], int(lengths[b])
    first_slot = prompt_len - prompt_counts[b]  # real tokens fill slots [first, first + n)
    cols = slice(start, start + n)
    source[row, cols] = b * width + first_slot + np.arange(n)
    positions[row, cols] = np.arange(n)
    segment_ids[row, cols] = b + 1
    # Completion token t sits at column start + prompt_count + t; the state before it,
    # one column earlier, predicts (and values) it.
    t = np.arange(completion_counts[b])
    completion_rows[b, t] = row
    completion_cols[b, t] = start + prompt_counts[b] + t - 1
  last_rows = row_of.astype(np.int32)
  last_cols = (start_of + lengths - 1).astype(np.int32)
  # The LM head's positions: every real completion token's predicting state, in (b, t)
  # order (a boolean mask's row-major order), rounded up like the rows.
  real = np.arange(completion_len)[None, :] < completion_counts[:, None]  # [batch, T]
  count = int(real.sum())
  head_index = np.zeros(round_rows(max(count, 1), row_multiple), np.int32)
  head_targets = np.zeros_like(head_index)
  head_index[:count] = (completion_rows * budget + completion_cols)[real]
  head_targets[:count] = np.flatnonzero(real)
  completion_slot = np.zeros((batch, completion_len), np.int32)
  completion_slot[real] = np.arange(count)
  return PackPlan(source, positions, segment_ids, completion_rows, completion_cols,
                  last_rows, last_cols, head_index, head_targets, completion_slot)


def pad_rows(plan: PackPlan, rows: int) -> PackPlan:
  """`plan` with empty rows (all padding: segment 0) appended up to `rows` rows; the
  gathers are unchanged, as no sequence moves."""
  extra = rows - plan.source.shape[0]
  if extra < 0:
    raise ValueError(f"pad_rows: the plan has {plan.source.shape[0]} rows, more than {rows}.")
  pad = lambda x: np.pad(x, ((0, extra), (0, 0)))
  return plan._replace(source=pad(plan.source), positions=pad(plan.positions),
                       segment_ids=pad(plan.segment_ids))


def pad_head(plan: PackPlan, entries: int) -> PackPlan:
  """`plan` with spare LM-head entries appended up to `entries` (index 0, never read)."""
  extra = entries - plan.head_index.shape[0]
  if extra < 0:
    raise ValueError(f"pad_head: the plan has {plan.head_index.shape[0]} head entries, "
                     f"more than {entries}.")
  pad = lambda x: np.pad(x, (0, extra))
  return plan._replace(head_index=pad(plan.head_index), head_targets=pad(plan.head_targets))


def plan_minibatches(prompt_mask, completion_mask, index, budget: int,
                     row_multiple: int = 1,
                     field: str = "stages.train.pack_tokens") -> PackPlan:
  """One plan per minibatch of an update, all with the same row count.

  Args:
    prompt_mask: bool [batch, P]; completion_mask: bool [batch, T]: the whole batch.
    index: int [..., minibatch]: the batch rows of each minibatch, in the order the
      update gathers them (`x[index]`); the leading dims are the update's (epochs,
      minibatches).
    budget, row_multiple, field: as `plan_packing`.

  Returns:
    A `PackPlan` whose fields carry `index`'s leading dims: [..., rows, budget] and
    [..., minibatch, T] / [..., minibatch], each minibatch's plan made for its own rows
    in `index` order. `rows` is the largest row count a minibatch needs: each plan's is
    one of `round_rows`' sizes (or the minibatch, rounded to `row_multiple`), so their
    largest is too, and the packed shape is a few sizes an octave across updates; the
    LM head's entries likewise.
  """
  prompt_mask = np.asarray(prompt_mask, bool)
  completion_mask = np.asarray(completion_mask, bool)
  index = np.asarray(index)
  lead = index.shape[:-1]
  plans = [plan_packing(prompt_mask[rows], completion_mask[rows], budget, row_multiple, field)
           for rows in index.reshape(-1, index.shape[-1])]
  rows = max(p.source.shape[0] for p in plans)
  entries = max(p.head_index.shape[0] for p in plans)
  plans = [pad_head(pad_rows(p, rows), entries) for p in plans]
  return PackPlan(*(np.stack(fields).reshape(lead + fields[0].shape)
                    for fields in zip(*plans)))


def occupancy(plan: PackPlan) -> float:
  """The fraction of packed columns that hold a real token."""
  return float(np.mean(np.asarray(plan.segment_ids) != 0))
