"""The smallest peak of a chain whose boundaries are all kept and that holds no layers, and a plan
reaching it: the min-peak table in exact bytes, or with autocast copies the top-level frontiers."""
from __future__ import annotations

from functools import lru_cache

from ..baselines import none_peak, plan_none
from ..chain import Chain
from ..plan import Plan, items_from_ranges
from ..tables import base_bytes, fixed_peak
from .common import cast_frontier, layer_tables, plan_from


@lru_cache(maxsize=16)
def min_peak_kept(chain: Chain) -> int:
    """``min_peak`` of a fully kept chain without held layers (exact: a min-max DP over bytes,
    every layer a unit, selective options included; with autocast copies, the top-level
    frontiers of ``casts.py``, without options)."""
    if chain.has_casts:
        lowest = cast_frontier(chain).min_peak()
        return none_peak(chain) if lowest is None else lowest
    t = layer_tables(chain)
    lowest = max(fixed_peak(chain), base_bytes(chain) + int(t.peaks.R[0, t.units.size]))
    if chain.unsaved_bytes:  # the tables' bound can pass the plan without checkpoints
        return min(lowest, none_peak(chain))
    return lowest


def min_peak_plan_kept(chain: Chain, budget_bytes: int | None = None) -> Plan:
    """``min_peak_plan`` of a fully kept chain without held layers."""
    n = chain.n_layers
    params = {"budget_bytes": budget_bytes, "min_peak": True}
    if chain.unsaved_bytes and min_peak_kept(chain) == none_peak(chain):
        return Plan("dp", n, plan_none(n).items, params)  # the tables' bound is above it
    base = base_bytes(chain)
    if chain.has_casts:
        cf = cast_frontier(chain)
        need = cf.need_bytes()
        ranges = None if need is None else cf.ranges(
            need if budget_bytes is None else max(need, budget_bytes - base))
        items = plan_none(n).items if ranges is None else items_from_ranges(n, ranges)
        return Plan("dp", n, items, params)
    t = layer_tables(chain)
    need = int(t.peaks.R[0, t.units.size])
    avail = need if budget_bytes is None else max(need, budget_bytes - base)
    return plan_from(chain, t.units, *t.peaks.parts(avail), params)
