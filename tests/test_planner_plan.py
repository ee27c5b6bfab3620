"""One Plan type: validation, views and JSON."""
from __future__ import annotations

import json

import pytest

from ckplan.errors import SpecError
from ckplan.planner import Plan, plan_every_k, plan_none, plan_sqrtn
from ckplan.planner.plan import Checkpoint, Store, items_from_ranges

NESTED = Plan("custom", 6, (Store(0), Checkpoint(1, 5, (Store(1), Checkpoint(2, 4, (Store(2), Store(3))),
                                                       Store(4))), Store(5)))


def test_views():
    assert NESTED.describe() == "S0 C[1,5){S1 C[2,4){S2 S3} S4} S5"
    assert [(d.stored, d.depth, d.forwards) for d in NESTED.per_layer()] == [
        (True, 0, 1), (False, 1, 2), (False, 2, 3), (False, 2, 3), (False, 1, 2), (True, 0, 1)]
    assert [(r.start, r.stop, r.depth) for r in NESTED.recomputed_ranges()] == [(1, 5, 1), (2, 4, 2)]
    assert NESTED.boundaries() == (4,)
    assert NESTED.segments() == ((0, 1, False), (1, 5, True), (5, 6, False))
    assert NESTED.n_checkpoints == 2


def test_json_round_trip():
    for plan in (NESTED, plan_none(5), plan_every_k(7, 3), plan_sqrtn(10)):
        d = json.loads(json.dumps(plan.to_dict()))
        back = Plan.from_dict(d)
        assert back == plan and back.params == plan.params
    assert NESTED.to_dict()["checkpoints"] == [[1, 5], [2, 4]]


def test_nested_items_json_is_accepted():
    inner = [{"store": 1}, {"store": 2}]
    d = {"n_layers": 3, "items": [{"store": 0}, {"checkpoint": [1, 3], "inner": inner}]}
    assert Plan.from_dict(d).describe() == "S0 C[1,3){S1 S2}"


def test_deep_nesting_needs_no_recursion():
    n = 3000
    items = items_from_ranges(n, [(0, t) for t in range(2, n + 1)])
    plan = Plan("deep", n, items)
    assert plan.per_layer()[0].depth == n - 1
    assert Plan.from_dict(json.loads(json.dumps(plan.to_dict()))).n_checkpoints == n - 1


@pytest.mark.parametrize("bad,msg", [
    ({"n_layers": 4, "checkpoints": [[0, 2], [1, 3]]}, "overlap without nesting"),
    ({"n_layers": 4, "checkpoints": [[0, 5]]}, "outside the chain"),
    ({"n_layers": 4, "checkpoints": [[0, 2], [0, 2]]}, "same range twice"),
    ({"n_layers": 4, "checkpoints": [[2, 2]]}, "outside the chain"),
    ({"n_layers": 4, "checkpoints": [[0, "2"]]}, "pair of integers"),
    ({"n_layers": 0, "checkpoints": []}, "positive integer"),
    ({"n_layers": 4}, "needs a 'checkpoints' list"),
    ([1, 2], "JSON object"),
    ({"n_layers": 3, "items": [{"store": 0}, {"store": 2}]}, "leaves layers \\[1, 2\\) uncovered"),
    ({"n_layers": 3, "items": [{"store": 0}, {"store": 1}, {"store": 1}, {"store": 2}]}, "overlaps"),
    ({"n_layers": 2, "items": [{"store": 0}]}, "ends at 1"),
    ({"n_layers": 2, "items": [{"checkpoint": [0, 2], "inner": [
        {"checkpoint": [0, 2], "inner": [{"store": 0}, {"store": 1}]}]}]}, "single checkpoint"),
    ({"n_layers": 2, "items": [{"layer": 0}]}, "must be"),
    ({"format": "ckplan.plan/2", "n_layers": 2, "checkpoints": []}, "format 'ckplan.plan/2' is not 'ckplan.plan/1'"),
    ({"format": "profile", "n_layers": 2, "checkpoints": []}, "format 'profile'"),
    ({"n_layers": 2, "checkpoints": [], "checkpoint": [[0, 2]]}, "plan key 'checkpoint' is not one of"),
    ({"n_layers": 2, "checkpoints": [], "items": [{"store": 0}, {"store": 1}]}, "not both"),
    ({"n_layers": 2, "checkpoints": [], "options": ["store", 7]}, "option 7 must be a name"),
    ({"n_layers": 2, "checkpoints": [], "options": ["store"]}, "options list 1 layers but the plan has 2"),
    ({"n_layers": 10**12, "checkpoints": [[0, 2]]}, "n_layers about 10\\^12 is above the most ckplan plans, 100000"),
])
def test_bad_plan_json_raises_spec_error(bad, msg):
    with pytest.raises(SpecError, match=msg):
        Plan.from_dict(bad)


def test_describe_runs_shortens_long_stretches_of_plain_stores_only():
    p = Plan("dp", 12, (Checkpoint(0, 6, (Store(0), Store(1), Store(2, "sac-attn"), Store(3), Store(4),
                                          Store(5))), Store(6), Store(7), Store(8), Store(9),
                        Store(10), Store(11)))
    assert p.describe(runs=True) == "C[0,6){S0 S1 S2:sac-attn S3 S4 S5} S6..S11"
    assert p.describe() == "C[0,6){S0 S1 S2:sac-attn S3 S4 S5} S6 S7 S8 S9 S10 S11"
    assert Plan("none", 3, (Store(0), Store(1), Store(2))).describe(runs=True) == "S0 S1 S2"



def test_describe_runs_shortens_runs_of_one_layer_checkpoints_with_one_option():
    def one(i, option="store"):
        return Checkpoint(i, i + 1, (Store(i, option),))
    p = Plan("dp", 12, (Store(0), one(1), one(2), one(3), Store(4), one(5, "sac-attn"), one(6, "sac-attn"),
                        one(7, "sac-attn"), one(8, "sac-attn"), one(9), one(10), one(11)))
    assert p.describe(runs=True) == ("S0 C[1,2){S1} C[2,3){S2} C[3,4){S3} S4 "
                                     "C[5,6){S5:sac-attn}..C[8,9){S8:sac-attn} C[9,10){S9} C[10,11){S10} C[11,12){S11}")
    q = Plan("dp", 5, tuple(one(i) for i in range(5)))
    assert q.describe(runs=True) == "C[0,1){S0}..C[4,5){S4}"
    assert q.describe() == "C[0,1){S0} C[1,2){S1} C[2,3){S2} C[3,4){S3} C[4,5){S4}"

def test_plan_for_another_chain_is_refused_before_any_layer_is_built():
    import time

    from ckplan.planner import plan_items as plan_module
    start = time.perf_counter()
    with pytest.raises(SpecError, match="the plan is for about 10\\^12 layers but the chain has 4"):
        Plan.from_dict({"n_layers": 10**12, "checkpoints": [[0, 2]]}, chain_layers=4)
    with pytest.raises(SpecError, match="the plan is for 6 layers but the chain has 4"):
        Plan.from_dict({"n_layers": 6, "checkpoints": [[0, 2]]}, chain_layers=4)
    assert time.perf_counter() - start < 1.0
    # a long plan builds its own stores: nothing per layer stays cached after the plan is freed
    long = Plan.from_dict({"n_layers": 50_000, "checkpoints": [[0, 2]]}, chain_layers=50_000)
    assert long.n_layers == 50_000 and len(plan_module._STORES) <= plan_module._SHARED


def test_plan_files_name_only_ckplans_options():
    from ckplan.options import SELECTIVE_OPTIONS
    d = {"n_layers": 2, "checkpoints": [], "options": ["store", "sac-everything"]}
    assert Plan.from_dict(d).options() == ("store", "sac-everything")  # a synthetic chain's option
    with pytest.raises(SpecError, match="plan option 'sac-everything' is not one of store, sac-compute"):
        Plan.from_dict(d, known_options=SELECTIVE_OPTIONS)
