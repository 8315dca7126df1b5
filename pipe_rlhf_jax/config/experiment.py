"""The experiment's settings, typed: each config section checked and converted once.

Owns `ExperimentSettings.from_config(config)`, the one conversion of an experiment config
(an `ml_collections.ConfigDict`, `configs/*.py`) into frozen dataclasses, before anything
is built or compiled: the model, data, sft, reward_model, reward, warm_start, checkpoint
and log sections here; the algorithm (`PPOSettings`) in `config.algorithm` and the
hand-written plan (`Plan`, from the plan, mesh and stages sections) in `config.plan`; how the
plan is chosen (`PlanChoice`: plan.choose, hardware, calibration, ...) here.

- Every default is a dataclass field's default, stated once; a field without one must be
  in the config ("Config field data.prompt_len is missing; add it").
- A key a section does not know is refused, naming the nearest known one
  (`checks.check_known`): a typo in a config file fails here instead of leaving the
  default silently in force.
- Each check names the field, the value it got and what is allowed, so a typo on the
  command line (`--config.ppo.kl_estimator=k4`) fails in a second with a readable message
  instead of deep inside a jitted function. Numbers go through `checks.check_int` /
  `check_number` (NaN and inf refused), as in `config.algorithm` and `config.plan`.
  Checks of one field live in its section's `from_config`; checks across sections (the
  data task against the rewards, the batch against the micro-batches) in
  `ExperimentSettings.from_config`. Checks that need the devices (mesh sizes,
  divisibility of parameters over mesh axes) happen when the stage layouts are built.

`to_dict()` is the canonical form of the settings: what the resume fingerprint hashes
(`checkpoint.config_fingerprint` leaves out the plan and the bookkeeping sections).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping

from pipe_rlhf_jax.checks import (
  check_choice,
  check_fraction,
  check_int,
  check_known,
  check_number,
)
from pipe_rlhf_jax.config.algorithm import PPOSettings
from pipe_rlhf_jax.config.plan import Plan
from pipe_rlhf_jax.config.retired import check_renamed_keys

# Registers the built-in rule rewards: the names are checked against REWARD_FUNCTIONS,
# which is empty in a process that has not imported them yet. (Importing the registry
# module runs the ppo package, which registers the KL estimators and losses.)
from pipe_rlhf_jax.data import rewards as _builtin_rewards  # noqa: F401
from pipe_rlhf_jax.data.arith import ArithSettings
from pipe_rlhf_jax.data.digests import JSONL_ROLES
from pipe_rlhf_jax.data.word_problems import WordProblemSettings
from pipe_rlhf_jax.envs import EnvSettings
from pipe_rlhf_jax.generation.sampler import SamplingSettings
from pipe_rlhf_jax.models import hf_config, load, lora
from pipe_rlhf_jax.models.checkpoint_files import is_model_path
from pipe_rlhf_jax.models.config import TransformerConfig, tiny_config
from pipe_rlhf_jax.ppo.registry import REWARD_FUNCTIONS, rule_answers

REQUIRED_SECTIONS = ("model", "data", "sft", "reward_model", "reward", "ppo", "plan",
                     "mesh", "stages", "checkpoint", "log")
TOP_LEVEL = REQUIRED_SECTIONS + ("seed", "name", "workdir", "warm_start", "lora", "env")
# `reward.fn` of an experiment whose episodes' environment gives the reward (`env`).
ENVIRONMENT_REWARD = "environment"


def _missing(path: str) -> ValueError:
  return ValueError(f"Config field {path} is missing; add it (see configs/quickstart.py).")


def _get(config, path: str) -> Any:
  """The field `path` ("data.prompt_len") of `config`; ValueError naming it when absent."""
  node = config
  for part in path.split("."):
    if part not in node:
      raise _missing(path)
    node = node[part]
  return node


def _fields(cls, section: Mapping[str, Any], path: str) -> dict[str, Any]:
  """The values of `cls`'s fields in the config section `section` (named `path`).

  Keys `cls` does not know are refused; a field without a default must be there; a field
  left out takes its default.
  """
  check_known(section.keys(), [f.name for f in dataclasses.fields(cls)], path)
  values = {}
  for f in dataclasses.fields(cls):
    if f.name in section:
      values[f.name] = section[f.name]
    elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
      raise _missing(f"{path}.{f.name}")
  return values


@dataclasses.dataclass(frozen=True)
class ModelSettings:
  """`model`: the embedded tiny model's size, or a local Hugging Face directory.

  Attributes:
    path: a local Hugging Face model directory (config.json, *.safetensors, tokenizer);
      empty: the embedded tiny model of the sizes below.
    tokenizer: the tokenizer without `path` ("byte", or a tokenizer.json / directory).
    dtype / param_dtype: compute and parameter dtypes ("float32", "bfloat16").
    num_layers .. mlp_dim: the embedded model's size.
    require_path: the config is for a local model only: `path` must be set.
  """

  path: str
  tokenizer: str
  dtype: str
  param_dtype: str
  num_layers: int
  embed_dim: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  mlp_dim: int
  require_path: bool = False

  @classmethod
  def from_config(cls, section, path: str = "model") -> "ModelSettings":
    values = _fields(cls, section, path)
    for name in ("num_layers", "embed_dim", "num_heads", "num_kv_heads", "head_dim",
                 "mlp_dim"):
      check_int(values[name], f"{path}.{name}")
    for name in ("dtype", "param_dtype"):
      check_choice(values[name], f"{path}.{name}", ("float32", "bfloat16"))
    settings = cls(**values)
    if settings.require_path and not settings.path:
      raise ValueError("model.path is required by this config: pass "
                       "--config.model.path=/path/to/a/local/huggingface/model/dir.")
    if settings.path and not is_model_path(settings.path):
      raise ValueError(f"model.path={settings.path!r} is neither a GGUF file nor a "
                       "directory with a config.json; give a local Hugging Face model "
                       "directory (config.json, *.safetensors, tokenizer.json) or a .gguf "
                       "file.")
    if settings.num_heads % settings.num_kv_heads:
      raise ValueError(f"model.num_heads={settings.num_heads} must be a multiple of "
                       f"model.num_kv_heads={settings.num_kv_heads}.")
    return settings

  def role_configs(self, tokenizer) -> dict[str, TransformerConfig]:
    """The `TransformerConfig`s of the run's three roles (actor, critic, reward).

    The actor is the embedded tiny model sized to `tokenizer` (its vocabulary padded to
    a multiple of 8, so that it splits evenly over tensor axes of 2, 4 and 8, and its
    special ids), or the local checkpoint's config (its `config.json` or a GGUF file's
    metadata); the critic and the reward model share its body and differ in the head.
    The main job, the planner's calibration and `plan` all size their models here, so a
    plan is priced for the model the run builds.
    """
    if self.path:
      base = hf_config.config_from_hf(load.read_hf_config(self.path), dtype=self.dtype,
                               param_dtype=self.param_dtype).replace(head="lm")
    else:
      base = tiny_config(vocab_size=-(-tokenizer.vocab_size // 8) * 8,
                         embed_dim=self.embed_dim, num_layers=self.num_layers,
                         num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                         head_dim=self.head_dim, mlp_dim=self.mlp_dim, dtype=self.dtype,
                         param_dtype=self.param_dtype, eos_token_id=tokenizer.eos_id,
                         bos_token_id=tokenizer.bos_id, pad_token_id=tokenizer.pad_id)
    return {"actor": base, "critic": base.replace(head="value"),
            "reward": base.replace(head="score")}


@dataclasses.dataclass(frozen=True)
class JsonlFiles:
  """`data.jsonl`: the user's own files of `data.task='jsonl'` (one JSON object a line).

  prompts / prompts_eval: {"prompt" | "messages", optional "answer"}; demos: {"prompt",
  "completion"}; prefs / prefs_eval: {"prompt", "chosen", "rejected"} (read only when a
  reward model is trained).
  """

  prompts: str = ""
  prompts_eval: str = ""
  demos: str = ""
  prefs: str = ""
  prefs_eval: str = ""

  @classmethod
  def from_config(cls, section, path: str = "data.jsonl") -> "JsonlFiles":
    return cls(**_fields(cls, section, path))

  def __getitem__(self, role: str) -> str:
    return getattr(self, role)


@dataclasses.dataclass(frozen=True)
class DataSettings:
  """`data`: which task's records, how long, and what to do with bad ones.

  Attributes:
    task: "reverse" / "arith" / "word_problems" (embedded, generated under `dir`) or
      "jsonl" (`jsonl`).
    dir: where the datasets are built (empty: <workdir>/data).
    prompt_len / completion_len: tokens of a prompt (left-padded) and a completion.
    num_prompts / num_demos / num_pairs: records of the embedded tasks.
    num_eval: held-out problems (and pairs) of the embedded tasks.
    hard_pairs: share of the reverse task's preference pairs that differ by one
      neighbour-copy error (0: none); other tasks ignore it.
    on_invalid: "skip" or "error" on a malformed record; on_overlong: "truncate", "skip"
      or "error" on one longer than its budget.
    arith: the arith task's problems (`data.task='arith'` only; None otherwise).
    word_problems: the chat word problems (`data.task='word_problems'` only; None
      otherwise).
    jsonl: the user's files (`data.task='jsonl'`).
  """

  task: str
  dir: str
  prompt_len: int
  completion_len: int
  num_prompts: int
  num_demos: int
  num_pairs: int
  on_invalid: str
  on_overlong: str
  num_eval: int = 256
  hard_pairs: float = 0.0
  arith: ArithSettings | None = None
  word_problems: WordProblemSettings | None = None
  jsonl: JsonlFiles = JsonlFiles()

  @classmethod
  def from_config(cls, section, path: str = "data") -> "DataSettings":
    values = _fields(cls, section, path)
    check_choice(values["task"], f"{path}.task", ("reverse", "arith", "word_problems", "jsonl"))
    for name in ("prompt_len", "completion_len"):
      check_int(values[name], f"{path}.{name}")
    check_int(values.get("num_eval", cls.num_eval), f"{path}.num_eval", low=1)
    check_number(values.get("hard_pairs", cls.hard_pairs), f"{path}.hard_pairs",
                 allow_zero=True, at_most=1.0, what="a probability",
                 hint=" It is the share of reverse-task preference pairs that differ by one "
                      "neighbour-copy error.")
    check_choice(values["on_invalid"], f"{path}.on_invalid", ("skip", "error"))
    check_choice(values["on_overlong"], f"{path}.on_overlong", ("truncate", "skip", "error"))
    values["jsonl"] = JsonlFiles.from_config(values.get("jsonl") or {}, f"{path}.jsonl")
    # Other tasks ignore the arith section (a user switching the arith config to another
    # task must not have to delete it).
    arith = values.pop("arith", None)
    if values["task"] == "arith":
      if arith is None:
        raise ValueError("data.task='arith' needs a data.arith section (operators, "
                         "min_digits, max_digits, demo_noise); see configs/grpo_arith.py.")
      values["arith"] = ArithSettings.from_config(arith, f"{path}.arith")
      if values.get("num_eval", cls.num_eval) > values["arith"].num_problems() // 2:
        raise ValueError(
            f"data.num_eval={values['num_eval']} held-out problems is more than half of "
            f"the {values['arith'].num_problems()} that data.arith allows; lower "
            "data.num_eval or allow more digits/operators.")
    words = values.pop("word_problems", None)
    if values["task"] == "word_problems":
      values["word_problems"] = WordProblemSettings.from_config(words or {},
                                                            f"{path}.word_problems")
      if values.get("num_eval", cls.num_eval) > values["word_problems"].num_problems() // 2:
        raise ValueError(
            f"data.num_eval={values['num_eval']} held-out problems is more than half of "
            f"the {values['word_problems'].num_problems()} that data.word_problems allows; "
            "lower data.num_eval or raise max_operand.")
    return cls(**values)


def _training_fields(cls, section, path: str) -> dict[str, Any]:
  """`_fields` of a warm-start phase's section, its steps (>= 0), batch size and learning
  rate checked."""
  values = _fields(cls, section, path)
  check_int(values["steps"], f"{path}.steps", low=0)
  check_int(values["batch_size"], f"{path}.batch_size")
  check_number(values["learning_rate"], f"{path}.learning_rate")
  return values


@dataclasses.dataclass(frozen=True)
class SFTSettings:
  """`sft`: supervised fine-tuning on the demonstrations (0 steps: none)."""

  steps: int
  batch_size: int
  learning_rate: float
  warmup_steps: int

  @classmethod
  def from_config(cls, section, path: str = "sft") -> "SFTSettings":
    return cls(**_training_fields(cls, section, path))


@dataclasses.dataclass(frozen=True)
class RewardModelSettings:
  """`reward_model`: the Bradley-Terry reward model (trained only with reward.fn='model').

  Attributes:
    steps / batch_size / learning_rate / warmup_steps / eval_batches: its training.
    init: "base" (from the base model) or "sft" (from the SFT policy's backbone).
    policy_pairs: share of each batch made of the SFT policy's own samples, the best and
      the worst of `policy_samples` per prompt by `label_fn` (0: dataset pairs only).
    policy_samples: samples per prompt ranked for a policy pair.
    label_fn: the rule that ranks them (empty: reward.eval_fn).
  """

  steps: int
  batch_size: int
  learning_rate: float
  warmup_steps: int
  eval_batches: int
  init: str = "base"
  policy_pairs: float = 0.0
  policy_samples: int = 4
  label_fn: str = ""

  @classmethod
  def from_config(cls, section, path: str = "reward_model") -> "RewardModelSettings":
    values = _training_fields(cls, section, path)
    check_choice(values.get("init", cls.init), f"{path}.init", ("base", "sft"))
    check_number(values.get("policy_pairs", cls.policy_pairs), f"{path}.policy_pairs",
                 allow_zero=True, at_most=1.0, what="a fraction",
                 hint=" It is the share of each reward-model batch made of the SFT "
                      "policy's samples.")
    return cls(**values)


@dataclasses.dataclass(frozen=True)
class RewardSettings:
  """`reward`: what PPO optimises and what is reported beside it.

  Attributes:
    fn: "model" (the trained reward model), a registered rule (`ppo.registry`), or
      "environment" (multi-turn episodes: the environment of `env.name` gives it).
    eval_fn: a registered rule logged alongside, never optimised (empty: none).
    normalize_samples_per_prompt: > 0 standardises the reward model's score by its mean
      and std over this many answers per prompt of the warm-start policy (0: raw).
  """

  fn: str
  eval_fn: str
  normalize_samples_per_prompt: int = 0

  @classmethod
  def from_config(cls, section, path: str = "reward") -> "RewardSettings":
    values = _fields(cls, section, path)
    check_int(values.get("normalize_samples_per_prompt", 0),
              f"{path}.normalize_samples_per_prompt", low=0)
    check_choice(values["fn"], f"{path}.fn",
                 ["model", ENVIRONMENT_REWARD] + REWARD_FUNCTIONS.names())
    if values["eval_fn"]:
      check_choice(values["eval_fn"], f"{path}.eval_fn", REWARD_FUNCTIONS.names())
    return cls(**values)

  @property
  def uses_model(self) -> bool:
    """Whether the run trains a reward model (`fn == "model"`) or scores by a rule.

    With a rule there are no preference pipelines, no reward-model phase and no reward
    model in the PPO system.
    """
    return self.fn == "model"

  @property
  def uses_environment(self) -> bool:
    """Whether the episodes' environment gives the reward (`fn == "environment"`)."""
    return self.fn == ENVIRONMENT_REWARD


@dataclasses.dataclass(frozen=True)
class WarmStartSettings:
  """`warm_start`: where SFT and the reward model train, and a warm start to restore.

  Attributes:
    mesh: the warm-start phases' mesh axes ({"data": -1}: data parallel over every device),
      the same whatever the mode, so all modes of a seed start PPO alike.
    checkpoint: another run's <workdir>/warmstart, restored instead of training the warm
      start here (empty: train it, unless this workdir has its own).
  """

  mesh: Mapping[str, int] = dataclasses.field(default_factory=lambda: {"data": -1})
  checkpoint: str = ""

  @classmethod
  def from_config(cls, section, path: str = "warm_start") -> "WarmStartSettings":
    values = _fields(cls, section or {}, path)
    if "mesh" in values:
      mesh = values["mesh"]
      values["mesh"] = dict(mesh.to_dict() if hasattr(mesh, "to_dict") else mesh)
    settings = cls(**values)
    if settings.checkpoint and not os.path.isdir(settings.checkpoint):
      raise ValueError(f"warm_start.checkpoint={settings.checkpoint!r} is not a directory; "
                       "give the warmstart/ directory of an earlier run of this seed and "
                       "config, or ''.")
    return settings


@dataclasses.dataclass(frozen=True)
class LoRASettings:
  """`lora`: train LoRA adapters in PPO instead of every parameter (`models/lora.py`).

  The actor and the critic get adapters on `targets` as PPO starts (after the warm
  start, which trains whole models); the reference policy is then the actor's base with
  the adapters off (no copy of its own), the optimizer states hold the adapters only (and
  the critic's value head), weight sync moves the adapters only, and a PPO checkpoint
  holds those (the base is the warm start's, whose fingerprint the run's covers). The
  run's export writes the merged model and the adapters alone in peft's layout.

  Attributes:
    rank: 0 (no adapters: every parameter trains) or the adapters' rank.
    alpha: the adapters' outputs are scaled by alpha / rank (peft's `lora_alpha`).
    targets: comma-separated projections (q_proj, k_proj, v_proj, o_proj, gate_proj,
      up_proj, down_proj) or groups ("attention", "mlp", "all").
  """

  rank: int = 0
  alpha: float = 16.0
  targets: str = "all"

  @classmethod
  def from_config(cls, section, path: str = "lora") -> "LoRASettings":
    values = _fields(cls, section or {}, path)
    check_int(values.get("rank", 0), f"{path}.rank", low=0)
    settings = cls(**values)
    settings.apply(tiny_config())  # checks alpha and the targets, naming the field
    return settings

  def apply(self, config: TransformerConfig) -> TransformerConfig:
    """`config` with these adapters (unchanged at rank 0)."""
    if not self.rank:
      return config
    return config.replace(lora_rank=self.rank, lora_alpha=float(self.alpha),
                          lora_targets=lora.parse_targets(self.targets))


@dataclasses.dataclass(frozen=True)
class CheckpointSettings:
  """`checkpoint`: a PPO checkpoint every `every` steps (and at the end), `keep` kept."""

  every: int
  keep: int

  @classmethod
  def from_config(cls, section, path: str = "checkpoint") -> "CheckpointSettings":
    values = _fields(cls, section, path)
    for name in ("every", "keep"):
      check_int(values[name], f"{path}.{name}")
    return cls(**values)


@dataclasses.dataclass(frozen=True)
class LogSettings:
  """`log`: what a run writes besides its checkpoints.

  Attributes:
    every: a metrics row every `every` PPO steps (and the last).
    samples: held-out completions shown before and after PPO.
    tensorboard / wandb / wandb_project: the metrics' other sinks.
    eval_prompts: held-out prompts answered and scored by the rules before and after PPO
      (0: none).
    eval_samples_per_prompt: sampled answers per held-out prompt besides the greedy one
      (0: greedy only).
  """

  every: int
  samples: int
  tensorboard: bool
  wandb: bool
  wandb_project: str
  eval_prompts: int = 0
  eval_samples_per_prompt: int = 0

  @classmethod
  def from_config(cls, section, path: str = "log") -> "LogSettings":
    values = _fields(cls, section, path)
    check_int(values["every"], f"{path}.every")
    for name in ("eval_prompts", "eval_samples_per_prompt"):
      check_int(values.get(name, 0), f"{path}.{name}", low=0)
    return cls(**values)


@dataclasses.dataclass(frozen=True)
class PolicySamplingSettings:
  """How PPO samples its completions (the `ppo` section's temperature, top_k, top_p).

  `sampling_params` makes the generator's `SamplingSettings` once the tokenizer (EOS, pad)
  is known.
  """

  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0

  FIELDS = ("temperature", "top_k", "top_p")

  @classmethod
  def from_config(cls, ppo, path: str = "ppo") -> "PolicySamplingSettings":
    temperature, top_k, top_p = (ppo.get(name, getattr(cls, name)) for name in cls.FIELDS)
    settings = cls(temperature=check_number(temperature, f"{path}.temperature",
                                            allow_zero=True),
                   top_k=check_int(top_k, f"{path}.top_k", low=0),
                   top_p=check_number(top_p, f"{path}.top_p", at_most=1.0))
    if settings.temperature == 0:
      raise ValueError("ppo.temperature=0 (greedy) gives PPO no exploration; use a "
                       "value > 0.")
    return settings

  def sampling_params(self, max_new_tokens: int, tokenizer) -> SamplingSettings:
    """Completions of `max_new_tokens` tokens ending at the tokenizer's EOS."""
    return SamplingSettings(max_new_tokens=max_new_tokens, temperature=self.temperature,
                          top_k=self.top_k, top_p=self.top_p, eos_id=tokenizer.eos_id,
                          pad_id=tokenizer.pad_id)


@dataclasses.dataclass(frozen=True)
class PlanChoice:
  """The plan section's fields that say how the plan is chosen and on what it runs
  (the plan itself is `Plan`).

  Attributes:
    choose: "manual" (the hand-written plan, checked by the planner) or "auto" (the
      planner chooses).
    hardware: the planner's hardware profile (empty: detected from the devices).
    calibration: a `planner.calibrate` file (empty: the profile's assumed efficiencies).
    response_fraction: mean response length / data.completion_len the planner prices
      generation with (1: every row runs to the end).
    num_devices: use the first N of jax.devices() (0: all).
  """

  choose: str = "manual"
  hardware: str = ""
  calibration: str = ""
  response_fraction: float = 1.0
  num_devices: int = 0

  FIELDS = ("choose", "hardware", "calibration", "response_fraction", "num_devices")

  @classmethod
  def from_config(cls, section, path: str = "plan") -> "PlanChoice":
    values = {k: section[k] for k in cls.FIELDS if k in section}
    check_int(values.get("num_devices", 0), f"{path}.num_devices", low=0)
    check_fraction(values.get("response_fraction", 1.0), f"{path}.response_fraction")
    check_choice(values.get("choose", cls.choose), f"{path}.choose", ("auto", "manual"))
    return cls(**values)


# The sections of one settings class each (the others: ppo, plan, mesh, stages).
SECTION_TYPES = {"model": ModelSettings, "data": DataSettings, "sft": SFTSettings,
                 "reward_model": RewardModelSettings, "reward": RewardSettings,
                 "warm_start": WarmStartSettings, "lora": LoRASettings, "env": EnvSettings,
                 "checkpoint": CheckpointSettings, "log": LogSettings}
# The plan section's keys `Plan.from_config` reads.
_PLAN_FIELDS = ("mode", "max_staleness", "partial_rollouts", "past_staleness", "queue_size",
                "shutdown_timeout_s", "progress_timeout_s", "placement")
# Built-in rule rewards that only apply to one embedded task, by name prefix.
TASK_RULE_PREFIXES = {"reverse": "reverse_", "arith": "arith_"}
# Tasks whose prompt records carry a reference answer (for rules that take `answers`).
TASKS_WITH_ANSWERS = ("word_problems", "jsonl")


@dataclasses.dataclass(frozen=True)
class ExperimentSettings:
  """Every section of an experiment config, checked and typed (`from_config`).

  Attributes:
    name / seed / workdir: the run's name, seed and directory (empty: runs/<name>-<time>).
    model, data, sft, reward_model, reward, warm_start, lora, env, checkpoint, log: the
      sections.
    ppo: the algorithm, seeded by `seed` (`PPOSettings`).
    sampling: how PPO samples (`ppo.temperature`, `top_k`, `top_p`).
    critic_init: where the critic's backbone starts, "reward_model" or "sft"
      (`ppo.critic_init`).
    plan: the hand-written plan (`Plan`: plan, mesh and stages sections).
    choice: how the plan is chosen and on how many devices it runs (`PlanChoice`).
  """

  name: str
  seed: int
  workdir: str
  model: ModelSettings
  data: DataSettings
  sft: SFTSettings
  reward_model: RewardModelSettings
  reward: RewardSettings
  warm_start: WarmStartSettings
  lora: LoRASettings
  env: EnvSettings
  checkpoint: CheckpointSettings
  log: LogSettings
  ppo: PPOSettings
  sampling: PolicySamplingSettings
  critic_init: str
  plan: Plan
  choice: PlanChoice

  @classmethod
  def from_config(cls, config) -> "ExperimentSettings":
    """The settings of `config`; raises ValueError naming the first bad field.

    The algorithm (`ppo`) and the plan (`plan`, `mesh`, `stages`) are checked by
    their typed settings (`config.algorithm`, `config.plan`), which the library's own
    users construct directly: one set of checks for both ways in.
    """
    check_renamed_keys(config)
    for section in REQUIRED_SECTIONS:
      _get(config, section)
    check_known(config.keys(), TOP_LEVEL, "the config", "sections")
    check_known(config.plan.keys(), _PLAN_FIELDS + PlanChoice.FIELDS, "plan")
    check_known(config.stages.keys(), ("generate", "infer", "train"), "stages")
    seed = config.get("seed", 0)
    for f in dataclasses.fields(PPOSettings):
      if f.default is dataclasses.MISSING:
        _get(config, f"ppo.{f.name}")
    ppo = PPOSettings.from_config(config.ppo, seed=seed)
    plan = Plan.from_config(config)
    settings = cls(
        name=config.get("name", "run"), seed=seed, workdir=config.get("workdir", ""),
        model=ModelSettings.from_config(config.model),
        data=DataSettings.from_config(config.data),
        sft=SFTSettings.from_config(config.sft),
        reward_model=RewardModelSettings.from_config(config.reward_model),
        reward=RewardSettings.from_config(config.reward),
        warm_start=WarmStartSettings.from_config(config.get("warm_start")),
        lora=LoRASettings.from_config(config.get("lora")),
        env=EnvSettings.from_config(config.get("env")),
        checkpoint=CheckpointSettings.from_config(config.checkpoint),
        log=LogSettings.from_config(config.log), ppo=ppo,
        sampling=PolicySamplingSettings.from_config(config.ppo),
        critic_init=check_choice(_get(config, "ppo.critic_init"), "ppo.critic_init",
                            ("reward_model", "sft")),
        plan=plan, choice=PlanChoice.from_config(config.plan))
    settings._check_env()
    settings._check_task()
    num_mb = plan.generate.num_microbatches
    if ppo.batch_size % num_mb:
      raise ValueError(f"ppo.batch_size={ppo.batch_size} is not divisible by "
                       f"stages.generate.num_microbatches={num_mb}; choose a divisor.")
    return settings

  @property
  def uses_demos(self) -> bool:
    """Whether the run reads demonstrations: SFT trains on them, PPO-ptx mixes them in."""
    return self.sft.steps > 0 or self.ppo.ptx_coef > 0

  def data_files(self, roles: tuple[str, ...] = JSONL_ROLES) -> dict[str, str]:
    """{"data.jsonl.<role>": path} of the user's files among `roles` that the run reads
    (what `data.digests.file_digests` hashes).

    Empty unless `data.task == 'jsonl'`; the preference files count only when a reward
    model is trained (`reward.fn == 'model'`), the demonstrations only when SFT or
    PPO-ptx reads them (`uses_demos`).
    """
    if self.data.task != "jsonl":
      return {}
    return {f"data.jsonl.{role}": self.data.jsonl[role] for role in roles
            if (self.reward.uses_model or not role.startswith("prefs"))
            and (self.uses_demos or role != "demos")}

  def _check_task(self) -> None:
    """The data source, and that the rewards and critic fit it.

    A rule reward trains no reward model, so preference data are needed only with
    `reward.fn="model"`, and a critic (when the estimator has one) cannot start from a
    reward model then. A built-in rule of one task on another task's prompts would raise
    at the first PPO step: refused here instead.
    """
    task, use_rm = self.data.task, self.reward.uses_model
    if task == "jsonl":
      roles = (("prompts", "prompts_eval") + (("demos",) if self.uses_demos else ())
               + (("prefs", "prefs_eval") if use_rm else ()))
      for role in roles:
        path = self.data.jsonl[role]
        if not path or not os.path.isfile(path):
          why = ("the prefs train the reward model" if use_rm
                 else "no prefs: reward.fn is a rule")
          why += ("; the demos feed SFT or ppo.ptx_coef" if self.uses_demos
                  else "; no demos: sft.steps=0 and ppo.ptx_coef=0")
          raise ValueError(f"data.jsonl.{role}={path!r} is not a file; data.task='jsonl' "
                           f"needs all of data.jsonl.{{{','.join(roles)}}} ({why}).")
    self._check_policy_pairs()
    if task == "arith" and use_rm:
      raise ValueError("data.task='arith' has no preference pairs to train a reward model "
                       "on: set reward.fn to a rule, e.g. --config.reward.fn=arith_exact_match.")
    for path, name in (("reward.fn", self.reward.fn), ("reward.eval_fn", self.reward.eval_fn)):
      for other, prefix in TASK_RULE_PREFIXES.items():
        if name.startswith(prefix) and other != task:
          raise ValueError(
              f"{path}={name!r} scores the embedded {other} task only, but "
              f"data.task={task!r}; choose a rule for your data (or set "
              "--config.reward.eval_fn='').")
      if (task not in TASKS_WITH_ANSWERS and name in REWARD_FUNCTIONS
          and rule_answers(REWARD_FUNCTIONS.get(name)) == "required"):
        raise ValueError(
            f"{path}={name!r} checks each completion against its prompt's reference "
            f"answer, but the prompts of data.task={task!r} carry none: use "
            "data.task='jsonl' with prompt records that have an 'answer' field.")
    if not use_rm and self.ppo.needs_critic and self.critic_init == "reward_model":
      raise ValueError(f"ppo.critic_init='reward_model' but reward.fn={self.reward.fn!r} "
                       "is not 'model': no reward model is trained to start the critic "
                       "from; set --config.ppo.critic_init=sft.")

  def _check_env(self) -> None:
    """Episodes (`env`) against the reward and the plan."""
    env, reward = self.env, self.reward
    if env.enabled != reward.uses_environment:
      raise ValueError(
          f"env.name={env.name!r} with reward.fn={reward.fn!r}: the reward of episodes is "
          f"their environment's. Set both (env.name to a registered environment and "
          f"reward.fn={ENVIRONMENT_REWARD!r}) or neither.")
    if not env.enabled:
      return
    if reward.eval_fn:
      raise ValueError(f"reward.eval_fn={reward.eval_fn!r} with env.name={env.name!r}: a "
                       "rule scores one completion, an episode is several turns and "
                       "messages; set --config.reward.eval_fn='' (the environment's reward "
                       "is reported as reward/mean and on the held-out prompts).")
    if self.plan.partial_rollouts:
      raise ValueError("plan.partial_rollouts=True with env.name set: an episode's turns "
                       "are sampled one engine call each, so unfinished rows are not kept "
                       "across updates; set plan.partial_rollouts=False.")
    if self.reward_model.policy_pairs:
      raise ValueError("reward_model.policy_pairs needs a reward model; with env.name set "
                       "the environment gives the reward: set policy_pairs=0.")

  def _check_policy_pairs(self) -> None:
    """reward_model.policy_pairs / policy_samples / label_fn (phases.policy_pairs)."""
    if not self.reward_model.policy_pairs or not self.reward.uses_model:
      return
    k = self.reward_model.policy_samples
    if not (isinstance(k, int) and k >= 2):
      raise ValueError(f"reward_model.policy_samples={k!r}: a pair is the best and the "
                       "worst of at least 2 samples per prompt; set an int >= 2.")
    self.policy_pairs_label()

  def policy_pairs_label(self):
    """The registered rule that ranks the policy's samples for `reward_model.policy_pairs`
    (`reward_model.label_fn`, empty: `reward.eval_fn`); errors name the field it came
    from."""
    own = self.reward_model.label_fn
    label = own or self.reward.eval_fn
    if not label:
      raise ValueError("reward_model.policy_pairs needs a rule to rank the samples: set "
                       "reward_model.label_fn (or reward.eval_fn) to a registered reward "
                       "function, or policy_pairs=0.")
    return REWARD_FUNCTIONS.get(label, field="reward_model.label_fn" if own
                                else "reward.eval_fn (ranking reward_model.policy_pairs)")

  def section_dict(self, name: str) -> dict[str, Any]:
    """One section's settings as plain data (`to_dict`'s entry)."""
    return _as_data(getattr(self, name))

  def to_dict(self) -> dict[str, Any]:
    """The settings as plain, JSON-able data: the config's sections with every default
    filled in (the plan as `plan`; `lora` only with adapters, `env` only with an
    environment); what the fingerprints hash."""
    out = {"name": self.name, "seed": self.seed, "workdir": self.workdir}
    for name in ("model", "data", "sft", "reward_model", "reward", "warm_start", "lora",
                 "env", "checkpoint", "log", "ppo"):
      out[name] = self.section_dict(name)
    # No adapters, no environment: the sections change nothing, and left out they keep
    # the fingerprint of checkpoints written before the sections existed.
    if not self.lora.rank:
      del out["lora"]
    if not self.env.enabled:
      del out["env"]
    # The ppo section: the algorithm, its sampling and where the critic starts.
    out["ppo"].pop("seed", None)  # the top-level seed
    out["ppo"].update(self.section_dict("sampling"), critic_init=self.critic_init)
    out["plan"] = {**_as_data(self.plan), **_as_data(self.choice)}
    return out


def _as_data(value: Any) -> Any:
  """Nested dataclasses, mappings and tuples as plain dicts and lists."""
  if dataclasses.is_dataclass(value):
    return {f.name: _as_data(getattr(value, f.name)) for f in dataclasses.fields(value)}
  if isinstance(value, Mapping):
    return {k: _as_data(v) for k, v in value.items()}
  if isinstance(value, (tuple, list)):
    return [_as_data(v) for v in value]
  return value
