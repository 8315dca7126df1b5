"""The inference stage: turns a rollout into PPO experience with forward passes only.

Reference log-probs (frozen SFT policy), critic values and reward-model scores are three
forward passes over the same `[prompt | completion]` tokens; KL shaping, GAE and
advantage whitening follow in the same jitted call, so a rollout crosses the host once.
A rule-based reward (registered by name) is evaluated on the host from decoded text and
enters the jitted call as `scores`.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pipe_rlhf_jax.ppo import advantages as adv_lib
from pipe_rlhf_jax.ppo import kl as kl_lib
from pipe_rlhf_jax.ppo.losses import explained_variance
from pipe_rlhf_jax.ppo.registry import ADVANTAGE_ESTIMATORS, KL_ESTIMATORS
from pipe_rlhf_jax.ppo.types import Experience, Rollout
from pipe_rlhf_jax.stages.common import (StageLayout, completion_logprobs,
                                         completion_values, sequence_scores)


@dataclasses.dataclass(frozen=True)
class InferHyper:
  """Static settings of experience making.

  `temperature` defines the policy the reference log-probs are taken under; top-k /
  top-p are deliberately absent: they filter the draw, never a log-prob (see
  `generation/sampling.py`).
  """

  kl_estimator: str
  advantage_estimator: str
  gamma: float
  lam: float
  whiten_advantages: bool
  temperature: float

  @classmethod
  def from_settings(cls, ppo, temperature: float) -> "InferHyper":
    """From a `system.settings.PPOConfig` (or any object with its fields)."""
    KL_ESTIMATORS.get(ppo.kl_estimator, field="ppo.kl_estimator")
    ADVANTAGE_ESTIMATORS.get(ppo.advantage_estimator, field="ppo.advantage_estimator")
    return cls(kl_estimator=ppo.kl_estimator, advantage_estimator=ppo.advantage_estimator,
               gamma=ppo.gamma, lam=ppo.lam, whiten_advantages=ppo.whiten_advantages,
               temperature=temperature)


class InferStage:
  """Scores rollouts on the inference mesh.

  Args:
    layout: the inference stage's mesh and rules.
    policy_graphdef: structure of the reference policy (same as the actor's).
    critic_graphdef: structure of the critic (value head).
    reward_graphdef: structure of the reward model (score head), or None when the reward
      is a rule.
    hyper: settings.
    reward_fn: host-side rule reward `(prompts, completions) -> [batch]`, used when
      `reward_graphdef` is None.
    eval_fn: a host-side rule reward reported as `rule_reward/mean`, not optimised.
    decode: token ids -> text, for rule rewards.
  """

  def __init__(self, layout: StageLayout, policy_graphdef: nnx.GraphDef,
               critic_graphdef: nnx.GraphDef, reward_graphdef: nnx.GraphDef | None,
               hyper: InferHyper, reward_fn: Callable | None = None,
               eval_fn: Callable | None = None, decode: Callable | None = None):
    if reward_graphdef is None and reward_fn is None:
      raise ValueError("reward.fn: give a reward model or a registered rule reward.")
    self.layout = layout
    self.hyper = hyper
    self.reward_fn = reward_fn
    self.eval_fn = eval_fn
    self.decode = decode
    h = hyper
    estimate_advantages = ADVANTAGE_ESTIMATORS.get(h.advantage_estimator,
                                                   field="ppo.advantage_estimator")

    def make_experience(ref, critic, reward_model, rollout: Rollout, host_scores,
                        kl_coef):
      with layout.rules_context():
        r = rollout
        args = (r.prompt_tokens, r.prompt_mask, r.completion_tokens, r.completion_mask)
        mask = r.completion_mask
        # Under the untruncated policy: a sampled token outside the reference's own
        # nucleus still has a finite reference log-prob, so the KL stays finite.
        ref_logprobs = completion_logprobs(policy_graphdef, ref, *args,
                                           temperature=h.temperature)
        values = completion_values(critic_graphdef, critic, *args)
        if reward_graphdef is not None:
          scores = sequence_scores(reward_graphdef, reward_model, *args)
        else:
          scores = host_scores
        kl = kl_lib.kl_penalty(r.behaviour_logprobs, ref_logprobs, mask, h.kl_estimator)
        rewards = kl_lib.shape_rewards(scores, kl, mask, kl_coef)
        advantages, returns = estimate_advantages(rewards, values, mask, h.gamma, h.lam)
        if h.whiten_advantages:
          advantages = adv_lib.whiten(advantages, mask)
        exp = Experience(rollout=r, old_logprobs=r.behaviour_logprobs,
                         ref_logprobs=ref_logprobs, values=values, scores=scores,
                         rewards=rewards, advantages=advantages, returns=returns, kl=kl)
        return exp, experience_metrics(exp)

    self._make = jax.jit(make_experience)

  def score_on_host(self, rollout: Rollout, fn: Callable) -> np.ndarray:
    """Rule reward `fn` of each completion, from decoded text."""
    prompts_np, pmask, completions_np, cmask = jax.device_get(
        (rollout.prompt_tokens, rollout.prompt_mask, rollout.completion_tokens,
         rollout.completion_mask))  # one host transfer for the whole batch
    prompts = [self.decode(p[m]) for p, m in zip(prompts_np, pmask)]
    completions = [self.decode(c[m]) for c, m in zip(completions_np, cmask)]
    return np.asarray(fn(prompts, completions), np.float32)

  def __call__(self, ref: nnx.State, critic: nnx.State, reward_model: nnx.State | None,
               rollout: Rollout, kl_coef: float) -> tuple[Experience, dict]:
    """Experience for `rollout` (placed on this stage), plus scalar metrics."""
    batch = rollout.prompt_tokens.shape[0]
    host_scores = (self.score_on_host(rollout, self.reward_fn) if reward_model is None
                   else np.zeros((batch,), np.float32))
    host_scores = jax.device_put(host_scores, self.layout.batch_sharding(1))
    exp, metrics = self._make(ref, critic, reward_model, rollout, host_scores,
                              jnp.asarray(kl_coef, jnp.float32))
    if self.eval_fn is not None:
      metrics["rule_reward/mean"] = float(np.mean(self.score_on_host(rollout, self.eval_fn)))
    return exp, metrics


def experience_metrics(exp: Experience) -> dict:
  """Scalar summaries of a batch of experience (computed on device)."""
  mask = exp.rollout.completion_mask
  mean = lambda x: adv_lib.masked_mean(x, mask)
  lengths = jnp.sum(mask.astype(jnp.float32), axis=1)
  seq_kl = jnp.sum(jnp.where(mask, exp.kl, 0.0), axis=1)
  return {
      "reward/mean": jnp.mean(exp.scores), "reward/std": jnp.std(exp.scores),
      "kl/mean": jnp.mean(seq_kl), "kl/token_mean": mean(exp.kl),
      "return/mean": mean(exp.returns), "value/mean": mean(exp.values),
      "advantage/mean": mean(exp.advantages),
      "response_length/mean": jnp.mean(lengths),
      "explained_variance": explained_variance(exp.values, exp.returns, mask),
  }
