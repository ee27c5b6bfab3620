"""--compile-scope model's rows (ckplan.bench.whole_rows) that fail before anything compiles: plans
a whole-model compile cannot run as one region per layer, and budgets no such plan meets."""
from __future__ import annotations

import itertools
from dataclasses import replace

from ckplan.bench.whole_rows import whole_entries
from ckplan.planner import simulate
from ckplan.planner.synthetic import random_chain
from ckplan.planner.whole import option_plan
from ckplan.records import ERROR, INFEASIBLE
from ckplan.units import format_bytes


def test_multi_layer_checkpoints_are_an_error_row_that_names_the_fix():
    chain = random_chain(4, 0, max_size=997)
    (e,) = whole_entries(chain, ["every-k"], None, 2, None, None, {}, {})
    assert e.status == ERROR and e.plan is None
    assert "one checkpoint region per layer" in e.message and "--k 1" in e.message


def test_a_budget_below_every_region_plan_is_infeasible_with_the_least_peak():
    chain = random_chain(4, 0, max_size=997, options=1)
    # the random option named as a SAC policy: whole-model regions take those and full-region only
    chain = replace(chain, layers=tuple(replace(ly, options=(replace(ly.options[0], name="sac-linear"),))
                                        for ly in chain.layers))
    every = [simulate(chain, option_plan(opts)).peak_bytes
             for opts in itertools.product(*[("store", *(o.name for o in ly.options)) for ly in chain.layers])]
    (e,) = whole_entries(chain, ["dp"], min(every) - 1, 1, None, None, {}, {})
    assert e.status == INFEASIBLE and e.plan is None
    assert f"the least such a plan reaches is {format_bytes(min(every))}" in e.message
