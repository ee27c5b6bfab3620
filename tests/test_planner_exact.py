"""The dp is exact at every budget, whatever the sizes.

Oracles: brute force over every nested plan (small chains, sizes in bytes that share no slot),
scored by the simulator at *every* distinct budget breakpoint; and, on 20-30 layer chains, the
slot DP on gcd-sized slots (an independent implementation, exact when sizes are small integers)
against the byte-level Pareto DP (``tables.ParetoTable``) at every budget from the smallest peak up.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
from brute_plans import brute_best, brute_scores

from ckplan.planner import min_peak, min_peak_plan, plan_chain, plan_dp, plan_none, simulate
from ckplan.planner.plan import Plan, items_from_ranges
from ckplan.planner.solve import DPSolver, layer_tables
from ckplan.planner.solve.solver import _slot_bound
from ckplan.planner.synthetic import random_chain
from ckplan.planner.tables import ParetoTable, base_bytes

WIDE = 1_000_003  # sizes up to a million bytes with gcd 1: slots cannot be exact


def _reference(chain) -> ParetoTable:
    """The byte-level frontier with no pruning (every budget up to the unrestricted peak)."""
    t = layer_tables(chain)
    top = simulate(chain, plan_none(chain.n_layers)).peak_bytes - base_bytes(chain)
    return ParetoTable(t.units, t.pairs, t.peaks.R, top)


@pytest.mark.parametrize("seed", range(12))
def test_dp_equals_brute_force_at_every_budget_breakpoint(seed):
    n = 4 + seed % 3  # 4..6 layers: up to 1806 plans, as many distinct peaks
    chain = random_chain(n, seed, max_size=WIDE)
    scores = brute_scores(chain)
    peaks = sorted({p for p, _, _ in scores})
    assert min_peak(chain) == peaks[0]
    solver = DPSolver(chain)
    assert solver.exact and solver.slot_bytes == 1
    for budget in sorted(set(peaks) | {p - 1 for p in peaks}):
        want = brute_best(scores, budget)
        plan = solver.solve(budget) if budget < solver.none_peak else plan_none(n)
        if want == math.inf:
            assert plan is None
            continue
        sc = simulate(chain, plan)
        assert sc.peak_bytes <= budget
        assert sc.recompute_ms == pytest.approx(want, rel=1e-9, abs=1e-9), budget
    # the public entry, one table per budget (pruned for that budget), at a sample of them
    for budget in peaks[:: max(1, len(peaks) // 25)]:
        res = plan_chain(chain, "dp", budget)
        assert res.fits and res.exact
        assert res.score.recompute_ms == pytest.approx(brute_best(scores, budget), rel=1e-9, abs=1e-9)


@pytest.mark.slow
@pytest.mark.parametrize("n,seed", [(20, 1), (25, 2), (30, 3)])
def test_pareto_equals_the_gcd_slot_dp(n, seed):
    """Two implementations, exact for different reasons, agree at every budget."""
    chain = random_chain(n, seed)  # small integer sizes: gcd slots are exact
    slots = DPSolver(chain, max_slots=10**9, pareto=False)
    assert slots.exact and slots.pareto is None
    exact = DPSolver(chain)
    assert exact.pareto is not None
    for b in range(min_peak(chain), slots.none_peak):
        ps, pe = slots.solve(b), exact.solve(b)
        se, ss = simulate(chain, pe), simulate(chain, ps)
        assert se.peak_bytes <= b
        assert se.recompute_ms == pytest.approx(ss.recompute_ms, rel=1e-9, abs=1e-9), b


@pytest.mark.parametrize("seed", [3, 0, 5])
def test_within_one_percent_of_the_reference_at_and_above_min_peak(seed):
    """30 wide layers at the smallest peak, where ``plan`` lands by default on CPU: the old
    slot DP recomputed 5.6% more than the optimum on seed 3."""
    n = 30
    chain = random_chain(n, seed, max_size=WIDE)
    ref = _reference(chain)
    lo = min_peak(chain)
    hi = simulate(chain, plan_none(n)).peak_bytes
    for b in [lo, lo + 1, lo + (hi - lo) // 1000, lo + (hi - lo) // 100, lo + (hi - lo) // 10]:
        res = plan_chain(chain, "dp", b)
        assert res.fits and res.exact and res.slot_bytes == 1
        want = ref.cost(b - base_bytes(chain))
        assert res.score.recompute_ms <= want * 1.01 + 1e-9, (b, res.score.recompute_ms, want)
        # the reference's own plan is what it says
        plan = Plan("dp", n, items_from_ranges(n, ref.ranges(b - base_bytes(chain))))
        sc = simulate(chain, plan)
        assert sc.peak_bytes <= b and sc.recompute_ms == pytest.approx(want, rel=1e-9)


def test_pruned_tables_answer_like_the_full_one():
    """Budget-bounded tables (plan_dp) and the cost bound prune nothing an optimal plan uses."""
    chain = random_chain(24, 11, max_size=WIDE)
    ref = _reference(chain)
    lo = min_peak(chain)
    hi = simulate(chain, plan_none(24)).peak_bytes
    for b in np.linspace(lo, hi - 1, 9).astype(int):
        res = plan_dp(chain, int(b))
        assert res.exact
        sc = simulate(chain, res.plan)
        assert sc.peak_bytes <= b
        assert sc.recompute_ms == pytest.approx(ref.cost(int(b) - base_bytes(chain)), rel=1e-9, abs=1e-9)


@pytest.mark.parametrize("seed, options", [(0, 0), (1, 2), (2, 1)])
def test_slot_bound_prunes_nothing_an_optimal_plan_uses(seed, options):
    """From 40 layers the exact tables are bounded by the slot table's plan (``_slot_bound``):
    a plan that fits, so never below the optimum, and the bounded tables still answer it."""
    n = 44
    chain = random_chain(n, seed, max_size=WIDE, options=options)
    ref = _reference(chain)
    lo = min_peak(chain)
    hi = simulate(chain, plan_none(n)).peak_bytes
    for b in [lo, lo + (hi - lo) // 100, lo + (hi - lo) // 10, lo + (hi - lo) // 2]:
        want = ref.cost(b - base_bytes(chain))
        assert want * (1 - 1e-9) <= _slot_bound(chain, b) < math.inf
        res = plan_dp(chain, b)
        assert res.exact and res.plan.params["budget_bytes"] == b
        sc = simulate(chain, res.plan)
        assert sc.peak_bytes <= b
        assert sc.recompute_ms == pytest.approx(want, rel=1e-9, abs=1e-9)


@pytest.mark.slow
def test_long_chain_near_min_peak_is_within_five_percent():
    """Over 120 layers the DP groups layers; at the smallest peak it must do better than the bare
    smallest-peak plan (+61% here). Reference: the exact DP on layers, bounded to the budget."""
    n = 130
    chain = random_chain(n, 0, max_size=WIDE)
    lo = min_peak(chain)
    res = plan_chain(chain, "dp", lo)
    assert res.fits and not res.exact
    t = layer_tables(chain)
    bare = simulate(chain, min_peak_plan(chain, lo)).recompute_ms
    ref = ParetoTable(t.units, t.pairs, t.peaks.R, lo - base_bytes(chain), None, bare)
    want = ref.cost(lo - base_bytes(chain))
    assert res.score.recompute_ms <= want * 1.05
    assert res.score.recompute_ms < bare
