"""Benchmark of multi-process runs on one machine: weight sync across processes, s/step.

Owns two measurements, each a job of several local processes started with
`pipe_rlhf_jax.launch` (virtual CPU devices, a free coordinator port, hard timeouts):

* weight sync: process 0 holds an actor laid out for training (fsdp over its devices)
  and publishes it through `distributed.transfer.WeightPublisher`; process 1 asks for
  each version with a `WeightSubscriber` into a generation layout (pipeline x tensor over
  its devices) and times request -> arrays ready. Reported per model size: parameter
  bytes, median seconds, bytes/s. (Includes the key-value round trips and the sender's
  reshard onto the mirrored layout: what a generator waits for.)
* seconds per PPO step of the library API (`system.run`, rule reward, no warm start) for
  each process layout (1 x 8, 2 x 4, 4 x 2 processes x devices, the same 8 devices and
  meshes) and each mode (`pipe` on 4 x 2 runs generation's 4-stage pipeline over two
  whole processes, SPMD in that group). The first --warmup steps (compilation) are
  excluded; a layout the plan cannot run is reported as such.

On virtual CPU devices every process shares the host's cores, so these figures say what
the multi-process machinery costs (collectives through gloo, transfer servers, the
key-value store), not what a cluster's network would give.

Usage:
  python -m experiments.bench_multihost
  python -m experiments.bench_multihost --sync-sizes 64,256 --layouts 1x8,2x4 --steps 6
Writes `multihost.json` and prints the tables (default --out-dir experiments/out/multihost).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# pipe mode's devices of (generate, infer, train): in a 2 x 4 job generation is process
# 0's, inference and training process 1's; in a 4 x 2 job generation spans processes
# 0-1, inference is process 2's and training process 3's.
PIPE_PLACEMENT = (4, 2, 2)


# ---- workers (one process of a job) -----------------------------------------------------
def _join(args) -> None:
  from pipe_rlhf_jax import distributed
  distributed.initialize(distributed.DistributedConfig(
      coordinator_address=args.coordinator_address, num_processes=args.num_processes,
      process_id=args.process_id, cpu_devices=args.cpu_devices))


def _model_config(embed_dim: int):
  from pipe_rlhf_jax.models.config import tiny_config
  return tiny_config(embed_dim=embed_dim, num_layers=4, num_heads=4, num_kv_heads=4,
                     head_dim=embed_dim // 4, mlp_dim=3 * embed_dim, vocab_size=512)


def sync_worker(args) -> None:
  from flax import nnx
  import jax
  import numpy as np

  from pipe_rlhf_jax import distributed
  from pipe_rlhf_jax.distributed import transfer as tr
  from pipe_rlhf_jax.models.transformer import init_model
  from pipe_rlhf_jax.parallel import logical
  from pipe_rlhf_jax.parallel.mesh import MeshShape, make_mesh
  from pipe_rlhf_jax.stages.common import StageLayout
  me = distributed.process_index()
  groups = {p: [d for d in jax.devices() if d.process_index == p] for p in (0, 1)}
  half = len(groups[1]) // 2
  rows = []
  for size in args.sizes:
    cfg = _model_config(size)
    train = StageLayout("train", make_mesh(MeshShape(fsdp=len(groups[0])), groups[0]),
                        logical.STAGE_RULES["train"])
    gen = StageLayout("generate", make_mesh(MeshShape(pipeline=2, tensor=half), groups[1]),
                      logical.STAGE_RULES["generate"])
    abstract = nnx.state(nnx.eval_shape(lambda: init_model(cfg)))
    name = f"actor{size}"
    if me == 0:
      params, _ = train.put_params(nnx.state(init_model(cfg, seed=0)))
      publisher = tr.WeightPublisher(name, [1], gen.param_shardings(abstract))
      for version in range(args.repeats + 1):
        publisher.publish(params, version)
        distributed.barrier(f"{name}/{version}")  # the subscriber took this version
      publisher.close()
    else:
      target = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                            abstract, gen.param_shardings(abstract))
      subscriber = tr.WeightSubscriber(name, 0, target)
      seconds = []
      for version in range(args.repeats + 1):
        start = time.perf_counter()
        params, got = subscriber.acquire(version, timeout_s=300)
        jax.block_until_ready(params)
        seconds.append(time.perf_counter() - start)
        assert got == version
        distributed.barrier(f"{name}/{version}")
      nbytes = sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize
                   for x in jax.tree.leaves(abstract))
      median = statistics.median(seconds[1:])  # the first pull connects and compiles
      rows.append({"embed_dim": size, "bytes": nbytes, "seconds": median,
                   "bytes_per_s": nbytes / median, "first_s": seconds[0]})
  if me == 1:
    with open(os.path.join(args.out, "sync.json"), "w", encoding="utf-8") as f:
      json.dump(rows, f)


def _plan(mode: str):
  """The plan of the PPO measurement in `mode` (the same meshes in every layout)."""
  from pipe_rlhf_jax.config import MeshSpec, Plan, StagePlan
  pipe = mode == "pipe"
  return Plan(
      mode=mode, max_staleness=1 if pipe else 0,
      placement=PIPE_PLACEMENT if pipe else None,
      mesh=MeshSpec(data=-1),
      generate=StagePlan(MeshSpec(data=1, pipeline=4) if pipe else MeshSpec(data=-1),
                         num_microbatches=8 if pipe else 1),
      infer=StagePlan(MeshSpec(data=-1)), train=StagePlan(MeshSpec(data=1, fsdp=-1)))


def ppo_worker(args) -> None:
  import jax

  from pipe_rlhf_jax import distributed
  from pipe_rlhf_jax.config import PPOSettings
  from pipe_rlhf_jax.generation import SamplingSettings
  from pipe_rlhf_jax.models.config import tiny_config
  from pipe_rlhf_jax.models.load import load_tokenizer
  from pipe_rlhf_jax.models.transformer import init_model
  from pipe_rlhf_jax.system import Models, PPOSystem, prompts_from_texts, run
  del jax
  tokenizer = load_tokenizer("byte")
  policy = init_model(tiny_config(), seed=0)  # the quickstart's model
  plan = _plan(args.mode)
  system = PPOSystem(
      Models.from_policy(policy),
      ppo=PPOSettings(steps=args.steps, batch_size=32, minibatch_size=16, actor_lr=1e-4),
      sampling=SamplingSettings(max_new_tokens=8, eos_id=tokenizer.eos_id,
                              pad_id=tokenizer.pad_id),
      plan=plan, reward_fn=lambda p, c: [float(x.count("a")) for x in c],
      decode=tokenizer.decode)
  words = [a + b + c for a in "abcd" for b in "efgh" for c in "ij"]
  prompts = prompts_from_texts([f"rev {w}=" for w in words], tokenizer, batch_size=32,
                               prompt_len=10)
  ends = []
  run(system, prompts, steps=args.steps, on_step=lambda s, m: ends.append(time.perf_counter()))
  steady = ends[args.warmup - 1:]
  # Steps complete on the training stage's processes (in pipe mode across processes, not
  # necessarily process 0's); one process (its leader) writes.
  if system.mode == "pipe" and distributed.process_count() > 1:
    from pipe_rlhf_jax.system.pipe_processes import stage_processes
    writer = stage_processes(system.layouts)["train"][0] == distributed.process_index()
  else:
    writer = distributed.is_primary()
  if writer:
    with open(os.path.join(args.out, "ppo.json"), "w", encoding="utf-8") as f:
      json.dump({"s_per_step": (steady[-1] - steady[0]) / (len(steady) - 1)}, f)


# ---- the driver -----------------------------------------------------------------------------
def _job(kind: str, extra: list[str], out: str, processes: int, devices: int,
         timeout_s: float) -> dict | list | None:
  from pipe_rlhf_jax.launch import launch
  os.makedirs(out, exist_ok=True)
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)
  env.setdefault("JAX_PLATFORMS", "cpu")
  # Each process runs this module as the driver does (`-m`), found from the repository
  # root whatever the working directory.
  env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
  result = launch([kind, f"--out={out}", *extra], num_processes=processes,
                  cpu_devices=devices, log_dir=os.path.join(out, "logs"),
                  timeout_s=timeout_s, command=(sys.executable, "-u", "-m", __spec__.name),
                  echo=False, env=env)
  if not result.ok:
    print(f"{kind} {extra} on {processes} x {devices} failed:\n{result.report()}")
    return None
  with open(os.path.join(out, f"{kind}.json"), encoding="utf-8") as f:
    return json.load(f)


def main() -> None:
  from pipe_rlhf_jax.planner.auto import runnable_across_processes
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("kind", nargs="?", choices=("sync", "ppo"),
                 help="(internal: one process of a job)")
  p.add_argument("--out", default="")
  p.add_argument("--out-dir", default=os.path.join(ROOT, "experiments", "out", "multihost"))
  p.add_argument("--sync-sizes", default="64,128,256,512",
                 help="embedding widths of the 4-layer models whose weights are synced")
  p.add_argument("--repeats", type=int, default=5)
  p.add_argument("--layouts", default="1x8,2x4,4x2", help="processes x devices each")
  p.add_argument("--modes", default="sequential,per_stage,pipe")
  p.add_argument("--mode", default="sequential")
  p.add_argument("--steps", type=int, default=8)
  p.add_argument("--warmup", type=int, default=2)
  p.add_argument("--timeout-s", type=float, default=900.0)
  p.add_argument("--coordinator_address", default="")
  p.add_argument("--num_processes", type=int, default=1)
  p.add_argument("--process_id", type=int, default=0)
  p.add_argument("--cpu_devices", type=int, default=0)
  args = p.parse_args()
  args.sizes = [int(s) for s in args.sync_sizes.split(",") if s]
  if args.kind:
    _join(args)
    (sync_worker if args.kind == "sync" else ppo_worker)(args)
    return

  results = {"sync": None, "ppo": []}
  if args.sizes:
    results["sync"] = _job("sync", [f"--sync-sizes={args.sync_sizes}",
                                    f"--repeats={args.repeats}"],
                           os.path.join(args.out_dir, "sync"), 2, 4, args.timeout_s)
    print("weight sync, process 0 (train, fsdp=4) -> process 1 (generate, pipeline=2 x "
          "tensor=2)")
    print(f"{'embed_dim':>9} {'MB':>8} {'s (median)':>11} {'MB/s':>9} {'first s':>8}")
    for r in results["sync"] or []:
      print(f"{r['embed_dim']:>9} {r['bytes'] / 1e6:>8.2f} {r['seconds']:>11.4f} "
            f"{r['bytes_per_s'] / 1e6:>9.1f} {r['first_s']:>8.2f}")
  print(f"\nseconds per PPO step (steps {args.warmup}..{args.steps - 1})")
  for mode in [m for m in args.modes.split(",") if m]:
    for layout in [x for x in args.layouts.split(",") if x]:
      processes, devices = (int(x) for x in layout.split("x"))
      if not runnable_across_processes(_plan(mode), processes, devices):
        print(f"  {mode:<11} {layout:>4}: not runnable (the placement does not cut at "
              f"process boundaries of {devices} devices)")
        continue
      out = os.path.join(args.out_dir, f"{mode}_{layout}")
      got = _job("ppo", [f"--mode={mode}", f"--steps={args.steps}",
                         f"--warmup={args.warmup}"], out, processes, devices, args.timeout_s)
      row = {"mode": mode, "layout": layout,
             "s_per_step": None if got is None else got["s_per_step"]}
      results["ppo"].append(row)
      shown = "failed" if got is None else f"{got['s_per_step']:.3f}"
      print(f"  {mode:<11} {layout:>4}: {shown}")
  os.makedirs(args.out_dir, exist_ok=True)
  with open(os.path.join(args.out_dir, "multihost.json"), "w", encoding="utf-8") as f:
    json.dump(results, f, indent=2)


if __name__ == "__main__":
  main()
