"""The banded DP: the exact DP in bytes over plans whose checkpoints span at most L layers."""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from ...errors import PlannerBugError
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
    if budget_bytes < fixed_peak(chain) or budget_bytes < base_bytes(chain):
        return None
    search = _BandSearch(chain, budget_bytes, bound, trim, trim_every, trim_abs, trim_scale, top,
                         prebuilt, nest)
    return search.run(start, max_work, widen_top)


class _BandSearch:
    """``banded_plan``'s state while it widens the band: the best plan so far (its recompute
    prunes every table), where top-level checkpoints may nest, and the thinning."""

    def __init__(self, chain: Chain, budget_bytes: int, bound: Plan | None, trim: float,
                 trim_every: int, trim_abs: float, trim_scale: float | None, top: int | None,
                 prebuilt: Prebuilt | None, nest: bool):
        self.chain, self.budget_bytes, self.prebuilt, self.nest = chain, budget_bytes, prebuilt, nest
        self.t = layer_tables(chain)
        self.u, self.pc = self.t.units, self.t.pairs
        self.U, self.n = self.u.size, chain.n_layers
        self.avail = budget_bytes - base_bytes(chain)
        self.LT = self.n if top is None else min(top, self.n)
        self.trim, self.trim_every, self.trim_abs = trim, trim_every, trim_abs
        self.slot_tried = False
        self.best: Banded | None = None
        self.cost = INF
        self.params = {"budget_bytes": budget_bytes}
        if bound is not None:  # a plan known to fit: prunes every band
            sc = simulate(chain, bound)
            if sc.peak_bytes <= budget_bytes:
                bound = replace(bound, params=self.params)
                self.best, self.cost = Banded(bound, 0, False, _longest(bound)), sc.recompute_ms
        self.spans: Spans = ()  # where top-level checkpoints may nest (``nest``; ``ParetoTable``)
        self.rounds = 0
        self.k = _thinned_items(self.U, trim_every)
        self.rel_within = math.expm1(-math.log1p(-trim) * self.k) if trim else 0.0
        scale = self.cost if trim_scale is None else min(self.cost, trim_scale)
        self.eps = trim_abs * scale / self.k if trim and trim_abs > 0 and self.cost < INF else 0.0
        self.limit = self.rel_within  # absolute thinning only where it proves as much as relative would

    def run(self, start: int, max_work: int, widen_top: bool) -> Banded | None:
        n = self.n
        L = max(1, min(start, n))
        work = 0  # breakpoints of the last band's table
        solved = False  # some band's table was built (else the bound alone is no answer)
        while True:
            full = n <= L
            if self.nest and not full and self.best is not None:
                self.spans = _nest_spans(self.best.plan, self.spans)
            peaks = self.peaks_for(L, full)
            if int(peaks.R[0, self.U]) <= self.avail:
                if self.best is None:  # a plan of this band that fits bounds every band's optimum
                    peaks = self.first_plan(L, full, peaks)
                pt = self.build(L, peaks)
                if pt is None:
                    break
                work, solved = pt.total_points, True
                self.read(pt, L)
                step = self.settle(L, full, self.thin_bound(L, peaks), widen_top)
                if step == "again":
                    continue
                if step == "stop":
                    break
            if full or 4 * work > max_work:
                break
            L = min(2 * L, n)
        return self.best if solved else None

    def peaks_for(self, L: int, full: bool) -> PeakTable:
        """The band's min-peak table (the prebuilt one when it is this band's)."""
        pre, LT = self.prebuilt, self.LT
        ready = pre is not None and (pre.band, pre.top) == (L, max(L, LT)) and not self.spans
        if full:
            return self.t.peaks
        if ready and pre is not None:
            return pre.peaks
        return PeakTable(self.u, self.pc, L, max(L, LT), nest=self.spans)

    def first_plan(self, L: int, full: bool, peaks: PeakTable) -> PeakTable:
        """The band's smallest-peak plan as the first bound (and where it nests: the table again)."""
        u, pc, LT = self.u, self.pc, self.LT
        first = plan_from(self.chain, u, *reconstruct_options(
            u.bounds, self.U, self.avail,
            exact_chooser(u, pc, peaks.R, peaks.K, None, None if full else (L, max(L, LT)))), self.params)
        self.cost = simulate(self.chain, first).recompute_ms
        self.best = Banded(first, L, False, _longest(first))
        if self.nest and not full:
            self.spans = _nest_spans(first, self.spans)
            peaks = PeakTable(u, pc, L, max(L, LT), nest=self.spans)
        return peaks

    def table(self, L: int, R: np.ndarray, absolute: bool) -> ParetoTable:
        pre, LT = self.prebuilt, self.LT
        inner = pre.inner if pre is not None and (pre.band, pre.top) == (L, max(L, LT)) else None
        return ParetoTable(self.u, self.pc, R, self.avail, limits.BAND_MAX_POINTS, self.cost, max_len=L,
                           top_len=max(L, LT), trim=0.0 if absolute else self.trim,
                           trim_abs=self.eps if absolute else 0.0, max_total=limits.BAND_MAX_TOTAL,
                           trim_every=self.trim_every, inner=inner, nest=self.spans)

    def build(self, L: int, peaks: PeakTable) -> ParetoTable | None:
        """The band's table; past its point limits, again pruned by the slot table's plan (once,
        chains of up to ``BAND_MAX_LAYERS`` layers); None when it still outgrows them."""
        pt = self.table(L, peaks.R, self.eps > 0)
        if not pt.ok and not self.slot_tried and self.n <= limits.BAND_MAX_LAYERS:
            self.slot_tried = True  # the bound prunes too little: the slot table's plan
            alt = _slot_plan(self.chain, self.budget_bytes)
            sc = simulate(self.chain, alt)
            if sc.peak_bytes <= self.budget_bytes and sc.recompute_ms < self.cost:
                self.cost, self.best = sc.recompute_ms, Banded(alt, 0, False, _longest(alt))
                pt = self.table(L, peaks.R, self.eps > 0)
        return pt if pt.ok else None

    def read(self, pt: ParetoTable, L: int) -> None:
        """The table's plan at the budget, kept when no dearer than the best so far."""
        assert self.best is not None
        # no plan of this band is cheaper (the cap), or (thinned) much cheaper
        self.best = replace(self.best, band=L)
        if pt.cost(self.avail) < INF:
            plan = plan_from(self.chain, self.u, *pt.parts(self.avail), self.params)
            sc = simulate(self.chain, plan)
            if sc.peak_bytes > self.budget_bytes:
                raise PlannerBugError(f"dp (banded) plan peaks at {sc.peak_bytes} > budget "
                                      f"{self.budget_bytes}")
            if sc.recompute_ms <= self.cost:
                self.cost, self.best = sc.recompute_ms, Banded(plan, L, False, _longest(plan))

    def thin_bound(self, L: int, peaks: PeakTable) -> float:
        """How far (relative) the plan is proven from the band's optimum; with absolute thinning,
        the table is built again while that bound is looser than the relative trim's."""
        within = self.rel_within
        if self.eps > 0:  # R <= optimum + k eps: proven within k eps / (R - k eps)
            within = _abs_within(self.k * self.eps, self.cost)
            if within > self.limit:  # the bound was far above the optimum: eps from R, again
                self.eps = self.trim_abs * self.cost / self.k
                pt = self.table(L, peaks.R, True)
                if pt.ok:
                    self.read(pt, L)
                    within = _abs_within(self.k * self.eps, self.cost)
            if within > self.limit:  # (rarely) relative
                self.eps = 0.0
                pt = self.table(L, peaks.R, False)
                if pt.ok:
                    self.read(pt, L)
                    within = self.rel_within
        return within

    def settle(self, L: int, full: bool, within: float, widen_top: bool) -> str | None:
        """After a band's table: "again" (the same band, nesting elsewhere or a wider ``top``),
        "stop" (the plan does not need a wider band), or None (widen the band)."""
        n, LT, nest = self.n, self.LT, self.nest
        assert self.best is not None
        best = self.best = replace(self.best, exact=full and not within, within=within,
                                   top=None if n <= LT else LT, nested=bool(self.spans) and not full)
        wider = nest and not full and 2 * L <= limits.NEST_WIDEN and _nests_within(best.plan, L)
        if nest and not full and not wider and self.rounds < limits.NEST_ROUNDS and _nests(best.plan, L):
            more = _nest_spans(best.plan, self.spans)
            if more != self.spans:  # it nests, with top-level checkpoints elsewhere: again
                self.spans, self.rounds = more, self.rounds + 1
                return "again"
        if full or (_longest(best.plan, L) < L and not wider):
            if widen_top and n > LT and 2 * best.longest > LT:
                self.LT = min(4 * LT, n)  # a long top-level checkpoint near the limit: widen
                return "again"
            return "stop"
        return None


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
