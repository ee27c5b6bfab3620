"""The compiled tables (numba, optional) equal the numpy ones exactly.

Oracle: the numpy path (``limits.USE_NUMBA = False``), itself checked against brute force by
``test_planner_exact.py``/``test_planner_options.py``/``test_planner_dp.py`` (tables under
``NUMBA_MIN_UNITS`` units always take it; here the compiled kernels run on small tables too).
Same frontiers (bytes, recompute, choice) for every sub-chain, same min-peak, slot (nested) and
depth-1 tables, on chains with tiny sizes (many ties) and with options.
"""
from __future__ import annotations

import numpy as np
import pytest

from ckplan.planner import limits, min_peak, min_peak_plan, plan_none, simulate
from ckplan.planner import tables as T
from ckplan.planner.groups import cheap_cuts, make_units
from ckplan.planner.solve import layer_tables
from ckplan.planner.synthetic import random_chain, with_tails
from ckplan.planner.tables import base_bytes

pytest.importorskip("numba")

CASES = [(n, seed, size, opts) for n, seed in ((1, 0), (2, 1), (6, 2), (13, 3), (24, 4))
         for size in (7, 1_000_003) for opts in (0, 2)]


def _chain(n: int, seed: int, size: int, opts: int = 0):
    """A random chain whose layers have tails (``Layer.tail_ms``), so the kernels' checkpoint
    costs ``Q[j] - P[s]`` differ from the forward prefix sums."""
    return with_tails(random_chain(n, seed, max_size=size, options=opts), seed + 7)


def _both(monkeypatch, build):
    monkeypatch.setattr(limits, "NUMBA_MIN_UNITS", 0)  # compiled on small tables too
    monkeypatch.setattr(limits, "USE_NUMBA", False)
    a = build()
    monkeypatch.setattr(limits, "USE_NUMBA", True)
    return a, build()


@pytest.mark.parametrize("n,seed,size,opts", CASES)
@pytest.mark.parametrize("extras", ["plain", "lead-breaks-loss"])
def test_pair_costs_compiled_equal_numpy(monkeypatch, n, seed, size, opts, extras):
    """``PairCosts``' store needs, inner extras and forward-without-saving peaks (with options,
    lead bytes, breaks and a loss beside the top level's backward)."""
    from dataclasses import replace

    from ckplan.planner.synthetic import with_loss
    ch = _chain(n, seed, size, opts)
    if extras != "plain":
        rng = np.random.default_rng(seed)
        ch = with_loss(replace(ch, layers=tuple(replace(ly, lead_bytes=int(rng.integers(0, size)))
                                                for ly in ch.layers),
                               breaks=tuple(b for b in (2, n - 1) if 0 < b < n)), seed)
    u = make_units(ch)
    a, b = _both(monkeypatch, lambda: T.PairCosts(u))
    for name in ("opt_store_req", "store_req", "inner_extra", "fnone", "grads", "store_all"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)
    np.testing.assert_array_equal(a.grads[:, -1], b.grads_to_end)


@pytest.mark.parametrize("n,seed,size,opts", CASES)
def test_peak_table_compiled_equals_numpy(monkeypatch, n, seed, size, opts):
    u = make_units(_chain(n, seed, size, opts))
    pc = T.PairCosts(u)
    a, b = _both(monkeypatch, lambda: T.PeakTable(u, pc))
    np.testing.assert_array_equal(a.R, b.R)
    np.testing.assert_array_equal(a.K, b.K)


@pytest.mark.parametrize("n,seed,size,opts", CASES)
@pytest.mark.parametrize("frac,bounded", [(0.0, True), (0.05, True), (0.4, True), (1.0, False)])
def test_pareto_table_compiled_equals_numpy(monkeypatch, n, seed, size, opts, frac, bounded):
    ch = _chain(n, seed, size, opts)
    t = layer_tables(ch)
    lo, hi = min_peak(ch), simulate(ch, plan_none(n)).peak_bytes
    b = int(lo + frac * (hi - lo))
    ub = simulate(ch, min_peak_plan(ch, b)).recompute_ms if bounded else None
    x, y = _both(monkeypatch, lambda: T.ParetoTable(t.units, t.pairs, t.peaks.R, b - base_bytes(ch),
                                                    None, ub))
    assert x.ok and y.ok and x.n_points == y.n_points
    assert x.F.keys() == y.F.keys()
    for k, f in x.F.items():
        for got, want in zip(y.F[k], f):
            np.testing.assert_array_equal(got, want)
    assert x.parts(b - base_bytes(ch)) == y.parts(b - base_bytes(ch))


def test_pareto_table_compiled_stops_at_max_points(monkeypatch):
    ch = random_chain(24, 0, max_size=1_000_003)
    t = layer_tables(ch)
    top = simulate(ch, plan_none(24)).peak_bytes - base_bytes(ch)
    x, y = _both(monkeypatch, lambda: T.ParetoTable(t.units, t.pairs, t.peaks.R, top, 5))
    assert not x.ok and not y.ok


@pytest.mark.parametrize("n,seed,size", [(6, 0, 7), (40, 1, 7), (90, 2, 1_000_003)])
def test_flat_table_compiled_equals_numpy(monkeypatch, n, seed, size):
    t = layer_tables(_chain(n, seed, size))
    a, b = _both(monkeypatch, lambda: T.FlatTable(t.units, t.pairs, 997, 700, "nearest", 30))
    np.testing.assert_array_equal(a.C, b.C)
    np.testing.assert_array_equal(a.S, b.S)


@pytest.mark.parametrize("n,seed,size,opts,groups", [(6, 0, 7, 0, None), (13, 3, 7, 2, None),
                                                     (24, 4, 1_000_003, 2, None),
                                                     (70, 1, 7, 2, None), (200, 2, 1_000_003, 0, 80)])
@pytest.mark.parametrize("rounding", ["nearest", "up"])
def test_cost_table_compiled_equals_numpy(monkeypatch, n, seed, size, opts, groups, rounding):
    ch = _chain(n, seed, size, opts)
    u = make_units(ch, None if groups is None else cheap_cuts(ch, groups))
    pc = T.PairCosts(u)
    M = 150
    slot = max(1, int(pc.store_req.max()) * 2 // M)  # rounded sizes: negative inner shifts too
    a, b = _both(monkeypatch, lambda: T.CostTable(u, pc, slot, M, rounding))
    assert a.C.dtype == b.C.dtype
    for s in range(u.size):  # every C[s, e] with s < e (the rest is never written)
        np.testing.assert_array_equal(a.C[s, s + 1:], b.C[s, s + 1:])


@pytest.mark.parametrize("frac", [0.0, 0.02])
def test_pareto_kernel_gallop_keeps_long_chains_identical(monkeypatch, frac):
    # Long walks over wide envelopes (50 layers, 2 options, near the smallest peak) are where the
    # kernel gallops over envelope segments (tables.GALLOP_BLOCK): every frontier must still equal
    # the numpy path's, point for point.
    ch = _chain(50, 11, 1_000_003, 2)
    t = layer_tables(ch)
    lo, hi = min_peak(ch), simulate(ch, plan_none(50)).peak_bytes
    b = int(lo + frac * (hi - lo))
    ub = simulate(ch, min_peak_plan(ch, b)).recompute_ms
    x, y = _both(monkeypatch, lambda: T.ParetoTable(t.units, t.pairs, t.peaks.R, b - base_bytes(ch), None, ub))
    assert x.F.keys() == y.F.keys() and x.n_points > 50
    for k, f in x.F.items():
        for got, want in zip(y.F[k], f):
            np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("n,seed,size,opts", [(13, 3, 1_000_003, 2), (24, 4, 7, 2), (30, 5, 1_000_003, 0)])
@pytest.mark.parametrize("frac,bounded,thin", [(0.0, True, False), (0.3, True, True), (0.6, False, False),
                                               (0.9, True, True)])
def test_tails_on_a_prebuilt_inner_part_equal_a_table_built_whole(monkeypatch, n, seed, size, opts,
                                                                  frac, bounded, thin):
    """``ParetoTable.inner_part`` (built with no recompute bound, as ``dp.plan_dp`` builds it
    beside the coarse plan) then the tails with a bound (and thinning): every tail's frontier,
    and the plan read, equal those of the table built in one go; a part built for another
    table is refused."""
    ch = _chain(n, seed, size, opts)
    t = layer_tables(ch)
    u, pc = t.units, t.pairs
    monkeypatch.setattr(limits, "NUMBA_MIN_UNITS", 0)
    lo, hi = min_peak(ch), simulate(ch, plan_none(n)).peak_bytes
    b = int(lo + frac * (hi - lo))
    avail = b - base_bytes(ch)
    ub = simulate(ch, min_peak_plan(ch, b)).recompute_ms if bounded else None
    L = max(2, n // 4)
    pk = T.PeakTable(u, pc, L, n)
    kw = dict(max_len=L, top_len=n, max_total=10**7)
    thin_kw = dict(trim_every=3, trim_abs=0.05 * sum(ly.fwd_ms for ly in ch.layers)) if thin else {}
    part = T.ParetoTable.inner_part(u, pc, pk.R, avail, 10**6, **kw)
    assert part is not None
    # one part serves several tables: the same one twice, then one with another bound and no
    # thinning (its tails skip other sub-chains: nothing of the earlier tables may stay)
    other = 0.5 * ub if ub else simulate(ch, min_peak_plan(ch, b)).recompute_ms
    for bound, thinning in ((ub, thin_kw), (ub, thin_kw), (other, {}), (ub, thin_kw)):
        whole = T.ParetoTable(u, pc, pk.R, avail, 10**6, bound, **kw, **thinning)
        split = T.ParetoTable(u, pc, pk.R, avail, 10**6, bound, **kw, **thinning, inner=part)
        assert split.ok and whole.ok
        tails = [k for k in whole.F if k[1] == u.size]
        assert tails and tails == [k for k in split.F if k[1] == u.size]
        for k in tails:
            for got, want in zip(split.F[k], whole.F[k]):
                np.testing.assert_array_equal(got, want)
        assert split.cost(avail) == whole.cost(avail)
        if whole.cost(avail) < np.inf:
            assert split.parts(avail) == whole.parts(avail)
    with pytest.raises(ValueError, match="another table"):
        T.ParetoTable(u, pc, pk.R, avail - 1, 10**6, ub, **kw, inner=part)
