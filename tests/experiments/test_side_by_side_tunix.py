"""The side-by-side page: rounds grouped by side, ratios of the means."""

from __future__ import annotations

import types

from experiments import side_by_side_tunix as sbs


def _row(side, s):
  return {"side": side, "s_per_step": s, "generate_s": 1.0, "infer_s": 1.0,
          "train_s": s - 2.0, "other_s": 0.0, "command": f"run {side}"}


def _args(peer_xla_flags):
  return types.SimpleNamespace(shape="smollm2-135m", steps=2, ours_flags="",
                               peer_xla_flags=peer_xla_flags)


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
