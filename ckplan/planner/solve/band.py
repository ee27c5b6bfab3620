"""The banded DP: the exact DP in bytes over plans whose checkpoints span at most L layers."""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from .. import limits
from ..chain import Chain
from ..plan import Checkpoint, Plan
from ..simulate import simulate
from ..tables import (
    INF,
    InnerPart,
    ParetoTable,
    PeakTable,
    Spans,
    base_bytes,
    exact_chooser,
    fixed_peak,
    nest_spans,
    reconstruct_options,
)
from .common import (
    layer_tables,
    plan_from,
)
from .solver import _slot_plan


@dataclass(frozen=True)
class Banded:
    """``banded_plan``'s answer: the plan, the band it was found in (the most layers a
    checkpoint may span), and whether that band is the whole chain (then optimal)."""

    plan: Plan
    band: int
    exact: bool
    longest: int  # the most layers one checkpoint of the plan spans
    # The tails' frontiers were thinned (``ParetoTable``'s ``trim``/``trim_abs``): the plan is
    # proven within this much (relative) of the band's optimum; 0.0 when not thinned.
    within: float = 0.0
    top: int | None = None  # the most layers a long top-level checkpoint may span (None: any)
    # Top-level checkpoints longer than the band may also nest checkpoints of the band where
    # ``banded_plan``'s ``nest`` allowed it (at the top-level checkpoints of the plans it tried).
    nested: bool = False


@dataclass(frozen=True)
class Prebuilt:
    """The banded DP's first band built ahead of its bound: the min-peak table and the inner
    frontiers (``ParetoTable.inner_part``, which need no bound)."""

    band: int
    top: int  # the most layers of a long top-level checkpoint (the band's ``top_len``)
    peaks: PeakTable
    inner: InnerPart | None


def banded_plan(chain: Chain, budget_bytes: int, start: int = limits.BAND_START,
                max_work: int = limits.BAND_WORK, bound: Plan | None = None,
                trim: float = 0.0, trim_every: int = 1, trim_abs: float = 0.0,
                trim_scale: float | None = None, top: int | None = None,
                widen_top: bool = False, prebuilt: Prebuilt | None = None,
                nest: bool = False) -> Banded | None:
    """The least-recompute plan fitting ``budget_bytes`` among the plans of a band L: every
    checkpoint spans at most L layers (nesting allowed inside), except top-level checkpoints,
    which may span any number of layers (at most ``top`` when given) when they store every
    layer inside (one long checkpoint that keeps its layers is what chains whose layers keep
    little besides their output want at budgets well above the smallest peak; consecutive
    ones of at most ``top`` layers recompute less, and hold a few more boundaries). L is
    widened until the plan no longer needs it; with ``widen_top``, ``top`` too (x4 while the
    plan has a long checkpoint of more than half ``top``: the limit can make the best plan
    shorten one that would pay to be longer, as on an MLP-like chain of 60 layers limited to
    12, whose plan then spans 10 and recomputes 1.4% more than with 15).

    ``nest``: top-level checkpoints longer than L may also nest checkpoints of the band inside
    where ``_nest_spans`` of the plans found so far allows (ending where one of their top-level
    checkpoints ends, starting at most ``NEST_MERGE`` of them back): each band's table is built
    with the spans of the best plan so far (the bound, or the smallest-peak plan of the band),
    and again (at most ``NEST_ROUNDS`` times) while its plan nests such a checkpoint and has
    top-level checkpoints the spans did not cover; and L is doubled also while the plan nests one
    of at most 2L layers, up to ``NEST_WIDEN``. ``Banded.nested`` says so.

    The exact DP in bytes (``ParetoTable``) restricted to such plans needs only the tails
    ``[s, U)`` and the sub-chains of at most L layers: O(U L^2 + U^2) splits instead of O(U^3),
    and short frontiers. Start at L = ``start``; double L while no banded plan reaches the
    budget or the best plan has a checkpoint of exactly L layers (a wider band may do better),
    up to the whole chain (exact, ``Banded.exact``) or while the next band's table should stay
    under ``max_work`` breakpoints (4 x this band's). Each band's table is pruned by the best
    plan so far (``bound`` when given, else the first feasible band's smallest-peak plan).
    Optimal among the plans of the last band's last table. None when no band's table was
    built (none reaches the budget within the limit, or the first frontier outgrows
    ``PARETO_MAX_POINTS``); the caller falls back to the slot and grouped tables.

    ``trim``, ``trim_every``: the tails' frontiers thinned (``ParetoTable``): within
    ``(1 - trim) ** -k`` of the band's optimum instead of equal to it, ``k = ceil(U /
    trim_every)`` (long chains: ``tail_trim``). ``trim_abs`` (with ``trim``, and a ``bound`` that
    fits): thin by ``eps = trim_abs x scale / k`` ms instead (``ParetoTable``'s ``trim_abs``;
    ``scale``: the bound's recompute, or ``trim_scale``, an estimate of the optimum, when
    lower), which keeps fewer points where the tails' recompute is small; the answer R is then
    at most the optimum + ``k x eps``, so within ``k eps / (R - k eps)`` of it, checked once R
    is known: past the relative trim's bound (the scale far above the optimum) the table is
    built again with eps from R, and past it again with the relative ``trim``
    (``Banded.within`` says which bound held). ``prebuilt``: the first band's min-peak table and
    inner frontiers, built beforehand (``_coarse_beside_inner``).

    Chains with autocast copies or unkept boundaries are not handled here (``plan_dp``)."""
    t = layer_tables(chain)
    u, pc = t.units, t.pairs
    U, n = u.size, chain.n_layers
    avail = budget_bytes - base_bytes(chain)
    if budget_bytes < fixed_peak(chain) or avail < 0:
        return None
    L = max(1, min(start, n))
    LT = n if top is None else min(top, n)
    work = 0  # breakpoints of the last band's table
    solved = False  # some band's table was built (else the bound alone is no answer)
    slot_tried = False
    best: Banded | None = None
    cost = INF
    params = {"budget_bytes": budget_bytes}
    if bound is not None:  # a plan known to fit: prunes every band
        sc = simulate(chain, bound)
        if sc.peak_bytes <= budget_bytes:
            bound = replace(bound, params=params)
            best, cost = Banded(bound, 0, False, _longest(bound)), sc.recompute_ms
    spans: Spans = ()  # where top-level checkpoints may nest (``nest``; ``ParetoTable``)
    rounds = 0
    k = _thinned_items(U, trim_every)
    rel_within = math.expm1(-math.log1p(-trim) * k) if trim else 0.0
    scale = cost if trim_scale is None else min(cost, trim_scale)
    eps = trim_abs * scale / k if trim and trim_abs > 0 and cost < INF else 0.0
    limit = rel_within  # absolute thinning only where it proves as much as relative would

    def table(L: int, R: np.ndarray, absolute: bool) -> ParetoTable:
        inner = (prebuilt.inner if prebuilt is not None
                 and (prebuilt.band, prebuilt.top) == (L, max(L, LT)) else None)
        return ParetoTable(u, pc, R, avail, limits.BAND_MAX_POINTS, cost, max_len=L, top_len=max(L, LT),
                           trim=0.0 if absolute else trim, trim_abs=eps if absolute else 0.0,
                           max_total=limits.BAND_MAX_TOTAL, trim_every=trim_every, inner=inner,
                           nest=spans)

    def read(pt: ParetoTable, L: int, full: bool) -> None:
        nonlocal best, cost
        assert best is not None
        # no plan of this band is cheaper (the cap), or (thinned) much cheaper
        best = replace(best, band=L)
        if pt.cost(avail) < INF:
            plan = plan_from(chain, u, *pt.parts(avail), params)
            sc = simulate(chain, plan)
            if sc.peak_bytes > budget_bytes:
                raise RuntimeError(f"dp (banded) plan peaks at {sc.peak_bytes} > budget "
                                   f"{budget_bytes}: planner bug")
            if sc.recompute_ms <= cost:
                cost, best = sc.recompute_ms, Banded(plan, L, False, _longest(plan))

    while True:
        full = n <= L
        if nest and not full and best is not None:
            spans = _nest_spans(best.plan, spans)
        ready = (prebuilt is not None and (prebuilt.band, prebuilt.top) == (L, max(L, LT))
                 and not spans)
        peaks = (t.peaks if full else prebuilt.peaks if ready and prebuilt is not None
                 else PeakTable(u, pc, L, max(L, LT), nest=spans))
        if int(peaks.R[0, U]) <= avail:
            if best is None:  # a plan of this band that fits bounds every band's optimum
                first = plan_from(chain, u, *reconstruct_options(
                    u.bounds, U, avail,
                    exact_chooser(u, pc, peaks.R, peaks.K, None, None if full else (L, max(L, LT)))), params)
                cost = simulate(chain, first).recompute_ms
                best = Banded(first, L, False, _longest(first))
                if nest and not full:
                    spans = _nest_spans(first, spans)
                    peaks = PeakTable(u, pc, L, max(L, LT), nest=spans)
            pt = table(L, peaks.R, eps > 0)
            if not pt.ok and not slot_tried and n <= limits.BAND_MAX_LAYERS:
                slot_tried = True  # the bound prunes too little: the slot table's plan
                alt = _slot_plan(chain, budget_bytes)
                sc = simulate(chain, alt)
                if sc.peak_bytes <= budget_bytes and sc.recompute_ms < cost:
                    cost, best = sc.recompute_ms, Banded(alt, 0, False, _longest(alt))
                    pt = table(L, peaks.R, eps > 0)
            if not pt.ok:
                break
            work, solved = pt.total_points, True
            read(pt, L, full)
            within = rel_within
            if eps > 0:  # R <= optimum + k eps: proven within k eps / (R - k eps)
                within = _abs_within(k * eps, cost)
                if within > limit:  # the bound was far above the optimum: eps from R, again
                    eps = trim_abs * cost / k
                    pt = table(L, peaks.R, True)
                    if pt.ok:
                        read(pt, L, full)
                        within = _abs_within(k * eps, cost)
                if within > limit:  # (rarely) relative
                    eps = 0.0
                    pt = table(L, peaks.R, False)
                    if pt.ok:
                        read(pt, L, full)
                        within = rel_within
            assert best is not None
            best = replace(best, exact=full and not within, within=within,
                           top=None if n <= LT else LT, nested=bool(spans) and not full)
            wider = nest and not full and 2 * L <= limits.NEST_WIDEN and _nests_within(best.plan, L)
            if nest and not full and not wider and rounds < limits.NEST_ROUNDS and _nests(best.plan, L):
                more = _nest_spans(best.plan, spans)
                if more != spans:  # it nests, with top-level checkpoints elsewhere: again
                    spans, rounds = more, rounds + 1
                    continue
            if full or (_longest(best.plan, L) < L and not wider):
                if widen_top and n > LT and 2 * best.longest > LT:
                    LT = min(4 * LT, n)  # a long top-level checkpoint near the limit: widen
                    continue
                break
        if full or 4 * work > max_work:
            break
        L = min(2 * L, n)
    return best if solved else None


def _nest_spans(plan: Plan, spans: Spans, merge: int = limits.NEST_MERGE) -> Spans:
    """``spans`` and, for each top-level checkpoint of ``plan``, ``(lo, e)``: its end and the
    start of the ``merge``-th top-level checkpoint ending there or before (``banded_plan``'s
    ``nest``: a checkpoint nesting these ``merge`` and the layers stored between them)."""
    tops = [(it.start, it.stop) for it in plan.items if isinstance(it, Checkpoint)]
    new = [(tops[max(0, i - merge + 1)][0], e) for i, (_, e) in enumerate(tops)]
    return nest_spans(spans + tuple(new))


def _nests(plan: Plan, L: int) -> bool:
    """Whether ``plan`` has a top-level checkpoint of over ``L`` layers with checkpoints inside."""
    return any(isinstance(it, Checkpoint) and it.stop - it.start > L
               and any(isinstance(x, Checkpoint) for x in it.inner) for it in plan.items)


def _nests_within(plan: Plan, L: int) -> bool:
    """Whether ``plan`` has a top-level checkpoint of ``L + 1`` to ``2 L`` layers with checkpoints
    inside (``NEST_WIDEN``)."""
    return any(isinstance(it, Checkpoint) and L < it.stop - it.start <= 2 * L
               and any(isinstance(x, Checkpoint) for x in it.inner) for it in plan.items)


def _longest(plan: Plan, most: int | None = None) -> int:
    """The most layers a checkpoint of ``plan`` spans (of those spanning at most ``most``)."""
    return max((r.stop - r.start for r in plan.recomputed_ranges()
                if most is None or r.stop - r.start <= most), default=0)


def _abs_within(slack: float, found: float) -> float:
    """How far (relative) a plan of ``found`` ms is at most from an optimum it exceeds by at
    most ``slack`` ms."""
    return slack / (found - slack) if found > slack else INF


def tail_trim(chain: Chain) -> tuple[float, int]:
    """``(trim, trim_every)`` of the banded DP's tails: none up to ``TRIM_MIN_LAYERS`` layers;
    every tail up to ``BAND_MAX_LAYERS`` (planning is fast there, and the plans nearer the
    optimum); every ``TRIM_EVERY``-th above. ``TAIL_TRIM_ERROR`` is shared out over the most
    top-level items of a plan that start at a thinned tail, so the plan is within
    ``exp(limits.TAIL_TRIM_ERROR)`` of the band's optimum."""
    n = chain.n_layers
    if n <= limits.TRIM_MIN_LAYERS:
        return 0.0, 1
    every = limits.TRIM_EVERY if n > limits.BAND_MAX_LAYERS else 1
    return limits.TAIL_TRIM_ERROR / _thinned_items(n + 1, every), every


def _thinned_items(units: int, every: int) -> int:
    """The most top-level items of a plan that start at a thinned tail (starts ``s < units``
    with ``s % every == 0``)."""
    return -(-units // every)


def _band_note(b: Banded) -> str:
    within = f"within {b.within:.1%} of " if b.within else ""
    proof = ("--exact proves the optimum" if b.plan.n_layers <= limits.EXACT_PROOF_LAYERS else
             "--exact would prove the optimum, but its O(U^3) tables are out of reach at this length")
    longer = "longer ones" if b.top is None else f"longer ones, of up to {b.top},"
    how = (f"storing their layers or, around the top-level checkpoints of the plans tried, nesting "
           f"ones of at most {b.band} layers" if b.nested else "storing their layers")
    return (f"near-optimal, not proven: {within}the best plan whose checkpoints span at most "
            f"{b.band} layers ({longer} only at the top level, {how}; this "
            f"plan's longest: {b.longest})" + (" (frontiers thinned to plan a long chain fast)"
                                               if b.within else "") + f"; {proof}")


def banded_applies(chain: Chain, *, max_slots: int | None = None, mode: str = "auto",
                **_: object) -> bool:
    """Whether ``plan_dp`` plans ``chain`` with the banded DP (at every budget)."""
    return (mode == "auto" and max_slots is None and not chain.has_casts
            and limits.BAND_MIN_LAYERS < chain.n_layers <= limits.BAND_MAX_LAYERS)


def plans_banded(chain: Chain, *, max_slots: int | None = None, mode: str = "auto",
                 **_: object) -> bool:
    """Whether ``plan_dp`` tries the banded DP first on ``chain`` (fully kept boundaries): from
    65 to 400 layers (``banded_applies``), and up to ``BAND_OPTIONS_MAX_LAYERS`` with selective
    options, which the grouped tables cannot use (their plans recomputed 7% to 5.5x as much at
    1000 layers)."""
    return banded_applies(chain, max_slots=max_slots, mode=mode) or (
        mode == "auto" and max_slots is None and not chain.has_casts and chain.has_options
        and limits.BAND_MAX_LAYERS < chain.n_layers <= limits.BAND_OPTIONS_MAX_LAYERS)
