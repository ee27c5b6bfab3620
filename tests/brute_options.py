"""Brute force over every plan and every selective option per layer of a small chain: the oracle for
plans with options."""
from __future__ import annotations

import itertools
import math
from functools import cache

import numpy as np
import pytest

from ckplan.errors import InfeasibleBudgetError
from ckplan.planner import (
    Plan,
    min_peak,
    min_peak_plan,
    plan_dp,
    plan_none,
    simulate,
)
from ckplan.planner.chain import STORE, Chain
from ckplan.planner.plan import Checkpoint, Store
from ckplan.planner.simulate import peak_of
from ckplan.planner.solve import DPSolver

SIZE = 997  # sizes drawn up to this: they do not divide evenly


@cache
def plans(n: int) -> tuple:
    """Every item sequence of rotor's grammar covering [0, n) (a checkpoint never ends an
    inner sequence)."""

    @cache
    def seqs(s: int, e: int, last_free: bool) -> tuple:
        if s == e:
            return ((),)
        out = [(Store(s),) + rest for rest in seqs(s + 1, e, last_free)]
        for j in range(s + 1, e + 1):
            if j == e and not last_free:
                continue
            for inner in seqs(s, j, False):
                for rest in seqs(j, e, last_free):
                    out.append((Checkpoint(s, j, inner),) + rest)
        return tuple(out)

    return seqs(0, n, True)


def _assign(items: tuple, names: tuple[str, ...]) -> tuple:
    return tuple(Store(it.layer, names[it.layer]) if isinstance(it, Store)
                 else Checkpoint(it.start, it.stop, _assign(it.inner, names)) for it in items)


def brute(chain: Chain) -> list[tuple[int, float]]:
    """(peak, recompute) of every plan with every option of every layer."""
    choices = [(STORE, *(o.name for o in ly.options)) for ly in chain.layers]
    return [peak_of(chain, _assign(items, names))
            for items in plans(chain.n_layers) for names in itertools.product(*choices)]


class Best:
    """The least brute-force recompute at each budget (a running minimum over sorted peaks)."""

    def __init__(self, scores: list[tuple[int, float]]):
        arr = np.array(scores, dtype=np.float64)
        order = np.argsort(arr[:, 0], kind="stable")
        self.peaks = arr[order, 0]
        self.least = np.minimum.accumulate(arr[order, 1])

    def __call__(self, budget: int) -> float:
        k = int(np.searchsorted(self.peaks, budget, side="right")) - 1
        return math.inf if k < 0 else float(self.least[k])


def budgets(scores: list[tuple[int, float]]) -> list[int]:
    """Every distinct brute-force peak, one byte below each, and the midpoints between them."""
    peaks = sorted({p for p, _ in scores})
    return sorted(set(peaks) | {p - 1 for p in peaks} | {(a + b) // 2 for a, b in zip(peaks, peaks[1:])})


def check_against_brute(chain: Chain) -> None:
    scores = brute(chain)
    best = Best(scores)
    lowest = min(p for p, _ in scores)
    assert min_peak(chain) == lowest
    assert simulate(chain, min_peak_plan(chain)).peak_bytes == lowest
    solver = DPSolver(chain)
    assert solver.exact and solver.pareto is not None and not solver.options_ignored
    slots = DPSolver(chain, max_slots=10**9)  # the cost table in gcd slots (1 byte here)
    assert slots.exact and slots.pareto is None and not slots.options_ignored
    for b in budgets(scores):
        want = best(b)
        plan = solver.solve(b) if b < solver.none_peak else plan_none(chain.n_layers)
        if want == math.inf:
            assert plan is None
            continue
        assert plan is not None
        sc = simulate(chain, plan)
        assert sc.peak_bytes <= b
        assert sc.recompute_ms == pytest.approx(want, rel=1e-9, abs=1e-9), (b, plan.describe())
        if b < slots.none_peak:
            sp = slots.solve(b)
            assert sp is not None
            ss = simulate(chain, sp)
            assert ss.peak_bytes <= b and ss.recompute_ms == pytest.approx(want, rel=1e-9, abs=1e-9)
        assert simulate(chain, min_peak_plan(chain, b)).peak_bytes <= max(b, lowest)
        back = Plan.from_dict(plan.to_dict())
        assert back == plan and back.options() == plan.options()
    # the public entry at a few budgets (each builds its own table, pruned for that budget)
    for b in budgets(scores)[:: max(1, len(scores) // 5)][:6]:
        if b < lowest:
            with pytest.raises(InfeasibleBudgetError) as err:
                plan_dp(chain, b)
            assert err.value.min_peak_bytes == lowest
            continue
        res = plan_dp(chain, b)
        sc = simulate(chain, res.plan)
        assert res.exact and sc.peak_bytes <= b
        assert sc.recompute_ms == pytest.approx(best(b), rel=1e-9, abs=1e-9)
