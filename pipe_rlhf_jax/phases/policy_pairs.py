"""Preference pairs from the SFT policy's own samples, labelled by a rule.

A reward model trained only on a dataset's pairs learns to tell apart the mistakes that
dataset shows; PPO then finds the mistakes it was never shown (docs/design_notes.md:
the quickstart's reward model preferred a copied neighbour letter to the right
answer, and PPO learned to copy). InstructGPT-style pipelines have labellers rank the
policy's own samples instead. Here a rule stands in for the labeller
(`reward_model.label_fn`, by default the task's `reward.eval_fn`): the reward model sees
the near-misses the SFT policy actually makes, ranked.

Owns `PolicyPairs`, which rewrites the first `round(share * B)` rows of every
preference batch before the reward model trains on it: `k` samples of the SFT policy
for the row's prompt, the best-labelled one as `chosen` and the worst as `rejected`. A
row whose `k` samples all get the same label keeps its dataset pair, so batch shapes
never change and every row still holds a strict preference. Sampling is keyed by the
batch's step and each sample's row, so the pairs are the same on every run of a seed.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

from flax import nnx
import jax
import numpy as np

from pipe_rlhf_jax import distributed
from pipe_rlhf_jax.generation.sampler import SamplingSettings, generate_repeated
from pipe_rlhf_jax.ppo.registry import score_rule


class PolicyPairs:
  """An iterator of preference batches whose first rows are the policy's own samples.

  Args:
    batches: the dataset's preference batches (`data.loaders.PreferenceLoader`).
    graphdef, params: the SFT policy (an LM-head Transformer's parts).
    tokenizer: decodes prompts and samples for the label rule.
    label_fn: a registered rule `(prompts, completions) -> float32 [batch]`.
    share: fraction of each batch's rows replaced, in [0, 1].
    samples_per_prompt: k >= 2 samples drawn per replaced row.
    sampling: the policy's sampling distribution (PPO's temperature / top-k / top-p);
      its `max_new_tokens` must equal the batches' completion length.
    seed: sampling seed.

  Each batch also counts what it did in `self.stats` (rows replaced, rows kept because
  all samples tied, mean label of the chosen and of the rejected samples).
  """

  def __init__(self, batches: Iterator[dict], graphdef: nnx.GraphDef, params: nnx.State,
               tokenizer, label_fn: Callable, *, share: float, samples_per_prompt: int,
               sampling: SamplingSettings, seed: int):
    if samples_per_prompt < 2:
      raise ValueError(f"reward_model.policy_samples={samples_per_prompt}: a pair needs "
                       "at least 2 samples per prompt.")
    self._batches = batches
    self._model = nnx.merge(graphdef, params)
    self._tokenizer = tokenizer
    self._label = label_fn
    self._share = share
    self._k = samples_per_prompt
    self._sampling = sampling
    self._rng = jax.random.key(seed)
    self._step = 0
    self.stats = {"replaced": 0, "tied": 0, "chosen_label": 0.0, "rejected_label": 0.0}

  def __iter__(self) -> "PolicyPairs":
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    batch = dict(next(self._batches))
    rows = int(round(self._share * batch["prompt_tokens"].shape[0]))
    if rows:
      self._replace(batch, rows)
    self._step += 1
    return batch

  def _replace(self, batch: dict[str, np.ndarray], rows: int) -> None:
    k, length = self._k, batch["chosen_tokens"].shape[1]
    for key in ("chosen_tokens", "chosen_mask", "rejected_tokens", "rejected_mask"):
      batch[key] = np.array(batch[key])  # the pipeline's arrays may be read-only
    if self._sampling.max_new_tokens != length:
      raise ValueError(f"policy pairs: samples of {self._sampling.max_new_tokens} tokens "
                       f"for completions of {length}")
    prompt, prompt_mask, out = generate_repeated(  # [rows * k, P] prompts
        self._model, batch["prompt_tokens"][:rows], batch["prompt_mask"][:rows], k,
        self._sampling, rng=jax.random.fold_in(self._rng, self._step))
    tokens, mask = (np.asarray(x) for x in distributed.fetch((out.tokens, out.mask)))
    decode = self._tokenizer.decode
    prompts = [decode(p[m]) for p, m in zip(prompt, prompt_mask)]
    completions = [decode(c[m]) for c, m in zip(tokens, mask)]
    labels = score_rule(self._label, prompts, completions).reshape(rows, k)  # [rows, k]
    rows_at = np.arange(rows)
    best, worst = labels.argmax(axis=1), labels.argmin(axis=1)  # [rows]
    # A row whose samples all tie has nothing to prefer: its dataset pair stays.
    kept = rows_at[labels[rows_at, best] > labels[rows_at, worst]]
    tokens, mask = tokens.reshape(rows, k, length), mask.reshape(rows, k, length)
    for side, pick in (("chosen", best[kept]), ("rejected", worst[kept])):
      batch[f"{side}_tokens"][kept] = tokens[kept, pick]
      batch[f"{side}_mask"][kept] = mask[kept, pick]
    self.stats["replaced"] += len(kept)
    self.stats["tied"] += rows - len(kept)
    self.stats["chosen_label"] += float(labels[kept, best[kept]].sum())
    self.stats["rejected_label"] += float(labels[kept, worst[kept]].sum())

  def summary(self) -> dict[str, Any]:
    """Rows replaced and tied so far, and the mean label of chosen and rejected samples."""
    n = max(self.stats["replaced"], 1)
    return {"policy_pairs": self.stats["replaced"], "policy_pairs_tied": self.stats["tied"],
            "policy_chosen_label": self.stats["chosen_label"] / n,
            "policy_rejected_label": self.stats["rejected_label"] / n}
