"""ckplan plan --compile-scope model (ckplan.api_whole): the result when dp takes the partitioner's
min-cut, from given measurements (the compiles themselves: tests/test_whole_compile.py, slow)."""
from __future__ import annotations

import json

import pytest

from ckplan.api_whole import _mincut_result
from ckplan.planner import Plan, plan_none, simulate
from ckplan.planner.synthetic import random_chain
from ckplan.planner.whole import WholeStep
from ckplan.whole_choice import Mincut
from ckplan.whole_compile import PARTITIONER_BUDGET


def test_a_taken_min_cut_is_reported_with_its_measured_peak_time_and_budget():
    chain = random_chain(5, 3, max_size=997)
    plan = Plan("dp", 5, plan_none(5).items, {PARTITIONER_BUDGET: 0.8})
    peak = simulate(chain, plan_none(5)).peak_bytes - 100
    mc = Mincut(plan, peak, WholeStep(10, 20, 30, 5.0), 0.03, object())
    res = _mincut_result(chain, mc, peak + 1, ["partitioner budget 0.800: measured"])
    base = simulate(chain, plan_none(5))
    assert res.fits and res.score.peak_bytes == peak and res.score.overhead == 0.03
    assert res.score.step_ms == pytest.approx(base.step_ms * 1.03)
    assert res.score.recompute_ms == pytest.approx(base.step_ms * 0.03)
    assert json.loads(json.dumps(res.plan.to_dict()))["params"] == {PARTITIONER_BUDGET: 0.8}
    assert "activation_memory_budget 0.800" in res.notes[0] and "partitioner budget 0.800" in res.notes[0]
    assert res.plan.describe(runs=True) == "S0..S4 (partitioner budget 0.8)"
    assert not _mincut_result(chain, mc, peak - 1, []).fits
