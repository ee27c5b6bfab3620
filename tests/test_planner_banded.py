"""The banded DP: optimal among its plans, never over budget.

Oracles: brute force over every plan of rotor's grammar with every option of every layer,
filtered to the band (every checkpoint spans at most L layers, except top-level checkpoints
that store every layer inside, which may be longer); the exact DP (``mode="exact"``, itself
checked against brute force) on chains long enough to take the banded path in ``plan_dp``.
"""
from __future__ import annotations

import itertools
import math
import os
import re

import pytest
from brute_options import Best, _assign, budgets, plans
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckplan.planner import limits, min_peak, plan_chain, plan_dp, plan_none, simulate
from ckplan.planner import tables as T
from ckplan.planner.chain import STORE, Chain
from ckplan.planner.limits import BAND_MIN_LAYERS
from ckplan.planner.plan import Checkpoint, Store
from ckplan.planner.simulate import peak_of
from ckplan.planner.solve import banded_plan, coarse, layer_tables, plan_from
from ckplan.planner.synthetic import random_chain, uniform_chain, with_tails
from ckplan.planner.tables import base_bytes, fixed_peak


def _nested_within(items: tuple, most: int) -> bool:
    return all(not isinstance(it, Checkpoint)
               or (it.stop - it.start <= most and _nested_within(it.inner, most)) for it in items)


def in_band(items: tuple, most: int, long_top: bool, top: int | None = None) -> bool:
    """A plan of the band: checkpoints span at most ``most`` layers, except (``long_top``)
    top-level ones (of at most ``top`` layers, when given) whose layers are all stored with
    ``store``."""
    for it in items:
        if not isinstance(it, Checkpoint):
            continue
        if it.stop - it.start > most:
            if not (long_top and (top is None or it.stop - it.start <= top)
                    and all(isinstance(x, Store) and x.option == STORE for x in it.inner)):
                return False
        elif not _nested_within(it.inner, most):
            return False
    return True


def brute_band(chain: Chain, most: int, long_top: bool,
               top: int | None = None) -> list[tuple[int, float]]:
    choices = [(STORE, *(o.name for o in ly.options)) for ly in chain.layers]
    out = []
    for items in plans(chain.n_layers):
        for names in itertools.product(*choices):
            full = _assign(items, names)
            if in_band(full, most, long_top, top):
                out.append(peak_of(chain, full))
    return out


def check_band_against_brute(chain: Chain, most: int, long_top: bool,
                             longest: int | None = None) -> None:
    """``longest``: long top-level checkpoints of at most this many layers (``top_len``)."""
    n = chain.n_layers
    scores = brute_band(chain, most, long_top, longest)
    best = Best(scores)
    t = layer_tables(chain)
    u, pc = t.units, t.pairs
    top = (longest or n) if long_top else most
    peaks = T.PeakTable(u, pc, most, top)
    lowest = min(p for p, _ in scores)
    assert max(fixed_peak(chain), base_bytes(chain) + int(peaks.R[0, u.size])) == lowest
    top_avail = max(p for p, _ in scores) - base_bytes(chain)  # one table answers every budget
    pt = T.ParetoTable(u, pc, peaks.R, top_avail, None, None, max_len=most, top_len=top)
    for b in budgets(scores):
        want = best(b)
        if b < fixed_peak(chain) or b - base_bytes(chain) < peaks.R[0, u.size]:
            assert want == math.inf
            continue
        avail = min(b - base_bytes(chain), top_avail)
        assert pt.cost(avail) == pytest.approx(want, rel=1e-9, abs=1e-9), b
        plan = plan_from(chain, u, *pt.parts(avail), {})
        assert in_band(plan.items, most, long_top, longest), plan.describe()
        sc = simulate(chain, plan)
        assert sc.peak_bytes <= b
        assert sc.recompute_ms == pytest.approx(want, rel=1e-9, abs=1e-9), (b, plan.describe())


band_chains = st.builds(lambda n, seed, k: with_tails(random_chain(n, seed, max_size=997, options=k), seed),
                        st.integers(3, 6), st.integers(0, 2**32), st.integers(0, 2))


@pytest.mark.slow
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(band_chains, st.integers(1, 3), st.booleans())
def test_banded_tables_equal_brute_force_over_the_band(chain, most, long_top):
    if chain.has_options and chain.n_layers > 4:  # 3^6 option sets of every plan: too many
        chain = random_chain(4, chain.n_layers, max_size=997, options=2)
    check_band_against_brute(chain, most, long_top)


@pytest.mark.parametrize("seed", range(3))
def test_banded_tables_on_seven_layers(seed):
    """Seven layers, thousands of plans: bands of 2 and 3, with and without long top-level
    checkpoints (xbar close to x makes long checkpoints pay, as in MLP-like chains)."""
    ch = random_chain(7, seed, max_size=997)
    for most, long_top in ((2, True), (3, False), (3, True)):
        check_band_against_brute(ch, most, long_top)



def test_banded_tables_with_long_checkpoints_cut_short():
    """Long top-level checkpoints of at most ``top_len`` layers (``BAND_TOP``), on a chain whose
    optimum takes longer ones well above the smallest peak."""
    check_band_against_brute(_mlp_like(7), 1, True, longest=3)


@pytest.mark.parametrize("n,seed,size,opts", [(6, 2, 7, 0), (13, 3, 1_000_003, 2), (24, 4, 7, 2),
                                              (40, 5, 1_000_003, 0)])
@pytest.mark.parametrize("most,long_top", [(2, True), (4, False), (4, True)])
def test_banded_tables_compiled_equal_numpy(monkeypatch, n, seed, size, opts, most, long_top):
    pytest.importorskip("numba")
    ch = with_tails(random_chain(n, seed, max_size=size, options=opts), seed)
    t = layer_tables(ch)
    u, pc = t.units, t.pairs
    top = n if long_top else most
    monkeypatch.setattr(limits, "NUMBA_MIN_UNITS", 0)

    def build(flag: bool):
        monkeypatch.setattr(limits, "USE_NUMBA", flag)
        pk = T.PeakTable(u, pc, most, top)
        lo, hi = base_bytes(ch) + int(pk.R[0, u.size]), simulate(ch, plan_none(n)).peak_bytes
        avail = (lo + hi) // 3 * 2 - base_bytes(ch) if hi > lo else int(pk.R[0, u.size])
        return pk, T.ParetoTable(u, pc, pk.R, avail, None, None, max_len=most, top_len=top), avail
    (pa, ta, avail), (pb, tb, _) = build(False), build(True)
    assert (pa.R == pb.R).all() and (pa.K == pb.K).all()
    assert ta.F.keys() == tb.F.keys()
    for k, f in ta.F.items():
        for got, want in zip(tb.F[k], f):
            assert (got == want).all(), k
    assert ta.parts(avail) == tb.parts(avail)


def _mlp_like(n: int) -> Chain:
    """Layers that keep little besides their output: one long checkpoint storing its layers is
    what the optimum takes well above the smallest peak (the band alone missed it by 5-6%)."""
    return uniform_chain(n, x_bytes=1_000_003, xbar_bytes=1_000_010, persistent_bytes=10**8)


@pytest.mark.parametrize("chain", [_mlp_like(BAND_MIN_LAYERS + 6),
                                   uniform_chain(BAND_MIN_LAYERS + 6, x_bytes=1_000_003,
                                                 xbar_bytes=4_000_019, persistent_bytes=10**8),
                                   random_chain(BAND_MIN_LAYERS + 6, 3, max_size=1_000_003, options=2)],
                         ids=["mlp-like", "xbar-4x", "random-options"])
@pytest.mark.parametrize("frac", [0.0, 0.01, 0.1, 0.3, 0.5, 0.8])
def test_plan_dp_banded_path_matches_the_exact_dp(chain, frac):
    n = chain.n_layers
    lo, hi = min_peak(chain), simulate(chain, plan_none(n)).peak_bytes
    b = int(lo + frac * (hi - lo))
    got = plan_dp(chain, b)
    ref = plan_dp(chain, b, mode="exact")
    assert ref.exact
    sg, sr = simulate(chain, got.plan), simulate(chain, ref.plan)
    assert sg.peak_bytes <= b
    assert sg.recompute_ms == pytest.approx(sr.recompute_ms, rel=1e-9, abs=1e-9), got.notes
    assert plan_chain(chain, "dp", b).score.recompute_ms == pytest.approx(sr.recompute_ms, rel=1e-9)


def test_banded_plan_widens_to_the_whole_chain_when_it_must():
    """A chain of layers keeping only their output reaches its smallest peak only with long
    nested checkpoints: the band widens until a plan fits, and at the whole chain says exact."""
    ch = _mlp_like(40)
    lo = min_peak(ch)
    got = banded_plan(ch, lo, start=4)
    assert got is not None and simulate(ch, got.plan).peak_bytes <= lo
    assert got.band > 4
    if got.band >= ch.n_layers:
        assert got.exact


def test_banded_plan_bound_prunes_without_changing_the_answer():
    ch = random_chain(BAND_MIN_LAYERS + 6, 5, max_size=1_000_003)
    lo, hi = min_peak(ch), simulate(ch, plan_none(ch.n_layers)).peak_bytes
    b = (lo + hi) // 2
    plain = banded_plan(ch, b)
    bounded = banded_plan(ch, b, bound=plan_none(ch.n_layers))  # over budget: ignored
    assert plain is not None and bounded is not None
    assert simulate(ch, plain.plan).recompute_ms == simulate(ch, bounded.plan).recompute_ms
    assert banded_plan(ch, fixed_peak(ch) - 1) is None


@pytest.mark.parametrize("most_points,retried", [(1500, True), (3, False)])
def test_banded_plan_when_frontiers_outgrow_the_limit(monkeypatch, most_points, retried):
    """A frontier past ``BAND_MAX_POINTS`` stops the band's table; it is built again pruned by
    the slot table's plan, and when that is still too big the banded DP gives up (None) and
    ``plan_dp`` plans with its other tables: the answer fits either way, and with the retry it
    is still the optimum."""
    ch = random_chain(BAND_MIN_LAYERS + 6, 2, max_size=1_000_003, options=2)
    lo, hi = min_peak(ch), simulate(ch, plan_none(ch.n_layers)).peak_bytes
    b = int(lo + 0.9 * (hi - lo))  # the first table: ~3000 points; pruned by the slot plan: ~80
    want = simulate(ch, plan_dp(ch, b, mode="exact").plan).recompute_ms
    monkeypatch.setattr(limits, "BAND_MAX_POINTS", most_points)
    got = banded_plan(ch, b)
    res = plan_dp(ch, b)
    assert simulate(ch, res.plan).peak_bytes <= b
    assert (got is not None) == retried
    if got is None:
        assert not any("near-optimal, not proven" in n for n in res.notes)
    else:
        assert simulate(ch, got.plan).recompute_ms == pytest.approx(want, rel=1e-9)


def test_unkept_boundaries_over_120_layers_plan_with_the_banded_dp():
    """A chain whose plain forward does not keep some boundaries plans on a bound that keeps
    them, at several budgets: past 120 layers those plans now come from the banded DP instead of
    the grouped tables (which ignore options): it fits, and is no dearer."""
    from dataclasses import replace
    ch = random_chain(125, 3, max_size=1_000_003, options=2)
    ch = replace(ch, layers=tuple(replace(ly, x_kept=False) if i % 7 == 3 else ly
                                  for i, ly in enumerate(ch.layers)))
    assert not ch.all_kept
    lo, hi = min_peak(ch), simulate(ch, plan_none(ch.n_layers)).peak_bytes
    b = int(lo + 0.1 * (hi - lo))
    got = simulate(ch, plan_dp(ch, b).plan)
    old = simulate(ch, plan_dp(ch, b, mode="grouped").plan)
    assert got.peak_bytes <= b
    assert got.recompute_ms < old.recompute_ms


@pytest.mark.parametrize("frac", [0.3, 0.9])
def test_coarse_bound_fits_and_changes_nothing_but_time(frac):
    """Past 150 layers, away from the smallest peak, the banded DP starts from the plan of the
    same band on sizes rounded up to 1/4000 of the budget: it fits, it is a bound only (the
    answer equals the banded DP's without it)."""
    from ckplan.planner.limits import COARSE_MIN_LAYERS
    from ckplan.planner.solve.coarse import _coarse_plan
    ch = random_chain(COARSE_MIN_LAYERS + 10, 4, max_size=1_000_003, options=2)
    lo, hi = min_peak(ch), simulate(ch, plan_none(ch.n_layers)).peak_bytes
    b = int(lo + frac * (hi - lo))
    bound = _coarse_plan(ch, b).plan
    assert bound is not None and simulate(ch, bound).peak_bytes <= b
    plain = banded_plan(ch, b)
    got = plan_dp(ch, b)  # with the coarse bound
    assert plain is not None
    assert simulate(ch, got.plan).peak_bytes <= b
    assert simulate(ch, got.plan).recompute_ms == pytest.approx(simulate(ch, plain.plan).recompute_ms,
                                                               rel=1e-9)
    assert simulate(ch, got.plan).recompute_ms <= simulate(ch, bound).recompute_ms
    low = _coarse_plan(ch, lo)
    assert low is None or simulate(ch, low.plan).peak_bytes <= lo


# ---- Trimmed tails (long chains, ``ParetoTable``'s ``trim``) ------------------------------------
# Oracle: the untrimmed table (itself equal to brute force above). Claim under test: every point
# left is a real plan (a plan read from the trimmed table fits and recomputes at most what the
# table says), and the least recompute is within (1 - trim) ** -k of the optimum, k the top-level
# items of an optimal plan (plus the loss unit). Trims of 5-20% make the thinning bite on chains
# this small; the bound is then loose enough to fail only when the recursion is wrong.


def _trim_cases(trim: float, numba: bool, monkeypatch, every: int = 1, eps_share: float = 0.0) -> int:
    """Check the claim on a few chains at a grid of budgets, every ``every``-th tail thinned
    (k: the optimal plan's top-level items starting at a thinned tail); return how many answers
    the trimming changed (the test must see some, or it checks nothing). ``eps_share``: thin by
    an absolute ``eps`` too (``trim_abs``: this share of the chain's forward time), the bound
    then ``(optimum + k eps) / (1 - trim) ** k``."""
    if numba:
        pytest.importorskip("numba")
    monkeypatch.setattr(limits, "NUMBA_MIN_UNITS", 0)
    monkeypatch.setattr(limits, "USE_NUMBA", numba)
    changed = 0
    for n, seed, opts in ((8, 1, 0), (12, 2, 2), (20, 3, 1), (30, 4, 0)):
        ch = with_tails(random_chain(n, seed, max_size=1_000_003, options=opts), seed)
        t = layer_tables(ch)
        u, pc = t.units, t.pairs
        lo, hi = min_peak(ch), simulate(ch, plan_none(n)).peak_bytes
        top = hi - base_bytes(ch)
        exact = T.ParetoTable(u, pc, t.peaks.R, top)
        eps = eps_share * sum(ly.fwd_ms for ly in ch.layers)
        trimmed = T.ParetoTable(u, pc, t.peaks.R, top, trim=trim, trim_every=every, trim_abs=eps)
        assert trimmed.total_points < exact.total_points
        for f in (0.0, 0.001, 0.01, 0.05, 0.1, 0.2, 0.35, 0.5, 0.7, 0.9):
            b = int(lo + f * (hi - lo))
            avail = b - base_bytes(ch)
            want = exact.cost(avail)
            got = trimmed.cost(avail)
            items = plan_from(ch, u, *exact.parts(avail), {}).items
            k = sum((it.layer if isinstance(it, Store) else it.start) % every == 0 for it in items) + 1
            assert want - 1e-9 <= got <= (want + k * eps) * (1 - trim) ** -k + 1e-9, (n, f)
            plan = plan_from(ch, u, *trimmed.parts(avail), {})
            sc = simulate(ch, plan)
            assert sc.peak_bytes <= b, (n, f)
            assert sc.recompute_ms <= got + 1e-9, (n, f)
            changed += got > want + 1e-9
    return changed


@pytest.mark.parametrize("numba", [False, True], ids=["numpy", "numba"])
def test_trimmed_tails_fit_and_stay_within_their_bound(monkeypatch, numba):
    assert _trim_cases(0.2, numba, monkeypatch) > 0
    _trim_cases(0.05, numba, monkeypatch)
    assert _trim_cases(0.3, numba, monkeypatch, every=3) > 0  # every third tail, thinned more


@pytest.mark.parametrize("numba", [False, True], ids=["numpy", "numba"])
def test_tails_thinned_by_an_absolute_amount_stay_within_k_eps(monkeypatch, numba):
    """``trim_abs``: a thinned tail keeps a point only when it is eps ms cheaper than the last
    kept, so the least recompute is within k x eps of the optimum (alone, and with ``trim``)."""
    assert _trim_cases(0.0, numba, monkeypatch, eps_share=0.02) > 0
    assert _trim_cases(0.0, numba, monkeypatch, every=3, eps_share=0.05) > 0
    assert _trim_cases(0.1, numba, monkeypatch, eps_share=0.01) > 0


@pytest.mark.parametrize("numba", [False, True], ids=["numpy", "numba"])
def test_only_every_nth_tail_is_thinned(monkeypatch, numba):
    """``trim_every`` past the last tail thins only tail 0: every other frontier is the
    untrimmed table's, point for point."""
    if numba:
        pytest.importorskip("numba")
    monkeypatch.setattr(limits, "NUMBA_MIN_UNITS", 0)
    monkeypatch.setattr(limits, "USE_NUMBA", numba)
    ch = with_tails(random_chain(20, 5, max_size=1_000_003, options=2), 5)
    t = layer_tables(ch)
    u, pc = t.units, t.pairs
    top = simulate(ch, plan_none(20)).peak_bytes - base_bytes(ch)
    exact = T.ParetoTable(u, pc, t.peaks.R, top)
    one = T.ParetoTable(u, pc, t.peaks.R, top, trim=0.3, trim_every=u.size + 1)
    assert exact.F.keys() == one.F.keys()
    for key, f in exact.F.items():
        if key != (0, u.size):
            assert all((a == b).all() for a, b in zip(one.F[key], f)), key
    assert len(one.F[(0, u.size)][0]) < len(exact.F[(0, u.size)][0])


def test_trim_is_refused_outside_zero_to_one():
    ch = random_chain(5, 0, max_size=1000)
    t = layer_tables(ch)
    for bad in (-0.1, 1.0):
        with pytest.raises(ValueError, match="trim"):
            T.ParetoTable(t.units, t.pairs, t.peaks.R, 10**9, trim=bad)


@pytest.mark.parametrize("frac", [0.0, 0.01, 0.3])
@pytest.mark.parametrize("over_band", [False, True], ids=["every-tail", "every-8th-tail"])
def test_long_chains_plan_with_trimmed_tails_within_the_stated_bound(monkeypatch, frac, over_band):
    """``plan_dp`` on a chain over TRIM_MIN_LAYERS (lowered here to a chain the exact DP can
    check; and over BAND_MAX_LAYERS, where every 8th tail is thinned, by an absolute amount
    from the coarse plan's recompute away from the smallest peak): the plan fits, says it is
    within some bound of at most 4.6%, and is, against the exact DP."""
    from ckplan.planner import solve as D
    monkeypatch.setattr(limits, "TRIM_MIN_LAYERS", BAND_MIN_LAYERS)
    monkeypatch.setattr(limits, "COARSE_MIN_LAYERS", BAND_MIN_LAYERS)
    if over_band:
        monkeypatch.setattr(limits, "BAND_MAX_LAYERS", BAND_MIN_LAYERS + 2)
    ch = random_chain(BAND_MIN_LAYERS + 6, 7, max_size=1_000_003, options=2)
    n = ch.n_layers
    lo, hi = min_peak(ch), simulate(ch, plan_none(n)).peak_bytes
    b = int(lo + frac * (hi - lo))
    assert D.tail_trim(ch)[1] == (limits.TRIM_EVERY if over_band else 1)
    got = plan_dp(ch, b)
    ref = plan_dp(ch, b, mode="exact")
    assert ref.exact and not got.exact
    stated = [float(m.group(1)) for x in got.notes for m in [re.search(r"within (\d+\.\d)%", x)] if m]
    assert len(stated) == 1 and stated[0] <= 4.6, got.notes
    if not over_band or frac < limits.COARSE_MIN_FRAC:
        assert stated[0] == 4.6  # relative thinning: the bound known beforehand
    else:
        assert stated[0] < 4.6  # absolute thinning, its bound proven after the fact
    sg, sr = simulate(ch, got.plan), simulate(ch, ref.plan)
    assert sg.peak_bytes <= b
    assert sr.recompute_ms - 1e-9 <= sg.recompute_ms <= sr.recompute_ms * (1 + (stated[0] + 0.05) / 100)


def _thinned(chain: Chain, budget: int, bound, monkeypatch, **kw):
    from ckplan.planner import solve as D
    monkeypatch.setattr(limits, "TRIM_MIN_LAYERS", BAND_MIN_LAYERS)
    monkeypatch.setattr(limits, "BAND_MAX_LAYERS", BAND_MIN_LAYERS + 2)
    trim, every = D.tail_trim(chain)
    return banded_plan(chain, budget, bound=bound, trim=trim, trim_every=every, **kw), trim, every


@pytest.mark.parametrize("frac", [0.1, 0.5, 0.9])
def test_absolute_thinning_proves_its_bound_after_the_fact(monkeypatch, frac):
    """``banded_plan``'s ``trim_abs``: eps from the bound plan's recompute; the answer R is within
    k eps of the optimum, so ``within`` = k eps / (R - k eps), which must hold against the
    exact DP; a bound far above the optimum (the smallest-peak plan, half-way up) makes that
    too loose, and the table is built again with eps from R."""
    from ckplan.planner import solve as D
    ch = random_chain(BAND_MIN_LAYERS + 6, 11, max_size=1_000_003, options=2)
    n = ch.n_layers
    lo, hi = min_peak(ch), simulate(ch, plan_none(n)).peak_bytes
    b = int(lo + frac * (hi - lo))
    ref = simulate(ch, plan_dp(ch, b, mode="exact").plan).recompute_ms
    absolute = 0
    for bound in (coarse._coarse_plan(ch, b).plan, D.min_peak_plan(ch)):
        got, trim, every = _thinned(ch, b, bound, monkeypatch, trim_abs=limits.TAIL_TRIM_ABS)
        sc = simulate(ch, got.plan)
        assert sc.peak_bytes <= b and not got.exact
        relative = math.expm1(-math.log1p(-trim) * -(-(n + 1) // every))
        assert 0 < got.within <= relative + 1e-12
        absolute += got.within < relative - 1e-12
        assert ref - 1e-9 <= sc.recompute_ms <= ref * (1 + got.within) + 1e-9
    assert absolute  # some answer carries the bound proven after the fact


def test_absolute_thinning_falls_back_to_relative_when_its_bound_is_too_loose(monkeypatch):
    """When no absolute thinning proves as much as the relative trim would, the table is built
    with the relative trim and the plan carries that bound, (1 - trim) ** -k - 1."""
    ch = random_chain(BAND_MIN_LAYERS + 6, 11, max_size=1_000_003, options=2)
    n = ch.n_layers
    lo, hi = min_peak(ch), simulate(ch, plan_none(n)).peak_bytes
    b = int(lo + 0.5 * (hi - lo))
    trim, every = limits.TAIL_TRIM_ERROR / -(-(n + 1) // limits.TRIM_EVERY), limits.TRIM_EVERY
    got = banded_plan(ch, b, bound=coarse._coarse_plan(ch, b).plan, trim=trim, trim_every=every,
                      trim_abs=0.5)  # k eps = half the optimum: never as good as relative
    k = -(-(n + 1) // every)
    assert got.within == pytest.approx(math.expm1(-math.log1p(-trim) * k))
    ref = simulate(ch, plan_dp(ch, b, mode="exact").plan).recompute_ms
    assert simulate(ch, got.plan).recompute_ms <= ref * (1 + got.within) + 1e-9


def test_coarse_plan_is_reproducible():
    """Stochastic rounding with a fixed seed: the same chain and budget give the same plan."""
    ch = random_chain(limits.COARSE_MIN_LAYERS + 10, 4, max_size=1_000_003, options=2)
    lo, hi = min_peak(ch), simulate(ch, plan_none(ch.n_layers)).peak_bytes
    b = int(lo + 0.4 * (hi - lo))
    first = coarse._coarse_plan(ch, b)
    layer_tables.cache_clear()
    assert first is not None and coarse._coarse_plan(ch, b) == first


def test_long_top_level_checkpoints_cut_short_fit_and_cost_no_less():
    """``banded_plan``'s ``top``: long top-level checkpoints of at most ``top`` layers; on a chain
    whose plan without the limit takes a longer one, the plan with it spans less and recomputes
    no less (a smaller plan space), and its note says so; with ``widen_top`` (as ``plan_dp``
    calls it) the limit grows until the plan no longer uses it all."""
    from dataclasses import replace as dc_replace

    import numpy as np

    from ckplan.planner.solve.band import _band_note
    base = random_chain(60, 4, max_size=1_000_003)
    rng = np.random.default_rng(4)
    ch = dc_replace(base, layers=tuple(dc_replace(ly, x_bytes=1_000_003,
                                                  xbar_bytes=1_000_003 + int(50_000 * rng.random()) + 7)
                                       for ly in base.layers))
    lo, hi = min_peak(ch), simulate(ch, plan_none(60)).peak_bytes
    b = int(lo + 0.5 * (hi - lo))
    free, cut = banded_plan(ch, b, start=8), banded_plan(ch, b, start=8, top=12)
    assert free.band == cut.band == 8 and cut.top == 12 and free.top is None
    assert max(r.stop - r.start for r in free.plan.recomputed_ranges()) > 12
    assert max(r.stop - r.start for r in cut.plan.recomputed_ranges()) <= 12
    sf, sc = simulate(ch, free.plan), simulate(ch, cut.plan)
    assert sc.peak_bytes <= b and sc.recompute_ms >= sf.recompute_ms - 1e-9
    assert "of up to 12," in _band_note(cut) and "of up to" not in _band_note(free)
    # widened while the plan has one as long as allowed (12 -> 48): the plan without the limit's
    wide = banded_plan(ch, b, start=8, top=12, widen_top=True)
    assert wide.top == 48
    assert simulate(ch, wide.plan).recompute_ms == pytest.approx(sf.recompute_ms, rel=1e-12)


@pytest.mark.parametrize("frac", [0.05, 0.4])
def test_long_chains_with_options_take_the_banded_dp_and_fall_back_when_it_outgrows(monkeypatch, frac):
    """Over BAND_MAX_LAYERS (lowered here) a chain with options is planned by the banded DP, with
    its options (the exact DP's plan, which uses them); without options by the tables;
    and when the banded DP's frontiers outgrow BAND_MAX_TOTAL, by the grouped tables too."""
    from ckplan.planner import solve as D
    n = BAND_MIN_LAYERS + 6
    monkeypatch.setattr(limits, "BAND_MAX_LAYERS", BAND_MIN_LAYERS + 2)
    ch = random_chain(n, 3, max_size=1_000_003, options=2)
    lo, hi = min_peak(ch), simulate(ch, plan_none(n)).peak_bytes
    b = int(lo + frac * (hi - lo))
    assert D.plans_banded(ch) and not D.plans_banded(ch.without_options())
    got = plan_dp(ch, b)
    ref = plan_dp(ch, b, mode="exact")
    assert D.OPTIONS_IGNORED not in got.notes and any("near-optimal" in x for x in got.notes)
    assert ref.plan.uses_options
    sg = simulate(ch, got.plan)
    assert sg.peak_bytes <= b
    assert sg.recompute_ms == pytest.approx(simulate(ch, ref.plan).recompute_ms, rel=1e-9, abs=1e-9)
    plain = plan_dp(ch.without_options(), b) if b >= min_peak(ch.without_options()) else None
    if plain is not None:
        assert not any("checkpoints span at most" in x for x in plain.notes)  # the tables'
    monkeypatch.setattr(limits, "BAND_MAX_TOTAL", 1000)
    monkeypatch.setattr(limits, "EXACT_MAX_LAYERS", BAND_MIN_LAYERS)  # grouped tables, as over 400
    monkeypatch.setattr(limits, "DEFAULT_GROUPS", 10)
    small = plan_dp(ch, b)
    assert simulate(ch, small.plan).peak_bytes <= b
    assert D.OPTIONS_IGNORED in small.notes or any("smallest peak" in x for x in small.notes)
    assert simulate(ch, small.plan).recompute_ms >= sg.recompute_ms - 1e-9


@pytest.mark.parametrize("frac", [0.2, 0.7])
def test_inner_frontiers_built_beside_the_coarse_plan_change_nothing(monkeypatch, frac):
    """``plan_dp`` builds the banded table's inner frontiers on a second thread while it looks
    for the coarse plan (``_coarse_beside_inner``): the plan equals the one built on one CPU."""
    pytest.importorskip("numba")
    ch = random_chain(limits.COARSE_MIN_LAYERS + 10, 6, max_size=1_000_003, options=2)
    lo, hi = min_peak(ch), simulate(ch, plan_none(ch.n_layers)).peak_bytes
    b = int(lo + frac * (hi - lo))
    found, pre = coarse._coarse_beside_inner(ch, b, None)
    assert pre is not None and pre.inner is not None and found is not None
    two = plan_dp(ch, b)
    monkeypatch.setattr(os, "cpu_count", lambda: 1)
    assert coarse._coarse_beside_inner(ch, b, None)[1] is None
    one = plan_dp(ch, b)
    assert two.plan == one.plan and two.notes == one.notes
