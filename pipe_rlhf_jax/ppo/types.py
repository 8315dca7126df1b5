"""The data that flows between PPO stages: rollouts and experience.

Layout convention shared by every stage (and by the SFT / reward-model data): a prompt is
left-padded to a fixed length P, its completion right-padded to a fixed length T, so the
full sequence `[prompt | completion]` has the prompt's last token at index P-1 and the
completion's token i at index P+i for every row.

A prompt's reference answer (for verifiable rule rewards) rides along as text in a fixed
width: its UTF-8 bytes, NUL-padded to A bytes (`encode_answers` / `decode_answers`), so
it moves with the rollout through every queue, reshard and cross-process transfer as an
array like the others, and needs no side channel.

A multi-turn episode (`stages/episodes.py`) is one row too: its completion is every
token after the prompt, the policy's turns and the environment's replies between them,
all attended (`completion_mask`); `policy_mask` marks the tokens the policy sampled,
the only ones the loss, the KL and the advantages read (`Rollout.loss_mask`).
"""

from __future__ import annotations

from typing import Sequence

from flax import struct
import jax
import numpy as np


@struct.dataclass
class Rollout:
  """What generation produces for one batch.

  Attributes:
    prompt_tokens: int32 [batch, prompt_len], left-padded.
    prompt_mask: bool [batch, prompt_len], True on real prompt tokens.
    completion_tokens: int32 [batch, completion_len], right-padded; EOS included.
    completion_mask: bool [batch, completion_len], True up to and including EOS.
    behaviour_logprobs: f32 [batch, completion_len], log-probs of the sampled tokens under
      the tempered, untruncated policy softmax(logits / T) of the generating weights
      (top-k / top-p only filtered the draw; see `generation/sampling.py`), 0 on padding.
    policy_version: int32 [] (the version of the actor weights that generated the
      batch) or [batch, completion_len] (partial rollouts: the version that drew each
      token, `stages/rollout_stream.py`).
    answer_bytes: uint8 [batch, answer_len], each row's reference answer (NUL-padded
      UTF-8, see `decode_answers`), or None when the prompts carry none. Read by the
      rule reward only; the inference stage drops it from the experience.
    policy_mask: bool [batch, completion_len], True on the tokens the policy sampled,
      for multi-turn episodes (their environment tokens are False); None when every
      completion token is the policy's (one turn).
    env_scores: f32 [batch], each episode's reward as its environment gave it, or None
      when the reward is scored by the inference stage (a rule or a reward model).
  """

  prompt_tokens: jax.Array
  prompt_mask: jax.Array
  completion_tokens: jax.Array
  completion_mask: jax.Array
  behaviour_logprobs: jax.Array
  policy_version: jax.Array
  answer_bytes: jax.Array | None = None
  policy_mask: jax.Array | None = None
  env_scores: jax.Array | None = None

  @property
  def loss_mask(self) -> jax.Array:
    """bool [batch, completion_len]: the tokens the loss, the KL and the advantages read,
    the policy's own (`completion_mask` without the environment's tokens)."""
    if self.policy_mask is None:
      return self.completion_mask
    return self.completion_mask & self.policy_mask


@struct.dataclass
class Experience:
  """A rollout scored by the inference stage and turned into PPO targets.

  Attributes:
    rollout: the generating batch.
    old_logprobs: f32 [batch, completion_len], actor log-probs the PPO ratio is taken
      against (the behaviour log-probs, or the proximal policy's in the decoupled mode).
    ref_logprobs: f32 [batch, completion_len], frozen reference policy log-probs; None
      when there is no reference (ppo.kl_coef = 0).
    values: f32 [batch, completion_len], critic values V(s_t) before token t; None for a
      critic-free advantage estimator.
    scores: f32 [batch], reward-model (or rule) score of each completion.
    rewards: f32 [batch, completion_len], per-token rewards: the score on the last valid
      token, minus kl_coef * kl on every token when ppo.kl_in = "reward".
    advantages: f32 [batch, completion_len], the estimator's advantages (0 on padding).
    returns: f32 [batch, completion_len], value targets (GAE) or the estimator's returns.
    kl: f32 [batch, completion_len], per-token KL estimate of the behaviour policy against
      the reference; None without a reference.
    kl_coef: f32 [], the KL coefficient `rewards` were shaped with (that of the rollout's
      policy version), so the trainer can shape them again (`ppo.kl_policy`).

  Rows [g * n, (g + 1) * n) are the n = ppo.group_size completions of one prompt.
  """

  rollout: Rollout
  old_logprobs: jax.Array
  ref_logprobs: jax.Array
  values: jax.Array
  scores: jax.Array
  rewards: jax.Array
  advantages: jax.Array
  returns: jax.Array
  kl: jax.Array
  kl_coef: jax.Array


def encode_answers(answers: Sequence[str], width: int) -> np.ndarray:
  """Answers as uint8 [len(answers), width]: UTF-8 bytes, NUL-padded.

  Raises:
    ValueError: an answer longer than `width` bytes, or holding a NUL (it would read
      back cut there).
  """
  out = np.zeros((len(answers), width), np.uint8)
  for i, answer in enumerate(answers):
    raw = answer.encode("utf-8")
    if len(raw) > width or b"\0" in raw:
      raise ValueError(f"answer {i} ({answer[:40]!r}) has {len(raw)} bytes or a NUL; answers "
                       f"take at most {width} bytes and no NUL.")
    out[i, :len(raw)] = np.frombuffer(raw, np.uint8)
  return out


def decode_answers(answer_bytes) -> list[str]:
  """The answers of uint8 [batch, width] NUL-padded UTF-8 rows (a host array)."""
  rows = np.asarray(answer_bytes, np.uint8)
  return [bytes(row).rstrip(b"\0").decode("utf-8", errors="replace") for row in rows]
