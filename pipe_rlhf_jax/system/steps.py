"""The bookkeeping of a PPO step that every schedule shares: prompts in, a step finished.

Owns `DataFeed` (prompt batches by step, and the source's state before each, which a
checkpoint stores), `BadStepGuard` (stops a run after too many skipped updates; its
counts travel with the checkpoint, so a crash-and-resume loop cannot reset them) and
`finish_step` (what happens after an update, in the thread that owns the trainer state:
staleness metrics, the guard, then the caller's hook that writes metrics and
checkpoints). `system/modes.py` (one process) and `system/pipe_processes.py` (pipe mode
across processes) both run their steps through these.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

import numpy as np

from pipe_rlhf_jax.concurrency.queues import PipelineShutdown

OnStep = Callable[[int, dict], None]


def np_batch(batch: dict) -> dict:
  """Host copy of a data batch (grain may hand out views into reused buffers)."""
  return {k: np.array(v) for k, v in batch.items()}


def check_prompt_ids(batch: dict, vocab_size: int, step: int) -> None:
  """Raises ValueError naming the first prompt token the policy has no embedding row for.

  A tokenizer often holds more ids than the model embeds (tokens added after the model
  was saved); `jnp.take` fills an out-of-range row with NaN, and the step would run on
  without an error, far from the cause.

  Args:
    batch: a prompt batch ({"prompt_tokens": int [batch, prompt_len], "prompt_mask"}).
    vocab_size: rows of the policy's embedding.
    step: the PPO step the batch is for (named in the message).
  """
  tokens = np.asarray(batch["prompt_tokens"])
  mask = np.asarray(batch.get("prompt_mask", np.ones(tokens.shape, bool)), bool)
  bad = mask & ((tokens < 0) | (tokens >= vocab_size))
  if bad.any():
    row, col = (int(i[0]) for i in np.nonzero(bad))
    raise ValueError(
        f"PPO step {step}: prompt row {row} (position {col}) holds token id "
        f"{int(tokens[row, col])}, outside the policy's vocabulary of {vocab_size} ids "
        f"({int(bad.sum())} such tokens in the batch). The tokenizer has ids the model has "
        "no embedding for (added tokens?): use the tokenizer the model was saved with, or "
        "resize the model's embeddings to the tokenizer's size.")


class DataFeed:
  """Prompt batches by step index, remembering the source's state before each one.

  The prompt source is any iterator of batches (the protocol, `system.api.PromptSource`):
  `next()` gives {"prompt_tokens": int32 [batch, prompt_len] left-padded, "prompt_mask":
  bool [batch, prompt_len], "index": int [batch] (global sample ids, which key the
  sampling randomness)}; `get_state()` / `set_state()` are optional and make a run
  resumable. The checkpoint of step k stores the state before batch k + 1 even when the
  generator has already read further ahead. With `vocab_size`, every batch is checked
  for token ids the policy cannot embed (`check_prompt_ids`) as it enters.
  """

  def __init__(self, source, vocab_size: int | None = None):
    self.source = source
    self.vocab_size = vocab_size
    self._resumable = hasattr(source, "get_state")
    self._states: dict[int, dict | None] = {}
    self._lock = threading.Lock()

  def _state(self) -> dict | None:
    return self.source.get_state() if self._resumable else None

  def next(self, step: int) -> dict:
    with self._lock:
      self._states[step] = self._state()
      batch = self._read(f"PPO step {step}")
    if self.vocab_size is not None:
      check_prompt_ids(batch, self.vocab_size, step)
    return batch

  def read(self, count: int) -> dict:
    """The source's next batch without recording a state by step: partial rollouts read
    prompts ahead of and across steps (`stages/rollout_stream.py`) and checkpoint the
    prompts they hold themselves. `count` numbers the reads (for messages)."""
    with self._lock:
      batch = self._read(f"prompt batch {count}")
    if self.vocab_size is not None:
      check_prompt_ids(batch, self.vocab_size, count)
    return batch

  def current_state(self) -> dict | None:
    """The source's state after the batches read so far."""
    with self._lock:
      return self._state()

  def _read(self, what: str) -> dict:
    try:
      return np_batch(next(self.source))
    except StopIteration:
      raise RuntimeError(f"The prompt source ran out before {what}; give an endless (or "
                         "long enough) source.") from None

  def remember(self, step: int, state: dict | None) -> None:
    """Records the source's state before batch `step` as read elsewhere (pipe mode
    across processes: the generating process reads the prompts, the trainer's process
    checkpoints)."""
    with self._lock:
      self._states[step] = state

  def state_before(self, step: int) -> dict | None:
    with self._lock:
      for old in [k for k in self._states if k < step - 8]:
        del self._states[old]
      return self._states.get(step, self._state())


class StopHere(PipelineShutdown):
  """Ends the training worker's loop at an agreed step boundary (a clean exit)."""


class BadStepGuard:
  """Stops the run after `limit` consecutive PPO steps with a skipped update.

  `state()` / `restore()` carry the counts through a checkpoint: a run that crashes on
  bad steps and is resumed continues its streak instead of starting a new one.
  """

  def __init__(self, limit: int):
    self.limit = limit
    self.streak = 0
    self.total = 0

  def check(self, step: int, metrics: dict) -> None:
    bad = metrics.get("bad_updates", 0.0) > 0
    self.total += int(bad)
    self.streak = self.streak + 1 if bad else 0
    metrics["bad_steps_total"] = float(self.total)
    if self.streak >= self.limit:
      raise FloatingPointError(
          f"PPO step {step}: {self.streak} consecutive steps had non-finite losses or "
          f"gradients (updates skipped); stopping. Lower ppo.actor_lr / ppo.critic_lr, or "
          f"raise ppo.max_bad_steps to tolerate more.")

  def state(self) -> dict[str, int]:
    return {"streak": self.streak, "total": self.total}

  def restore(self, state: dict[str, Any] | None) -> None:
    state = state or {}
    self.streak = int(state.get("streak", 0))
    self.total = int(state.get("total", 0))


def finish_step(system, step: int, metrics: dict, on_step: OnStep) -> None:
  """After update `step` (already committed with its version, `PPOSystem.train`): the
  staleness of the batch it trained on, the bad-step guard, then the caller's hook
  (metrics, checkpoint)."""
  # How many updates the trainer was ahead of the policy / critic that made the batch
  # (the version before this update's commit).
  trained_at = system.version - 1
  metrics["staleness/actor"] = float(trained_at - metrics["version/actor"])
  if system.has_critic:
    metrics["staleness/critic"] = float(trained_at - metrics["version/critic"])
  if "version/oldest_token" in metrics:  # partial rollouts: the batch's oldest token
    metrics["staleness/oldest_token"] = float(trained_at - metrics["version/oldest_token"])
  system.guard.check(step, metrics)
  on_step(step, metrics)
