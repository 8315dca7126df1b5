"""Learning curves across modes and seeds: does asynchronous PPO learn as well?

Owns one experiment: for a config (the quickstart by default: PPO against a learned reward
model; or any config with a `reward.eval_fn` rule), every seed's warm start (SFT + reward
model) is trained once (`train.prepare_warm_start`), then every *cell* starts PPO from that
same checkpoint (`warm_start.checkpoint`). A cell is a schedule:

  sequential       the serial baseline
  pipe_s<k>        `pipe` mode with plan.max_staleness=k (pipe_s0 is on-policy)
  decoupled_s<k>   `pipe` mode, staleness k, the decoupled objective
                   (ppo.loss=decoupled_ppo_clip: the off-policy corrected objective)

Per run it records the curve of the rule's score of the sampled answers
(`rule_reward/mean`, i.e. `reward.eval_fn`: never optimised when the reward is a model),
the learned reward and the KL per PPO step, and the held-out evaluation before and
after PPO: the greedy answers' `reward.eval_fn` score on the held-out prompts
(`log.eval_prompts`; the result's `heldout_before` / `heldout_after`, and each prompt's
score, `heldout_per_prompt`) and, with `log.eval_samples_per_prompt` = k, the same rule
over k answers per prompt sampled as PPO samples (`heldout_sampled`). Per cell, over
seeds (mean +- sample std): the accuracy at the start (step 0: the warm-start policy, the
same in every cell of a seed) and over the last 20% of steps, the gain, KL over the last
20% of steps, the held-out sampled score before -> after and its gain, the greedy score
before -> after, in how many seeds each fell and in how many of those beyond the 95%
bootstrap interval over the held-out prompts (`heldout.paired_change`), and samples/s (PPO
samples per second between consecutive updates, the first two excluded: compilation).
Samples/s are only meaningful on a quiet machine; accuracies are valid under any load.

Outputs under --out (default experiments/out/learning_curves/<config name>[-<tag>]):
  seed<k>/<cell>/            each PPO run's workdir, and its run.json when finished
  runs.csv, runs.json        every finished run
  table.md                   the per-cell table, with the command and the goal checks
  curves.png                 accuracy vs PPO step, mean and +-1 std band per cell
  settings.json              what the runs were made with (the overrides and the config's
                             resolved ppo / reward sections); other settings, a changed
                             default included, refuse to resume into the same directory
                             (use --tag)

Warm starts live beside the output directories, in
experiments/out/learning_curves/warm_starts/<fingerprint>/ (the hash of the seed and the
sections that decide the warm start: `phases.warm_start.warm_start_fingerprint`), so
experiments that
change only PPO settings (--set ppo.kl_coef=..., another --tag) reuse them, and two
invocations running at once wait for each other's warm start instead of training it twice.

Resumable: a run whose run.json exists is skipped, so the command can be repeated after
an interruption (the unfinished run starts again from scratch). Several invocations may
share the work: each run is locked (seed<k>/<cell>.lock) by the process running it, and
the others pass over it.

Usage:
  python -m experiments.learning_curves                                 # 3 seeds x 7 cells
  python -m experiments.learning_curves --seeds 0,1,2 --cells sequential,pipe_s1
  python -m experiments.learning_curves --cells sequential,partial_s1,partial_s2 \
      --tag partial --page learning_partial      # partial rollouts (decoupled loss)
  python -m experiments.learning_curves --set ppo.kl_coef=0.1 --tag kl0.1
  python -m experiments.learning_curves --config configs/grpo_arith.py
  python -m experiments.learning_curves --report-only                   # table from run.json
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import fcntl
import json
import os
import re
import shlex
import shutil
import sys
import time

from pipe_rlhf_jax.host_devices import use_virtual_cpu_devices

use_virtual_cpu_devices()

import numpy as np

from experiments import results
from experiments.common import apply_overrides, config_module, parse_value

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

DEFAULT_CELLS = ("sequential", "pipe_s0", "pipe_s1", "pipe_s2", "pipe_s4", "decoupled_s2",
                 "decoupled_s4")
FINAL_FRACTION = 0.2  # "final" = the mean over the last 20% of PPO steps
_CELL_RE = re.compile(r"^(sequential|pipe_s(\d+)|decoupled_s(\d+)|partial_s(\d+))$")
# partial_s<k>: the generation mesh without a pipeline axis (the slot engine's), its
# devices over data, and as many slots as a batch has completions.
_PARTIAL = {"plan.partial_rollouts": True, "stages.generate.mesh.pipeline": 1,
            "stages.generate.mesh.tensor": 1, "stages.generate.mesh.data": -1}


# ---- cells and configs -------------------------------------------------------------------
def cell_overrides(cell: str) -> dict:
  """The config overrides (dotted path -> value) that make a cell's schedule.

  Raises:
    ValueError: an unknown cell name.
  """
  match = _CELL_RE.match(cell)
  if not match:
    raise ValueError(f"--cells: unknown cell {cell!r}; use sequential, pipe_s<k>, "
                     "decoupled_s<k> or partial_s<k> (k = plan.max_staleness).")
  if cell == "sequential":
    return {"plan.mode": "sequential", "plan.max_staleness": 0}
  staleness = int(match.group(2) or match.group(3) or match.group(4))
  loss = "ppo_clip" if cell.startswith("pipe") else "decoupled_ppo_clip"
  out = {"plan.mode": "pipe", "plan.max_staleness": staleness, "ppo.loss": loss}
  if cell.startswith("partial"):
    out.update(_PARTIAL)
  return out


def run_config(args, seed: int, cell: str | None, warm_dir: str | None):
  """The config of one run: the experiment's settings, the seed, the cell's schedule and
  (with a cell) the warm-start run `warm_dir` to start from.

  A config whose sequential plan shares fewer devices than its pipe mode needs (e.g. one
  device for every stage, against one per stage) says how it runs in pipe mode with a
  module-level `use_pipe_mode(config, max_staleness)`, applied to pipe cells.
  """
  module = config_module(args.config)
  config = module.get_config(args.config.partition(":")[2])
  config.seed = seed
  apply_overrides(config, args.overrides)
  if args.steps:
    config.ppo.steps = args.steps
  config.checkpoint.every = config.ppo.steps  # one PPO checkpoint, at the end
  config.log.every = 1
  if not scored_by(config):
    raise ValueError(f"--config {args.config}: reward.eval_fn is empty and no environment "
                     "gives the reward; the learning curves measure a rule's score (or an "
                     "environment's reward), so the config needs one.")
  if not config.log.get("eval_prompts", 0):
    raise ValueError(f"--config {args.config}: log.eval_prompts is 0; the learning curves "
                     "compare greedy held-out answers before and after PPO, so set it "
                     "(e.g. --set log.eval_prompts=256).")
  if cell is not None:
    overrides = cell_overrides(cell)
    if overrides["plan.mode"] == "pipe" and hasattr(module, "use_pipe_mode"):
      module.use_pipe_mode(config, overrides["plan.max_staleness"])
    apply_overrides(config, overrides)
    if config.plan.get("partial_rollouts"):
      config.stages.generate.num_slots = config.ppo.batch_size
    config.warm_start.checkpoint = os.path.join(warm_dir, "warmstart")
    # The task data the warm start was built from (the same seed makes the same data):
    # read, not generated again per run.
    config.data.dir = os.path.join(warm_dir, "data")
  return config


@contextlib.contextmanager
def locked(path: str, wait: bool = True):
  """Holds an exclusive lock on the file `path`; yields False (holding nothing) when
  `wait` is False and another process holds it."""
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, "w", encoding="utf-8") as f:
    try:
      fcntl.flock(f, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
      held = True
    except BlockingIOError:
      held = False
    try:
      yield held
    finally:
      if held:
        fcntl.flock(f, fcntl.LOCK_UN)


def shared_warm_start(config, store: str, prepare) -> dict:
  """The seed's warm start from the store, trained there first when missing.

  Args:
    config: a run config without a cell (its PPO plan does not matter).
    store: the warm-start store directory.
    prepare: `train.prepare_warm_start`.
  """
  from pipe_rlhf_jax.config import ExperimentSettings
  from pipe_rlhf_jax.phases.warm_start import warm_start_fingerprint
  directory = os.path.join(store,
                           warm_start_fingerprint(ExperimentSettings.from_config(config)))
  with locked(os.path.join(directory, ".lock")):
    return prepare(config, os.path.join(directory, "run"), progress=False)


# ---- one run -------------------------------------------------------------------------------
def steady_samples_per_s(tracer, batch_size: int, excluded: int = 2) -> float:
  """PPO samples per second from the spacing of train-span ends, the first `excluded`
  updates (compilation) left out; the same definition as experiments/bench_modes.py."""
  ends = sorted(s.end for s in tracer.spans("train"))
  if len(ends) <= excluded:
    return float("nan")
  return batch_size * (len(ends) - excluded) / (ends[-1] - ends[excluded - 1])


def stage_tokens_per_s(tracer, rows: list[dict], batch_size: int, prompt_len: int,
                       epochs: int, excluded: int = 2) -> dict[str, float]:
  """Tokens per second of each stage's own spans, the first `excluded` steps (compiling)
  left out: generate counts the completion tokens it sampled, infer the prompt and
  completion tokens it scored (each model pass), train those it trained on per epoch.
  Spans are the stages' wall time, so a stage that shares its devices is timed as it ran.
  """
  counted = rows[excluded:]
  if not counted:
    return {}
  completion = sum(r.get("response_length/mean", 0.0) for r in counted)
  out = {}
  for stage in ("generate", "infer", "train"):
    spans = tracer.spans(stage)[excluded:]
    seconds = sum(s.end - s.start for s in spans)
    if not spans or seconds <= 0:
      continue
    per_row = completion if stage == "generate" else (
        completion + prompt_len * len(counted)) * (epochs if stage == "train" else 1)
    out[stage] = per_row * batch_size / seconds
  return out


def host_description() -> str:
  """The CPU and the jax build a run was made on.

  A seed's warm start is not the same on every host: the same code, versions and seed 0
  trained reward models of 0.828 and 0.777 held out on two of this project's machines
  (an AVX-512 / AMX host gave 0.828 with and without `--xla_cpu_max_isa=AVX2`, so XLA's
  own choice of instruction set is not the whole cause). Tables of different hosts are
  compared by cell, never run by run.
  """
  import jax
  model, flags = "unknown CPU", set()
  with contextlib.suppress(OSError):
    with open("/proc/cpuinfo", encoding="utf-8") as f:
      for line in f:
        key, _, value = line.partition(":")
        if key.strip() == "model name" and model == "unknown CPU":
          model = value.strip()
        elif key.strip() == "flags":
          flags = set(value.split())
          break
  isa = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_tile") if f in flags]
  return f"{model} ({' '.join(isa) or 'no AVX2'}), jax {jax.__version__}"


def scored_by(config) -> str:
  """What the curves measure: the rule `reward.eval_fn`, or with multi-turn episodes the
  environment `env.name` (whose reward PPO optimises); "" for neither."""
  if config.reward.eval_fn:
    return config.reward.eval_fn
  return config.get("env", {}).get("name", "") if config.reward.fn == "environment" else ""


def tool_fields(result, rows: list[dict], env: str) -> dict:
  """With an environment: the share of held-out greedy episodes that called a tool,
  before and after PPO (and per prompt), and the share per PPO batch."""
  key = f"{env}_tool_calls"
  if key not in result.heldout_before:
    return {}
  return {"tool_before": result.heldout_before[key], "tool_after": result.heldout_after[key],
          "tool_before_per_prompt": result.heldout_per_prompt["before"][key],
          "tool_after_per_prompt": result.heldout_per_prompt["after"][key],
          "tool_curve": [r.get("env/tool_call_rate", float("nan")) for r in rows],
          "turns_curve": [r.get("env/turns", float("nan")) for r in rows]}


def summarise_run(result: dict, config, seed: int, cell: str, wall_s: float) -> dict:
  """The numbers of one finished run that the table and the plot need."""
  rows = sorted(result.ppo_metrics, key=lambda r: r["step"])
  steps = len(rows)
  last = max(1, int(round(FINAL_FRACTION * steps)))
  # The rule's score of the sampled answers; an environment's reward is PPO's own.
  curve = [r["rule_reward/mean" if config.reward.eval_fn else "reward/mean"] for r in rows]
  kl = [r.get("kl/mean", float("nan")) for r in rows]  # absent when there is no reference
  # The held-out greedy scores of `reward.eval_fn` (or the environment's) before and after.
  fn = scored_by(config)
  return {
      "seed": seed, "cell": cell, "mode": config.plan.mode,
      "max_staleness": config.plan.max_staleness if config.plan.mode == "pipe" else 0,
      "loss": config.ppo.loss, "steps": steps,
      "acc_start": curve[0], "acc_final": float(np.mean(curve[-last:])),
      "gain": float(np.mean(curve[-last:]) - curve[0]),
      "kl_end": float(np.mean(kl[-last:])),
      "reward_start": rows[0]["reward/mean"],
      "reward_final": float(np.mean([r["reward/mean"] for r in rows[-last:]])),
      "greedy_before": result.heldout_before[fn],
      "greedy_after": result.heldout_after[fn],
      "greedy_prompts": result.heldout_prompts,
      # Each held-out prompt's greedy score, in the same order before and after.
      "greedy_before_per_prompt": result.heldout_per_prompt["before"][fn],
      "greedy_after_per_prompt": result.heldout_per_prompt["after"][fn],
      # k sampled answers per held-out prompt (log.eval_samples_per_prompt), when on.
      **sampled_fields(result.heldout_sampled, fn),
      "staleness_mean": float(np.mean([r.get("staleness/actor", 0.0) for r in rows])),
      "rm_eval_accuracy": (result.rm_eval or {}).get("eval_accuracy"),  # None: a rule
      "samples_per_s": steady_samples_per_s(result.tracer, config.ppo.batch_size),
      # Per stage, over the steps after compiling (rows: one per PPO step).
      "tokens_per_s": stage_tokens_per_s(result.tracer, rows, config.ppo.batch_size,
                                         config.data.prompt_len, config.ppo.epochs),
      # |behaviour - the trainer's recomputed| log-probs (stages/train.py: logprob_gap).
      "logprob_gap_max": [r.get("logprob_gap/max", float("nan")) for r in rows],
      "logprob_gap_mean": [r.get("logprob_gap/mean", float("nan")) for r in rows],
      "response_length": [r.get("response_length/mean", float("nan")) for r in rows],
      "wall_s": wall_s, "load_average": os.getloadavg()[0], "host": host_description(),
      "curve": curve, "reward_curve": [r["reward/mean"] for r in rows], "kl_curve": kl,
      "samples_after": result.samples_after, "samples_before": result.samples_before,
      **(tool_fields(result, rows, fn) if not config.reward.eval_fn else {}),
  }


def sampled_fields(sampled: dict | None, fn: str) -> dict:
  """A run's record of its held-out sampled evaluation (`heldout_sampled` of the result):
  the mean before and after PPO and each prompt's; {} when it was off."""
  if not sampled:
    return {}
  return {"sampled_k": sampled["samples_per_prompt"], "sampled_before": sampled["before"][fn],
          "sampled_after": sampled["after"][fn],
          "sampled_before_per_prompt": sampled["per_prompt"]["before"][fn],
          "sampled_after_per_prompt": sampled["per_prompt"]["after"][fn]}


def sampled_change(run: dict):
  """The paired change of the run's held-out sampled scores, or None without them."""
  return _paired(run, "sampled")


def greedy_change(run: dict):
  """The run's paired change of the held-out greedy scores (`heldout.PairedChange`), or
  None for a run recorded before the per-prompt scores were."""
  return _paired(run, "greedy")


def _paired(run: dict, name: str):
  from pipe_rlhf_jax.phases.heldout import paired_change
  if f"{name}_after_per_prompt" not in run:
    return None
  return paired_change(run[f"{name}_before_per_prompt"], run[f"{name}_after_per_prompt"])


# ---- aggregation and output ------------------------------------------------------------------
def mean_std(values) -> tuple[float, float]:
  """Mean and sample standard deviation (ddof=1; 0 for a single value)."""
  values = np.asarray([v for v in values if v is not None], np.float64)
  if not values.size:
    return float("nan"), float("nan")
  return float(values.mean()), float(values.std(ddof=1)) if values.size > 1 else 0.0


def aggregate(runs: list[dict], cells: list[str]) -> list[dict]:
  """One row per cell: mean and std over its seeds, plus the paired difference to
  `sequential` of the same seed (the cells of a seed share the warm start)."""
  seq = {r["seed"]: r for r in runs if r["cell"] == "sequential"}
  table = []
  for cell in cells:
    rs = sorted((r for r in runs if r["cell"] == cell), key=lambda r: r["seed"])
    if not rs:
      continue
    row = {"cell": cell, "seeds": [r["seed"] for r in rs]}
    for key in ("acc_start", "acc_final", "gain", "kl_end", "greedy_before", "greedy_after",
                "samples_per_s", "reward_final", "staleness_mean"):
      row[key] = mean_std([r[key] for r in rs])
    row["gain_min"] = min(r["gain"] for r in rs)
    row["greedy_worse"] = sum(r["greedy_after"] < r["greedy_before"] for r in rs)
    changes = [greedy_change(r) for r in rs]
    # Runs whose greedy score fell beyond its 95% interval over prompts (None: some runs
    # have no per-prompt scores).
    row["greedy_worse_95"] = (None if None in changes else
                              sum(c.significantly_worse for c in changes))
    sampled = [sampled_change(r) for r in rs]
    if None in sampled:  # some runs were recorded without the sampled evaluation
      row["sampled_before"] = row["sampled_after"] = row["sampled_gain"] = (float("nan"),) * 2
      row["sampled_gain_min"], row["sampled_worse"], row["sampled_worse_95"] = (
          float("nan"), None, None)
    else:
      row["sampled_before"] = mean_std([r["sampled_before"] for r in rs])
      row["sampled_after"] = mean_std([r["sampled_after"] for r in rs])
      row["sampled_gain"] = mean_std([c.delta for c in sampled])
      row["sampled_gain_min"] = min(c.delta for c in sampled)
      row["sampled_worse"] = sum(c.delta < 0 for c in sampled)
      row["sampled_worse_95"] = sum(c.significantly_worse for c in sampled)
    paired = [r["acc_final"] - seq[r["seed"]]["acc_final"] for r in rs if r["seed"] in seq]
    row["vs_sequential"] = mean_std(paired) if paired else (float("nan"), float("nan"))
    table.append(row)
  return table


def _pm(value: tuple[float, float], fmt: str = "{:.3f}") -> str:
  mean, std = value
  return "-" if np.isnan(mean) else f"{fmt.format(mean)} ± {fmt.replace('+', '').format(std)}"


def _arrow(before: tuple[float, float], after: tuple[float, float]) -> str:
  return "-" if np.isnan(before[0]) else f"{before[0]:.3f} → {after[0]:.3f}"


def _or_dash(value) -> str:
  return "-" if value is None else str(value)


def format_table(table: list[dict]) -> str:
  """The markdown table of `aggregate`'s rows."""
  lines = ["| cell | seeds | accuracy start | accuracy final (last 20%) | gain | min gain | "
           "final − sequential (paired) | KL end | held-out sampled before → after | "
           "its gain (min) | its gain < 0 (beyond 95%) | greedy before → after | "
           "greedy worse (beyond 95%) | samples/s* |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
  for row in table:
    sampled_min = ("-" if np.isnan(row["sampled_gain_min"])
                   else f"{row['sampled_gain_min']:+.3f}")
    sampled_worse = ("-" if row["sampled_worse"] is None else
                     f"{row['sampled_worse']}/{len(row['seeds'])} ({row['sampled_worse_95']})")
    lines.append(
        f"| {row['cell']} | {len(row['seeds'])} | {_pm(row['acc_start'])} | "
        f"{_pm(row['acc_final'])} | {_pm(row['gain'], '{:+.3f}')} | {row['gain_min']:+.3f} | "
        f"{_pm(row['vs_sequential'], '{:+.3f}')} | {_pm(row['kl_end'], '{:.2f}')} | "
        f"{_arrow(row['sampled_before'], row['sampled_after'])} | "
        f"{_pm(row['sampled_gain'], '{:+.3f}')} ({sampled_min}) | {sampled_worse} | "
        f"{row['greedy_before'][0]:.3f} → {row['greedy_after'][0]:.3f} | "
        f"{row['greedy_worse']}/{len(row['seeds'])} ({_or_dash(row['greedy_worse_95'])}) | "
        f"{_pm(row['samples_per_s'], '{:.1f}')} |")
  return "\n".join(lines)


def _change(run: dict, name: str) -> str:
  """`name`'s ("greedy" / "sampled") before → after of a run, with its paired change."""
  change = _paired(run, name)
  if change is None:
    return "-"
  return (f"{run[f'{name}_before']:.3f} → {run[f'{name}_after']:.3f} ({change.delta:+.3f}, "
          f"95% interval [{change.low:+.3f}, {change.high:+.3f}])")


def format_runs(runs: list[dict]) -> str:
  """One row per run: its held-out changes with their intervals, KL, time and rates (and
  with an environment, its greedy episodes' tool-call rate)."""
  tools = any("tool_before" in r for r in runs)
  lines = ["| seed | cell | greedy before → after (change, 95% interval) | "
           "held-out sampled before → after (change, 95% interval) | "
           + ("greedy tool-call rate before → after (change, 95% interval) | "
              "PPO batches' tool-call rate first → last step | " if tools else "")
           + "KL end | wall s | tokens/s generate / infer / train |",
           "|---|---|---|---|" + ("---|---|" if tools else "") + "---|---|---|"]
  for run in sorted(runs, key=lambda r: (r["cell"], r["seed"])):
    rates = run.get("tokens_per_s") or {}
    rate = " / ".join(f"{rates[k]:.0f}" if k in rates else "-"
                      for k in ("generate", "infer", "train"))
    lines.append(f"| {run['seed']} | {run['cell']} | {_change(run, 'greedy')} | "
                 f"{_change(run, 'sampled')} | "
                 + (f"{_change(run, 'tool')} | {_first_last(run.get('tool_curve'))} | "
                    if tools else "")
                 + f"{run['kl_end']:.3f} | {run['wall_s']:.0f} | {rate} |")
  return "\n".join(lines)


def _first_last(curve) -> str:
  return "-" if not curve else f"{curve[0]:.3f} → {curve[-1]:.3f}"


def format_answers(runs: list[dict], count: int = 4) -> str:
  """The held-out answers shown before and after PPO, of the first seed of each cell."""
  blocks = []
  for cell in dict.fromkeys(r["cell"] for r in runs):
    run = min((r for r in runs if r["cell"] == cell), key=lambda r: r["seed"])
    for when in ("before", "after"):
      shown = run.get(f"samples_{when}") or []
      if shown:
        blocks.append(f"Seed {run['seed']} {cell}, {when} PPO:\n\n```text\n"
                      + "\n".join(shown[:count]) + "\n```")
  return "\n\n".join(blocks)


def paired(runs: list[dict], cell: str, baseline: str) -> list[float]:
  """Final accuracy of `cell` minus `baseline`'s, per seed that ran both (sorted by seed)."""
  base = {r["seed"]: r["acc_final"] for r in runs if r["cell"] == baseline}
  return [r["acc_final"] - base[r["seed"]] for r in sorted(runs, key=lambda r: r["seed"])
          if r["cell"] == cell and r["seed"] in base]


def greedy_goal_lines(runs: list[dict], goal: float) -> list[str]:
  """Per cell: whether every seed's held-out greedy score rose by at least `goal` with a
  95% interval above zero, with each seed's change and interval."""
  lines = []
  for cell in dict.fromkeys(r["cell"] for r in runs):
    rs = sorted((r for r in runs if r["cell"] == cell), key=lambda r: r["seed"])
    changes = [(r["seed"], greedy_change(r)) for r in rs]
    met = [c is not None and c.delta >= goal and c.low > 0 for _, c in changes]
    per_seed = "; ".join(f"seed {seed} {c.delta:+.3f} [{c.low:+.3f}, {c.high:+.3f}]"
                         for seed, c in changes if c is not None)
    lines.append(f"- {cell}: held-out greedy gain >= {goal:+.2f} with its 95% interval above "
                 f"zero in {sum(met)} of {len(rs)} seeds: "
                 f"{'holds' if all(met) else 'does NOT hold'} ({per_seed})")
  return lines


def goal_checks(table: list[dict], runs: list[dict]) -> list[str]:
  """The experiment's goals, each stated with its numbers and whether it holds.

  "Within one standard deviation" compares the cells' means against the larger of their
  standard deviations over seeds (the experiment's criterion); the paired differences (same
  seed, same warm start) are given beside it, since they remove the seed-to-seed spread.
  """
  rows = {r["cell"]: r for r in table}

  def compare(cell: str, baseline: str) -> tuple[float, float, list[float]]:
    diff = rows[cell]["acc_final"][0] - rows[baseline]["acc_final"][0]
    std = max(rows[cell]["acc_final"][1], rows[baseline]["acc_final"][1])
    return diff, std, paired(runs, cell, baseline)

  def per_seed(values: list[float]) -> str:
    return ", ".join(f"{v:+.3f}" for v in values)

  lines = []
  for cell in ("pipe_s1", "pipe_s2", "partial_s1", "partial_s2"):
    if cell in rows and "sequential" in rows:
      diff, std, pairs = compare(cell, "sequential")
      lines.append(f"- {cell} final accuracy vs sequential: {diff:+.3f} (one std: {std:.3f}): "
                   f"{'holds' if abs(diff) <= std else 'does NOT hold'}; per seed "
                   f"{per_seed(pairs)}")
  if "decoupled_s4" in rows and "pipe_s4" in rows:
    diff, std, pairs = compare("decoupled_s4", "pipe_s4")
    lines.append(f"- decoupled_s4 vs pipe_s4 final accuracy: {diff:+.3f} (one std: {std:.3f}): "
                 f"{'no worse' if diff >= -std else 'WORSE'} within one std; per seed "
                 f"{per_seed(pairs)} (lower in {sum(p < 0 for p in pairs)} of {len(pairs)})")
  for row in table:
    # The held-out sampled gain when the runs have it (its start is measured on 4 x 256
    # answers, the curve's on one batch); else the curve's.
    if not np.isnan(row["sampled_gain_min"]):
      if row["sampled_gain_min"] <= 0:
        lines.append(f"- {row['cell']}: the held-out sampled gain is not positive in every "
                     f"seed (min {row['sampled_gain_min']:+.3f})")
    elif row["gain_min"] <= 0:
      lines.append(f"- {row['cell']}: the gain is not positive in every seed "
                   f"(min {row['gain_min']:+.3f})")
    if row["greedy_worse"]:
      lines.append(f"- {row['cell']}: greedy answers got worse in {row['greedy_worse']} "
                   f"of {len(row['seeds'])} seeds"
                   + ("" if row["greedy_worse_95"] is None else
                      f", beyond the 95% interval over prompts in {row['greedy_worse_95']}"))
    if row["sampled_worse"]:
      lines.append(f"- {row['cell']}: the held-out sampled score fell in "
                   f"{row['sampled_worse']} of {len(row['seeds'])} seeds, beyond the 95% "
                   f"interval over prompts in {row['sampled_worse_95']}")
  for run in sorted(runs, key=lambda r: (r["cell"], r["seed"])):
    for name, change in (("greedy", greedy_change(run)), ("held-out sampled",
                                                          sampled_change(run))):
      if change is not None and change.significantly_worse:
        lines.append(f"  - seed {run['seed']} {run['cell']}: {name} {change.delta:+.3f}, 95% "
                     f"interval [{change.low:+.3f}, {change.high:+.3f}], {change.worse} "
                     f"prompts worse / {change.better} better")
  return lines


def smooth(curve, window: int) -> np.ndarray:
  """Trailing moving average (the first points average what exists so far)."""
  curve = np.asarray(curve, np.float64)
  sums = np.cumsum(np.concatenate([[0.0], curve]))
  idx = np.arange(1, curve.size + 1)
  lo = np.maximum(idx - window, 0)
  return (sums[idx] - sums[lo]) / (idx - lo)


def plot_curves(runs: list[dict], cells: list[str], path: str, title: str) -> str:
  """Accuracy vs PPO step: per cell the mean over seeds (line) and +-1 std (band) of the
  smoothed per-run curves. Columns: staleness; the decoupled objective. Top row: the
  accuracy; bottom row: the accuracy minus the seed's step-0 accuracy (the same in every
  cell of a seed), which removes the seed-to-seed spread of the warm starts."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  steps = min(len(r["curve"]) for r in runs)
  window = max(1, steps // 10)
  panels = ([c for c in cells if not c.startswith("decoupled")],
            [c for c in cells if c == "sequential" or c in ("pipe_s2", "pipe_s4")
             or c.startswith("decoupled")])
  fig, axes = plt.subplots(2, 2, figsize=(13, 8.5), sharex=True, sharey="row")
  colors = dict(zip(DEFAULT_CELLS + tuple(c for c in cells if c not in DEFAULT_CELLS),
                    plt.get_cmap("tab10").colors))
  x = np.arange(steps)
  for row, relative in enumerate((False, True)):
    for ax, panel in zip(axes[row], panels):
      for cell in panel:
        cell_runs = [r for r in runs if r["cell"] == cell]
        if not cell_runs:
          continue
        curves = np.stack([smooth(r["curve"][:steps], window)
                           - (r["curve"][0] if relative else 0.0) for r in cell_runs])
        mean = curves.mean(0)
        std = curves.std(0, ddof=1) if len(curves) > 1 else np.zeros_like(mean)
        color = colors.get(cell)
        ax.plot(x, mean, label=f"{cell} (n={len(curves)})", color=color)
        for curve in curves:  # each seed's own curve, thin
          ax.plot(x, curve, color=color, lw=0.6, alpha=0.45)
        ax.fill_between(x, mean - std, mean + std, alpha=0.12, color=color)
      ax.grid(alpha=0.3)
      if ax.lines:  # a panel of cells this invocation did not run stays empty
        ax.legend(fontsize=8, loc="lower right")
  axes[0][0].set_ylabel(f"rule score of sampled answers\n(moving mean over {window} steps)")
  axes[1][0].set_ylabel("change since step 0 (same seed)")
  axes[0][0].set_title("staleness")
  axes[0][1].set_title("decoupled objective")
  for ax in axes[1]:
    ax.set_xlabel("PPO step")
  fig.suptitle(title, fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)
  return path


RUN_FIELDS = ("seed", "cell", "mode", "max_staleness", "loss", "steps", "acc_start",
              "acc_final", "gain", "kl_end", "reward_start", "reward_final", "greedy_before",
              "greedy_after", "greedy_prompts", "greedy_delta", "greedy_low", "greedy_high",
              "greedy_prompts_worse", "greedy_prompts_better", "sampled_k", "sampled_before",
              "sampled_after", "sampled_low", "sampled_high", "staleness_mean",
              "rm_eval_accuracy",
              "samples_per_s", "wall_s", "load_average")


def write_report(out: str, runs: list[dict], cells: list[str], settings: dict,
                 greedy_goal: float | None = None) -> str:
  """runs.csv, runs.json, table.md and curves.png from the finished runs; the table text."""
  with open(os.path.join(out, "runs.csv"), "w", newline="", encoding="utf-8") as f:
    writer = csv.DictWriter(f, fieldnames=RUN_FIELDS, extrasaction="ignore")
    writer.writeheader()
    for run in runs:
      row = dict(run)
      change = greedy_change(run)
      if change is not None:
        row.update(greedy_delta=change.delta, greedy_low=change.low, greedy_high=change.high,
                   greedy_prompts_worse=change.worse, greedy_prompts_better=change.better)
      change = sampled_change(run)
      if change is not None:
        row.update(sampled_low=change.low, sampled_high=change.high)
      writer.writerow(row)
  with open(os.path.join(out, "runs.json"), "w", encoding="utf-8") as f:
    json.dump({"settings": settings, "runs": runs}, f, indent=1)
  table = aggregate(runs, cells)
  seeds = sorted({r["seed"] for r in runs})
  scorer = (f"the environment `{settings['eval_fn']}`'s reward (its episodes')"
            if settings.get("reward", {}).get("fn") == "environment"
            else f"the rule `{settings['eval_fn']}`")
  text = "\n".join([
      f"Command: `{settings['command']}`", "",
      f"Config {os.path.relpath(settings['config'], _ROOT)} with "
      f"{settings['overrides'] or 'no overrides'}; "
      f"{runs[0]['steps']} PPO steps; seeds {seeds}; every cell of a seed starts from that "
      f"seed's warm start. Accuracy: {scorer} over the sampled "
      f"answers of each PPO batch (start: step 0; final: mean of the last "
      f"{int(FINAL_FRACTION * 100)}% of steps); greedy: the same score over "
      f"{runs[0]['greedy_prompts']} held-out prompts answered greedily before and after "
      "PPO (greedy worse: runs whose score fell; beyond 95%: of them, those whose fall "
      "lies beyond the 95% bootstrap interval over prompts); held-out sampled: the score "
      f"over {runs[0].get('sampled_k', '-')} answers per held-out prompt sampled as PPO "
      "samples, before and after PPO (its gain: the paired change); mean ± sample std "
      "over seeds.", "",
      format_table(table), "",
      "Each run (its held-out intervals are paired bootstrap intervals over the prompts, "
      "`phases.heldout.paired_change`; tokens/s: each stage's own spans after the first "
      "two, compiling, steps):", "",
      format_runs(runs), "",
      "*samples/s were measured on a shared machine (load average "
      f"{min(r['load_average'] for r in runs):.1f}-{max(r['load_average'] for r in runs):.1f}"
      " at the runs' ends): not a speed result.", "",
      "Hosts (a seed's warm start differs between hosts): "
      + "; ".join(sorted({r.get("host", "not recorded") for r in runs})) + ".", "",
      "Goals:", *goal_checks(table, runs),
      *(greedy_goal_lines(runs, greedy_goal) if greedy_goal is not None else []), "",
      "Held-out answers:", "", format_answers(runs), ""])
  with open(os.path.join(out, "table.md"), "w", encoding="utf-8") as f:
    f.write(text)
  plot_curves(runs, cells, os.path.join(out, "curves.png"),
              f"{os.path.relpath(settings['config'], _ROOT)} {settings['overrides'] or ''}: "
              f"mean ± std over seeds {seeds}")
  return text


# ---- the driver ----------------------------------------------------------------------------
def parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--config", default=os.path.join(_ROOT, "configs", "quickstart.py"),
                      help="config module path, optionally :variant (e.g. ...py:tiny)")
  parser.add_argument("--seeds", default="0,1,2")
  parser.add_argument("--cells", default=",".join(DEFAULT_CELLS))
  parser.add_argument("--steps", type=int, default=0, help="PPO steps (0 = the config's)")
  parser.add_argument("--set", action="append", default=[], metavar="PATH=VALUE",
                      help="a config override, e.g. ppo.kl_coef=0.1 (repeatable)")
  parser.add_argument("--tag", default="", help="suffix of the default --out directory")
  parser.add_argument("--out", default="", help="output directory")
  # The page's plot goes beside it, as docs/results/<NAME>.png.
  results.add_page_flag(parser, "learning_curves")
  parser.add_argument("--greedy-goal", type=float, default=None,
                      help="also check that every seed's held-out greedy score rose by at "
                           "least this much with a 95%% interval above zero")
  parser.add_argument("--report-only", action="store_true",
                      help="only rebuild the table and plot from the finished runs")
  parser.add_argument("--warm-starts-only", action="store_true",
                      help="only train the seeds' warm starts (another invocation running at "
                           "the same time then finds them ready)")
  args = parser.parse_args(argv)
  try:
    args.seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
  except ValueError:
    parser.error(f"--seeds {args.seeds!r}: give integers like 0,1,2")
  args.cells = [c.strip() for c in args.cells.split(",") if c.strip()]
  for cell in args.cells:
    try:
      cell_overrides(cell)
    except ValueError as e:
      parser.error(str(e))
  args.overrides = {}
  for item in args.set:
    path, sep, value = item.partition("=")
    if not sep or not path:
      parser.error(f"--set {item!r}: write PATH=VALUE, e.g. ppo.kl_coef=0.1")
    args.overrides[path.strip()] = parse_value(value.strip())
  if not args.out:
    name = os.path.splitext(os.path.basename(args.config.partition(":")[0]))[0]
    variant = args.config.partition(":")[2]
    name += f"-{variant}" if variant else ""
    name += f"-{args.tag}" if args.tag else ""
    args.out = os.path.join(_ROOT, "experiments", "out", "learning_curves", name)
  return args


def check_settings(out: str, settings: dict) -> None:
  """Writes settings.json, or refuses to mix runs made with other settings into `out`."""
  path = os.path.join(out, "settings.json")
  keys = ("config", "overrides", "steps")
  if os.path.exists(path):
    with open(path, encoding="utf-8") as f:
      saved = json.load(f)
    # The config's own ppo / reward sections too, so that a changed default does not mix
    # into a table made before it (directories from before this check have none).
    keys += tuple(k for k in ("ppo", "reward") if k in saved)
    if any(saved.get(k) != settings[k] for k in keys):
      raise SystemExit(
          f"{out} holds runs made with {({k: saved.get(k) for k in keys})}, not "
          f"{({k: settings[k] for k in keys})}; pass another --tag or --out.")
  with open(path, "w", encoding="utf-8") as f:
    json.dump(settings, f, indent=1)


def load_runs(out: str, seeds, cells) -> list[dict]:
  runs = []
  for seed in seeds:
    for cell in cells:
      path = os.path.join(out, f"seed{seed}", cell, "run.json")
      if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
          runs.append(json.load(f))
  return runs


def main(argv=None) -> int:
  args = parse_args(argv)
  # The command that makes the table: the same without the flags that only select what
  # this invocation does of it.
  words = sys.argv[1:] if argv is None else list(argv)
  command = shlex.join(["python", "-m", "experiments.learning_curves",
                        *(w for w in words if w not in ("--report-only", "--warm-starts-only"))])
  os.makedirs(args.out, exist_ok=True)
  probe = run_config(args, args.seeds[0], None, None)
  settings = {"command": command, "config": args.config, "overrides": args.overrides,
              "steps": probe.ppo.steps, "eval_fn": scored_by(probe),
              "ppo": probe.ppo.to_dict(), "reward": probe.reward.to_dict()}
  check_settings(args.out, settings)
  store = os.path.join(os.path.dirname(args.out), "warm_starts")
  if not args.report_only:
    from absl import logging as absl_logging
    import jax

    from pipe_rlhf_jax.train import prepare_warm_start, train
    absl_logging.set_verbosity(absl_logging.WARNING)
    print(f"[learning_curves] {command}\n  -> {args.out}; jax {jax.__version__}, "
          f"{jax.device_count()} devices, load average {os.getloadavg()[0]:.1f}", flush=True)
    for seed in args.seeds:
      todo = [] if args.warm_starts_only else [
          c for c in args.cells
          if not os.path.exists(os.path.join(args.out, f"seed{seed}", c, "run.json"))]
      if not todo and not args.warm_starts_only:
        continue
      t0 = time.perf_counter()
      warm = shared_warm_start(run_config(args, seed, None, None), store, prepare_warm_start)
      rm_eval = warm["rm_eval"] or {}  # None when the reward is a rule
      print(f"[learning_curves] seed {seed}: warm start ready in "
            f"{time.perf_counter() - t0:.0f}s (reward model held-out accuracy "
            f"{rm_eval.get('eval_accuracy')})", flush=True)
      for cell in todo:
        workdir = os.path.join(args.out, f"seed{seed}", cell)
        with locked(workdir + ".lock", wait=False) as mine:
          # Another invocation is running this cell, or has just finished it.
          if not mine or os.path.exists(os.path.join(workdir, "run.json")):
            continue
          if os.path.exists(workdir):  # an interrupted run: start it again
            shutil.rmtree(workdir)
          config = run_config(args, seed, cell, warm["workdir"])
          jax.clear_caches()
          t0 = time.perf_counter()
          result = train(config, workdir, progress=False)
          summary = summarise_run(result, config, seed, cell, time.perf_counter() - t0)
          with open(os.path.join(workdir, "run.json"), "w", encoding="utf-8") as f:
            json.dump(summary, f, indent=1)
        print(f"[learning_curves] seed {seed} {cell}: accuracy {summary['acc_start']:.3f} -> "
              f"{summary['acc_final']:.3f}, KL {summary['kl_end']:.2f}, greedy "
              f"{summary['greedy_before']:.3f} -> {summary['greedy_after']:.3f}, "
              f"{summary['wall_s']:.0f}s", flush=True)
  if args.warm_starts_only:
    return 0
  runs = load_runs(args.out, args.seeds, args.cells)
  if not runs:
    print("no finished runs yet")
    return 1
  text = write_report(args.out, runs, args.cells, settings, args.greedy_goal)
  print(text)
  print(f"wrote {args.out}/table.md, runs.csv, runs.json, curves.png")
  if args.page:
    figure = os.path.join(results.RESULTS_DIR, f"{args.page}.png")
    os.makedirs(results.RESULTS_DIR, exist_ok=True)
    shutil.copyfile(os.path.join(args.out, "curves.png"), figure)
    # Accuracies do not depend on the machine's speed: no limits are measured for it.
    path = results.write_page(
        args.page, f"Learning curves: {os.path.relpath(settings['config'], _ROOT)}",
        f"![accuracy over PPO steps, mean and ±1 std over seeds]({args.page}.png)\n\n"
        + text, None, command=settings["command"])
    print(f"wrote {path}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
