"""``plan_dp`` for chains without held layers: which solver plans which chain, and its notes."""
from __future__ import annotations

from functools import lru_cache
from typing import Any

from ...errors import InfeasibleBudgetError
from .. import limits
from ..baselines import none_peak, plan_none
from ..chain import Chain
from ..floor import infeasible_error
from ..plan import Plan
from ..simulate import simulate
from ..tables import (
    base_bytes,
)
from .band import Banded, _band_note, banded_plan, plans_banded, tail_trim
from .coarse import _coarse_beside_inner, _coarse_plan, _scale
from .common import (
    OPTIONS_IGNORED,
    DPResult,
)
from .lowest import min_peak_kept, min_peak_plan_kept
from .near_min import near_min_plan
from .solver import DPSolver
from .unkept import _plan_dp_unkept, min_peak_plan_unkept, min_peak_unkept


def _plan_dp_tables(chain: Chain, budget_bytes: int, notes: list[str], band: bool,
                    **dp_options) -> tuple[Plan, bool, DPSolver | None]:
    """``plan_dp`` with the exact, slot or grouped tables (``DPSolver``), and where they
    cannot reach the budget, the banded DP (when ``band``) or ``near_min_plan`` (then no
    solver: its notes do not apply)."""
    peak_none = none_peak(chain)
    # Tables up to this budget only: finer slots, and the exact DP skips what it cannot reach.
    solver = DPSolver(chain, **dp_options,
                      top_bytes=max(budget_bytes, min(min_peak_kept(chain), peak_none)),
                      lowest_bytes=budget_bytes)
    found = solver.solve(budget_bytes)
    exact = solver.exact
    if found is None:
        lowest = min_peak_kept(chain)
        if budget_bytes < lowest:
            raise infeasible_error(chain, budget_bytes, lowest)
        trim, every = tail_trim(chain)
        banded = banded_plan(chain, budget_bytes, trim=trim, trim_every=every, top=limits.BAND_TOP,
                             widen_top=True) if band else None
        if banded is not None:
            found, exact = banded.plan, banded.exact
            how = _band_note(banded)
        else:
            found, how = near_min_plan(chain, budget_bytes)
            exact = False
        which = "grouped" if solver.grouped else "slot"
        notes.append(f"the {which} tables cannot reach a budget this close to the smallest peak: "
                     + how)
        return found, exact, None  # the tables' own notes do not apply to this plan
    return found, exact, solver


def none_fits(chain: Chain, budget_bytes: int, none_peak: int) -> DPResult | None:
    """``plan_dp``'s answer when the plan without checkpointing fits, else None."""
    if budget_bytes < none_peak:
        return None
    plan = Plan("dp", chain.n_layers, plan_none(chain.n_layers).items, {"budget_bytes": budget_bytes})
    return DPResult(plan, 1, 0, True, chain.n_layers + 1, ("the plan without checkpointing fits",))


def safe_side(chain: Chain, exact: bool, notes: list[str]) -> bool:
    """``exact`` unless the tables count something on the safe side (lead bytes, memory no
    saved-tensor hook sees), which ``notes`` then says."""
    if exact and any(ly.lead_bytes for ly in chain.layers):
        exact = False
        notes.append("some layers' backward holds gradients before the recompute it starts "
                     "(lead bytes): the tables count them through the whole recompute, on the "
                     "safe side, so the plan fits but may recompute more than the optimum")
    if exact and (chain.side_bytes or chain.side_grad_bytes):
        exact = False
        notes.append("the layers' side inputs (masks, position biases made before them) and their gradients are "
                     "counted as live for the whole step, on the safe side: the plan fits, and where the tables "
                     "read at the budget plus those bytes give a faster plan that still fits, that one is taken")
    if exact and chain.unsaved_bytes:
        exact = False
        notes.append("some layers keep tensors no saved-tensor hook sees (ctx attributes, caches) "
                     "until the backward is over: the tables count them as live for the whole step, "
                     "on the safe side, so the plan fits but may recompute more than the optimum")
    return exact


def _banded_first(chain: Chain, budget_bytes: int, none_peak: int) -> Banded | None:
    """The banded DP where ``plan_dp`` tries it first (``plans_banded``): long chains from a
    coarse bound (``_coarse_plan``) away from the smallest peak, thinned tails, nested bands up
    to ``NEST_MAX_LAYERS`` layers. None when it finds nothing within its work limits."""
    coarse, prebuilt = None, None
    long_chain = chain.n_layers > limits.BAND_MAX_LAYERS
    top = limits.BAND_TOP if long_chain else None
    nest = chain.n_layers <= limits.NEST_MAX_LAYERS
    if chain.n_layers >= limits.COARSE_MIN_LAYERS:
        lowest = min_peak_kept(chain)
        if budget_bytes - lowest >= limits.COARSE_MIN_FRAC * (none_peak - lowest):
            if nest:  # the first table nests at the coarse plan's checkpoints: no prebuilt part
                coarse = _coarse_plan(chain, budget_bytes)
            else:
                coarse, prebuilt = _coarse_beside_inner(chain, budget_bytes, top)
    trim, every = tail_trim(chain)
    return banded_plan(chain, budget_bytes, bound=coarse.plan if coarse else None, trim=trim,
                       trim_every=every, trim_abs=limits.TAIL_TRIM_ABS if long_chain else 0.0,
                       trim_scale=_scale(coarse), top=top, widen_top=True,
                       prebuilt=prebuilt, nest=nest)


def _solver_notes(chain: Chain, solver: DPSolver, notes: list[str]) -> None:
    """What the tables of ``solver`` add to ``plan_dp``'s notes."""
    if solver.options_ignored:
        notes.append(OPTIONS_IGNORED)
    if solver.grouped:
        notes.append(f"long chain: best of nested plans on {solver.units.size - 1} groups of "
                     f"layers and single-level plans on all {chain.n_layers} layers (near-optimal)")
    elif chain.has_casts:
        notes.append("mixed precision: autocast weight copies kept until the end of the forward are "
                     "planned at the top level (casts.py); the plan fits exactly")
    elif not solver.exact:
        notes.append(f"recompute estimated in slots of {solver.slot_bytes} bytes: the plan fits "
                     "exactly but may recompute slightly more than the optimum")


def plan_unheld(chain: Chain, budget_bytes: int, *, max_slots: int | None = None, mode: str = "auto",
                groups: int | None = None, rounding: str = "nearest") -> DPResult:
    """``plan_dp`` of a chain that holds no layers: the exact DP in bytes up to
    ``BAND_MIN_LAYERS`` layers, the banded DP up to ``BAND_MAX_LAYERS`` (with options up to
    ``BAND_OPTIONS_MAX_LAYERS``), the grouped tables above, and chains with unkept boundaries
    planned on a bound that keeps them (``unkept.py``).

    The tables count side inputs and their gradients as live for the whole step
    (``tables.base_bytes``), so a plan within those bytes of the budget can be missed, and
    budgets just above the smallest peak refused: on chains of up to ``SIDE_RELAX_MAX_LAYERS``
    layers the tables are also read at the budget plus those bytes (lower by the overshoot
    where that plan does not fit), and that plan is taken where the simulator says it fits and
    it recomputes less (``_side_relaxed``)."""
    kw: dict[str, Any] = dict(max_slots=max_slots, mode=mode, groups=groups, rounding=rounding)
    slack = chain.side_bytes + chain.side_grad_bytes
    if not slack or chain.n_layers > limits.SIDE_RELAX_MAX_LAYERS:
        return _plan_unheld(chain, budget_bytes, **kw)
    try:
        found: DPResult | None = _plan_unheld(chain, budget_bytes, **kw)
    except InfeasibleBudgetError:
        found = None
    relaxed = _side_relaxed(chain, budget_bytes, slack, found, kw)
    if relaxed is not None:
        return relaxed
    if found is not None:
        return found
    if budget_bytes < min_peak_unheld(chain):
        raise infeasible_error(chain, budget_bytes, min_peak_unheld(chain)) from None  # the same error, once
    # between the smallest peak a plan reaches and the tables' own (the side inputs' bytes)
    plan = min_peak_plan_kept(chain)
    plan = Plan("dp", plan.n_layers, plan.items, {**plan.params, "budget_bytes": budget_bytes})
    return DPResult(plan, 1, 0, False, chain.n_layers + 1,
                    ("a budget this close to the smallest peak: the plan reaching it",))


def _side_relaxed(chain: Chain, budget_bytes: int, slack: int, found: DPResult | None,
                  kw: dict[str, Any]) -> DPResult | None:
    """The plan the tables give at ``budget_bytes + slack`` where it fits ``budget_bytes`` and
    recomputes less than ``found`` (or ``found`` is None); where it does not fit, read again
    lower by its overshoot (up to ``limits.SIDE_RELAX_READS`` reads); else None."""
    read = budget_bytes + slack
    for _ in range(limits.SIDE_RELAX_READS):
        try:
            alt = _plan_unheld(chain, read, **kw)
        except InfeasibleBudgetError:
            return None
        sc = simulate(chain, alt.plan)
        if sc.peak_bytes <= budget_bytes:
            break
        read -= sc.peak_bytes - budget_bytes
        if read <= budget_bytes:
            return None
    else:
        return None
    if found is not None and sc.recompute_ms >= simulate(chain, found.plan).recompute_ms - 1e-9:
        return None
    plan = Plan(alt.plan.strategy, alt.plan.n_layers, alt.plan.items, {**alt.plan.params, "budget_bytes": budget_bytes})
    note = (f"read at the budget plus {read - budget_bytes} of the side inputs' {slack} bytes (the tables count "
            "them for the whole step): this plan fits the budget in the simulator")
    return DPResult(plan, alt.slot_bytes, alt.n_slots, False, alt.n_units, (*alt.notes, note))


def _plan_unheld(chain: Chain, budget_bytes: int, *, max_slots: int | None = None, mode: str = "auto",
                 groups: int | None = None, rounding: str = "nearest") -> DPResult:
    """``plan_unheld`` with the tables read at ``budget_bytes``."""
    notes: list[str] = []
    peak_none = none_peak(chain)
    fits = none_fits(chain, budget_bytes, peak_none)
    if fits is not None:
        return fits
    if not chain.all_kept:
        return _plan_dp_unkept(chain, budget_bytes, max_slots=max_slots, mode=mode, groups=groups,
                               rounding=rounding)
    band_ok = mode == "auto" and max_slots is None and not chain.has_casts
    banded = (_banded_first(chain, budget_bytes, peak_none)
              if plans_banded(chain, max_slots=max_slots, mode=mode) else None)
    if banded is not None:
        found, exact, solver = banded.plan, banded.exact, None
        if not exact:
            notes.append(_band_note(banded))
    else:
        found, exact, solver = _plan_dp_tables(
            chain, budget_bytes, notes, band_ok and chain.n_layers > limits.BAND_MAX_LAYERS,
            max_slots=max_slots, mode=mode, groups=groups, rounding=rounding)
    exact = safe_side(chain, exact, notes)
    if solver is None:
        return DPResult(found, 1, max(0, peak_none - base_bytes(chain)), exact,
                        chain.n_layers + 1, tuple(notes))
    _solver_notes(chain, solver, notes)
    return DPResult(found, solver.slot_bytes, solver.M, exact, solver.units.size, tuple(notes))


@lru_cache(maxsize=16)
def min_peak_unheld(chain: Chain) -> int:
    """``min_peak`` of a chain that holds no layers."""
    if not chain.all_kept:
        return min_peak_unkept(chain)
    lowest = min_peak_kept(chain)
    if chain.side_bytes or chain.side_grad_bytes:  # the tables count them for the whole step
        lowest = min(lowest, simulate(chain, min_peak_plan_kept(chain)).peak_bytes)
    return lowest


def min_peak_plan_unheld(chain: Chain, budget_bytes: int | None = None) -> Plan:
    """``min_peak_plan`` of a chain that holds no layers."""
    if not chain.all_kept:
        return min_peak_plan_unkept(chain, budget_bytes)
    return min_peak_plan_kept(chain, budget_bytes)
