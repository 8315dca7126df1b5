"""Multi-process runs on localhost: several JAX processes joined by jax.distributed.

Each test starts real processes (`pipe_rlhf_jax.launch.launch`, a free coordinator port
each time, hard timeouts, SIGKILL of anything left) running `tests/distributed/multihost_worker.py`,
and checks what they wrote. Marked `multihost` (deselect with `-m "not multihost"`); the
longer ones also `slow` (the default run keeps one run equality, pipe mode's staleness
bound, the failure stop and the transfers). Their hard bounds (600 s) are far above what
they take on an idle machine: they are there so that nothing can hang.
"""

import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from pipe_rlhf_jax.distributed import DistributedConfig
from pipe_rlhf_jax.launch import launch
from tests.helpers.metric_helpers import assert_metrics_close
from tests.helpers.xla_env import child_env

pytestmark = pytest.mark.multihost

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = (sys.executable, "-u", os.path.join(HERE, "multihost_worker.py"))
NOT_MATH = ("time", "tokens_per_s", "transfer/", "queue/", "weights/", "staleness/")


def run_job(tmp_path, name, args, num_processes, cpu_devices, timeout_s=600, grace_s=30):
  result = launch([*args, f"--out={tmp_path / name}"], num_processes=num_processes,
                  cpu_devices=cpu_devices, log_dir=str(tmp_path / name / "logs"),
                  timeout_s=timeout_s, grace_s=grace_s, command=WORKER, echo=False,
                  env=child_env())
  return result


def run_plain(tmp_path, name, args, cpu_devices, timeout_s=600):
  """The same worker as one ordinary process (no jax.distributed at all)."""
  out = tmp_path / name
  subprocess.run(["timeout", "-s", "KILL", str(timeout_s), *WORKER, *args, f"--out={out}",
                  f"--cpu_devices={cpu_devices}"], check=True, env=child_env(),
                 stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
  return out


def math_metrics(records):
  return [{k: v for k, v in r.items() if not any(k.startswith(p) or p in k for p in NOT_MATH)}
          for r in records]


def read_metrics(path):
  with open(path / "metrics.json", encoding="utf-8") as f:
    return json.load(f)


@pytest.mark.parametrize("mode", ["sequential",
                                  pytest.param("per_stage",
                                               marks=[pytest.mark.slow, pytest.mark.extended])])
def test_two_processes_match_one_process_on_the_same_global_mesh(tmp_path, mode):
  # 2 processes x 4 CPU devices vs 1 process x 8 devices: the meshes have the same shape
  # over 8 devices in the same order, so the PPO metrics agree at the tolerance of the
  # mode-equivalence tests (rtol 1e-4); the sampled tokens agree exactly (response lengths
  # and rule rewards are among the compared metrics). per_stage generates with a 2-stage
  # pipelined decoder whose stages are the two processes.
  args = ["ppo", f"--mode={mode}", "--steps=2"]
  one = read_metrics(run_plain(tmp_path, "one", args, cpu_devices=8))
  job = run_job(tmp_path, "two", args, num_processes=2, cpu_devices=4)
  assert job.ok, job.report()
  two = read_metrics(tmp_path / "two")
  assert len(one) == len(two) == 2
  assert_metrics_close(math_metrics(one), math_metrics(two), rtol=1e-4, atol=1e-5)
  assert not os.path.exists(tmp_path / "two" / "p1.json")  # only process 0 wrote


# Pipe mode over 2 processes: generation on process 0 (devices 0-3, pipeline=2 x tensor=2),
# inference and training on process 1 (devices 4-5 and 6-7); rollouts and weights cross
# processes through distributed.transfer.


def test_pipe_mode_across_processes_trains_within_its_staleness_bound(tmp_path):
  # With staleness 1 it trains every step and never lags more than 1.
  job = run_job(tmp_path, "lag", ["ppo", "--mode=pipe", "--steps=4", "--staleness=1"],
                num_processes=2, cpu_devices=4)
  assert job.ok, job.report()
  lag = read_metrics(tmp_path / "lag")
  assert len(lag) == 4
  assert all(0 <= r["staleness/actor"] <= 1 and 0 <= r["staleness/critic"] <= 1
             for r in lag)


@pytest.mark.slow
def test_reference_answers_cross_process_groups_with_their_rollouts(tmp_path):
  # Generation in process 0, inference and training in process 1: each rollout's
  # answers travel with it through distributed.transfer, and every row's answer is its
  # own prompt's (the rule rewards 1 only then).
  job = run_job(tmp_path, "answers", ["ppo", "--mode=pipe", "--steps=3", "--staleness=1",
                                      "--answers"], num_processes=2, cpu_devices=4)
  assert job.ok, job.report()
  rows = read_metrics(tmp_path / "answers")
  assert [r["reward/mean"] for r in rows] == [1.0, 1.0, 1.0]


@pytest.mark.slow
@pytest.mark.parametrize("extra", [
    pytest.param([], id="whole"),
    # LoRA: the weights links carry the adapters alone (`PPOSystem.abstract_params`, held
    # in tests/system/test_lora.py), each consuming process adds its own frozen base.
    pytest.param(["--lora_rank=4"], id="lora", marks=pytest.mark.extended),
    # Multi-turn episodes: the rollouts carry their policy masks and the environment's
    # rewards across processes.
    pytest.param(["--episodes"], id="episodes", marks=pytest.mark.extended)])
def test_pipe_mode_across_processes_on_policy_equals_one_process(tmp_path, extra):
  # On-policy it computes what one process computes with the same placement.
  args = ["ppo", "--mode=pipe", "--steps=3", "--staleness=0", *extra]
  one = read_metrics(run_plain(tmp_path, "one", args, cpu_devices=8))
  job = run_job(tmp_path, "two", args, num_processes=2, cpu_devices=4)
  assert job.ok, job.report()
  two = read_metrics(tmp_path / "two")
  assert_metrics_close(math_metrics(one), math_metrics(two), rtol=1e-4, atol=1e-5)
  if "--episodes" in extra:  # not vacuous: the episodes had several turns
    assert max(r["env/turns"] for r in two) > 1


def test_an_exception_in_one_process_stops_every_process_naming_it(tmp_path):
  # Process 1 raises as step 0's inference begins, while process 0 is inside that step:
  # its collective then fails too ("connection closed by peer"), yet it must name process
  # 1's error as the cause, not its own echo of it.
  job = run_job(tmp_path, "fail", ["ppo", "--steps=2", "--fail_at=0", "--fail_process=1"],
                num_processes=2, cpu_devices=4)
  assert job.returncodes == [1, 1], job.report()
  assert job.killed == []  # both stopped by themselves
  assert abs(job.exit_s[0] - job.exit_s[1]) < 15, job.report()
  text = job.log_text(0)
  assert "stopping process 0 of 2" in text
  assert "process 1 of 2 (" in text and "injected failure at PPO step 0" in text


def test_distributed_config_errors_name_the_field():
  with pytest.raises(ValueError, match="distributed.process_id=2 must be < "):
    DistributedConfig(coordinator_address="127.0.0.1:1", num_processes=2, process_id=2)
  with pytest.raises(ValueError, match="needs distributed.coordinator_address"):
    DistributedConfig(num_processes=2)
  with pytest.raises(ValueError, match="must be host:port"):
    DistributedConfig(coordinator_address="localhost", num_processes=2)
  with pytest.raises(ValueError, match="cluster_detection='pbs'"):
    DistributedConfig(cluster_detection="pbs")
  assert not DistributedConfig().wanted


def test_weights_and_rollouts_cross_process_groups_bit_for_bit(tmp_path):
  # Process 0 = train group (fsdp=4), process 1 = generate group (pipeline=2 x tensor=2):
  # weights go 0 -> 1 through distributed.transfer, rollouts 1 -> 0 through a queue of
  # capacity 1, with staleness bound 1 (see multihost_worker.transfer).
  job = run_job(tmp_path, "transfer", ["transfer"], num_processes=2, cpu_devices=4,
                timeout_s=180)
  assert job.ok, job.report()
  with open(tmp_path / "transfer" / "p0.json", encoding="utf-8") as f:
    trainer = json.load(f)
  with open(tmp_path / "transfer" / "p1.json", encoding="utf-8") as f:
    generator = json.load(f)
  used = generator["used"]
  assert [u["step"] for u in used] == [0, 1, 2, 3, 4]
  for u in used:
    # Staleness bound 1: batch k needs version >= k - 1; version k + 1 cannot exist
    # before batch k was generated and trained.
    assert u["step"] - 1 <= u["version"] <= u["step"]
    # The weights the generator used are the trainer's published version, bit for bit.
    assert u["digest"] == trainer["published"][str(u["version"])]
  # The trainer received every rollout once, in order, with its generating version.
  assert [(b["step"], b["version"], b["rollout_sum"]) for b in trainer["batches"]] == [
      (u["step"], u["version"], 96.0 * u["step"]) for u in used]
  assert max(generator["in_flight"]) <= 1  # the queue's capacity
  # A different layout at the receiver is refused before any data moves, naming the leaf.
  assert "leaf ['embedding'].value is sent as float32[264, 32] on mesh(" in \
      generator["refused"]
  assert "nothing was moved" in generator["refused"]


ROOT = os.path.dirname(os.path.dirname(HERE))
MAIN = (sys.executable, "-u", "-m", "pipe_rlhf_jax.main")


def main_args(workdir):
  """The tiny quickstart, shortened, in sequential mode."""
  return [f"--config={os.path.join(ROOT, 'configs', 'quickstart.py')}:tiny",
          "--config.plan.mode=sequential", "--config.sft.steps=2",
          "--config.reward_model.steps=2", "--config.ppo.steps=4",
          "--config.checkpoint.every=1", "--config.log.tensorboard=False",
          f"--workdir={workdir}", "--heartbeat_timeout_s=5"]


def rule_reward_args(workdir):
  """The tiny arith task, GRPO with its rule reward and no SFT: no reward model and no
  critic, so the job compiles little besides PPO's own programs."""
  return [f"--config={os.path.join(ROOT, 'configs', 'grpo_arith.py')}:tiny",
          "--config.plan.mode=sequential", "--config.sft.steps=0",
          "--config.ppo.steps=3", "--config.checkpoint.every=1",
          "--config.log.tensorboard=False", f"--workdir={workdir}",
          "--heartbeat_timeout_s=5"]


@pytest.mark.slow
def test_killed_process_stops_the_job_and_resume_finishes_it(tmp_path):
  # The main job on 2 processes x 4 devices; process 1 is SIGKILLed after PPO step 2 of 3
  # (step 1's checkpoint is then being written, step 0's is complete).
  # Process 0 must end by itself (jax's heartbeat check, 5 s here) well within 30 s;
  # `--resume` on 2 processes then finishes the run from the multi-host checkpoint.
  workdir = tmp_path / "run"
  env = {**child_env(), "PYTHONPATH": ROOT}
  # Process 0 writes the programs it compiled; on the CPU backend only process 0 can load
  # them again (see main's --compilation_cache_dir).
  cache = f"--compilation_cache_dir={tmp_path / 'xla_cache'}"
  killed_at = []

  def kill_after_step_2(procs, logs):
    if killed_at or not os.path.exists(logs[0]):
      return
    with open(logs[0], encoding="utf-8", errors="replace") as f:
      if "ppo step 2/3" in f.read():
        procs[1].kill()
        killed_at.append(time.monotonic())

  start = time.monotonic()
  job = launch([*rule_reward_args(workdir), cache], num_processes=2, cpu_devices=4,
               log_dir=str(tmp_path / "logs1"), timeout_s=400, grace_s=60, command=MAIN,
               echo=False, env=env, watch=kill_after_step_2)
  assert killed_at, job.report()
  assert job.returncodes[1] == -9
  assert job.returncodes[0] != 0 and job.killed == [], job.report()
  assert start + job.exit_s[0] - killed_at[0] < 30, job.report()

  job = launch([*rule_reward_args(workdir), cache, "--resume"], num_processes=2, cpu_devices=4,
               log_dir=str(tmp_path / "logs2"), timeout_s=400, command=MAIN, echo=False,
               env=env)
  assert job.ok, job.report()
  assert "resumed PPO at step" in job.log_text(0)
  assert os.listdir(tmp_path / "xla_cache")
  with open(workdir / "metrics.jsonl", encoding="utf-8") as f:
    rows = [json.loads(line) for line in f]
  assert [r["step"] for r in rows if r["phase"] == "ppo"] == [0, 1, 2]


@pytest.mark.slow
@pytest.mark.extended
def test_pipe_mode_with_every_stage_in_its_own_process(tmp_path):
  # 3 processes x 4 devices, one stage each: every link (rollouts, experience, actor and
  # critic weights) crosses processes. On-policy it equals one process over 12 devices.
  args = ["ppo", "--mode=pipe", "--steps=3", "--staleness=0", "--placement=4,4,4"]
  one = read_metrics(run_plain(tmp_path, "one", args, cpu_devices=12))
  job = run_job(tmp_path, "three", args, num_processes=3, cpu_devices=4)
  assert job.ok, job.report()
  assert_metrics_close(math_metrics(one), math_metrics(read_metrics(tmp_path / "three")),
                       rtol=1e-4, atol=1e-5)


# What the full quickstart runs around PPO and the tiny variant turns off: the reward
# model's scale under the warm-start policy and the held-out evaluation, both sampled.
MEASURED_ARGS = ("--config.ppo.steps=3", "--config.reward.normalize_samples_per_prompt=2",
                 "--config.log.eval_prompts=16", "--config.log.eval_samples_per_prompt=2")


def phase_rows(workdir, phase):
  with open(workdir / "metrics.jsonl", encoding="utf-8") as f:
    return [json.loads(line) for line in f if f'"phase": "{phase}"' in line]


def standardised_by(workdir):
  with open(workdir / "summary.txt", encoding="utf-8") as f:
    return [line for line in f if "reward standardised by" in line]


@pytest.mark.slow
def test_main_job_in_pipe_mode_across_processes(tmp_path):
  # The tiny quickstart in pipe mode on 2 processes x 4 devices: generation and inference
  # on process 1, training (and all the run's files) on process 0.
  workdir = tmp_path / "run"
  args = [a for a in main_args(workdir) if "plan.mode" not in a]
  job = launch([*args, *MEASURED_ARGS], num_processes=2, cpu_devices=4,
               log_dir=str(tmp_path / "logs"), timeout_s=500, command=MAIN, echo=False,
               env={**child_env(), "PYTHONPATH": ROOT})
  assert job.ok, job.report()
  assert "stage train: data=1 fsdp=4 pipeline=1 tensor=1 on devices [0..3]" in job.log_text(0)
  rows = phase_rows(workdir, "ppo")
  assert [r["step"] for r in rows] == [0, 1, 2]
  # The same job in one process on 8 devices: the warm start trains on the same devices,
  # so the reward model's scale and the held-out scores before PPO (both drawn from the
  # warm-start policy, every process taking part) are the same to the last digit. Both
  # come before PPO's first step, so this run takes one.
  one = tmp_path / "one"
  subprocess.run(["timeout", "-s", "KILL", "500", *MAIN,
                  *[a.replace(str(workdir), str(one)) for a in args], *MEASURED_ARGS,
                  "--config.ppo.steps=1"],
                 check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                 env=child_env(8, PYTHONPATH=ROOT))
  assert standardised_by(workdir) == standardised_by(one) != []
  before = [{k: v for k, v in phase_rows(d, "heldout")[0].items() if k != "time"}
            for d in (workdir, one)]
  assert before[0] == before[1] and "heldout_sampled/reverse_accuracy" in before[0]
  assert [r["step"] for r in phase_rows(workdir, "heldout")] == [0, 3]
  assert all(r["staleness/actor"] <= 1 for r in rows)
  assert sorted(os.listdir(workdir / "checkpoints")) == ["0", "1", "2"]
  with open(workdir / "trace.json", encoding="utf-8") as f:
    events = json.load(f)["traceEvents"]
  where = {(e["name"].split()[0], e["args"].get("process")) for e in events
           if e.get("ph") == "X"}
  assert ("generate", "p1") in where and ("train", "p0") in where


# Extended: the placement rule it runs (training on the last devices, whatever their count)
# is held without processes by tests/phases/test_run_state.py on 8 and 16 devices, and the
# slow tier runs the same main job across two processes at the count it was written for.
@pytest.mark.slow
@pytest.mark.extended
def test_main_job_in_pipe_mode_on_more_devices_than_its_placement(tmp_path):
  # The tiny quickstart's placement, 2 + 2 + 4 written for 8 devices, on 2 processes x 8:
  # generation and inference on process 1's first devices, training on process 0's last
  # 4 (the devices between unused), not refused for lying in process 1.
  workdir = tmp_path / "run"
  args = [a for a in main_args(workdir) if "plan.mode" not in a and "ppo.steps" not in a]
  args.append("--config.ppo.steps=2")  # where the stages run is known at step 0
  job = launch(args, num_processes=2, cpu_devices=8, log_dir=str(tmp_path / "logs"),
               timeout_s=400, command=MAIN, echo=False,
               env={**child_env(), "PYTHONPATH": ROOT})
  assert job.ok, job.report()
  assert "plan (hand-written, checked by the planner): pipe[2+2+4 devices" in job.log_text(0)
  assert "stage train: data=1 fsdp=4 pipeline=1 tensor=1 on devices [4..7]" in job.log_text(0)
  assert [r["step"] for r in phase_rows(workdir, "ppo")] == [0, 1]


def test_launcher_kills_what_does_not_stop(tmp_path):
  # Process 1 fails at once, process 0 would sleep a minute: after grace_s it is
  # SIGKILLed; and a job past timeout_s is SIGKILLed whole.
  code = ("import sys, time\n"
          "if '--process_id=1' in sys.argv: sys.exit(3)\n"
          "time.sleep(60)\n")
  start = time.monotonic()
  job = launch([], num_processes=2, log_dir=str(tmp_path / "a"), grace_s=1, timeout_s=30,
               command=(sys.executable, "-c", code), echo=False)
  assert job.returncodes == [-9, 3] and job.first_failure == 1 and job.killed == [0]
  assert time.monotonic() - start < 45  # killed after grace_s, not after the 60 s sleep
  job = launch([], num_processes=2, log_dir=str(tmp_path / "b"), timeout_s=1,
               command=(sys.executable, "-c", "import time; time.sleep(60)"), echo=False)
  assert job.returncodes == [-9, -9] and sorted(job.killed) == [0, 1]
  assert "killed by SIGKILL (SIGKILLed by the launcher)" in job.report()


def test_weights_and_queues_cross_a_stage_spanning_two_processes_bit_for_bit(tmp_path):
  # 3 processes x 2 devices: process 0 alone, processes 1-2 one group (SPMD) holding
  # generation's pipeline=2 x tensor=2 and a data=2 x fsdp=2 batch layout; weights and queue
  # items both ways (see multihost_worker.groups).
  job = run_job(tmp_path, "groups", ["groups"], num_processes=3, cpu_devices=2,
                timeout_s=180)
  assert job.ok, job.report()
  seen = []
  for p in range(3):
    with open(tmp_path / "groups" / f"p{p}.json", encoding="utf-8") as f:
      seen.append(json.load(f))
  trainer, group = seen[0], seen[1:]
  # Both processes of the group used the same versions, each the trainer's bit for bit.
  assert group[0]["used"] == group[1]["used"]
  used = group[0]["used"]
  assert [u["step"] for u in used] == [0, 1, 2, 3, 4]
  for u in used:
    assert u["step"] - 1 <= u["version"] <= u["step"]
    assert u["digest"] == trainer["published"][str(u["version"])]
  # Rollouts gathered in the group and sent by its leader arrived whole and in order;
  # the weights the group published back are what it had received, bit for bit.
  assert [(b["step"], b["version"], b["exact"]) for b in trainer["batches"]] == [
      (u["step"], u["version"], True) for u in used]
  for c in trainer["critics"]:
    assert c["version"] == c["step"]
    assert c["digest"] == trainer["published"][str(c["actor_version"])]
  # Each process of the group pulled exactly its own rows of every experience item.
  assert all(all(g["exact"]) and len(g["exact"]) == 5 for g in group)
  assert max(group[0]["in_flight"]) <= 1
  # A block laid out for the processes in the other order is refused by each process
  # before any data moves (the block's start in the array differs).
  for p, g in zip((1, 2), group):
    assert f"(process {p})" in g["refused"] and "nothing was moved" in g["refused"]
    assert " at [1" in g["refused"], g["refused"]


@pytest.mark.slow
@pytest.mark.parametrize("placement, meshes, spanning", [
    # Generation on processes 0-1 (pipeline=2 x tensor=2: a pipeline row each), inference and
    # training on process 2.
    ("4,1,1", "data=1,pipeline=2,tensor=2/data=1/data=1", "generate"),
    # Generation and inference on process 0, training on processes 1-2 (fsdp=4).
    pytest.param("1,1,4", "data=1/data=1/data=1,fsdp=4", "train",
                 marks=pytest.mark.extended),
])
def test_pipe_mode_with_a_stage_spanning_two_processes(tmp_path, placement, meshes,
                                                       spanning):
  # 3 processes x 2 devices, staleness 1: it trains every step, never lags more than 1,
  # and every generating process used the same weights as its peer, bit for bit the
  # version the trainer published.
  job = run_job(tmp_path, "three", ["ppo", "--mode=pipe", "--steps=3", "--staleness=1",
                                    f"--placement={placement}", f"--meshes={meshes}"],
                num_processes=3, cpu_devices=2, timeout_s=300)
  assert job.ok, job.report()
  rows = read_metrics(tmp_path / "three")
  assert len(rows) == 3
  assert all(0 <= r["staleness/actor"] <= 1 and 0 <= r["staleness/critic"] <= 1
             for r in rows)
  seen = []
  for p in range(3):
    with open(tmp_path / "three" / f"p{p}.json", encoding="utf-8") as f:
      seen.append(json.load(f))
  generators = [s["used"] for s in seen if s["used"]]
  trainers = [s["published"] for s in seen if s["published"]]
  assert len(generators) == (2 if spanning == "generate" else 1)
  assert len(trainers) == (2 if spanning == "train" else 1)
  assert all(t == trainers[0] for t in trainers)  # the training group in lockstep
  assert all(g == generators[0] for g in generators)
  assert [u["step"] for u in generators[0]] == [0, 1, 2]
  for u in generators[0]:
    assert u["step"] - 1 <= u["version"] <= u["step"]
    assert u["digest"] == trainers[0][str(u["version"])]


@pytest.mark.slow
@pytest.mark.extended
def test_main_job_with_the_training_stage_over_two_processes_checkpoints_and_resumes(
    tmp_path):
  # The tiny quickstart in pipe mode on 4 processes x 2 devices: process 0's devices come
  # last, so generation is process 1's, inference process 2's and training (fsdp=4) spans
  # processes 3 and 0, which hold, checkpoint and restore the trainer state together.
  workdir = tmp_path / "run"
  args = [a for a in main_args(workdir) if "plan.mode" not in a and "ppo.steps" not in a]
  args += ["--config.ppo.steps=2", "--config.warm_start.mesh.fsdp=-1"]
  env = {**child_env(), "PYTHONPATH": ROOT}
  job = launch(args, num_processes=4, cpu_devices=2, log_dir=str(tmp_path / "logs1"),
               timeout_s=500, command=MAIN, echo=False, env=env)
  assert job.ok, job.report()
  assert "stage train: data=1 fsdp=4 pipeline=1 tensor=1 on devices [6144,6145,0,1]" in \
      job.log_text(0)
  assert sorted(os.listdir(workdir / "checkpoints")) == ["0", "1"]
  with open(workdir / "trace.json", encoding="utf-8") as f:
    events = json.load(f)["traceEvents"]
  where = {(e["name"].split()[0], e["args"].get("process")) for e in events
           if e.get("ph") == "X"}
  assert {("generate", "p1"), ("infer", "p2"), ("train", "p0"), ("train", "p3")} <= where
  # Resume from step 0's checkpoint: the training group restores it and re-trains step 1.
  shutil.rmtree(workdir / "checkpoints" / "1")
  job = launch([*args, "--resume"], num_processes=4, cpu_devices=2,
               log_dir=str(tmp_path / "logs2"), timeout_s=500, command=MAIN, echo=False,
               env=env)
  assert job.ok, job.report()
  assert "resumed PPO at step 1" in job.log_text(0)
  assert "resumed PPO at step 1" in job.log_text(3)
  with open(workdir / "metrics.jsonl", encoding="utf-8") as f:
    rows = [json.loads(line) for line in f if '"ppo"' in line]
  assert [r["step"] for r in rows] == [0, 1]


# ---- signals and stuck peers across processes ------------------------------------------

FAULTY = (sys.executable, "-u", os.path.join(HERE, "fault_worker.py"))


def fault_args(workdir, mode="sequential", steps=5):
  """The tiny arith GRPO job (no reward model, no critic) with the fault worker's rule;
  a checkpoint only at the end or on a stop."""
  return [f"--config={os.path.join(ROOT, 'configs', 'grpo_arith.py')}:tiny",
          f"--config.plan.mode={mode}", "--config.sft.steps=0",
          f"--config.ppo.steps={steps}", "--config.checkpoint.every=100",
          "--config.log.tensorboard=False", "--config.reward.fn=faulty_arith_exact_match",
          f"--workdir={workdir}", "--heartbeat_timeout_s=5"]


def launch_faulty(tmp_path, name, args, fault="", **kwargs):
  env = {**child_env(), "PYTHONPATH": ROOT, "PIPE_RLHF_JAX_FAULT": fault}
  return launch(args, num_processes=2, cpu_devices=4, log_dir=str(tmp_path / name),
                command=FAULTY, echo=False, env=env, **{"timeout_s": 400, **kwargs})


def ppo_steps(workdir):
  return [r["step"] for r in phase_rows(workdir, "ppo")]


# Extended: the default tier's cross-process stop is the exception case above, its signal
# stop tests/test_faults.py's SIGINT inside the update; the slow tier stops and resumes
# across processes by a kill (below), and holds a resumed run to the uninterrupted one in
# one process (tests/test_faults.py's signal matrix).
@pytest.mark.slow
@pytest.mark.extended
def test_a_signal_to_one_process_stops_both_at_one_step_and_resume_equals_the_whole_run(
    tmp_path):
  # The uninterrupted two-process run, for the resumed run to equal.
  whole = tmp_path / "whole"
  assert launch_faulty(tmp_path, "logs0", fault_args(whole)).ok
  # A scheduler's SIGTERM reaches process 1 alone, during step 2: both processes agree
  # to stop after step 2, write its checkpoint together and exit 143; nothing is lost.
  workdir = tmp_path / "run"
  job = launch_faulty(tmp_path, "logs1", fault_args(workdir), fault="sigterm@reward:2:1")
  assert job.returncodes == [143, 143] and job.killed == [], job.report()
  assert sorted(os.listdir(workdir / "checkpoints")) == ["2"]
  assert ppo_steps(workdir) == [0, 1, 2]
  job = launch_faulty(tmp_path, "logs2", [*fault_args(workdir), "--resume"])
  assert job.ok, job.report()
  assert ppo_steps(workdir) == [0, 1, 2, 3, 4]
  assert_metrics_close(math_metrics(phase_rows(whole, "ppo")),
                       math_metrics(phase_rows(workdir, "ppo")), rtol=1e-6, atol=1e-7)
  # Ctrl-C on process 0 stops both the same way, with SIGINT's status.
  job = launch_faulty(tmp_path, "logs3", fault_args(tmp_path / "ctrl_c"),
                      fault="sigint@reward:1:0")
  assert job.returncodes == [130, 130], job.report()
  assert ppo_steps(tmp_path / "ctrl_c") == [0, 1]


# Extended: the slow tier stops a two-process job and resumes it by a kill
# (test_killed_process_stops_the_job_and_resume_finishes_it), and the default tier holds a
# signal's save-and-resume to the uninterrupted run in one process (tests/test_faults.py).
@pytest.mark.slow
@pytest.mark.extended
def test_sigterm_to_the_launcher_in_pipe_mode_saves_and_resume_finishes(tmp_path):
  # Pipe mode across 2 processes (generation and inference on process 1, training on
  # process 0); the launcher passes a SIGTERM on to both, which stop at one step.
  workdir = tmp_path / "run"
  logs = tmp_path / "logs1"
  cmd = [sys.executable, "-m", "pipe_rlhf_jax.launch", "--num_processes=2",
         "--cpu_devices=4", f"--log_dir={logs}", "--timeout_s=400", "--",
         *[a for a in fault_args(workdir, mode="pipe", steps=8)
           if "reward.fn" not in a]]
  proc = subprocess.Popen(cmd, env={**child_env(), "PYTHONPATH": ROOT},
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
  try:
    deadline = time.monotonic() + 400
    while time.monotonic() < deadline and proc.poll() is None:
      log = logs / "process_0.log"
      if log.exists() and "ppo step 2/8" in log.read_text(errors="replace"):
        proc.send_signal(subprocess.signal.SIGTERM)
        break
      time.sleep(0.2)
    _, err = proc.communicate(timeout=400)
  finally:
    if proc.poll() is None:
      proc.kill()
  assert proc.returncode == 143, err[-3000:]
  saved = sorted(int(s) for s in os.listdir(workdir / "checkpoints") if s.isdigit())
  assert saved and saved[-1] == ppo_steps(workdir)[-1] < 7, err[-3000:]
  job = launch([*[a for a in fault_args(workdir, mode="pipe", steps=8)
                 if "reward.fn" not in a], "--resume"], num_processes=2,
               cpu_devices=4, log_dir=str(tmp_path / "logs2"), timeout_s=400, command=MAIN,
               echo=False, env={**child_env(), "PYTHONPATH": ROOT})
  assert job.ok, job.report()
  assert ppo_steps(workdir) == list(range(8))


@pytest.mark.slow
def test_a_stuck_peer_stops_the_job_naming_it(tmp_path):
  # Process 1's reward call never returns (a hung server): its heartbeats keep flowing,
  # so only the progress deadline can end the job; both processes stop by themselves.
  workdir = tmp_path / "run"
  job = launch_faulty(tmp_path, "logs", [*fault_args(workdir),
                                         "--config.plan.progress_timeout_s=15"],
                      fault="hang@reward:2:1", grace_s=120)
  assert job.killed == [] and all(c != 0 for c in job.returncodes), job.report()
  text = job.log_text(0) + job.log_text(1)
  assert "PPO step 2 made no progress" in text, job.report()
  # Both processes run the same deadline; whichever reaches it first reports, and the other
  # is then aborted by the coordination service. Process 1 names its own stuck stage;
  # process 0 names its infer stage waiting on the collective and process 1's step.
  assert ("the infer stage (process 1)" in text
          or "the others' last activity: process 1: PPO step 2" in text), job.report()


def test_binding_every_interface_is_recognised_and_transfer_ids_need_the_secret():
  from pipe_rlhf_jax.distributed.cluster import is_wildcard
  from pipe_rlhf_jax.distributed.transfer import transfer_id
  assert all(is_wildcard(h) for h in ("0.0.0.0:1234", "[::]:1234", "::", "0.0.0.0"))
  assert not any(is_wildcard(h) for h in ("127.0.0.1:5", "10.0.0.2", "node-3:8476"))
  # Without the job's key the id of the next item cannot be derived from the last one.
  ids = {transfer_id("actor@0-4", 1, seq, b"k" * 32) for seq in range(1000)}
  assert len(ids) == 1000 and all(0 <= i < 2**63 for i in ids)
  assert transfer_id("actor@0-4", 1, 5, b"a" * 32) != transfer_id("actor@0-4", 1, 5,
                                                                   b"b" * 32)
