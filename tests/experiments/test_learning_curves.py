"""experiments/learning_curves.py: cells, statistics over seeds, goal checks, settings.

The end-to-end path (warm start once per seed, cells from its checkpoint) is exercised by
tests/phases/test_warm_start.py through the same `train` functions; these tests check the
experiment's own arithmetic against hand-computed values.
"""

import json

import jax
import numpy as np
import pytest

from experiments import learning_curves as lc
from pipe_rlhf_jax.concurrency.tracing import Tracer
from pipe_rlhf_jax.phases.run_state import JobResult
from tests.helpers.configs import tiny_quickstart


def test_cells_set_mode_staleness_and_objective():
  assert lc.cell_overrides("sequential") == {"plan.mode": "sequential",
                                             "plan.max_staleness": 0}
  assert lc.cell_overrides("pipe_s2") == {"plan.mode": "pipe", "plan.max_staleness": 2,
                                          "ppo.loss": "ppo_clip"}
  assert lc.cell_overrides("decoupled_s4") == {
      "plan.mode": "pipe", "plan.max_staleness": 4, "ppo.loss": "decoupled_ppo_clip"}
  with pytest.raises(ValueError, match="unknown cell 'pipe4'"):
    lc.cell_overrides("pipe4")


def test_overrides_keep_types_and_name_bad_paths():
  config = tiny_quickstart()
  lc.apply_overrides(config, {"ppo.kl_coef": 1, "ppo.steps": 7, "plan.mode": "pipe"})
  assert config.ppo.kl_coef == 1.0 and isinstance(config.ppo.kl_coef, float)
  assert config.ppo.steps == 7 and config.plan.mode == "pipe"
  with pytest.raises(ValueError, match="--set ppo.kl_cof: the config has no field 'kl_cof'"):
    lc.apply_overrides(config, {"ppo.kl_cof": 0.1})
  with pytest.raises(ValueError, match="no field 'pp' on that path"):
    lc.apply_overrides(config, {"pp.kl_coef": 0.1})
  assert lc.parse_value("3e-4") == 3e-4 and lc.parse_value("pipe") == "pipe"


def run(seed, cell, curve, greedy=(0.5, 0.6), kl=1.0, per_prompt=None):
  """A finished run's record; `per_prompt`: (before, after) lists of the greedy scores."""
  record = {"seed": seed, "cell": cell, "acc_start": curve[0],
            "acc_final": float(np.mean(curve[-1:])), "gain": curve[-1] - curve[0],
            "kl_end": kl, "greedy_before": greedy[0], "greedy_after": greedy[1],
            "samples_per_s": 10.0, "reward_final": 1.0, "staleness_mean": 0.0,
            "curve": curve}
  if per_prompt is not None:
    record.update(greedy_before_per_prompt=per_prompt[0],
                  greedy_after_per_prompt=per_prompt[1])
  return record


def test_aggregate_mean_std_paired_difference_and_worse_greedy():
  runs = [run(0, "sequential", [0.5, 0.7]), run(1, "sequential", [0.5, 0.9]),
          run(0, "pipe_s1", [0.5, 0.6], greedy=(0.5, 0.4)),
          run(1, "pipe_s1", [0.5, 0.4])]
  table = {r["cell"]: r for r in lc.aggregate(runs, ["sequential", "pipe_s1"])}
  seq, pipe = table["sequential"], table["pipe_s1"]
  assert seq["acc_final"] == pytest.approx((0.8, np.sqrt(0.02)))  # sample std of .7, .9
  assert pipe["acc_final"] == pytest.approx((0.5, np.sqrt(0.02)))
  assert pipe["gain_min"] == pytest.approx(-0.1)
  # Paired by seed: 0.6 - 0.7 and 0.4 - 0.9.
  assert pipe["vs_sequential"] == pytest.approx((-0.3, np.std([-0.1, -0.5], ddof=1)))
  assert pipe["greedy_worse"] == 1 and seq["greedy_worse"] == 0
  checks = "\n".join(lc.goal_checks(lc.aggregate(runs, ["sequential", "pipe_s1"]), runs))
  assert ("pipe_s1 final accuracy vs sequential: -0.300 (one std: 0.141): does NOT hold; "
          "per seed -0.100, -0.500") in checks
  assert "pipe_s1: the gain is not positive in every seed (min -0.100)" in checks
  assert "pipe_s1: greedy answers got worse in 1 of 2 seeds" in checks
  assert "- sequential:" not in checks  # positive gains, greedy never worse
  # Without per-prompt scores nothing is said about significance.
  assert pipe["greedy_worse_95"] is None
  assert "| 1/2 (-) |" in lc.format_table(lc.aggregate(runs, ["sequential", "pipe_s1"]))


def test_sampled_heldout_gain_per_cell():
  runs = []
  for seed, after in ((0, [0.75, 0.5, 0.5, 1.0]), (1, [0.25, 0.5, 0.5, 0.5])):
    record = run(seed, "sequential", [0.5, 0.7])
    record.update(sampled_k=4, sampled_before=0.5, sampled_after=float(np.mean(after)),
                  sampled_before_per_prompt=[0.5] * 4, sampled_after_per_prompt=after)
    runs.append(record)
  row = lc.aggregate(runs, ["sequential"])[0]
  assert row["sampled_gain"] == pytest.approx((0.0625, np.std([0.1875, -0.0625], ddof=1)))
  assert row["sampled_gain_min"] == pytest.approx(-0.0625)
  assert (row["sampled_worse"], row["sampled_worse_95"]) == (1, 0)
  assert "| 0.500 → 0.562 | +0.062 ± 0.177 (-0.062) | 1/2 (0) |" in lc.format_table([row])
  checks = "\n".join(lc.goal_checks([row], runs))
  assert "sequential: the held-out sampled score fell in 1 of 2 seeds, beyond the 95% " \
         "interval over prompts in 0" in checks
  # The gain check reads the held-out sampled gain (its start is 4 x 256 answers, the
  # curve's one batch): here the curves rose in both seeds, the held-out score fell in one.
  assert "sequential: the held-out sampled gain is not positive in every seed " \
         "(min -0.062)" in checks
  assert "sequential: the gain is not positive" not in checks


def test_greedy_worse_beyond_the_interval_needs_a_drop_the_prompts_do_not_explain():
  # Seed 0: 2 prompts of 64 worse, 1 better (a fall of 1/64 that a resample of the prompts
  # can turn into a rise); seed 1: 40 of 64 prompts fell from 1 to 0.
  noise = ([1.0] * 64, [0.0, 0.0] + [1.0] * 62)
  noise[0][2] = 0.0
  drop = ([1.0] * 64, [0.0] * 40 + [1.0] * 24)
  runs = [run(0, "sequential", [0.5, 0.7], per_prompt=([1.0] * 64, [1.0] * 64)),
          run(0, "pipe_s1", [0.5, 0.7], greedy=(63 / 64, 62 / 64), per_prompt=noise),
          run(1, "pipe_s1", [0.5, 0.7], greedy=(1.0, 24 / 64), per_prompt=drop)]
  table = {r["cell"]: r for r in lc.aggregate(runs, ["sequential", "pipe_s1"])}
  assert table["pipe_s1"]["greedy_worse"] == 2 and table["pipe_s1"]["greedy_worse_95"] == 1
  assert table["sequential"]["greedy_worse_95"] == 0
  assert "| 2/2 (1) |" in lc.format_table(lc.aggregate(runs, ["sequential", "pipe_s1"]))
  checks = "\n".join(lc.goal_checks(lc.aggregate(runs, ["sequential", "pipe_s1"]), runs))
  assert ("pipe_s1: greedy answers got worse in 2 of 2 seeds, beyond the 95% interval over "
          "prompts in 1") in checks
  assert "seed 1 pipe_s1: greedy -0.625" in checks and "40 prompts worse / 0 better" in checks
  assert "seed 0 pipe_s1: greedy" not in checks


def test_summarise_run_reads_the_heldout_scores_of_eval_fn():
  config = tiny_quickstart("sequential")
  rows = [{"step": s, "rule_reward/mean": acc, "reward/mean": 1.0 + s, "kl/mean": 0.1 * s}
          for s, acc in enumerate([0.2, 0.3, 0.4, 0.5, 0.6])]
  result = JobResult(workdir="", summary="", wall_s=1.0, ppo_metrics=rows,
                     rm_eval={"eval_accuracy": 0.9}, tracer=Tracer(),
                     heldout_before={"reverse_accuracy": 0.25},
                     heldout_after={"reverse_accuracy": 0.75}, heldout_prompts=2,
                     heldout_per_prompt={"before": {"reverse_accuracy": [0.5, 0.0]},
                                         "after": {"reverse_accuracy": [1.0, 0.5]}})
  summary = lc.summarise_run(result, config, seed=0, cell="sequential", wall_s=1.0)
  assert (summary["greedy_before"], summary["greedy_after"]) == (0.25, 0.75)
  assert summary["greedy_prompts"] == 2
  assert summary["greedy_before_per_prompt"] == [0.5, 0.0]
  assert summary["greedy_after_per_prompt"] == [1.0, 0.5]
  assert summary["acc_start"] == 0.2 and summary["acc_final"] == pytest.approx(0.6)
  assert summary["rm_eval_accuracy"] == 0.9


def test_summarise_run_reads_an_environments_reward_and_tool_calls():
  from tests.envs.test_episodes import Echo  # noqa: F401  (registers "test_echo")
  config = tiny_quickstart("sequential", {"env.name": "test_echo", "reward.fn": "environment",
                                          "reward.eval_fn": ""})
  rows = [{"step": s, "reward/mean": acc, "env/tool_call_rate": 0.5 + s / 10}
          for s, acc in enumerate([0.2, 0.4, 0.6])]
  heldout = lambda v, t: {"test_echo": v, "test_echo_tool_calls": t}
  result = JobResult(workdir="", summary="", wall_s=1.0, ppo_metrics=rows, rm_eval=None,
                     tracer=Tracer(), heldout_before=heldout(0.0, 0.5),
                     heldout_after=heldout(1.0, 1.0), heldout_prompts=2,
                     heldout_per_prompt={"before": heldout([0.0, 0.0], [1.0, 0.0]),
                                         "after": heldout([1.0, 1.0], [1.0, 1.0])})
  summary = lc.summarise_run(result, config, seed=0, cell="sequential", wall_s=1.0)
  assert summary["curve"] == [0.2, 0.4, 0.6]  # the environment's reward: PPO's own
  assert (summary["greedy_before"], summary["greedy_after"]) == (0.0, 1.0)
  assert (summary["tool_before"], summary["tool_after"]) == (0.5, 1.0)
  assert summary["tool_curve"] == [0.5, 0.6, 0.7]
  assert "greedy tool-call rate" in lc.format_runs([summary])


def test_run_config_needs_heldout_prompts():
  # The tiny variant scores no held-out prompts (log.eval_prompts=0): refused by name.
  args = lc.parse_args(["--config", "configs/quickstart.py:tiny"])
  with pytest.raises(ValueError, match="log.eval_prompts is 0"):
    lc.run_config(args, 0, None, None)
  args = lc.parse_args(["--config", "configs/quickstart.py:tiny",
                        "--set", "log.eval_prompts=16"])
  assert lc.run_config(args, 0, None, None).log.eval_prompts == 16


def test_smooth_is_a_trailing_mean():
  np.testing.assert_allclose(lc.smooth([1.0, 3.0, 5.0, 7.0], 2), [1.0, 2.0, 4.0, 6.0])
  np.testing.assert_allclose(lc.smooth([1.0, 3.0], 1), [1.0, 3.0])


def test_samples_per_s_leaves_out_the_compiling_updates():
  tracer = Tracer()
  for step, end in enumerate([10.0, 12.0, 13.0, 14.0, 15.0]):
    tracer.add("train", end - 0.5, end, batch=step)
  # Updates 2..4 end 1 s apart after update 1 ended at 12: 3 batches of 8 in 3 s.
  assert lc.steady_samples_per_s(tracer, batch_size=8) == pytest.approx(8.0)


def test_settings_of_another_experiment_are_refused(tmp_path):
  settings = {"command": "x", "config": "c.py", "overrides": {"ppo.kl_coef": 0.3},
              "steps": 60, "eval_fn": "reverse_accuracy",
              "ppo": {"kl_coef": 0.3, "kl_policy": "behaviour"}, "reward": {"fn": "model"}}
  lc.check_settings(str(tmp_path), settings)
  lc.check_settings(str(tmp_path), {**settings, "command": "y"})  # same experiment
  with pytest.raises(SystemExit, match="pass another --tag"):
    lc.check_settings(str(tmp_path), {**settings, "overrides": {}})
  # A changed default of the config (no override says so) is refused too.
  with pytest.raises(SystemExit, match="kl_policy"):
    lc.check_settings(str(tmp_path), {**settings, "ppo": {"kl_coef": 0.3,
                                                          "kl_policy": "proximal"}})
  assert json.load(open(tmp_path / "settings.json"))["command"] == "y"


def test_a_locked_run_is_passed_over(tmp_path):
  path = str(tmp_path / "seed0" / "pipe_s1.lock")
  with lc.locked(path) as first:
    with lc.locked(path, wait=False) as second:
      assert first and not second
  with lc.locked(path, wait=False) as again:
    assert again  # released


@pytest.mark.long
@pytest.mark.slow
def test_experiment_end_to_end(tmp_path):
  # The experiment on the tiny quickstart: the seed's warm start into the store beside
  # --out, one pipe cell from it, its per-prompt held-out scores, the table.
  out = str(tmp_path / "tiny")
  argv = ["--config", "configs/quickstart.py:tiny", "--steps", "2", "--seeds", "0",
          "--cells", "pipe_s1", "--set", "log.eval_prompts=16",
          "--set", "log.eval_samples_per_prompt=2", "--out", out]
  assert lc.main(argv) == 0
  path = tmp_path / "tiny" / "seed0" / "pipe_s1" / "run.json"
  recorded = json.loads(path.read_text())
  assert len(recorded["greedy_after_per_prompt"]) == recorded["greedy_prompts"] == 16
  assert np.mean(recorded["greedy_after_per_prompt"]) == pytest.approx(
      recorded["greedy_after"], abs=1e-6)
  assert recorded["sampled_k"] == 2 and len(recorded["sampled_after_per_prompt"]) == 16
  assert np.mean(recorded["sampled_before_per_prompt"]) == pytest.approx(
      recorded["sampled_before"], abs=1e-6)
  assert (tmp_path / "warm_starts").is_dir()
  table = (tmp_path / "tiny" / "table.md").read_text()
  assert "| pipe_s1 | 1 |" in table
  assert recorded["host"].endswith(f"jax {jax.__version__}") and recorded["host"] in table



def test_greedy_goal_needs_the_gain_and_an_interval_above_zero_in_every_seed():
  # Seed 0: 20 of 64 prompts went from 0 to 1 (+0.31); seed 1: 8 of 64 (+0.125).
  big = ([0.0] * 64, [1.0] * 20 + [0.0] * 44)
  small = ([0.0] * 64, [1.0] * 8 + [0.0] * 56)
  runs = [run(0, "sequential", [0.1, 0.3], greedy=(0.0, 20 / 64), per_prompt=big),
          run(1, "sequential", [0.1, 0.3], greedy=(0.0, 8 / 64), per_prompt=small)]
  lines = lc.greedy_goal_lines(runs, 0.2)
  assert len(lines) == 1 and "in 1 of 2 seeds: does NOT hold" in lines[0]
  assert "seed 0 +0.312" in lines[0] and "seed 1 +0.125" in lines[0]
  assert "in 2 of 2 seeds: holds" in lc.greedy_goal_lines(runs, 0.1)[0]
  per_run = lc.format_runs([{**r, "wall_s": 60.0, "tokens_per_s": {"generate": 12.0}}
                            for r in runs])
  assert "0.000 → 0.312 (+0.312, 95% interval [+" in per_run and "| 60 | 12 / - / - |" in per_run


def test_stage_tokens_per_s_count_each_stages_own_tokens_after_compiling():
  tracer = Tracer()
  for step in range(4):  # each stage takes 1, 2 and 4 seconds a step
    tracer.add("generate", 10 * step, 10 * step + 1, batch=step)
    tracer.add("infer", 10 * step + 1, 10 * step + 3, batch=step)
    tracer.add("train", 10 * step + 3, 10 * step + 7, batch=step)
  rows = [{"response_length/mean": 10.0} for _ in range(4)]
  rates = lc.stage_tokens_per_s(tracer, rows, batch_size=8, prompt_len=30, epochs=2)
  # Steps 2 and 3: 2 x 8 x 10 completion tokens in 2 s; 2 x 8 x 40 tokens in 4 s; twice
  # that (two epochs) in 8 s.
  assert rates == pytest.approx({"generate": 80.0, "infer": 160.0, "train": 160.0})


def test_a_configs_own_pipe_mode_is_applied_to_pipe_cells(tmp_path):
  module = tmp_path / "cfg.py"
  module.write_text(
      "from configs import quickstart\n"
      "def get_config(variant=''):\n"
      "  config = quickstart.get_config()\n"
      "  config.plan.num_devices = 1\n"
      "  return config\n"
      "def use_pipe_mode(config, max_staleness):\n"
      "  config.plan.num_devices = 3\n"
      "  config.plan.placement.update(generate=1, infer=1, train=1)\n")
  args = lc.parse_args(["--config", str(module), "--out", str(tmp_path / "out")])
  pipe = lc.run_config(args, 0, "pipe_s2", str(tmp_path))
  assert (pipe.plan.mode, pipe.plan.max_staleness, pipe.plan.num_devices) == (
      "pipe", 2, 3)
  assert lc.run_config(args, 0, "sequential", str(tmp_path)).plan.num_devices == 1


def test_partial_cells_run_the_slot_engine_across_updates(tmp_path):
  # partial_s<k>: pipe mode, partial rollouts, the decoupled loss, a generation mesh
  # without a pipeline axis and one slot per completion of a batch; the plan is valid.
  from pipe_rlhf_jax.config import Plan
  args = lc.parse_args(["--config", "configs/quickstart.py", "--out", str(tmp_path)])
  config = lc.run_config(args, 0, "partial_s1", str(tmp_path))
  assert config.plan.partial_rollouts and config.ppo.loss == "decoupled_ppo_clip"
  assert config.stages.generate.num_slots == config.ppo.batch_size
  plan = Plan.from_config(config)
  assert plan.generate.mesh.pipeline == 1 and plan.max_staleness == 1
