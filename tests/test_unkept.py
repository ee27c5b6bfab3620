"""Boundaries no op keeps: a layer's output that the next layer reads without saving it.

``nn.Sequential(Linear, ReLU, Linear, ...)`` with each module a chain layer: ReLU saves its own
output, not its input, so the Linear's output is freed once the ReLU has run. Cohere's LayerNorm
saves ``x - mean``, not ``x``, so no block's input is saved either. Rotor's model (a stored layer
keeps its output) overstated such chains by up to 50% without checkpoints and understated
checkpoints that start after them (a checkpoint saves its input).

Oracles: the live-tensor tracker's peak of real training steps under *every* nested plan of a
small chain (the prediction must equal it to the byte), hand traces of the simulator, and brute
force for the DP (never over budget on the chain as measured; no dearer than the optimum of the
bound it plans on; the bound is one on every plan).
"""
from dataclasses import replace

import numpy as np
import pytest
import torch
import torch.nn as nn
from brute_plans import all_plans
from unkept_nets import B, D, InPlaceNet, SeqNet, _grads, _measured_peak, _nested, _profiled

from ckplan.planner import Plan, chain_from_profile, min_peak, plan_chain, plan_none, simulate, trace
from ckplan.planner.plan import Checkpoint, Store, items_from_ranges
from ckplan.planner.simulate import peak_of
from ckplan.planner.solve.unkept_dp import DirectDP, direct_applies
from ckplan.planner.synthetic import random_chain


class CenterNorm(nn.Module):
    """LayerNorm written out as Cohere writes it: saves ``x - mean`` and the scale, not ``x``."""

    def forward(self, x):
        c = x - x.mean(-1, keepdim=True)
        return c * torch.rsqrt(c.pow(2).mean(-1, keepdim=True) + 1e-5)


class ParallelBlock(nn.Module):
    """Cohere's block shape: x + attn(norm(x)) + mlp(norm(x)), here with two Linears."""

    def __init__(self):
        super().__init__()
        self.norm, self.a, self.m = CenterNorm(), nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, x):
        h = self.norm(x)
        return x + self.a(h) + torch.tanh(self.m(h))


class CohereLike(nn.Module):
    def __init__(self, n=4):
        super().__init__()
        self.stem = nn.Linear(D, D)
        self.layers = nn.ModuleList(ParallelBlock() for _ in range(n))
        self.norm = CenterNorm()

    def forward(self, x):
        x = self.stem(x)
        for layer in self.layers:
            x = layer(x)
        return self.norm(x).pow(2).mean()


@pytest.mark.parametrize("which", ["sequential", "cohere-like"])
def test_every_plan_peaks_as_predicted_where_outputs_are_not_kept(which):
    torch.manual_seed(0)
    model = SeqNet() if which == "sequential" else CohereLike(n=3)
    x, prof = _profiled(model, "body" if which == "sequential" else "layers")
    kept = [r.output_kept for r in prof.chain_layers]
    if which == "sequential":  # Linear outputs: read by an activation that saves its own output
        assert kept == [False, True, False, True]
    else:  # no block saves its input, and neither does the final norm
        assert kept == [False] * 3
    # the stem's output: the first Linear saves it; the first parallel block does not
    assert prof.pre.output_kept is (which == "sequential")
    chain = chain_from_profile(prof)
    assert not chain.all_kept
    p = chain.persistent_bytes
    n = chain.n_layers
    ref = _grads(model, x)
    bound_wrong = exact_nested = nested = 0
    for items in all_plans(n):
        plan = Plan("custom", n, items)
        measured = _measured_peak(model, x, plan)
        predicted = simulate(chain, plan).peak_bytes - p
        if _nested(items):
            # never under; over by at most the bias gradient a nested checkpoint's next layer
            # allocates after the boundary is last read, inside a recompute (README: known limits)
            assert measured <= predicted <= measured + D * 4, plan.describe()
            exact_nested += predicted == measured
            nested += 1
        else:
            assert predicted == measured, plan.describe()
            bound_wrong += simulate(chain.conservative(), plan).peak_bytes - p != measured
    assert bound_wrong > 0  # the oracle can fail: rotor's model misses some of these plans
    # the forward without saving counts an output no op keeps once (not in the transient measured
    # without it and again as live), and a nested checkpoint's input inside a recompute goes once
    # read: at most 8 of the 56 nested plans of the sequential chain are over, by 128 B
    assert exact_nested * 5 >= nested * 4, (exact_nested, nested)
    for r in ("dp", "chen", "sqrtn"):
        got = _grads(model, x, plan_chain(chain, r, min_peak(chain)).plan)
        assert all(torch.equal(a, b) for a, b in zip(ref, got)), r


def test_sequential_without_checkpoints_is_no_longer_overstated():
    # Every Linear's output is freed once its activation has run: 12 boundaries, 6 of them kept.
    torch.manual_seed(0)
    model = SeqNet(acts=("relu",) * 6)
    x, prof = _profiled(model, "body")
    chain = chain_from_profile(prof)
    none = Plan("none", chain.n_layers, items_from_ranges(chain.n_layers, []))
    measured = _measured_peak(model, x, none)
    assert simulate(chain, none).peak_bytes - chain.persistent_bytes == measured
    assert prof.totals.predicted_peak_bytes == simulate(chain, none).peak_bytes


def _unkept_chain(seed: int, n: int = 5, own: bool = False):
    """Layers whose output no op keeps (seed's bits); with ``own``, the others' outputs kept by
    their own ops only (``x_kept_next`` False) on every other layer."""
    ch = random_chain(n, seed, max_size=100_000)
    flags = [(seed >> i) & 1 == 0 for i in range(n)]
    layers = tuple(replace(ly, x_kept_next=not (own and i % 2 == seed % 2)) if keep else
                   replace(ly, x_kept=False, xbar_bytes=ly.xbar_bytes - ly.x_bytes // 2)
                   for i, (ly, keep) in enumerate(zip(ch.layers, flags)))
    pre = replace(ch.pre, x_kept=seed % 3 != 0)
    return replace(ch, layers=layers, pre=pre)


def test_simulator_holds_a_checkpoint_input_and_releases_its_unread_boundary():
    ch = _unkept_chain(0b01010)  # layers 1 and 3 keep their outputs, 0, 2, 4 do not
    assert [ly.x_kept for ly in ch.layers] == [True, False, True, False, True]
    x = [ly.x_bytes for ly in ch.layers]
    # Store(1), then [2, 4): the checkpoint keeps x[1], which no op of the plain forward saves;
    # its boundary x[3] is read by Store(4) and saved by nobody: freed once read
    ev = trace(ch, Plan("c", 5, items_from_ranges(5, [(2, 4)])))
    labels = [e.label for e in ev]
    i = labels.index("[2,4) keeps its input x[1]")
    assert ev[i].mem_bytes == ev[i - 1].mem_bytes + x[1]
    j = labels.index("boundary x[3] of [2,4) freed (nothing after it saves it)")
    assert ev[j].mem_bytes == ev[j - 1].mem_bytes - x[3]
    assert "free boundary x[3] of [2,4)" not in labels  # not freed twice
    k = labels.index("input x[1] of [2,4) freed")
    assert labels[k - 1] == "B(layer 2) during recompute of [2,4)" and labels[k + 1] == "B(layer 1)"
    # a checkpoint after another one: the boundary is its input, kept by it; nothing added
    ev = trace(ch, Plan("c", 5, items_from_ranges(5, [(0, 2), (2, 4)])))
    assert not any("keeps its input" in e.label for e in ev)


@pytest.mark.parametrize("seed,own", [(s, False) for s in range(8)] + [(s, True) for s in range(4)])
def test_dp_fits_on_the_chain_and_is_no_dearer_than_the_optimum_of_its_bound(seed, own):
    n = 5
    ch = _unkept_chain(seed * 7 + 1, n, own)
    cons = ch.conservative()
    assert cons.all_kept
    exact = [peak_of(ch, items) for items in all_plans(n)]
    bound = [peak_of(cons, items) for items in all_plans(n)]
    for (real, _), (upper, _) in zip(exact, bound):  # the bound is one, on every plan
        assert real <= upper
    lo = min_peak(ch)
    assert min(p for p, _ in exact) <= lo <= min(p for p, _ in bound)
    assert any(p == lo for p, _ in exact)  # a plan reaches it
    none_peak = simulate(ch, Plan("none", n, items_from_ranges(n, []))).peak_bytes
    for budget in sorted({lo, (lo + none_peak) // 2, none_peak - 1, none_peak}):
        if budget < lo:
            continue
        got = plan_chain(ch, "dp", budget)
        assert got.score.peak_bytes <= budget
        opt_bound = min((r for (_, r), (u, _) in zip(exact, bound) if u <= budget), default=None)
        if opt_bound is not None:
            assert got.score.recompute_ms <= opt_bound + 1e-9
        # a chain this short: every plan tried, so dp is the optimum on the chain itself
        assert got.score.recompute_ms == pytest.approx(min(r for p, r in exact if p <= budget), abs=1e-9)
        assert got.exact


@pytest.mark.parametrize("seed,n", [(s, n) for n in (6, 7) for s in (3, 11, 26, 40)])
def test_dp_is_the_optimum_on_short_chains_with_unkept_outputs(seed, n):
    """Every plan of rotor's grammar simulated on the chain itself (brute force): at every
    distinct peak some plan reaches, dp's plan fits and costs the least that fits (the bound that
    keeps every boundary misses plans whose checkpoint drops an unkept output: 23% dearer on an
    8-layer nn.Sequential before its plans were improved on the chain)."""
    ch = _unkept_chain(seed, n)
    scores = [peak_of(ch, items) for items in all_plans(n)]
    lo = min(p for p, _ in scores)
    assert min_peak(ch) == lo
    peaks = sorted({p for p, _ in scores})
    for budget in peaks[:: max(1, len(peaks) // 15)]:
        got = plan_chain(ch, "dp", budget)
        assert got.score.peak_bytes <= budget
        assert got.score.recompute_ms == pytest.approx(min(r for p, r in scores if p <= budget), abs=1e-9)


def _varied(ch, seed: int):
    """``ch`` with sizes real profiles add, drawn at random: early stops, tails, no-save peaks,
    in-place layers, input copies and, on some chains, a break."""
    rng = np.random.default_rng(seed)
    layers = []
    for ly in ch.layers:
        kw = {}
        if rng.random() < 0.5:
            ex = int(rng.integers(0, ly.xbar_bytes + 1))
            et = int(rng.integers(0, ly.xbar_bytes + ly.fwd_tmp_bytes - ex + 1))
            kw.update(early_xbar_bytes=ex, early_fwd_tmp_bytes=et)
        if rng.random() < 0.5:
            kw["tail_ms"] = float(rng.uniform(0, ly.fwd_ms))
        if rng.random() < 0.5:
            kw["nosave_peak_bytes"] = int(ly.x_bytes + rng.integers(0, 3 * ly.fwd_tmp_bytes + 1000))
        u = rng.random()
        if u < 0.15:
            kw = {k: v for k, v in kw.items() if not k.startswith("early")}
            kw.update(in_place=True, xbar_bytes=int(rng.integers(0, ly.xbar_bytes + 1)))
        elif u < 0.3:
            kw["copies_input"] = True
        layers.append(replace(ly, **kw))
    breaks = (int(rng.integers(1, ch.n_layers)),) if rng.random() < 0.3 else ()
    return replace(ch, layers=tuple(layers), breaks=breaks)


def _brute(ch):
    """(peak, recompute) of every plan of rotor's grammar that spans none of the chain's breaks."""
    def spans(items):
        return any(isinstance(it, Checkpoint) and any(it.start < b < it.stop for b in ch.breaks)
                   for it, _ in Plan("x", ch.n_layers, items).walk())
    return [peak_of(ch, items) for items in all_plans(ch.n_layers) if not spans(items)]


def _check_optimal(ch, scores, budgets):
    assert min_peak(ch) == min(p for p, _ in scores)
    for budget in budgets:
        got = plan_chain(ch, "dp", budget)
        assert got.exact and got.score.peak_bytes <= budget
        assert got.score.recompute_ms == pytest.approx(min(r for p, r in scores if p <= budget), abs=1e-9)


@pytest.mark.parametrize("seed,n", [(s, n) for n in (5, 6) for s in range(1, 40, 6)])
def test_the_dp_on_the_chain_is_exact_with_the_sizes_profiles_add(seed, n):
    """solve/unkept_dp.py against brute force at up to 40 of the distinct peaks plans reach, on
    chains with early stops, tails, no-save peaks, in-place layers, input copies and breaks."""
    ch = _varied(_unkept_chain(seed * 7 + 1, n, own=seed % 3 == 2), seed)
    scores = _brute(ch)
    peaks = sorted({p for p, _ in scores})
    _check_optimal(ch, scores, peaks[:: max(1, len(peaks) // 40)])


@pytest.mark.parametrize("seed,own", [(8079, True), (8116, False)] + [
    pytest.param(s, own, marks=pytest.mark.slow) for s, own in ((8005, False), (8042, False), (8153, False),
                                                                (8190, True), (8227, False), (8301, True))])
def test_dp_is_the_optimum_on_8_layer_chains_with_unkept_outputs(seed, own):
    """Every plan of 8 layers (41,586) simulated: dp reaches the smallest peak and costs the least
    at 15 budgets or so. Planned on the bound and improved there, dp was 29% dearer on the first
    chain and found no plan at its smallest peak on the second."""
    ch = _unkept_chain(seed, 8, own)
    scores = _brute(ch)
    peaks = sorted({p for p, _ in scores})
    _check_optimal(ch, scores, peaks[:: max(1, len(peaks) // 15)])


def test_chains_the_dp_does_not_model_are_planned_by_trying_every_plan():
    ch = _unkept_chain(11, 6)
    ch = replace(ch, layers=tuple(replace(ly, unsaved_kept_bytes=5_000) if i == 2 else ly
                                  for i, ly in enumerate(ch.layers)))
    assert not direct_applies(ch)
    scores = _brute(ch)
    peaks = sorted({p for p, _ in scores})
    _check_optimal(ch, scores, peaks[:: max(1, len(peaks) // 15)])


def test_the_bound_and_random_plans_are_never_cheaper_than_the_dp_on_longer_chains():
    """At 20 layers (past UNKEPT_DIRECT_LAYERS, planned on the bound) dp's plans and 1,500 random
    plans of rotor's grammar are no cheaper than the DP on the chain itself, at every budget."""
    rng = np.random.default_rng(5)

    def seq(s, e, last_free):
        out = []
        while s < e:
            stops = [j for j in range(s + 2, e + 1) if j < e or last_free]
            if not stops or rng.random() < 0.6:
                out.append(Store(s))
                s += 1
                continue
            j = int(rng.choice(stops))
            out.append(Checkpoint(s, j, tuple(seq(s, j, False))))
            s = j
        return out

    ch = _unkept_chain(77, 20)
    exact = DirectDP(ch)
    samples = [peak_of(ch, tuple(seq(0, 20, True))) for _ in range(1500)]
    lo, hi = exact.min_peak(), simulate(ch, plan_none(20)).peak_bytes
    assert lo <= min_peak(ch)
    for budget in (lo + (hi - lo) * f // 10 for f in range(10)):
        found = exact.solve(budget)
        assert found is not None
        peak, recompute = peak_of(ch, found[0])
        assert peak <= budget and recompute == pytest.approx(found[1], abs=1e-9)
        assert all(r >= found[1] - 1e-9 for p, r in samples if p <= budget)
        if budget >= min_peak(ch):
            assert plan_chain(ch, "dp", budget).score.recompute_ms >= found[1] - 1e-9


def test_a_selective_option_after_an_unkept_output_holds_it():
    ch = random_chain(4, 9, max_size=100_000, options=1)
    ch = replace(ch, layers=(replace(ch.layers[0], x_kept=False),) + ch.layers[1:])
    name = ch.layers[1].options[0].name
    plan = Plan("c", 4, (Store(0), Store(1, name), Store(2), Store(3)))
    labels = [e.label for e in trace(ch, plan)]
    assert "[1,2) keeps its input x[0]" in labels and "input x[0] of [1,2) freed" in labels
    inner = Plan("c", 4, (Checkpoint(0, 3, (Store(0), Store(1, name), Store(2))), Store(3)))
    assert "[1,2) keeps its input x[0]" in [e.label for e in trace(ch, inner)]


def test_old_profiles_without_the_flag_read_as_kept():
    torch.manual_seed(0)
    model = SeqNet()
    _, prof = _profiled(model, "body")
    d = prof.to_dict()
    for row in d["layers"]:
        row.pop("output_kept")
    back = type(prof).from_dict(d)
    assert all(r.output_kept is None for r in back.chain_layers)
    assert chain_from_profile(back).all_kept
    assert type(prof).from_dict(prof.to_dict()) == prof


@pytest.mark.slow
def test_in_place_layers_run_under_every_plan_and_peak_as_predicted():
    # A checkpoint starting at ReLU(inplace=True) would save the tensor the ReLU then changes, and
    # PyTorch would refuse the backward ("modified by an inplace operation"). The executor gives
    # such a layer a copy there; elsewhere it runs in place, and its output is counted once
    # (counted twice, none would be predicted 28% high on a VGG-style chain).
    torch.manual_seed(0)
    model = InPlaceNet()
    x, prof = _profiled(model, "body")
    assert [r.output_in_place for r in prof.chain_layers] == [False, False, True, False, True]
    chain = chain_from_profile(prof)
    assert not chain.all_kept  # the DP plans on the bound (in-place outputs counted)
    p, n = chain.persistent_bytes, chain.n_layers
    ref = _grads(model, x)
    for items in all_plans(n):
        plan = Plan("custom", n, items)
        got = _grads(model, x, plan)  # BatchNorm's running stats move: same batch, same grads
        assert all(torch.allclose(a, b, rtol=0, atol=1e-6) for a, b in zip(ref, got)), plan.describe()
        measured = _measured_peak(model, x, plan)
        predicted = simulate(chain, plan).peak_bytes - p
        if _nested(items):
            # a nested checkpoint inside a recompute starting at an in-place layer gets a copy,
            # and its input goes once copied: held longer in the prediction (README: known limits)
            assert measured <= predicted <= measured + B * D * 4, plan.describe()
        else:
            assert predicted == measured, plan.describe()
    for budget in (min_peak(chain), simulate(chain, plan_chain(chain, "none").plan).peak_bytes - 1):
        assert plan_chain(chain, "dp", budget).score.peak_bytes <= budget


def test_a_stored_layer_keeps_its_output_unless_flagged():
    ch = random_chain(3, 1, max_size=1000)
    low = replace(ch.layers[1], xbar_bytes=ch.layers[1].x_bytes - 1)
    with pytest.raises(ValueError, match="xbar"):
        replace(ch, layers=(ch.layers[0], low, ch.layers[2]))
    for flagged in (replace(low, x_kept=False), replace(low, in_place=True)):
        replace(ch, layers=(ch.layers[0], flagged, ch.layers[2]))  # accepted
