"""Selective options in the DP against brute force over every plan and every option.

Oracle: every nested plan of rotor's grammar (as in test_planner_dp.py) times every assignment
of an option (``store`` or one of the layer's selective options) to every layer, each scored by
the simulator. Every layer is stored exactly once in a plan, so the assignments are all
distinct plans. Chains are random with sizes up to ~1000 bytes that share no divisor, so the
exact-bytes DP (not slots) is what is checked.
"""
from __future__ import annotations

import pytest
from brute_options import SIZE, check_against_brute
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckplan.errors import InfeasibleBudgetError, SpecError
from ckplan.planner import (
    Plan,
    compare,
    min_peak,
    min_peak_plan,
    plan_chain,
    plan_dp,
    plan_none,
    simulate,
    sweep,
)
from ckplan.planner.chain import Chain
from ckplan.planner.plan import Store
from ckplan.planner.simulate import peak_of
from ckplan.planner.solve import OPTIONS_IGNORED
from ckplan.planner.synthetic import random_chain, with_casts, with_options, with_tails


def option_chains(max_n: int):
    return st.builds(lambda n, seed, k: random_chain(n, seed, max_size=SIZE, options=k),
                     st.integers(1, max_n), st.integers(0, 2**32), st.integers(2, 3))


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(option_chains(4))
def test_dp_with_options_equals_brute_force(chain):
    check_against_brute(chain)


@pytest.mark.slow
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(option_chains(4), st.integers(0, 2**32))
def test_dp_with_options_and_tails_equals_brute_force(chain, seed):
    """The exact frontiers and the gcd-slot table with layer tails (a checkpoint ending at a
    layer does not redo its tail), options on: the simulator's recompute on every plan."""
    check_against_brute(with_tails(chain, seed))


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.builds(lambda n, seed: with_tails(random_chain(n, seed, max_size=SIZE), seed),
                 st.integers(1, 5), st.integers(0, 2**32)))
def test_exact_dp_with_tails_equals_brute_force(chain):
    check_against_brute(chain)


@pytest.mark.slow  # 15-20 s each; the hypothesis test above covers up to 4 layers by default
@pytest.mark.parametrize("seed", [1, 2])
def test_dp_with_options_equals_brute_force_five_layers(seed):
    """394 plans x 3^5 option assignments per chain."""
    check_against_brute(random_chain(5, seed, max_size=SIZE, options=2))


def test_options_lower_the_smallest_peak_and_are_used():
    """Across seeds, options often lower the smallest peak (never raise it), and the DP's plans
    then use them."""
    lowered = 0
    for seed in range(20):
        ch = random_chain(6, seed, max_size=SIZE, options=2)
        plain = ch.without_options()
        assert min_peak(ch) <= min_peak(plain)
        if min_peak(ch) < min_peak(plain):
            lowered += 1
            assert min_peak_plan(ch).uses_options
            assert plan_chain(ch, "dp").plan.uses_options
            with pytest.raises(InfeasibleBudgetError):
                plan_chain(plain, "dp", min_peak(ch))
        # never worse than without options at any budget
        hi = simulate(ch, plan_none(6)).peak_bytes
        for t in range(5):
            b = min_peak(plain) + (hi - min_peak(plain)) * t // 5
            with_o, without = plan_chain(ch, "dp", b), plan_chain(plain, "dp", b)
            assert with_o.fits and with_o.score.recompute_ms <= without.score.recompute_ms + 1e-9
    assert lowered >= 3


def test_unit_option_columns_match_the_simulator():
    """A single stored layer: the option's hold and needs as the simulator sees them."""
    ch = random_chain(1, 3, max_size=SIZE, options=3)
    for o in ch.layers[0].options:
        p = Plan("dp", 1, (Store(0, o.name),))
        alone = simulate(ch, p)
        as_layer = simulate(ch.without_options().__class__(
            (ch.layers[0].option(o.name),), ch.pre, ch.post, ch.x_in_bytes, ch.delta_in_bytes,
            ch.persistent_bytes, ch.opt_step_peak_bytes), plan_none(1))
        assert alone.peak_bytes == as_layer.peak_bytes
        assert alone.recompute_ms == pytest.approx(o.recompute_ms)


def test_slot_and_grouped_tables_plan_without_options():
    ch = random_chain(8, 11, max_size=SIZE, options=2)
    plain = ch.without_options()
    lo, lo_plain = min_peak(ch), min_peak(plain)
    hi = simulate(ch, plan_none(8)).peak_bytes
    mid = (lo_plain + hi) // 2
    # rounded slots on single layers take options too; the plan fits, no worse than without
    for b in (lo, (lo + lo_plain) // 2, mid):
        res = plan_dp(ch, b, max_slots=400)
        assert OPTIONS_IGNORED not in res.notes and not res.exact
        assert simulate(ch, res.plan).peak_bytes <= b
        if b >= lo_plain:
            assert (simulate(ch, res.plan).recompute_ms
                    <= simulate(ch, plan_dp(plain, b, max_slots=400).plan).recompute_ms + 1e-9)
    # grouped: fits, and below the smallest peak without options it falls back to options
    for b in sorted({lo, (lo + lo_plain) // 2, mid}):
        r = plan_dp(ch, b, mode="grouped", groups=3)
        assert simulate(ch, r.plan).peak_bytes <= b and not r.exact
        if b < lo_plain:  # planned by the fallback, with options: the tables' note is not shown
            assert r.plan.uses_options and OPTIONS_IGNORED not in r.notes
        else:
            assert OPTIONS_IGNORED in r.notes
    # autocast copies: min_peak as without options; the plans may take them (test_planner_cast.py)
    cast = with_casts(ch, 5)
    assert min_peak(cast) == min_peak(cast.without_options())
    r = plan_dp(cast, (min_peak(cast) + hi) // 2)
    assert OPTIONS_IGNORED not in r.notes


def _selective_oracle(chain: Chain, budget: int | None) -> tuple[int, float]:
    """(peak, recompute) the selective strategy must return: over the policies on every layer,
    the fastest all-layers plan that fits, else the lowest peak."""
    names = set.intersection(*({o.name for o in ly.options} for ly in chain.layers))
    scored = [peak_of(chain, tuple(Store(i, nm) for i in range(chain.n_layers))) for nm in names]
    fit = [s for s in scored if budget is not None and s[0] <= budget]
    if fit:
        return min(fit, key=lambda s: (s[1], s[0]))
    return min(scored)


@settings(max_examples=30, deadline=None)
@given(option_chains(8), st.floats(-0.1, 1.1))
def test_selective_strategy(chain, frac):
    hi = simulate(chain, plan_none(chain.n_layers)).peak_bytes
    lo = min_peak(chain)
    budget = int(lo + frac * (hi - lo))
    for b in (None, budget):
        r = plan_chain(chain, "selective", b)
        assert (r.score.peak_bytes, r.score.recompute_ms) == pytest.approx(_selective_oracle(chain, b))
        pol = r.plan.params["policy"]
        assert r.plan.options() == (pol,) * chain.n_layers and r.plan.n_checkpoints == 0
        assert r.fits is (None if b is None else r.score.peak_bytes <= b)
        if b is not None and r.fits and b >= lo:  # dp is never worse than selective
            assert plan_chain(chain, "dp", b).score.recompute_ms <= r.score.recompute_ms + 1e-9


def test_selective_needs_options():
    ch = random_chain(5, 2)
    with pytest.raises(SpecError, match="this chain has none that pays"):
        plan_chain(ch, "selective")
    # compare and sweep leave it out on a chain without options, keep it on one with
    assert [r.strategy for r in compare(ch, ("dp", "selective"))] == ["dp"]
    assert not [p for p in sweep(ch, ("none", "selective")) if p.strategy == "selective"]
    opt = random_chain(5, 2, max_size=SIZE, options=3)
    assert [r.strategy for r in compare(opt, ("dp", "selective"))] == ["dp", "selective"]
    assert len([p for p in sweep(opt, ("selective",)) if p.strategy == "selective"]) == 3
    # options on some layers only: no policy common to every layer
    some = with_options(random_chain(5, 2), 1, share=0.5)
    if any(not ly.options for ly in some.layers):
        with pytest.raises(SpecError, match="every layer"):
            plan_chain(some, "selective")


def test_random_chain_without_options_is_unchanged():
    assert random_chain(7, 4) == random_chain(7, 4, options=0)
    assert random_chain(7, 4, options=2).without_options() == random_chain(7, 4)
