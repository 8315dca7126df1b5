"""PPO mathematics: advantages, KL regularisation, losses; importing fills the registries."""

from pipe_rlhf_jax.ppo import critic_free  # noqa: F401  (registers grpo, rloo, reinforce_pp)
from pipe_rlhf_jax.ppo.advantages import AdvantageSettings, gae, masked_mean, whiten
from pipe_rlhf_jax.ppo.aggregation import aggregate
from pipe_rlhf_jax.ppo.kl import adaptive_kl_coef, kl_penalty, shape_rewards
from pipe_rlhf_jax.ppo.losses import (
                                      entropy_from_logits,
                                      entropy_from_logprobs,
                                      policy_loss,
                                      value_loss,
)

__all__ = [
    "AdvantageSettings",
    "adaptive_kl_coef",
    "aggregate",
    "entropy_from_logits",
    "entropy_from_logprobs",
    "gae",
    "kl_penalty",
    "masked_mean",
    "policy_loss",
    "shape_rewards",
    "value_loss",
    "whiten",
]
