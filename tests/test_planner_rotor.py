"""ckplan's ``dp`` against rotor's own dynamic program (``tests/rotor_ref.py``), at 10-40 layers
where brute force is out of reach.

A rotor chain maps onto a ckplan chain (``rotor_ref.to_ckplan``: the layers' fields as rotor's
stages, the backward transient plus the gradient it makes, pre holding the input, post the loss,
everything rotor does not model neutral) on which ckplan's simulator gives every plan rotor's peak
plus the persistent bytes, and the same recompute time. So on random heterogeneous chains with
exact integer sizes (no memory slots to round to) and integer times:

1. rotor's optimal sequence, and random sequences of rotor's grammar, peak in ckplan's simulator at
   rotor's peak plus the offset, with the same recompute;
2. ``dp`` recomputes no more than rotor's optimum at every budget, and its plan fits; on chains
   where ckplan's model is kinder (tails: a checkpoint skips its last layer's final ops; early
   stops) rotor's optimum is an upper bound;
3. where the models coincide, ``dp`` equals it, and ``min_peak`` equals rotor's least memory;
4. the reference itself: on chains of up to 6 stages its optimum equals brute force over every
   plan of rotor's grammar (``brute_plans.all_plans``) scored by its own simulator.
"""
from __future__ import annotations

import math
from functools import cache
from typing import NamedTuple

import numpy as np
import pytest
import rotor_ref as R
from brute_plans import all_plans

from ckplan.errors import InfeasibleBudgetError
from ckplan.planner import Plan, min_peak, plan_chain, plan_none, simulate
from ckplan.planner.chain import Chain
from ckplan.planner.plan import Checkpoint, Store
from ckplan.planner.simulate import peak_of
from ckplan.planner.synthetic import with_early, with_tails

TOL = 1e-9
# (stages, seed); max_size 30 for the last one: larger sizes, a table of a few thousand bytes
CHAINS = [(10, 0, 10), (13, 1, 10), (17, 2, 10), (21, 3, 10), (26, 4, 10), (31, 5, 10),
          (35, 6, 10), (40, 7, 10), (24, 8, 30)]
IDS = [f"L{n}-seed{s}-size{m}" for n, s, m in CHAINS]


class Case(NamedTuple):
    rc: R.RotorChain
    persistent: int
    chain: Chain
    table: R.Table
    lo: int  # rotor's least memory
    hi: int  # rotor's peak without checkpoints
    budgets: tuple[int, ...]  # from lo to hi


@cache
def _case(n: int, seed: int, size: int) -> Case:
    rc = R.random_rotor_chain(n, seed, max_size=size)
    persistent = int(np.random.default_rng(seed).integers(0, 100))
    hi = R.simulate(rc, R.no_checkpoint_ops(rc))[0]
    table = R.compute_table(rc, hi)
    lo = table.min_peak()
    assert lo is not None
    budgets = tuple(sorted({lo, lo + 1, hi - 1, hi, *np.linspace(lo, hi, 14).astype(int).tolist()}))
    return Case(rc, persistent, R.to_ckplan(rc, persistent), table, lo, hi, budgets)


def _random_items(n: int, rng: np.random.Generator) -> tuple:
    """A random plan of rotor's grammar: an inner sequence never ends with a checkpoint."""
    def seq(s: int, e: int, top: bool) -> tuple:
        out: list = []
        while s < e:
            last = e if top else e - 1  # the furthest a checkpoint starting at s may end
            if last <= s or rng.random() < 0.4:
                out.append(Store(s))
                s += 1
                continue
            j = int(rng.integers(s + 1, last + 1))
            out.append(Checkpoint(s, j, seq(s, j, False)))
            s = j
        return tuple(out)
    return seq(0, n, True)


# ---- 1. the mapping: both simulators agree on every sequence ----------------------------------

@pytest.mark.parametrize("n,seed,size", CHAINS, ids=IDS)
def test_rotor_optimal_sequences_peak_alike_in_ckplan(n, seed, size):
    c = _case(n, seed, size)
    assert simulate(c.chain, plan_none(n)).peak_bytes == c.hi + c.persistent
    for b in c.budgets:
        ops = c.table.sequence(b)
        peak, recompute = R.simulate(c.rc, ops)
        assert peak <= b and recompute == pytest.approx(c.table.recompute(b), abs=TOL)
        items = R.to_items(ops, n)
        assert R.to_ops(items, n) == ops
        sc = simulate(c.chain, Plan("rotor", n, items))
        assert sc.peak_bytes == peak + c.persistent, (b, Plan("rotor", n, items).describe())
        assert sc.recompute_ms == pytest.approx(recompute, abs=TOL)


@pytest.mark.parametrize("n,seed,size", CHAINS, ids=IDS)
def test_random_sequences_peak_alike_in_ckplan(n, seed, size):
    c = _case(n, seed, size)
    rng = np.random.default_rng(1000 + seed)
    for _ in range(60):
        items = _random_items(n, rng)
        peak, recompute = R.simulate(c.rc, R.to_ops(items, n))
        got = peak_of(c.chain, items)
        assert got[0] == peak + c.persistent, Plan("r", n, items).describe()
        assert got[1] == pytest.approx(recompute, abs=TOL)


# ---- 2 and 3. dp against rotor's optimum -------------------------------------------------------

@pytest.mark.parametrize("n,seed,size", CHAINS, ids=IDS)
def test_dp_equals_rotor(n, seed, size):
    c = _case(n, seed, size)
    assert min_peak(c.chain) == c.lo + c.persistent
    assert not math.isfinite(c.table.recompute(c.lo - 1))
    with pytest.raises(InfeasibleBudgetError):
        plan_chain(c.chain, "dp", c.lo - 1 + c.persistent)
    for b in c.budgets:
        want = c.table.recompute(b)
        res = plan_chain(c.chain, "dp", b + c.persistent)
        assert res.score.peak_bytes <= b + c.persistent
        assert res.score.recompute_ms <= want + TOL, (b, res.plan.describe())  # 2.
        assert res.score.recompute_ms == pytest.approx(want, abs=TOL), (b, res.plan.describe())  # 3.


@pytest.mark.parametrize("kind", ["tails", "early"])
@pytest.mark.parametrize("n,seed,size", CHAINS[::2], ids=IDS[::2])
def test_dp_no_dearer_than_rotor_where_ckplan_is_kinder(n, seed, size, kind):
    """Tails (a checkpoint does not redo its last layer's final ops) cut recompute; early stops
    (a recompute stops at its last layer's last saved tensor) cut peaks: rotor's plan costs no more
    on such a chain, so rotor's optimum bounds dp's."""
    c = _case(n, seed, size)
    chain = with_tails(c.chain, seed) if kind == "tails" else with_early(c.chain, seed)
    assert min_peak(chain) <= c.lo + c.persistent
    cheaper = 0
    for b in c.budgets:
        want = c.table.recompute(b)
        rotor_plan = simulate(chain, Plan("rotor", n, R.to_items(c.table.sequence(b), n)))
        assert rotor_plan.peak_bytes <= b + c.persistent and rotor_plan.recompute_ms <= want + TOL
        res = plan_chain(chain, "dp", b + c.persistent)
        assert res.score.peak_bytes <= b + c.persistent
        assert res.score.recompute_ms <= rotor_plan.recompute_ms + TOL, (b, res.plan.describe())
        cheaper += res.score.recompute_ms < want - TOL
    if kind == "tails":  # every budget that recomputes at all gains
        assert cheaper >= len(c.budgets) - 2


# ---- 4. the reference against brute force ------------------------------------------------------

SMALL = [(n, seed) for n in range(1, 6) for seed in range(4)] + [(6, 0), (6, 1)]


@pytest.mark.parametrize("n,seed", SMALL, ids=[f"L{n}-seed{s}" for n, s in SMALL])
def test_rotor_ref_equals_brute_force(n, seed):
    rc = R.random_rotor_chain(n, 500 + seed, max_size=8)
    persistent = seed * 3
    chain = R.to_ckplan(rc, persistent)
    scores = []
    for items in all_plans(n):
        ops = R.to_ops(items, n)
        assert R.to_items(ops, n) == items
        peak, recompute = R.simulate(rc, ops)
        assert peak_of(chain, items) == (peak + persistent, pytest.approx(recompute, abs=TOL))
        scores.append((peak, recompute))
    hi = R.simulate(rc, R.no_checkpoint_ops(rc))[0]
    table = R.compute_table(rc, hi)
    lowest = min(p for p, _ in scores)
    assert table.min_peak() == lowest
    for b in sorted({p for p, _ in scores} | {lowest - 1}):
        want = min((r for p, r in scores if p <= b), default=math.inf)
        assert table.recompute(b) == want
        if want < math.inf:
            peak, recompute = R.simulate(rc, table.sequence(b))
            assert peak <= b and recompute == want


# ---- rotor's published check, and what the mapping must leave out -----------------------------

# A chain on which rotor's code (its F_all branch checks the forward of s beside d[s] instead of
# d[t], the gradient live then) accepts a sequence over its memory limit.
OVER = R.RotorChain(uf=(0.0, 2.0, 6.0, 9.0), ub=(0.0, 6.0, 5.0, 1.0), wx=(3, 4, 6, 0),
                    wxb=(0, 5, 8, 0), of=(0, 14, 4, 15), ob=(0, 1, 1, 2))


def test_published_fall_check_accepts_a_sequence_over_the_limit():
    hi = R.simulate(OVER, R.no_checkpoint_ops(OVER))[0]
    published = R.compute_table(OVER, hi, published=True)
    ops = published.sequence(27)
    assert ops == [("Fck", 1), ("Fn", 2), ("Fall", 3), ("B", 3), ("Fall", 1), ("Fall", 2), ("B", 2), ("B", 1)]
    # F_all(1) in the recompute runs beside x[0] and d[2]: 3 + 6 + 5 + 14 = 28
    assert R.simulate(OVER, ops) == (28, 8.0)
    table = R.compute_table(OVER, hi)
    assert table.recompute(27) == 10.0 and R.simulate(OVER, table.sequence(27))[0] <= 27
    res = plan_chain(R.to_ckplan(OVER), "dp", 27)
    assert res.score.recompute_ms == 10.0 and res.score.peak_bytes <= 27


@pytest.mark.parametrize("addition", ["grad_bytes", "loss_bytes"])
def test_ckplan_additions_are_no_constant_offset(addition):
    """Parameter gradients (live from their layer's backward to the optimizer step) and the loss
    with its seed (live through the backward) move the peak by an amount that depends on the plan:
    the mapping must leave them at 0."""
    from dataclasses import replace
    rc = R.random_rotor_chain(5, 7, max_size=8)
    rc = replace(rc, of=(0, 60, *rc.of[2:]))  # plans storing stage 1 peak in the first forward
    chain = R.to_ckplan(rc)
    if addition == "grad_bytes":
        chain = replace(chain, layers=tuple(replace(ly, grad_bytes=3 + k) for k, ly in enumerate(chain.layers)))
    else:
        chain = replace(chain, post=replace(chain.post, loss_bytes=4))
    shifts = {peak_of(chain, items)[0] - R.simulate(rc, R.to_ops(items, 5))[0] for items in all_plans(5)}
    assert min(shifts) >= 0 and len(shifts) > 1
