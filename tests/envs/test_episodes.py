"""The episode loop (stages/episodes.py) with scripted turns: rows, masks, limits, tool
failures; GAE and group baselines over an episode's policy tokens against hand
computations."""

import threading
import time

import numpy as np
import pytest

from pipe_rlhf_jax.envs import ENVIRONMENTS, Environment, EnvSettings, Reply
from pipe_rlhf_jax.envs.render import PlainRenderer
from pipe_rlhf_jax.models.tokenizer import ByteTokenizer
from pipe_rlhf_jax.ppo.advantages import gae
from pipe_rlhf_jax.stages.episodes import EpisodeRunner

TOK = ByteTokenizer()
EOS, PAD = TOK.eos_id, TOK.pad_id
RELEASE = threading.Event()  # lets the hung tool's thread end when the tests are done


@ENVIRONMENTS.register("test_echo")
class Echo(Environment):
  """Replies "ok<k>" to turns 0 and 1, ends after turn 2; reward = turns seen."""

  def step(self, state, turn):
    return None if turn.index >= 2 else Reply(f"ok{turn.index}")

  def reward(self, state, turns):
    return float(len(turns))


@ENVIRONMENTS.register("test_hang")
class Hang(Environment):
  """Hangs on prompts holding "hang", raises on "boom", else ends the episode."""

  def step(self, state, turn):
    if "hang" in state["prompt"]:
      RELEASE.wait(60)
    if "boom" in state["prompt"]:
      raise RuntimeError("the tool broke")
    return None

  def reward(self, state, turns):
    return 1.0


def scripted(turn_tokens, log):
  """Turn functions that answer each row with "t<k>r<row>" (+ EOS), logging every call."""

  def answer(rows: int, k: int, limits):
    tokens = np.full((rows, turn_tokens), PAD, np.int32)
    mask = np.zeros((rows, turn_tokens), bool)
    logprobs = np.zeros((rows, turn_tokens), np.float32)
    for r in range(rows):
      ids = TOK.encode(f"t{k}r{r}") + [EOS]
      n = min(len(ids), int(limits[r]))
      tokens[r, :n], mask[r, :n] = ids[:n], True
      logprobs[r, :n] = -0.5 - np.arange(n)
    log.append((k, limits.copy()))
    return tokens, logprobs, mask

  def first(batch, budget):
    rows = len(batch["prompt_tokens"]) * GROUP
    return answer(rows, 0, np.repeat(batch["max_new_tokens"], GROUP))

  def following(rows, k):
    return answer(len(rows["prompt_tokens"]), k, rows["max_new_tokens"])

  return first, following


GROUP = 2


def prompt_batch(texts, width=16):
  tokens = np.full((len(texts), width), PAD, np.int32)
  mask = np.zeros((len(texts), width), bool)
  for i, text in enumerate(texts):
    ids = TOK.encode(text)
    tokens[i, width - len(ids):], mask[i, width - len(ids):] = ids, True
  return {"prompt_tokens": tokens, "prompt_mask": mask, "index": np.arange(len(texts))}


def runner(name, completion_len=48, **settings):
  env = ENVIRONMENTS.get(name)()
  return EpisodeRunner(env, EnvSettings(name=name, **settings), PlainRenderer(TOK), TOK,
                       completion_len, EOS, PAD)


def test_an_episode_row_is_the_sampled_tokens_and_the_rendered_replies():
  log = []
  out = runner("test_echo", turn_tokens=8).run(prompt_batch(["a", "b"]), GROUP,
                                               *scripted(8, log))
  assert out.ends == ["done"] * 4
  np.testing.assert_array_equal(out.scores, 3.0)
  for row in range(4):
    expected, policy = [], []
    for k in range(3):
      turn = TOK.encode(f"t{k}r{row}") + [EOS]
      expected += turn
      policy += [True] * len(turn)
      if k < 2:
        reply = TOK.encode(f"\ntool: ok{k}\n")
        expected += reply
        policy += [False] * len(reply)
    n = len(expected)
    assert out.completion_tokens[row, :n].tolist() == expected  # byte for byte
    assert out.policy_mask[row, :n].tolist() == policy
    assert out.completion_mask[row].sum() == n and not out.policy_mask[row, n:].any()
    # Behaviour log-probs on the policy's tokens only, each turn's own.
    lp = out.behaviour_logprobs[row]
    assert (lp[~out.policy_mask[row]] == 0).all() and (lp[out.policy_mask[row]] < 0).all()
    assert [t.text for t in out.turns[row]] == [f"t{k}r{row}" for k in range(3)]
  assert [k for k, _ in log] == [0, 1, 2]
  assert out.metrics["env/tool_call_rate"] == 1.0 and out.metrics["env/turns"] == 3.0
  assert out.metrics["env/end/done"] == 1.0


def test_limits_end_episodes_with_named_reasons():
  # Two turns allowed: the second ends at max_turns without asking the environment.
  out = runner("test_echo", turn_tokens=8, max_turns=2).run(
      prompt_batch(["a"]), GROUP, *scripted(8, []))
  assert out.ends == ["max_turns"] * 2 and [len(t) for t in out.turns] == [2, 2]
  # A turn cut by its budget (no EOS) ends the episode.
  out = runner("test_echo", turn_tokens=3).run(prompt_batch(["a"]), GROUP, *scripted(3, []))
  assert out.ends == ["turn_length"] * 2 and not out.turns[0][0].ended
  # A reply that would leave no room for another turn is not appended.
  out = runner("test_echo", completion_len=12, turn_tokens=8).run(
      prompt_batch(["a"]), GROUP, *scripted(8, []))
  assert out.ends == ["token_budget"] * 2
  assert out.policy_mask[0, :out.completion_mask[0].sum()].all()  # ends on policy tokens
  # A later turn gets what is left of the episode's budget (22 - 5 - 11 = 6 tokens).
  log = []
  runner("test_echo", completion_len=22, turn_tokens=8).run(
      prompt_batch(["a"]), GROUP, *scripted(8, log))
  assert log[1][1].tolist() == [6, 6]


def test_a_hung_or_failing_tool_ends_its_episode_only():
  start = time.perf_counter()
  out = runner("test_hang", tool_timeout_s=0.5, failure_reward=-1.0).run(
      prompt_batch(["hang", "boom", "fine"]), 1, *scripted(8, []))
  seconds = time.perf_counter() - start
  RELEASE.set()
  assert seconds < 10  # bounded by the timeout, not by the tool
  assert out.ends == ["tool_timeout", "tool_error", "done"]
  assert "RuntimeError: the tool broke" in out.errors[1]
  np.testing.assert_array_equal(out.scores, [-1.0, -1.0, 1.0])
  assert out.metrics["env/end/tool_timeout"] == pytest.approx(1 / 3)


def test_gae_steps_over_environment_tokens():
  # Policy tokens at 0, 1, 4, 5 (2, 3 are a tool's reply, 6, 7 padding).
  mask = np.asarray([[1, 1, 0, 0, 1, 1, 0, 0]], bool)
  rewards = np.asarray([[0.1, 0.2, 9.0, 9.0, 0.3, 1.0, 9.0, 9.0]], np.float32)
  values = np.asarray([[0.5, 0.4, 7.0, 7.0, 0.3, 0.2, 7.0, 7.0]], np.float32)
  g, lam = 0.9, 0.8
  # By hand over the policy tokens' trajectory (V after the last one is 0).
  r, v = [0.1, 0.2, 0.3, 1.0], [0.5, 0.4, 0.3, 0.2]
  adv, next_v, next_a = [0.0] * 4, 0.0, 0.0
  for t in reversed(range(4)):
    adv[t] = r[t] + g * next_v - v[t] + g * lam * next_a
    next_v, next_a = v[t], adv[t]
  advantages, returns = gae(rewards, values, mask, g, lam)
  np.testing.assert_allclose(np.asarray(advantages)[0, [0, 1, 4, 5]], adv, rtol=1e-6)
  np.testing.assert_array_equal(np.asarray(advantages)[0, [2, 3, 6, 7]], 0.0)
  np.testing.assert_allclose(np.asarray(returns)[0, [0, 1, 4, 5]], np.add(adv, v), rtol=1e-6)


def test_settings_name_the_field():
  with pytest.raises(ValueError, match="env.name"):
    EnvSettings(name="no_such_env")
  with pytest.raises(ValueError, match="env.max_turns"):
    EnvSettings(max_turns=0)
  with pytest.raises(ValueError, match="env.tool_timeout_s"):
    EnvSettings(tool_timeout_s=float("nan"))


def test_group_baselines_compare_episodes_on_their_policy_tokens():
  from pipe_rlhf_jax.ppo.advantages import AdvantageSettings
  from pipe_rlhf_jax.ppo.critic_free import grpo
  from pipe_rlhf_jax.ppo.kl import shape_rewards
  # Two episodes of one prompt; environment tokens at 2-3 (row 0) and 1 (row 1).
  mask = np.asarray([[1, 1, 0, 0, 1, 0], [1, 0, 1, 1, 0, 0]], bool)
  rewards = shape_rewards(np.asarray([1.0, 0.0], np.float32), np.zeros((2, 6), np.float32),
                          mask, 0.0)
  # The score sits on each episode's last policy token.
  np.testing.assert_array_equal(np.asarray(rewards), [[0, 0, 0, 0, 1, 0], [0, 0, 0, 0, 0, 0]])
  advantages, _ = grpo(rewards, None, mask, AdvantageSettings(group_size=2))
  # By hand: returns 1 and 0, mean 0.5, std (Bessel) sqrt(0.5).
  a = 0.5 / (np.sqrt(0.5) + 1e-6)
  np.testing.assert_allclose(np.asarray(advantages), np.where(mask, [[a], [-a]], 0.0),
                             rtol=1e-6)
