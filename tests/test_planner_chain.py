"""chain_from_profile: transients calibrated so the plan without checkpointing reproduces the
measured windows. Numbers below are worked out by hand."""
from __future__ import annotations

import dataclasses

import pytest

from ckplan.errors import ChainError, PlannerArgumentError, SpecError, UsageError
from ckplan.planner import chain_from_profile, default_budget, plan_none, predicted_peak_none, simulate
from ckplan.records import CHAIN, POST, PRE, Profile, StageRecord, Totals


def stage(index, role, *, out, saved, grad, fwd_peak, bwd_peak, fwd_ms=1.0, bwd_ms=2.0):
    return StageRecord(index=index, name=f"s{index}", type="T", role=role, param_bytes=0,
                       grad_bytes=grad, output_bytes=out, saved_bytes=saved, fwd_ms=fwd_ms,
                       bwd_ms=bwd_ms, fwd_flops=10, bwd_flops=20, fwd_tmp_bytes=0, bwd_tmp_bytes=0,
                       fwd_peak_bytes=fwd_peak, bwd_peak_bytes=bwd_peak)


def make_profile(accum: int = 1) -> Profile:
    # Relative live bytes of the plan without checkpointing (what the simulator holds; the post's
    # output is the loss, 4 bytes, held from its forward on, and its seed from its backward on):
    #   pre F 4 | F0 4+5=9 | F1 9+4=13 | post F 13+6+4=23 | post B 23+4=27, after 27+3+10-6=34
    #   B1 34, after 34+2+50-4-3=79 | B0 79, after 79+3+40-5-2=115 | pre B 115, after 108
    #   (then loss and seed go: 100)
    layers = (
        stage(-1, PRE, out=3, saved=4, grad=0, fwd_peak=5, bwd_peak=116),
        stage(0, CHAIN, out=2, saved=5, grad=40, fwd_peak=10, bwd_peak=118),
        stage(1, CHAIN, out=3, saved=4, grad=50, fwd_peak=13, bwd_peak=83),
        stage(2, POST, out=4, saved=6, grad=10, fwd_peak=24, bwd_peak=35),
    )
    totals = Totals(param_bytes=100, buffer_bytes=0, trainable_bytes=100, grad_bytes=100,
                    optimizer_bytes=200, optimizer_tmp_bytes=5, input_bytes=10,
                    activation_bytes=16, predicted_peak_bytes=0, measured_peak_bytes=None)
    return Profile(model="toy", device="cpu", device_name="cpu", chain="blocks", chain_detected=True,
                   batch_size=1, precision="fp32", optimizer="adamw", accum=accum,
                   input_requires_grad=True, times_estimated=False, layers=layers, totals=totals)


def test_calibrated_chain_by_hand():
    ch = chain_from_profile(make_profile())
    assert ch.persistent_bytes == 310 and ch.opt_step_peak_bytes == 415
    assert ch.delta_in_bytes == 3 and ch.x_in_bytes == 3 and ch.pre.retained_bytes == 4
    assert [(ly.x_bytes, ly.xbar_bytes, ly.grad_bytes) for ly in ch.layers] == [(2, 5, 40), (3, 4, 50)]
    assert [(ly.fwd_tmp_bytes, ly.bwd_tmp_bytes) for ly in ch.layers] == [(10 - 9, 118 - 79), (0, 83 - 34)]
    assert (ch.pre.fwd_tmp_bytes, ch.pre.bwd_tmp_bytes) == (1, 1)
    assert (ch.post.xbar_bytes, ch.post.fwd_tmp_bytes, ch.post.bwd_tmp_bytes) == (6, 1, 8)
    assert ch.post.loss_bytes == 4
    assert ch.layers[0].fwd_flops == 10 and ch.layers[1].bwd_ms == 2.0


def test_none_peak_reproduces_the_measured_windows():
    prof = make_profile()
    ch = chain_from_profile(prof)
    sc = simulate(ch, plan_none(2))
    assert sc.peak_bytes == 310 + 118 == 428
    assert sc.peak_at == "B(layer 0)"
    formula = max(ch.persistent_bytes + max(max(r.fwd_peak_bytes, r.bwd_peak_bytes) for r in prof.layers),
                  ch.opt_step_peak_bytes)
    assert predicted_peak_none(prof) == formula == 428


def test_every_window_is_reproduced():
    from ckplan.planner import trace
    prof = make_profile()
    ch = chain_from_profile(prof)
    by_stage = {(e.op, e.stage): e.peak_bytes for e in trace(ch, plan_none(2)) if e.op in "FB"}
    for r in prof.layers:
        assert by_stage[("F", r.index)] == ch.persistent_bytes + r.fwd_peak_bytes
        assert by_stage[("B", r.index)] == ch.persistent_bytes + r.bwd_peak_bytes


def test_gradient_accumulation_moves_grads_into_persistent():
    prof = make_profile(accum=4)
    ch = chain_from_profile(prof)
    assert ch.persistent_bytes == 410 and all(ly.grad_bytes == 0 for ly in ch.layers)
    assert ch.post.grad_bytes == 0 and ch.opt_step_peak_bytes == 415
    assert predicted_peak_none(prof) == simulate(ch, plan_none(2)).peak_bytes == 410 + 118


def test_optimizer_step_peak_wins_when_larger():
    prof = make_profile()
    prof = dataclasses.replace(prof, totals=dataclasses.replace(prof.totals, optimizer_tmp_bytes=500))
    assert predicted_peak_none(prof) == 100 + 10 + 200 + 100 + 500


def test_inconsistent_window_gives_zero_transient():
    prof = make_profile()
    low = dataclasses.replace(prof.layers[2], bwd_peak_bytes=0)  # below the model's 34
    prof = dataclasses.replace(prof, layers=(prof.layers[0], prof.layers[1], low, prof.layers[3]))
    ch = chain_from_profile(prof)
    assert ch.layers[1].bwd_tmp_bytes == 0
    assert predicted_peak_none(prof) >= 428


def test_profile_without_chain_layers():
    prof = make_profile()
    prof = dataclasses.replace(prof, layers=(prof.layers[0], prof.layers[3]))
    with pytest.raises(SpecError, match="no chain layers"):
        chain_from_profile(prof)


def test_chain_carries_casts_optimizer_and_accumulation():
    prof = make_profile()
    rows = tuple(dataclasses.replace(r, cast_bytes=3 if r.role == CHAIN else 7) for r in prof.layers)
    ch = chain_from_profile(dataclasses.replace(prof, layers=rows))
    assert [ly.cast_bytes for ly in ch.layers] == [3, 3] and ch.has_casts
    assert ch.optimizer == "adamw" and not ch.grads_in_persistent
    assert chain_from_profile(make_profile(accum=4)).grads_in_persistent
    # Stored layers hold their copies inside xbar: the calibrated no-checkpoint peak is unchanged.
    assert predicted_peak_none(dataclasses.replace(prof, layers=rows)) == predicted_peak_none(prof)


def test_a_bad_chain_is_a_chain_error_and_still_a_value_error():
    prof = make_profile()
    rows = tuple(dataclasses.replace(r, fwd_ms=-1.0) if r.role == CHAIN else r for r in prof.layers)
    with pytest.raises(ChainError, match="negative time") as got:
        chain_from_profile(dataclasses.replace(prof, layers=rows))
    assert isinstance(got.value, ValueError) and isinstance(got.value, SpecError)
    assert got.value.exit_code == 2
    ch = chain_from_profile(prof)
    with pytest.raises(ValueError, match="at least one layer"):  # what callers catching ValueError see
        dataclasses.replace(ch, layers=())


def test_a_bad_planner_argument_is_a_usage_error_and_still_a_value_error():
    ch = chain_from_profile(make_profile())
    with pytest.raises(PlannerArgumentError, match="mode must be") as got:
        default_budget(ch, mode="fastest", free_device_bytes=None)
    assert isinstance(got.value, ValueError) and isinstance(got.value, UsageError)
