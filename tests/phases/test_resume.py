"""How a resumed run reads the plan its checkpoint recorded (phases/resume.py)."""

import logging

from pipe_rlhf_jax.config import MeshSpec, Plan, StagePlan
from pipe_rlhf_jax.phases import resume
from pipe_rlhf_jax.phases.ppo_loop import plan_of


def _plan():
  return Plan(mode="pipe", max_staleness=1, placement=(2, 2, 4),
              generate=StagePlan(MeshSpec(data=1, pipeline=2), num_microbatches=4))


def _with_old_axis_name(node):
  if not isinstance(node, dict):
    return node
  return {("pipe" if k == "pipeline" else k): _with_old_axis_name(v) for k, v in node.items()}


def test_a_plan_saved_under_the_old_axis_name_reads_as_the_same_plan(caplog):
  current = plan_of(_plan(), devices=list(range(8)))
  saved = _with_old_axis_name(current)
  assert saved["generate"]["mesh"]["pipe"] == 2 and saved["mode"] == "pipe"
  with caplog.at_level(logging.WARNING):
    resume.compare_plans(saved, current)
  assert not caplog.records


def test_a_changed_plan_is_named(caplog):
  current = plan_of(_plan(), devices=list(range(8)))
  saved = {**current, "mode": "sequential", "max_staleness": 0}
  with caplog.at_level(logging.WARNING):
    resume.compare_plans(saved, current)
  text = caplog.text
  assert "max_staleness: 0 -> 1" in text and "mode: 'sequential' -> 'pipe'" in text
  assert "may now lag the policy by up to 1 update(s) instead of 0" in text
