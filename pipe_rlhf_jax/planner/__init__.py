"""The planner: choose each stage's strategy and predict what a PPO step costs.

Modules (one concern each):
  space       the hierarchical plan space (schedule -> placement -> per-stage mesh, M,
              remat) of valid `Plan`s, validated by the system's own checks on
              abstract meshes; conversion to / from config overrides.
  hardware    hardware profiles (TPU v4/v5e/v5p/v6e, A100, H100, H200, this cpu) with
              the source of every number.
  memory      bytes per device of each stage; plans that do not fit are rejected with the
              reason.
  cost        seconds per stage (FLOPs and bytes over peaks x efficiencies, the delayed
              schedule's tick count, alpha-beta collectives counted per weight array).
  composition a plan's cost from its stages': weight sync and batches moved between
              stage layouts, exclusive stages and shared-host demands, the closed form.
  calibrate   times real pieces on this backend and fits the efficiencies
              (`python -m pipe_rlhf_jax.planner.calibrate --out FILE`).
  simulator   discrete-event simulation of the three modes (queues, staleness gate, weight
              sync, shared hosts) into a `Tracer` (predicted Gantt).
  search      exhaustive branch and bound (small device counts) or per-stage Pareto sets
              over placements (large), ranked by the simulator.
  presets     published model shapes (models/shapes.py) for projections.
  lengths     the response-length (EOS) model: passes the early-exiting decoders run.
  auto        the planner inside the main job: `plan.choose = "auto"` (the best plan
              for the devices it sees) and the check of a hand-written plan before
              anything compiles; measured steady seconds per step from a run's trace.

Planning a run:
  python -m pipe_rlhf_jax.planner.calibrate --out calibration.json
  python -m pipe_rlhf_jax.plan --config=configs/quickstart.py --hardware=cpu --devices=8 \
      --calibration=calibration.json
  python -m pipe_rlhf_jax.main --config=configs/quickstart.py $(cat best_plan.flags)
  python -m pipe_rlhf_jax.main --config=configs/quickstart.py --config.plan.choose=auto \
      --config.plan.calibration=calibration.json
Projections for absent hardware: `--hardware=h100 --devices=64 --model=llama2-7b` (the
efficiencies are then the stated defaults of `cost.Efficiency` unless a calibration file
from that hardware is given); `experiments/project_paper_scale.py` tabulates them for
LLaMA-2 7B-70B on H100 nodes and TPU v5p slices.
"""
