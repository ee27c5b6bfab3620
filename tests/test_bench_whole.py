"""--compile-scope model's rows (ckplan.bench.whole_rows) that fail before anything compiles: plans
a whole-model compile cannot run as one region per layer, and budgets no such plan meets."""
from __future__ import annotations

import itertools
from dataclasses import replace

import pytest

from ckplan.bench.whole_rows import whole_entries
from ckplan.planner import simulate
from ckplan.planner.synthetic import random_chain
from ckplan.planner.whole import option_plan
from ckplan.records import ERROR, INFEASIBLE
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
    from ckplan.profiling.whole_steps import CHECKS, checked_plan
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
    from ckplan.profiling.whole_steps import runs_text
    opts = ["store", "full-region", *["sac-attn"] * 6, *["sac-compute"] * 14, "sac-attn"]
    assert runs_text(opts) == "0 store, 1 full-region, 2-7 sac-attn, 8-21 sac-compute, 22 sac-attn"
