"""Benchmark of the peer library tunix: seconds per PPO step, for the same work as ours.

Owns one measurement: tunix's own PPO (`tunix.rl.ppo.ppo_learner.PPOLearner` on an
`RLCluster` with its "vanilla" rollout engine, i.e. tunix's KV-cache `Sampler`) on one CPU
device, f32, at the model sizes of `bench_ppo_step` (`experiments.shapes.SIZES`, which
both import, so the two cannot drift apart). Actor, reference and critic are tunix `Qwen2`
models built by tunix's own random init (`create_dummy_model`) at those dims, untied LM
head; the critic is the actor's copy with the LM head replaced by a 1-unit value head
(`rl.utils.create_critic_model`), the reference a second model of the same seed. Each
PPO step: `batch` random prompts of `prompt` tokens, `gen` sampled tokens each
(temperature 1, full vocabulary), reference log-probs and critic values, a host rule
reward (the completion's length in tokens), GAE, one actor and one critic gradient step
on the whole batch (num_iterations=1, mini_batch_size=batch, no micro-batching). The
first `--warmup` steps (compilation) are left out of the mean and min.

Per-stage times come from wrapping the `RLCluster` methods the learner calls, blocking
on their results: rollout = `generate`; inference = `get_ref_per_token_logps` +
`get_old_per_token_logps` + `get_values`; update = `update_actor` + `update_critic`;
other = the rest of the step (host reward, GAE, tunix's metric statistics and buffers).
A step ends when `update_critic` returns.

Where the work matches `bench_ppo_step.py`: model dims (the parameter count differs only
by Qwen2's q/k/v biases), batch/prompt/gen, f32, one device, exactly `gen` generated
tokens, reference and critic forwards, one actor and one critic AdamW step (global-norm
clipping 1.0, lr 1e-5), a per-token KL to the reference in the rewards (k1, coefficient
0.05), GAE with gamma 1 and lambda 0.95, clip 0.2 for the ratio and the value.

Where it differs (read from tunix 0.1.7's source):
- Qwen2, not Llama3: tunix's Llama3 cannot be the critic, since `common.compute_score`
  always passes `segment_ids` and `Llama3.__call__` does not take it (TypeError on the
  first `get_values`). Qwen2 adds q/k/v biases and, in every attention, a mask built
  from those segment ids on top of the causal mask (elementwise work, no matmuls).
- EOS cannot be switched off in tunix's sampler (`eos_tokens=None` means the
  tokenizer's EOS), so this script's tokenizer names an EOS id outside the vocabulary
  (vocab + 1), which the model cannot sample: every row runs the full `gen` tokens. Its
  pad id is outside the vocabulary too (vocab), because tunix counts every token equal to
  the pad id as padding (attention and completion masks); the prompts have no padding.
- tunix recomputes the old (behaviour) log-probs with one more actor forward over prompt
  + completion (`get_old_per_token_logps`, whatever num_iterations is); ours keeps the
  sampler's. So tunix's inference stage is three forwards (reference, actor, critic), ours
  two.
- Log-probs (reference, old, and in the actor's loss) come from the LM head applied at
  all prompt + gen positions, sliced afterwards; ours applies it at the `gen` completion
  positions. tunix's prefill likewise produces logits at every prompt position; ours at
  the last one.
- tunix's decode loop runs `gen` one-token forwards after the prefill (the last sample
  falls outside the token buffer and is dropped); ours runs `gen` - 1. Each decode step
  attends over the whole KV cache (prompt + gen, the least tunix accepts), masked.
- tunix's layers are a Python loop, unrolled into each program (ours: a layer scan,
  unrolled by default, `StagePlan.scan_unroll`).
- No advantage whitening (tunix's PPO has none). The rollout seed is the same every step
  (tunix's RolloutConfig takes one seed; a key array is donated, see `seed=0` below); the
  prompts differ each step.
- tunix builds the token rewards with the completion ids' dtype (int32), so a fractional
  score is truncated; the length reward here is integral, so nothing changes.
- The trainer's weights are shared with the sampler (colocated roles on one mesh), so
  there is no weight sync; the output records tunix's `should_sync_weights`.

Usage (in its own virtual environment, not the project's .venv; `.venv-tunix/` is
git-ignored; from the repository root, where `experiments.shapes`, which imports nothing,
is found without this project's dependencies):
  python3 -m venv .venv-tunix
  .venv-tunix/bin/pip install google-tunix==0.1.7 chex
  .venv-tunix/bin/python -m experiments.bench_peer_tunix --sizes 1,2 --steps 8
  # SmolLM2-135M's shape, beside `python -m experiments.bench_ppo_step --shapes smollm2-135m`:
  .venv-tunix/bin/python -m experiments.bench_peer_tunix --dims 30,576,9,3,1536,49152,8,64,64 \
      --tied --steps 3 --warmup 1

Writes peer_step.json and peer_step.md to --out-dir (default
experiments/out/bench_peer_tunix/). Timings on a shared machine are noisy: run it alone.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import sys
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from flax import nnx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from tunix.models import dummy_model_creator  # noqa: E402
from tunix.models.qwen2 import model as qwen2  # noqa: E402
from tunix.rl import rl_cluster as rl_cluster_lib  # noqa: E402
from tunix.rl import utils as rl_utils  # noqa: E402
from tunix.rl.ppo import ppo_learner  # noqa: E402
from tunix.rl.rollout import base_rollout  # noqa: E402

from experiments.shapes import SIZES  # noqa: E402  (literals only: no project import)


class IdTokenizer:
  """Prompts and completions as space-separated token ids (tunix's rollout takes text).

  bos_id is None so no BOS is prepended; pad and EOS are ids the model cannot emit (see
  the module docstring)."""

  def __init__(self, vocab: int):
    self._pad, self._eos = vocab, vocab + 1

  def encode(self, text: str, **_) -> list[int]:
    return [int(t) for t in text.split()]

  def decode(self, ids, **_) -> str:
    return " ".join(str(int(i)) for i in ids)

  def bos_id(self):
    return None

  def eos_id(self) -> int:
    return self._eos

  def pad_id(self) -> int:
    return self._pad


def length_reward(prompts, completions, **_) -> list[float]:
  return [float(len(c.split())) for c in completions]


class StageClock:
  """Wall time per stage and per step, by wrapping the RLCluster methods PPOLearner
  calls. Results are blocked on so that asynchronous dispatch does not move a stage's
  time into the next one."""

  STAGES = {"generate": "rollout", "get_ref_per_token_logps": "inference",
            "get_old_per_token_logps": "inference", "get_values": "inference",
            "update_actor": "update", "update_critic": "update"}

  def __init__(self, cluster):
    self.steps: list[dict[str, float]] = []
    self.shortest = None  # fewest tokens any completion had: checks that EOS never hit
    self._current = self._fresh()
    self._last_end = None
    self._cluster = cluster
    for name, stage in self.STAGES.items():
      setattr(cluster, name, self._wrap(getattr(cluster, name), stage,
                                        ends_step=name == "update_critic"))

  @staticmethod
  def _fresh() -> dict[str, float]:
    return {"rollout": 0.0, "inference": 0.0, "update": 0.0}

  def start(self) -> None:
    self._last_end = time.perf_counter()

  def _wrap(self, fn, stage, ends_step):
    def timed(*args, **kwargs):
      t0 = time.perf_counter()
      out = fn(*args, **kwargs)
      if stage == "update":
        # The trainers return nothing; their models' new weights are the result.
        model = (self._cluster.critic_trainer.model if ends_step
                 else self._cluster.actor_trainer.model)
        jax.block_until_ready(nnx.state(model))
      elif stage == "inference":
        jax.block_until_ready(out)
      t1 = time.perf_counter()
      if stage == "rollout":
        n = min(len(t) for t in out.tokens)
        self.shortest = n if self.shortest is None else min(self.shortest, n)
      self._current[stage] += t1 - t0
      if ends_step:
        self._current["step"] = t1 - self._last_end
        self._last_end = t1
        self.steps.append(self._current)
        self._current = self._fresh()
      return out
    return timed


def bench_size(size, sizes: dict, steps: int, warmup: int, tied: bool = False) -> dict:
  layers, embed, heads, kv, mlp, vocab, batch, prompt, gen = sizes[size]
  config = qwen2.ModelConfig(
      num_layers=layers, vocab_size=vocab, embed_dim=embed, hidden_dim=mlp,
      num_heads=heads, head_dim=embed // heads, num_kv_heads=kv, rope_theta=10_000,
      norm_eps=1e-5, use_tied_embedding=tied, dtype=jnp.float32,
      param_dtype=jnp.float32)
  # One device for every role: tunix then colocates them and shares the actor's weights
  # with the sampler, as our sequential mode does on one device.
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("fsdp", "tp"))
  make = lambda: dummy_model_creator.create_dummy_model(
      qwen2.Qwen2, config, mesh=mesh, dtype=jnp.float32, random_seed=0)
  actor = make()
  reference = make()
  critic = rl_utils.create_critic_model(actor, seed=1)

  optimizer = lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-5))
  cluster_config = rl_cluster_lib.ClusterConfig(
      role_to_mesh={role: mesh for role in rl_cluster_lib.Role},
      rollout_engine="vanilla",
      offload_to_cpu=False,
      training_config=rl_cluster_lib.RLTrainingConfig(
          actor_optimizer=optimizer(), critic_optimizer=optimizer(),
          eval_every_n_steps=10**9, max_steps=steps, mini_batch_size=batch,
          pbar_description=None),
      rollout_config=base_rollout.RolloutConfig(
          max_tokens_to_generate=gen, max_prompt_length=prompt,
          kv_cache_size=prompt + gen, temperature=1.0, top_p=1.0, top_k=None,
          # An int, not a key array: the sampler donates its state, key included, so a
          # key array would be deleted after the first rollout.
          seed=0),
  )
  cluster = rl_cluster_lib.RLCluster(
      actor=actor, critic=critic, reference=reference, tokenizer=IdTokenizer(vocab),
      cluster_config=cluster_config)
  learner = ppo_learner.PPOLearner(
      rl_cluster=cluster,
      ppo_config=ppo_learner.PPOConfig(
          num_iterations=1, gamma=1.0, gae_lambda=0.95, beta=0.05, kl_method="kl",
          epsilon=0.2, clip_range_value=0.2),
      reward_fns=length_reward)
  clock = StageClock(cluster)
  rng = np.random.default_rng(0)

  def prompts():
    while True:
      ids = rng.integers(3, vocab, (batch, prompt))
      # An array, not a list: tunix maps np.repeat over the batch's leaves.
      yield {"prompts": np.array([" ".join(map(str, row)) for row in ids])}

  t0 = time.perf_counter()
  clock.start()
  learner.train(prompts())
  wall = time.perf_counter() - t0
  done = clock.steps
  if len(done) != steps:
    raise RuntimeError(f"tunix ran {len(done)} PPO steps, asked for {steps}")
  if clock.shortest != gen:
    raise RuntimeError(f"a completion had {clock.shortest} tokens, not {gen}")
  steady = done[warmup:]
  step_s = [s["step"] for s in steady]
  mean = lambda key: float(np.mean([s[key] for s in steady]))
  stages = {f"{k}_s": mean(k) for k in ("rollout", "inference", "update")}
  params = sum(x.size for x in jax.tree.leaves(nnx.state(cluster.actor_trainer.model)))
  return {
      "size": size, "dims": sizes[size], "params": int(params), "steps": steps,
      "warmup": warmup, "wall_s": wall, "s_per_step": float(np.mean(step_s)),
      "s_per_step_min": float(np.min(step_s)), **stages,
      "other_s": float(np.mean(step_s)) - sum(stages.values()),
      "should_sync_weights": bool(learner.should_sync_weights),
      "step_times_s": [s["step"] for s in done],
  }


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--sizes", default="1,2")
  parser.add_argument("--dims", default="", help="instead of --sizes, one size as "
                      "layers,embed,heads,kv_heads,mlp,vocab,batch,prompt,gen (e.g. "
                      "SmolLM2-135M's 30,576,9,3,1536,49152,8,64,64 with --tied)")
  parser.add_argument("--tied", action="store_true", help="tie the LM head to the embedding")
  parser.add_argument("--steps", type=int, default=8)
  parser.add_argument("--warmup", type=int, default=2)
  parser.add_argument("--out-dir", default=os.path.join(_ROOT, "experiments", "out",
                                                        "bench_peer_tunix"))
  args = parser.parse_args()
  if args.steps <= args.warmup:
    parser.error("--steps must exceed --warmup")
  sizes = dict(SIZES)
  if args.dims:
    dims = tuple(int(x) for x in args.dims.split(","))
    if len(dims) != 9:
      parser.error(f"--dims={args.dims!r} needs 9 integers, got {len(dims)}")
    sizes, args.sizes = {"dims": dims}, "dims"
  os.makedirs(args.out_dir, exist_ok=True)
  versions = {"tunix": importlib.metadata.version("google-tunix"), "jax": jax.__version__,
              "flax": importlib.metadata.version("flax")}
  rows = []
  for size in [s if s == "dims" else int(s) for s in args.sizes.split(",")]:
    row = bench_size(size, sizes, args.steps, args.warmup, tied=args.tied)
    rows.append(row)
    print(json.dumps({k: (round(v, 4) if isinstance(v, float) else
                          [round(x, 4) for x in v] if k == "step_times_s" else v)
                      for k, v in row.items()}), flush=True)
  # The interpreter in full: the script runs in tunix's own environment.
  command = " ".join([sys.executable, "-m", __spec__.name, *sys.argv[1:]])
  with open(os.path.join(args.out_dir, "peer_step.json"), "w", encoding="utf-8") as f:
    json.dump({"command": command, "backend": jax.default_backend(),
               "devices": 1, "versions": versions, "rows": rows}, f, indent=2)
  lines = [f"`{command}` (tunix {versions['tunix']}, jax {versions['jax']}, flax "
           f"{versions['flax']}; {jax.default_backend()}, 1 device, f32; mean over steps "
           f"{args.warmup + 1}..{args.steps})", "",
           "| dims (layers, d, heads/kv, ffn, vocab; batch, prompt, gen) | s/step mean | "
           "s/step min | rollout / inference / update / other s |", "|---|---|---|---|"]
  for r in rows:
    d = r["dims"]
    lines.append(
        f"| {d[0]}, {d[1]}, {d[2]}/{d[3]}, {d[4]}, {d[5]}; {d[6]}, {d[7]}, {d[8]} | "
        f"{r['s_per_step']:.3f} | {r['s_per_step_min']:.3f} | {r['rollout_s']:.3f} / "
        f"{r['inference_s']:.3f} / {r['update_s']:.3f} / {r['other_s']:.3f} |")
  with open(os.path.join(args.out_dir, "peer_step.md"), "w", encoding="utf-8") as f:
    f.write("\n".join(lines) + "\n")
  print("\n".join(lines))


if __name__ == "__main__":
  main()
