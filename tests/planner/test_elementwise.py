"""The cost model's non-matmul term: its units, switching it off, the fit across model
sizes, and the held-out split of that fit."""


import pytest

from pipe_rlhf_jax.config import StagePlan
from pipe_rlhf_jax.models import flops
from pipe_rlhf_jax.models.config import tiny_config
from pipe_rlhf_jax.planner import calibrate, cost, hardware, space

WORK = space.Workload(actor=tiny_config(), batch_size=8, minibatch_size=8, epochs=1,
                      prompt_len=16, gen_len=8, num_devices=1, reward_model=False)
MESH1 = dict(data=1, fsdp=1, tensor=1, pipeline=1)


def machine(**eff) -> cost.Machine:
  return cost.Machine(hardware.get("cpu"), cost.Efficiency(hbm_bw=10e9, **eff))


def test_one_pass_is_activation_bytes_over_the_bandwidth():
  # Inference: each model's forward over [B, Lp + T], head at the T completion positions.
  terms = cost.stage_terms("infer", StagePlan(), MESH1, WORK, machine())
  elements = sum(flops.forward_elements(c, 8, 24, head_positions=8)
                 for c in WORK.models("infer"))
  assert terms.elementwise == pytest.approx(elements * 4 / 10e9)  # f32: 4 bytes each
  # Seconds scale as bytes / bandwidth: twice the bandwidth, half the seconds.
  fast = cost.Machine(hardware.get("cpu"), cost.Efficiency(hbm_bw=20e9))
  assert cost.stage_terms("infer", StagePlan(), MESH1, WORK, fast).elementwise == (
      pytest.approx(terms.elementwise / 2))
  # Elements per layer per token grow with the width, the heads' context and the MLP.
  cfg = tiny_config()
  assert flops.layer_elements(cfg, 10) - flops.layer_elements(cfg, 0) == 10 * cfg.num_heads


@pytest.mark.parametrize("stage", ["generate", "infer", "train"])
def test_the_term_prices_passes_and_costs_nothing_switched_off(stage):
  off = machine(**{n: 0.0 for n in cost.ELEMENTWISE.values()})
  on = machine(**{cost.ELEMENTWISE[stage]: 3.0})
  base = cost.stage_cost(stage, StagePlan(), MESH1, WORK, off)
  terms = cost.stage_terms(stage, StagePlan(), MESH1, WORK, off)
  assert terms.elementwise > 0
  # Off: exactly the analytic model without it.
  assert base.compute == pytest.approx(
      getattr(off.eff, cost.STAGE_CONSTANTS[stage][0]) * terms.roofline
      + terms.memory, rel=1e-12)
  priced_on = cost.stage_cost(stage, StagePlan(), MESH1, WORK, on)
  assert priced_on.total - base.total == pytest.approx(3.0 * terms.elementwise)
  assert priced_on.comm == base.comm and priced_on.overhead == base.overhead


def test_the_fit_recovers_known_passes():
  truth = {"generate": 40.0, "infer": 7.5, "train": 0.0}
  samples = []
  for i, shape in enumerate(("a", "b", "c", "d")):
    for stage, passes in truth.items():
      predicted, elementwise = 0.1 * (i + 1), 0.01 * (i + 2) ** 2
      samples.append({"shape": shape, "stage": stage, "predicted": predicted,
                      "elementwise": elementwise,
                      "seconds": predicted + passes * elementwise})
  fitted = calibrate.fit_elementwise(samples)
  for stage, passes in truth.items():
    assert fitted[cost.ELEMENTWISE[stage]] == pytest.approx(passes, abs=1e-9)
  # A model slower than predicted by less than nothing gives no negative passes.
  fast = [dict(s, seconds=0.5 * s["predicted"]) for s in samples]
  assert all(v == 0.0 for v in calibrate.fit_elementwise(fast).values())


def test_the_held_out_size_never_enters_the_fit():
  samples = [{"shape": shape, "stage": stage, "predicted": 1.0, "elementwise": 0.1,
              "seconds": 2.0 if shape == "smollm2-135m" else 1.5}
             for shape in ("size2", "smollm2-135m", "size3") for stage in cost.ELEMENTWISE]
  fit_rows, check = calibrate.heldout_split(samples, "smollm2-135m")
  assert all(s["shape"] != "smollm2-135m" for s in fit_rows)
  assert check and all(s["shape"] == "smollm2-135m" for s in check)
  assert len(fit_rows) + len(check) == len(samples)
  # The fit sees only the other sizes: 5 passes, not the held-out's 10.
  assert calibrate.fit_elementwise(fit_rows)["infer_elementwise"] == pytest.approx(5.0)


def test_a_calibration_file_without_the_term_keeps_it_off(tmp_path):
  # Its stage constants were fitted without the term: loading must not add it on top.
  old = tmp_path / "old.json"
  old.write_text('{"efficiency": {"matmul": 0.3, "generate_scale": 0.8}}')
  eff = cost.Efficiency.load(str(old))
  assert eff.matmul == 0.3 and all(getattr(eff, n) == 0.0 for n in cost.ELEMENTWISE.values())
  new = tmp_path / "new.json"
  new.write_text('{"efficiency": {"generate_elementwise": 12.0, "infer_elementwise": 0.0, '
                 '"train_elementwise": 3.0}}')
  assert cost.Efficiency.load(str(new)).generate_elementwise == 12.0
  # No file (assumed efficiencies): off; the fit across sizes goes with measured rates.
  assert all(getattr(cost.Efficiency(), n) == 0.0 for n in cost.ELEMENTWISE.values())
  assert cost.FITTED_ELEMENTWISE["generate_elementwise"] > 0
