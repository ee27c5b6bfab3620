"""planner/frontier.py: each strategy's memory/time frontier. Oracles: the DP at each budget
alone, every baseline point, and the simulator."""
from __future__ import annotations

import pytest

from ckplan.errors import UsageError
from ckplan.planner import STRATEGIES, min_peak, plan_none, simulate, sweep
from ckplan.planner.baselines import chen_grid
from ckplan.planner.synthetic import random_chain, uniform_chain


def test_sweep_frontiers():
    ch = random_chain(20, 9)
    rows = sweep(ch, STRATEGIES, n_points=8)
    by = {s: [r for r in rows if r.strategy == s] for s in STRATEGIES}
    assert len(by["none"]) == 1 and by["none"][0].recompute_ms == 0
    assert len(by["sqrtn"]) == 1 and len(by["chen"]) == len(chen_grid(ch))
    assert [r.k for r in by["every-k"]] == list(range(1, 17)) + [20]
    dp = by["dp"]
    assert len(dp) >= 8 and dp[0].budget_bytes == min_peak(ch)
    # dp is also evaluated exactly at every affordable baseline point's own peak
    lo, hi = min_peak(ch), simulate(ch, plan_none(20)).peak_bytes
    assert {r.peak_bytes for r in rows if r.strategy != "dp" and lo <= r.peak_bytes <= hi} <= \
        {d.budget_bytes for d in dp}
    assert dp[-1].budget_bytes == simulate(ch, plan_none(20)).peak_bytes and dp[-1].recompute_ms == 0
    assert all(r.peak_bytes <= r.budget_bytes for r in dp)
    assert all(a.recompute_ms >= b.recompute_ms for a, b in zip(dp, dp[1:]))
    # the DP frontier lies on or below every baseline point it can afford
    for r in rows:
        if r.strategy != "dp":
            affordable = [d.recompute_ms for d in dp if d.budget_bytes >= r.peak_bytes]
            assert not affordable or min(affordable) <= r.recompute_ms + 1e-9
    assert set(dp[0].to_dict()) >= {"strategy", "budget_bytes", "peak_bytes", "recompute_ms"}


@pytest.mark.parametrize("n_layers,banded", [(6, False), (70, True)])
def test_sweep_solves_once_per_distinct_plan(monkeypatch, n_layers, banded):
    # Oracle: the DP at each budget alone. Many more points than plans cost one DP per plan.
    from ckplan.planner import frontier
    from ckplan.planner import solve as dp_module
    ch = random_chain(n_layers, 3, scale=1000)
    calls = []
    solve, plan_chain_ = dp_module.DPSolver.solve, frontier.plan_chain
    monkeypatch.setattr(dp_module.DPSolver, "solve", lambda self, b: calls.append(b) or solve(self, b))
    monkeypatch.setattr(frontier, "plan_chain", lambda *a, **k: calls.append(a) or plan_chain_(*a, **k))
    points = 2000 if not banded else 300
    rows = [r for r in sweep(ch, ["dp"], n_points=points) if r.strategy == "dp"]
    distinct = {(r.peak_bytes, r.recompute_ms) for r in rows}
    assert len(rows) >= points * 0.9 and len(calls) <= 2 * len(distinct) + 2
    for r in rows[:: max(1, len(rows) // 12)]:
        alone = plan_chain_(ch, "dp", r.budget_bytes)
        assert r.peak_bytes <= r.budget_bytes and r.recompute_ms <= alone.score.recompute_ms + 1e-9


@pytest.mark.parametrize("points", [1, 10_001, 10**8])
def test_sweep_points_outside_the_limit_are_refused(points):
    with pytest.raises(UsageError, match=f"n_points {points} is not a number of budgets from 2 to 10000"):
        sweep(uniform_chain(4, x_bytes=100), ["dp"], n_points=points)
