"""Held layers (FSDP2 per rank): ``held.py`` where it applies, else the chain without its holds
read at budgets lowered by each overshoot until the plan simulated with the holds fits."""
from __future__ import annotations

from dataclasses import replace
from functools import lru_cache

from ...errors import PlannerBugError
from .. import held, limits
from ..baselines import plan_every_k
from ..chain import Chain
from ..floor import infeasible_error
from ..plan import Plan
from ..simulate import peak_of, simulate
from ..tables import (
    base_bytes,
)
from .common import (
    DPResult,
    _cheapest_fitting,
)
from .portfolio import min_peak_plan_unheld, min_peak_unheld, plan_unheld, safe_side


def _held_fallback(chain: Chain, budget_bytes: int | None) -> list[Plan]:
    """Candidates for a held chain ``held.py`` does not take (above), lowest peaks first."""
    free = held.without_holds(chain)
    lo = min_peak_unheld(free)
    n = chain.n_layers
    plans = [min_peak_plan_unheld(free), plan_every_k(n, 1)]
    if budget_bytes is None:
        return plans
    read = budget_bytes
    for _ in range(limits.HELD_FALLBACK_READS):
        if read < lo:
            break
        plan = plan_unheld(free, read).plan
        plans.append(plan)
        over = simulate(chain, plan).peak_bytes - budget_bytes
        if over <= 0:
            break
        read -= over
    return plans


def _held_fallback_min_peak(chain: Chain) -> int:
    """The lowest peak of the fallback's smallest-peak candidates (one a plan reaches; the true
    smallest may be lower)."""
    return min(simulate(chain, p).peak_bytes for p in _held_fallback(chain, None))


@lru_cache(maxsize=16)
def min_peak_held(chain: Chain) -> int:
    """``min_peak`` of a chain with held layers: ``held.py``'s (exact) where it applies, else the
    fallback's (a peak a plan reaches)."""
    return held.min_peak(chain) if held.held_applies(chain) else _held_fallback_min_peak(chain)


def _held_min_peak_plan(chain: Chain, budget_bytes: int | None) -> Plan:
    """``min_peak_plan`` of a chain with held layers."""
    if held.held_applies(chain):
        return held.min_peak_plan(chain, budget_bytes)
    params = {"budget_bytes": budget_bytes, "min_peak": True}
    plans = _held_fallback(chain, budget_bytes)
    return replace(_cheapest_fitting(chain, plans, budget_bytes)
                   or min(plans, key=lambda p: peak_of(chain, p.items)), params=params)


def _plan_dp_held(chain: Chain, budget_bytes: int, none_peak: int) -> DPResult:
    """``plan_dp`` of a held chain below the peak without checkpoints."""
    n = chain.n_layers
    lowest = min_peak_held(chain)
    if budget_bytes < lowest:
        raise infeasible_error(chain, budget_bytes, lowest)
    if held.held_applies(chain):
        plan, exact, more = held.plan_held(chain, budget_bytes)
        notes = list(more)
    else:
        found = _cheapest_fitting(chain, _held_fallback(chain, budget_bytes), budget_bytes)
        if found is None:  # pragma: no cover - the plan reaching min_peak is among them
            raise PlannerBugError(f"held dp fallback found no plan at budget {budget_bytes}")
        plan, exact = Plan("dp", n, found.items, {"budget_bytes": budget_bytes}), False
        notes = ["held layers (FSDP2 per rank) on a chain the exact held DP does not take (autocast "
                 f"copies, unkept boundaries or over {limits.HELD_MAX_LAYERS} layers): planned without "
                 "the holds at budgets lowered until the plan fits (not proven optimal)"]
    peak = simulate(chain, plan).peak_bytes
    if peak > budget_bytes:
        raise PlannerBugError(f"dp (held layers) plan peaks at {peak} > budget {budget_bytes}")
    exact = safe_side(chain, exact, notes)
    return DPResult(plan, 1, max(0, none_peak - base_bytes(chain)), exact, n + 1, tuple(notes))
