"""Baseline strategies, the public entry points, and the sweep."""
from __future__ import annotations

import itertools
import math
import subprocess
import sys

import pytest

from ckplan.errors import UsageError
from ckplan.planner import (
    STRATEGIES,
    min_peak,
    plan_chain,
    plan_chen,
    plan_every_k,
    plan_none,
    plan_sqrtn,
    simulate,
    sweep,
)
from ckplan.planner.baselines import chen_grid, plan_chen_threshold
from ckplan.planner.plan import Checkpoint, Plan, Store
from ckplan.planner.synthetic import random_chain, uniform_chain


def test_every_k_segments():
    p = plan_every_k(7, 3)
    assert p.describe() == "C[0,3){S0 S1 S2} C[3,6){S3 S4 S5} C[6,7){S6}"
    assert plan_every_k(3, 1).boundaries() == (0, 1, 2)
    assert plan_every_k(3, 5).describe() == "C[0,3){S0 S1 S2}"
    with pytest.raises(UsageError, match="k >= 1"):
        plan_every_k(3, 0)


def sequential_reference(n: int) -> list[tuple[int, int]]:
    """torch.utils.checkpoint.checkpoint_sequential's loop, written out (inclusive ends)."""
    segments = math.ceil(math.sqrt(n))
    size = n // segments
    ranges, end = [], -1
    for start in range(0, size * (segments - 1), size):
        end = start + size - 1
        ranges.append((start, end + 1))
    return ranges


@pytest.mark.parametrize("n", [1, 2, 3, 4, 10, 17, 24, 100])
def test_sqrtn_matches_checkpoint_sequential(n):
    p = plan_sqrtn(n)
    ckpts = [(it.start, it.stop) for it in p.items if isinstance(it, Checkpoint)]
    assert ckpts == sequential_reference(n)
    last = ckpts[-1][1] if ckpts else 0
    assert [it.layer for it in p.items if isinstance(it, Store)] == list(range(last, n))
    if n == 10:
        assert p.describe() == "C[0,2){S0 S1} C[2,4){S2 S3} C[4,6){S4 S5} S6 S7 S8 S9"


def test_chen_threshold_walk():
    ch = uniform_chain(10, x_bytes=4)
    # running totals 4, 8, 12 > 10: close after the third layer
    assert plan_chen_threshold(ch, 10).describe().startswith("C[0,3){S0 S1 S2} C[3,6)")
    assert plan_chen_threshold(ch, 1000).describe() == "C[0,10){S0 S1 S2 S3 S4 S5 S6 S7 S8 S9}"
    grid = chen_grid(ch)
    assert 10 <= len(grid) <= 17 and grid == tuple(sorted(set(grid)))  # deduplicated


def test_chen_under_a_budget_picks_least_recompute_that_fits():
    ch = random_chain(30, 3)
    scored = [simulate(ch, plan_chen_threshold(ch, b)) for b in chen_grid(ch)]
    budget = sorted(s.peak_bytes for s in scored)[len(scored) // 2]
    best = min(s.recompute_ms for s in scored if s.peak_bytes <= budget)
    got = simulate(ch, plan_chen(ch, budget))
    assert got.peak_bytes <= budget and got.recompute_ms == best
    too_low = simulate(ch, plan_chen(ch, 0))
    assert too_low.peak_bytes == min(s.peak_bytes for s in scored)


def test_plan_chain_results():
    ch = random_chain(12, 5)
    hi = simulate(ch, plan_none(12)).peak_bytes
    for s in STRATEGIES:
        r = plan_chain(ch, s, hi, k=3)
        assert r.strategy == s and r.fits is True and r.budget_bytes == hi
        assert r.score == simulate(ch, r.plan)
    r = plan_chain(ch, "dp")
    assert r.fits is None and r.score.peak_bytes == min_peak(ch)
    assert plan_chain(ch, "every-k", k=4).plan.params == {"k": 4}
    with pytest.raises(UsageError, match="unknown strategy 'magic'"):
        plan_chain(ch, "magic")


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
    from ckplan.planner import dp as dp_module
    from ckplan.planner import strategies
    ch = random_chain(n_layers, 3, scale=1000)
    calls = []
    solve, plan_chain_ = dp_module.DPSolver.solve, strategies.plan_chain
    monkeypatch.setattr(dp_module.DPSolver, "solve", lambda self, b: calls.append(b) or solve(self, b))
    monkeypatch.setattr(strategies, "plan_chain", lambda *a, **k: calls.append(a) or plan_chain_(*a, **k))
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


def test_planner_does_not_import_torch():
    code = ("import sys, ckplan.planner as p; "
            "from ckplan.planner.synthetic import random_chain; "
            "p.plan_chain(random_chain(5, 1), 'dp'); "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


# ---- The dp safety net's pruning bound ------------------------------------------------------
# Oracle: the simulator. ``recompute_floor`` may only prune baselines the simulator would score
# no cheaper; the net must return what simulating every baseline returns.

@pytest.mark.slow
def test_recompute_floor_is_below_the_simulated_recompute_and_exact_on_baselines():
    import itertools

    from brute_options import _assign, plans

    from ckplan.planner.baselines import baseline_candidates
    from ckplan.planner.chain import STORE
    from ckplan.planner.strategies import recompute_floor
    from ckplan.planner.synthetic import with_tails
    for seed in range(4):
        ch = with_tails(random_chain(5, seed, max_size=997, options=2), seed, most=0.9)
        choices = [(STORE, *(o.name for o in ly.options)) for ly in ch.layers]
        for items in plans(5):
            for names in itertools.islice(itertools.product(*choices), 0, None, 17):
                p = Plan("x", 5, _assign(items, names))
                assert recompute_floor(ch, p) <= simulate(ch, p).recompute_ms + 1e-9, p.describe()
        for p in baseline_candidates(ch.without_options(), 2):
            assert recompute_floor(ch, p) == pytest.approx(simulate(ch, p).recompute_ms, rel=1e-12, abs=1e-12)


def test_safety_net_returns_what_simulating_every_baseline_returns():
    from ckplan.planner.baselines import baseline_candidates
    from ckplan.planner.strategies import _safety_net
    from ckplan.planner.synthetic import with_tails
    weak = plan_every_k(40, 1)  # recomputes everything: baselines that fit beat it
    swapped = 0
    for seed, f in itertools.product(range(3), (0.0, 0.05, 0.2, 0.5, 0.9)):
        ch = with_tails(random_chain(40, seed, max_size=10_007), seed)
        lo, hi = min_peak(ch), simulate(ch, plan_none(40)).peak_bytes
        b = int(lo + f * (hi - lo))
        for start in (plan_chain(ch, "dp", b).plan, weak):
            best, best_sc = start, simulate(ch, start)
            for cand in baseline_candidates(ch, 2):
                sc = simulate(ch, cand)
                if sc.peak_bytes <= b and sc.recompute_ms < best_sc.recompute_ms * (1 - 1e-12):
                    best, best_sc = cand, sc
            got, _ = _safety_net(ch, start, b, 2)
            assert got.items == best.items, (seed, f)
            swapped += best is not start
    assert swapped  # the net had something to do
