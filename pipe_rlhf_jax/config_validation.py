"""Validation of an experiment config, once, before anything is built or compiled.

Each check names the field, the value it got, and what is allowed, so a typo on the
command line (`--config.ppo.kl_estimator=k4`) fails in a second with a readable message
instead of deep inside a jitted function. Numbers go through the same checks as the
typed settings (`checks.check_int`, `checks.check_number`: NaN and inf are refused), so
a field fails alike from a config or from `PPOConfig`. Checks that need the devices
(mesh sizes, divisibility of parameters over mesh axes) happen when the stage layouts
are built.
"""

from __future__ import annotations

import os
from typing import Any

from pipe_rlhf_jax.checks import check_fraction, check_int, check_known, check_number

# Registers the built-in rule rewards: the names are checked against REWARD_FUNCTIONS,
# which is empty in a process that has not imported them yet. (Importing the registry
# module runs the ppo package, which registers the KL estimators and losses.)
from pipe_rlhf_jax.data import rewards as _builtin_rewards  # noqa: F401
from pipe_rlhf_jax.ppo.registry import REWARD_FUNCTIONS, rule_answers

REQUIRED_SECTIONS = ("model", "data", "sft", "reward_model", "reward", "ppo", "runtime",
                     "mesh", "stages", "checkpoint", "log")

# The keys each section accepts: a key outside them is refused, naming the nearest known
# one (`checks.check_known`), so a typo in a config file fails here instead of leaving
# the default silently in force. `ppo`, `mesh` and `stages.*` are checked by their typed
# settings' constructors (`system.settings`), `data.arith` by `ArithSpec`.
TOP_LEVEL = REQUIRED_SECTIONS + ("seed", "name", "workdir", "warm_start")
SECTION_FIELDS = {
    "model": ("path", "require_path", "tokenizer", "dtype", "param_dtype", "num_layers",
              "embed_dim", "num_heads", "num_kv_heads", "head_dim", "mlp_dim"),
    "data": ("task", "dir", "prompt_len", "completion_len", "num_prompts", "num_demos",
             "num_pairs", "num_eval", "hard_pairs", "on_invalid", "on_overlong", "arith",
             "jsonl"),
    "sft": ("steps", "batch_size", "learning_rate", "warmup_steps"),
    "reward_model": ("steps", "batch_size", "learning_rate", "warmup_steps", "eval_batches",
                     "init", "policy_pairs", "policy_samples", "label_fn"),
    "reward": ("fn", "eval_fn", "normalize_samples_per_prompt"),
    "runtime": ("mode", "max_staleness", "queue_size", "shutdown_timeout_s",
                "progress_timeout_s", "placement", "num_devices", "plan", "hardware",
                "calibration", "response_fraction"),
    "stages": ("generate", "infer", "train"),
    "checkpoint": ("every", "keep"),
    "log": ("every", "samples", "tensorboard", "wandb", "wandb_project", "eval_prompts",
            "eval_samples_per_prompt"),
    "warm_start": ("mesh", "checkpoint"),
}

# The fields a config may leave out (configs written before the field existed, or a user's
# own), and the value a run then uses: the one place these defaults are stated. Read them
# with `optional(config, path)`.
OPTIONAL_FIELDS = {
    "data.num_eval": 256,  # held-out problems of the embedded tasks
    "data.hard_pairs": 0.0,  # no neighbour-copy preference pairs
    "log.eval_prompts": 0,  # no held-out evaluation
    "log.eval_samples_per_prompt": 0,  # greedy held-out answers only
    "reward.normalize_samples_per_prompt": 0,  # raw reward-model scores
    "reward_model.init": "base",
    "reward_model.policy_pairs": 0.0,  # no pairs of the SFT policy's samples
    "reward_model.policy_samples": 4,
    "reward_model.label_fn": "",  # reward.eval_fn ranks the policy's samples
    "runtime.plan": "manual",  # the hand-written plan
    "runtime.hardware": "",  # detected from the devices
    "runtime.calibration": "",  # the profile's analytic efficiencies
    "runtime.num_devices": 0,  # every device
    "runtime.response_fraction": 1.0,  # price full-length responses
}


def optional(config, path: str) -> Any:
  """The field `path` of `config`, or its `OPTIONAL_FIELDS` default when left out."""
  if path not in OPTIONAL_FIELDS:
    raise KeyError(f"{path} is not an optional config field; read it from the config.")
  node = config
  *sections, name = path.split(".")
  for part in sections:
    node = node[part]
  return node[name] if name in node else OPTIONAL_FIELDS[path]


def _get(config, path: str) -> Any:
  node = config
  for part in path.split("."):
    if part not in node:
      raise ValueError(f"Config field {path} is missing; add it (see configs/quickstart.py).")
    node = node[part]
  return node


def _positive_int(config, path: str, allow_zero: bool = False) -> int:
  return check_int(_get(config, path), path, low=0 if allow_zero else 1)


def _positive_float(config, path: str, allow_zero: bool = False,
                    at_most: float | None = None) -> float:
  return check_number(_get(config, path), path, allow_zero=allow_zero, at_most=at_most)


def _choice(config, path: str, choices) -> str:
  value = _get(config, path)
  if value not in choices:
    raise ValueError(f"{path}={value!r}; choose one of {sorted(choices)}.")
  return value


# Built-in rule rewards that only apply to one embedded task, by name prefix.
TASK_RULE_PREFIXES = {"reverse": "reverse_", "arith": "arith_"}


def _check_task(config) -> None:
  """The data source, and that the rewards and critic fit it.

  A rule reward trains no reward model, so preference data are needed only with
  `reward.fn="model"`, and a critic (when the estimator has one) cannot start from a
  reward model then. A built-in rule of one task on another task's prompts would raise
  at the first PPO step: refused here instead.
  """
  task = _choice(config, "data.task", ("reverse", "arith", "jsonl"))
  use_rm = config.reward.fn == "model"
  if task == "jsonl":
    roles = ("prompts", "prompts_eval", "demos") + (("prefs", "prefs_eval") if use_rm else ())
    for role in roles:
      path = config.data.jsonl.get(role, "")
      if not path or not os.path.isfile(path):
        why = ("the prefs train the reward model" if use_rm
               else "no prefs: reward.fn is a rule")
        raise ValueError(f"data.jsonl.{role}={path!r} is not a file; data.task='jsonl' needs "
                         f"all of data.jsonl.{{{','.join(roles)}}} ({why}).")
  init = optional(config, "reward_model.init")
  if init not in ("base", "sft"):
    raise ValueError(f"reward_model.init={init!r}; choose one of ['base', 'sft'].")
  check_number(optional(config, "data.hard_pairs"), "data.hard_pairs", allow_zero=True,
               at_most=1.0, what="a probability",
               hint=" It is the share of reverse-task preference pairs that differ by one "
                    "neighbour-copy error.")
  _check_policy_pairs(config, use_rm)
  # Other tasks ignore it (the quickstart sets it, and a user switching the quickstart to
  # data.task='jsonl' must not have to unset a knob of data they no longer generate).
  if task == "arith":
    if "arith" not in config.data:
      raise ValueError("data.task='arith' needs a data.arith section (operators, min_digits, "
                       "max_digits, demo_noise); see configs/grpo_arith.py.")
    from pipe_rlhf_jax.data.arith import ArithSpec
    spec = ArithSpec.from_config(config.data.arith, "data.arith")
    num_eval = optional(config, "data.num_eval")
    if num_eval > spec.num_problems() // 2:
      raise ValueError(f"data.num_eval={num_eval} held-out problems is more than half of the "
                       f"{spec.num_problems()} that data.arith allows; lower data.num_eval "
                       "or allow more digits/operators.")
    if use_rm:
      raise ValueError("data.task='arith' has no preference pairs to train a reward model "
                       "on: set reward.fn to a rule, e.g. --config.reward.fn=arith_exact_match.")
  for path in ("reward.fn", "reward.eval_fn"):
    name = _get(config, path)
    for other, prefix in TASK_RULE_PREFIXES.items():
      if name.startswith(prefix) and other != task:
        raise ValueError(
            f"{path}={name!r} scores the embedded {other} task only, but data.task={task!r};"
            f" choose a rule for your data (or set --config.reward.eval_fn='').")
    if (task != "jsonl" and name in REWARD_FUNCTIONS
        and rule_answers(REWARD_FUNCTIONS.get(name)) == "required"):
      raise ValueError(
          f"{path}={name!r} checks each completion against its prompt's reference answer, "
          f"but the prompts of data.task={task!r} carry none: use data.task='jsonl' with "
          "prompt records that have an 'answer' field.")
  from pipe_rlhf_jax.system.settings import PPOConfig
  needs_critic = PPOConfig.from_config(config.ppo).needs_critic
  if not use_rm and needs_critic and config.ppo.critic_init == "reward_model":
    raise ValueError(f"ppo.critic_init='reward_model' but reward.fn={config.reward.fn!r} is a "
                     "rule: no reward model is trained to start the critic from; set "
                     "--config.ppo.critic_init=sft.")


def validate_config(config) -> None:
  """Raises ValueError naming the first bad field of `config`.

  The PPO algorithm (`ppo`) and the plan (`runtime`, `mesh`, `stages`) are checked by
  converting them to their typed settings (`system.settings`), which the library's own
  users construct directly: one set of checks for both ways in.
  """
  from pipe_rlhf_jax.system.settings import PPOConfig, RuntimeConfig
  for section in REQUIRED_SECTIONS:
    _get(config, section)
  check_known(config.keys(), TOP_LEVEL, "the config", "sections")
  for section, known in SECTION_FIELDS.items():
    if section in config and config[section] is not None:
      check_known(config[section].keys(), known, section)
  PPOConfig.from_config(config.ppo, seed=config.get("seed", 0))
  runtime = RuntimeConfig.from_config(config)
  for path in ("sft.steps", "reward_model.steps"):
    _positive_int(config, path, allow_zero=True)
  for path in ("sft.batch_size", "reward_model.batch_size", "data.prompt_len",
               "data.completion_len", "checkpoint.every", "checkpoint.keep", "log.every",
               "model.num_layers", "model.embed_dim", "model.num_heads",
               "model.num_kv_heads", "model.head_dim", "model.mlp_dim"):
    _positive_int(config, path)
  for path in ("sft.learning_rate", "reward_model.learning_rate"):
    _positive_float(config, path)
  _positive_float(config, "ppo.temperature", allow_zero=True)
  _positive_float(config, "ppo.top_p", at_most=1.0)
  _positive_int(config, "ppo.top_k", allow_zero=True)
  check_int(optional(config, "data.num_eval"), "data.num_eval", low=1)
  for path in ("log.eval_prompts", "log.eval_samples_per_prompt",
               "reward.normalize_samples_per_prompt", "runtime.num_devices"):
    check_int(optional(config, path), path, low=0)
  check_fraction(optional(config, "runtime.response_fraction"), "runtime.response_fraction")
  plan = optional(config, "runtime.plan")
  if plan not in ("manual", "auto"):
    raise ValueError(f"runtime.plan={plan!r}; choose one of ['auto', 'manual'].")
  shared = (config.get("warm_start") or {}).get("checkpoint", "")
  if shared and not os.path.isdir(shared):
    raise ValueError(f"warm_start.checkpoint={shared!r} is not a directory; give the "
                     "warmstart/ directory of an earlier run of this seed and config, or ''.")
  _choice(config, "ppo.critic_init", ("reward_model", "sft"))
  _choice(config, "data.on_invalid", ("skip", "error"))
  _choice(config, "data.on_overlong", ("truncate", "skip", "error"))
  _choice(config, "model.dtype", ("float32", "bfloat16"))
  _choice(config, "model.param_dtype", ("float32", "bfloat16"))
  _choice(config, "reward.fn", ["model"] + REWARD_FUNCTIONS.names())
  if config.reward.eval_fn:
    _choice(config, "reward.eval_fn", REWARD_FUNCTIONS.names())
  _check_task(config)
  if config.model.get("require_path") and not config.model.path:
    raise ValueError("model.path is required by this config: pass "
                     "--config.model.path=/path/to/a/local/huggingface/model/dir.")
  if config.model.path and not os.path.isfile(os.path.join(config.model.path, "config.json")):
    raise ValueError(f"model.path={config.model.path!r} has no config.json; give a local "
                     "Hugging Face model directory (config.json, *.safetensors, tokenizer.json).")
  if config.ppo.temperature == 0:
    raise ValueError("ppo.temperature=0 (greedy) gives PPO no exploration; use a value > 0.")
  ppo = config.ppo
  num_mb = runtime.generate.num_microbatches
  if ppo.batch_size % num_mb:
    raise ValueError(f"ppo.batch_size={ppo.batch_size} is not divisible by "
                     f"stages.generate.num_microbatches={num_mb}; choose a divisor.")
  if config.model.num_heads % config.model.num_kv_heads:
    raise ValueError(f"model.num_heads={config.model.num_heads} must be a multiple of "
                     f"model.num_kv_heads={config.model.num_kv_heads}.")


def _check_policy_pairs(config, use_rm: bool) -> None:
  """reward_model.policy_pairs / policy_samples / label_fn (phases.policy_pairs)."""
  share = check_number(optional(config, "reward_model.policy_pairs"),
                       "reward_model.policy_pairs", allow_zero=True, at_most=1.0, what="a fraction",
                       hint=" It is the share of each reward-model batch made of the SFT "
                            "policy's samples.")
  if not share or not use_rm:
    return
  k = optional(config, "reward_model.policy_samples")
  if not (isinstance(k, int) and k >= 2):
    raise ValueError(f"reward_model.policy_samples={k!r}: a pair is the best and the worst "
                     "of at least 2 samples per prompt; set an int >= 2.")
  policy_pairs_label(config)


def policy_pairs_label(config):
  """The registered rule that ranks the policy's samples for `reward_model.policy_pairs`
  (`reward_model.label_fn`, empty: `reward.eval_fn`); errors name the field it came from."""
  own = optional(config, "reward_model.label_fn")
  label = own or config.reward.eval_fn
  if not label:
    raise ValueError("reward_model.policy_pairs needs a rule to rank the samples: set "
                     "reward_model.label_fn (or reward.eval_fn) to a registered reward "
                     "function, or policy_pairs=0.")
  return REWARD_FUNCTIONS.get(label, field="reward_model.label_fn" if own
                              else "reward.eval_fn (ranking reward_model.policy_pairs)")
