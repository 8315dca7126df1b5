"""The warm-start phase: SFT and the reward model before PPO, checkpointed and shared.

Owns what decides a warm start and where it comes from: its fingerprint (the seed and the model,
data, sft and reward_model sections, with the content of the user's demonstration and
preference files in place of their paths; never the PPO plan), which checkpoint a run
restores (its own `<workdir>/warmstart`, else the shared one the config names, refused
when written under another config or from files that have changed since), and
`fit_or_restore`, which trains the phases (`phases.supervised`) on their own layout or
restores them onto it.

SFT and the reward model train on one layout of their own (`warm_start.mesh` over all
the job's devices), never on a PPO stage's mesh, so a seed's warm start is the same, to
the last bit, in every mode, and runs of one seed in several modes can start PPO
from one checkpoint.
"""

from __future__ import annotations

import os
import time
from typing import Any

from flax import nnx
import jax

from pipe_rlhf_jax import checkpoint as ckpt_lib
from pipe_rlhf_jax.config import ExperimentSettings
from pipe_rlhf_jax.config.experiment import ModelSettings, WarmStartSettings
from pipe_rlhf_jax.data import digests
from pipe_rlhf_jax.metrics import say
from pipe_rlhf_jax.models import load
from pipe_rlhf_jax.models.config import TransformerConfig
from pipe_rlhf_jax.models.transformer import Transformer, init_model
from pipe_rlhf_jax.phases import supervised
from pipe_rlhf_jax.phases.policy_pairs import PolicyPairs
from pipe_rlhf_jax.system.system import with_backbone

# The metrics phases the warm start writes (rewritten when its checkpoint is missing).
PHASES = ("sft", "reward_model", "reward_model_eval")


def init_policy(m: ModelSettings, seed: int, cfg: TransformerConfig) -> Transformer:
  """The policy before SFT: `model.path`'s weights, or the embedded model initialised from
  the seed."""
  if m.path:
    return load.from_pretrained(m.path, dtype=m.dtype, param_dtype=m.param_dtype)
  return init_model(cfg, seed=seed)


def warm_start_fingerprint(settings: ExperimentSettings) -> str:
  """Hash of what decides the warm start's result: the seed, and the model, data, SFT and
  reward-model sections (not `data.dir`, a location, nor any part of the PPO plan). With
  `data.task='jsonl'` the demonstration and preference files count by their content,
  not their paths (`data.digests.with_content`).

  A rule-reward run trains no reward model, so the reward_model settings do not decide
  its warm start (and a reward-model checkpoint is never mistaken for one).
  """
  sections = {k: settings.section_dict(k) for k in ("model", "data", "sft")}
  sections["reward_model"] = (settings.section_dict("reward_model")
                              if settings.reward.uses_model else "none: rule reward")
  if isinstance(sections["reward_model"], dict) and not sections["reward_model"].get(
      "policy_pairs", 0.0):
    # Policy pairs off: their settings decide nothing, so runs that differ only in them
    # share a warm start.
    for key in ("policy_pairs", "policy_samples", "label_fn"):
      sections["reward_model"].pop(key, None)
  return ckpt_lib.config_fingerprint(
      digests.with_content({"seed": settings.seed, **sections},
                           digests.file_digests(settings.data_files(digests.WARM_START_ROLES))),
      ignore=ckpt_lib.DEFAULT_FINGERPRINT_IGNORE + ("data.dir",))


def warm_start_source(warm: WarmStartSettings, workdir: str) -> str | None:
  """The warm-start checkpoint this run restores, or None when it must train one.

  Its own `<workdir>/warmstart` when that holds a checkpoint (a resume), else the
  directory `warm_start.checkpoint` names, when set.
  """
  own = os.path.join(workdir, "warmstart")
  if os.path.isdir(own):  # (opening a Checkpointer would create the directory)
    with ckpt_lib.Checkpointer(own, async_save=False) as ckpt:
      if ckpt.latest_step() is not None:
        return own
  shared = warm.checkpoint
  if not shared:
    return None
  with ckpt_lib.Checkpointer(shared, async_save=False) as ckpt:
    if ckpt.latest_step() is None:
      raise FileNotFoundError(
          f"warm_start.checkpoint={shared!r} holds no warm-start checkpoint; give the "
          "warmstart/ directory of a finished run (or of `train.prepare_warm_start`), or set "
          "--config.warm_start.checkpoint='' to train the warm start here.")
  return shared


def resolve_source(settings: ExperimentSettings, workdir: str) -> str | None:
  """`warm_start_source`, decided once per run, before any data are built.

  Refuses a warm start trained on a data.jsonl file whose content has changed since
  (the run's own or a shared one), and a shared warm start (`warm_start.checkpoint`)
  written under another seed, model, data, sft or reward_model config (or reward); the
  run's own is compared with its config when it is restored. The run then passes the result
  on, never asking the file system again: in a multi-process job every process must
  make the same choice, and a later look could see the directory another process has
  just created (and open a checkpoint manager, a collective, the others never open).
  """
  source = warm_start_source(settings.warm_start, workdir)
  if source is None:
    return None  # trained here
  own = source == os.path.join(workdir, "warmstart")
  with ckpt_lib.Checkpointer(source, async_save=False) as ckpt:
    meta = ckpt.read_metadata()
  changed = digests.changed_file(meta.get("data_files"),
                                 digests.file_digests(settings.data_files(digests.WARM_START_ROLES)))
  if changed:
    fix = ("use a new workdir" if own else
           "set --config.warm_start.checkpoint='' to train a warm start on it here")
    raise ckpt_lib.CheckpointError(
        f"the warm start in {source} was trained on other data: {changed}. Restore the "
        f"file, or {fix}.")
  if own:
    return source  # this run's own: its config is checked when it is restored
  saved = meta.get("fingerprint")
  if saved != warm_start_fingerprint(settings):
    raise ckpt_lib.CheckpointError(
        f"warm_start.checkpoint={source!r} was written under another seed, model, data, "
        f"sft or reward_model config than this run's (fingerprint {saved!r}, this run "
        f"{warm_start_fingerprint(settings)!r}); give the warm start of this seed and config, "
        "or set --config.warm_start.checkpoint='' to train one here.")
  return source


def fit_or_restore(settings: ExperimentSettings, workdir, source: str | None, data, cfgs,
                   writer, layout, progress: bool, tokenizer=None) -> dict[str, Any]:
  """SFT and reward-model phases on `layout`, or restores `source` (`resolve_source`).

  With a rule reward (`reward.fn` not "model") the reward-model phase is skipped: the
  result has no "reward" entry and `rm_eval` is None. The reward model starts from the
  run's base model (`reward_model.init="base"`: the embedded model freshly initialised,
  or the backbone of `model.path`) or from the SFT policy's backbone ("sft"), with a
  new score head either way.

  `layout` is the warm-start layout (`phases.supervised.warm_start_layout`), the same in
  every mode. A checkpoint is restored onto it (replicated over its mesh),
  whatever devices wrote it; its fingerprint (`warm_start_fingerprint`) covers what
  decides its result, never the plan, so a preempted run may continue on another slice
  and runs in other modes may share it.

  With `reward_model.policy_pairs` > 0 that share of every reward-model batch is made of
  the SFT policy's own samples, ranked by `reward_model.label_fn` (`phases.policy_pairs`;
  `tokenizer` decodes them for the rule).
  """
  use_rm = settings.reward.uses_model
  policy = init_policy(settings.model, settings.seed, cfgs["actor"])
  actor_gd, actor = nnx.split(policy)
  target = {"actor": actor}
  if use_rm:
    reward_gd, reward = nnx.split(init_model(cfgs["reward"], seed=settings.seed + 1))
    if settings.model.path:
      reward = with_backbone(cfgs["reward"], actor, settings.seed + 1)
    target["reward"] = reward
  fingerprint = warm_start_fingerprint(settings)
  if source is not None:
    with ckpt_lib.Checkpointer(source, max_to_keep=1, async_save=False) as ckpt:
      state, meta = ckpt.restore(target=jax.tree.map(
          lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=layout.replicated),
          target), expect_metadata={"fingerprint": fingerprint})
    say(f"warm start restored from {source}")
    return {**state, "rm_eval": meta["rm_eval"]}
  ckpt = ckpt_lib.Checkpointer(os.path.join(workdir, "warmstart"), max_to_keep=1,
                               async_save=False)
  t0 = time.perf_counter()
  actor, _ = supervised.fit(supervised.sft_loss(actor_gd), actor, layout,
                            iter(data["demos"] or ()),  # None when sft.steps=0
                            steps=settings.sft.steps, learning_rate=settings.sft.learning_rate,
                            warmup_steps=settings.sft.warmup_steps, phase="sft", writer=writer,
                            progress=progress)
  say(f"SFT done in {time.perf_counter() - t0:.1f}s")
  state, rm_eval = {"actor": actor}, None
  if use_rm:
    rm = settings.reward_model
    if rm.init == "sft":
      # The reward model reads answers with the SFT policy's features (which already
      # predict the right letter), only its score head starting afresh.
      reward = with_backbone(cfgs["reward"], actor, settings.seed + 1)
    pairs = iter(data["prefs"])
    if rm.policy_pairs:
      pairs = policy_pairs_of(settings, pairs, actor_gd, actor, tokenizer)
    state["reward"], _ = supervised.fit(
        supervised.reward_model_loss(reward_gd), reward, layout, pairs,
        steps=rm.steps, learning_rate=rm.learning_rate, warmup_steps=rm.warmup_steps,
        phase="reward_model", writer=writer, progress=progress)
    rm_eval = supervised.evaluate_reward_model(reward_gd, state["reward"], layout,
                                               iter(data["prefs_eval"]), rm.eval_batches)
    if isinstance(pairs, PolicyPairs):
      rm_eval.update(pairs.summary())
      say(f"reward model: {rm_eval['policy_pairs']} pairs from the SFT policy's samples "
          f"(labels {rm_eval['policy_chosen_label']:.3f} chosen vs "
          f"{rm_eval['policy_rejected_label']:.3f} rejected; "
          f"{rm_eval['policy_pairs_tied']} rows tied, kept from the dataset)")
    writer.write(rm.steps, rm_eval, phase="reward_model_eval")
    say(f"reward model: held-out pairwise accuracy {rm_eval['eval_accuracy']:.3f} "
        f"on {rm_eval['eval_pairs']} pairs")
  else:
    source = (f"the environment {settings.env.name!r}" if settings.reward.uses_environment
              else f"the rule {settings.reward.fn!r}")
    say(f"reward: {source}; no reward model is trained")
  ckpt.save(0, state, metadata={
      "fingerprint": fingerprint, "rm_eval": rm_eval,
      "data_files": digests.file_digests(settings.data_files(digests.WARM_START_ROLES))})
  ckpt.close()
  return {**state, "rm_eval": rm_eval}


def policy_pairs_of(settings: ExperimentSettings, batches, actor_gd, actor, tokenizer
                    ) -> PolicyPairs:
  """The reward model's batches with `reward_model.policy_pairs` of their rows made of
  the SFT policy's samples, sampled as PPO will sample (`ppo.temperature`, top-k,
  top-p) and ranked by `reward_model.label_fn` (empty: `reward.eval_fn`)."""
  rm = settings.reward_model
  sampling = settings.sampling.sampling_params(settings.data.completion_len, tokenizer)
  return PolicyPairs(batches, actor_gd, actor, tokenizer, settings.policy_pairs_label(),
                     share=rm.policy_pairs, samples_per_prompt=rm.policy_samples,
                     sampling=sampling, seed=settings.seed + 2)
