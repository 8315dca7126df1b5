"""The library entry point: run PPO steps of a `PPOSystem` on any prompt source.

The main job (`pipe_rlhf_jax.train`) adds SFT, the reward model, data
building, checkpoints and reports around this; a researcher who has their own models,
reward and prompts needs only:

  models = Models.from_policy(hf.from_pretrained(path, dtype=jnp.bfloat16))
  system = PPOSystem(models, ppo=PPOSettings(...), sampling=SamplingSettings(...),
                     plan=Plan(mode="pipe", ...), reward_fn=my_rule,
                     decode=tokenizer.decode)
  result = run(system, prompts_from_texts(texts, tokenizer, ...), steps=100)
  result.metrics   # one dict per PPO step;  result.tracer.gantt("gantt.png")

The prompt-source protocol (`PromptSource`): an iterator of batches, each a dict of numpy
arrays {"prompt_tokens": int32 [batch, prompt_len], LEFT-padded; "prompt_mask": bool
[batch, prompt_len]; "index": int [batch], a global id per sample that keys its sampling
randomness; optionally "answer_bytes": uint8 [batch, A], each prompt's reference answer
(`ppo.types.encode_answers`), handed to rule rewards that take `answers`}. `batch` must
equal `PPOSettings.prompts_per_step` (= `batch_size` / `group_size`: each prompt is
sampled `group_size` times). A source that also has
`get_state() -> dict` and `set_state(dict)` can be checkpointed and resumed exactly
(`data.loaders.PromptLoader` is one, over TFDS or any list of {"prompt": text}).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterator, Protocol, Sequence, runtime_checkable

import numpy as np

from pipe_rlhf_jax import host_devices
from pipe_rlhf_jax.concurrency.tracing import Tracer
from pipe_rlhf_jax.system import modes
from pipe_rlhf_jax.system.steps import DataFeed
from pipe_rlhf_jax.system.system import PPOSystem

# The speed the benchmarks measure is the library's default: XLA's CPU compiler gets its
# memory-minimising scheduler here as in the command-line entry points, unless jax has
# already started (it then has read its flags) or XLA_FLAGS choose (`host_devices`).
# Importing the modules above starts no backend.
host_devices.use_memory_lean_scheduler_by_default()


@runtime_checkable
class PromptSource(Protocol):
  """Batches of left-padded prompts (see the module docstring for the arrays)."""

  def __next__(self) -> dict[str, np.ndarray]: ...


def prompts_from_texts(texts: Sequence[str], tokenizer, batch_size: int, prompt_len: int,
                       seed: int = 0, shuffle: bool = True):
  """An endless, resumable prompt source over in-memory strings.

  Each epoch is a fresh shuffle (`seed` + epoch); over-long prompts are truncated to
  `prompt_len` tokens (BOS first when the tokenizer has one).
  """
  from pipe_rlhf_jax.data.loaders import PromptLoader
  if len(texts) < batch_size:
    raise ValueError(f"{len(texts)} prompts cannot fill one batch of {batch_size}; give "
                     "more prompts or a smaller batch_size.")
  return PromptLoader([{"prompt": t} for t in texts], tokenizer, batch_size, prompt_len,
                        seed, shuffle=shuffle, name="prompts_from_texts")


@dataclasses.dataclass
class RunResult:
  """What `run` returns.

  Attributes:
    metrics: one dict of floats per PPO step, in step order (keys documented in
      docs/algorithms.md, "What a PPO step logs").
    tracer: the stage spans (`to_chrome_trace(path)`, `gantt(path)`, `busy_fraction()`).
    data_state: the prompt source's state before the next unconsumed batch (None when
      the source has no `get_state`), to checkpoint with `system.checkpoint_state()`.
  """

  metrics: list[dict[str, float]]
  tracer: Tracer
  data_state: dict | None


def run(system: PPOSystem, prompts: Iterator[dict], steps: int, *,
        on_step: Callable[[int, dict], None] | None = None,
        tracer: Tracer | None = None) -> RunResult:
  """Runs `steps` PPO steps after the system's current version, in its mode.

  Args:
    system: the PPO system (its version counts the updates applied so far).
    prompts: a `PromptSource`.
    steps: how many PPO updates to apply.
    on_step: called as `on_step(step, metrics)` after each update, from the thread
      that owns the trainer state (where a checkpoint may be written).
    tracer: where spans are recorded (default: a new one).
  """
  if not isinstance(prompts, PromptSource):
    raise TypeError(f"prompts must be an iterator of batches (a PromptSource), got "
                    f"{type(prompts).__name__}; wrap a list of strings with "
                    "prompts_from_texts(texts, tokenizer, batch_size, prompt_len).")
  if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
    raise ValueError(f"steps={steps!r} must be an integer >= 1.")
  tracer = tracer or Tracer()
  records: list[dict[str, float]] = []

  def record(step: int, metrics: dict) -> None:
    records.append(metrics)
    if on_step is not None:
      on_step(step, metrics)

  start = system.version
  feed = DataFeed(prompts, vocab_size=system.vocab_size)
  modes.run(system, feed, start, start + steps, record, tracer)
  return RunResult(metrics=records, tracer=tracer,
                   data_state=feed.state_before(start + steps))
