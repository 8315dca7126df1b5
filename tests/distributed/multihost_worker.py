"""One process of the multi-process tests (started by `pipe_rlhf_jax.launch.launch`).

  python tests/distributed/multihost_worker.py SCENARIO --out=DIR [scenario flags] [job flags]

Job flags are those the launcher appends (`--coordinator_address`, `--num_processes`,
`--process_id`, `--cpu_devices`); without them the worker is one plain process.

Scenarios:
  ppo       a few PPO steps of a tiny system through the library API (`--mode`,
            `--steps`); process 0 writes the metrics to DIR/metrics.json. With
            `--fail_at=K --fail_process=I`, process I raises as PPO step K's inference
            begins (serial modes).
            In pipe mode `--placement` and `--meshes` place the stages, and every
            process writes DIR/p<i>.json: the digest of the actor each generation used
            and of each version the trainer published. With `--answers` each prompt
            carries a reference answer and the rule rewards 1 where a row's answer is
            its own prompt's.
  transfer  weights and a queue between two process groups through
            `distributed.transfer`; every process writes what it saw to DIR/p<i>.json.
  groups    the same between a one-process group and a group spanning two processes
            (3 processes): blocks of weights and queue items both ways.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from pipe_rlhf_jax import distributed  # noqa: E402
from pipe_rlhf_jax.distributed.faults import FaultWatch  # noqa: E402


def parse():
  p = argparse.ArgumentParser()
  p.add_argument("scenario", choices=("ppo", "transfer", "groups"))
  p.add_argument("--out", required=True)
  p.add_argument("--mode", default="sequential")
  p.add_argument("--steps", type=int, default=3)
  p.add_argument("--staleness", type=int, default=0)
  p.add_argument("--placement", default="4,2,2", help="pipe: devices of gen,infer,train")
  p.add_argument("--meshes", default="data=1,pipeline=2,tensor=2/data=2,fsdp=-1/data=1,fsdp=-1",
                 help="pipe: the generate/infer/train meshes (axis=size, comma-separated)")
  p.add_argument("--fail_at", type=int, default=-1)
  p.add_argument("--fail_process", type=int, default=1)
  p.add_argument("--answers", action="store_true")
  p.add_argument("--lora_rank", type=int, default=0)
  p.add_argument("--episodes", action="store_true")
  p.add_argument("--coordinator_address", default="")
  p.add_argument("--num_processes", type=int, default=1)
  p.add_argument("--process_id", type=int, default=0)
  p.add_argument("--cpu_devices", type=int, default=0)
  return p.parse_args()


def mesh_specs(text: str):
  """'data=1,pipeline=2,tensor=2/...' -> the three stages' MeshSpecs."""
  from pipe_rlhf_jax.config import MeshSpec
  return [MeshSpec(**{axis: int(size) for axis, size in
                      (item.split("=") for item in part.split(","))})
          for part in text.split("/")]


def tiny_system(mode: str, staleness: int = 0, placement=(4, 2, 2), meshes=None,
                answers: bool = False, lora_rank: int = 0, episodes: bool = False):
  """A model of the quickstart's tiny size, a rule reward, 16 prompts per batch (with
  `answers`, prompts with reference answers and a rule that checks their pairing; with
  `lora_rank`, LoRA adapters of that rank on every projection; with `episodes`,
  three-turn episodes with an environment that answers each turn, whose reward is
  PPO's)."""
  import jax
  jax.config.update("jax_default_matmul_precision", "highest")
  from pipe_rlhf_jax.config import LoRASettings, MeshSpec, Plan, PPOSettings, StagePlan
  from pipe_rlhf_jax.generation import SamplingSettings
  from pipe_rlhf_jax.models.config import tiny_config
  from pipe_rlhf_jax.models.tokenizer import load_tokenizer
  from pipe_rlhf_jax.models.transformer import init_model
  from pipe_rlhf_jax.system import Models, PPOSystem, prompts_from_texts
  tokenizer = load_tokenizer("byte")
  policy = init_model(tiny_config(embed_dim=32, num_layers=2, num_heads=4, num_kv_heads=4,
                                  head_dim=8, mlp_dim=64), seed=0)

  def count_a(prompts, completions):
    return [float(c.count("a")) / max(len(c), 1) for c in completions]

  def paired(prompts, completions, answers):
    return [float(a == "ans " + p.strip().removeprefix("rev ").removesuffix("="))
            for p, a in zip(prompts, answers)]

  # per_stage: a 2-stage pipelined decoder whose stages are the two processes (its ring
  # ppermute crosses them), tensor=4 inside each; inference and training data / fsdp.
  # pipe: by default generation on devices 0-3 (process 0 of a 2 x 4 job), inference on
  # 4-5 and training on 6-7 (process 1).
  pipe = mode == "pipe"
  gen, inf, trn = meshes or (MeshSpec(data=1, pipeline=2, tensor=2 if pipe else 4),
                             MeshSpec(data=2, fsdp=-1), MeshSpec(data=1, fsdp=-1))
  plan = Plan(mode=mode, mesh=MeshSpec(data=-1), max_staleness=staleness,
                          placement=tuple(placement) if pipe else None,
                          generate=StagePlan(gen, num_microbatches=2),
                          infer=StagePlan(inf), train=StagePlan(trn))
  runner = None
  if episodes:
    runner = episode_runner(tokenizer)
    policy = ending_turns(policy, tokenizer)
  system = PPOSystem(
      Models.from_policy(policy, lora_settings=LoRASettings(rank=lora_rank)),
      ppo=PPOSettings(steps=4, batch_size=16, minibatch_size=8, actor_lr=1e-3, kl_coef=0.1),
      sampling=SamplingSettings(max_new_tokens=40 if episodes else 6,
                                eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id),
      plan=plan, reward_fn=None if episodes else paired if answers else count_a,
      decode=tokenizer.decode, episodes=runner)
  words = ["abc", "bad", "cab", "dga", "hgf", "fed", "ace", "bdf", "gab", "cad", "fab",
           "bag", "dab", "egg", "hag", "aced"]
  if answers:
    from pipe_rlhf_jax.data.loaders import PromptLoader
    records = [{"prompt": f"rev {w}=", "answer": f"ans {w}"} for w in words]
    return system, PromptLoader(records, tokenizer, 16, 10, seed=0, answer_len=16)
  prompts = prompts_from_texts([f"rev {w}=" for w in words], tokenizer, batch_size=16,
                               prompt_len=10)
  return system, prompts


def episode_runner(tokenizer):
  """Episodes of up to 3 turns of 6 tokens with an environment that replies "ok" to the
  first two; the reward is the share of "a" in the last turn."""
  from pipe_rlhf_jax.envs import ENVIRONMENTS, Environment, EnvSettings, Reply, renderer_for
  from pipe_rlhf_jax.stages.episodes import EpisodeRunner

  @ENVIRONMENTS.register("worker_ok")
  class Ok(Environment):
    def step(self, state, turn):
      return None if turn.index >= 2 else Reply("ok")

    def reward(self, state, turns):
      return turns[-1].text.count("a") / max(len(turns[-1].text), 1)

  return EpisodeRunner(Ok(), EnvSettings(name="worker_ok", turn_tokens=6),
                       renderer_for(tokenizer), tokenizer, 40, tokenizer.eos_id,
                       tokenizer.pad_id)


def ending_turns(policy, tokenizer, lift: float = 0.1):
  """The policy with its head's EOS column moved by `lift` along the mean final hidden
  state, so that its turns end within a few tokens (as tests/system/test_episodes.py)."""
  import jax.numpy as jnp
  ids = tokenizer.encode("rev abc=")
  h = policy.hidden(jnp.asarray([ids]), jnp.ones((1, len(ids)), bool))[0]
  u = jnp.mean(h, axis=0)
  policy.lm_head.value = policy.lm_head.value.at[:, tokenizer.eos_id].add(
      lift * u / jnp.sum(u * u))
  return policy


def ppo(args) -> None:
  from pipe_rlhf_jax.system import run
  pipe = args.mode == "pipe"
  system, prompts = tiny_system(args.mode, args.staleness,
                                [int(n) for n in args.placement.split(",")],
                                mesh_specs(args.meshes) if pipe else None, args.answers,
                                args.lora_rank, args.episodes)
  me = distributed.process_index()
  fail = args.fail_at >= 0 and me == args.fail_process
  across = pipe and distributed.process_count() > 1
  if across:
    from pipe_rlhf_jax.system.pipe_processes import stage_processes
    where = stage_processes(system.layouts)
  # Pipe mode across processes: what each process saw of the actor, as digests (the
  # fetches in them are programs of the stage's own group, run in lockstep by it).
  published, used = {}, []
  if across and me in where["train"]:
    published[system.version] = digest(system.state.actor)
  if across and me in where["generate"]:
    generate = system.generate

    def recording(params, batch, step, version):
      used.append({"step": step, "version": version, "digest": digest(params)})
      return generate(params, batch, step, version)
    system.generate = recording
  if fail:
    fail_as_step_infers(system, args.fail_at)

  def on_step(step, metrics):
    if across:  # after the update: the version the trainer publishes next
      published[system.version] = digest(system.state.actor)

  result = run(system, prompts, steps=args.steps, on_step=on_step)
  # Serial modes: every process has the metrics, process 0 writes them; pipe mode: only
  # the training stage's processes have them, its leader writes.
  if result.metrics and (me == where["train"][0] if across else distributed.is_primary()):
    with open(os.path.join(args.out, "metrics.json"), "w", encoding="utf-8") as f:
      json.dump(result.metrics, f)
  if across:
    with open(os.path.join(args.out, f"p{me}.json"), "w", encoding="utf-8") as f:
      json.dump({"published": published, "used": used}, f)


def fail_as_step_infers(system, fail_at: int) -> None:
  """Makes this process raise as PPO step `fail_at`'s inference begins (serial modes):
  the other processes are then inside that step, soon waiting in a collective that this
  one never joins, which is the case the fault watch exists for."""
  generate, infer, current = system.generate, system.infer, {}

  def noting_step(params, batch, step, version):
    current["step"] = step
    return generate(params, batch, step, version)

  def failing(*args, **kwargs):
    if current.get("step") == fail_at:
      raise RuntimeError(f"injected failure at PPO step {fail_at}")
    return infer(*args, **kwargs)
  system.generate, system.infer = noting_step, failing


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
  pipeline 2 x tensor 2 on process 1's. Five batches with staleness bound 1 and a rollout
  queue of capacity 1; then a subscriber whose target layout differs from what is
  published must refuse before pulling.
  """
  from flax import nnx
  import jax
  import numpy as np

  from pipe_rlhf_jax.concurrency.weights import required_version
  from pipe_rlhf_jax.distributed import transfer as tr
  from pipe_rlhf_jax.models.config import tiny_config
  from pipe_rlhf_jax.models.transformer import init_model
  from pipe_rlhf_jax.parallel import logical
  from pipe_rlhf_jax.parallel.mesh import MeshShape, make_mesh
  from pipe_rlhf_jax.stages.common import StageLayout

  steps, staleness, me = 5, 1, distributed.process_index()
  groups = {p: [d for d in jax.devices() if d.process_index == p] for p in (0, 1)}
  train = StageLayout("train", make_mesh(MeshShape(fsdp=4), groups[0]),
                      logical.STAGE_RULES["train"])
  gen = StageLayout("generate", make_mesh(MeshShape(pipeline=2, tensor=2), groups[1]),
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
    publisher = tr.WeightPublisher("actor", [1], gen.param_shardings(abstract))
    wrong_publisher = tr.WeightPublisher("actor_b", [1], gen.param_shardings(abstract))
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
    sender = tr.QueueSender("rollouts", [0], capacity=1)
    used, in_flight = [], []
    for step in range(steps):
      params, version = subscriber.acquire(required_version(step, staleness), timeout_s=120)
      used.append({"step": step, "version": version, "digest": digest(params)})
      rollout = jax.device_put(np.full(rollout_shape.shape, step, np.float32),
                               gen.batch_sharding(2))
      sender.put(rollout, train.batch_sharding(2), {"step": step, "version": version},
                 timeout_s=120)
      in_flight.append(sender.in_flight())
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


def groups(args) -> None:
  """Process 0 is a one-process group, processes 1-2 one group spanning both (SPMD).

  Every layout is built from the same description and global device list on every
  process. Weights 0 -> {1, 2} (generation's pipeline=2 x tensor=2 over the group: each
  process pulls its own pipeline row, and both must get the same version); rollouts
  {1, 2} -> 0 (gathered within the group, sent by its leader); experience 0 -> {1, 2}
  into data=2 x fsdp=2 (each process pulls its own rows); weights {1, 2} -> 0 (published
  by the group). Five steps, staleness bound 1, queues of capacity 1. Then a publisher
  that lays generation's mesh out with the processes swapped: each process's block
  starts elsewhere, and both refuse it before pulling.
  """
  from flax import nnx
  import jax
  import numpy as np

  from pipe_rlhf_jax.concurrency.weights import required_version
  from pipe_rlhf_jax.distributed import transfer as tr
  from pipe_rlhf_jax.models.config import tiny_config
  from pipe_rlhf_jax.models.transformer import init_model
  from pipe_rlhf_jax.parallel import logical
  from pipe_rlhf_jax.parallel.mesh import MeshShape, make_mesh
  from pipe_rlhf_jax.stages.common import StageLayout

  steps, staleness, me = 5, 1, distributed.process_index()
  devs = {p: [d for d in jax.devices() if d.process_index == p] for p in (0, 1, 2)}
  group = [1, 2]
  train = StageLayout("train", make_mesh(MeshShape(fsdp=2), devs[0]),
                      logical.STAGE_RULES["train"])
  gen = StageLayout("generate", make_mesh(MeshShape(pipeline=2, tensor=2), devs[1] + devs[2]),
                    logical.STAGE_RULES["generate"])
  swapped = StageLayout("generate", make_mesh(MeshShape(pipeline=2, tensor=2),
                                              devs[2] + devs[1]),
                        logical.STAGE_RULES["generate"])
  rows = StageLayout("infer", make_mesh(MeshShape(data=2, fsdp=2), devs[1] + devs[2]),
                     logical.STAGE_RULES["infer"])
  cfg = tiny_config(embed_dim=32, num_layers=2, num_heads=4, num_kv_heads=4, head_dim=8,
                    mlp_dim=64)
  abstract = nnx.state(nnx.eval_shape(lambda: init_model(cfg)))
  target = lambda layout: jax.tree.map(
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract,
      layout.param_shardings(abstract))
  batch = lambda layout: (lambda meta: jax.ShapeDtypeStruct((16, 6), np.float32,
                                                            sharding=layout.batch_sharding(2)))
  expected = lambda step: np.arange(96, dtype=np.float32).reshape(16, 6) + 1000.0 * step
  if me == 0:
    params, _ = train.put_params(nnx.state(init_model(cfg, seed=0)))
    actor = tr.WeightPublisher("actor", group, gen.param_shardings(abstract))
    wrong = tr.WeightPublisher("actor_b", group, swapped.param_shardings(abstract))
    critic = tr.WeightSubscriber("critic", 1, target(train))
    rollouts = tr.QueueReceiver("rollouts", 1, batch(train))
    experience = tr.QueueSender("experience", group, capacity=1)
    published, batches, critics = {}, [], []
    actor.publish(params, 0)
    wrong.publish(params, 0)
    published[0] = digest(params)
    for rollout, meta in rollouts:
      step = meta["step"]
      batches.append({**meta, "exact": bool(np.array_equal(distributed.fetch(rollout),
                                                           expected(step)))})
      values, version = critic.acquire(step, timeout_s=120)
      critics.append({"step": step, "version": version, "digest": digest(values),
                      "actor_version": meta["version"]})
      experience.put(rollout * 2, rows.batch_sharding(2), {"step": step}, timeout_s=120)
      params = jax.tree.map(lambda x: x * 0.5 + 1.0, params)
      actor.publish(params, step + 1)
      published[step + 1] = digest(params)
    experience.close()
    distributed.barrier("groups_done")
    actor.close()
    wrong.close()
    seen = {"published": published, "batches": batches, "critics": critics}
  else:
    actor = tr.WeightSubscriber("actor", 0, target(gen), group=group)
    critic = tr.WeightPublisher("critic", [0], train.param_shardings(abstract), group=group)
    rollouts = tr.QueueSender("rollouts", [0], capacity=1, group=group)
    experience = tr.QueueReceiver("experience", 0, batch(rows))
    used, exact, in_flight = [], [], []
    for step in range(steps):
      params, version = actor.acquire(required_version(step, staleness), timeout_s=120)
      used.append({"step": step, "version": version, "digest": digest(params)})
      critic.publish(params, step)
      rollout = distributed.put_global(expected(step), rows.batch_sharding(2))
      rollouts.put(rollout, train.batch_sharding(2), {"step": step, "version": version},
                   timeout_s=120)
      in_flight.append(rollouts.in_flight())
      got, meta = experience.get(timeout_s=120)
      # This process's rows arrived where the global layout puts them.
      exact.append(meta["step"] == step and all(
          np.array_equal(np.asarray(s.data), 2 * expected(step)[s.index])
          for s in got.addressable_shards))
    rollouts.close()
    refused = ""
    try:
      tr.WeightSubscriber("actor_b", 0, target(gen), group=group).acquire(0, timeout_s=60)
    except tr.LayoutMismatch as e:
      refused = str(e)
    distributed.barrier("groups_done")
    critic.close()
    seen = {"used": used, "exact": exact, "in_flight": in_flight, "refused": refused}
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
    {"ppo": ppo, "transfer": transfer, "groups": groups}[args.scenario](args)
  except Exception as e:  # pylint: disable=broad-except
    if watch is None:
      raise
    watch.fail(e)
  if watch is not None:
    watch.finish()


if __name__ == "__main__":
  main()
