"""A profile document is trusted only whole: each corruption a hand edit can make is named by its
field (never a ValueError from deep in the planner), and the document ckplan writes passes."""
import copy
import json

import pytest
from fake_records import make_profile

from ckplan.profile_doc import MAX_PROFILE_INT, profile_problem
from ckplan.records import Profile


def _doc():
    return json.loads(json.dumps(make_profile(4).to_dict()))


def test_the_document_ckplan_writes_passes_and_reads_back():
    d = _doc()
    assert profile_problem(d) is None
    assert Profile.from_dict(copy.deepcopy(d)).to_dict() == make_profile(4).to_dict()


def _set(path, value):
    def edit(d):
        *head, last = path
        for key in head:
            d = d[key]
        d[last] = value
    return edit


@pytest.mark.parametrize("edit, named", [
    (_set(("layers", 2, "saved_bytes"), -5), "layers[2].saved_bytes is -5"),
    (_set(("layers", 2, "fwd_ms"), float("nan")), "layers[2].fwd_ms"),
    (_set(("layers", 2, "output_bytes"), MAX_PROFILE_INT + 1), "layers[2].output_bytes"),
    (_set(("layers", 2, "output_bytes"), True), "layers[2].output_bytes"),
    (_set(("totals", "param_bytes"), "12GB"), "totals.param_bytes"),
    (_set(("chain_breaks",), [0]), "chain_breaks is [0]"),
    (_set(("host_bw",), [-1.0, 5.0]), "host_bw is [-1.0, 5.0]"),
    (_set(("host_bw",), [1e9]), "host_bw is [1000000000.0]"),
    (_set(("host_bw",), [float("inf"), 1e9]), "host_bw is [inf"),
    (lambda d: d.pop("totals"), "field 'totals' is missing"),
    (lambda d: d["layers"].pop(1), "layers"),
])
def test_each_corruption_is_named_by_its_field(edit, named):
    d = _doc()
    edit(d)
    problem = profile_problem(d)
    assert problem is not None and named in problem, problem


def test_sizes_that_add_up_past_the_limit_are_refused():
    d = _doc()
    for row in d["layers"][1:-1]:
        row["saved_bytes"] = MAX_PROFILE_INT // 2
    assert "add up to about" in profile_problem(d)
