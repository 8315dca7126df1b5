"""Side by side with the peer library tunix: seconds per PPO step at one model shape.

Owns one comparison: alternating rounds of the peer's benchmark
(`bench_peer_tunix.py`, tunix's own `PPOLearner`, in tunix's virtual environment) and this
project's (`bench_ppo_step --shapes`, `PPOSystem` in `sequential` mode), at the same model
shape, batch and token counts, one CPU device, f32, each in a fresh process so neither
inherits the other's caches. Rounds alternate (peer, ours, peer, ours, ...) so that a
change in the machine's speed during the comparison reaches both sides alike. Both leave
out their compilation step and report the mean of the timed steps; the page lists every
round and the ratio of the means (peer seconds / ours: above 1, this project is faster).
What each side computes, and where the two differ, is in the two scripts' docstrings.
This project's side runs the library's defaults (`StagePlan()`, `bench_ppo_step --shapes`
without plan flags): what a user gets without tuning. `--ours-flags` changes that side's
plan; `--tuned-flags`, where they differ from it, add a side of their own each round, so
that a tuned plan is reported beside the defaults, never in their place. This project
gives XLA's CPU compiler its memory-minimising scheduler
(`host_devices.use_memory_lean_scheduler`, set when `pipe_rlhf_jax.system` is imported
before jax starts); the peer runs under XLA's defaults, and with `--peer-xla-flags` (by
default that same scheduler flag) each round also runs the peer under those flags, so the
page separates what the flag gives from what the framework does.

Usage (the peer's environment first: see bench_peer_tunix.py):
  python -m experiments.side_by_side_tunix --rounds 2 --page
  python -m experiments.side_by_side_tunix --rounds 2 --tuned-flags "--logits-chunk 32" --page
  python -m experiments.side_by_side_tunix --dry-run   # the commands of one round

Writes experiments/out/side_by_side_tunix/rounds.jsonl and, with --page,
docs/results/peer_tunix.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from experiments import results  # noqa: E402
from pipe_rlhf_jax.models import shapes  # noqa: E402

OUT_DIR = os.path.join(_ROOT, "experiments", "out", "side_by_side_tunix")


def peer_dims(shape: str, batch: int, prompt: int, gen: int) -> tuple[int, ...]:
  """`bench_peer_tunix.py --dims` of a published shape."""
  f = shapes.hf_config(shape)
  heads = f["num_attention_heads"]
  if f.get("head_dim", f["hidden_size"] // heads) * heads != f["hidden_size"]:
    raise ValueError(f"{shape}: the peer's Qwen2 takes head_dim = hidden / heads; "
                     f"{shape} has head_dim {f['head_dim']}. Choose another shape.")
  dims = (f["num_hidden_layers"], f["hidden_size"], heads, f["num_key_value_heads"],
          f["intermediate_size"], f["vocab_size"], batch, prompt, gen)
  return dims


PEER, PEER_FLAGGED, OURS, TUNED = ("tunix", "tunix + flags", "pipe_rlhf_jax",
                                  "pipe_rlhf_jax tuned")


def peer_command(args, dims, out_dir: str) -> list[str]:
  # Run from the repository root (`cwd`): the peer's environment lacks this project's
  # package, and `experiments.bench_peer_tunix` imports only `experiments.shapes` of it.
  return [args.peer_python, "-m", "experiments.bench_peer_tunix",
          "--dims", ",".join(map(str, dims)), "--steps", str(args.steps + 1), "--warmup",
          "1", "--out-dir", out_dir]


def ours_command(args, out_dir: str, flags: str) -> list[str]:
  """`bench_ppo_step --shapes` at the comparison's shape; `flags` its plan flags (empty: the
  library's defaults)."""
  return [sys.executable, "-m", "experiments.bench_ppo_step",
          "--shapes", args.shape, "--steps", str(args.steps), "--batch", str(args.batch),
          "--prompt-len", str(args.prompt_len), "--new-tokens", str(args.new_tokens),
          "--untied", "--out-dir", out_dir, *flags.split()]


def tuned(args) -> bool:
  """Whether `--tuned-flags` ask for a plan other than this project's side's."""
  return bool(args.tuned_flags.split()) and args.tuned_flags.split() != args.ours_flags.split()


def run_peer(args, dims, out_dir: str, xla_flags: str = "") -> dict:
  """One round of the peer's benchmark; `xla_flags` (appended to the caller's XLA_FLAGS)
  makes it the flagged variant."""
  cmd = peer_command(args, dims, out_dir)
  env = dict(os.environ)
  if xla_flags:
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {xla_flags}".strip()
  subprocess.run(cmd, cwd=_ROOT, check=True, timeout=args.timeout_s, env=env)
  with open(os.path.join(out_dir, "peer_step.json"), encoding="utf-8") as f:
    row = json.load(f)["rows"][0]
  prefix = f"XLA_FLAGS='{env['XLA_FLAGS']}' " if xla_flags else ""
  return {"side": PEER_FLAGGED if xla_flags else PEER, "s_per_step": row["s_per_step"],
          "generate_s": row["rollout_s"], "infer_s": row["inference_s"],
          "train_s": row["update_s"], "other_s": row["other_s"],
          "command": prefix + " ".join(cmd)}


def run_ours(args, out_dir: str, flags: str | None = None) -> dict:
  """One round of this project's benchmark: `--ours-flags`, or with `flags` the tuned side."""
  cmd = ours_command(args, out_dir, args.ours_flags if flags is None else flags)
  subprocess.run(cmd, cwd=_ROOT, check=True, timeout=args.timeout_s)
  with open(os.path.join(out_dir, f"{args.shape}.jsonl"), encoding="utf-8") as f:
    row = json.loads(f.readlines()[-1])
  return {"side": OURS if flags is None else TUNED, "s_per_step": row["step_s"],
          "generate_s": row["generate_s"], "infer_s": row["infer_s"],
          "train_s": row["train_s"],
          "other_s": row["step_s"] - row["generate_s"] - row["infer_s"] - row["train_s"],
          "command": " ".join(cmd)}


def page_body(args, dims, rounds) -> str:
  mean = lambda side: sum(r["s_per_step"] for r in rounds if r["side"] == side) / max(
      1, sum(r["side"] == side for r in rounds))
  peer, ours, flagged, best = mean(PEER), mean(OURS), mean(PEER_FLAGGED), mean(TUNED)
  sides = len({r["side"] for r in rounds})
  lines = [__doc__.split("\nUsage")[0].split("\n", 1)[1].strip(), "",
           f"Shape {args.shape} ({dims[0]} layers, d{dims[1]}, {dims[2]} / {dims[3]} heads, "
           f"ffn {dims[4]}, vocab {dims[5]}; an untied LM head on both sides: tunix's "
           f"critic builder replaces a model's `lm_head`, which its tied Qwen2 lacks); batch "
           f"{dims[6]}, {dims[7]} prompt + {dims[8]} new tokens; {args.steps} timed steps a "
           f"round after one compile step; this project's plan flags: "
           + (f"`{args.ours_flags}`" if args.ours_flags.split()
              else "none (the library's defaults)")
           + (f"; its tuned side's: `{args.tuned_flags}`" if TUNED in {
               r["side"] for r in rounds} else "") + ".", "",
           "| round | side | s/step | generate | infer | update | other |",
           "|---|---|---|---|---|---|---|"]
  for i, r in enumerate(rounds):
    lines.append(f"| {i // sides + 1} | {r['side']} | {r['s_per_step']:.2f} | "
                 f"{r['generate_s']:.2f} | {r['infer_s']:.2f} | {r['train_s']:.2f} | "
                 f"{r['other_s']:.2f} |")
  lines += ["", f"Mean s/step: tunix {peer:.2f}, pipe_rlhf_jax {ours:.2f}: "
                f"**{peer / ours:.2f}x** the peer's speed (goal: 1.5x)."]
  if PEER_FLAGGED in {r["side"] for r in rounds}:
    lines += ["", f"The peer under `{args.peer_xla_flags}`: {flagged:.2f} s/step; this "
                  f"project is **{flagged / ours:.2f}x** its speed."]
  if TUNED in {r["side"] for r in rounds}:
    lines += ["", f"Tuned (`{args.tuned_flags}`): {best:.2f} s/step, **{peer / best:.2f}x** "
                  f"the peer's speed"
                  + (f", **{flagged / best:.2f}x** the flagged peer's" if PEER_FLAGGED in {
                      r["side"] for r in rounds} else "")
                  + f"; {ours / best:.2f}x the defaults' speed."]
  lines += ["", "Commands of the last round:", ""]
  lines += [f"- {r['side']}: `{r['command']}`" for r in rounds[-sides:]]
  return "\n".join(lines)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=__doc__.split(
      "\nUsage")[1], formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--shape", default="smollm2-135m")
  parser.add_argument("--rounds", type=int, default=2)
  parser.add_argument("--steps", type=int, default=2, help="timed steps per round")
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--prompt-len", type=int, default=64)
  parser.add_argument("--new-tokens", type=int, default=64)
  parser.add_argument("--ours-flags", default="",
                      help="bench_ppo_step --shapes plan flags for this project's side "
                      "(default none: the library's defaults)")
  parser.add_argument("--tuned-flags", default="",
                      help="bench_ppo_step --shapes plan flags of a tuned side, run each round "
                      "beside the defaults where they differ from --ours-flags")
  parser.add_argument("--dry-run", action="store_true",
                      help="print one round's commands and run nothing")
  parser.add_argument("--peer-python", default=os.path.join(_ROOT, ".venv-tunix", "bin",
                                                            "python"))
  parser.add_argument("--peer-xla-flags",
                      default="--xla_cpu_enable_concurrency_optimized_scheduler=false",
                      help="also run the peer under these XLA flags each round (the "
                      "scheduler flag this project's scripts set); empty: skip")
  parser.add_argument("--timeout-s", type=int, default=1800, help="per benchmark process")
  parser.add_argument("--out-dir", default=OUT_DIR)
  results.add_page_flag(parser, "peer_tunix")
  args = parser.parse_args(argv)
  dims = peer_dims(args.shape, args.batch, args.prompt_len, args.new_tokens)
  if args.dry_run:
    out = os.path.join(tempfile.gettempdir(), "<round>")
    print(" ".join(peer_command(args, dims, out)))
    if args.peer_xla_flags:
      print(f"XLA_FLAGS='{args.peer_xla_flags}' " + " ".join(peer_command(args, dims, out)))
    print(" ".join(ours_command(args, out, args.ours_flags)))
    if tuned(args):
      print(" ".join(ours_command(args, out, args.tuned_flags)))
    return
  if not os.path.exists(args.peer_python):
    parser.error(f"--peer-python={args.peer_python} does not exist; make tunix's "
                 "environment first (see the docstring of experiments/bench_peer_tunix.py).")
  os.makedirs(args.out_dir, exist_ok=True)
  rounds = []
  for _ in range(args.rounds):
    runs = [lambda d: run_peer(args, dims, d)]
    if args.peer_xla_flags:
      runs.append(lambda d: run_peer(args, dims, d, args.peer_xla_flags))
    runs.append(lambda d: run_ours(args, d))
    if tuned(args):
      runs.append(lambda d: run_ours(args, d, args.tuned_flags))
    for run in runs:
      with tempfile.TemporaryDirectory() as tmp:
        row = run(tmp)
      rounds.append(row)
      results.record_row(args.out_dir, "rounds", row)
  if args.page:
    # Measured after the rounds, so the benchmarks ran on an idle machine.
    limits = results.machine_limits()
    path = results.write_page(args.page, "Side by side with tunix",
                              page_body(args, dims, rounds), limits)
    print(f"wrote {path}")


if __name__ == "__main__":
  main()
