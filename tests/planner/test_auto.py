"""The planner in the main job: plan.choose='auto' runs the planner's best plan and reports
predicted vs measured s/step; a hand-written plan the planner rejects fails before any
data are built or anything compiles."""

import json
import os

import jax
import pytest

from configs import quickstart
from pipe_rlhf_jax.concurrency import tracing
from pipe_rlhf_jax.concurrency.tracing import Tracer
from pipe_rlhf_jax.config import ExperimentSettings, MeshSpec, Plan, StagePlan
from pipe_rlhf_jax.models.tokenizer import load_tokenizer
from pipe_rlhf_jax.planner import auto, hardware, search
from pipe_rlhf_jax.train import train
from tests.helpers.configs import tiny_quickstart


def test_steady_step_time_skips_the_compiling_steps():
  tracer = Tracer()
  # Batch k's train span ends at 10, 11, 13, 16, 20 (sync spans end earlier or later).
  for k, end in enumerate((10.0, 11.0, 13.0, 16.0, 20.0)):
    tracer.add("train", end - 0.5, end, batch=k)
    tracer.add("sync", end - 1.0, end - 0.7, batch=k)
  assert tracing.completion_times(tracer) == [10.0, 11.0, 13.0, 16.0, 20.0]
  assert tracing.steady_step_time(tracer, warmup=2) == pytest.approx((20 - 13) / 2)
  assert tracing.steady_step_time(tracer, warmup=0) == pytest.approx((20 - 10) / 4)
  tracer.add("sync", 20.0, 21.0, batch=4)  # pipe mode: the sync after the update counts
  assert tracing.steady_step_time(tracer, warmup=10) == pytest.approx(21 - 16)
  one = Tracer()
  one.add("train", 0.0, 1.0, batch=0)
  assert tracing.steady_step_time(one) is None


def test_hardware_is_detected_or_named():
  cpu = auto.detect_hardware(jax.devices())
  assert cpu.name == "cpu" and cpu.shared_host
  assert cpu.devices_per_host == jax.local_device_count() == 8
  assert cpu.hbm_bytes == pytest.approx(os.sysconf("SC_PAGE_SIZE")
                                        * os.sysconf("SC_PHYS_PAGES"))
  assert auto.detect_hardware(jax.devices(), "h100") is hardware.get("h100")
  with pytest.raises(ValueError, match="plan.hardware: unknown hardware 'h1000'"):
    auto.detect_hardware(jax.devices(), "h1000")


def test_bad_plan_fields_name_the_field(tmp_path):
  with pytest.raises(ValueError, match=r"plan.choose='best'; choose one of"):
    train(tiny_quickstart(overrides={"plan.choose": "best"}), str(tmp_path), progress=False)
  with pytest.raises(ValueError, match=r"plan.calibration='nope.json' is not a file"):
    config = tiny_quickstart(overrides={"plan.choose": "auto", "plan.calibration": "nope.json"})
    train(config, str(tmp_path), progress=False)


@pytest.mark.slow
def test_auto_applies_the_best_plan_and_reports_predicted_vs_measured(tmp_path):
  config = tiny_quickstart(overrides={"plan.choose": "auto"})
  workdir = str(tmp_path / "run")
  result = train(config, workdir, progress=False)
  # The plan that ran is the search's first, with staleness at most the config's bound.
  settings = ExperimentSettings.from_config(config)
  cfgs = settings.model.role_configs(load_tokenizer("byte"))
  m = auto.machine_of(settings, jax.devices())
  work = auto.workload(settings, cfgs["actor"], 8, m.hw.devices_per_host)
  best = search.search(work, m, auto.options_of(settings), k=1)[0][0]
  saved = json.load(open(os.path.join(workdir, "config.json")))
  ran = Plan.from_config(quickstart.ml_collections.ConfigDict(saved))
  assert ran == best.plan and ran.max_staleness <= config.plan.max_staleness
  # The summary and the metrics carry predicted and measured steady s/step.
  line = next(x for x in result.summary.splitlines() if "steady s/step" in x)
  assert f"{best.step_time:.4g} predicted (cpu, planner's choice)" in line
  assert "measured" in line and "not measured" not in line
  rows = [json.loads(x) for x in open(os.path.join(workdir, "metrics.jsonl"))]
  plan_row = next(r for r in rows if r["phase"] == "plan")
  assert plan_row["plan/predicted_step_s"] == pytest.approx(best.step_time)
  assert plan_row["plan/measured_step_s"] > 0


def _rejected_before_building(config, tmp_path, match):
  workdir = tmp_path / "run"
  with pytest.raises(ValueError, match=match):
    train(config, str(workdir), progress=False)
  # Nothing after set_up ran: no datasets built, no warm start trained.
  assert not (workdir / "data").exists() and not (workdir / "warmstart").exists()


def test_hand_written_plan_that_splits_the_batch_unevenly_fails_first(tmp_path):
  # Training on fsdp=4 cannot split a batch of 10 rollouts: the system's own check fires
  # in set_up, before SFT and the reward model, with the planner's wording around it.
  config = tiny_quickstart(overrides={"ppo.batch_size": 10, "ppo.minibatch_size": 5,
                                     "stages.generate.num_microbatches": 2})
  _rejected_before_building(config, tmp_path, r"hand-written plan pipe\[2\+2\+4 devices.*"
                            r"ppo.batch_size=10 does not split over the 4 batch shards of "
                            r"the train stage")


def test_hand_written_plan_over_memory_fails_with_the_memory_models_reason(tmp_path):
  config = tiny_quickstart()
  # ~2.2e9 parameters per model: far over any host's RAM share of one virtual device.
  config.model.update(embed_dim=8192, mlp_dim=32768, num_heads=64, num_kv_heads=8,
                      head_dim=128)
  _rejected_before_building(config, tmp_path,
                            r"GiB per device on the .* devices, over the .* usable of cpu")


def test_pipe_plans_across_processes_place_stages_on_whole_processes():
  runnable = auto.runnable_across_processes
  pipe = lambda placement, **stages: Plan(mode="pipe", placement=placement,
                                                   **stages)
  # 2 processes x 4 devices: blocks of at most 4 devices lie in one process each.
  assert runnable(pipe((4, 2, 2)), processes=2, devices_per_process=4)
  # 4 processes x 2 devices: a 4-device stage spans two whole processes of its own.
  assert runnable(pipe((2, 2, 4)), processes=4, devices_per_process=2)
  assert runnable(pipe((4, 2, 2), generate=StagePlan(MeshSpec(data=1, pipeline=2, tensor=2))),
                  processes=4, devices_per_process=2)
  # A block that starts inside a process would share it with another stage.
  assert not runnable(pipe((2, 1, 5)), processes=2, devices_per_process=4)
  assert not runnable(pipe((3, 3, 2)), processes=4, devices_per_process=2)
  # A process's devices must be a rectangular block of the stage's mesh: data=3 x
  # tensor=2 cut into processes of 3 devices is not.
  assert not runnable(pipe((6, 3, 3), generate=StagePlan(MeshSpec(data=3, tensor=2))),
                      processes=4, devices_per_process=3)
  assert runnable(pipe((2, 1, 5)), processes=1, devices_per_process=8)
  assert runnable(Plan(mode="sequential"), processes=2, devices_per_process=4)
