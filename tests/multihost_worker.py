"""One process of the multi-process tests (started by `pipe_rlhf_jax.launch.launch`).

  python tests/multihost_worker.py SCENARIO --out=DIR [scenario flags] [job flags]

Job flags are those the launcher appends (`--coordinator_address`, `--num_processes`,
`--process_id`, `--cpu_devices`); without them the worker is one plain process.

Scenarios:
  ppo       a few PPO steps of a tiny system through the library API (`--mode`,
            `--steps`); process 0 writes the metrics to DIR/metrics.json. With
            `--fail_at=K --fail_process=I`, process I raises at PPO step K instead.
  transfer  weights and a queue between two process groups through
            `distributed.transfer`; every process writes what it saw to DIR/p<i>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pipe_rlhf_jax import distributed  # noqa: E402
from pipe_rlhf_jax.distributed.faults import FaultWatch  # noqa: E402


def parse():
  p = argparse.ArgumentParser()
  p.add_argument("scenario", choices=("ppo", "transfer"))
  p.add_argument("--out", required=True)
  p.add_argument("--mode", default="sequential")
  p.add_argument("--steps", type=int, default=3)
  p.add_argument("--staleness", type=int, default=0)
  p.add_argument("--placement", default="4,2,2", help="pipe: devices of gen,infer,train")
  p.add_argument("--fail_at", type=int, default=-1)
  p.add_argument("--fail_process", type=int, default=1)
  p.add_argument("--coordinator_address", default="")
  p.add_argument("--num_processes", type=int, default=1)
  p.add_argument("--process_id", type=int, default=0)
  p.add_argument("--cpu_devices", type=int, default=0)
  return p.parse_args()


def tiny_system(mode: str, staleness: int = 0, placement=(4, 2, 2)):
  """A model of the quickstart's tiny size, a rule reward, 16 prompts per batch."""
  import jax
  jax.config.update("jax_default_matmul_precision", "highest")
  from pipe_rlhf_jax.generation import SamplingParams
  from pipe_rlhf_jax.models.config import tiny_config
  from pipe_rlhf_jax.models.tokenizer import load_tokenizer
  from pipe_rlhf_jax.models.transformer import init_model
  from pipe_rlhf_jax.system import (MeshSpec, Models, PPOConfig, PPOSystem, RuntimeConfig,
                                    StagePlan, prompts_from_texts)
  tokenizer = load_tokenizer("byte")
  policy = init_model(tiny_config(embed_dim=32, num_layers=2, num_heads=4, num_kv_heads=4,
                                  head_dim=8, mlp_dim=64), seed=0)

  def count_a(prompts, completions):
    return [float(c.count("a")) / max(len(c), 1) for c in completions]

  # per_stage: a 2-stage pipelined decoder whose stages are the two processes (its ring
  # ppermute crosses them), tensor=4 inside each; inference and training data / fsdp.
  # pipe: by default generation on devices 0-3 (process 0 of a 2 x 4 job), inference on
  # 4-5 and training on 6-7 (process 1).
  pipe = mode == "pipe"
  runtime = RuntimeConfig(mode=mode, mesh=MeshSpec(data=-1), max_staleness=staleness,
                          placement=tuple(placement) if pipe else None,
                          generate=StagePlan(MeshSpec(data=1, pipe=2, tensor=2 if pipe else 4),
                                             num_microbatches=2),
                          infer=StagePlan(MeshSpec(data=2, fsdp=-1)),
                          train=StagePlan(MeshSpec(data=1, fsdp=-1)))
  system = PPOSystem(
      Models.from_policy(policy),
      ppo=PPOConfig(steps=4, batch_size=16, minibatch_size=8, actor_lr=1e-3, kl_coef=0.1),
      sampling=SamplingParams(max_new_tokens=6, eos_id=tokenizer.eos_id,
                              pad_id=tokenizer.pad_id),
      runtime=runtime, reward_fn=count_a, decode=tokenizer.decode)
  words = ["abc", "bad", "cab", "dga", "hgf", "fed", "ace", "bdf", "gab", "cad", "fab",
           "bag", "dab", "egg", "hag", "aced"]
  prompts = prompts_from_texts([f"rev {w}=" for w in words], tokenizer, batch_size=16,
                               prompt_len=10)
  return system, prompts


def ppo(args) -> None:
  from pipe_rlhf_jax.system import run
  system, prompts = tiny_system(args.mode, args.staleness,
                                [int(n) for n in args.placement.split(",")])
  fail = args.fail_at >= 0 and distributed.process_index() == args.fail_process

  def on_step(step, metrics):
    if fail and step + 1 == args.fail_at:
      raise RuntimeError(f"injected failure at PPO step {args.fail_at}")

  result = run(system, prompts, steps=args.steps, on_step=on_step)
  # Serial modes: every process has the metrics, process 0 writes them; pipe mode: only
  # the training stage's process has them.
  if result.metrics and (distributed.is_primary() or args.mode == "pipe"):
    with open(os.path.join(args.out, "metrics.json"), "w", encoding="utf-8") as f:
      json.dump(result.metrics, f)


def digest(tree) -> str:
  """sha256 over every leaf's bytes, in tree order: equal iff bit-for-bit equal."""
  import hashlib
  import numpy as np
  h = hashlib.sha256()
  for leaf in jax_leaves(distributed.fetch(tree)):
    h.update(np.ascontiguousarray(leaf).tobytes())
  return h.hexdigest()


def jax_leaves(tree):
  import jax
  return jax.tree.leaves(tree)


def transfer(args) -> None:
  """Process 0 trains, process 1 generates; weights 0 -> 1, rollouts 1 -> 0.

  Both build every layout from the same description and global device list, as two stage
  groups of a pipe-mode job would: train = fsdp 4 on process 0's devices, generate =
  pipe 2 x tensor 2 on process 1's. Five batches with staleness bound 1 and a rollout
  queue of capacity 1; then a subscriber whose target layout differs from what is
  published must refuse before pulling.
  """
  import jax
  import numpy as np
  from flax import nnx
  from pipe_rlhf_jax.distributed import transfer as tr
  from pipe_rlhf_jax.models.config import tiny_config
  from pipe_rlhf_jax.models.transformer import init_model
  from pipe_rlhf_jax.parallel import logical
  from pipe_rlhf_jax.parallel.mesh import MeshShape, make_mesh
  from pipe_rlhf_jax.runtime.weights import required_version
  from pipe_rlhf_jax.stages.common import StageLayout

  steps, staleness, me = 5, 1, distributed.process_index()
  groups = {p: [d for d in jax.devices() if d.process_index == p] for p in (0, 1)}
  train = StageLayout("train", make_mesh(MeshShape(fsdp=4), groups[0]),
                      logical.STAGE_RULES["train"])
  gen = StageLayout("generate", make_mesh(MeshShape(pipe=2, tensor=2), groups[1]),
                    logical.STAGE_RULES["generate"])
  # A layout that must be refused: generation's mesh as tensor=4 (other specs and sizes).
  wrong = StageLayout("generate", make_mesh(MeshShape(tensor=4), groups[1]),
                      logical.STAGE_RULES["generate"])
  cfg = tiny_config(embed_dim=32, num_layers=2, num_heads=4, num_kv_heads=4, head_dim=8,
                    mlp_dim=64)
  abstract = nnx.state(nnx.eval_shape(lambda: init_model(cfg)))
  rollout_shape = jax.ShapeDtypeStruct((16, 6), np.float32)
  seen = {}
  if me == 0:
    params, _ = train.put_params(nnx.state(init_model(cfg, seed=0)))
    publisher = tr.WeightPublisher(
        "actor", [1], tr.mirror_shardings(gen.param_shardings(abstract), groups[0]))
    wrong_publisher = tr.WeightPublisher(
        "actor_b", [1], tr.mirror_shardings(gen.param_shardings(abstract), groups[0]))
    published = {}
    publisher.publish(params, 0)
    wrong_publisher.publish(params, 0)
    published[0] = digest(params)
    receiver = tr.QueueReceiver("rollouts", 1, lambda meta: jax.ShapeDtypeStruct(
        rollout_shape.shape, rollout_shape.dtype, sharding=train.batch_sharding(2)))
    batches = []
    for rollout, meta in receiver:
      # "Training" on the batch: a deterministic change of every parameter.
      params = jax.tree.map(lambda x: x * 0.5 + 1.0, params)
      version = meta["step"] + 1
      publisher.publish(params, version)
      published[version] = digest(params)
      batches.append({**meta, "rollout_sum": float(np.asarray(distributed.fetch(rollout)).sum())})
    distributed.barrier("transfer_done")
    publisher.close()
    wrong_publisher.close()
    seen = {"published": published, "batches": batches}
  else:
    subscriber = tr.WeightSubscriber("actor", 0, jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract,
        gen.param_shardings(abstract)))
    sender = tr.QueueSender("rollouts", 0, capacity=1)
    mirror = tr.mirror_shardings(train.batch_sharding(2), groups[1])
    used, in_flight = [], []
    for step in range(steps):
      params, version = subscriber.acquire(required_version(step, staleness), timeout_s=120)
      used.append({"step": step, "version": version, "digest": digest(params)})
      rollout = jax.device_put(np.full(rollout_shape.shape, step, np.float32), mirror)
      sender.put(rollout, {"step": step, "version": version}, timeout_s=120)
      in_flight.append(sender._sent - (sender.endpoint.try_get("queue/rollouts/taken") or 0))
    sender.close()
    refused = ""
    bad = tr.WeightSubscriber("actor_b", 0, jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract,
        wrong.param_shardings(abstract)))
    try:
      bad.acquire(0, timeout_s=60)
    except tr.LayoutMismatch as e:
      refused = str(e)
    distributed.barrier("transfer_done")
    seen = {"used": used, "in_flight": in_flight, "refused": refused}
  with open(os.path.join(args.out, f"p{me}.json"), "w", encoding="utf-8") as f:
    json.dump(seen, f)


def main() -> None:
  args = parse()
  os.makedirs(args.out, exist_ok=True)
  distributed.initialize(distributed.DistributedConfig(
      coordinator_address=args.coordinator_address, num_processes=args.num_processes,
      process_id=args.process_id, cpu_devices=args.cpu_devices, heartbeat_timeout_s=5,
      shutdown_timeout_s=10))
  watch = FaultWatch.start()
  try:
    if args.scenario == "ppo":
      ppo(args)
    else:
      transfer(args)
  except Exception as e:  # pylint: disable=broad-except
    if watch is None:
      raise
    watch.fail(e)
  if watch is not None:
    watch.finish()


if __name__ == "__main__":
  main()
