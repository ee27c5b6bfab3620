"""Chains with boundaries the plain forward does not keep: planned on a bound that keeps them."""
from __future__ import annotations

from dataclasses import replace
from functools import lru_cache

from .. import limits
from ..baselines import none_peak, plan_none
from ..chain import Chain
from ..floor import infeasible_error
from ..plan import Plan
from ..simulate import peak_of, simulate
from .band import banded_applies, banded_plan
from .common import (
    DPResult,
    _cheapest_fitting,
)
from .lowest import min_peak_kept, min_peak_plan_kept
from .solver import DPSolver


def _unkept_extra(chain: Chain) -> int:
    """The most ``chain.conservative()`` overstates a peak: every boundary no op keeps."""
    return (0 if chain.pre.x_kept else chain.x_in_bytes) + sum(
        ly.x_bytes for ly in chain.layers if not (ly.x_kept and ly.x_kept_next))


def _unkept_plans(chain: Chain, start: int, **dp_options) -> list[Plan]:
    """Plans of the tables on ``chain.conservative()`` at ``UNKEPT_STEPS + 1`` budgets from
    ``start`` (at least the bound's smallest peak) up to ``start`` + the unkept boundaries."""
    cons = chain.conservative()
    n = chain.n_layers
    lo_c, none_c = min_peak_kept(cons), none_peak(cons)
    extra = _unkept_extra(chain)
    first = max(start, lo_c)
    steps = limits.UNKEPT_STEPS
    budgets = sorted({min(none_c - 1, first + extra * j // steps) for j in range(steps + 1)})
    budgets = [b for b in budgets if b >= lo_c]
    plans = [min_peak_plan_kept(cons, b) for b in budgets] if first == lo_c else []
    if first + extra >= none_c:
        plans.append(plan_none(n))
    if budgets and banded_applies(cons, **dp_options) and n > limits.EXACT_MAX_LAYERS:
        # the grouped tables would plan these: the banded DP, budget by budget
        plans += [b.plan for b in (banded_plan(cons, x, nest=n <= limits.NEST_MAX_LAYERS) for x in budgets)
                  if b is not None]
    elif budgets:
        solver = DPSolver(cons, top_bytes=budgets[-1], lowest_bytes=budgets[0], **dp_options)
        plans += [p for p in map(solver.solve, budgets) if p is not None]
    return plans


@lru_cache(maxsize=16)
def _unkept_low_plans(chain: Chain) -> tuple[Plan, ...]:
    """Candidates for the smallest peak of a chain with unkept boundaries: the bound's plans
    from its smallest peak up to that plus the boundaries it overstates (``min_peak`` is the
    lowest of their peaks on ``chain``)."""
    return tuple(_unkept_plans(chain, 0))


def _plan_dp_unkept(chain: Chain, budget_bytes: int, **dp_options) -> DPResult:
    """``plan_dp`` on a chain with boundaries the plain forward does not keep (``Layer.x_kept``).

    The tables model rotor's chain, where a stored layer keeps its output. They plan on
    ``chain.conservative()`` (every such output kept), whose plans peak no lower, op by op, than
    on ``chain``, so each fits here too; since the bound overstates by at most the unkept
    boundaries, its tables are read at ``UNKEPT_STEPS + 1`` budgets from the asked one up to that
    much higher (and near its own smallest peak), and the cheapest of those plans whose peak on
    ``chain`` fits is returned. Never over budget; not proven optimal."""
    n = chain.n_layers
    lowest = min_peak_unkept(chain)
    if budget_bytes < lowest:
        raise infeasible_error(chain, budget_bytes, lowest)
    cands = list(_unkept_low_plans(chain)) + _unkept_plans(chain, budget_bytes, **dp_options)
    best = _cheapest_fitting(chain, cands, budget_bytes)
    if best is None:  # pragma: no cover - the plan reaching min_peak is among them
        raise RuntimeError(f"dp found no plan at budget {budget_bytes} above the smallest peak "
                           f"{lowest}: planner bug")
    plan = Plan("dp", n, best.items, {"budget_bytes": budget_bytes})
    return DPResult(plan, 1, 0, False, n + 1, (_unkept_note(chain, len(cands)),))


def _unkept_note(chain: Chain, n_plans: int) -> str:
    """What ``_plan_dp_unkept`` says about a chain's unkept boundaries and how it planned."""
    unkept = sum(not ly.x_kept for ly in chain.layers)
    own = sum(ly.x_kept and not ly.x_kept_next for ly in chain.layers)
    what = [f"{'the chain input and ' if not chain.pre.x_kept else ''}{unkept} layer output(s) are "
            "not kept by the plain forward (no op saves them)"] if unkept or not chain.pre.x_kept else []
    if own:
        what.append(f"{own} layer output(s) are saved only by the layer's own ops (a checkpoint "
                    "ending there frees them once read)")
    return (f"{'; '.join(what)}: planned on a bound that keeps them, "
            f"the cheapest of {n_plans} plans that fits the budget as measured")


@lru_cache(maxsize=16)
def min_peak_unkept(chain: Chain) -> int:
    """``min_peak`` of a chain with unkept boundaries (no held layers): the lowest peak on
    ``chain`` of the plans the tables of ``chain.conservative()`` give near their own smallest
    peak (``_unkept_low_plans``): a peak a plan reaches, which the true smallest may undercut
    (by at most those boundaries)."""
    return min(simulate(chain, p).peak_bytes for p in _unkept_low_plans(chain))


def min_peak_plan_unkept(chain: Chain, budget_bytes: int | None) -> Plan:
    """``min_peak_plan`` of a chain with unkept boundaries (no held layers), planned with every
    boundary kept: peaks no lower than here."""
    cands = list(_unkept_low_plans(chain))
    cons = chain.conservative()
    if budget_bytes is not None and budget_bytes >= min_peak_kept(cons):
        cands.append(min_peak_plan_kept(cons, budget_bytes))
    best = _cheapest_fitting(chain, cands, budget_bytes)
    if best is None:  # no budget (or below every candidate): the lowest peak
        best = min(cands, key=lambda p: peak_of(chain, p.items))
    return replace(best, params={"budget_bytes": budget_bytes, "min_peak": True})
