"""The reward model's scale under the policy PPO starts from.

A Bradley-Terry reward model is defined up to a shift and a scale: two reward models
trained alike on different seeds can rank the same answers the same way with scores
spread twice as wide. The KL penalty is in the reward's units, so one `ppo.kl_coef`
restrains PPO twice as hard against the narrower one (the quickstart's reward models:
score std 2.1 to 5.7 over the first PPO batch in four seeds; PPO gained least against
the narrowest one). Standardising the score by its mean and standard deviation over the
warm-start policy's own answers gives `kl_coef` one meaning for every reward model, the
way InstructGPT-style pipelines normalise the reward model before RL.

Owns `score_statistics`: the mean and standard deviation of the reward model's scores
over answers sampled from the warm-start policy, computed once before PPO, from the warm
start alone (so every run and every resume of a seed gets the same numbers); the
experiment pipeline passes them to `PPOSettings.reward_shift` / `reward_scale`.
"""

from __future__ import annotations

import dataclasses

from flax import nnx
import jax
import numpy as np

from pipe_rlhf_jax import distributed
from pipe_rlhf_jax.generation.sampler import SamplingSettings, generate_repeated
from pipe_rlhf_jax.stages.common import sequence_scores


@dataclasses.dataclass(frozen=True)
class ScoreStatistics:
  """The reward model's scores over `samples` answers of the warm-start policy."""

  mean: float
  std: float
  samples: int


def score_statistics(policy_graphdef: nnx.GraphDef, policy: nnx.State,
                     reward_graphdef: nnx.GraphDef, reward: nnx.State,
                     batch: dict[str, np.ndarray], sampling: SamplingSettings, *,
                     samples_per_prompt: int, seed: int) -> ScoreStatistics:
  """Mean and standard deviation of the reward model's score over `samples_per_prompt`
  answers per prompt of `batch`, sampled from `policy` as PPO samples (`sampling`).

  The draws are keyed by seed and sample (`sample_ids`), not by the devices the models
  sit on: the statistics are a function of the warm start, the prompts and the seed.

  Raises:
    ValueError: the scores do not vary (a standard deviation of 0 cannot scale them).
  """
  k = samples_per_prompt
  if k < 1:
    raise ValueError(f"reward.normalize_samples_per_prompt={k}: draw at least 1 answer "
                     "per prompt.")
  prompt_tokens, prompt_mask, out = generate_repeated(
      nnx.merge(policy_graphdef, policy), batch["prompt_tokens"], batch["prompt_mask"], k,
      sampling, rng=jax.random.key(seed))
  tokens, mask = distributed.fetch((out.tokens, out.mask))
  scores = np.asarray(distributed.fetch(jax.jit(
      lambda params, *args: sequence_scores(reward_graphdef, params, *args))(
          reward, prompt_tokens, prompt_mask, tokens, mask)), np.float64)  # [prompts * k]
  std = float(scores.std())
  if not std > 0:
    raise ValueError(
        f"reward.normalize_samples_per_prompt: the reward model gave all {scores.size} "
        f"answers of the warm-start policy the same score ({scores[0]:.4g}); it cannot be "
        "standardised. Set reward.normalize_samples_per_prompt=0 or check the reward model.")
  return ScoreStatistics(float(scores.mean()), std, int(scores.size))
