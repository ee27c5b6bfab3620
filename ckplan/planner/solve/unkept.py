"""Chains with boundaries the plain forward does not keep: planned by the exact DP on the chain
itself (``unkept_dp.py``) where it models the chain and it is short enough, else on a bound that
keeps them."""
from __future__ import annotations

from dataclasses import replace
from functools import cache, lru_cache

from ...errors import PlannerBugError
from .. import limits
from ..baselines import none_peak, plan_none
from ..chain import Chain
from ..floor import infeasible_error
from ..plan import Checkpoint, Item, Plan, Store, items_from_ranges
from ..simulate import peak_of, simulate
from .band import banded_applies, banded_plan
from .common import (
    DPResult,
    _cheapest_fitting,
)
from .improve import improve
from .lowest import min_peak_kept, min_peak_plan_kept
from .solver import DPSolver
from .unkept_dp import DirectDP, direct_applies, direct_dp


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

    Up to ``UNKEPT_DIRECT_LAYERS`` layers, on a chain :func:`direct_applies` to without selective
    options, the DP on the chain itself (:class:`DirectDP`) gives the optimum. Otherwise the
    tables, which model rotor's chain (a stored layer keeps its output), plan on
    ``chain.conservative()`` (every such output kept), whose plans peak no lower, op by op, than
    on ``chain``, so each fits here too; since the bound overstates by at most the unkept
    boundaries, its tables are read at ``UNKEPT_STEPS + 1`` budgets from the asked one up to that
    much higher (and near its own smallest peak); with the DP's plan (without options) where it
    applies, the cheapest plans of those whose peak on ``chain`` fits are improved by moving their
    checkpoints' ends (:func:`improve`), and the cheapest is returned. Never over budget; not
    proven optimal there, except on a chain of at most ``UNKEPT_EXHAUSTIVE_LAYERS`` layers without
    selective options, where every plan is tried."""
    n = chain.n_layers
    lowest = min_peak_unkept(chain)
    if budget_bytes < lowest:
        raise infeasible_error(chain, budget_bytes, lowest)
    direct = _direct(chain)
    found = direct.solve(budget_bytes) if direct is not None else None
    if found is not None and not chain.has_options:
        plan = Plan("dp", n, found[0], {"budget_bytes": budget_bytes})
        if simulate(chain, plan).peak_bytes <= budget_bytes:  # the simulator has the last word
            return DPResult(plan, 1, 0, True, n + 1, (_unkept_note(chain, _DIRECT_NOTE),))
    cands = list(_unkept_low_plans(chain)) + _unkept_plans(chain, budget_bytes, **dp_options)
    every = _every_plain_plan(chain) if direct is None else None
    if found is not None:
        cands.append(Plan("dp", n, found[0]))
    if every:  # a short chain: the best plan without options, by trying them all
        fits = [(cost, peak, i) for i, (peak, cost) in enumerate(every[1]) if peak <= budget_bytes]
        if fits:
            cands.append(Plan("dp", n, every[0][min(fits)[2]]))
    best = _cheapest_fitting(chain, cands, budget_bytes)
    if best is None:  # pragma: no cover - the plan reaching min_peak is among them
        raise PlannerBugError(f"dp found no plan at budget {budget_bytes} above the smallest peak "
                              f"{lowest}")
    # the cheapest few that fit, improved on the chain: simulations spread over them, fewer on long chains
    k = limits.UNKEPT_IMPROVED if n <= 16 else 2
    fitting = sorted({c.items: c for c in cands if simulate(chain, c).peak_bytes <= budget_bytes}.values(),
                     key=lambda c: simulate(chain, c).recompute_ms)[:k]
    sims = max(20, limits.UNKEPT_IMPROVE_WORK // (n * k))
    best = _cheapest_fitting(chain, [best] + [_improved(chain, c, budget_bytes, sims) for c in fitting],
                             budget_bytes) or best
    plan = Plan("dp", n, best.items, {"budget_bytes": budget_bytes})
    exact = every is not None and not chain.has_options
    how = (f"the cheapest of every plan ({len(every[0])}) that fits the budget as measured" if exact and every
           else f"planned on a bound that keeps them, the cheapest of {len(cands)} plans that fits the budget "
           "as measured" + (" (with the DP on the chain itself, which plans without options)" if found else ""))
    return DPResult(plan, 1, 0, exact, n + 1, (_unkept_note(chain, how),))


_DIRECT_NOTE = ("the cheapest nested plan that fits the budget, by a DP on the chain as measured "
                "(solve/unkept_dp.py: exact)")


def _direct(chain: Chain) -> DirectDP | None:
    """The exact DP on ``chain`` itself, where it models every op and the chain is short enough
    (``UNKEPT_DIRECT_LAYERS``)."""
    if chain.n_layers > limits.UNKEPT_DIRECT_LAYERS or not direct_applies(chain):
        return None
    return direct_dp(chain)


@lru_cache(maxsize=8)
def _every_plain_plan(chain: Chain) -> tuple[tuple[tuple[Item, ...], ...], tuple[tuple[int, float], ...]] | None:
    """Every plan of rotor's grammar on a chain of at most ``UNKEPT_EXHAUSTIVE_LAYERS`` layers
    (394 at 5 layers, 8,558 at 7), each stored layer plain, with its simulated peak and
    recompute (for chains the DP on the chain itself does not model); None for a longer chain or
    one with breaks."""
    n = chain.n_layers
    if n > limits.UNKEPT_EXHAUSTIVE_LAYERS or chain.breaks:
        return None

    @cache
    def seqs(s: int, e: int, last_free: bool, whole: bool = True) -> tuple[tuple[Item, ...], ...]:
        if s == e:
            return ((),)
        out = [(Store(s), *rest) for rest in seqs(s + 1, e, last_free)]
        for j in range(s + 1, e + 1):
            if j == e and not (last_free and whole):
                continue
            out += [(Checkpoint(s, j, inner), *rest) for inner in seqs(s, j, False, False)
                    for rest in seqs(j, e, last_free)]
        return tuple(out)

    plans = seqs(0, n, True)
    return plans, tuple(peak_of(chain, items) for items in plans)


def _improved(chain: Chain, plan: Plan, budget_bytes: int, sims: int) -> Plan:
    """``plan``, or a cheaper one that fits found by moving its checkpoints' ends on ``chain``
    itself (:func:`improve`): the bound's plans keep boundaries that ``chain`` frees, so a
    checkpoint one layer longer or shorter can fit here where the bound said it would not. Plans
    with selective options or offload are left as they are."""
    if plan.uses_options:
        return plan
    ranges = [(it.start, it.stop) for it, _ in plan.walk() if isinstance(it, Checkpoint)]
    n = chain.n_layers
    better = improve(chain, ranges, budget_bytes, max_sims=sims)
    return plan if sorted(better) == sorted(ranges) else Plan(plan.strategy, n, items_from_ranges(n, better))


def _unkept_note(chain: Chain, how: str) -> str:
    """What ``_plan_dp_unkept`` says about a chain's unkept boundaries, then ``how`` it planned."""
    unkept = sum(not ly.x_kept for ly in chain.layers)
    own = sum(ly.x_kept and not ly.x_kept_next for ly in chain.layers)
    what = [f"{'the chain input and ' if not chain.pre.x_kept else ''}{unkept} layer output(s) are "
            "not kept by the plain forward (no op saves them)"] if unkept or not chain.pre.x_kept else []
    if own:
        what.append(f"{own} layer output(s) are saved only by the layer's own ops (a checkpoint "
                    "ending there frees them once read)")
    return f"{'; '.join(what)}: {how}"


@lru_cache(maxsize=16)
def min_peak_unkept(chain: Chain) -> int:
    """``min_peak`` of a chain with unkept boundaries (no held layers): exact where the DP on the
    chain itself plans it (``_direct``) and the chain has no selective options; else the lowest
    peak on ``chain`` of the plans the tables of ``chain.conservative()`` give near their own
    smallest peak (``_unkept_low_plans``), of the DP's plan and, on a short chain, of every plan:
    a peak a plan reaches, which on a longer chain the true smallest may undercut (by at most
    those boundaries)."""
    direct = _direct(chain)
    if direct is not None and not chain.has_options:
        return direct.min_peak()
    every = _every_plain_plan(chain) if direct is None else None
    lowest = min(simulate(chain, p).peak_bytes for p in _unkept_low_plans(chain))
    if direct is not None:
        lowest = min(lowest, direct.min_peak())
    return min(lowest, *(peak for peak, _ in every[1])) if every else lowest


def min_peak_plan_unkept(chain: Chain, budget_bytes: int | None) -> Plan:
    """``min_peak_plan`` of a chain with unkept boundaries (no held layers): the DP's cheapest
    plan at the budget (or at the smallest peak) where it plans the chain, else the cheapest
    fitting plan of those the bound gives (planned with every boundary kept: peaks no lower than
    here) and, on a short chain, of every plan."""
    n = chain.n_layers
    direct = _direct(chain)
    if direct is not None and not chain.has_options:
        found = direct.solve(max(budget_bytes or 0, direct.min_peak()))
        assert found is not None
        return Plan("dp", n, found[0], {"budget_bytes": budget_bytes, "min_peak": True})
    cands = list(_unkept_low_plans(chain))
    every = _every_plain_plan(chain) if direct is None else None
    if every:  # a short chain: the lowest peak of every plan, the cheapest there
        low = min((peak, cost, i) for i, (peak, cost) in enumerate(every[1]))
        cands.append(Plan("dp", n, every[0][low[2]]))
    if direct is not None:
        found = direct.solve(max(budget_bytes or 0, direct.min_peak()))
        if found is not None:
            cands.append(Plan("dp", n, found[0]))
    cons = chain.conservative()
    if budget_bytes is not None and budget_bytes >= min_peak_kept(cons):
        cands.append(min_peak_plan_kept(cons, budget_bytes))
    best = _cheapest_fitting(chain, cands, budget_bytes)
    if best is None:  # no budget (or below every candidate): the lowest peak
        best = min(cands, key=lambda p: peak_of(chain, p.items))
    return replace(best, params={"budget_bytes": budget_bytes, "min_peak": True})
