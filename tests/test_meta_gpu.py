"""Meta plans priced by a device model choose as the GPU's measurements do: on an H200 (the benches
in reports/cuda) SAC policies on gpt2-small at 2 x 512 cost more than recomputing whole layers,
so a meta plan for an H200 must choose no selective option there; at 8 x 512 they paid off."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from ckplan import api
from ckplan.planner import chain_from_profile, plan_chain

ROOT = Path(__file__).resolve().parents[1]
# what the H200 measured above a meta profile's sizes before it counted the CUDA runtime's blocks
# (BERT-large's none: 66.8 MiB, measured - predicted): the cuBLAS workspaces and 0.8 MiB more
UNSEEN = 70_018_496


def _measured(path: str) -> dict[str, float]:
    rows = json.loads((ROOT / path).read_text())["rows"]
    return {r["strategy"]: r["slowdown"] for r in rows if r.get("slowdown") is not None}


@pytest.fixture(scope="module")
def h200_small():
    spec = api.load(ROOT / "configs/gpt2-small.yaml", batch_size=2, optimizer="sgd")
    return api.profile(spec, device="meta", meta_target="h200", options=True)


def test_options_the_h200_found_dominated_are_left_out_on_meta(h200_small):
    measured = _measured("reports/cuda/bench-gpt2-small-cuda.json")
    # the premise, measured on the H200: sac-compute on every layer ran slower than a checkpoint per layer
    assert measured["sac-policy"] > measured["hf"]
    chain = chain_from_profile(h200_small)
    assert all(not ly.options for ly in chain.layers)
    for budget in (chain.persistent_bytes + 10**9, plan_chain(chain, "none").score.peak_bytes - 1):
        # no SAC policy; offload (an H200 has a host link) is another question, not measured there
        assert not [o for o in plan_chain(chain, "dp", budget).plan.options() if o.startswith("sac")]


def test_meta_times_say_which_device_model_priced_them(h200_small):
    assert h200_small.times_estimated
    assert any("h200 device model" in n for n in h200_small.notes)
    block = h200_small.chain_layers[0]
    # gpt2-small's block at 2 x 512: 16.1 GFLOP forward at 67 TFLOP/s x 0.75 is 0.32 ms; the
    # roofline adds its memory-bound ops, so the forward costs more, and the backward more again
    assert 0.32 < block.fwd_ms < 2 and block.bwd_ms > block.fwd_ms


def _meta_vs_gpu():
    import importlib.util
    spec = importlib.util.spec_from_file_location("meta_vs_gpu", ROOT / "scripts" / "meta_vs_gpu.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("bench", ["reports/cuda/b8/bench-gpt2-small-cuda.json",
                                   "reports/cuda/bench-bert-large-cuda.json"])
def test_meta_slowdowns_hold_on_the_h200(bench):
    """The `h200` device model against what the H200 measured (8 x 512 tokens): every row's plan,
    scored on the meta profile, within 15% in step time for `none` and 3 points in slowdown; the one
    known miss, `sac-linear` on every gpt2-small layer (`selective`, reports/cuda/meta-vs-h200.md),
    within 7."""
    head, rows = _meta_vs_gpu().compare(ROOT / bench, "h200")
    assert {r["strategy"] for r in rows} >= {"none", "every-k", "dp", "selective"}
    for r in rows:
        points = abs(r["pred_slowdown"] - r["meas_slowdown"]) * 100
        limit = 7 if (head["model"], r["strategy"]) == ("gpt2-small", "selective") else 3
        assert points <= limit, (r["strategy"], points)
        if r["strategy"] == "none":
            assert abs(r["pred_step_ms"] / r["meas_step_ms"] - 1) <= 0.15
        # Peaks: the meta profile counts the h200 model's CUDA runtime blocks (2 x 33 MiB, as a CUDA
        # profile measured them there); what it cannot see, the attention backward's workspace and
        # the loss's, leaves the measured peak at most 2 MiB above.
        short = r["meas_peak"] - r["pred_peak"]
        assert 0 <= short <= 2 * 2**20, (r["strategy"], short)
        assert short < UNSEEN - 64 * 2**20
