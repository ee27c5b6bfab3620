"""Plans of one region per layer (ckplan.planner.regions) against brute force: every assignment
of store / each option / full to every layer, scored by the simulator."""
from __future__ import annotations

import itertools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckplan.planner import simulate
from ckplan.planner.chain import STORE
from ckplan.planner.regions import FULL, layer_choices, plan_regions, regions_plan
from ckplan.planner.synthetic import random_chain, with_tails


def _brute(chain):
    choices = [(STORE, *(o.name for o in ly.options), FULL) for ly in chain.layers]
    out = []
    for opts in itertools.product(*choices):
        sc = simulate(chain, regions_plan(opts))
        out.append((sc.peak_bytes, sc.recompute_ms, opts))
    return out


def _check(chain):
    scores = _brute(chain)
    peaks = sorted({p for p, _, _ in scores})
    for b in sorted(set(peaks) | {p - 1 for p in peaks}):
        fits = [t for p, t, _ in scores if p <= b]
        res = plan_regions(chain, b)
        if not fits:
            assert res is None, b
            continue
        assert res is not None and res.exact, b
        sc = simulate(chain, res.plan)
        assert sc.peak_bytes <= b
        assert sc.recompute_ms == pytest.approx(min(fits), rel=1e-9, abs=1e-9), (b, res.plan.describe())


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(1, 5), seed=st.integers(0, 10_000), options=st.integers(0, 2))
def test_regions_plan_equals_brute_force(n, seed, options):
    _check(random_chain(n, seed, max_size=997, options=options))


@pytest.mark.parametrize("seed", range(4))
def test_regions_plan_with_tails_equals_brute_force(seed):
    _check(with_tails(random_chain(4, seed, max_size=997, options=2), seed))


def test_each_choice_is_priced_by_the_simulator_alone():
    chain = random_chain(4, 3, max_size=997, options=2)
    rows = layer_choices(chain)
    for i, row in enumerate(rows):
        names = [c.option for c in row]
        assert [n for n in names[1:-1]] == [o.name for o in chain.layers[i].options]
        assert names[0] == STORE and names[-1] == FULL
        assert row[0].held_bytes == 0 and row[0].recompute_ms == 0
        full = row[-1]
        # recomputing the layer whole redoes its forward (less the tail a checkpoint skips)
        ly = chain.layers[i]
        assert full.recompute_ms == pytest.approx(ly.fwd_ms - ly.tail_ms, abs=1e-9)


def test_regions_plans_have_one_region_per_layer():
    chain = random_chain(6, 1, max_size=997, options=2)
    low = min(simulate(chain, regions_plan([FULL] * 6)).peak_bytes,
              simulate(chain, regions_plan([STORE] * 6)).peak_bytes)
    res = plan_regions(chain, low)
    assert res is not None
    for it in res.plan.items:
        assert getattr(it, "stop", getattr(it, "layer", 0) + 1) - getattr(it, "start", getattr(it, "layer", 0)) == 1
