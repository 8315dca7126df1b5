"""Command line of the planner: rank the plans of an experiment on a (maybe absent) machine.

  python -m pipe_rlhf_jax.plan --config=configs/quickstart.py --hardware=cpu --devices=8
  python -m pipe_rlhf_jax.plan --config=configs/quickstart.py --hardware=h100 --devices=64 \
      --model=llama2-7b --gen_len=512 --prompt_len=512 --batch_size=512
  (--calibration=FILE: efficiencies fitted by `python -m pipe_rlhf_jax.planner.calibrate`;
   --response_fraction=0.4 or --lengths_from=runs/X/metrics.jsonl: rows stop at EOS after
   that mean fraction of gen_len (given, or measured in a run; `planner.lengths`);
   --show_rejected: the plans over the memory limit, with the reason.)

Prints a ranked table (plan, predicted seconds per step, per-stage seconds, memory per
device, bottleneck) and writes the best plan as config overrides to --out (one
`--config.KEY=VALUE` per line; also a JSON dict next to it). Projections for hardware that
is not here are labelled so, with the calibration they rest on.
"""

import os
import sys

from absl import app, flags
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file(
    "config", "configs/quickstart.py", "Experiment config (a get_config() module).",
    lock_config=True)
_HARDWARE = flags.DEFINE_string("hardware", "cpu", "Hardware profile (planner/hardware.py).")
_DEVICES = flags.DEFINE_integer("devices", 8, "Devices to plan for.")
_DEVICES_PER_HOST = flags.DEFINE_integer("devices_per_host", 0,
                                         "Devices per host (0: the profile's).")
_MODEL = flags.DEFINE_string("model", "", "Model size preset, a name in models/shapes.py "
                             "(llama2-7b, qwen3-0.6b, ...); empty: the config's model.")
_BATCH = flags.DEFINE_integer("batch_size", 0, "Rollouts per step (0: config ppo.batch_size).")
_MINIBATCH = flags.DEFINE_integer("minibatch_size", 0, "0: config ppo.minibatch_size.")
_PROMPT = flags.DEFINE_integer("prompt_len", 0, "0: config data.prompt_len.")
_GEN = flags.DEFINE_integer("gen_len", 0, "0: config data.completion_len.")
_CALIBRATION = flags.DEFINE_string("calibration", "", "Calibration JSON (planner.calibrate).")
_RESPONSE = flags.DEFINE_float("response_fraction", 0.0,
                               "Mean response length / gen_len (early EOS); 0: the "
                               "config's plan.response_fraction.")
_LENGTHS_FROM = flags.DEFINE_string("lengths_from", "",
                                    "A run's metrics.jsonl: its mean response_length/mean "
                                    "sets response_fraction (measured in a run).")
_TOP = flags.DEFINE_integer("top", 10, "Plans shown.")
_SHOW_REJECTED = flags.DEFINE_bool("show_rejected", False, "Also list rejected plans.")
_METHOD = flags.DEFINE_enum("method", "auto", ["auto", "exhaustive", "pareto"], "Search.")
_OUT = flags.DEFINE_string("out", "best_plan.flags", "Where the best plan's overrides go.")
_GANTT = flags.DEFINE_string("gantt", "", "Also draw the best plan's predicted Gantt here.")


def workload_from_flags(config):
  """The hardware profile and the workload: the config's, with the flags' overrides."""
  import dataclasses

  from pipe_rlhf_jax.config import ExperimentSettings
  from pipe_rlhf_jax.planner import auto, hardware, lengths, presets
  settings = ExperimentSettings.from_config(config)
  hw = hardware.get(_HARDWARE.value)
  if _MODEL.value:
    actor = presets.model(_MODEL.value)
  else:
    from pipe_rlhf_jax.models.load import load_tokenizer
    actor = settings.model.role_configs(load_tokenizer(settings.model.tokenizer))["actor"]
  work = auto.workload(settings, actor, _DEVICES.value,
                       _DEVICES_PER_HOST.value or hw.devices_per_host)
  work = dataclasses.replace(
      work, batch_size=_BATCH.value or work.batch_size,
      minibatch_size=_MINIBATCH.value or work.minibatch_size,
      prompt_len=_PROMPT.value or work.prompt_len, gen_len=_GEN.value or work.gen_len)
  if _LENGTHS_FROM.value:
    fraction = lengths.fraction_from_metrics(_LENGTHS_FROM.value, work.gen_len)
  else:
    fraction = _RESPONSE.value or work.response_fraction
  return hw, dataclasses.replace(work, response_fraction=fraction)


def _name(plan) -> str:
  """The plan's one-line form plus what it omits (the training stage's remat)."""
  return f"{plan}" + (f" remat={plan.train.remat}" if plan.train.remat != "none" else "")


def _gib(x: float) -> str:
  return f"{x / 2 ** 30:.2f}"


def main(argv):
  del argv
  from pipe_rlhf_jax.planner import cost, search, space
  config = _CONFIG.value
  hw, work = workload_from_flags(config)
  eff = cost.Efficiency.load(_CALIBRATION.value) if _CALIBRATION.value else cost.Efficiency()
  machine = cost.Machine(hw, eff)
  best, rejected, stats = search.search(work, machine, k=_TOP.value, method=_METHOD.value)
  a = work.actor
  print(f"model: {a.num_params() / 1e9:.3g}B params ({a.num_layers} layers, embed "
        f"{a.embed_dim}, {a.dtype}); batch {work.batch_size} x (prompt {work.prompt_len} + "
        f"gen {work.gen_len}, mean response {work.response_fraction:.2f} of it), "
        f"minibatch {work.minibatch_size}, epochs {work.epochs}")
  print(f"hardware: {hw.name} x {work.num_devices} ({work.devices_per_host} per host); "
        f"efficiencies: {eff.source}")
  if not (hw.name == "cpu" and _CALIBRATION.value):
    print("PROJECTION: predicted from the analytic model and the efficiencies above, "
          "not measured.")
  print(f"search: {stats['method']}, {stats['seconds']:.1f} s")
  header = (f"{'#':>2}  {'s/step':>9}  {'gen':>8}  {'infer':>8}  {'train':>8}  "
            f"{'sync':>7}  {'GiB/dev':>7}  {'bottleneck':>10}  plan")
  print(header)
  for rank, c in enumerate(best, 1):
    pc = c.cost
    print(f"{rank:>2}  {c.step_time:9.4g}  {pc.stage('generate'):8.3g}  "
          f"{pc.stage('infer'):8.3g}  {pc.stage('train'):8.3g}  {pc.sync:7.2g}  "
          f"{_gib(max(c.memory.values())):>7}  {c.bottleneck:>10}  {_name(c.plan)}")
  if _SHOW_REJECTED.value:
    print(f"\nrejected ({len(rejected)}):")
    for c in rejected[:max(_TOP.value, 20)]:
      print(f"  {_name(c.plan)}: {c.rejected}")
  if not best:
    print("no plan fits; see --show_rejected.")
    return 1
  top = best[0]
  flags_text = "\n".join(space.override_flags(top.plan, config)) + "\n"
  with open(_OUT.value, "w") as f:
    f.write(flags_text)
  import json
  with open(os.path.splitext(_OUT.value)[0] + ".json", "w") as f:
    json.dump({"plan": str(top.plan), "predicted_step_s": top.step_time,
               "overrides": space.to_overrides(top.plan, config)}, f, indent=1)
  print(f"\nbest plan -> {_OUT.value}:\n  " + " ".join(space.override_flags(top.plan, config)))
  if _GANTT.value:
    sim = search.simulate_plan(top.plan, top.cost, machine, steps=8)
    print("predicted Gantt ->", sim.tracer.gantt(_GANTT.value, title=f"predicted: {top.plan}"))
  return 0


def run() -> None:
  """The installed command (`pip install -e .`), the same as `python -m pipe_rlhf_jax.plan`."""
  import __main__
  if not getattr(__main__, "__doc__", None):
    __main__.__doc__ = __doc__  # absl's --help prints the main module's docstring
  sys.exit(app.run(main))


if __name__ == "__main__":
  sys.exit(app.run(main))
