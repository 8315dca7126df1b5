"""Benchmark of the rollout engine: continuous batching against the static batch.

Owns one measurement: the same queue of completions decoded by the static sampler
(consecutive batches of S rows, each decoded until its longest row ends) and by the
continuous-batching engine (`generation/engine.py`, S slots refilled as rows end), at
the same slot count and the same KV-cache memory (S x (P + T) columns each), in
alternating rounds of one process. Three length distributions:

  long_tail  lognormal lengths with a p99 about 8x the median, forced with per-row
             length budgets (`limits`) on the SmolLM2-135M shape with random weights
  uniform    every completion the same length (the engine must not be slower)
  real       SmolLM2-135M-Instruct (the packaged GGUF model) free-running at temperature
             1 on the 32 shipped math chat prompts (configs/data/math_prompts*.jsonl),
             n samples each, up to T tokens, ending at its own EOS; the lengths it
             produced are recorded in the page and in lengths_real.json
  step       whole PPO steps (GRPO, groups of 4) of `PPOSystem` on the random-weight
             shape, prompts carrying long-tailed length budgets (`max_new_tokens`):
             `sequential` and `pipe` with static batches, and `pipe` with partial
             rollouts (one engine of B slots kept across updates); inference and
             training packed in every variant, so the rollout engine is what differs
  pipelined  the long tail's queue on the delayed inter-batch pipeline over 2 virtual CPU
             devices (`generation/pipelined.py`, M micro-batches of S / M rows):
             consecutive static batches of S rows against one call whose micro-batches
             are refilled load by load (`num_slots=S`); ticks run against the pure
             schedules (`schedule.refill_schedule`), slot occupancy over the row-passes
             stage 0 ran
  packing    the inference stage (reference, critic and reward model) and the training
             stage (one PPO update of actor and critic over minibatches) on a batch of
             the real part's lengths (its lengths_real.json; prompts the shipped ones),
             padded [B, P + T] against packed into rows of P + T tokens
             (`stages.infer.pack_tokens`, `stages.train.pack_tokens`), on the
             random-weight shape; same outputs

Per engine and distribution: decode steps, slot occupancy (tokens decoded over slot-steps
run), seconds per queue, useful tokens/s (every completion token, over the seconds), the
KV cache (and what a paged cache would hold at the schedule's busiest step:
`SlotTimeline.peak_paged_columns`) and the compiled program's temporary memory, and the
cost model's prediction:
decode steps from the pure schedules (`slot_schedule.simulate`, `static_timeline`)
times one decode step's seconds, plus the prefills, the step and prefill seconds
measured once on a separate probe (uniform lengths, not the queues measured).
Both engines draw token t of completion k with the same key, so they produce the same
completions: the page counts how many are identical.

  python -m experiments.bench_rollout --prefill-chunk 16 --real-samples 4 --page  # engine page
  python -m experiments.bench_rollout --parts packing --page packing --rounds 1  # after "real"
  python -m experiments.bench_rollout --parts step --step-steps 32 --page rollout_step  # PPO steps
  python -m experiments.bench_rollout --parts pipelined --page rollout_pipelined --layers 4 \
      --queue 64                             # refilled pipeline micro-batches
  python -m experiments.bench_rollout --parts packing --packing-stages train --layers 1 \
      --real-max-new-tokens 64 --rounds 1   # a quick look at packed training
  python -m experiments.bench_rollout --parts long_tail,uniform --layers 4 \
      --queue 32                             # a quick look (no --page: no page)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from flax import nnx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from experiments import results  # noqa: E402
from pipe_rlhf_jax.generation import engine, sampler, slot_schedule  # noqa: E402
from pipe_rlhf_jax.models import shapes  # noqa: E402
from pipe_rlhf_jax.models.transformer import init_model  # noqa: E402

PARTS = ("long_tail", "uniform", "real", "pipelined", "packing", "step")
DEFAULT_PARTS = ("long_tail", "uniform", "real")  # the rollout_engine page
DATA = os.path.join(_ROOT, "configs", "data")
# Columns per page of the paged cache the page sizes up (`SlotTimeline.peak_paged_columns`).
PAGE = 16


def parse_args(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--parts", default=",".join(DEFAULT_PARTS),
                      help=f"comma-separated distributions among {PARTS}")
  parser.add_argument("--slots", type=int, default=16, help="S, for both engines")
  parser.add_argument("--min-admit", type=int, default=0,
                      help="the engine's narrowest admission while slots decode, in prompts "
                           "(0: the engine's default)")
  parser.add_argument("--prefill-chunk", type=int, default=0,
                      help="also run the engine with its admissions prefilled in passes of "
                           "this many prompt columns, decode steps between them (0: not)")
  parser.add_argument("--queue", type=int, default=256,
                      help="completions in the synthetic queues, a multiple of --slots (the "
                           "engine's speed-up is bounded by the drain at the queue's end: "
                           "at 16 slots 2.3x for 128, 2.8x for 256 on the long tail)")
  parser.add_argument("--layers", type=int, default=8,
                      help="layers of the random-weight SmolLM2-135M shape (synthetic parts)")
  parser.add_argument("--median", type=int, default=48,
                      help="median length of the synthetic long tail (uniform: every length)")
  parser.add_argument("--max-new-tokens", type=int, default=512,
                      help="T of the synthetic parts")
  parser.add_argument("--prompt-len", type=int, default=64, help="P of the synthetic parts")
  parser.add_argument("--real-samples", type=int, default=2,
                      help="samples per shipped prompt in the real part")
  parser.add_argument("--real-max-new-tokens", type=int, default=512)
  parser.add_argument("--rounds", type=int, default=2,
                      help="alternating timed rounds (median reported); the real part runs 1")
  parser.add_argument("--packing-stages", default="infer,train",
                      help="the packing part's stages: infer, train or both")
  parser.add_argument("--train-minibatch", type=int, default=16,
                      help="the packing part's training minibatch rows (the batch is the "
                           "real part's completions)")
  parser.add_argument("--step-prompts", type=int, default=8,
                      help="the step part's prompts per PPO step (x 4 samples each)")
  parser.add_argument("--step-steps", type=int, default=16,
                      help="the step part's PPO steps per variant (the first 3 untimed)")
  parser.add_argument("--step-max-new-tokens", type=int, default=256,
                      help="T of the step part (its long tail's median is T / 8)")
  parser.add_argument("--pipe-microbatches", type=int, default=8,
                      help="M of the pipelined part (S must be a multiple)")
  parser.add_argument("--seed", type=int, default=0)
  results.add_page_flag(parser, "rollout_engine")
  parser.add_argument("--out", default=os.path.join(_ROOT, "experiments", "out",
                                                    "bench_rollout"))
  args = parser.parse_args(argv)
  if args.queue < 1 or args.queue % args.slots:
    parser.error(f"--queue {args.queue} must be a positive multiple of --slots "
                 f"{args.slots} (the static sampler decodes it in batches of S rows)")
  return args


def long_tail_lengths(count: int, median: int, cap: int, seed: int) -> np.ndarray:
  """Lognormal lengths, p99 / median = 8 (sigma = ln 8 / z_0.99), in [1, cap]."""
  sigma = np.log(8.0) / 2.3263
  rs = np.random.RandomState(seed)
  return np.clip(np.round(median * rs.lognormal(0.0, sigma, count)), 1, cap).astype(np.int32)


def random_prompts(count: int, prompt_len: int, vocab: int, seed: int):
  rs = np.random.RandomState(seed + 1)
  tokens = rs.randint(1, vocab, (count, prompt_len)).astype(np.int32)
  return tokens, np.ones((count, prompt_len), bool)


def compiled_bytes(compiled) -> int:
  """Temporary bytes of a compiled program (0 where the backend does not report it)."""
  try:
    return int(compiled.memory_analysis().temp_size_in_bytes)
  except (AttributeError, NotImplementedError, RuntimeError):
    return 0


class Static:
  """The static sampler over the queue in consecutive batches of S rows."""

  def __init__(self, graphdef, state, params, slots, group_size, queue, limits, rng):
    self.state, self.rng, self.n, self.slots = state, rng, group_size, slots
    tokens, mask = queue
    per = slots // group_size  # prompts per batch
    self.batches = []
    for start in range(0, len(tokens), per):
      rows = slice(start * group_size, (start + per) * group_size)
      self.batches.append((jnp.asarray(np.repeat(tokens[start:start + per], group_size, 0)),
                           jnp.asarray(np.repeat(mask[start:start + per], group_size, 0)),
                           jnp.arange(rows.start, rows.stop, dtype=jnp.int32),
                           jnp.asarray(limits[rows])))
    prefill, decode = sampler.make_generate_fns(graphdef, params, group_size=group_size)
    t, m, ids, lim = self.batches[0]
    self.prefill = prefill.lower(state, t, m, rng, ids, lim).compile()
    first = self.prefill(state, t, m, rng, ids, lim)
    self.decode = decode.lower(state, first, m, rng, ids).compile()
    self.temp_bytes = max(compiled_bytes(self.prefill), compiled_bytes(self.decode))

  def __call__(self):
    outs, steps = [], 0
    start = time.perf_counter()
    for t, m, ids, lim in self.batches:
      first = self.prefill(self.state, t, m, self.rng, ids, lim)
      out = self.decode(self.state, first, m, self.rng, ids).output()
      outs.append(out)
    outs = jax.block_until_ready(outs)
    seconds = time.perf_counter() - start
    steps = sum(int(o.num_steps) - 1 for o in outs)
    tokens = np.concatenate([np.asarray(o.tokens) for o in outs])
    mask = np.concatenate([np.asarray(o.mask) for o in outs])
    return dict(seconds=seconds, decode_steps=steps, prefills=len(outs), tokens=tokens,
                mask=mask)


class Continuous:
  """The engine with S slots over the whole queue."""

  def __init__(self, graphdef, state, params, slots, group_size, queue, limits, rng,
               min_admit=None, prefill_chunk=0):
    self.state, self.rng = state, rng
    tokens, mask = queue
    self.args = (jnp.asarray(tokens), jnp.asarray(mask), rng,
                 jnp.arange(len(limits), dtype=jnp.int32), jnp.asarray(limits))
    spec = engine.EngineSpec(num_slots=slots, group_size=group_size, min_admit=min_admit,
                             prefill_chunk=prefill_chunk)
    self.fn = engine.make_engine_fn(graphdef, params, spec).lower(state, *self.args).compile()
    self.temp_bytes = compiled_bytes(self.fn)

  def __call__(self):
    start = time.perf_counter()
    out, stats = jax.block_until_ready(self.fn(self.state, *self.args))
    seconds = time.perf_counter() - start
    return dict(seconds=seconds, decode_steps=int(stats.decode_steps),
                prefills=int(stats.prefills), tokens=np.asarray(out.tokens),
                mask=np.asarray(out.mask))


def probe_costs(graphdef, state, params, slots, prompt_len, vocab) -> dict[str, float]:
  """Seconds of one decode step of S rows and of one prompt's prefill, measured on the
  static sampler over uniform lengths (a queue of its own, not one of those measured)."""
  steps = min(32, params.max_new_tokens)
  tokens, mask = random_prompts(slots, prompt_len, vocab, seed=99)
  limits = np.full(slots, steps, np.int32)
  run = Static(graphdef, state, params, slots, 1, (tokens, mask), limits, jax.random.key(9))
  run()  # warm
  best = min((run() for _ in range(2)), key=lambda r: r["seconds"])
  t, m, ids, lim = run.batches[0]
  start = time.perf_counter()
  jax.block_until_ready(run.prefill(state, t, m, run.rng, ids, lim))
  prefill = time.perf_counter() - start
  step = (best["seconds"] - prefill) / best["decode_steps"]
  return {"step_s": step, "prefill_prompt_s": prefill / slots}


def predicted_seconds(kind: str, lengths, slots: int, n: int, costs, prompt_len: int,
                      min_admit=None, prefill_chunk=0):
  """The cost model: decode steps from the pure schedule x step seconds + prefills.

  Returns the seconds, the schedule (`slot_schedule.SlotTimeline`) and the largest
  prefill pass in prompt tokens (what a decode step can wait on: the static batch's
  prefill runs before any decoding).
  """
  if kind == "static":
    timeline = slot_schedule.static_timeline(lengths, slots)
    prefill_prompts = len(lengths) // n
    widest = min(len(lengths), slots) // n * prompt_len
  else:
    spec = engine.EngineSpec(num_slots=slots, group_size=n, min_admit=min_admit,
                             prefill_chunk=prefill_chunk)
    timeline = slot_schedule.simulate(lengths, spec, prompt_len)
    # Passes of C columns cover P (the last overlapping): that many prompt columns' work.
    passes, columns = spec.prefill_passes(prompt_len)
    prefill_prompts = sum(timeline.prefill_widths) * passes * columns / prompt_len
    widest = max(timeline.prefill_widths) * columns
  return (timeline.decode_steps * costs["step_s"]
          + prefill_prompts * costs["prefill_prompt_s"], timeline, widest)


def measure(name, graphdef, state, params, slots, n, queue, limits, rounds, costs,
            min_admit=None, prefill_chunk=0):
  """The engines on one queue, alternating rounds; a row per engine (the engine with
  chunked prefill too when `prefill_chunk`)."""
  rng = jax.random.key(7)
  runs = {"static": Static(graphdef, state, params, slots, n, queue, limits, rng),
          "continuous": Continuous(graphdef, state, params, slots, n, queue, limits, rng,
                                   min_admit)}
  chunked = f"continuous, prefill passes of {prefill_chunk}"
  if prefill_chunk:
    runs[chunked] = Continuous(graphdef, state, params, slots, n, queue, limits, rng,
                               min_admit, prefill_chunk)
  got = {k: [] for k in runs}
  for _ in range(rounds):
    for kind, run in runs.items():
      got[kind].append(run())
      print(f"  {name} {kind}: {got[kind][-1]['seconds']:.2f} s", flush=True)
  lengths = got["static"][0]["mask"].sum(1)
  rows = []
  for kind, runs_ in got.items():
    same = int(np.all(got["static"][0]["tokens"] == runs_[0]["tokens"], axis=1).sum())
    seconds = statistics.median(r["seconds"] for r in runs_)
    r = runs_[0]
    useful = int(r["mask"].sum())
    decoded = useful - len(lengths)  # the first tokens come from the prefills
    predicted, timeline, widest = predicted_seconds(
        kind, r["mask"].sum(1), slots, n, costs, queue[0].shape[1], min_admit,
        prefill_chunk if kind == chunked else 0)
    columns = queue[0].shape[1] + params.max_new_tokens
    kv_mib = kv_bytes(graphdef, state, slots, columns) / 2**20
    paged = timeline.peak_paged_columns(queue[0].shape[1], PAGE) / (slots * columns)
    rows.append(dict(
        distribution=name, engine=kind, decode_steps=r["decode_steps"],
        predicted_steps=timeline.decode_steps,
        occupancy=decoded / max(r["decode_steps"] * slots, 1),
        seconds=seconds, tokens_per_s=useful / seconds, predicted_s=predicted,
        kv_mib=kv_mib, paged_mib=kv_mib * paged, temp_mib=runs[kind].temp_bytes / 2**20,
        identical=same, completions=len(lengths), widest_pass=widest))
  return rows, lengths


def ceilings(rows) -> str:
  """The speed-ups the queue allows the engine, from the schedules alone: its decode steps
  against the static batch's, and occupancy alone (an endless queue, no final drain)."""
  by_engine = {r["engine"]: r for r in rows}
  static, cont = by_engine["static"], by_engine["continuous"]
  return (f"decode-step ceiling of this queue {static['predicted_steps']} / "
          f"{cont['predicted_steps']} = {static['predicted_steps'] / cont['predicted_steps']:.2f}x"
          f", of occupancy alone (an endless queue) 1 / {static['occupancy']:.2f} = "
          f"{1 / static['occupancy']:.2f}x")


def kv_bytes(graphdef, state, slots: int, columns: int) -> int:
  c = nnx.merge(graphdef, state).config
  return 2 * c.num_layers * slots * columns * c.num_kv_heads * c.head_dim * \
      jnp.dtype(c.dtype).itemsize


def real_queue(samples: int, load_model: bool = True):
  """The packaged SmolLM2-135M-Instruct (None without `load_model`), its tokenizer and the
  32 shipped math chat prompts, rendered with its chat template and left-padded."""
  from pipe_rlhf_jax.models import load, packaged
  path = packaged.gguf_path("smollm2-135m-instruct")
  model = load.from_pretrained(path) if load_model else None
  tok = load.load_tokenizer(path)
  records = []
  for name in ("math_prompts.jsonl", "math_prompts_eval.jsonl"):
    with open(os.path.join(DATA, name), encoding="utf-8") as f:
      records += [json.loads(line) for line in f if line.strip()]
  ids = [tok.apply_chat_template(r["messages"], add_generation_prompt=True) for r in records]
  width = max(len(x) for x in ids)
  tokens = np.full((len(ids), width), tok.pad_id, np.int32)
  mask = np.zeros((len(ids), width), bool)
  for row, x in enumerate(ids):
    tokens[row, width - len(x):] = x
    mask[row, width - len(x):] = True
  return model, tok, (tokens, mask)


def length_summary(lengths, cap: int) -> str:
  lengths = np.asarray(lengths)
  return (f"{len(lengths)} completions, lengths {lengths.min()}-{lengths.max()} (median "
          f"{np.median(lengths):.0f}, mean {lengths.mean():.0f}, p99 "
          f"{np.percentile(lengths, 99):.0f}, {int((lengths >= cap).sum())} cut at {cap})")


def packing_batch(args, lengths):
  """The packing part's batch: the shipped prompts' masks (each repeated per sample) and
  completions of the real part's lengths, random tokens; returns (rollout, config)."""
  from pipe_rlhf_jax.ppo.types import Rollout
  _, tok, (prompt_tokens, prompt_mask) = real_queue(args.real_samples, load_model=False)
  n = len(lengths) // len(prompt_tokens)
  prompt_mask = np.repeat(prompt_mask, n, 0)  # [B, P]
  steps = args.real_max_new_tokens
  cfg = shapes.config("smollm2-135m", dtype="float32", num_hidden_layers=args.layers)
  rs = np.random.RandomState(args.seed)
  batch = len(lengths)
  completion_mask = np.arange(steps)[None, :] < np.asarray(lengths)[:, None]  # [B, T]
  rollout = Rollout(
      prompt_tokens=jnp.asarray(np.where(prompt_mask, rs.randint(1, cfg.vocab_size,
                                                                  prompt_mask.shape), 0)),
      prompt_mask=jnp.asarray(prompt_mask),
      completion_tokens=jnp.asarray(np.where(completion_mask, rs.randint(
          1, cfg.vocab_size, completion_mask.shape), 0)),
      completion_mask=jnp.asarray(completion_mask),
      behaviour_logprobs=jnp.zeros((batch, steps), jnp.float32),
      policy_version=jnp.zeros((), jnp.int32))
  return rollout, cfg


def measure_packing(args, lengths) -> tuple[list[str], list[str]]:
  """The inference and / or training stage padded and packed on one batch of the real
  lengths: a table and a note per stage."""
  from pipe_rlhf_jax.parallel import logical
  from pipe_rlhf_jax.parallel.mesh import make_mesh
  from pipe_rlhf_jax.stages.common import StageLayout
  from pipe_rlhf_jax.stages.infer import InferSettings, InferStage
  stages_measured = [s for s in args.packing_stages.split(",") if s]
  if not stages_measured or set(stages_measured) - {"infer", "train"}:
    raise SystemExit(f"--packing-stages: choose among infer, train, got "
                     f"{args.packing_stages!r}")
  rollout, cfg = packing_batch(args, lengths)
  batch, width = rollout.prompt_mask.shape
  steps = rollout.completion_mask.shape[1]
  models = {head: nnx.split(init_model(cfg.replace(head=head), seed=i))
            for i, head in enumerate(("lm", "value", "score"))}
  layout = StageLayout("infer", make_mesh({"data": 1}, jax.devices()[:1]),
                       logical.DEFAULT_RULES)
  settings = InferSettings(kl_estimator="k1", advantage_estimator="gae", gamma=1.0, lam=0.95,
                     whiten_advantages=True, temperature=1.0)
  budget = width + steps
  stages = {name: InferStage(layout, models["lm"][0], models["value"][0],
                             models["score"][0], settings, pack_tokens=pack)
            for name, pack in (("padded", 0), ("packed", budget))}
  params = (models["lm"][1], models["value"][1], models["score"][1])
  real = int(np.sum(rollout.prompt_mask) + np.sum(rollout.completion_mask))
  shape = (f"{batch} rows of the real part's lengths, P={width}, T={steps}, SmolLM2-135M "
           f"shape with {args.layers} layers, random weights; packed into rows of {budget} "
           "tokens")
  tables, notes, seconds = [], [], []  # per stage: {"padded": s, "packed": s}
  if "infer" in stages_measured:
    got, out = {k: [] for k in stages}, {}
    for round_ in range(1 + args.rounds):  # round 0 compiles
      for name, stage in stages.items():
        start = time.perf_counter()
        exp, _ = stage(*params, rollout, 0.1)
        jax.block_until_ready(exp)
        if round_:
          got[name].append(time.perf_counter() - start)
          print(f"  packing {name}: {got[name][-1]:.2f} s", flush=True)
        out[name] = exp
    diff = max(float(np.max(np.abs(np.asarray(getattr(out["padded"], f))
                                   - np.asarray(getattr(out["packed"], f)))))
               for f in ("ref_logprobs", "values"))
    tables.append(speed_table("inference stage", "s per batch", got, real, batch * budget))
    seconds.append({k: statistics.median(v) for k, v in got.items()})
    notes.append(f"packing: the inference stage (reference log-probs, critic values, "
                 f"reward-model scores, then advantages) on {shape}; largest difference "
                 f"of the log-probs and values {diff:.1e}; median of {args.rounds} rounds "
                 "after a compiling one")
  if "train" in stages_measured:
    table, note, got = measure_train_packing(args, layout, models, stages["padded"], params,
                                             rollout, budget)
    tables.append(table)
    notes.append(f"{note}; {shape}")
    seconds.append({k: statistics.median(v) for k, v in got.items()})
  if len(seconds) == 2:
    padded, packed = (sum(s[k] for s in seconds) for k in ("padded", "packed"))
    notes.append(f"inference + training on the batch: padded {padded:.2f} s, packed "
                 f"{packed:.2f} s: {padded / packed:.2f}x")
  return tables, notes


def speed_table(stage: str, unit: str, got: dict, real: int, slots: int) -> str:
  """Median seconds of the padded and packed runs of a stage, and the speed-up."""
  base = statistics.median(got["padded"])
  rows = [f"| {name} | {real} of {slots} | {statistics.median(t):.2f} | "
          f"{base / statistics.median(t):.2f}x |" for name, t in got.items()]
  return "\n".join([f"| {stage} | real tokens of the layout | {unit} | speed-up |",
                    "|---|---|---|---|", *rows])


def measure_train_packing(args, layout, models, infer, params, rollout, budget):
  """One PPO update (actor and critic, one epoch of minibatches) padded and packed on
  the same experience: a table and a note."""
  import optax

  from pipe_rlhf_jax.models.transformer import with_execution
  from pipe_rlhf_jax.stages.train import PACK_FILL_KEY, TrainSettings, TrainStage
  exp, _ = infer(*params, rollout, 0.1)
  batch = rollout.prompt_mask.shape[0]
  minibatch = min(args.train_minibatch, batch)
  if batch % minibatch:
    raise SystemExit(f"--train-minibatch={minibatch} must divide the batch ({batch} rows)")
  settings = TrainSettings(epochs=1, minibatch_size=minibatch, clip_eps=0.2, value_clip_eps=0.2,
                   entropy_coef=0.0, loss="ppo_clip", behaviour_weight_cap=None,
                   temperature=1.0)
  # The LM head over 128 positions at a time in both layouts, as a real run would: the
  # [minibatch, T, vocab] f32 logits of a whole minibatch do not fit beside its backward.
  actor_gd, actor = with_execution(*models["lm"], logits_chunk_size=128), models["lm"][1]
  critic_gd, critic = models["value"]
  trainers = {name: TrainStage(layout, actor_gd, critic_gd, settings, optax.sgd(1e-4),
                               optax.sgd(1e-4), pack_tokens=pack)
              for name, pack in (("padded", 0), ("packed", budget))}
  states = {name: t.init_state(actor, critic) for name, t in trainers.items()}
  got, metrics = {k: [] for k in trainers}, {}
  for round_ in range(1 + args.rounds):  # round 0 compiles (and starts both equal)
    for name, trainer in trainers.items():
      start = time.perf_counter()
      # Every round draws the same minibatches (one key): the packed update's shape (its
      # row and LM-head counts) follows the draw, so another draw could compile a new
      # program inside a timed round. A run compiles a handful of these shapes (a few
      # sizes an octave) and then reuses them; the rounds time that steady state.
      states[name], m = trainer.update(states[name], exp, jax.random.key(0))
      jax.block_until_ready(states[name])
      if round_:
        got[name].append(time.perf_counter() - start)
        print(f"  packing train {name}: {got[name][-1]:.2f} s", flush=True)
      else:
        metrics[name] = {k: float(v) for k, v in m.items()}
  fill = metrics["packed"].pop(PACK_FILL_KEY)
  diff = max(abs(metrics["packed"][k] - v) / max(abs(v), 1e-6)
             for k, v in metrics["padded"].items())
  real = int(np.sum(rollout.prompt_mask) + np.sum(rollout.completion_mask))
  table = speed_table("training stage", "s per update", got, real, batch * budget)
  note = (f"training: one PPO update (actor and critic, {batch // minibatch} minibatches of "
          f"{minibatch} rows, one epoch, SGD) on the padded inference stage's experience; "
          f"packed slots filled {fill:.2f}; largest relative difference of the first "
          f"update's metrics {diff:.1e}; median of {args.rounds} rounds after a compiling "
          "one, every round the same minibatches (so the same packed shape)")
  return table, note, got


STEP_WARMUP = 3  # compilation, and partial rollouts' engine filling up


def step_variants(prompts: int, group: int):
  """The step part's plans: static generation in two modes, and partial rollouts."""
  from pipe_rlhf_jax.config import MeshSpec, Plan, StagePlan
  packed = lambda length, **kw: StagePlan(pack_tokens=length, **kw)  # noqa: E731

  def plan(length, mode, **kw):
    gen = StagePlan(num_slots=kw.pop("num_slots", 0))
    if mode == "sequential":
      return Plan(mode=mode, mesh=MeshSpec(data=1), generate=gen, infer=packed(length),
                  train=packed(length, mesh=MeshSpec(data=1)))
    return Plan(mode=mode, placement=(1, 1, 1), max_staleness=1, generate=gen,
                infer=packed(length), train=packed(length), **kw)

  return {"sequential, static": lambda n: plan(n, "sequential"),
          "pipe, static": lambda n: plan(n, "pipe"),
          "pipe, partial rollouts": lambda n: plan(n, "pipe", partial_rollouts=True,
                                                   num_slots=prompts * group)}


PIPE_STAGES = 2


def measure_pipelined(args) -> tuple[list[str], list[str]]:
  """The long-tail queue on the pipelined decoder: static batches against refills."""
  from pipe_rlhf_jax.generation import pipelined
  from pipe_rlhf_jax.generation import schedule as sched
  from pipe_rlhf_jax.parallel.mesh import MeshShape, make_mesh
  cfg = shapes.config("smollm2-135m", dtype="float32", num_hidden_layers=args.layers)
  graphdef, state = nnx.split(init_model(cfg, seed=args.seed))
  params = sampler.SamplingSettings(max_new_tokens=args.max_new_tokens, temperature=1.0,
                                  eos_id=None)
  mesh = make_mesh(MeshShape(pipeline=PIPE_STAGES), jax.devices()[:PIPE_STAGES])
  slots, num_mb = args.slots, args.pipe_microbatches
  rows = slots // num_mb
  tokens, mask = random_prompts(args.queue, args.prompt_len, cfg.vocab_size, args.seed)
  limits = long_tail_lengths(args.queue, args.median, args.max_new_tokens, args.seed)
  rng = jax.random.key(7)

  def compiled(lo, hi, num_slots):
    prepared = pipelined.prepare_pipelined(
        (graphdef, state), tokens[lo:hi], mask[lo:hi], params, mesh=mesh,
        num_microbatches=num_mb, rng=rng, sample_ids=np.arange(lo, hi, dtype=np.int32),
        limits=limits[lo:hi], num_slots=num_slots)
    fn = prepared.fn.lower(*prepared.args).compile()
    return fn, prepared.args

  static_calls = [compiled(lo, lo + slots, 0) for lo in range(0, args.queue, slots)]
  refill_call = compiled(0, args.queue, slots)
  loads = limits.reshape(-1, rows).max(axis=1)
  predicted = {
      "static": sum(len(sched.refill_schedule(PIPE_STAGES, num_mb, loads[i:i + num_mb]))
                    for i in range(0, len(loads), num_mb)),
      "refilled": len(sched.refill_schedule(PIPE_STAGES, num_mb, loads))}

  def run(calls):
    start = time.perf_counter()
    outs = jax.block_until_ready([fn(*a) for fn, a in calls])
    seconds = time.perf_counter() - start
    ticks = passes = busy = 0
    for _, executed in outs:
      executed = np.asarray(executed)
      ran = np.flatnonzero((executed[..., 0] >= 0).any(axis=1))
      ticks += int(ran.max()) + 1
      passes += int((executed[:, 0, 0] >= 0).sum())
      busy += int((executed[..., 0] >= 0).sum())
    out_tokens = np.concatenate([np.asarray(o.tokens) for o, _ in outs])
    out_mask = np.concatenate([np.asarray(o.mask) for o, _ in outs])
    return dict(seconds=seconds, ticks=ticks, passes=passes, busy=busy, tokens=out_tokens,
                mask=out_mask)

  variants = {"static": static_calls, "refilled": [refill_call]}
  got = {k: [] for k in variants}
  for _ in range(args.rounds):
    for kind, calls in variants.items():
      got[kind].append(run(calls))
      print(f"  pipelined {kind}: {got[kind][-1]['seconds']:.2f} s", flush=True)
  same = int(np.all(got["static"][0]["tokens"] == got["refilled"][0]["tokens"], axis=1).sum())
  base = statistics.median(r["seconds"] for r in got["static"])
  per_tick = base / got["static"][0]["ticks"]
  lines = ["| engine | ticks (schedule's) | busy stage-ticks | slot occupancy | s per queue "
           "(predicted, error) | useful tokens/s | speed-up | identical completions |",
           "|---|---|---|---|---|---|---|---|"]
  for kind, runs_ in got.items():
    seconds = statistics.median(r["seconds"] for r in runs_)
    r = runs_[0]
    useful = int(r["mask"].sum())
    guess = predicted[kind] * per_tick
    lines.append(
        f"| {kind} | {r['ticks']} ({predicted[kind]}) | "
        f"{r['busy'] / (r['ticks'] * PIPE_STAGES):.2f} | {useful / (r['passes'] * rows):.2f} "
        f"| {seconds:.2f} ({guess:.2f}, {100 * (guess - seconds) / seconds:+.0f}%) | "
        f"{useful / seconds:.1f} | {base / seconds:.2f}x | {same}/{args.queue} |")
  notes = [f"pipelined: SmolLM2-135M shape with {args.layers} layers, random weights, "
           f"{PIPE_STAGES} stages x M={num_mb} micro-batches of {rows} rows (S={slots}), "
           f"P={args.prompt_len}, T={args.max_new_tokens}, {args.rounds} alternating rounds "
           f"(median seconds); "
           f"{length_summary(got['static'][0]['mask'].sum(1), args.max_new_tokens)}"]
  return ["\n".join(lines)], notes


def measure_steps(args) -> tuple[list[str], list[str]]:
  """Whole PPO steps of each `step_variants` plan on one long-tailed prompt stream."""
  from pipe_rlhf_jax.config import PPOSettings
  from pipe_rlhf_jax.system import Models, PPOSystem, run
  group, k, steps_t = 4, args.step_prompts, args.step_max_new_tokens
  prompt_len, median = 32, max(steps_t // 8, 1)
  cfg = shapes.config("smollm2-135m", dtype="float32", num_hidden_layers=args.layers)
  rows = []
  for name, make_plan in step_variants(k, group).items():
    rs = np.random.RandomState(args.seed + 2)  # every variant: the same prompt stream

    def prompts():
      index = 0
      while True:
        yield {"prompt_tokens": rs.randint(1, cfg.vocab_size, (k, prompt_len)
                                           ).astype(np.int32),
               "prompt_mask": np.ones((k, prompt_len), bool),
               "index": np.arange(index, index + k),
               "max_new_tokens": long_tail_lengths(k, median, steps_t, args.seed + index)}
        index += k

    plan = make_plan(prompt_len + steps_t)
    devices = jax.devices()[:1 if plan.mode == "sequential" else 3]
    system = PPOSystem(
        Models.from_policy(init_model(cfg, seed=args.seed), critic_from=None,
                           reference=False),
        ppo=PPOSettings(steps=args.step_steps, batch_size=k * group,
                      minibatch_size=k * group, group_size=group, epochs=1,
                      advantage_estimator="grpo", whiten_advantages=False,
                      loss="decoupled_ppo_clip", actor_lr=1e-6, kl_coef=0.0),
        sampling=sampler.SamplingSettings(max_new_tokens=steps_t, temperature=1.0,
                                        eos_id=None, pad_id=0),
        plan=plan, reward_fn=lambda p, c: [float(len(x)) for x in c],
        decode=lambda ids: " ".join(str(int(i)) for i in ids), devices=devices)
    ends = []  # when each update finished: in pipe mode steps overlap, so the time per
    # step is the interval between updates, not one step's own span
    t0 = time.perf_counter()
    metrics = run(system, prompts(), args.step_steps,
                  on_step=lambda step, m: ends.append(time.perf_counter())).metrics
    wall = time.perf_counter() - t0
    timed = metrics[STEP_WARMUP:]
    mean = lambda key: float(np.mean([m.get(key, float("nan")) for m in timed]))  # noqa
    tokens = mean("response_length/mean") * k * group
    interval = (ends[-1] - ends[STEP_WARMUP - 1]) / len(timed)
    rows.append({"variant": name, "s_per_step": interval, "step_span_s": mean("time/step_s"),
                 "generate_s": mean("time/generate_s"), "infer_s": mean("time/infer_s"),
                 "train_s": mean("time/train_s"), "tokens": tokens,
                 "occupancy": mean("generate/slot_occupancy"),
                 "carried": mean("rollout/carried"),
                 "oldest": mean("staleness/oldest_token"), "wall_s": wall})
    print(rows[-1], flush=True)
  with open(os.path.join(args.out, "steps.json"), "w") as f:
    json.dump(rows, f, indent=1)
  base = {r["variant"].split(",")[0]: r for r in rows if r["variant"].endswith("static")}
  lines = ["| mode, generation | s per step | generate s | infer s | train s | completion "
           "tokens per step | trained tokens/s | vs static, same mode | slot occupancy | "
           "rows carried | oldest-token staleness |", "|---|---|---|---|---|---|---|---|---|"
           "---|---|"]
  for r in rows:
    ref = base[r["variant"].split(",")[0]]
    speed = r["tokens"] / r["s_per_step"]
    lines.append(
        f"| {r['variant']} | {r['s_per_step']:.2f} | {r['generate_s']:.2f} | "
        f"{r['infer_s']:.2f} | {r['train_s']:.2f} | {r['tokens']:.0f} | {speed:.1f} | "
        f"{speed / (ref['tokens'] / ref['s_per_step']):.2f}x | "
        + " | ".join("-" if np.isnan(r[key]) else f"{r[key]:.2f}"
                     for key in ("occupancy", "carried", "oldest")) + " |")
  notes = [f"step: SmolLM2-135M shape with {args.layers} layers, random weights, GRPO, "
           f"{k} prompts x {group} samples per step, P={prompt_len}, T={steps_t}, length "
           f"budgets lognormal per prompt (median {median}, p99 about 8x), inference and "
           f"training packed (pack_tokens={prompt_len + steps_t}), staleness 1, pipe on 3 "
           f"virtual CPU devices (one per stage); s per step: the interval between "
           f"updates {STEP_WARMUP - 1} and {args.step_steps - 1} over their count, the "
           f"other columns means over those steps, one run per variant. A batch of partial "
           f"rollouts is the first completions to finish, so its tokens per step run below "
           f"the distribution's mean at first and the long ones arrive later."]
  return ["\n".join(lines)], notes


def main(argv=None):
  args = parse_args(argv)
  results.git_commit()  # the commit measured, read before anything runs
  parts = [p for p in args.parts.split(",") if p]
  if "step" in parts or "pipelined" in parts:
    # Pipe mode and the pipelined decoder: a virtual CPU device per stage, set before jax
    # starts.
    from pipe_rlhf_jax.host_devices import use_virtual_cpu_devices
    use_virtual_cpu_devices(3 if "step" in parts else PIPE_STAGES)
  unknown = sorted(set(parts) - set(PARTS))
  if unknown:
    raise SystemExit(f"--parts: unknown {unknown}; choose among {PARTS}")
  os.makedirs(args.out, exist_ok=True)
  rows, notes = [], []
  synthetic = [p for p in parts if p in ("long_tail", "uniform")]
  if synthetic:
    cfg = shapes.config("smollm2-135m", dtype="float32", num_hidden_layers=args.layers)
    graphdef, state = nnx.split(init_model(cfg, seed=args.seed))
    params = sampler.SamplingSettings(max_new_tokens=args.max_new_tokens, temperature=1.0,
                                    eos_id=None)
    costs = probe_costs(graphdef, state, params, args.slots, args.prompt_len, cfg.vocab_size)
    notes.append(f"synthetic parts: SmolLM2-135M shape with {args.layers} layers, random "
                 f"weights, P={args.prompt_len}, T={args.max_new_tokens}, S={args.slots}, "
                 f"min_admit={args.min_admit or 'default'}; "
                 f"probe: {1e3 * costs['step_s']:.1f} ms per decode step, "
                 f"{1e3 * costs['prefill_prompt_s']:.1f} ms per prompt prefilled")
    queue = random_prompts(args.queue, args.prompt_len, cfg.vocab_size, args.seed)
    for part in synthetic:
      limits = (long_tail_lengths(args.queue, args.median, args.max_new_tokens, args.seed)
                if part == "long_tail" else np.full(args.queue, args.median, np.int32))
      got, lengths = measure(part, graphdef, state, params, args.slots, 1, queue, limits,
                             args.rounds, costs, args.min_admit or None, args.prefill_chunk)
      rows += got
      notes.append(f"{part}: {length_summary(lengths, args.max_new_tokens)}; "
                   f"{ceilings(got)}")
  if "real" in parts:
    model, tok, queue = real_queue(args.real_samples)
    graphdef, state = nnx.split(model)
    params = sampler.SamplingSettings(max_new_tokens=args.real_max_new_tokens,
                                    temperature=1.0, eos_id=tok.eos_id, pad_id=tok.pad_id)
    costs = probe_costs(graphdef, state, params, args.slots, queue[0].shape[1],
                        model.config.vocab_size)
    limits = np.full(len(queue[0]) * args.real_samples, args.real_max_new_tokens, np.int32)
    got, lengths = measure("real", graphdef, state, params, args.slots, args.real_samples,
                           queue, limits, 1, costs, args.min_admit or None,
                           args.prefill_chunk)
    rows += got
    with open(os.path.join(args.out, "lengths_real.json"), "w") as f:
      json.dump([int(x) for x in lengths], f)
    notes.append(f"real: SmolLM2-135M-Instruct (Q4_1 GGUF, float32), {len(queue[0])} prompts "
                 f"x {args.real_samples} samples, P={queue[0].shape[1]}, "
                 f"T={args.real_max_new_tokens}, S={args.slots}: "
                 f"{length_summary(lengths, args.real_max_new_tokens)}; {ceilings(got)}; probe: "
                 f"{1e3 * costs['step_s']:.1f} ms per decode step, "
                 f"{1e3 * costs['prefill_prompt_s']:.1f} ms per prompt prefilled")
  tables, step_tables = [], []
  if "pipelined" in parts:
    got_tables, got_notes = measure_pipelined(args)
    tables += got_tables
    notes += got_notes
  if "step" in parts:
    step_tables, got_notes = measure_steps(args)
    notes += got_notes
  if "packing" in parts:
    path = os.path.join(args.out, "lengths_real.json")
    if not os.path.exists(path):
      raise SystemExit(f"--parts packing reads the real part's lengths from {path}: run "
                       "the real part first (or with it).")
    with open(path) as f:
      got_tables, got_notes = measure_packing(args, json.load(f))
    tables += got_tables
    notes += got_notes
  with open(os.path.join(args.out, "rows.json"), "w") as f:
    json.dump(rows, f, indent=1)
  table = "\n\n".join(([render(rows)] if rows else []) + step_tables + tables)
  intro = (([ENGINE_INTRO] if rows else []) + ([STEP_INTRO] if step_tables else [])
           + ([PIPELINED_INTRO] if "pipelined" in parts else [])
           + ([PACKING_INTRO] if "packing" in parts else []))
  print(table)
  print("\n".join(notes))
  if args.page:
    title = ("Rollout engine: continuous batching against the static batch" if rows
             else "Whole PPO steps: partial rollouts against static batches" if step_tables
             else "Pipelined decoder: refilled micro-batches against static batches"
             if "pipelined" in parts
             else "Packed inference and training against the padded layout")
    path = results.write_page(args.page, title, body(intro, table, notes), None)
    print(f"wrote {path}")


def render(rows) -> str:
  lines = ["| distribution | engine | decode steps (predicted) | slot occupancy | s per queue "
           "(predicted, error) | useful tokens/s | speed-up | largest prefill pass (prompt "
           f"tokens) | KV cache MiB (paged: at its peak, pages of {PAGE}) | compiled temp MiB "
           "| identical completions |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
  base = {r["distribution"]: r for r in rows if r["engine"] == "static"}
  for r in rows:
    err = (r["predicted_s"] - r["seconds"]) / r["seconds"]
    lines.append(
        f"| {r['distribution']} | {r['engine']} | {r['decode_steps']} "
        f"({r['predicted_steps']}) | {r['occupancy']:.2f} | {r['seconds']:.2f} "
        f"({r['predicted_s']:.2f}, {100 * err:+.0f}%) | {r['tokens_per_s']:.1f} | "
        f"{r['tokens_per_s'] / base[r['distribution']]['tokens_per_s']:.2f}x | "
        f"{r['widest_pass']} | {r['kv_mib']:.1f} ({r['paged_mib']:.1f}) | "
        f"{r['temp_mib']:.1f} | "
        f"{r['identical']}/{r['completions']} |")
  return "\n".join(lines)


ENGINE_INTRO = (
    "The same queue of completions decoded by the static sampler (consecutive batches of "
    "S rows, each running until its longest row ends) and by the continuous-batching "
    "engine (S slots, a finished row's slot refilled at once), at the same slot count "
    "and KV-cache memory. The speed-up is in useful tokens per second (every "
    "completion token over the seconds the queue took); slot occupancy is the decoded "
    "tokens over the slot-steps run. Predicted: the cost model's decode steps (the pure "
    "schedule of `generation/engine.py`) times a probe's step seconds, plus prefills. "
    "With `--prefill-chunk C` a third engine runs: the continuous one with its admissions "
    "prefilled in passes of C prompt columns and a decode step of the running slots "
    "between two passes (`stages.generate.prefill_chunk`). The largest prefill pass is "
    "the most prompt tokens one forward pass takes, the longest a decode step can wait "
    "on a prefill (the static batch's prefill runs before its decode steps). The paged "
    "KV figure is a count from the schedule, not a measured engine (the engine's cache is "
    "contiguous per slot): the pages a cache of fixed-size pages would hold at the "
    "busiest decode step, every busy row's prompt and tokens so far, a finished row's "
    "pages freed at once.")
STEP_INTRO = (
    "Whole PPO steps on one stream of prompts whose completions have long-tailed lengths: "
    "static batches (each decoded until its longest completion ends) in `sequential` and "
    "`pipe` mode, and partial rollouts in `pipe` mode (`plan.partial_rollouts`: one "
    "engine of as many slots as the batch has completions, kept across updates; a batch "
    "is the first completions to finish, the rest continue under the next weights). "
    "Trained tokens/s is the completion tokens per step over the seconds per step.")
PIPELINED_INTRO = (
    "The long tail's queue on the delayed inter-batch pipeline (2 stages, M micro-batches "
    "of S / M rows), as consecutive static batches of S rows (every micro-batch runs "
    "until its longest row ends, the batch until its last micro-batch does) and as one "
    "call whose micro-batches are refilled with the next load of S / M rows once their "
    "rows are all done (`num_slots=S`), at the same slot count and KV-cache memory. "
    "Ticks: the last tick any stage worked, measured and from the pure schedule. Busy "
    "stage-ticks: the share of (tick, stage) slots that ran a pass. Slot occupancy: "
    "tokens drawn over the row-passes stage 0 ran. Predicted seconds: the "
    "refill's ticks at the static run's seconds per tick.")
PACKING_INTRO = (
    "The inference stage on one batch, its forward passes over the padded "
    "`[prompt | completion]` layout and over the batch's real tokens packed into rows "
    "(`stages.infer.pack_tokens`, `stages/packing.py`), and the training stage's PPO "
    "update on that batch, each minibatch's forward and backward passes padded and "
    "packed (`stages.train.pack_tokens`); the outputs are the same.")


def body(intro, table: str, notes) -> str:
  return "\n".join([*intro, "", table, "", *[f"- {n}" for n in notes]])


if __name__ == "__main__":
  main()
