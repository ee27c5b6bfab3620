"""The chain of a whole-model compiled step (ckplan.planner.whole): the post stage fitted to one
measured step reproduces that step's held bytes and peaks in the simulator."""
from __future__ import annotations

import pytest

from ckplan.planner import held_for_backward_bytes, plan_none, simulate, trace
from ckplan.planner.synthetic import random_chain
from ckplan.planner.whole import FULL, WholeStep, option_plan, whole_model_chain


def _measured_like(chain):
    """The none plan's held bytes and forward / backward peaks above persistent, from a trace."""
    n = chain.n_layers
    events = trace(chain, plan_none(n))
    end = next(i for i, ev in enumerate(events) if ev.op == "F" and ev.stage == n)
    fwd = max(ev.peak_bytes for ev in events[:end + 1]) - chain.persistent_bytes
    bwd = max(ev.peak_bytes for ev in events[end + 1:] if ev.op != "opt") - chain.persistent_bytes
    return held_for_backward_bytes(chain, plan_none(n)), fwd, bwd


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("held_delta,fwd_extra,bwd_extra", [(0, 0, 0), (-500, 0, -300), (700, 900, 1200)])
def test_the_fitted_chain_reproduces_the_measured_step(seed, held_delta, fwd_extra, bwd_extra):
    chain = random_chain(4, seed, max_size=997)
    held, fwd, bwd = _measured_like(chain)
    held_delta = max(held_delta, -chain.post.xbar_bytes)  # the head cannot hold less than nothing
    # a step that held and peaked differently from the profiled chain, at the loss head
    step = WholeStep(held + held_delta, max(fwd, held + held_delta) + fwd_extra,
                     max(bwd, held + held_delta) + bwd_extra)
    fitted = whole_model_chain(chain, {"store": step})
    got_held, got_fwd, got_bwd = _measured_like(fitted)
    assert got_held == step.held_bytes
    # the head sets the step's peaks only where they are above what the layers reach
    assert got_fwd == max(step.fwd_peak_bytes, _forward_peak_before_the_head(fitted))
    assert got_bwd >= step.bwd_peak_bytes
    assert fitted.layers == chain.layers and fitted.pre == chain.pre


def _forward_peak_before_the_head(chain) -> int:
    n = chain.n_layers
    return max(ev.peak_bytes for ev in trace(chain, plan_none(n))
               if ev.op == "F" and ev.stage is not None and ev.stage < n) - chain.persistent_bytes


def test_the_stages_times_scale_to_the_measured_step():
    chain = random_chain(3, 1, max_size=997)
    stages = (chain.pre.fwd_ms + chain.pre.bwd_ms + chain.post.fwd_ms + chain.post.bwd_ms
              + sum(ly.fwd_ms + ly.bwd_ms for ly in chain.layers))
    held, fwd, bwd = _measured_like(chain)
    for measured in (stages * 0.5, stages * 3.0):  # the whole graph faster, or slower, than its parts
        fitted = whole_model_chain(chain, {"store": WholeStep(held, fwd, bwd, fwd_bwd_ms=measured)})
        assert simulate(fitted, plan_none(3)).step_ms == pytest.approx(measured + chain.opt_ms)
        for a, b in zip(fitted.layers, chain.layers):  # one factor for every stage
            assert a.fwd_ms / b.fwd_ms == pytest.approx(measured / stages)
            assert a.tail_ms <= a.fwd_ms


def test_each_measured_choice_becomes_the_layers_option():
    chain = random_chain(3, 2, max_size=997, options=1)
    n = chain.n_layers
    held, fwd, bwd = _measured_like(chain)
    layers_ms = (chain.pre.fwd_ms + chain.pre.bwd_ms + chain.post.fwd_ms + chain.post.bwd_ms
                 + sum(ly.fwd_ms + ly.bwd_ms for ly in chain.layers))
    opt = chain.layers[0].options[0].name
    none = WholeStep(held, fwd, bwd, layers_ms, layer_saved=tuple(ly.xbar_bytes for ly in chain.layers))
    x = [ly.x_bytes for ly in chain.layers]
    # each step holds more than its graph's per-layer bytes add up to (bytes no layer is named on)
    full = WholeStep(held + 600, fwd, bwd + 5000, layers_ms + 30.0, layer_saved=tuple(v + 11 for v in x))
    sel = WholeStep(held + 900, fwd, bwd, layers_ms + 6.0, layer_saved=tuple(v + 21 for v in x))
    fitted = whole_model_chain(chain, {"store": none, FULL: full, opt: sel})
    fwd_ms = [ly.fwd_ms for ly in chain.layers]
    for name, step, read in ((FULL, full, 11), (opt, sel, 21)):
        # the plan with every layer so holds what its step held; each layer's bytes are its graph's
        # moved by one equal share (the remainder's byte on the first layers)
        assert held_for_backward_bytes(fitted, option_plan([name] * n)) == step.held_bytes
        shares = [next(o for o in ly.options if o.name == name).xbar_bytes - (x[i] + read)
                  for i, ly in enumerate(fitted.layers)]
        assert shares[0] > 0 and max(shares) - min(shares) <= 1 and shares == sorted(shares, reverse=True)
    for i, ly in enumerate(fitted.layers):
        by = {o.name: o for o in ly.options}
        # the steps' extra time, shared by the layers' forward times
        assert by[FULL].recompute_ms == pytest.approx(30.0 * fwd_ms[i] / sum(fwd_ms))
        assert by[opt].recompute_ms == pytest.approx(6.0 * fwd_ms[i] / sum(fwd_ms))
    # each uniform step's peak is reached (the embeddings' backward, the option's transient raised)
    assert simulate(fitted, option_plan([FULL] * n)).peak_bytes >= fitted.persistent_bytes + full.bwd_peak_bytes
    sel_high = WholeStep(held + 900, fwd, bwd + 7000, layers_ms + 6.0, layer_saved=tuple(v + 21 for v in x))
    fitted = whole_model_chain(chain, {"store": none, opt: sel_high})
    assert simulate(fitted, option_plan([opt] * n)).peak_bytes == fitted.persistent_bytes + sel_high.bwd_peak_bytes
    # and the stored plan still reproduces its own step
    assert _measured_like(fitted)[0] == none.held_bytes


def test_a_graph_that_names_no_chain_layer_keeps_the_profiles_bytes():
    # Dynamo may reach the layers under another module path (a sliced ModuleList): nothing is
    # attributed to them, every count is 0, and the profile's bytes stay
    chain = random_chain(3, 4, max_size=997, options=1)
    held, fwd, bwd = _measured_like(chain)
    zeros = (0, 0, 0)
    opt = chain.layers[0].options[0].name
    steps = {"store": WholeStep(held + 100, fwd + 100, bwd + 100, layer_saved=zeros),
             FULL: WholeStep(held + 700, fwd, bwd, layer_saved=zeros),
             opt: WholeStep(held + 800, fwd, bwd, layer_saved=zeros)}
    fitted = whole_model_chain(chain, steps)
    moved = {FULL: [], opt: []}
    for a, b in zip(fitted.layers, chain.layers):
        by = {o.name: o.xbar_bytes for o in a.options}
        assert a.xbar_bytes == b.xbar_bytes
        moved[FULL].append(by[FULL] - b.x_bytes)
        moved[opt].append(by[opt] - next(o.xbar_bytes for o in b.options if o.name == opt))
    for name in (FULL, opt):  # the profile's bytes, moved by equal shares to what the step held
        assert max(moved[name]) - min(moved[name]) <= 1
        assert held_for_backward_bytes(fitted, option_plan([name] * 3)) == steps[name].held_bytes
    assert _measured_like(fitted)[0] == held + 100  # the difference is the head's


def _whole_chain(seed: int):
    """A random chain fitted to measured-like steps, and its option: every layer has it and full-region."""
    chain = random_chain(4, seed, max_size=997, options=1)
    held, fwd, bwd = _measured_like(chain)
    opt = chain.layers[0].options[0].name
    x = tuple(ly.x_bytes for ly in chain.layers)
    steps = {"store": WholeStep(held, fwd, bwd, 40.0, tuple(ly.xbar_bytes for ly in chain.layers)),
             FULL: WholeStep(held + 50, fwd, bwd + 900, 70.0, tuple(v + 5 for v in x)),
             opt: WholeStep(held + 400, fwd, bwd + 200, 50.0, tuple(v + 9 for v in x))}
    return whole_model_chain(chain, steps), opt


def _layer_backward_top(chain, opt) -> int:
    return max(ev.peak_bytes for ev in trace(chain, option_plan([opt] * chain.n_layers))
               if ev.op == "B" and ev.stage in range(chain.n_layers) and not ev.recompute)


def test_an_option_fitted_to_its_step_peaks_there_even_where_the_chain_peaked_elsewhere():
    # the uniform step's measured peak lies below the simulated chain's highest op (the loss head,
    # say) but above what its layers' backward reach: the layers are raised to it, not by the
    # (smaller) difference from the chain's peak
    chain = random_chain(3, 7, max_size=997, options=1)
    held, fwd, bwd = _measured_like(chain)
    opt = chain.layers[0].options[0].name
    x = tuple(ly.x_bytes for ly in chain.layers)
    store = WholeStep(held, fwd, bwd + 5000)
    base = whole_model_chain(chain, {"store": store})
    layer_top = _layer_backward_top(base, opt)
    chain_top = simulate(base, option_plan([opt] * 3)).peak_bytes
    assert layer_top < chain_top  # the head's backward peaks above the layers'
    want = (layer_top + chain_top) // 2 - base.persistent_bytes
    assert want >= fwd  # the step peaked in its backward
    fitted = whole_model_chain(chain, {"store": store, opt: WholeStep(held, fwd, want, 0.0, x)})
    assert _layer_backward_top(fitted, opt) == want + fitted.persistent_bytes
    # a step that peaked below what its layers were priced at: their transients come down, to
    # none at least
    fitted = whole_model_chain(chain, {"store": store, opt: WholeStep(held, fwd, fwd, 0.0, x)})
    tmp = [o.bwd_tmp_bytes for ly in fitted.layers for o in ly.options if o.name == opt]
    top = _layer_backward_top(fitted, opt)
    assert top == fwd + fitted.persistent_bytes or (top > fwd + fitted.persistent_bytes and min(tmp) == 0)


@pytest.mark.parametrize("seed", range(6))
def test_a_checked_plan_is_scored_by_its_measured_peak(seed):
    from ckplan.errors import InfeasibleBudgetError
    from ckplan.planner.whole import plan_whole, whole_peak
    chain, _ = _whole_chain(seed)
    n = chain.n_layers
    lowest = plan_whole(chain, None).peak_bytes
    none_peak = simulate(chain, plan_none(n)).peak_bytes
    budget = (lowest + none_peak) // 2
    first = plan_whole(chain, budget)
    assert first.plan.options() and whole_peak(chain, first.plan) == first.peak_bytes <= budget
    # its own step measured 1 byte over the budget: another plan is chosen, and never that one
    checked = {first.plan.options(): budget + 1}
    try:
        again = plan_whole(chain, budget, checked)
    except InfeasibleBudgetError as err:  # only when it was the one plan that fitted
        assert err.min_peak_bytes > budget
    else:
        assert again.plan.options() != first.plan.options() and again.peak_bytes <= budget
        assert again.peak_bytes == whole_peak(chain, again.plan, checked)
    # measured lower than simulated: the measured peak is the plan's
    low = {first.plan.options(): first.peak_bytes - 1}
    assert whole_peak(chain, first.plan, low) >= first.peak_bytes - 1
    # only measured plans: one choice on every layer, or checked
    try:
        only = plan_whole(chain, budget, low, only_measured=True)
    except InfeasibleBudgetError as err:
        assert err.min_peak_bytes > budget
    else:
        opts = only.plan.options()
        assert len(set(opts)) == 1 or opts in low


@pytest.mark.parametrize("seed", range(6))
def test_a_margin_is_added_to_unmeasured_mixed_plans_only(seed):
    from ckplan.planner.whole import plan_whole
    chain, _ = _whole_chain(seed)
    lowest = plan_whole(chain, None).peak_bytes
    budget = (lowest + simulate(chain, plan_none(chain.n_layers)).peak_bytes) // 2
    margin = (budget - lowest) // 2
    for store_margin, region_margin in ((margin, 0), (0, margin), (margin, margin // 2)):
        res = plan_whole(chain, budget, margin=store_margin, region_margin=region_margin)
        opts = res.plan.options()
        sim = simulate(chain, res.plan).peak_bytes
        extra = 0 if len(set(opts)) == 1 else store_margin if "store" in opts else region_margin
        assert res.peak_bytes == sim + extra <= budget
