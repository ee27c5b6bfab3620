"""The DP against brute force over every plan, and its invariants.

Oracle: enumerate every plan of rotor's grammar (sequences of Store / Checkpoint where a
checkpoint never ends an inner sequence; counts are large Schroeder numbers) and score each with
the simulator. Chains are random with small integer sizes, so the DP runs on exact slots.
"""
from __future__ import annotations

import math
from dataclasses import replace

import pytest
from brute_plans import (
    EXACT,
    _check_against_brute,
    all_plans,
    brute_best,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckplan.errors import InfeasibleBudgetError
from ckplan.planner import (
    Plan,
    compare,
    infeasible_budget,
    min_peak,
    min_peak_plan,
    plan_chain,
    plan_dp,
    plan_every_k,
    plan_none,
    plan_sqrtn,
    simulate,
    sweep,
)
from ckplan.planner.baselines import baseline_candidates, chen_grid, plan_chen_threshold
from ckplan.planner.chain import Chain
from ckplan.planner.plan import Checkpoint, Store, items_from_ranges
from ckplan.planner.simulate import peak_of, simulate_items
from ckplan.planner.solve import DPSolver
from ckplan.planner.synthetic import random_chain, uniform_chain, with_tails
from ckplan.planner.tables import fixed_peak
from ckplan.units import format_bytes


def test_plan_counts_are_large_schroeder_numbers():
    assert [len(all_plans(n)) for n in range(1, 7)] == [2, 6, 22, 90, 394, 1806]


chains = st.builds(lambda n, seed: random_chain(n, seed), st.integers(1, 6), st.integers(0, 2**32))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(chains)
def test_dp_equals_brute_force(chain):
    _check_against_brute(chain)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.builds(lambda n, seed: with_tails(random_chain(n, seed), seed), st.integers(1, 6),
                 st.integers(0, 2**32)))
def test_dp_equals_brute_force_with_tails(chain):
    """Layers whose last ops a checkpoint ending there does not redo (PyTorch's early stop):
    the DP's costs Q[j] - P[s] against the simulator on every plan."""
    _check_against_brute(chain)


@settings(max_examples=15, deadline=None)
@given(st.builds(lambda n, seed: with_tails(random_chain(n, seed), seed), st.integers(1, 4),
                 st.integers(0, 2**32)))
def test_dp_with_tails_is_optimal_over_every_nesting(chain):
    """A checkpoint ending an inner sequence gets no tail off its parent's recompute; such plans
    still never win."""
    _check_against_brute(chain, general=True)


def test_a_checkpoint_skips_only_its_last_layers_tail():
    # Oracle by hand: forward 1 ms and tail 0.25 ms per layer. A checkpoint redoes the forward of
    # its layers but stops before the last one's tail; a nested checkpoint runs whole in its
    # parent's recompute and is then recomputed itself; an inner sequence ending in a checkpoint
    # gets no tail off.
    chain = replace(uniform_chain(4, x_bytes=1), layers=tuple(
        replace(ly, tail_ms=0.25) for ly in uniform_chain(4, x_bytes=1).layers))
    S = Store
    cases = {
        "C[0,2){S0 S1} C[2,4){S2 S3}": ((Checkpoint(0, 2, (S(0), S(1))), Checkpoint(2, 4, (S(2), S(3)))), 3.5),
        "C[0,1) .. C[3,4)": (tuple(Checkpoint(i, i + 1, (S(i),)) for i in range(4)), 3.0),
        "C[0,4){C[0,2){S0 S1} S2 S3}": ((Checkpoint(0, 4, (Checkpoint(0, 2, (S(0), S(1))), S(2), S(3))),), 3.75 + 1.75),
        "C[0,4){S0 S1 C[2,4){S2 S3}}": ((Checkpoint(0, 4, (S(0), S(1), Checkpoint(2, 4, (S(2), S(3))))),), 4 + 1.75),
    }
    for name, (items, want) in cases.items():
        assert simulate_items(chain, items).recompute_ms == pytest.approx(want), name
    assert chain.layers[0].alone_ms == 0.75


@settings(max_examples=15, deadline=None)
@given(st.builds(lambda n, seed: random_chain(n, seed), st.integers(1, 4), st.integers(0, 2**32)))
def test_dp_is_optimal_over_every_nesting(chain):
    """Plans outside rotor's grammar (a checkpoint ending an inner sequence) never win."""
    _check_against_brute(chain, general=True)


@pytest.mark.slow
@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**32))
def test_dp_equals_brute_force_six_layers(seed):
    """1806 plans per chain."""
    _check_against_brute(random_chain(6, seed))


@pytest.mark.slow
@settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.integers(7, 10), st.integers(0, 2**32))
def test_dp_equals_brute_force_long(n, seed):
    """Up to ~1e6 plans per chain (about 40 s at 10 layers)."""
    _check_against_brute(random_chain(n, seed))


def _budget_between(chain, frac):
    """(smallest feasible peak, a budget ``frac`` of the way from it to the no-checkpoint peak)."""
    lo = min_peak(chain)
    hi = simulate(chain, plan_none(chain.n_layers)).peak_bytes
    return lo, int(lo + frac * (hi - lo))


@settings(max_examples=40, deadline=None)
@given(chains, st.floats(0, 1))
def test_plan_dp_public_entry(chain, frac):
    lo, budget = _budget_between(chain, frac)
    res = plan_dp(chain, budget, max_slots=EXACT)
    assert simulate(chain, res.plan).peak_bytes <= budget
    assert res.exact
    with pytest.raises(InfeasibleBudgetError) as err:
        plan_dp(chain, lo - 1)
    assert err.value.min_peak_bytes == lo and err.value.budget_bytes == lo - 1


@settings(max_examples=40, deadline=None)
@given(chains)
def test_dp_is_none_when_the_budget_is_ample(chain):
    hi = simulate(chain, plan_none(chain.n_layers)).peak_bytes
    for budget in (hi, hi + 1000):
        assert plan_dp(chain, budget).plan.items == plan_none(chain.n_layers).items


@settings(max_examples=40, deadline=None)
@given(chains, st.integers(1, 6))
def test_dp_never_worse_than_a_baseline_at_its_peak(chain, k):
    n = chain.n_layers
    for base in [plan_every_k(n, k), plan_sqrtn(n)] + [plan_chen_threshold(chain, b)
                                                        for b in chen_grid(chain)]:
        sb = simulate(chain, base)
        sd = simulate(chain, plan_dp(chain, sb.peak_bytes, max_slots=EXACT).plan)
        assert sd.peak_bytes <= sb.peak_bytes
        assert sd.recompute_ms <= sb.recompute_ms + 1e-9


@settings(max_examples=30, deadline=None)
@given(chains)
def test_dp_recompute_is_monotone_in_the_budget(chain):
    lo = min_peak(chain)
    solver = DPSolver(chain)
    costs = [simulate(chain, solver.solve(b) or plan_none(chain.n_layers)).recompute_ms
             for b in range(lo, solver.none_peak)]
    assert all(a >= b - 1e-9 for a, b in zip(costs, costs[1:]))


def test_rounded_slots_stay_within_budget_and_near_optimal():
    """Sizes that are not multiples of the slot: the DP rounds conservatively."""
    for seed in range(6):
        chain = random_chain(12, seed, scale=1_000_003, max_size=20)
        lo = min_peak(chain)
        hi = simulate(chain, plan_none(chain.n_layers)).peak_bytes
        exact = DPSolver(chain, max_slots=10**7)
        coarse = DPSolver(chain, max_slots=60)
        assert exact.exact and not coarse.exact
        for t in range(1, 10):
            b = lo + (hi - lo) * t // 10
            pe, pc = exact.solve(b), coarse.solve(b)
            if pc is None:
                continue
            assert simulate(chain, pc).peak_bytes <= b
            assert simulate(chain, pc).recompute_ms >= simulate(chain, pe).recompute_ms - 1e-9
            # the public entry never does worse than a baseline that fits
            r = plan_chain(chain, "dp", b, max_slots=60)
            assert r.fits
            for cand in baseline_candidates(chain):
                sc = simulate(chain, cand)
                if sc.peak_bytes <= b:
                    assert r.score.recompute_ms <= sc.recompute_ms + 1e-9


def test_grouped_mode_is_feasible_and_no_better_than_exact():
    chain = random_chain(40, 7)
    lo, hi = min_peak(chain), simulate(chain, plan_none(40)).peak_bytes
    exact = DPSolver(chain, max_slots=EXACT, mode="exact")
    grouped = DPSolver(chain, max_slots=EXACT, mode="grouped", groups=10, cuts="equal", flat=False)
    both = DPSolver(chain, mode="grouped", groups=10)
    assert len(grouped.readers) == 1 and len(both.readers) == 2
    for t in range(11):
        b = lo + (hi - lo) * t // 10
        pe = exact.solve(b)
        assert pe is not None
        re = simulate(chain, pe).recompute_ms
        pg = grouped.solve(b)
        if pg is not None:
            sg = simulate(chain, pg)
            assert sg.peak_bytes <= b and sg.recompute_ms >= re - 1e-9
            # cuts only between groups of 4
            assert all(r.start % 4 == 0 and r.stop % 4 == 0 for r in pg.recomputed_ranges())
        pb = both.solve(b)
        if pb is not None:
            sb = simulate(chain, pb)
            assert sb.peak_bytes <= b and sb.recompute_ms >= re - 1e-9


def depth1_plans(n: int):
    """Every plan whose checkpoints all have all-Store inner plans (compositions of n)."""
    if n == 0:
        yield ()
        return
    for first in range(1, n + 1):
        for rest in depth1_plans(n - first):
            shifted = tuple(Store(it.layer + first) if isinstance(it, Store) else
                            Checkpoint(it.start + first, it.stop + first,
                                       tuple(Store(k + first) for k in range(it.start, it.stop)))
                            for it in rest)
            if first == 1:
                yield (Store(0),) + shifted
            yield (Checkpoint(0, first, tuple(Store(k) for k in range(first))),) + shifted


@settings(max_examples=40, deadline=None)
@given(st.builds(lambda n, seed: random_chain(n, seed), st.integers(1, 7), st.integers(0, 2**32)))
def test_flat_table_is_optimal_among_depth_one_plans(chain):
    """The long-chain helper DP against brute force over single-level plans."""
    from ckplan.planner.groups import make_units
    from ckplan.planner.tables import FlatTable, PairCosts, base_bytes

    scores = [(*peak_of(chain, items), items) for items in depth1_plans(chain.n_layers)]
    u = make_units(chain)
    ft = FlatTable(u, PairCosts(u), 1, max(p for p, _, _ in scores), "up")
    for budget in sorted({p for p, _, _ in scores}):
        want = brute_best(scores, budget)
        m = budget - base_bytes(chain)
        if budget < fixed_peak(chain) or m < 0:
            continue
        got = ft.C[0, min(m, ft.M)]
        assert got == pytest.approx(want, rel=1e-9, abs=1e-9)
        if got < math.inf:
            plan = Plan("flat", chain.n_layers, items_from_ranges(chain.n_layers, ft.ranges(min(m, ft.M))))
            sc = simulate(chain, plan)
            assert sc.peak_bytes <= budget and sc.recompute_ms == pytest.approx(want)


def test_infeasible_message_names_the_floor_and_only_fixes_that_move_it():
    gib = 2**30
    ch = uniform_chain(8, x_bytes=gib // 4, persistent_bytes=0)
    # Gradient accumulation: the gradients are part of the fixed memory.
    params, grads, state = int(1.2 * gib), int(1.2 * gib), int(2.4 * gib)
    fixed = params + grads + state
    ch = Chain(ch.layers, ch.pre, ch.post, ch.x_in_bytes, 0, persistent_bytes=fixed,
               opt_step_peak_bytes=5 * gib, param_bytes=params, total_grad_bytes=grads,
               optimizer_bytes=state, optimizer="adamw", grads_in_persistent=True)
    lo = min_peak(ch)
    assert lo == fixed + 4 * (gib // 4)  # recompute everything: x_in + 2 live outputs + 1 gradient
    with pytest.raises(InfeasibleBudgetError) as err:
        plan_chain(ch, "dp", 5 * gib)
    msg = str(err.value)
    assert msg.startswith(f"budget 5 GiB is below the smallest feasible peak {format_bytes(lo)}, "
                          "reached in forward/backward, recomputing everything: parameters 1.2 GiB, "
                          "gradients 1.2 GiB, optimizer state 2.4 GiB and activations and gradients "
                          "(the least any plan holds) 1 GiB. Tip: ")
    assert ("shard the optimizer state (ZeRO / FSDP) or offload it to CPU, a smaller optimizer "
            "(SGD keeps no state: train.optimizer sgd, --optimizer sgd), a smaller batch size or sequence "
            "length (input.batch_size, input.shape; --batch-size, --seq-len: the least any plan holds is "
            "1 GiB of the floor) and a budget of at least 5.8 GiB") in msg
    assert err.value.min_peak_bytes == lo and err.value.persistent_bytes == fixed
    assert err.value.exit_code == 3
    # One micro-batch: the gradients are made in the backward, so part of what the plans hold, and
    # the tip says that part does not shrink with the batch.
    one = replace(ch, persistent_bytes=params + state, opt_step_peak_bytes=params + state, grads_in_persistent=False)
    with pytest.raises(InfeasibleBudgetError) as err:
        plan_chain(one, "dp", 2 * gib)
    assert "of which up to 1 GiB are the gradients made so far, which do not shrink with the batch" in \
        err.value.tip


def test_infeasible_tips_fit_the_case():
    gib = 2**30
    base = uniform_chain(4, x_bytes=gib // 64)
    # SGD, the optimizer step sets the floor and the weights alone exceed the budget.
    ch = Chain(base.layers, base.pre, base.post, base.x_in_bytes, 0, persistent_bytes=3 * gib,
               opt_step_peak_bytes=6 * gib, param_bytes=3 * gib, total_grad_bytes=3 * gib,
               optimizer_bytes=0, optimizer="sgd")
    assert min_peak(ch) == 6 * gib
    with pytest.raises(InfeasibleBudgetError) as err:
        plan_chain(ch, "dp", 2 * gib)
    msg, tip = err.value.message, err.value.tip
    assert msg == ("budget 2 GiB is below the smallest feasible peak 6 GiB, reached in the optimizer "
                   "step: parameters 3 GiB and gradients 3 GiB")
    assert tip == ("the parameters alone (3 GiB) exceed the budget: shard them across devices (FSDP) "
                   "or offload them and a budget of at least 6 GiB")
    assert "optimizer sgd" not in str(err.value) and "batch size" not in str(err.value)
    # AdamW at the step: its state and the step's transient are named; no batch-size tip.
    ch2 = Chain(base.layers, base.pre, base.post, base.x_in_bytes, 0, persistent_bytes=3 * gib,
                opt_step_peak_bytes=5 * gib, param_bytes=gib, total_grad_bytes=gib,
                optimizer_bytes=2 * gib, optimizer="adamw")
    with pytest.raises(InfeasibleBudgetError) as err:
        plan_chain(ch2, "chen", 4 * gib)
    assert err.value.message.endswith("reached in the optimizer step: parameters 1 GiB, gradients "
                                      "1 GiB, optimizer state 2 GiB and optimizer-step transient 1 GiB")
    assert err.value.tip == ("shard the optimizer state (ZeRO / FSDP) or offload it to CPU, a smaller "
                             "optimizer (SGD keeps no state: train.optimizer sgd, --optimizer sgd) and a budget of at "
                             "least 5 GiB")


def test_infeasible_tip_names_activations_saved_outside_the_chain_only_when_they_dominate():
    kib = 2**10
    base = uniform_chain(2, x_bytes=64 * kib)
    # A seq2seq model planned over its encoder: the decoder's activations sit in the head (post).
    big_post = Chain(base.layers, base.pre, replace(base.post, xbar_bytes=4096 * kib), base.x_in_bytes, 0,
                     persistent_bytes=0, opt_step_peak_bytes=0, optimizer="sgd")
    with pytest.raises(InfeasibleBudgetError) as err:
        plan_chain(big_post, "dp", 1024 * kib)
    outside = format_bytes(base.pre.retained_bytes + 4096 * kib)
    assert f"a chain that covers more of the model: {outside} of the activations are saved before or after" \
        in err.value.tip
    with pytest.raises(InfeasibleBudgetError) as err:
        plan_chain(base, "dp", kib)
    assert "a chain that covers more" not in err.value.tip


def test_chen_and_dp_agree_on_infeasible_budgets_and_compare_never_raises():
    for seed in range(20):
        ch = random_chain(6, seed)
        lo = min_peak(ch)
        for s in ("dp", "chen"):
            with pytest.raises(InfeasibleBudgetError):
                plan_chain(ch, s, lo - 1)
        rows = compare(ch, budget_bytes=lo - 1)
        assert [r.strategy for r in rows] == ["none", "every-k", "sqrtn", "chen", "dp"]
        assert all(r.fits is False for r in rows)
        assert simulate(ch, rows[-1].plan).peak_bytes == lo  # dp's row: the smallest-peak plan
        assert infeasible_budget(rows) is not None and "below the smallest feasible peak" in infeasible_budget(rows)
        ok = compare(ch, budget_bytes=lo)
        assert infeasible_budget(ok) is None and ok[-1].fits


@settings(max_examples=30, deadline=None)
@given(chains, st.floats(0, 1))
def test_min_peak_plan_uses_slack(chain, frac):
    lo, b = _budget_between(chain, frac)
    tight, loose = simulate(chain, min_peak_plan(chain)), simulate(chain, min_peak_plan(chain, b))
    assert tight.peak_bytes == lo and loose.peak_bytes <= b


def test_fixed_peak_is_a_floor():
    ch = random_chain(5, 3)
    assert min_peak(ch) >= fixed_peak(ch)
    big = Chain(ch.layers, ch.pre, ch.post, ch.x_in_bytes, ch.delta_in_bytes, ch.persistent_bytes,
                opt_step_peak_bytes=10**6)
    assert min_peak(big) == 10**6
    assert plan_chain(big, "dp", 10**6).fits


def test_article_arithmetic_every_10_is_20_gb_not_10():
    """100 layers of 1 GB, a checkpoint every 10: 10 boundaries + one 10-layer segment
    recomputed = 20 GB of activations (the seed article says 10 GB)."""
    gb = 10**9
    ch = uniform_chain(100, x_bytes=gb, persistent_bytes=1000)
    sc = simulate(ch, plan_every_k(100, 10))
    act = sc.peak_bytes - ch.persistent_bytes - ch.pre.retained_bytes
    assert act == 20 * gb
    assert "during recompute of [90,100)" in sc.peak_at
    budget = ch.persistent_bytes + ch.pre.retained_bytes + 20 * gb
    res = plan_dp(ch, budget)  # the banded DP (100 layers): as cheap as the proven optimum
    ref = plan_dp(ch, budget, mode="exact")
    assert ref.exact
    assert simulate(ch, res.plan).recompute_ms <= simulate(ch, ref.plan).recompute_ms * (1 + 1e-9)
    sd = simulate(ch, res.plan)
    assert sd.peak_bytes <= budget and sd.recompute_ms <= sc.recompute_ms
    # with nesting, the DP reaches far below the sqrt(N) figure
    assert min_peak(ch) - budget < -10 * gb


def test_compare_runs_every_strategy():
    ch = random_chain(9, 11)
    budget = (min_peak(ch) + simulate(ch, plan_none(9)).peak_bytes) // 2
    rows = compare(ch, ("none", "every-k", "sqrtn", "chen", "dp"), budget, k=3)
    assert [r.strategy for r in rows] == ["none", "every-k", "sqrtn", "chen", "dp"]
    dp_row = rows[-1]
    assert dp_row.fits and dp_row.slot_bytes >= 1
    for r in rows[:-1]:
        if r.fits:
            assert dp_row.score.recompute_ms <= r.score.recompute_ms + 1e-9
    assert isinstance(dp_row.plan, Plan) and dp_row.to_dict()["plan"]["n_layers"] == 9


def test_peak_tables_are_built_once_per_chain(monkeypatch):
    from ckplan.planner import solve as dp
    from ckplan.planner import tables

    dp.layer_tables.cache_clear()
    dp.min_peak.cache_clear()
    built = []
    real = tables.PeakTable.__init__

    def counting(self, *args, **kwargs):
        built.append(1)
        real(self, *args, **kwargs)

    monkeypatch.setattr(tables.PeakTable, "__init__", counting)
    ch = random_chain(30, 12345, scale=1_000_003)
    lo = min_peak(ch)
    plan_chain(ch, "dp", lo)
    plan_chain(ch, "dp")
    min_peak_plan(ch, lo + 10**6)
    sweep_points = sweep(ch, ("dp",), n_points=3)
    assert sweep_points and len(built) == 1
