"""The inference stage: turns a rollout into PPO experience with forward passes only.

Reference log-probs (frozen SFT policy), critic values and reward-model scores are
forward passes over the same `[prompt | completion]` tokens, one jitted program; KL
shaping, the advantage estimator and advantage whitening follow in a second one. A
rule-based reward (registered by name) is evaluated on the host from decoded text (and
the rollout's reference answers, for a rule that takes them) while the device runs the
forward passes (dispatched first), and enters the second program as `scores`; the
experience never crosses the host.

Only the models the algorithm needs run: no critic for a critic-free estimator
(`values` is None), no reference when `ppo.kl_coef == 0` (`ref_logprobs` and `kl` are
None). With `ppo.kl_in == "loss"` the KL is measured here (metrics, `Experience.kl`) but
not put into the rewards; the trainer adds it to the loss.

With `pack_tokens` = L > 0 the forward passes run over packed rows of L tokens (real
tokens only, `stages/packing.py`) instead of the padded `[batch, P + T]` layout, with the
same outputs; the plan needs the masks on the host, once per batch.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

from pipe_rlhf_jax.distributed.arrays import fetch, put_global
from pipe_rlhf_jax.ppo import advantages as adv_lib
from pipe_rlhf_jax.ppo import kl as kl_lib
from pipe_rlhf_jax.ppo.advantages import AdvantageSettings
from pipe_rlhf_jax.ppo.losses import explained_variance
from pipe_rlhf_jax.ppo.registry import ADVANTAGE_ESTIMATORS, KL_ESTIMATORS, score_rule
from pipe_rlhf_jax.ppo.types import Experience, Rollout, decode_answers
from pipe_rlhf_jax.stages import packing
from pipe_rlhf_jax.stages.common import (
  StageLayout,
  completion_logprobs,
  completion_values,
  packed_completion_logprobs,
  packed_completion_values,
  packed_sequence_scores,
  policy_only,
  sequence_scores,
)


@dataclasses.dataclass(frozen=True)
class InferSettings:
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
  kl_in: str = "reward"
  group_size: int = 1
  grpo_norm_by_std: bool = True
  grpo_eps: float = 1e-6
  reward_shift: float = 0.0
  reward_scale: float = 1.0

  @classmethod
  def from_settings(cls, ppo, temperature: float) -> "InferSettings":
    """From a `config.PPOSettings` (or any object with its fields)."""
    KL_ESTIMATORS.get(ppo.kl_estimator, field="ppo.kl_estimator")
    ADVANTAGE_ESTIMATORS.get(ppo.advantage_estimator, field="ppo.advantage_estimator")
    return cls(kl_estimator=ppo.kl_estimator, advantage_estimator=ppo.advantage_estimator,
               gamma=ppo.gamma, lam=ppo.lam, whiten_advantages=ppo.whiten_advantages,
               temperature=temperature, kl_in=ppo.kl_in, group_size=ppo.group_size,
               grpo_norm_by_std=ppo.grpo_norm_by_std, grpo_eps=ppo.grpo_eps,
               reward_shift=ppo.reward_shift, reward_scale=ppo.reward_scale)

  @property
  def advantage_settings(self) -> AdvantageSettings:
    return AdvantageSettings(gamma=self.gamma, lam=self.lam, group_size=self.group_size,
                             norm_by_std=self.grpo_norm_by_std, eps=self.grpo_eps)

  @property
  def needs_critic(self) -> bool:
    return ADVANTAGE_ESTIMATORS.info(self.advantage_estimator)["needs_critic"]


def derive_targets(h: InferSettings, rollout: Rollout, policy_logprobs: jax.Array | None,
                   ref_logprobs: jax.Array | None, values: jax.Array | None,
                   scores: jax.Array, kl_coef: jax.Array) -> Experience:
  """KL shaping, the advantage estimator and whitening: a rollout's PPO targets.

  A pure function of its inputs (traced inside the stages' jitted programs), so that the
  inference stage derives the targets at the behaviour policy and the trainer can derive
  them again at its own policy (`ppo.kl_policy="proximal"`, `stages/train.py`).

  Args:
    h: the estimator, KL and reward-scale settings.
    rollout: the generating batch.
    policy_logprobs: f32 [batch, completion_len] log-probs of the sampled tokens under the
      policy whose KL to the reference the rewards penalise (the behaviour policy's at
      the inference stage).
    ref_logprobs: f32 [batch, completion_len], or None without a reference.
    values: f32 [batch, completion_len] critic values, or None without a critic.
    scores: f32 [batch] raw sequence scores.
    kl_coef: f32 [] the KL coefficient of the rollout's policy version.

  Returns:
    The experience; its `old_logprobs` are the behaviour log-probs.
  """
  r = rollout
  mask = r.loss_mask  # the policy's tokens: an episode's environment tokens take no part
  kl = (kl_lib.kl_penalty(policy_logprobs, ref_logprobs, mask, h.kl_estimator)
        if ref_logprobs is not None else None)
  # The score as the rewards see it (`reward_shift` / `reward_scale`: the reward model's
  # standardisation); `Experience.scores` and the metrics keep it raw.
  shaped = ((scores - h.reward_shift) / h.reward_scale
            if (h.reward_shift, h.reward_scale) != (0.0, 1.0) else scores)
  kl_coef = jnp.asarray(kl_coef, jnp.float32)
  if kl is not None and h.kl_in == "reward":
    rewards = kl_lib.shape_rewards(shaped, kl, mask, kl_coef)
  else:  # the score alone, on each row's last valid token
    rewards = kl_lib.shape_rewards(shaped, jnp.zeros(mask.shape, jnp.float32), mask, 0.0)
  estimate = ADVANTAGE_ESTIMATORS.get(h.advantage_estimator, field="ppo.advantage_estimator")
  advantages, returns = estimate(rewards, values, mask, h.advantage_settings)
  if h.whiten_advantages:
    advantages = adv_lib.whiten(advantages, mask)
  return Experience(rollout=r, old_logprobs=r.behaviour_logprobs, ref_logprobs=ref_logprobs,
                    values=values, scores=scores, rewards=rewards, advantages=advantages,
                    returns=returns, kl=kl, kl_coef=kl_coef)


class InferStage:
  """Scores rollouts on the inference mesh.

  Args:
    layout: the inference stage's mesh and rules.
    policy_graphdef: structure of the reference policy (same as the actor's).
    critic_graphdef: structure of the critic (value head); None exactly when the
      advantage estimator needs no critic.
    reward_graphdef: structure of the reward model (score head), or None when the reward
      is a rule.
    settings: the stage's settings (`InferSettings`).
    reward_fn: host-side rule reward `(prompts, completions) -> [batch]` (or with the
      rollout's reference answers, `ppo.registry.score_rule`), used when
      `reward_graphdef` is None.
    eval_fn: a host-side rule reward reported as `rule_reward/mean`, not optimised.
    decode: token ids -> text, for rule rewards.
    pack_tokens: 0 runs the forward passes over the padded layout; L > 0 over packed
      rows of L tokens (`stages.infer.pack_tokens`; the same outputs).
    env_rewards: the rollouts are episodes whose environment gave their rewards
      (`Rollout.env_scores`): no reward model and no rule.
  """

  def __init__(self, layout: StageLayout, policy_graphdef: nnx.GraphDef,
               critic_graphdef: nnx.GraphDef | None, reward_graphdef: nnx.GraphDef | None,
               settings: InferSettings, reward_fn: Callable | None = None,
               eval_fn: Callable | None = None, decode: Callable | None = None,
               pack_tokens: int = 0, env_rewards: bool = False):
    if reward_graphdef is None and reward_fn is None and not env_rewards:
      raise ValueError("reward.fn: give a reward model, a registered rule reward or an "
                       "environment.")
    if (critic_graphdef is None) == settings.needs_critic:
      need = "needs" if settings.needs_critic else "takes no"
      raise ValueError(f"ppo.advantage_estimator={settings.advantage_estimator!r} {need} "
                       "critic: build the stage with a critic_graphdef exactly when it "
                       "needs one.")
    self.layout = layout
    self.settings = settings
    self.reward_fn = reward_fn
    self.eval_fn = eval_fn
    self.decode = decode
    if pack_tokens < 0:
      raise ValueError(f"stages.infer.pack_tokens={pack_tokens} must be >= 0.")
    self.pack_tokens = pack_tokens
    self.env_rewards = env_rewards
    h = settings
    ADVANTAGE_ESTIMATORS.get(h.advantage_estimator, field="ppo.advantage_estimator")

    def forward(ref, critic, reward_model, rollout: Rollout):
      # The model passes, one jitted program dispatched before any host work so that a
      # rule reward's decoding and scoring on the host overlap them. `ref` / `critic` /
      # `reward_model` are None when the algorithm has no such model: a static fact of the
      # trace (None is an empty pytree), so the skipped pass is not compiled.
      with layout.rules_context():
        r = rollout
        args = (r.prompt_tokens, r.prompt_mask, r.completion_tokens, r.completion_mask)
        # Under the untruncated policy: a sampled token outside the reference's own
        # nucleus still has a finite reference log-prob, so the KL stays finite.
        ref_logprobs = (completion_logprobs(policy_graphdef, ref, *args,
                                            temperature=h.temperature)
                        if ref is not None else None)
        values = (completion_values(critic_graphdef, critic, *args)
                  if critic is not None else None)
        model_scores = (sequence_scores(reward_graphdef, reward_model, *args)
                        if reward_model is not None else None)
        return policy_only(r, ref_logprobs), policy_only(r, values), model_scores

    def forward_packed(ref, critic, reward_model, rollout: Rollout, plan: packing.PackPlan):
      # The same passes over packed rows; their outputs are the padded layout's.
      with layout.rules_context():
        r = rollout
        args = (plan, r.prompt_tokens, r.completion_tokens)
        ref_logprobs = (packed_completion_logprobs(policy_graphdef, ref, *args,
                                                   r.completion_mask,
                                                   temperature=h.temperature)
                        if ref is not None else None)
        values = (packed_completion_values(critic_graphdef, critic, *args, r.completion_mask)
                  if critic is not None else None)
        model_scores = (packed_sequence_scores(reward_graphdef, reward_model, *args)
                        if reward_model is not None else None)
        return policy_only(r, ref_logprobs), policy_only(r, values), model_scores

    def make_experience(rollout: Rollout, ref_logprobs, values, scores, kl_coef):
      with layout.rules_context():
        exp = derive_targets(h, rollout, rollout.behaviour_logprobs, ref_logprobs, values,
                             scores, kl_coef)
        return exp, experience_metrics(exp)

    self._forward = jax.jit(forward)
    self._forward_packed = jax.jit(forward_packed)
    self._make = jax.jit(make_experience)

  def score_on_host(self, rollout: Rollout, fn: Callable) -> np.ndarray:
    """Rule reward `fn` of each completion, from decoded text (and the rollout's
    reference answers, for a rule that takes them); checked finite."""
    # One host transfer for the whole batch; every process of the stage scores the whole
    # batch (rule rewards are cheap next to the model passes), so all hold equal scores.
    prompts_np, pmask, completions_np, cmask, answer_bytes = fetch(
        (rollout.prompt_tokens, rollout.prompt_mask, rollout.completion_tokens,
         rollout.completion_mask, rollout.answer_bytes))
    prompts = [self.decode(p[m]) for p, m in zip(prompts_np, pmask)]
    completions = [self.decode(c[m]) for c, m in zip(completions_np, cmask)]
    answers = None if answer_bytes is None else decode_answers(answer_bytes)
    return score_rule(fn, prompts, completions, answers)

  def pack(self, rollout: Rollout) -> packing.PackPlan:
    """The packing plan of `rollout`'s masks (one host transfer), placed on this stage."""
    prompt_mask, completion_mask = fetch((rollout.prompt_mask, rollout.completion_mask))
    plan = packing.plan_packing(prompt_mask, completion_mask, self.pack_tokens,
                                row_multiple=self.layout.batch_ways())
    return self.layout.put_batch(plan)

  def forward(self, ref: nnx.State | None, critic: nnx.State | None,
              reward_model: nnx.State | None, rollout: Rollout):
    """Dispatches the model passes: (reference log-probs, values, model scores), each
    None without its model; over packed rows when `pack_tokens` is set."""
    if not self.pack_tokens:
      return self._forward(ref, critic, reward_model, rollout)
    return self._forward_packed(ref, critic, reward_model, rollout, self.pack(rollout))

  def __call__(self, ref: nnx.State | None, critic: nnx.State | None,
               reward_model: nnx.State | None, rollout: Rollout, kl_coef: float
               ) -> tuple[Experience, dict]:
    """Experience for `rollout` (placed on this stage), plus scalar metrics.

    `ref` is None when there is no reference (kl_coef = 0), `critic` None for a
    critic-free estimator.
    """
    if (critic is None) == self.settings.needs_critic:
      raise ValueError("InferStage: pass critic parameters exactly when the advantage "
                       f"estimator {self.settings.advantage_estimator!r} needs a critic.")
    # The reference answers are for the rules on the host: the device programs and the
    # experience the trainer receives go without them.
    scored, rollout = rollout, rollout.replace(answer_bytes=None)
    # Asynchronous dispatch: the device runs the model passes while the host decodes
    # and scores the completions below.
    ref_logprobs, values, model_scores = self.forward(ref, critic, reward_model, rollout)
    if rollout.env_scores is not None:  # episodes: their environment gave the reward
      scores = rollout.env_scores
    elif self.env_rewards:
      raise ValueError("The inference stage was built for episodes (env_rewards=True) but "
                       "got a rollout without env_scores.")
    elif reward_model is None:
      # Each process holds the whole host batch; put_global keeps its own shards.
      scores = put_global(self.score_on_host(scored, self.reward_fn),
                          self.layout.batch_sharding(1))
    else:
      scores = model_scores
    exp, metrics = self._make(rollout, ref_logprobs, values, scores,
                              jnp.asarray(kl_coef, jnp.float32))
    if self.eval_fn is not None:
      metrics["rule_reward/mean"] = float(np.mean(self.score_on_host(scored, self.eval_fn)))
    return exp, metrics


def experience_metrics(exp: Experience) -> dict:
  """Scalar summaries of a batch of experience (computed on device).

  KL metrics exist only with a reference, value metrics only with a critic. Token
  means are over the policy's tokens; `response_length/mean` counts them.
  """
  mask = exp.rollout.loss_mask
  mean = lambda x: adv_lib.masked_mean(x, mask)
  lengths = jnp.sum(mask.astype(jnp.float32), axis=1)
  metrics = {
      "reward/mean": jnp.mean(exp.scores), "reward/std": jnp.std(exp.scores),
      "return/mean": mean(exp.returns), "advantage/mean": mean(exp.advantages),
      "response_length/mean": jnp.mean(lengths),
  }
  if exp.kl is not None:
    seq_kl = jnp.sum(jnp.where(mask, exp.kl, 0.0), axis=1)
    metrics.update({"kl/mean": jnp.mean(seq_kl), "kl/token_mean": mean(exp.kl)})
  if exp.values is not None:
    metrics.update({"value/mean": mean(exp.values),
                    "explained_variance": explained_variance(exp.values, exp.returns,
                                                             mask)})
  return metrics
