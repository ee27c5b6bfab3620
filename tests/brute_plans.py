"""Brute force over every checkpoint plan of a small chain: the oracle the planner's tests (and the
memory-model tests that plan) check dp against."""
from __future__ import annotations

import math
from functools import cache

import pytest

from ckplan.planner import (
    Plan,
    min_peak,
    min_peak_plan,
    plan_chain,
    plan_none,
    simulate,
)
from ckplan.planner.chain import Chain
from ckplan.planner.plan import Checkpoint, Store
from ckplan.planner.simulate import peak_of
from ckplan.planner.solve import DPSolver

EXACT = 10**9  # slots enough for exact gcd-sized slots on small chains


def all_plans(n: int, general: bool = False):
    """Every item sequence covering [0, n).

    Rotor's grammar (``general=False``): inside a checkpoint's inner sequence the last layer is
    never checkpointed again. ``general=True``: any nesting, only forbidding an inner sequence
    that is one checkpoint of its whole range (what ``Plan`` accepts).
    """

    @cache
    def seqs(s: int, e: int, last_free: bool, whole_ok: bool = True) -> tuple:
        if s == e:
            return ((),)
        out = [(Store(s),) + rest for rest in seqs(s + 1, e, last_free)]
        for j in range(s + 1, e + 1):
            if j == e and not (last_free and whole_ok):
                continue
            for inner in seqs(s, j, general, False):
                for rest in seqs(j, e, last_free):
                    out.append((Checkpoint(s, j, inner),) + rest)
        return tuple(out)

    return seqs(0, n, True)


def brute_scores(chain: Chain, general: bool = False) -> list[tuple[int, float, tuple]]:
    return [(*peak_of(chain, items), items) for items in all_plans(chain.n_layers, general)]


def brute_best(scores, budget: int) -> float:
    fit = [r for p, r, _ in scores if p <= budget]
    return min(fit) if fit else math.inf


def _check_against_brute(chain: Chain, general: bool = False) -> None:
    scores = brute_scores(chain, general)
    lowest = min(p for p, _, _ in scores)
    assert min_peak(chain) == lowest
    assert simulate(chain, min_peak_plan(chain)).peak_bytes == lowest
    solver = DPSolver(chain, max_slots=EXACT)
    assert solver.exact
    for budget in sorted({p for p, _, _ in scores} | {lowest - 1}):
        want = brute_best(scores, budget)
        plan = solver.solve(budget) if budget < solver.none_peak else plan_none(chain.n_layers)
        if want == math.inf:
            assert plan is None
            continue
        sc = simulate(chain, plan)
        assert sc.peak_bytes <= budget
        assert sc.recompute_ms == pytest.approx(want, rel=1e-9, abs=1e-9), (budget, plan.describe())


def check_plan_chain_against_brute(chain: Chain) -> None:
    """``plan_chain(chain, "dp", b)`` (the exact-bytes tables, as the CLI plans) at every
    brute-force peak ``b``: never over budget, recompute equal to the brute-force optimum; and
    ``min_peak`` equal to the least brute-force peak. Plans with a checkpoint across one of the
    chain's breaks (``Chain.breaks``) are not plans of that chain and are left out."""
    def spans_break(items) -> bool:
        return any(isinstance(it, Checkpoint) and any(it.start < b < it.stop for b in chain.breaks)
                   for it, _ in Plan("x", chain.n_layers, items).walk())
    scores = [peak_of(chain, items) for items in all_plans(chain.n_layers) if not spans_break(items)]
    assert min_peak(chain) == min(p for p, _ in scores)
    for b in sorted({p for p, _ in scores}):
        want = min(r for p, r in scores if p <= b)
        res = plan_chain(chain, "dp", b)
        assert res.score.peak_bytes <= b
        assert res.score.recompute_ms == pytest.approx(want, rel=1e-9, abs=1e-9), (b, res.plan.describe())


def check_long_chain_fits(chain: Chain) -> None:
    """A long chain (grouped tables): min_peak_plan reaches min_peak, and dp fits its budget near
    the smallest peak and a third of the way up."""
    lo = min_peak(chain)
    assert simulate(chain, min_peak_plan(chain)).peak_bytes == lo
    hi = simulate(chain, plan_none(chain.n_layers)).peak_bytes
    for f in (0.0, 0.01, 0.3):
        b = int(lo + f * (hi - lo))
        assert plan_chain(chain, "dp", b).score.peak_bytes <= b
