"""Calibration fits recover known constants; the cost model loads the file."""

import dataclasses
import json

import pytest

from pipe_rlhf_jax.planner import calibrate, composition, cost, hardware


def _synthetic(peak=1e11, matmul=0.5, train=0.25, overhead=2e-3, tick=1e-4, bw=5e9,
               decode_bw=0.8, alpha=3e-5, link=2e9, k=8):
  return {
      "devices": k,
      "matmul": [{"n": n, "flops": 2 * n ** 3, "seconds_one": 2 * n ** 3 / peak,
                  "seconds_all": 2 * n ** 3 * k / peak} for n in (256, 512)],
      "bandwidth": {"bytes": 1e9, "seconds": 1e9 / bw},
      "dispatch": {"seconds": 1e-5},
      "forward": [{"flops": f, "seconds": overhead + f / (peak * matmul)}
                  for f in (1e8, 1e9, 4e9)],
      "train": [{"flops": f, "seconds": overhead + f / (peak * train)} for f in (1e8, 1e9)],
      "decode": [{"bytes": b, "seconds": tick + b / (bw * decode_bw)} for b in (1e6, 1e7)],
      # Per collective, 16 in a program; the cpu profile's collectives are k - 1
      # exchanges, each paying alpha.
      "all_gather": [{"devices": d, "bytes": v, "count": 16,
                      "seconds": (d - 1) * alpha + v * (d - 1) / d / link}
                     for d in (2, 4, k) for v in (1e3, 1e5, 1e7)],
      "concurrency": [{"copies": 1, "seconds": 1.0}, {"copies": 2, "seconds": 1.25},
                      {"copies": 8, "seconds": 5.0}],
  }


def test_fit_recovers_the_constants():
  fits = {k: v for k, (v, _) in calibrate.fit(_synthetic()).items()}
  assert fits["device_peak_flops"] == pytest.approx(1e11)
  assert fits["host_peak_flops"] == pytest.approx(1e11)  # devices share the host
  assert fits["matmul"] == pytest.approx(0.5)
  assert fits["train"] == pytest.approx(0.25)
  assert fits["call_overhead_s"] == pytest.approx(2e-3)
  assert fits["tick_overhead_s"] == pytest.approx(1e-4)
  assert fits["decode_bw"] == pytest.approx(0.8)
  assert fits["link_latency"] == pytest.approx(3e-5)
  assert fits["link_bw"] == pytest.approx(2e9)
  assert fits["host_concurrency"] == pytest.approx(1.6)  # 2 copies in 1.25 x one's time


def test_negative_intercept_is_refit_through_the_origin():
  a, b = calibrate.fit_line([1.0, 2.0, 3.0], [0.5, 2.0, 3.5])
  assert a == 0.0 and b > 0


def test_cost_model_loads_the_calibration(tmp_path):
  fits = calibrate.fit(_synthetic())
  path = tmp_path / "cal.json"
  path.write_text(json.dumps({"efficiency": calibrate.efficiency_dict(fits, "synthetic")}))
  eff = cost.Efficiency.load(str(path))
  assert eff.matmul == pytest.approx(0.5) and eff.source == "synthetic"
  m = cost.Machine(hardware.get("cpu"), eff)
  assert m.compute_rate("float32", 1) == pytest.approx(1e11)  # measured, not the profile
  # Concurrency 1.6: two devices at once do 1.6 devices' work, eight no more than that.
  assert m.compute_rate("float32", 2) == pytest.approx(1.6e11)
  assert m.compute_rate("float32", 8) == pytest.approx(1.6e11)
  no_concurrency = cost.Machine(hardware.get("cpu"), cost.Efficiency(
      host_peak_flops=1e11, device_peak_flops=1e11))
  assert no_concurrency.compute_rate("float32", 8) == pytest.approx(1e11)
  assert m.all_gather(1e7, 8) == pytest.approx(7 * 3e-5 + 1e7 * 7 / 8 / 2e9)
  # Three arrays gathered one by one: three times the latency, the same bytes.
  assert m.all_gather(1e7, 8, count=3) == pytest.approx(3 * 7 * 3e-5 + 1e7 * 7 / 8 / 2e9)
  # On accelerators the profile's latency is per collective.
  h100 = cost.Machine(hardware.get("h100"), cost.Efficiency())
  bw, lat = h100.link(False)
  assert h100.all_gather(1e7, 8) == pytest.approx(lat + 1e7 * 7 / 8 / bw)


def test_an_earlier_calibrations_single_all_gathers_still_fit():
  samples = _synthetic()
  samples["all_gather"] = [{"devices": 8, "bytes": v, "seconds": 3e-5 + v * 7 / 8 / 2e9}
                           for v in (1e5, 1e7)]
  fits = {k: v for k, (v, _) in calibrate.fit(samples).items()}
  assert fits["link_latency"] == pytest.approx(3e-5)
  assert fits["link_bw"] == pytest.approx(2e9)


def test_reshard_moves_are_fitted_and_price_the_weight_sync_and_batches():
  import dataclasses

  from pipe_rlhf_jax.models.config import tiny_config
  samples = {**_synthetic(), "model": dataclasses.asdict(tiny_config())}
  # seconds = 2e-4 per array + bytes x replicas / 1e9
  samples["stages"] = [{"stage": "reshard", "arrays": a, "bytes": b, "replicas": r,
                        "seconds": a * 2e-4 + b * r / 1e9}
                       for a, b, r in ((12, 1e6, 1), (12, 1e6, 8), (6, 1e4, 2),
                                       (14, 5e4, 4))]
  fits = {k: v for k, (v, _) in calibrate.fit(samples).items()}
  assert fits["reshard_array_s"] == pytest.approx(2e-4)
  assert fits["reshard_bw"] == pytest.approx(1e9)
  from pipe_rlhf_jax.config import MeshSpec, Plan, StagePlan
  from pipe_rlhf_jax.planner import space
  work = space.Workload(actor=tiny_config(), batch_size=16, minibatch_size=8, epochs=1,
                        prompt_len=8, gen_len=4, num_devices=8)
  m = cost.Machine(hardware.get("cpu"), cost.Efficiency(reshard_array_s=2e-4,
                                                        reshard_bw=1e9))
  shapes = {"generate": dict(data=1, fsdp=1, tensor=2, pipeline=4),
            "infer": dict(data=4, fsdp=1, tensor=1, pipeline=2),
            "train": dict(data=4, fsdp=1, tensor=2, pipeline=1)}
  plan = lambda mode: Plan(mode=mode, **{s: StagePlan(mesh=MeshSpec(**v))
                                                  for s, v in shapes.items()})
  assert composition.batch_moves(plan("sequential"), shapes, work, m) == {
      "generate": 0.0, "infer": 0.0, "train": 0.0}
  per_stage = composition.batch_moves(plan("per_stage"), shapes, work, m)
  arrays, nbytes = composition.batch_arrays(work)["infer"]
  # The rollout goes to infer's 4 batch shards, each on 2 devices; the experience stays
  # where it is (the same data x fsdp split on the same devices).
  assert per_stage == {"generate": 0.0, "infer": pytest.approx(arrays * 2e-4 + nbytes * 2 / 1e9),
                       "train": 0.0}
  # The sync: actor to generate (8 ways, no replicas) and critic to infer (2 replicas).
  per_layer, other = work.actor.num_param_arrays()
  assert composition.sync_time(plan("per_stage"), shapes, work, m) == pytest.approx(
      2 * (per_layer + other) * 2e-4 + cost.param_bytes(work.actor) * 1 / 1e9
      + cost.param_bytes(work.critic) * 4 / 1e9 + 2 * m.eff.call_overhead_s)


def test_device_overhead_is_fitted_and_charged_on_shared_hosts_only():
  samples = _synthetic()
  samples["split"] = [{"kind": "train", "devices": 8, "seconds": 1.7, "seconds_one": 1.0}]
  fits = {k: v for k, (v, _) in calibrate.fit(samples).items()}
  assert fits["train_device_overhead_s"] == pytest.approx(0.1)
  from pipe_rlhf_jax.config import MeshSpec, StagePlan
  from pipe_rlhf_jax.models.config import tiny_config
  from pipe_rlhf_jax.planner import space
  work = space.Workload(actor=tiny_config(), batch_size=16, minibatch_size=8, epochs=1,
                        prompt_len=8, gen_len=4, num_devices=8)
  mesh = dict(data=8, fsdp=1, tensor=1, pipeline=1)
  plan = StagePlan(mesh=MeshSpec(data=8))
  eff = cost.Efficiency(train_device_overhead_s=0.1, call_overhead_s=0.0)
  cpu = cost.train_cost(plan, mesh, work, cost.Machine(hardware.get("cpu"), eff))
  # 2 minibatch steps x 2 models x 7 extra devices x 0.1 s.
  assert cpu.overhead == pytest.approx(2 * 2 * 7 * 0.1)
  gpu = cost.train_cost(plan, mesh, work, cost.Machine(hardware.get("h100"), eff))
  assert gpu.overhead == 0.0


def test_tick_device_overhead_is_charged_per_generation_tick():
  samples = _synthetic()
  samples["split"] = [{"kind": "tick", "devices": 8, "seconds": 1.35e-3,
                       "seconds_one": 1e-3}]
  fits = {k: v for k, (v, _) in calibrate.fit(samples).items()}
  assert fits["tick_device_overhead_s"] == pytest.approx(5e-5)
  from pipe_rlhf_jax.config import MeshSpec, StagePlan
  from pipe_rlhf_jax.generation import schedule
  from pipe_rlhf_jax.models.config import tiny_config
  from pipe_rlhf_jax.planner import space
  work = space.Workload(actor=tiny_config(), batch_size=16, minibatch_size=8, epochs=1,
                        prompt_len=8, gen_len=4, num_devices=4)
  eff = cost.Efficiency(tick_device_overhead_s=5e-5, tick_overhead_s=0.0,
                        call_overhead_s=0.0)
  plan = StagePlan(mesh=MeshSpec(data=1, pipeline=4), num_microbatches=4)
  mesh = dict(data=1, fsdp=1, tensor=1, pipeline=4)
  c = cost.generate_cost(plan, mesh, work, cost.Machine(hardware.get("cpu"), eff))
  # Every tick of the 4-device pipeline runs 3 extra device programs.
  assert c.overhead == pytest.approx(schedule.num_ticks(4, 4, 4) * 3 * 5e-5)


def test_nnls_keeps_constants_non_negative():
  # y = 2 x1 exactly, x2 anti-correlated: the unconstrained fit would go negative.
  cols = [[1.0, 2.0, 3.0, 4.0], [4.0, 3.0, 2.0, 1.0]]
  coef = calibrate.nnls(cols, [2.0, 4.1, 5.9, 8.0], [1.0] * 4)
  assert coef[1] >= 0.0 and coef[0] == pytest.approx(2.0, rel=0.05)
  exact = calibrate.nnls(cols, [2 * a + 0.5 * b for a, b in zip(*cols)], [1.0] * 4)
  assert exact == pytest.approx([2.0, 0.5])


_STAGE_CONSTANTS = dict(
    generate_scale=1.3, generate_call_s=2e-3, tick_overhead_s=4e-4,
    tick_device_overhead_s=6e-5, infer_scale=1.6, infer_call_s=1e-3,
    forward_device_overhead_s=2e-3, train_scale=1.4,
    train_call_s=3e-3, train_step_s=1e-3, train_device_overhead_s=4e-3,
    train_exchange_s=2e-5)


def _with_stages(constants):
  """Synthetic microbenchmarks plus real-stage samples at the calibration points, timed
  as the cost model prices them with `constants` on top of the microbenchmark fits."""
  import dataclasses

  from pipe_rlhf_jax.config import MeshSpec, StagePlan
  from pipe_rlhf_jax.models.config import tiny_config
  from pipe_rlhf_jax.planner import space
  samples = _synthetic()
  samples["optimizer"] = {"bytes": 7e6, "seconds": 1e-5 + 7e6 / (5e9 * 0.9)}
  cfg = tiny_config()
  samples["model"] = dataclasses.asdict(cfg)
  samples["hardware"] = "cpu"
  base = calibrate.efficiency_dict(calibrate.fit(samples), "microbenchmarks")
  # A calibration carries the non-matmul passes fitted across sizes and fits its stage
  # constants beside them.
  m = cost.Machine(hardware.get("cpu"),
                   cost.Efficiency(**{**base, **cost.FITTED_ELEMENTWISE, **constants}))
  samples["stages"] = []
  for k, mode, gen, inf, trn, micro, (b, mb, lp, t) in calibrate.STAGE_POINTS:
    meshes = {"generate": gen, "infer": inf, "train": trn}
    if mode == "sequential":
      meshes = {s: {"data": k} for s in meshes}
    work = space.Workload(actor=cfg, batch_size=b, minibatch_size=mb, epochs=1,
                          prompt_len=lp, gen_len=t, num_devices=k, reward_model=False)
    for stage, axes in meshes.items():
      mesh = calibrate._mesh(axes)
      m_stage = micro if stage == "generate" else 1
      plan = StagePlan(mesh=MeshSpec(**mesh), num_microbatches=m_stage)
      samples["stages"].append({
          "stage": stage, "devices": k, "mode": mode, "mesh": mesh,
          "num_microbatches": m_stage, "batch": b, "minibatch": mb, "prompt_len": lp,
          "gen_len": t, "seconds": cost.stage_cost(stage, plan, mesh, work, m).total})
  return samples


def test_stage_fit_recovers_the_constants_of_the_real_stages():
  samples = _with_stages(_STAGE_CONSTANTS)
  fits = {k: v for k, (v, _) in calibrate.fit(samples).items()}
  assert fits["optimizer_bw"] == pytest.approx(0.9)
  for name, value in _STAGE_CONSTANTS.items():
    assert fits[name] == pytest.approx(value, rel=1e-6), name
  # The microbenchmark's own per-device estimate is kept for the record, not used.
  assert "microbenchmark_train_device_overhead_s" not in fits  # no split samples here
  eff = cost.Efficiency(**calibrate.efficiency_dict(calibrate.fit(samples), "s"))
  assert eff.train_scale == pytest.approx(1.4)


def test_stage_fit_never_returns_negative_constants():
  # Stages faster than the microbenchmark roofline alone: constants clip at 0, scale > 0.
  samples = _with_stages(dict(_STAGE_CONSTANTS, train_call_s=0.0, train_step_s=0.0))
  for s in samples["stages"]:
    s["seconds"] *= 0.7
  fits = {k: v for k, (v, _) in calibrate.fit(samples).items()}
  for name in _STAGE_CONSTANTS:
    assert fits[name] >= 0.0, name


@pytest.mark.slow
def test_real_stage_points_record_the_reshard_helpers_moves_apart_from_the_stages():
  # One per_stage point on 2 devices, as `planner.calibrate` measures it: the weight sync
  # and each stage's batch moved in become reshard samples, and the stage samples are
  # timed without their batch's move.
  from pipe_rlhf_jax.models.config import tiny_config
  cfg = tiny_config(embed_dim=32, num_layers=2, num_heads=2, num_kv_heads=2, head_dim=16,
                    mlp_dim=64)
  point = (2, "per_stage", dict(tensor=2), dict(data=2), dict(fsdp=2), 1, (8, 4, 6, 3))
  rows = calibrate.measure_stages(cfg, (point,), repeats=1)
  moves = {r["what"]: r for r in rows if r["stage"] == "reshard"}
  per_layer, other = cfg.num_param_arrays()
  assert moves["actor"]["arrays"] == per_layer + other  # the whole model, stacked layers
  assert moves["actor"]["replicas"] == 1  # generate splits the weights over tensor=2
  assert moves["critic"]["replicas"] == 2  # infer holds them whole on both devices
  assert moves["infer"]["arrays"] == 6  # the rollout's arrays
  assert all(r["seconds"] > 0 for r in moves.values())
  stages = {r["stage"]: r for r in rows if r["stage"] != "reshard"}
  assert stages["infer"]["moved_s"] == moves["infer"]["seconds"]
  assert stages["generate"]["moved_s"] == 0.0
  fits = calibrate.fit({**_synthetic(), "model": dataclasses.asdict(cfg), "stages": rows})
  assert fits["reshard_array_s"][0] >= 0 and fits["reshard_bw"][0] >= 0


def test_all_gathers_are_timed_per_collective_on_2_4_and_all_devices():
  import jax
  samples = calibrate.measure_all_gathers(jax.devices(), (2 ** 4,), count=4)
  assert [(s["devices"], s["bytes"], s["count"]) for s in samples] == [
      (2, 128, 4), (4, 256, 4), (8, 512, 4)]
  assert all(s["seconds"] >= 0 for s in samples)
  fits = {k: v for k, (v, _) in calibrate.fit({**_synthetic(), "all_gather": samples,
                                                "hardware": "cpu"}).items()}
  assert fits["link_latency"] >= 0 and fits["link_bw"] >= 0


def test_read_bandwidth_takes_the_faster_of_its_two_reads():
  import jax
  seconds = iter([2.0, 0.5])  # the sum, then the matrix-vector product
  calls = []

  def timer(fn, *args):
    calls.append([a.shape for a in args])
    return next(seconds)
  read_bytes, took = calibrate.read_bandwidth(jax.devices()[0], 1, timer)
  assert read_bytes == 2 ** 20 and took == 0.5
  assert calls == [[(64, 4096)], [(64, 4096), (4096,)]]


def test_a_point_the_model_does_not_divide_over_is_skipped(capsys):
  from pipe_rlhf_jax.models.config import tiny_config
  cfg = tiny_config(embed_dim=48, num_layers=2, num_heads=3, num_kv_heads=3, head_dim=16,
                    mlp_dim=64)
  point = (2, "per_stage", dict(tensor=2), dict(data=2), dict(data=2), 1, (8, 4, 6, 3))
  assert calibrate.measure_stages(cfg, (point,), repeats=1) == []
  assert "calibration point on 2 devices skipped: stages.generate.mesh" in (
      capsys.readouterr().err)


def test_a_stage_with_few_points_fits_fewer_constants():
  # Three train points for five constants: two are fitted (the scale, then the per-step
  # cost), the others are left out rather than fitted to one point each.
  samples = _with_stages(_STAGE_CONSTANTS)
  train = [s for s in samples["stages"] if s["stage"] == "train"][:3]
  samples["stages"] = [s for s in samples["stages"] if s["stage"] != "train"] + train
  fits = calibrate.fit(samples)
  assert "train_scale" in fits and "train_step_s" in fits
  assert not {"train_call_s", "train_device_overhead_s", "train_exchange_s"} & set(fits)


@pytest.mark.slow
def test_the_microbenchmarks_measure_and_fit_a_tiny_model():
  # Every probe of `measure` but the stage points (timed by the tests above), on a tiny
  # model: each sample is a positive time of the sizes asked for, and the fit takes them.
  from pipe_rlhf_jax.models.config import tiny_config
  cfg = tiny_config(vocab_size=64, embed_dim=32, num_layers=2, num_heads=4, num_kv_heads=2,
                    head_dim=8, mlp_dim=64)
  samples = calibrate.measure(cfg, quick=True, stages=False)
  assert [s["n"] for s in samples["matmul"]] == [256, 512]
  assert [(s["batch"], s["length"]) for s in samples["forward"]] == [(8, 24), (64, 24)]
  assert [(s["batch"], s["slots"]) for s in samples["decode"]] == [(8, 32), (64, 128)]
  assert {s["kind"] for s in samples["split"]} == {"forward", "train", "tick"}
  assert [s["copies"] for s in samples["concurrency"]] == [1, 2, 8]
  times = [s["seconds"] for key in ("forward", "train", "decode", "split", "concurrency")
           for s in samples[key]] + [samples["optimizer"]["seconds"]]
  assert all(t > 0 for t in times)
  fits = calibrate.fit(samples)
  assert fits["device_peak_flops"][0] > 0 and fits["hbm_bw"][0] > 0
  assert "forward_device_overhead_s" in fits and "tick_device_overhead_s" in fits
