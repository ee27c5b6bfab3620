"""--compile-scope model's rows (ckplan.bench.whole_rows) that fail before anything compiles: plans
a whole-model compile cannot run as one region per layer, and budgets no such plan meets."""
from __future__ import annotations

import itertools
from dataclasses import replace

import pytest

from ckplan.bench.whole_rows import whole_entries
from ckplan.bench_records import ERROR, INFEASIBLE
from ckplan.errors import InfeasibleBudgetError
from ckplan.planner import simulate
from ckplan.planner.synthetic import random_chain
from ckplan.planner.whole import option_plan
from ckplan.units import format_bytes


def _unmeasured(plan):
    raise AssertionError(f"nothing compiles in these rows ({plan})")


def _silent(msg: str) -> None:
    pass


def test_multi_layer_checkpoints_are_an_error_row_that_names_the_fix():
    chain = random_chain(4, 0, max_size=997)
    (e,) = whole_entries(chain, ["every-k"], None, 2, None, None, {}, {}, _unmeasured, _silent)
    assert e.status == ERROR and e.plan is None
    assert "one checkpoint region per layer" in e.message and "--k 1" in e.message


def test_a_budget_below_every_region_plan_is_infeasible_with_the_least_peak():
    chain = random_chain(4, 0, max_size=997, options=1)
    # the random option named as a SAC policy: whole-model regions take those and full-region only
    chain = replace(chain, layers=tuple(replace(ly, options=(replace(ly.options[0], name="sac-linear"),))
                                        for ly in chain.layers))
    every = [simulate(chain, option_plan(opts)).peak_bytes
             for opts in itertools.product(*[("store", *(o.name for o in ly.options)) for ly in chain.layers])]
    (e,) = whole_entries(chain, ["dp"], min(every) - 1, 1, None, None, {}, {}, _unmeasured, _silent)
    assert e.status == INFEASIBLE and e.plan is None
    assert f"the least such a plan reaches is {format_bytes(min(every))}" in e.message


def _sac_chain(seed: int):
    chain = random_chain(4, seed, max_size=997, options=1)
    return replace(chain, layers=tuple(replace(ly, options=(replace(ly.options[0], name="sac-linear"),))
                                       for ly in chain.layers))


@pytest.mark.parametrize("seed", range(8))
def test_dp_measures_a_mixed_plan_before_taking_it_and_never_takes_one_measured_over_budget(seed):
    from ckplan.errors import InfeasibleBudgetError
    from ckplan.planner.whole import WholeStep, plan_whole, whole_peak
    from ckplan.whole_choice import CHECKS, checked_plan
    chain = _sac_chain(seed)
    lowest = plan_whole(chain, None).peak_bytes
    none = simulate(chain, option_plan(["store"] * 4)).peak_bytes
    budget = (lowest + none) // 2
    assert len(set(plan_whole(chain, budget).plan.options())) > 1  # a mixed plan: it gets checked
    seen = []

    def measure(plan, over: int):  # the plan's step, measured `over` bytes above its prediction
        seen.append(plan.options())
        peak = simulate(chain, plan).peak_bytes + over - chain.persistent_bytes
        return object(), WholeStep(peak, peak, peak)
    # measured as predicted: the first plan is taken after one check
    res, checked, made, lines = checked_plan(chain, budget, lambda p: measure(p, 0), _silent)
    assert len(seen) == 1 and res.plan.options() == seen[0] and set(made) == set(checked) == {seen[0]}
    assert len(lines) == 1 and "over the budget" not in lines[0]
    # every mixed plan measured over the budget: after CHECKS checks a measured plan is taken
    seen.clear()
    try:
        res, checked, _, lines = checked_plan(chain, budget, lambda p: measure(p, budget), _silent)
    except InfeasibleBudgetError as err:  # no uniform plan fits either
        assert err.min_peak_bytes > budget
        return
    assert 1 <= len(seen) == len(lines) <= CHECKS and res.plan.options() not in seen
    assert all(line.endswith("(over the budget)") for line in lines)
    assert len(set(res.plan.options())) == 1 and whole_peak(chain, res.plan, checked) <= budget


def test_a_checked_plan_is_named_by_runs_of_layers():
    from ckplan.whole_choice import runs_text
    opts = ["store", "full-region", *["sac-attn"] * 6, *["sac-compute"] * 14, "sac-attn"]
    assert runs_text(opts) == "0 store, 1 full-region, 2-7 sac-attn, 8-21 sac-compute, 22 sac-attn"


def _store_step(chain):
    """The every-layer-stored step as the simulator has it (bytes above the persistent ones)."""
    from ckplan.planner.whole import WholeStep
    peak = simulate(chain, option_plan(["store"] * chain.n_layers)).peak_bytes - chain.persistent_bytes
    return WholeStep(peak, peak, peak, fwd_bwd_ms=100.0)


def test_the_partitioners_budget_is_lowered_by_its_miss_until_its_step_fits():
    """mincut_search: the first budget is the share the budget leaves of the stored step's
    activations; a step measured over the budget lowers it by the share it missed by."""
    from ckplan.planner.whole import WholeStep
    from ckplan.whole_choice import TRIES, mincut_search
    from ckplan.whole_compile import partitioner_budget
    chain = _sac_chain(0)
    store = _store_step(chain)
    p, act = chain.persistent_bytes, store.fwd_peak_bytes
    budget = p + act // 2
    tried = []

    def measure(plan, keeps, least=0.0):  # a partitioner keeping `keeps` times the share it is given, `least` at least
        b = partitioner_budget(plan)
        tried.append(b)
        peak = int(act * max(least, b * keeps))
        return object(), WholeStep(peak // 2, peak, peak)
    mc, lines = mincut_search(chain, budget, store, lambda pl: measure(pl, 1.0), lambda cm: 104.0, _silent)
    assert tried == [pytest.approx(0.5, abs=2e-3)] and mc.peak_bytes <= budget
    assert mc.step.fwd_bwd_ms == 104.0 and mc.overhead == pytest.approx(4.0 / simulate(
        chain, option_plan(["store"] * 4)).step_ms) and mc.plan.options() == ("store",) * 4
    assert lines[0].startswith(f"partitioner budget {tried[0]:.3f}: measured") and "over" not in lines[0]
    tried.clear()  # keeps 10% more than asked: the second try asks for 1/1.1 of the first
    mc, lines = mincut_search(chain, budget, store, lambda pl: measure(pl, 1.1), lambda cm: 104.0, _silent)
    assert len(tried) == 2 and tried[1] == pytest.approx(tried[0] / 1.1, rel=1e-2) and mc.peak_bytes <= budget
    assert lines[0].endswith("(over the budget)")
    for least, tries in ((0.9, 1), (0.6, 2)):  # a partitioner that stops short: no step fits
        tried.clear()  # it moved less than a quarter of the way (0.9), or not at all on the second try (0.6)
        mc, lines = mincut_search(chain, budget, store, lambda pl, least=least: measure(pl, 1.0, least), lambda cm: 1.0,
                                  _silent)
        assert mc is None and len(tried) == tries == len(lines) <= TRIES
    # no budget, or the stored step fits: nothing compiles
    assert mincut_search(chain, None, store, _unmeasured, None, _silent) == (None, [])
    assert mincut_search(chain, p + act + 10**9, store, _unmeasured, None, _silent) == (None, [])


@pytest.mark.parametrize("faster", [True, False])
def test_dp_takes_the_partitioners_min_cut_only_where_it_measured_faster(faster):
    from ckplan.planner.whole import WholeStep, plan_whole
    from ckplan.whole_choice import Mincut, dp_choice
    from ckplan.whole_compile import PARTITIONER_BUDGET
    chain = _sac_chain(1)
    lowest = plan_whole(chain, None).peak_bytes
    none = simulate(chain, option_plan(["store"] * 4)).peak_bytes
    budget = (lowest + none) // 2
    region = plan_whole(chain, budget)
    overhead = simulate(chain, region.plan).overhead + (-0.01 if faster else 0.01)
    from ckplan.planner import Plan
    plan = Plan("dp", 4, option_plan(["store"] * 4).items, {PARTITIONER_BUDGET: 0.5})
    mc = Mincut(plan, budget, WholeStep(1, 1, 1, 1.0), overhead, object())

    def measure(p):  # mixed plans measured as predicted
        peak = simulate(chain, p).peak_bytes - chain.persistent_bytes
        return object(), WholeStep(peak, peak, peak)
    res, _, _, lines, taken = dp_choice(chain, budget, measure, _silent, lambda: (mc, ["partitioner budget 0.500"]))
    assert res is not None and (taken is mc) == faster
    assert lines[-1].startswith("taken" if faster else "not taken")
    # no region plan fits: the min-cut is taken whatever it costs
    res, _, _, _, taken = dp_choice(chain, lowest - 1, measure, _silent, lambda: (mc, []))
    assert res is None and taken is mc
    with pytest.raises(InfeasibleBudgetError) as err:
        dp_choice(chain, lowest - 1, measure, _silent, lambda: (None, ["partitioner budget 0.400: measured 9 B"]))
    assert "min-cut did not fit either (partitioner budget 0.400" in err.value.message
