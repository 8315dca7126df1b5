"""TFDS datasets in array_record format built from JSONL, without TensorFlow.

What is built: for a JSONL file per split, a TFDS dataset `<data_dir>/<name>/1.0.0/`
with one `array_record` shard per split plus the usual `dataset_info.json`,
`features.json` and `metadata.json`. Examples hold the validated raw strings
(`tfds.features.Text`) and `index` (int64, the 0-based line number of the record in its
JSONL file), in file order. Tokenization is left to the pipelines, so one dataset
serves every tokenizer. Read it back with `tfds.data_source(name, data_dir=...,
split=...)` (random access, what grain consumes) or `BuiltDataset.source(split)`.

How, and why this way: TFDS 4.9.10 prepares `GeneratorBasedBuilder`s without
TensorFlow when every feature is numpy-encodable (Text and Scalar are) and the file
format is array_record; we checked this with `import tensorflow` failing in the venv.
Three details make it work outside a TFDS dataset package:

* `_info` returns a `tfds.core.DatasetInfo(builder=self, ...)` directly, because
  `dataset_info_from_configs` wants the package's metadata files; its subclass skips
  the lookup of published metadata on the TFDS bucket (which leaves a temp folder);
* builder classes are made per dataset name with `skip_registration=True`, so any
  number of names can be built in one process. Readers do not need the class: TFDS
  rebuilds a read-only builder from the files in the dataset directory;
* the class sets `code_path = None`: TFDS only uses it to find download checksums, and
  computing it for a class inside a package needs the `importlib_resources` backport,
  which TFDS does not declare as a dependency.

Each record goes through `records.RecordValidator` (structural checks only; token
budgets depend on the tokenizer and are applied in the pipeline); its counts per split
are stored in `metadata.json`. The input fingerprint (JSONL bytes, kind, policy) is
stored too: an existing dataset is reused when it matches and otherwise rebuilt only
with `overwrite=True` (and then said, whatever the log level), so stale data are never
read by accident. The valid records of a
split are held in memory while the shard is written, fine for RLHF-sized text sets.

A dataset's fields follow its records (`records.jsonl_fields`, the same for every
split): the prompt as "prompt" text or as "messages" (a conversation, stored as its JSON
text and rendered by the tokenizer's chat template in the pipeline), and for prompts an
"answer" when the records carry reference answers.

`make_task_datasets` generates the embedded reverse task (data/task.py) and builds its
three datasets in one call; `make_arith_datasets` does the same for the arith task
(data/arith.py), which has prompts and demonstrations only.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import re
import shutil
from typing import Any, Mapping

import numpy as np

from pipe_rlhf_jax.checks import check_int
from pipe_rlhf_jax.data import arith as arith_lib
from pipe_rlhf_jax.data import task as task_lib
from pipe_rlhf_jax.data import word_problems as word_problems_lib
from pipe_rlhf_jax.data.digests import update_with_file
from pipe_rlhf_jax.data.records import FIELDS_BY_KIND, RecordValidator, jsonl_fields

_log = logging.getLogger(__name__)

VERSION = "1.0.0"
# Bump when the record layout or validation semantics change, to invalidate old builds.
_FORMAT = "pipe_rlhf_jax.data.builders/2"
_NAME_RE = re.compile(r"^[a-z][a-z0-9_]*$")


@dataclasses.dataclass(frozen=True)
class BuiltDataset:
  """A prepared TFDS dataset and what validation did to it.

  Attributes:
    name: TFDS name, for `tfds.data_source(name, data_dir=data_dir, split=...)`.
    kind: "prompts", "demos" or "prefs".
    data_dir: TFDS data directory holding `name/`.
    path: the versioned dataset directory.
    splits: split -> number of examples.
    stats: split -> validator counts at build time.
    fingerprint: hash of the inputs and policy the dataset was built from.
    fields: the text fields of its examples (besides "index").
  """

  name: str
  kind: str
  data_dir: str
  path: str
  splits: dict[str, int]
  stats: dict[str, dict[str, int]]
  fingerprint: str
  fields: tuple[str, ...] = ()

  def source(self, split: str = "train"):
    """The random-access TFDS data source of `split`."""
    return load_source(self.name, self.data_dir, split)


def load_source(name: str, data_dir: str, split: str):
  """`tfds.data_source` of a built dataset; examples are dicts of bytes and int64."""
  import tensorflow_datasets as tfds

  return tfds.data_source(name, data_dir=data_dir, split=split)


def _features(fields):
  import tensorflow_datasets as tfds

  spec = {"index": tfds.features.Scalar(dtype=np.int64)}
  for field in fields:
    spec[field] = tfds.features.Text()
  return tfds.features.FeaturesDict(spec)


def _builder_class(name: str, kind: str, fields):
  """A GeneratorBasedBuilder subclass writing pre-validated records of one dataset."""
  import tensorflow_datasets as tfds

  class _LocalDatasetInfo(tfds.core.DatasetInfo):
    """DatasetInfo of a dataset that exists only locally.

    Before a dataset's first build TFDS calls `initialize_from_bucket`, which makes a
    `tempfile.mkdtemp("tfds")` folder for metadata published on the TFDS GCS bucket and
    never deletes it: one `tmp*tfds` folder in the system temp dir per build (dozens
    per test run). Our datasets are never published there, so there is nothing to fetch.
    """

    def initialize_from_bucket(self) -> None:
      pass

  class _JsonlBuilder(tfds.core.GeneratorBasedBuilder, skip_registration=True):
    VERSION = tfds.core.Version(VERSION)
    # The base class derives a checksums path from the defining package; for a class
    # inside a regular package that path lookup imports the optional
    # `importlib_resources` backport (absent here). There is nothing to download, so
    # there are no checksums: no code path.
    code_path = None

    # TFDS prints "Downloading and preparing dataset Unknown size ..." and "... downloaded
    # and prepared" around every build, to let a user cancel a long download. Nothing is
    # downloaded here; the run announces the datasets it rebuilds itself.
    def _log_download_bytes(self) -> None:
      pass

    def _log_download_done(self) -> None:
      pass

    def __init__(self, *, records: dict[str, list], metadata: dict[str, Any], **kwargs):
      # Set before the base constructor, which already calls `_info`.
      self._records = records
      self._metadata = metadata
      super().__init__(**kwargs)

    def _info(self):
      return _LocalDatasetInfo(
          builder=self,
          description=f"RLHF {kind} records from JSONL (pipe_rlhf_jax.data.builders).",
          features=_features(fields),
          metadata=tfds.core.MetadataDict(self._metadata),
          # File order is kept, so example i of a split is its i-th valid line.
          disable_shuffling=True,
      )

    def _split_generators(self, dl_manager):
      del dl_manager  # Nothing to download: the records are already in memory.
      return {split: self._generate_examples(split) for split in self._records}

    def _generate_examples(self, split):
      for line_index, fields in self._records[split]:
        yield line_index, {"index": line_index, **fields}

  _JsonlBuilder.name = name
  _JsonlBuilder.__name__ = f"JsonlBuilder_{name}"
  return _JsonlBuilder


def _fingerprint(kind: str, paths: Mapping[str, str], validator: RecordValidator) -> str:
  h = hashlib.sha256()
  h.update(json.dumps({"format": _FORMAT, "kind": kind, "policy": validator.policy()},
                      sort_keys=True).encode())
  for split in sorted(paths):
    h.update(split.encode() + b"\0")
    update_with_file(h, paths[split])
    h.update(b"\0")
  return h.hexdigest()


def _existing(path: str) -> dict[str, Any] | None:
  meta = os.path.join(path, "metadata.json")
  if not os.path.isfile(os.path.join(path, "dataset_info.json")) or not os.path.isfile(meta):
    return None
  with open(meta, encoding="utf-8") as f:
    return json.load(f)


def _built(name, kind, data_dir, path) -> BuiltDataset:
  meta = _existing(path) or {}
  return BuiltDataset(
      name=name, kind=kind, data_dir=data_dir, path=path,
      splits={s: int(n) for s, n in meta.get("num_examples", {}).items()},
      stats={s: dict(c) for s, c in meta.get("stats", {}).items()},
      fingerprint=meta.get("fingerprint", ""),
      fields=tuple(meta.get("fields", FIELDS_BY_KIND[kind])),
  )


def build_dataset(
    kind: str,
    jsonl_path: str | Mapping[str, str],
    data_dir: str,
    *,
    name: str | None = None,
    on_invalid: str = "skip",
    overwrite: bool = False,
) -> BuiltDataset:
  """Validates JSONL records and writes them as an array_record TFDS dataset.

  Args:
    kind: "prompts" (field prompt, optionally answer), "demos" (prompt, completion) or
      "prefs" (prompt, chosen, rejected); the prompt as "prompt" text or as "messages".
    jsonl_path: one JSONL file (becomes split "train") or a mapping split -> file.
    data_dir: TFDS data directory.
    name: TFDS dataset name (snake_case); defaults to "rlhf_<kind>".
    on_invalid: "skip" (count and drop malformed records) or "error" (raise).
    overwrite: rebuild when a dataset of this name exists but was built from other
      inputs; without it that case raises.

  Returns:
    A `BuiltDataset` describing the (new or reused) dataset.

  Raises:
    ValueError: bad arguments, a split with no valid records, a stale existing dataset
      without `overwrite`, or a malformed record under on_invalid="error".
  """
  import tensorflow_datasets as tfds

  if kind not in FIELDS_BY_KIND:
    raise ValueError(f"Unknown dataset kind {kind!r}; choose one of {sorted(FIELDS_BY_KIND)}.")
  name = name or f"rlhf_{kind}"
  if not _NAME_RE.match(name):
    raise ValueError(f"Dataset name {name!r} must be snake_case ([a-z][a-z0-9_]*).")
  if name in tfds.list_builders(with_community_datasets=False):
    raise ValueError(f"Dataset name {name!r} is a registered TFDS dataset; choose another name.")
  paths = {"train": jsonl_path} if isinstance(jsonl_path, (str, os.PathLike)) else dict(jsonl_path)
  if not paths:
    raise ValueError("jsonl_path must name at least one file.")
  for split, p in paths.items():
    if not os.path.isfile(p):
      raise FileNotFoundError(f"JSONL file for split {split!r} not found: {p}")
  data_dir = os.fspath(data_dir)
  path = os.path.join(data_dir, name, VERSION)

  validator = RecordValidator.for_kind(kind, on_invalid=on_invalid)
  fingerprint = _fingerprint(kind, paths, validator)
  existing = _existing(path)
  if existing is not None:
    if existing.get("fingerprint") == fingerprint:
      return _built(name, kind, data_dir, path)
    if not overwrite:
      raise ValueError(
          f"Dataset {path} exists but was built from different inputs or policy; pass "
          "overwrite=True to rebuild it, or use another name/data_dir."
      )
    # Visible whatever the log level: the run now reads other records than before.
    from pipe_rlhf_jax.metrics import say
    say(f"dataset {name}: its inputs changed since it was built "
        f"({', '.join(os.path.abspath(p) for p in paths.values())}); rebuilding {path}")
  if os.path.isdir(path):
    shutil.rmtree(path)

  records: dict[str, list] = {}
  stats: dict[str, dict[str, int]] = {}
  # One set of fields for every split (TFDS has one feature spec per dataset).
  fields = jsonl_fields(kind, [os.fspath(p) for p in paths.values()])
  for split, p in paths.items():
    split_validator = RecordValidator(fields, on_invalid=on_invalid)
    records[split] = list(split_validator.read_jsonl(os.fspath(p)))
    stats[split] = dict(split_validator.stats)
    if not records[split]:
      raise ValueError(f"No valid {kind} records in {p} ({split_validator.summary()}).")
    if any(k.startswith("skipped/") for k in split_validator.stats):
      _log.warning("Dataset %s split %s: %s", name, split, split_validator.summary())

  metadata = {
      "fingerprint": fingerprint,
      "kind": kind,
      "sources": {s: os.path.abspath(p) for s, p in paths.items()},
      "stats": stats,
      "num_examples": {s: len(r) for s, r in records.items()},
      "fields": list(fields),
  }
  builder = _builder_class(name, kind, fields)(
      records=records, metadata=metadata, data_dir=data_dir, file_format="array_record"
  )
  builder.download_and_prepare(download_dir=os.path.join(data_dir, "downloads"))
  return _built(name, kind, data_dir, path)


def _generated_datasets(data_dir: str, prefix: str, config: dict[str, Any],
                        files: dict[str, str], write,
                        splits: dict[str, dict[str, str]]) -> dict[str, Any]:
  """Writes a generated task's JSONL (when absent or different) and builds its datasets.

  Args:
    data_dir: TFDS data directory; the JSONL goes to `<data_dir>/<prefix>_jsonl/`.
    prefix: dataset names are "<prefix>_<kind>".
    config: the generator's arguments, compared with the `task_config.json` the last
      write left; any difference regenerates the files.
    files: role -> file name the generator writes.
    write: `write(jsonl_dir) -> {role: path}`, the generator.
    splits: kind -> {split: role}, the datasets to build.

  Returns:
    {"data_dir": str, "jsonl": {role: path}, <kind>: BuiltDataset for each kind}.
  """
  data_dir = os.fspath(data_dir)
  jsonl_dir = os.path.join(data_dir, f"{prefix}_jsonl")
  config_path = os.path.join(jsonl_dir, "task_config.json")
  paths = {role: os.path.join(jsonl_dir, f) for role, f in files.items()}
  current = None
  if os.path.isfile(config_path):
    with open(config_path, encoding="utf-8") as f:
      current = json.load(f)
  if current != config or not all(os.path.isfile(p) for p in paths.values()):
    paths = write(jsonl_dir)
  out: dict[str, Any] = {"data_dir": data_dir, "jsonl": paths}
  for kind, roles in splits.items():
    # Datasets built from older files are derived data: rebuilt, never refused.
    out[kind] = build_dataset(kind, {split: paths[role] for split, role in roles.items()},
                              data_dir, name=f"{prefix}_{kind}", overwrite=True)
  return out


def make_task_datasets(
    data_dir: str,
    seed: int = 0,
    *,
    num_prompts: int = 4096,
    num_demos: int = 4096,
    num_pairs: int = 4096,
    num_eval: int = 256,
    alphabet: str = task_lib.DEFAULT_ALPHABET,
    min_len: int = 3,
    max_len: int = 6,
    demo_noise: float = 0.3,
    length_noise: float = 0.2,
    hard_pairs: float = 0.0,
    prefix: str = "reverse",
) -> dict[str, Any]:
  """Generates the reverse task (when absent or different) and builds its TFDS datasets.

  The JSONL files go to `<data_dir>/<prefix>_jsonl/`. They are regenerated when their
  `task_config.json` differs from the arguments, and datasets built from older files are
  rebuilt (they are derived data).

  Args:
    data_dir: TFDS data directory (also holds the JSONL).
    seed / num_* / alphabet / min_len / max_len / demo_noise / length_noise / hard_pairs:
      see `task.make_task_records`.
    prefix: dataset names are "<prefix>_prompts", "<prefix>_demos", "<prefix>_prefs".

  Returns:
    {"data_dir": str, "jsonl": {role: path},
     "prompts": BuiltDataset (splits "train", "eval"),
     "demos": BuiltDataset (split "train"),
     "prefs": BuiltDataset (splits "train", "eval")}.
  """
  check_int(num_eval, "num_eval", hint=" The eval splits need records.")
  config = task_lib.task_settings(num_prompts, num_demos, num_pairs, seed, alphabet, min_len,
                                  max_len, demo_noise, num_eval=num_eval,
                                  length_noise=length_noise, hard_pairs=hard_pairs)
  write = lambda out_dir: task_lib.write_task_jsonl(
      out_dir, num_prompts, num_demos, num_pairs, seed, alphabet, min_len, max_len,
      demo_noise, num_eval=num_eval, length_noise=length_noise, hard_pairs=hard_pairs)
  return _generated_datasets(
      data_dir, prefix, config, task_lib.TASK_FILES, write,
      {"prompts": {"train": "prompts", "eval": "prompts_eval"}, "demos": {"train": "demos"},
       "prefs": {"train": "prefs", "eval": "prefs_eval"}})


def make_arith_datasets(
    data_dir: str,
    seed: int = 0,
    *,
    spec: arith_lib.ArithSettings = arith_lib.ArithSettings(),
    num_prompts: int = 4096,
    num_demos: int = 4096,
    num_eval: int = 256,
    prefix: str = "arith",
) -> dict[str, Any]:
  """Generates the arith task (when absent or different) and builds its TFDS datasets.

  As `make_task_datasets`, without preference pairs: the arith task is scored by a rule
  (`arith_exact_match`), so no reward model is trained.

  Args:
    data_dir: TFDS data directory (also holds the JSONL, under `<prefix>_jsonl/`).
    seed / spec / num_*: see `arith.make_arith_records`.
    prefix: dataset names are "<prefix>_prompts", "<prefix>_demos".

  Returns:
    {"data_dir": str, "jsonl": {role: path},
     "prompts": BuiltDataset (splits "train", "eval"),
     "demos": BuiltDataset (split "train")}.
  """
  check_int(num_eval, "num_eval", hint=" The eval split needs records.")
  config = arith_lib.arith_task_config(num_prompts, num_demos, seed, spec, num_eval)
  write = lambda out_dir: arith_lib.write_arith_jsonl(
      out_dir, num_prompts, num_demos, seed, spec, num_eval=num_eval)
  return _generated_datasets(
      data_dir, prefix, config, arith_lib.ARITH_FILES, write,
      {"prompts": {"train": "prompts", "eval": "prompts_eval"}, "demos": {"train": "demos"}})


def make_word_problem_datasets(
    data_dir: str,
    seed: int = 0,
    *,
    spec: word_problems_lib.WordProblemSettings = word_problems_lib.WordProblemSettings(),
    num_prompts: int = 4096,
    num_demos: int = 256,
    num_eval: int = 128,
    prefix: str = "word_problems",
) -> dict[str, Any]:
  """Generates the chat word problems (when absent or different) and builds their datasets.

  As `make_arith_datasets`: prompts carry reference answers and are scored by a rule
  (`math_verify`), so no preference pairs are generated.

  Args:
    data_dir: TFDS data directory (also holds the JSONL, under `<prefix>_jsonl/`).
    seed / spec / num_*: see `word_problems.make_word_problem_records`.
    prefix: dataset names are "<prefix>_prompts", "<prefix>_demos".

  Returns:
    {"data_dir": str, "jsonl": {role: path},
     "prompts": BuiltDataset (splits "train", "eval"),
     "demos": BuiltDataset (split "train")}.
  """
  check_int(num_eval, "num_eval", hint=" The eval split needs records.")
  config = word_problems_lib.word_problem_task_config(num_prompts, num_demos, seed, spec,
                                                      num_eval)
  write = lambda out_dir: word_problems_lib.write_word_problem_jsonl(
      out_dir, num_prompts, num_demos, seed, spec, num_eval=num_eval)
  return _generated_datasets(
      data_dir, prefix, config, word_problems_lib.WORD_PROBLEM_FILES, write,
      {"prompts": {"train": "prompts", "eval": "prompts_eval"}, "demos": {"train": "demos"}})
