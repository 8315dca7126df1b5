"""Multi-turn episodes through the PPO system: token in / token out from the sampler to
the trainer, in `sequential` and `pipe` mode, on a tiny chat model whose ChatML template
renders the environment's messages."""

import jax.numpy as jnp
import numpy as np
import pytest

from pipe_rlhf_jax import models
from pipe_rlhf_jax.config import MeshSpec, Plan, PPOSettings, StagePlan
from pipe_rlhf_jax.data.loaders import PromptLoader
from pipe_rlhf_jax.distributed.arrays import fetch
from pipe_rlhf_jax.envs import ENVIRONMENTS, Environment, EnvSettings, Reply, renderer_for
from pipe_rlhf_jax.envs.render import ChatRenderer, TemplateDriftError
from pipe_rlhf_jax.generation import SamplingSettings
from pipe_rlhf_jax.models.tokenizer import HFTokenizer
from pipe_rlhf_jax.stages.episodes import EpisodeRunner
from pipe_rlhf_jax.system import Models, PPOSystem, run
from tests.helpers.hf_helpers import CHATML_TEMPLATE, write_chat_tokenizer, write_tiny_chat_llama
from tests.system.test_modes import assert_same_math

CORPUS = "abcdefghijklmnopqrstuvwxyz0123456789 .,:;?!<>/*+-=()\n" + "systemuserassistanttool"
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


@ENVIRONMENTS.register("test_letters")
class Letters(Environment):
  """Replies with the turn's length for two turns, then ends; the reward (varied within
  a group) is the share of distinct characters in the last turn."""

  def step(self, state, turn):
    return None if turn.index >= 2 else Reply(f"n={len(turn.text)}")

  def reward(self, state, turns):
    text = turns[-1].text
    return len(set(text)) / max(len(text), 1)


def ending_turns(policy, tok, lift: float = 0.1):
  """The random policy with its head's EOS column moved by `lift` along the mean final
  hidden state: EOS becomes likelier, so that turns end within a few tokens and episodes
  have several."""
  ids = tok.apply_chat_template([{"role": "user", "content": "say abc"}])
  h = policy.hidden(jnp.asarray([ids]), jnp.ones((1, len(ids)), bool))[0]  # [len, embed]
  u = jnp.mean(h, axis=0)
  head = policy.lm_head.value
  policy.lm_head.value = head.at[:, tok.eos_id].add(lift * u / jnp.sum(u * u))
  return policy


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
  path = write_tiny_chat_llama(tmp_path_factory.mktemp("chat"), CORPUS)
  tok = HFTokenizer(path)
  return ending_turns(models.from_pretrained(path), tok), tok


def _system(chat_model, plan):
  policy, tok = chat_model
  episodes = EpisodeRunner(Letters(), EnvSettings(name="test_letters", turn_tokens=6),
                           renderer_for(tok), tok, 96, tok.eos_id, tok.pad_id)
  system = PPOSystem(
      Models.from_policy(policy, critic_from=None),
      ppo=PPOSettings(steps=2, batch_size=8, minibatch_size=8, actor_lr=1e-3, kl_coef=0.05,
                      kl_in="loss", kl_estimator="k3", advantage_estimator="grpo",
                      group_size=2, whiten_advantages=False),
      sampling=SamplingSettings(max_new_tokens=96, eos_id=tok.eos_id, pad_id=tok.pad_id),
      plan=plan, episodes=episodes)
  records = [{"messages": [{"role": "user", "content": f"say {c}"}]} for c in "abcdefgh"]
  return system, PromptLoader(records, tok, 4, 32, seed=0)


@pytest.fixture(scope="module")
def sequential(chat_model):
  """Two steps in `sequential` mode: their metrics, and each step's episodes with the
  experience the trainer received."""
  system, prompts = _system(chat_model, Plan(mode="sequential"))
  seen = []
  train = system.train
  system.train = lambda exp, *a, **k: (seen.append((system.generate_stage.last, exp)),
                                       train(exp, *a, **k))[1]
  return run(system, prompts, steps=2).metrics, seen


def test_the_trainer_reads_the_sampled_tokens_and_the_rendered_replies(chat_model,
                                                                         sequential):
  _, tok = chat_model
  metrics, seen = sequential
  renderer = ChatRenderer(tok)
  for episodes, exp in seen:
    r = fetch(exp.rollout)
    for i in range(len(episodes.turns)):
      # The row, rebuilt from what the sampler drew and what the template renders.
      row = []
      for k, turn in enumerate(episodes.turns[i]):
        row += list(turn.tokens)
        if k < len(episodes.replies[i]):
          row += renderer.reply_tokens(episodes.replies[i][k])
      n = int(r.completion_mask[i].sum())
      assert r.completion_tokens[i, :n].tolist() == row  # byte for byte
      sampled = np.concatenate([t.tokens for t in episodes.turns[i]])
      assert r.completion_tokens[i][r.policy_mask[i]].tolist() == sampled.tolist()
      assert (r.behaviour_logprobs[i][~r.policy_mask[i]] == 0).all()
    assert any(len(t) == 3 for t in episodes.turns)  # episodes had several turns
    # The environment's rewards are PPO's.
    np.testing.assert_allclose(np.asarray(fetch(exp.scores)), episodes.scores)
  for m in metrics:
    # The trainer's log-probs of the sampled tokens at the sampling weights are the
    # behaviour ones: the positions and the context are the sampler's.
    assert m["logprob_gap/max"] < 1e-4
    assert m["env/tool_call_rate"] > 0 and m["env/env_tokens"] > 0
    assert m["reward/std"] > 0


# Slow: the default tier holds `pipe` at staleness 0 to `sequential` on one-turn rollouts
# (tests/system/test_modes.py) and runs episodes in `sequential` here.
@pytest.mark.long
@pytest.mark.slow
def test_pipe_at_staleness_zero_equals_sequential(chat_model, sequential):
  plan = Plan(mode="pipe", max_staleness=0, placement=(2, 2, 4),
              generate=StagePlan(MeshSpec(data=1, pipeline=2), num_microbatches=2))
  pipe = run(*_system(chat_model, plan), steps=2).metrics
  assert_same_math(sequential[0], pipe)
  assert sequential[0][0]["env/turns"] > 1


# Extended: the engine's completions equal the static batch's in the default tier
# (tests/generation/test_engine.py), and an episode's turns are such completions.
@pytest.mark.slow
@pytest.mark.extended
def test_the_slot_engine_runs_the_same_episodes(chat_model, sequential):
  # Every turn through the continuous-batching engine (4 slots for 8 episodes): the same
  # tokens as the static batch, so the same mathematics.
  plan = Plan(mode="sequential", generate=StagePlan(MeshSpec(data=-1), num_slots=4))
  engine = run(*_system(chat_model, plan), steps=2).metrics
  assert all(m.pop("generate/slot_occupancy") > 0 for m in engine)  # the engine ran
  assert_same_math(sequential[0], engine)


def test_a_template_that_rewrites_earlier_turns_is_refused(tmp_path):
  # Drops the reasoning block of every assistant turn but the last, as some templates do.
  stripping = CHATML_TEMPLATE.replace(
      "{{ message['content'] }}",
      "{% if message['role'] == 'assistant' and not loop.last %}"
      "{{ message['content'].split('</think>')[-1].lstrip() }}"
      "{% else %}{{ message['content'] }}{% endif %}")
  write_chat_tokenizer(tmp_path, CORPUS + "_", SPECIALS, eos="<|im_end|>",
                       pad="<|endoftext|>", chat_template=stripping)
  with pytest.raises(TemplateDriftError, match="tokenizer_config.json.*turn by turn"):
    renderer_for(HFTokenizer(str(tmp_path)))
  # The ChatML template itself renders turn by turn as it renders whole.
  write_chat_tokenizer(tmp_path / "ok", CORPUS + "_", SPECIALS, eos="<|im_end|>",
                       pad="<|endoftext|>", chat_template=CHATML_TEMPLATE)
  assert isinstance(renderer_for(HFTokenizer(str(tmp_path / "ok"))), ChatRenderer)
