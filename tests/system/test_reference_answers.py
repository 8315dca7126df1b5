"""Reference answers from prompt records to the rule reward, in every in-process mode.

Each prompt "q<i>=" carries the answer "a<i>"; the rule sees (prompt, answer) pairs and
scores 1 exactly when they belong together, so a reward mean of 1 on every step means
that every completion's row got its own prompt's answer: through the prompt pipeline's
batch, the group repetition, the (pipelined) generation stage, the queues of `pipe`
mode and the reshard to the inference stage.
"""

import numpy as np
import pytest

from pipe_rlhf_jax import models
from pipe_rlhf_jax.config import MeshSpec, Plan, PPOSettings, StagePlan
from pipe_rlhf_jax.data.loaders import PromptLoader
from pipe_rlhf_jax.generation import SamplingSettings
from pipe_rlhf_jax.models.tokenizer import ByteTokenizer
from pipe_rlhf_jax.ppo.registry import rule_answers, score_rule
from pipe_rlhf_jax.ppo.types import decode_answers, encode_answers
from pipe_rlhf_jax.system import Models, PPOSystem, run

TOK = ByteTokenizer()


def test_answers_round_trip_as_nul_padded_bytes():
  answers = ["42", "\\frac{1}{2}", "é"]
  raw = encode_answers(answers, 12)
  assert raw.dtype == np.uint8 and raw.shape == (3, 12)
  assert decode_answers(raw) == answers
  with pytest.raises(ValueError, match="at most 2 bytes"):
    encode_answers(["123"], 2)


def test_score_rule_passes_answers_only_to_rules_that_take_them():
  plain = lambda prompts, completions: [len(c) for c in completions]
  def needs(prompts, completions, answers):
    return [float(c == a) for c, a in zip(completions, answers)]
  def optional(prompts, completions, answers=None):
    return [0.5 if answers is None else 1.0] * len(completions)
  assert [rule_answers(f) for f in (plain, needs, optional)] == ["no", "required",
                                                                   "optional"]
  args = (["p", "q"], ["42", "7"])
  np.testing.assert_array_equal(score_rule(plain, *args, ["42", "8"]), [2, 1])
  np.testing.assert_array_equal(score_rule(needs, *args, ["42", "8"]), [1, 0])
  np.testing.assert_array_equal(score_rule(optional, *args), [0.5, 0.5])
  np.testing.assert_array_equal(score_rule(optional, *args, ["1", "2"]), [1, 1])
  with pytest.raises(ValueError, match="carry none.*'answer' field"):
    score_rule(needs, *args)
  with pytest.raises(ValueError, match="one score per completion"):
    score_rule(lambda p, c: [1.0], *args)


def _pairing_rule(seen: list):
  def rule(prompts, completions, answers):
    seen.append(list(zip(prompts, answers)))
    return [float(a == "a" + p.strip().removeprefix("q").removesuffix("="))
            for p, a in zip(prompts, answers)]
  return rule


def _system(plan: Plan, rule):
  cfg = models.tiny_config(vocab_size=TOK.vocab_size, embed_dim=32, num_layers=2, num_heads=2,
                           num_kv_heads=1, head_dim=16, mlp_dim=64, eos_token_id=TOK.eos_id,
                           bos_token_id=TOK.bos_id, pad_token_id=TOK.pad_id)
  policy = models.init_model(cfg, seed=0)
  return PPOSystem(
      Models.from_policy(policy, critic_from=None, reference=False),
      ppo=PPOSettings(steps=2, batch_size=16, minibatch_size=8, actor_lr=1e-3, kl_coef=0.0,
                    advantage_estimator="grpo", group_size=2, whiten_advantages=False),
      sampling=SamplingSettings(max_new_tokens=3, eos_id=TOK.eos_id, pad_id=TOK.pad_id),
      plan=plan, reward_fn=rule, eval_fn=rule, decode=TOK.decode)


# Sequential mode in the slow tier: the pipe run (the cheaper one here) hands rows through
# the queues between stages, where a misrouted answer would show.
@pytest.mark.parametrize("mode", [pytest.param("sequential", marks=pytest.mark.slow), "pipe"])
def test_each_row_reaches_the_rule_with_its_own_answer(mode):
  plan = (Plan(mode="sequential") if mode == "sequential" else
             Plan(mode="pipe", max_staleness=1, placement=(2, 2, 4),
                           generate=StagePlan(MeshSpec(data=1, pipeline=2), num_microbatches=2)))
  seen = []
  system = _system(plan, _pairing_rule(seen))
  records = [{"prompt": f"q{i}=", "answer": f"a{i}"} for i in range(24)]
  prompts = PromptLoader(records, TOK, 8, 8, seed=0, answer_len=8)
  result = run(system, prompts, steps=2)
  assert [m["reward/mean"] for m in result.metrics] == [1.0, 1.0]
  assert [m["rule_reward/mean"] for m in result.metrics] == [1.0, 1.0]
  # Reward and eval rule each saw every step's 16 rows: 8 prompts, each twice in a row.
  assert len(seen) == 4 and all(len(batch) == 16 for batch in seen)
  for batch in seen:
    assert batch[0::2] == batch[1::2]
    assert len({p for p, _ in batch}) == 8


def test_a_rule_that_needs_answers_names_the_missing_field():
  system = _system(Plan(mode="sequential"), _pairing_rule([]))
  prompts = PromptLoader([{"prompt": f"q{i}="} for i in range(8)], TOK, 8, 8, seed=0)
  with pytest.raises(ValueError, match="'answer' field"):
    run(system, prompts, steps=1)
