"""The library API: typed settings, `Models.from_policy`, `run`, and the README's example."""

import os
import re

import jax.numpy as jnp
import numpy as np
import pytest

from pipe_rlhf_jax import models
from pipe_rlhf_jax.config import MeshSpec, Plan, PPOSettings, StagePlan
from pipe_rlhf_jax.generation import SamplingSettings
from pipe_rlhf_jax.ppo.registry import REWARD_FUNCTIONS
from pipe_rlhf_jax.system import Models, PPOSystem, prompts_from_texts, run
from tests.helpers.hf_helpers import write_tiny_llama

README = os.path.join(os.path.dirname(__file__), "..", "..", "README.md")


def readme_example() -> str:
  text = open(README, encoding="utf-8").read()
  match = re.search(r"<!-- library-example -->\n```python\n(.*?)```", text, re.S)
  assert match, "README lost its library example"
  return match.group(1)


def test_readme_library_example_runs(tmp_path, monkeypatch, capsys):
  write_tiny_llama(tmp_path / "tiny-llama")
  monkeypatch.chdir(tmp_path)
  scope = {}
  exec(compile(readme_example(), "README.md", "exec"), scope)
  result = scope["result"]
  assert len(result.metrics) == 3
  assert all(np.isfinite(m["reward/mean"]) and np.isfinite(m["kl/mean"])
             for m in result.metrics)
  assert max(m["staleness/actor"] for m in result.metrics) <= 1
  assert (tmp_path / "gantt.png").stat().st_size > 0
  assert result.data_state is not None  # prompts_from_texts is resumable
  assert scope["system"].version == 3
  printed = capsys.readouterr().out.strip().splitlines()[-1]
  assert printed.startswith("[") and len(printed.split(",")) == 3


def _tiny_system(tmp_path, batch_size=8, reward_fn=lambda p, c: [len(x) for x in c],
                 **plan):
  path = write_tiny_llama(tmp_path / "m")
  tok = models.load_tokenizer(path)
  system = PPOSystem(
      Models.from_policy(models.from_pretrained(path)),
      ppo=PPOSettings(steps=2, batch_size=batch_size, minibatch_size=batch_size,
                    actor_lr=1e-3),
      sampling=SamplingSettings(max_new_tokens=4, eos_id=tok.eos_id, pad_id=tok.pad_id),
      plan=Plan(**plan), reward_fn=reward_fn, decode=tok.decode)
  return system, tok


@REWARD_FUNCTIONS.register("test_nan_for_the_third_completion")
def _nan_for_the_third_completion(prompts, completions):
  del prompts
  return [float("nan") if i == 2 else 1.0 for i in range(len(completions))]


def test_a_rule_reward_that_returns_nan_stops_the_step_naming_rule_and_sample(tmp_path):
  # One NaN score would reach every advantage of the batch through the whitening.
  system, tok = _tiny_system(tmp_path, reward_fn=_nan_for_the_third_completion)
  texts = [f"rev {w}=" for w in "abcdefgh"]
  with pytest.raises(ValueError, match=r"reward function 'test_nan_for_the_third_completion' "
                                       r"scored completion 2 of the batch nan \(prompt "
                                       r"'rev c=', completion '.*'\).*finite score"):
    run(system, prompts_from_texts(texts, tok, 8, 8, shuffle=False), steps=1)
  assert system.version == 0  # no update was applied


def test_rule_scores_are_one_finite_number_per_completion():
  from pipe_rlhf_jax.ppo.registry import score_rule
  prompts, completions = ["rev ab=", "rev ba="], ["ba", "x" * 200]
  assert score_rule(lambda p, c: [0.5, 1], prompts, completions).dtype == np.float32
  with pytest.raises(ValueError, match=r"reward function '<lambda>' returned scores of shape "
                                       r"\(3,\) for 2 completions"):
    score_rule(lambda p, c: [0.0, 1.0, 2.0], prompts, completions)
  # Finite in float64, not in the float32 the advantages are computed in.
  with pytest.raises(ValueError, match=r"completion 1 of the batch inf .*'x{80}\.\.\.'"):
    score_rule(lambda p, c: [0.0, 1e39], prompts, completions)


@pytest.mark.slow
def test_run_continues_from_the_systems_version(tmp_path):
  system, tok = _tiny_system(tmp_path)
  prompts = prompts_from_texts([f"rev {w}=" for w in "abcdefgh"], tok, 8, 8)
  first = run(system, prompts, steps=1)
  second = run(system, prompts, steps=1)
  assert system.version == 2 and len(first.metrics) == len(second.metrics) == 1
  assert second.metrics[0]["version/actor"] == 1.0


def test_wrong_batch_size_and_non_iterator_prompts_are_refused(tmp_path):
  system, tok = _tiny_system(tmp_path)
  with pytest.raises(TypeError, match="prompts_from_texts"):
    run(system, ["rev ab="] * 4, steps=1)
  with pytest.raises(ValueError, match="ppo.batch_size=8"):
    run(system, prompts_from_texts(["rev ab="] * 8, tok, 2, 8), steps=1)


def test_prompt_ids_past_the_policys_vocabulary_are_refused_naming_row_id_and_size(tmp_path):
  # A tokenizer with added tokens yields ids the model has no embedding row for; the
  # lookup would fill NaN and the step run on without an error.
  system, tok = _tiny_system(tmp_path)
  vocab = system.vocab_size
  batch = next(prompts_from_texts([f"rev {w}=" for w in "abcdefgh"], tok, 8, 8,
                                  shuffle=False))
  batch["prompt_tokens"][3, -1] = vocab + 39
  with pytest.raises(ValueError, match=rf"prompt row 3 \(position 7\) holds token id "
                                       rf"{vocab + 39}, outside the policy's vocabulary of "
                                       rf"{vocab} ids"):
    run(system, iter([batch]), steps=1)
  assert system.version == 0  # nothing ran


@pytest.mark.long
def test_sampler_and_trainer_log_probs_agree_on_policy_and_differ_once_stale(tmp_path):
  # One model definition serves the sampler (token by token, KV cache) and the trainer
  # (whole sequences): at the same weights their log-probs of the sampled tokens agree
  # to float32 rounding. A rollout one version stale differs by the update between.
  texts = [f"rev {w}=" for w in "abcdefgh"]
  system, tok = _tiny_system(tmp_path)
  metrics = run(system, prompts_from_texts(texts, tok, 8, 8), steps=2).metrics
  for row in metrics:
    assert 0.0 <= row["logprob_gap/mean"] <= row["logprob_gap/max"] < 1e-4, row
  stale, tok = _tiny_system(tmp_path / "stale", mode="pipe", max_staleness=1,
                            placement=(2, 2, 4))
  rows = run(stale, prompts_from_texts(texts, tok, 8, 8), steps=3).metrics
  moved = [r["logprob_gap/max"] for r in rows if r["staleness/actor"] == 1]
  assert moved and min(moved) > 1e-3


def test_logprob_gap_by_hand():
  from pipe_rlhf_jax.stages.train import logprob_gap
  gap = logprob_gap(jnp.array([[-1.0, -2.0, -9.0]]), jnp.array([[-1.5, -2.0, 0.0]]),
                    jnp.array([[True, True, False]]))  # the padded token never counts
  assert float(gap["logprob_gap/max"]) == 0.5 and float(gap["logprob_gap/mean"]) == 0.25


def test_a_batch_that_does_not_split_over_the_mesh_is_refused_up_front(tmp_path):
  with pytest.raises(ValueError, match=r"ppo.batch_size=4 does not split over the 8 batch "
                                       r"shards of the generate stage.*give mesh fewer"):
    _tiny_system(tmp_path, batch_size=4)


def test_from_pretrained_accepts_dtype_objects_and_names(tmp_path):
  path = write_tiny_llama(tmp_path / "m")
  a = models.from_pretrained(path, dtype=jnp.bfloat16, param_dtype=np.dtype("float32"))
  b = models.from_pretrained(path, dtype="bfloat16", param_dtype="float32")
  assert a.config == b.config and a.config.dtype == "bfloat16"
  with pytest.raises(ValueError, match="model.dtype"):
    models.from_pretrained(path, dtype=jnp.int32)


def test_settings_name_the_bad_field():
  with pytest.raises(ValueError, match="ppo.batch_size=6 must be a multiple"):
    PPOSettings(steps=1, batch_size=6, minibatch_size=4)
  with pytest.raises(ValueError, match="ppo.kl_estimator"):
    PPOSettings(steps=1, batch_size=4, minibatch_size=4, kl_estimator="k9")
  with pytest.raises(ValueError, match="plan.placement"):
    Plan(mode="pipe")
  with pytest.raises(ValueError, match="plan.mode"):
    Plan(mode="async")
  with pytest.raises(ValueError, match="ppo has unknown fields \\['clip'\\]"):
    PPOSettings.from_config({"steps": 1, "batch_size": 4, "minibatch_size": 4, "clip": 0.1})


def test_settings_are_hashable_and_print_as_one_line():
  plan = Plan(mode="pipe", placement=(4, 2, 2), max_staleness=1,
                       generate=StagePlan(MeshSpec(data=1, pipeline=4), num_microbatches=8))
  assert hash(plan) == hash(Plan(mode="pipe", placement=(4, 2, 2), max_staleness=1,
                                          generate=StagePlan(MeshSpec(data=1, pipeline=4),
                                                             num_microbatches=8)))
  assert str(plan) == ("pipe[4+2+2 devices; generate: pipeline=4, infer: data=-1, "
                       "train: fsdp=-1, M=8, staleness<=1, queue=2]")


def test_experiment_config_converts_to_the_same_settings():
  from configs import quickstart
  config = quickstart.get_config()
  ppo = PPOSettings.from_config(config.ppo, seed=config.seed)
  assert ppo.clip_eps == config.ppo.clip_eps and ppo.steps == config.ppo.steps
  plan = Plan.from_config(config)
  assert plan.placement == (4, 2, 2) and plan.generate.num_microbatches == 8
  assert plan.generate.mesh == MeshSpec(data=1, fsdp=1, tensor=-1, pipeline=4)


def test_models_from_policy_checks_heads_and_reference(tmp_path):
  path = write_tiny_llama(tmp_path / "m")
  policy = models.from_pretrained(path)
  with pytest.raises(ValueError, match="reward model needs 'score'"):
    Models.from_policy(policy, reward_model=policy)
  m = Models.from_policy(policy)
  m.reference = m.critic
  with pytest.raises(ValueError, match="reference"):
    m.check(SamplingSettings(max_new_tokens=2))


@pytest.mark.slow
def test_per_stage_attention_and_remat_change_how_not_what(tmp_path):
  results = []
  for plan in (StagePlan(), StagePlan(attention="blockwise", remat="full", logits_chunk=3,
                                      scan_unroll=2)):
    system, tok = _tiny_system(tmp_path, generate=plan, infer=plan,
                               train=StagePlan(mesh=MeshSpec(data=1, fsdp=-1),
                                               attention=plan.attention, remat=plan.remat,
                                               logits_chunk=plan.logits_chunk,
                                               scan_unroll=plan.scan_unroll))
    prompts = prompts_from_texts([f"rev {w}=" for w in "abcdefgh"], tok, 8, 8)
    results.append(run(system, prompts, steps=2).metrics)
  for want, got in zip(*results):
    for key in ("reward/mean", "kl/mean", "policy_loss", "value_loss", "entropy"):
      np.testing.assert_allclose(got[key], want[key], rtol=1e-4, atol=1e-6, err_msg=key)


def test_stage_plan_names_a_bad_execution_field():
  with pytest.raises(ValueError, match="stages.train.remat='some'"):
    StagePlan.from_config({"remat": "some"}, "stages.train")
  with pytest.raises(ValueError, match="stages.train.scan_unroll=-1"):
    StagePlan.from_config({"scan_unroll": -1}, "stages.train")
  assert StagePlan.from_config({"scan_unroll": 4}, "stages.train").execution()[
      "scan_unroll"] == 4
  # Left out: 0, the library's choice: every layer unrolled (the model's own default)
  # unless the stage shards over fsdp or sets remat, where it loops; n >= 1 as given.
  assert StagePlan.from_config({}, "stages.train").scan_unroll == StagePlan().scan_unroll == 0
  assert models.tiny_config().scan_unroll == 0
  assert StagePlan().unroll_for(fsdp=1) == 0 and StagePlan(remat="full").unroll_for(1) == 1
  assert StagePlan().unroll_for(fsdp=4) == 1 and StagePlan(scan_unroll=2).unroll_for(4) == 2


@pytest.mark.slow
def test_adaptive_kl_coefficient_is_a_function_of_the_policy_version(tmp_path):
  from pipe_rlhf_jax.ppo.kl import adaptive_kl_coef
  path = write_tiny_llama(tmp_path / "m")
  tok = models.load_tokenizer(path)
  ppo = PPOSettings(steps=5, batch_size=8, minibatch_size=8, actor_lr=3e-3, kl_coef=0.1,
                  adaptive_kl=True, kl_target=1e-4, kl_horizon=8)
  system = PPOSystem(
      Models.from_policy(models.from_pretrained(path)), ppo=ppo,
      sampling=SamplingSettings(max_new_tokens=4, eos_id=tok.eos_id, pad_id=tok.pad_id),
      plan=Plan(mode="pipe", max_staleness=2, queue_size=2, placement=(2, 2, 4),
                            generate=StagePlan(MeshSpec(data=1, pipeline=2), num_microbatches=2)),
      reward_fn=lambda p, c: [len(x) for x in c], decode=tok.decode)
  metrics = run(system, prompts_from_texts([f"rev {w}=" for w in "abcdefgh"], tok, 8, 8),
                steps=5).metrics
  # The controller's trajectory: version v + 1's coefficient from version v's and the KL
  # of the batch trained at step v.
  coefs = [0.1]
  for m in metrics:
    coefs.append(float(adaptive_kl_coef(coefs[-1], m["kl/mean"], 8, 1e-4, 8)))
  for step, m in enumerate(metrics):
    version = int(m["version/actor"])
    assert m["staleness/actor"] == step - version
    np.testing.assert_allclose(m["kl_coef"], coefs[version], rtol=1e-6)
  assert len(set(coefs)) > 1  # the controller did move
  np.testing.assert_allclose(system.kl_coef, coefs[-1], rtol=1e-6)


def test_continuous_batching_changes_how_not_what(tmp_path):
  # The same two PPO steps, generation as one static batch and as a queue over 3 slots
  # whose admissions prefill the 8-column prompts in passes of 4 (the engine without
  # passes is held to the static sampler in tests/generation/test_engine.py).
  results = []
  for plan in (StagePlan(), StagePlan(num_slots=3, prefill_chunk=4)):
    system, tok = _tiny_system(tmp_path, generate=plan)
    prompts = prompts_from_texts([f"rev {w}=" for w in "abcdefgh"], tok, 8, 8)
    results.append(run(system, prompts, steps=2).metrics)
  for want, got in zip(*results):
    for key in ("reward/mean", "kl/mean", "policy_loss", "value_loss"):
      np.testing.assert_allclose(got[key], want[key], rtol=1e-4, atol=1e-6, err_msg=key)
  assert 0 < results[1][-1]["generate/slot_occupancy"] <= 1


def test_num_slots_is_a_generation_setting():
  with pytest.raises(ValueError, match="stages.generate.num_slots=-1"):
    StagePlan.from_config({"num_slots": -1}, "stages.generate")
  with pytest.raises(ValueError, match="stages.train.num_slots=4: only generation"):
    Plan(train=StagePlan(mesh=MeshSpec(data=1, fsdp=-1), num_slots=4))
  # The pipelined decoder refills micro-batches of num_slots / num_microbatches rows.
  Plan(mode="per_stage", generate=StagePlan(mesh=MeshSpec(pipeline=2), num_microbatches=2,
                                            num_slots=4))
  with pytest.raises(ValueError, match="num_slots=3 is not a multiple of "
                                       "stages.generate.num_microbatches=2"):
    Plan(mode="per_stage", generate=StagePlan(mesh=MeshSpec(pipeline=2), num_microbatches=2,
                                              num_slots=3))
  with pytest.raises(ValueError, match="the engine kept across updates is the plain"):
    Plan(mode="pipe", placement=(2, 1, 1), partial_rollouts=True,
         generate=StagePlan(mesh=MeshSpec(pipeline=2), num_slots=4))
  # Prefill passes belong to the plain engine.
  Plan(generate=StagePlan(num_slots=4, prefill_chunk=16))
  with pytest.raises(ValueError, match="stages.generate.prefill_chunk=-2"):
    StagePlan.from_config({"prefill_chunk": -2}, "stages.generate")
  for bad in (StagePlan(prefill_chunk=16),
              StagePlan(mesh=MeshSpec(pipeline=2), num_slots=4, prefill_chunk=16)):
    with pytest.raises(ValueError, match="stages.generate.prefill_chunk=16: prefill passes"):
      Plan(mode="per_stage", generate=bad)
  with pytest.raises(ValueError, match="stages.train.prefill_chunk=8"):
    Plan(generate=StagePlan(num_slots=4), train=StagePlan(mesh=MeshSpec(data=1, fsdp=-1),
                                                          prefill_chunk=8))


def test_partial_rollouts_in_pipe_mode_train_on_finished_groups(tmp_path):
  # Groups of 2 over 4 slots, two prompts a batch: unfinished rows stay in the engine
  # across updates; "drop" keeps every trained completion within the staleness bound.
  path = write_tiny_llama(tmp_path / "m")
  tok = models.load_tokenizer(path)
  plan = Plan(mode="pipe", placement=(1, 1, 1), max_staleness=1, partial_rollouts=True,
              past_staleness="drop", generate=StagePlan(num_slots=4), train=StagePlan())
  system = PPOSystem(
      Models.from_policy(models.from_pretrained(path), critic_from=None),
      ppo=PPOSettings(steps=3, batch_size=4, minibatch_size=4, actor_lr=1e-3, group_size=2,
                    advantage_estimator="grpo", whiten_advantages=False,
                    loss="decoupled_ppo_clip"),
      sampling=SamplingSettings(max_new_tokens=12, eos_id=tok.eos_id, pad_id=tok.pad_id),
      plan=plan, reward_fn=lambda p, c: [len(x) for x in c], decode=tok.decode)
  texts = [f"rev {w}=" for w in "abcdefghijklmnop"]
  result = run(system, prompts_from_texts(texts, tok, 2, 8, shuffle=False), steps=3)
  assert system.version == 3
  for m in result.metrics:
    assert np.isfinite(m["policy_loss"]) and m["staleness/oldest_token"] <= 1
    assert m["rollout/past_staleness"] == 0
  # The prompts held travel with the data state, and stay in the system's engine for a
  # next `run` to continue.
  stream = system.rollout_stream()
  assert len(result.data_state["in_flight"]) == len(stream.data_state(None)["in_flight"])
  assert stream.decoding or stream.pending


def test_partial_rollouts_need_pipe_mode_and_slots():
  with pytest.raises(ValueError, match=r"plan.partial_rollouts=True needs "
                                       r"plan.mode='pipe' and stages.generate.num_slots"):
    Plan(partial_rollouts=True, generate=StagePlan(num_slots=4))
  with pytest.raises(ValueError, match="plan.partial_rollouts=True needs"):
    Plan(mode="pipe", placement=(1, 1, 1), partial_rollouts=True)
  with pytest.raises(ValueError, match="plan.past_staleness"):
    Plan(past_staleness="later")
