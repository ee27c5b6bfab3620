"""The exact, slot and grouped tables of one chain (``DPSolver``), read at any budget."""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ...errors import PlannerArgumentError, PlannerBugError
from .. import limits
from ..baselines import none_peak
from ..chain import Chain
from ..groups import Units, size_gcd
from ..plan import Plan, items_from_ranges
from ..simulate import simulate
from ..tables import (
    INF,
    CostTable,
    FlatTable,
    PairCosts,
    ParetoTable,
    PeakTable,
    base_bytes,
    fixed_peak,
)
from .common import (
    Parts,
    _units_for,
    cast_frontier,
    choose_slot,
    layer_tables,
    plan_from,
)
from .lowest import min_peak_kept, min_peak_plan_kept


@dataclass(frozen=True)
class _Reader:
    """One DP table seen from the top."""

    name: str
    need_bytes: int  # the least bytes above the chain's start any plan of this table needs
    parts: Callable[[int], Parts]  # checkpointed ranges and options for exact avail bytes
    slot_bytes: int
    top: np.ndarray  # the table's least recompute at each slot
    slot_parts: Callable[[int], Parts]  # the table's own plan at a slot
    units: Units | None = None  # the table's units when not the solver's (their option names)


class DPSolver:
    """DP tables for one chain, reusable for every budget below the unrestricted peak
    (``sweep`` reads a whole frontier from them). Slots do not depend on the budget.

    Each table is read two ways and the better plan kept: top-down in exact bytes (an option
    is taken only if the exact min-peak tables say it can be completed within what is left,
    and the cost table ranks those), which always fits; and the table's own optimal plan at the
    budget's slot, stepping down a slot while the simulator says it overshoots. With gcd-sized
    slots (``exact``) both are the optimum. ``rounding="nearest"`` (default) rounds sizes to the
    nearest slot so rounding errors cancel instead of adding up along the chain;
    ``rounding="up"`` is rotor's conservative rounding, kept for comparison.

    Long chains (``mode="grouped"``, or ``"auto"`` above ``EXACT_MAX_LAYERS`` layers) get two
    tables: the nested DP on groups of layers, and the depth-1 DP on single layers
    (:class:`FlatTable`); ``solve`` returns the better plan of the two.
    """

    def __init__(self, chain: Chain, *, max_slots: int | None = None, mode: str = "auto",
                 groups: int | None = None, rounding: str = "nearest", cuts: str = "cheap",
                 flat: bool | None = None, top_bytes: int | None = None,
                 pareto: bool | None = None, lowest_bytes: int | None = None):
        if rounding not in ("nearest", "up"):
            raise PlannerArgumentError(f"rounding must be 'nearest' or 'up', not {rounding!r}")
        self.options_ignored = False  # True when the chain has options the tables do not use
        self.chain = chain
        grouped_units = _units_for(chain.without_options(), mode, groups, cuts)
        if grouped_units is None:
            self.units = layer_tables(chain).units
        else:
            self.units = grouped_units
            pairs = PairCosts(grouped_units)
            peaks = PeakTable(grouped_units, pairs)
        self.grouped = self.units.size < chain.n_layers + 1
        self.none_peak = none_peak(chain)
        top = self.none_peak if top_bytes is None else top_bytes
        self.span = max(0, top - base_bytes(chain))
        self.cast_bytes = chain.pre.cast_bytes + sum(ly.cast_bytes for ly in chain.layers)
        self.pareto: ParetoTable | None = None
        if pareto is None:  # explicit slots ask for the slot tables
            pareto = max_slots is None
        if pareto and not self.grouped and not chain.has_casts:
            # Exact bytes: optimal at every budget up to ``top`` (pareto.py).
            self.lowest = min_peak_kept(chain) if lowest_bytes is None else lowest_bytes
            pt = self._pareto_table(top, self.lowest)
            if pt.ok:
                self.pareto = pt
                self.readers: list[_Reader] = []
                self.slot_bytes, self.M, self.exact = 1, self.span, True
                self._estimate = None
                return
        # The cost table on single layers takes options; grouped and autocast tables do not
        # (with autocast copies a table with options is read beside them: ``_options_reader``).
        with_options = chain if chain.has_casts and chain.has_options and not self.grouped else None
        if self.grouped or chain.has_casts:
            self.options_ignored = chain.has_options and with_options is None
            chain = chain.without_options()
        layers = layer_tables(chain)
        if grouped_units is None:
            self.units, pairs, peaks = layers.units, layers.pairs, layers.peaks
        g = size_gcd(chain)
        U = self.units.size
        slots = max_slots or max(limits.MIN_SLOTS, min(limits.MAX_SLOTS, limits.CELL_BUDGET // (U * U)))
        q = choose_slot(self.units, self.span, g, slots)
        M = int(self.span // q)
        self.readers = []
        self._estimate = None
        # A table none of whose plans fits up to ``top`` is not built (grouped tables just
        # above the smallest peak): solve finds nothing there and the caller takes over.
        if not self.grouped or int(peaks.R[0, U]) <= self.span:
            table = CostTable(self.units, pairs, q, M, "up" if q == g else rounding)
            self._estimate = None if self.grouped else table.estimate
            self.readers.append(_Reader("nested", int(peaks.R[0, U]), lambda a: table.parts(a, peaks),
                                        q, table.C[0, U], table.slot_parts))
        if flat if flat is not None else self.grouped:
            lu = layers.units
            N = lu.size
            max_len = min(N, max(64, 8 * math.isqrt(N)))
            slots = max_slots or max(limits.MIN_SLOTS, min(limits.MAX_SLOTS, limits.FLAT_CELL_BUDGET // (N * max_len)))
            fq = choose_slot(lu, self.span, g, slots)
            ft = FlatTable(lu, layers.pairs, fq, int(self.span // fq), "up" if fq == g else rounding,
                           max_len, top_bytes=self.span)
            if ft.built:
                self.readers.append(_Reader("flat", int(ft.R1[0]), lambda a: (ft.ranges(a), {}), fq,
                                            ft.C[0], lambda m: (ft.slot_ranges(m), {})))
        if with_options is not None and self.readers:
            self.readers.append(_options_reader(with_options, q, M, "up" if q == g else rounding))
        self.slot_bytes = int(q)
        self.M = M
        self.exact = q == g and not self.grouped and not chain.has_casts and not self.options_ignored

    def solve(self, budget_bytes: int) -> Plan | None:
        """The best plan the tables give at this budget, or None when none of them reaches
        it (grouped tables can miss budgets near the smallest peak; the caller decides).

        With autocast copies: the cheaper of the tables read at lowered budgets until a plan
        fits, and the plan of the exact top-level frontiers (``casts.py``), which fits whenever
        any plan does (docs/planner.md, "Chains that need more than one budget")."""
        if self.pareto is not None:
            return self._pareto_plan(budget_bytes)
        best, over = self._best_at(budget_bytes, budget_bytes)
        if not self.cast_bytes:
            return best
        if best is None and over is not None:
            lowest_read = budget_bytes - self.cast_bytes  # every table plan read here fits
            read = budget_bytes
            for _ in range(limits.CAST_READS):
                read = max(lowest_read, read - over)
                best, over_here = self._best_at(read, budget_bytes)
                if best is not None or over_here is None or read == lowest_read:
                    break
                over = over_here
        cands = [] if best is None else [best]
        if budget_bytes >= fixed_peak(self.chain):
            n = self.chain.n_layers
            ranges = cast_frontier(self.chain).ranges(budget_bytes - base_bytes(self.chain),
                                                      self._estimate)
            if ranges is not None:
                cands.append(Plan("dp", n, items_from_ranges(n, ranges), {"budget_bytes": budget_bytes}))
        scored = [(simulate(self.chain, p), p) for p in cands]
        fit = [sp for sp in scored if sp[0].peak_bytes <= budget_bytes]
        if len(fit) < len(scored):
            raise PlannerBugError(f"dp (mixed precision) plan over budget {budget_bytes}")
        return min(fit, key=lambda sp: sp[0].recompute_ms)[1] if fit else None

    def _pareto_table(self, top: int, lowest: int) -> ParetoTable:
        """Exact frontiers for budgets in [lowest, top]. The plan reaching the smallest peak
        and spending the slack at ``lowest`` on storing bounds the optimum at every budget of
        that range from above; the table prunes what costs more (no optimal plan uses it)."""
        t = layer_tables(self.chain)
        ub = None
        if lowest >= min_peak_kept(self.chain):
            ub = simulate(self.chain, min_peak_plan_kept(self.chain, lowest)).recompute_ms
            if self.chain.n_layers >= limits.UB_MIN_LAYERS and lowest < self.none_peak:
                # a near-optimal plan from the slot table on single layers, read in exact
                # bytes (so it fits): a much tighter bound (0.3-7% above the optimum with
                # options, against 5-70% for the exact DP on groups of layers used before),
                # which prunes most of the frontiers away
                ub = min(ub, _slot_bound(self.chain, lowest))
        return ParetoTable(t.units, t.pairs, t.peaks.R, max(0, top - base_bytes(self.chain)),
                           limits.PARETO_MAX_POINTS, ub)

    def _pareto_plan(self, budget_bytes: int) -> Plan | None:
        """The optimal plan from the exact frontiers (None when no plan fits)."""
        pt = self.pareto
        assert pt is not None
        if budget_bytes < fixed_peak(self.chain) or budget_bytes < min_peak_kept(self.chain):
            return None
        if budget_bytes < self.lowest:  # below what the table was pruned for: one for it
            pt = self._pareto_table(budget_bytes, budget_bytes)
        avail = min(budget_bytes - base_bytes(self.chain), pt.top)
        if pt.cost(avail) == INF:
            raise PlannerBugError(f"exact dp found no plan at budget {budget_bytes} above the "
                                  f"smallest peak {min_peak_kept(self.chain)}")
        return self._plan(*pt.parts(avail), budget_bytes, budget_bytes, "exact bytes")

    def _best_at(self, read_bytes: int, budget_bytes: int) -> tuple[Plan | None, int | None]:
        """The least-recompute plan read at ``read_bytes`` that fits ``budget_bytes``, and the
        least overshoot of the plans read that did not fit (None when none overshot)."""
        if read_bytes < fixed_peak(self.chain):
            return None, None
        avail = read_bytes - base_bytes(self.chain)
        best: tuple[float, Plan] | None = None
        overs: list[int] = []
        for r in self.readers:
            if r.need_bytes > avail:
                continue
            for plan in (self._plan(*r.parts(avail), read_bytes, budget_bytes, r.name, r.units),
                         self._scan(r, read_bytes, budget_bytes)):
                if plan is not None:
                    sc = simulate(self.chain, plan)
                    if sc.peak_bytes > budget_bytes:  # only with autocast copies
                        overs.append(sc.peak_bytes - budget_bytes)
                    elif best is None or sc.recompute_ms < best[0]:
                        best = (sc.recompute_ms, plan)
        return (None if best is None else best[1]), (min(overs) if overs else None)

    def _plan(self, ranges: list[tuple[int, int]], chosen: dict[int, int], read_bytes: int,
              budget_bytes: int, name: str, units: Units | None = None) -> Plan:
        plan = plan_from(self.chain, units or self.units, ranges, chosen, {"budget_bytes": budget_bytes})
        peak = simulate(self.chain, plan).peak_bytes
        if peak > read_bytes and not self.cast_bytes:  # exact feasibility forbids this
            raise PlannerBugError(f"dp ({name}) plan peaks at {peak} > budget {read_bytes}")
        return plan

    def _scan(self, r: _Reader, read_bytes: int, budget_bytes: int) -> Plan | None:
        """The table's own plan at the budget's slot, or at the next lower slots while it
        overshoots (rounding): often better than the exact-bytes read, never needed for
        feasibility."""
        m = min((read_bytes - base_bytes(self.chain)) // r.slot_bytes, len(r.top) - 1)
        for _ in range(limits.CAST_SCAN_READS if self.cast_bytes else limits.SCAN_READS):
            if m < 0 or r.top[m] == INF:
                return None
            plan = plan_from(self.chain, r.units or self.units, *r.slot_parts(m), {"budget_bytes": budget_bytes})
            peak = simulate(self.chain, plan).peak_bytes
            if peak <= read_bytes:
                return plan
            m -= 1
        return None


def _options_reader(chain: Chain, q: int, M: int, rounding: str) -> _Reader:
    """The cost table on single layers with their selective options, for a chain with autocast
    copies: read like the others at lowered budgets until its plan fits (``solve``), beside the
    option-free plans the exact top-level frontiers give; so a plan with options is taken where
    it is cheaper and fits, and never one that does not."""
    t = layer_tables(chain)
    table = CostTable(t.units, t.pairs, q, M, rounding)
    return _Reader("nested with options", int(t.peaks.R[0, t.units.size]), lambda a: table.parts(a, t.peaks),
                   q, table.C[0, t.units.size], table.slot_parts, t.units)


def _slot_bound(chain: Chain, budget_bytes: int) -> float:
    """A bound on the optimum at ``budget_bytes``: the recompute of ``_slot_plan`` (inf if,
    against construction, it does not fit)."""
    plan = _slot_plan(chain, budget_bytes)
    sc = simulate(chain, plan)
    return sc.recompute_ms if sc.peak_bytes <= budget_bytes else INF


def _slot_plan(chain: Chain, budget_bytes: int) -> Plan:
    """A near-optimal plan (0.3-7% above the optimum with options at 100 layers): read in exact
    bytes (``CostTable.parts``, which fits by construction) from the nested slot table on single
    layers with ``UB_SLOTS`` slots up to the budget. O(U^3 limits.UB_SLOTS)."""
    t = layer_tables(chain)
    avail = budget_bytes - base_bytes(chain)
    q = max(1, -(-avail // limits.UB_SLOTS))
    table = CostTable(t.units, t.pairs, q, avail // q, "nearest")
    return plan_from(chain, t.units, *table.parts(avail, t.peaks), {"budget_bytes": budget_bytes})
