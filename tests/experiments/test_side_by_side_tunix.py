"""The side-by-side page: rounds grouped by side, ratios of the means."""

from __future__ import annotations

import types

from experiments import side_by_side_tunix as sbs


def _row(side, s):
  return {"side": side, "s_per_step": s, "generate_s": 1.0, "infer_s": 1.0,
          "train_s": s - 2.0, "other_s": 0.0, "command": f"run {side}"}


def _args(peer_xla_flags, tuned_flags=""):
  return types.SimpleNamespace(shape="smollm2-135m", steps=2, batch=8, prompt_len=64,
                               new_tokens=64, ours_flags="", peer_xla_flags=peer_xla_flags,
                               tuned_flags=tuned_flags)


def test_page_reports_both_peer_variants_per_round():
  dims = sbs.peer_dims("smollm2-135m", 8, 64, 64)
  rounds = [_row(sbs.PEER, 30.0), _row(sbs.PEER_FLAGGED, 24.0), _row(sbs.OURS, 15.0),
            _row(sbs.PEER, 26.0), _row(sbs.PEER_FLAGGED, 20.0), _row(sbs.OURS, 13.0)]
  body = sbs.page_body(_args("--some_flag=false"), dims, rounds)
  assert "| 2 | tunix + flags | 20.00 |" in body
  assert "**2.00x** the peer's speed" in body  # 28 / 14
  assert "`--some_flag=false`: 22.00 s/step; this project is **1.57x**" in body
  assert body.count("- tunix") == 2 and "run pipe_rlhf_jax" in body


def test_page_without_the_flagged_variant():
  dims = sbs.peer_dims("smollm2-135m", 8, 64, 64)
  rounds = [_row(sbs.PEER, 30.0), _row(sbs.OURS, 15.0), _row(sbs.PEER, 26.0),
            _row(sbs.OURS, 13.0)]
  body = sbs.page_body(_args(""), dims, rounds)
  assert "| 2 | pipe_rlhf_jax | 13.00 |" in body and "tunix + flags" not in body
  assert "plan flags: none (the library's defaults)." in body and "Tuned" not in body


def test_a_tuned_plan_is_a_side_of_its_own_beside_the_defaults():
  assert not sbs.tuned(_args("", tuned_flags=""))
  assert not sbs.tuned(types.SimpleNamespace(ours_flags="--remat full",
                                             tuned_flags=" --remat  full"))
  args = _args("", tuned_flags="--logits-chunk 32")
  assert sbs.tuned(args)
  dims = sbs.peer_dims("smollm2-135m", 8, 64, 64)
  rounds = [_row(sbs.PEER, 30.0), _row(sbs.OURS, 15.0), _row(sbs.TUNED, 12.0),
            _row(sbs.PEER, 26.0), _row(sbs.OURS, 13.0), _row(sbs.TUNED, 10.0)]
  body = sbs.page_body(args, dims, rounds)
  assert "| 2 | pipe_rlhf_jax tuned | 10.00 |" in body
  assert "**2.00x** the peer's speed (goal" in body  # the defaults' ratio, 28 / 14
  assert "Tuned (`--logits-chunk 32`): 11.00 s/step, **2.55x** the peer's speed" in body
  assert "its tuned side's: `--logits-chunk 32`" in body
  assert sbs.ours_command(args, "/o", "")[-1] == "/o"
  assert sbs.ours_command(args, "/o", args.tuned_flags)[-2:] == ["--logits-chunk", "32"]
