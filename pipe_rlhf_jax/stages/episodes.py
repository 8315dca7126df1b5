"""Multi-turn episodes: the policy's turns and an environment's replies, as rollout rows.

Owns the episode loop (`EpisodeRunner`) and the generation stage that runs it
(`EpisodeStage`, what `PPOSystem` builds instead of a `GenerateStage` when `env.name` is
set), so that every mode (`sequential`, `per_stage`, `pipe`, `pipe` across processes)
runs episodes through its one generation step.

An episode is one row of the rollout: the prompt, then every token after it in order,
the policy's turns as the ids the engine sampled and the environment's messages as the
ids its chat template renders between turns (`envs/render.py`: token in, token out,
nothing re-tokenised). `completion_mask` covers them all (everything is attended);
`policy_mask` marks the sampled ones, the only ones with behaviour log-probs and the
only ones the loss, the KL and the advantages read; `env_scores` is the episode's
reward as its environment gave it.

The loop runs turn by turn over the batch. Turn 0 samples the prompts (a group's
samples share one prefill, as one-turn rollouts do). After each turn the environment
answers every episode that is still running, all at once on host threads, each call
bounded by `env.tool_timeout_s` (`envs/tools.py`); each following turn samples every
running episode from its whole context, the prompt and the row so far, as a new prompt.
So an episode waiting on its tool holds no slot and no KV cache: its context is
prefilled again when it continues. (Keeping each row's cache across the tool call would
save that prefill, a fraction of a turn's decode at these lengths, and would hold S x
(P + T) cache columns for rows that wait.) A turn's tokens are drawn with keys of its
own (the step's key folded with the turn index) and the episode's sample id, so an
episode is a function of the weights, its prompt, its key and its environment.

An episode ends when the environment answers None ("done"), when it reached
`env.max_turns` ("max_turns"), when a turn ran out of tokens without its EOS
("turn_length"), when the next message would not leave a token for another turn
("token_budget"), past `env.episode_timeout_s` ("wall_time"), or when an environment
call raised ("tool_error") or ran out of time ("tool_timeout"). The reward is the
environment's `reward` of its turns, except after a failed call: `env.failure_reward`.
The reasons are counted in the metrics (`env/end/<reason>`).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

from pipe_rlhf_jax.distributed.arrays import fetch
from pipe_rlhf_jax.envs import tools
from pipe_rlhf_jax.envs.base import Environment, EnvSettings, Reply, Turn
from pipe_rlhf_jax.envs.render import TurnRenderer
from pipe_rlhf_jax.generation import sampler
from pipe_rlhf_jax.ppo.types import Rollout, decode_answers
from pipe_rlhf_jax.stages.common import StageLayout
from pipe_rlhf_jax.stages.generate import GenerateStage, repeat_for_groups

END_REASONS = ("done", "max_turns", "turn_length", "token_budget", "wall_time",
               tools.ERROR, tools.TIMEOUT)

# (tokens, logprobs, mask) host arrays [rows, turn_tokens]: one turn of every row.
TurnOutput = tuple[np.ndarray, np.ndarray, np.ndarray]


@dataclasses.dataclass
class Episodes:
  """A batch of finished episodes, as host arrays.

  Attributes:
    prompt_tokens, prompt_mask: [B, P], each prompt repeated for its group's rows.
    completion_tokens: int32 [B, T]: every token after the prompt.
    completion_mask: bool [B, T]: True on all of them.
    policy_mask: bool [B, T]: True on the sampled ones.
    behaviour_logprobs: f32 [B, T]: their log-probs (0 elsewhere).
    scores: f32 [B]: each episode's reward.
    turns: per episode, its assistant turns (`envs.Turn`).
    replies: per episode, its environment messages (`envs.Reply`).
    ends: per episode, why it ended (one of END_REASONS).
    errors: per episode, the failed call's error ("" when none failed).
    metrics: the batch's `env/...` metrics.
  """

  prompt_tokens: np.ndarray
  prompt_mask: np.ndarray
  completion_tokens: np.ndarray
  completion_mask: np.ndarray
  policy_mask: np.ndarray
  behaviour_logprobs: np.ndarray
  scores: np.ndarray
  turns: list[list[Turn]]
  replies: list[list[Reply]]
  ends: list[str]
  errors: list[str]
  metrics: dict[str, float]


class EpisodeRunner:
  """Runs batches of episodes of one environment (see the module docstring).

  Args:
    env: the environment.
    settings: the episode limits (`env` section).
    renderer: how the environment's messages become tokens (`envs.render.renderer_for`).
    tokenizer: decodes turns for the environment and prompts for its `start`.
    completion_len: T, the row's tokens after the prompt (every turn and message).
    eos_id, pad_id: the sampler's.
  """

  def __init__(self, env: Environment, settings: EnvSettings, renderer: TurnRenderer,
               tokenizer: Any, completion_len: int, eos_id: int, pad_id: int):
    self.env = env
    self.settings = settings
    self.renderer = renderer
    self.tokenizer = tokenizer
    self.completion_len = completion_len
    self.turn_tokens = settings.turn_budget(completion_len)
    self.eos_id, self.pad_id = int(eos_id), int(pad_id)
    # Replies repeat (a tool's "error: ..." , a fixed user turn): rendered once each.
    self._reply_ids: dict[Reply, list[int]] = {}

  def _reply_tokens(self, reply: Reply) -> list[int]:
    if reply not in self._reply_ids:
      if len(self._reply_ids) > 4096:
        self._reply_ids.clear()
      self._reply_ids[reply] = self.renderer.reply_tokens(reply)
    return self._reply_ids[reply]

  def _calls(self, fns: list[Callable[[], Any]]) -> list[tools.Outcome]:
    return tools.call_all(fns, self.settings.tool_timeout_s, name=f"env-{self.settings.name}")

  def run(self, batch: dict, group_size: int, first_turn: Callable[[dict, int], TurnOutput],
          next_turn: Callable[[dict, int], TurnOutput]) -> Episodes:
    """Runs one batch of episodes to their ends.

    Args:
      batch: the host prompt batch ("prompt_tokens", "prompt_mask" [Q, P], "index" [Q],
        optionally "answer_bytes"); each prompt opens `group_size` episodes.
      group_size: n; episodes of prompt q are rows [q * n, (q + 1) * n).
      first_turn: (batch, turn budget) -> the first turn of every episode, [Q * n, t]
        host arrays (the prompts' groups sampled as `GenerateStage` samples them).
      next_turn: (rows batch, turn index) -> one turn of every row of a batch of
        contexts ("prompt_tokens" / "prompt_mask" [Q * n, P + T] left-padded, "index":
        the episodes' sample ids, "max_new_tokens": each row's budget).

    Returns:
      The finished `Episodes`.
    """
    s, T = self.settings, self.completion_len
    start = time.perf_counter()
    env_seconds = 0.0
    rows = repeat_for_groups({k: np.asarray(batch[k]) for k in
                              ("prompt_tokens", "prompt_mask", "index")}, group_size)
    prompt_tokens, prompt_mask = rows["prompt_tokens"], rows["prompt_mask"].astype(bool)
    ids = np.asarray(rows["index"], np.int64)
    B, P = prompt_tokens.shape
    answers = (np.repeat(decode_answers(batch["answer_bytes"]), group_size).tolist()
               if "answer_bytes" in batch else [None] * B)
    prompts = [self.tokenizer.decode(p[m]) for p, m in zip(prompt_tokens, prompt_mask)]

    tokens = np.full((B, T), self.pad_id, np.int32)
    policy = np.zeros((B, T), bool)
    logprobs = np.zeros((B, T), np.float32)
    used = np.zeros((B,), np.int64)
    running = np.ones((B,), bool)
    turns: list[list[Turn]] = [[] for _ in range(B)]
    replies: list[list[Reply]] = [[] for _ in range(B)]
    ends, errors = [""] * B, [""] * B
    failed = np.zeros((B,), bool)

    t0 = time.perf_counter()
    states = [self.env.start(p, a) for p, a in zip(prompts, answers)]
    env_seconds += time.perf_counter() - t0

    def end(i: int, reason: str, error: str = "") -> None:
      running[i] = False
      ends[i], errors[i] = reason, error
      failed[i] = reason in (tools.ERROR, tools.TIMEOUT)

    for k in range(s.max_turns):
      if not running.any():
        break
      budget = np.minimum(self.turn_tokens, T - used).astype(np.int32)  # [B]
      if k == 0:
        first = dict(batch, max_new_tokens=np.full((len(batch["prompt_tokens"]),),
                                                   self.turn_tokens, np.int32))
        out_tokens, out_logprobs, out_mask = first_turn(first, self.turn_tokens)
      else:
        context_tokens, context_mask = self._contexts(prompt_tokens, prompt_mask, tokens,
                                                      used)
        # Finished rows still take part (the decoders run fixed shapes), on one token.
        limits = np.where(running, np.maximum(budget, 1), 1).astype(np.int32)
        out_tokens, out_logprobs, out_mask = next_turn(
            {"prompt_tokens": context_tokens, "prompt_mask": context_mask, "index": ids,
             "max_new_tokens": limits}, k)
      # Append each running episode's turn; collect the environment's calls.
      asked = []
      for i in np.flatnonzero(running):
        n = int(out_mask[i].sum())
        sampled = out_tokens[i, :n]
        tokens[i, used[i]:used[i] + n] = sampled
        policy[i, used[i]:used[i] + n] = True
        logprobs[i, used[i]:used[i] + n] = out_logprobs[i, :n]
        used[i] += n
        ended = n > 0 and int(sampled[-1]) == self.eos_id
        turn = Turn(text=self.tokenizer.decode(sampled), tokens=tuple(int(x) for x in sampled),
                    index=k, ended=ended)
        turns[i].append(turn)
        if not ended:
          end(i, "turn_length")
        elif k + 1 == s.max_turns:
          end(i, "max_turns")
        else:
          asked.append(i)
      t0 = time.perf_counter()
      outcomes = self._calls([lambda i=i, turn=turns[i][-1]: self.env.step(states[i], turn)
                              for i in asked])
      env_seconds += time.perf_counter() - t0
      for i, outcome in zip(asked, outcomes):
        if outcome.kind != tools.OK:
          end(i, outcome.kind, outcome.error)
          continue
        reply = outcome.value
        if reply is None:
          end(i, "done")
          continue
        if not isinstance(reply, Reply):
          end(i, tools.ERROR, f"TypeError: {type(self.env).__name__}.step returned "
                              f"{type(reply).__name__}, not an envs.Reply or None")
          continue
        ids_ = self._reply_tokens(reply)
        if used[i] + len(ids_) + 1 > T:
          end(i, "token_budget")
          continue
        tokens[i, used[i]:used[i] + len(ids_)] = ids_
        used[i] += len(ids_)
        replies[i].append(reply)
        if s.episode_timeout_s and time.perf_counter() - start > s.episode_timeout_s:
          end(i, "wall_time")
    for i in np.flatnonzero(running):  # not reached: every turn ends or continues above
      end(i, "max_turns")

    # Rewards: the environment's, except where one of its calls failed.
    scores = np.full((B,), s.failure_reward, np.float32)
    scored = [i for i in range(B) if not failed[i]]
    t0 = time.perf_counter()
    outcomes = self._calls([lambda i=i: self.env.reward(states[i], tuple(turns[i]))
                            for i in scored])
    env_seconds += time.perf_counter() - t0
    for i, outcome in zip(scored, outcomes):
      value = outcome.value
      if outcome.kind == tools.OK and isinstance(value, (int, float, np.number)) \
          and np.isfinite(value):
        scores[i] = float(value)
      else:
        error = outcome.error or (f"ValueError: {type(self.env).__name__}.reward returned "
                                  f"{value!r}, not a finite number")
        end(i, outcome.kind if outcome.kind != tools.OK else tools.ERROR, error)

    completion_mask = np.arange(T)[None, :] < used[:, None]
    metrics = self._metrics(turns, replies, ends, policy, completion_mask, env_seconds)
    return Episodes(prompt_tokens=prompt_tokens, prompt_mask=prompt_mask,
                    completion_tokens=tokens, completion_mask=completion_mask,
                    policy_mask=policy & completion_mask, behaviour_logprobs=logprobs,
                    scores=scores, turns=turns, replies=replies, ends=ends, errors=errors,
                    metrics=metrics)

  def _contexts(self, prompt_tokens: np.ndarray, prompt_mask: np.ndarray,
                tokens: np.ndarray, used: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each episode's prompt and row so far as one left-padded prompt [B, P + T]."""
    B, P = prompt_tokens.shape
    T = tokens.shape[1]
    out = np.full((B, P + T), self.pad_id, np.int32)
    mask = np.zeros((B, P + T), bool)
    for i in range(B):
      context = np.concatenate([prompt_tokens[i][prompt_mask[i]], tokens[i, :used[i]]])
      out[i, P + T - len(context):] = context
      mask[i, P + T - len(context):] = True
    return out, mask

  def _metrics(self, turns, replies, ends, policy, completion_mask, env_seconds
               ) -> dict[str, float]:
    B = len(turns)
    tool_calls = np.asarray([sum(r.role == "tool" for r in rs) for rs in replies], np.float64)
    out = {"env/turns": float(np.mean([len(t) for t in turns])),
           "env/tool_calls": float(tool_calls.mean()),
           "env/tool_call_rate": float((tool_calls > 0).mean()),
           "env/policy_tokens": float(policy.sum() / B),
           "env/env_tokens": float((completion_mask & ~policy).sum() / B),
           "env/hung_calls": float(tools.hung_calls()),
           "time/env_s": env_seconds}
    for reason in END_REASONS:
      out[f"env/end/{reason}"] = sum(e == reason for e in ends) / B
    return out


class EpisodeStage:
  """The generation stage of multi-turn episodes: an `EpisodeRunner` over two
  `GenerateStage`s on the generation layout, one sampling the prompts' groups (turn 0),
  one sampling every episode's continuation (later turns, one row per episode), both
  with the turn's token budget. Called like a `GenerateStage`.

  Args:
    layout, graphdef, sampling, num_microbatches, group_size, num_slots, prefill_chunk:
      as `GenerateStage`'s (`sampling.max_new_tokens` is the episode's budget T).
    runner: the episodes' environment and limits.
  """

  def __init__(self, layout: StageLayout, graphdef: nnx.GraphDef,
               sampling: sampler.SamplingSettings, num_microbatches: int, group_size: int,
               num_slots: int, runner: EpisodeRunner, prefill_chunk: int = 0):
    self.layout = layout
    self.runner = runner
    self.group_size = group_size
    turn = dataclasses.replace(sampling, max_new_tokens=runner.turn_tokens)
    self.first = GenerateStage(layout, graphdef, turn, num_microbatches, group_size,
                               num_slots, prefill_chunk)
    self.next = GenerateStage(layout, graphdef, turn, num_microbatches, 1, num_slots,
                              prefill_chunk)
    self.last: Episodes | None = None  # the last batch's episodes (tests, samples)

  slot_timeline = None

  def trace_slots(self, tracer, batch: int | None = None) -> None:
    """Episodes draw no slot lanes (their turns are several engine calls)."""

  def __call__(self, actor: nnx.State, batch: dict, rng: jax.Array, version: int
               ) -> tuple[Rollout, dict]:
    """Runs one batch of episodes; returns their Rollout (on this stage) and metrics."""
    start = time.perf_counter()
    decode_seconds = [0.0]
    occupancy = []  # each turn's slot occupancy, with the slot engine

    def sample(stage: GenerateStage, rows: dict, k: int) -> TurnOutput:
      t0 = time.perf_counter()
      rollout, metrics = stage(actor, rows, jax.random.fold_in(rng, k), version)
      out = fetch((rollout.completion_tokens, rollout.behaviour_logprobs,
                   rollout.completion_mask))
      decode_seconds[0] += time.perf_counter() - t0
      if "generate/slot_occupancy" in metrics:
        occupancy.append(metrics["generate/slot_occupancy"])
      return out

    episodes = self.runner.run(batch, self.group_size,
                               lambda first, _: sample(self.first, first, 0),
                               lambda rows, k: sample(self.next, rows, k))
    self.last = episodes
    e = episodes
    answers = (np.repeat(np.asarray(batch["answer_bytes"], np.uint8), self.group_size, axis=0)
               if "answer_bytes" in batch else None)
    host = {"prompt_tokens": e.prompt_tokens, "prompt_mask": e.prompt_mask,
            "completion_tokens": e.completion_tokens, "completion_mask": e.completion_mask,
            "behaviour_logprobs": e.behaviour_logprobs, "policy_mask": e.policy_mask,
            "env_scores": e.scores}
    if answers is not None:
      host["answer_bytes"] = answers
    placed = self.layout.put_batch(host)
    rollout = Rollout(**placed, policy_version=jnp.asarray(version, jnp.int32))
    seconds = time.perf_counter() - start
    policy_tokens = float(e.policy_mask.sum())
    metrics = {"time/generate_s": seconds, "time/decode_s": decode_seconds[0],
               "generate/tokens_per_s": policy_tokens / max(seconds, 1e-9), **e.metrics}
    if occupancy:
      metrics["generate/slot_occupancy"] = float(np.mean(occupancy))  # over the turns
    return rollout, metrics


def model_turns(model: nnx.Module, sampling: sampler.SamplingSettings, turn_tokens: int,
                rng: jax.Array, group_size: int = 1) -> tuple[Callable, Callable]:
  """(first_turn, next_turn) for `EpisodeRunner.run` from a plain model and the static
  sampler (held-out evaluation): turn k draws with `rng` folded with k, as in
  `EpisodeStage`, and every row's sample id is its position in the batch."""
  turn = dataclasses.replace(sampling, max_new_tokens=turn_tokens)

  def generate(rows: dict, k: int, group_size: int) -> TurnOutput:
    tokens = np.repeat(np.asarray(rows["prompt_tokens"]), group_size, axis=0)
    mask = np.repeat(np.asarray(rows["prompt_mask"]), group_size, axis=0).astype(bool)
    limits = np.repeat(np.asarray(rows["max_new_tokens"]), group_size).astype(np.int32)
    out = sampler.generate(model, tokens, mask, turn.max_new_tokens,
                           rng=jax.random.fold_in(rng, k), temperature=turn.temperature,
                           top_k=turn.top_k, top_p=turn.top_p, eos_id=turn.eos_id,
                           pad_id=turn.pad_id, limits=jnp.asarray(limits))
    return fetch((out.tokens, out.logprobs, out.mask))

  return (lambda batch, _: generate(batch, 0, group_size),
          lambda rows, k: generate(rows, k, 1))
