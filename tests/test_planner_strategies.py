"""Baseline strategies, the public entry points, and the sweep."""
from __future__ import annotations

import itertools
import math
import subprocess
import sys

import pytest
from brute_plans import brute_best, brute_scores

from ckplan.errors import UsageError
from ckplan.planner import (
    STRATEGIES,
    compare,
    min_peak,
    plan_chain,
    plan_chen,
    plan_dp,
    plan_every_k,
    plan_none,
    plan_sqrtn,
    simulate,
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
                if sc.peak_bytes > b:
                    continue
                tie = sc.recompute_ms <= best_sc.recompute_ms * (1 + 1e-9) and sc.peak_bytes < best_sc.peak_bytes
                if sc.recompute_ms < best_sc.recompute_ms * (1 - 1e-9) or tie:
                    best, best_sc = cand, sc
            got, _ = _safety_net(ch, start, b, 2)
            assert got.items == best.items, (seed, f)
            swapped += best is not start
    assert swapped  # the net had something to do


def test_dp_breaks_a_recompute_tie_with_a_baseline_toward_the_lower_peak():
    # Identical layers: many plans recompute the same layers. Oracle: every baseline simulated;
    # none that fits may recompute as little as dp's plan at a lower peak (a user would see
    # sqrtn beside dp at the same overhead and less memory).
    from dataclasses import replace as _replace

    from ckplan.planner.baselines import baseline_candidates
    from ckplan.planner.synthetic import random_chain as _rc
    broken = 0
    for seed in range(8):
        ch = _rc(6, seed, max_size=5000)
        ch = _replace(ch, layers=tuple(_replace(ch.layers[0]) for _ in ch.layers))
        lo, hi = min_peak(ch), simulate(ch, plan_none(6)).peak_bytes
        for t in range(1, 8):
            b = lo + (hi - lo) * t // 8
            got = simulate(ch, plan_chain(ch, "dp", b).plan)
            for cand in baseline_candidates(ch, 2):
                sc = simulate(ch, cand)
                assert not (sc.peak_bytes <= b and sc.recompute_ms <= got.recompute_ms * (1 + 1e-9)
                            and sc.peak_bytes < got.peak_bytes), (seed, b, cand.describe())
            raw = simulate(ch, plan_dp(ch, b).plan)
            broken += raw.peak_bytes > got.peak_bytes
    assert broken  # the DP alone broke some ties the other way: the oracle can fail


@pytest.mark.parametrize("seed", range(10))
def test_below_the_floor_dp_shows_the_cheapest_plan_reaching_the_smallest_peak(seed):
    """Brute force over every plan: ``compare``'s dp row at a budget no plan fits is the least
    recompute among the plans reaching the smallest peak; where the optimizer step sets that peak,
    every plan reaches it, so the row recomputes nothing."""
    from dataclasses import replace
    chain = random_chain(5, seed)
    scores = brute_scores(chain)
    lowest = min(p for p, _, _ in scores)
    (row,) = compare(chain, ["dp"], 1)
    assert not row.fits and row.score.peak_bytes == lowest
    assert row.score.recompute_ms == pytest.approx(brute_best(scores, lowest))
    step_bound = replace(chain, opt_step_peak_bytes=10**6)
    for row in compare(step_bound, ["dp", "dp-layer"], 1):
        assert not row.fits and row.score.peak_bytes == 10**6 and row.plan.n_checkpoints == 0, row.strategy
