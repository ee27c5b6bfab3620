"""What every solver shares: the result type, the layer-level tables (built once per chain),
slot choice, and turning checkpointed ranges into a plan."""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property, lru_cache

import numpy as np

from ...errors import PlannerArgumentError
from .. import limits
from ..baselines import none_peak
from ..casts import CastFrontier
from ..chain import Chain
from ..groups import Units, cheap_cuts, equal_cuts, make_units
from ..plan import Plan, items_from_ranges
from ..simulate import simulate
from ..tables import (
    PairCosts,
    PeakTable,
)

OPTIONS_IGNORED = ("selective options ignored by these tables: planned with store and full "
                   "checkpoints only")


@dataclass(frozen=True)
class DPResult:
    plan: Plan
    slot_bytes: int  # memory granularity of the DP
    n_slots: int  # slots between the fixed memory and the peak without checkpointing
    exact: bool  # slots divide every size and units are single layers: optimal
    n_units: int  # units the DP worked on (layers + post when not grouped)
    notes: tuple[str, ...] = field(default=())


class LayerTables:
    """The tables on single layers that every entry point needs, built once per chain; the
    min-peak table only when first asked for (grouped long chains plan without it: O(U^3))."""

    def __init__(self, units: Units, pairs: PairCosts):
        self.units, self.pairs = units, pairs

    @cached_property
    def peaks(self) -> PeakTable:
        return PeakTable(self.units, self.pairs)


@lru_cache(maxsize=16)  # chains are immutable and hashable; plan_chain and sweep ask repeatedly
def layer_tables(chain: Chain) -> LayerTables:
    u = make_units(chain)
    return LayerTables(u, PairCosts(u))


def _units_for(chain: Chain, mode: str, groups: int | None, cuts: str = "cheap") -> Units | None:
    """The solver's units, or None for the single layers of ``layer_tables``."""
    n = chain.n_layers
    if mode not in ("auto", "exact", "grouped"):
        raise PlannerArgumentError(f"dp mode must be auto, exact or grouped, not {mode!r}")
    g = groups or limits.DEFAULT_GROUPS
    if mode == "exact" or (mode == "auto" and n <= limits.EXACT_MAX_LAYERS) or g >= n:
        return None
    return make_units(chain, cheap_cuts(chain, g) if cuts == "cheap" else equal_cuts(n, g))


def plan_from(chain: Chain, units: Units, ranges: list[tuple[int, int]], chosen: dict[int, int],
              params: dict) -> Plan:
    """A ``dp`` plan from checkpointed ranges and ``{unit: option column}`` (``reconstruct_options``)."""
    n = chain.n_layers
    plan = Plan("dp", n, items_from_ranges(n, ranges), params)
    return plan.with_options(units.option_names(chosen)) if chosen else plan


@lru_cache(maxsize=16)
def cast_frontier(chain: Chain) -> CastFrontier:
    """The top-level frontiers of a chain with autocast copies (``casts.py``), once per chain;
    selective options are ignored (the frontiers plan store and full checkpoints only)."""
    chain = chain.without_options()
    t = layer_tables(chain)
    top = none_peak(chain)
    return CastFrontier(chain, t.units, t.pairs, t.peaks, top)


def choose_slot(units: Units, span: int, g: int, max_slots: int) -> int:
    """Slot size: the gcd of all sizes when that needs at most ``max_slots`` slots (exact);
    otherwise the size in [span / max_slots, 1.25 x that] that divides the units' kept and
    output bytes most evenly, so that repeated layers (transformer blocks) round exactly and
    their rounding errors do not pile up along the chain."""
    if span // g <= max_slots:
        return g
    q0 = -(-span // max_slots)
    vals = np.concatenate([units.hold[:-1], units.x_out[:-1]]).astype(np.float64)
    uniq, counts = np.unique(vals, return_counts=True)
    cands = {q0}
    for v in uniq[np.argsort(-counts)][:8]:
        for k in range(max(1, int(v // (1.25 * q0))), int(v // q0) + 1):
            if q0 <= int(v) // k <= 1.25 * q0:
                cands.add(int(v) // k)

    def err(q: int) -> float:
        r = vals / q
        return float(np.abs(r - np.round(r)).sum())
    return min(sorted(cands), key=err)


Parts = tuple[list[tuple[int, int]], dict[int, int]]  # checkpointed ranges, {unit: option}


def _cheapest_fitting(chain: Chain, plans: list[Plan], budget_bytes: int | None) -> Plan | None:
    """The plan of least recompute (then lowest peak) whose simulated peak on ``chain`` fits
    ``budget_bytes``; None when none does or there is no budget."""
    if budget_bytes is None:
        return None
    scored = [(sc.recompute_ms, sc.peak_bytes, i) for i, sc in enumerate(simulate(chain, p) for p in plans)
              if sc.peak_bytes <= budget_bytes]
    return plans[min(scored)[2]] if scored else None
