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
    full = WholeStep(held // 4, fwd, bwd + 5000, layers_ms + 30.0, layer_saved=tuple(v + 11 for v in x))
    sel = WholeStep(held // 2, fwd, bwd, layers_ms + 6.0, layer_saved=tuple(v + 21 for v in x))
    fitted = whole_model_chain(chain, {"store": none, FULL: full, opt: sel})
    fwd_ms = [ly.fwd_ms for ly in chain.layers]
    for i, ly in enumerate(fitted.layers):
        by = {o.name: o for o in ly.options}
        assert by[FULL].xbar_bytes == x[i] + 11 and by[opt].xbar_bytes == x[i] + 21
        # the steps' extra time, shared by the layers' forward times
        assert by[FULL].recompute_ms == pytest.approx(30.0 * fwd_ms[i] / sum(fwd_ms))
        assert by[opt].recompute_ms == pytest.approx(6.0 * fwd_ms[i] / sum(fwd_ms))
    # each uniform step's peak is reached (the embeddings' backward, the option's transient raised)
    assert simulate(fitted, option_plan([FULL] * n)).peak_bytes >= fitted.persistent_bytes + full.bwd_peak_bytes
    sel_high = WholeStep(held // 2, fwd, bwd + 7000, layers_ms + 6.0, layer_saved=tuple(v + 21 for v in x))
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
    fitted = whole_model_chain(chain, {"store": WholeStep(held + 100, fwd + 100, bwd + 100, layer_saved=zeros),
                                       FULL: WholeStep(held // 3, fwd, bwd, layer_saved=zeros),
                                       opt: WholeStep(held // 2, fwd, bwd, layer_saved=zeros)})
    for a, b in zip(fitted.layers, chain.layers):
        by = {o.name: o.xbar_bytes for o in a.options}
        assert a.xbar_bytes == b.xbar_bytes and by[FULL] == b.x_bytes
        assert by[opt] == next(o.xbar_bytes for o in b.options if o.name == opt)
    assert _measured_like(fitted)[0] == held + 100  # the difference is the head's
