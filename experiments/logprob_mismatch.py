"""Train-inference mismatch on the real model: the sampler's log-probs against the trainer's.

The most reported failure of RL frameworks is a gap between the log-probs the sampler
records for its tokens and the ones the trainer recomputes for the same tokens at the
same weights (different kernels, precisions and layouts), which biases the importance
ratio and collapses runs. Here one model definition serves both, so the gap should be
near zero; this measures it.

Each cell runs `configs/smollm2_rlvr.py` (the packaged SmolLM2-135M-Instruct, GGUF)
for a few GRPO steps and reads the update's `logprob_gap/max` and `logprob_gap/mean`
(stages/train.py: |behaviour - recomputed| over the completion tokens of the update's
first minibatch, recomputed by the trainer at the weights the update starts from). Every
mode runs with staleness 0, so the trainer's weights are the sampler's and the gap is the
mismatch alone. Cells: the compute dtype (float32; bfloat16 with float32 parameters) x
how it runs:

  sequential        every stage on one device, the plain sampler
  per_stage-pipe2   stages time-shared on two devices, generation the delayed pipelined
                    decoder (pipeline=2, 2 micro-batches), training fsdp=2
  pipe              the three stages concurrently on devices 0 / 1 / 2, plain sampler
  pipe-pipe2        concurrently, generation pipelined over devices 0-1

  python -m experiments.logprob_mismatch --page     # writes docs/results/logprob_mismatch.md
  python -m experiments.logprob_mismatch --steps 2 --cells sequential --dtypes float32

Outputs: experiments/out/logprob_mismatch/<dtype>-<cell>/ (each run's workdir and
gap.json) and the page.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time

from pipe_rlhf_jax.host_devices import use_virtual_cpu_devices

# Before jax starts its backend: the cells' meshes need 8 devices on a CPU.
use_virtual_cpu_devices()

import numpy as np

from experiments import common, results

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CONFIG = os.path.join(_ROOT, "configs", "smollm2_rlvr.py")
CELLS = ("sequential", "per_stage-pipe2", "pipe", "pipe-pipe2")
DTYPES = ("float32", "bfloat16")


def cell_config(cell: str, dtype: str, steps: int):
  """The smollm2_rlvr config of one cell: few steps, small batches, no evaluation."""
  config = common.load_config(CONFIG)
  config.name = f"logprob_mismatch-{dtype}-{cell}"
  config.model.dtype = dtype
  config.model.param_dtype = "float32"
  config.ppo.update(steps=steps, batch_size=8, minibatch_size=8, warmup_steps=1)
  config.log.update(eval_prompts=0, eval_samples_per_prompt=0, samples=0)
  config.checkpoint.every = steps
  config.plan.max_staleness = 0
  gen = config.stages.generate
  if cell == "sequential":
    return config
  if cell == "per_stage-pipe2":
    config.plan.mode = "per_stage"
    config.plan.num_devices = 2
    gen.mesh = dict(data=1, fsdp=1, tensor=1, pipeline=2)
    gen.num_microbatches = 2
    config.stages.infer.mesh = dict(data=2)
    config.stages.train.mesh = dict(fsdp=2)
    return config
  config.plan.mode = "pipe"
  if cell == "pipe":
    config.plan.num_devices = 3
    config.plan.placement.update(generate=1, infer=1, train=1)
    return config
  if cell == "pipe-pipe2":
    config.plan.num_devices = 4
    config.plan.placement.update(generate=2, infer=1, train=1)
    gen.mesh = dict(data=1, fsdp=1, tensor=1, pipeline=2)
    gen.num_microbatches = 2
    return config
  raise ValueError(f"--cells: unknown cell {cell!r}; choose from {CELLS}.")


def run_cell(cell: str, dtype: str, steps: int, out: str) -> dict:
  """Runs one cell (or reads its finished gap.json) and returns its record."""
  from pipe_rlhf_jax.train import train
  workdir = os.path.join(out, f"{dtype}-{cell}")
  done = os.path.join(workdir, "gap.json")
  if os.path.exists(done):
    with open(done, encoding="utf-8") as f:
      return json.load(f)
  if os.path.exists(workdir):
    import shutil
    shutil.rmtree(workdir)  # an interrupted run starts again
  config = cell_config(cell, dtype, steps)
  t0 = time.perf_counter()
  result = train(config, workdir, progress=False)
  rows = sorted(result.ppo_metrics, key=lambda r: r["step"])
  record = {
      "cell": cell, "dtype": dtype, "steps": len(rows),
      "gap_max": [r["logprob_gap/max"] for r in rows],
      "gap_mean": [r["logprob_gap/mean"] for r in rows],
      "staleness": [r.get("staleness/actor", 0.0) for r in rows],
      "tokens": [r["response_length/mean"] * config.ppo.minibatch_size for r in rows],
      "wall_s": time.perf_counter() - t0,
  }
  with open(done, "w", encoding="utf-8") as f:
    json.dump(record, f, indent=1)
  return record


def format_page(records: list[dict], command: str) -> str:
  """The page's body: one row per cell, and how to read it."""
  lines = [
      "Per cell: the largest and the mean |behaviour − recomputed| log-prob of the sampled "
      "tokens, over every PPO step of the run (each step's first minibatch: "
      f"{int(records[0]['tokens'][0]) if records else 0}-ish completion tokens), with "
      "staleness 0 so the trainer's weights are the sampler's. `exp(max)` is the largest "
      "importance ratio the mismatch alone puts into the PPO objective (1 = none); the "
      "clip range is 1 ± 0.2.", "",
      "| dtype | cell | steps | tokens compared | max gap (nats) | mean gap (nats) | "
      "exp(max) | staleness |",
      "|---|---|---|---|---|---|---|---|"]
  for r in records:
    top = float(np.max(r["gap_max"]))
    mean = float(np.average(r["gap_mean"], weights=r["tokens"]))
    lines.append(f"| {r['dtype']} | {r['cell']} | {r['steps']} | {int(sum(r['tokens']))} | "
                 f"{top:.2e} | {mean:.2e} | {np.exp(top):.6f} | "
                 f"{max(r['staleness']):.0f} |")
  lines.append("")
  for dtype in dict.fromkeys(r["dtype"] for r in records):
    tops = [float(np.max(r["gap_max"])) for r in records if r["dtype"] == dtype]
    ratio = float(np.exp(max(tops)))
    verdict = ("inside the clip range: the mismatch alone does not move a ratio out of it"
               if ratio < 1.2 else
               "beyond the clip range: on some tokens the ratio the update sees differs "
               "from 1 by precision alone, so a run in this dtype should use the "
               "decoupled objective or a behaviour-weight cap, or compute the sampler in "
               "float32")
    lines.append(f"- {dtype}: the largest gap is {max(tops):.2e} nats, a ratio of "
                 f"{ratio:.4f}: {verdict}.")
  lines += ["", "How it is measured: `stages/train.py` (`logprob_gap`) compares the "
            "behaviour log-probs the sampler recorded with those of the update's first "
            "gradient step, whose forward pass runs at the update's starting weights in the "
            "training stage's own layout and precision (the same model code; the "
            "trainer's attention and LM head are computed over the whole sequence, the "
            "sampler's token by token against its KV cache). Every PPO run logs it "
            "(`logprob_gap/*` in metrics.jsonl); with staleness > 0 it also holds how far "
            "the policy moved since the rollout was sampled.", "",
            f"Re-run: `{command}`."]
  return "\n".join(lines)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--cells", default=",".join(CELLS))
  parser.add_argument("--dtypes", default=",".join(DTYPES))
  parser.add_argument("--steps", type=int, default=3)
  parser.add_argument("--out", default=os.path.join(_ROOT, "experiments", "out",
                                                    "logprob_mismatch"))
  results.add_page_flag(parser, "logprob_mismatch")
  args = parser.parse_args(argv)
  words = sys.argv[1:] if argv is None else list(argv)
  command = shlex.join(["python", "-m", "experiments.logprob_mismatch", *words])
  os.makedirs(args.out, exist_ok=True)
  records = []
  for dtype in [d for d in args.dtypes.split(",") if d]:
    for cell in [c for c in args.cells.split(",") if c]:
      record = run_cell(cell, dtype, args.steps, args.out)
      print(f"[logprob_mismatch] {dtype} {cell}: max {max(record['gap_max']):.2e}, mean "
            f"{np.mean(record['gap_mean']):.2e} ({record['wall_s']:.0f}s)", flush=True)
      records.append(record)
  body = format_page(records, command)
  print(body)
  if args.page:
    path = results.write_page(args.page, "Train-inference log-prob mismatch on the real "
                              "model", body, None, command=command)
    print(f"wrote {path}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
