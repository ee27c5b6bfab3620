"""Every strategy returns a :class:`Plan`, and only the simulator scores them.

The baselines (``none``, ``every-k``, ``sqrtn``, ``chen``) are in ``baselines.py``; ``dp``, the
optimal nested plan under a budget (rotor), is in ``solve/`` and chooses among each stored
layer's selective options when the chain has them. ``selective`` (Megatron-style selective
recomputation) stores every layer with one selective policy (``plan_selective``); it needs a
chain profiled with options, and ``compare``/``sweep`` leave it out on chains without.
``plan_chain`` is the public entry point; ``compare`` runs several strategies at one budget
(``frontier.sweep`` draws each strategy's memory/time frontier).

Budgets below the smallest feasible peak: ``plan_chain`` raises
:class:`ckplan.errors.InfeasibleBudgetError` for ``dp`` and ``chen`` alike (the strategies that
plan for a budget); ``compare`` never raises it, it returns every row with ``fits=False`` so a
caller can show the whole table and then exit with the error's code (see ``compare``).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from functools import lru_cache
from typing import Any

from ..errors import InfeasibleBudgetError, SpecError, UsageError
from . import solve
from .baselines import (
    baseline_candidates,
    chen_grid,
    cut_at_breaks,
    plan_chen,
    plan_chen_threshold,
    plan_every_k,
    plan_none,
    plan_sqrtn,
)
from .chain import Chain
from .floor import infeasible_error
from .plan import Plan, Store
from .simulate import Score, simulate

__all__ = ["ALL_STRATEGIES", "STRATEGIES", "PlanResult", "baseline_candidates",
           "chen_grid", "common_policies", "compare", "plan_chain", "plan_chen", "plan_chen_threshold",
           "plan_every_k", "plan_none", "plan_selective", "plan_sqrtn"]

STRATEGIES = ("none", "every-k", "sqrtn", "chen", "dp")  # the ones every chain can run
# Both need a chain with selective options: ``selective`` stores every layer with one policy;
# ``dp-layer`` is ``dp`` without options (store or recompute whole layers: rotor's plan space),
# the baseline that shows what the options are worth.
ALL_STRATEGIES = (*STRATEGIES, "selective", "dp-layer")
NEEDS_OPTIONS = ("selective", "dp-layer")


@dataclass(frozen=True)
class PlanResult:
    strategy: str
    plan: Plan
    score: Score
    budget_bytes: int | None
    fits: bool | None  # None without a budget
    slot_bytes: int | None = None  # dp only: memory granularity
    exact: bool | None = None  # dp only: True when provably optimal under the simulator
    notes: tuple[str, ...] = field(default=())

    def to_dict(self) -> dict[str, Any]:
        return {"strategy": self.strategy, "budget_bytes": self.budget_bytes, "fits": self.fits,
                "slot_bytes": self.slot_bytes, "exact": self.exact, "notes": list(self.notes),
                "score": asdict(self.score), "plan": self.plan.to_dict()}


# ---- public entry points ------------------------------------------------------------------
def plan_chain(chain: Chain, strategy: str, budget_bytes: int | None = None, k: int = 2, *,
               max_slots: int | None = None, mode: str = "auto",
               groups: int | None = None) -> PlanResult:
    """Plan ``chain`` with one strategy and score it.

    Only ``chen`` and ``dp`` look at the budget; for the others ``fits`` says whether they
    happen to fit. ``dp`` without a budget plans for the smallest feasible peak. ``dp`` and
    ``chen`` raise :class:`ckplan.errors.InfeasibleBudgetError` when the budget is below the
    smallest feasible peak (``chen`` returns ``fits=False`` when only its threshold grid misses a
    feasible budget). ``dp`` never returns a plan over its budget, mixed precision included
    (``solve/``); when its tables are not exact, ``_safety_net`` swaps in a baseline plan that
    fits with less recompute.
    """
    n = chain.n_layers
    slot: int | None = None
    exact: bool | None = None
    notes: tuple[str, ...] = ()
    if strategy == "none":
        plan = plan_none(n)
    elif strategy == "every-k":
        plan = cut_at_breaks(plan_every_k(n, k), chain.breaks)
    elif strategy == "sqrtn":
        plan = cut_at_breaks(plan_sqrtn(n), chain.breaks)
    elif strategy == "chen":
        plan = plan_chen(chain, budget_bytes)
        if budget_bytes is not None and simulate(chain, plan).peak_bytes > budget_bytes:
            lowest = solve.min_peak(chain)
            if budget_bytes < lowest:
                raise infeasible_error(chain, budget_bytes, lowest)
    elif strategy == "selective":
        plan, notes = plan_selective(chain, budget_bytes)
    elif strategy == "dp-layer":
        r = plan_chain(chain.without_options(), "dp", budget_bytes, k, max_slots=max_slots,
                       mode=mode, groups=groups)
        plan = replace(r.plan, strategy="dp-layer")
        slot, exact = r.slot_bytes, r.exact
        notes = r.notes + ("layer-level plan: every layer stored whole or recomputed whole "
                           "(selective options left out)",)
    elif strategy == "dp":
        target = solve.min_peak(chain) if budget_bytes is None else budget_bytes
        res = solve.plan_dp(chain, target, max_slots=max_slots, mode=mode,
                         groups=groups)
        plan, slot, exact, notes = res.plan, res.slot_bytes, res.exact, res.notes
        if budget_bytes is None:
            notes += ("no budget: planned for the smallest feasible peak",)
        plan, extra = _safety_net(chain, plan, target, k)
        notes += extra
    else:
        raise UsageError(f"unknown strategy {strategy!r}",
                         tip=f"choose one of {', '.join(ALL_STRATEGIES)}")
    plan = plan.copying_inputs([i for i, ly in enumerate(chain.layers) if ly.copies_input])
    score = simulate(chain, plan)
    fits = None if budget_bytes is None else score.peak_bytes <= budget_bytes
    if chain.breaks and strategy not in ("none", "selective"):
        layers = ", ".join(map(str, chain.breaks[:12])) + (" ..." if len(chain.breaks) > 12 else "")
        notes = (*notes, f"no checkpoint starts before and ends after layer(s) {layers}: the model changes "
                         "the hidden state before them (the profile's chain breaks)")
    return PlanResult(strategy, plan, score, budget_bytes, fits, slot, exact, tuple(notes))


def common_policies(chain: Chain) -> tuple[str, ...]:
    """The selective options every layer of ``chain`` has, in the first layer's order."""
    names = [o.name for o in chain.layers[0].options]
    return tuple(nm for nm in names if all(any(o.name == nm for o in ly.options) for ly in chain.layers))


def selective_plans(chain: Chain) -> list[Plan]:
    """One plan per common policy: every layer stored with it (``selective``'s candidates)."""
    if not chain.has_options:
        raise SpecError("the selective strategy needs selective options, and this chain has none that "
                        "pays: the profile measured none (profiled without options, or the layers cannot "
                        "run under SAC: its notes say which), or every option it measured was dominated "
                        "(kept more and recomputed no less than storing or recomputing the whole layer; "
                        "on small layers SAC's own overhead outweighs what it saves, and on a busy machine "
                        "the measured times that decide it vary)",
                        tip="profile with options where they were left out (`ckplan profile --options`), "
                            "use --strategy dp, which plans without options when none pays, or bench a "
                            "plan that uses one (--plan FILE) to measure it anyway")
    pols = common_policies(chain)
    if not pols:
        have = sorted({o.name for ly in chain.layers for o in ly.options})
        raise SpecError(f"the selective strategy needs a policy every layer has; the profile's "
                        f"options ({', '.join(have)}) are not on every layer",
                        tip="use --strategy dp, which chooses an option per layer")
    n = chain.n_layers
    return [Plan("selective", n, tuple(Store(i, p) for i in range(n)), {"policy": p}) for p in pols]


def plan_selective(chain: Chain, budget_bytes: int | None = None) -> tuple[Plan, tuple[str, ...]]:
    """Megatron-style selective recomputation: every layer stored with one policy (a selective
    option every layer has). The fastest whose peak fits the budget, else the lowest peak; with
    no budget, the lowest peak (ties: the fastest). Raises :class:`SpecError` when the chain
    has no options (or no policy common to every layer)."""
    scored = [(simulate(chain, p), p) for p in selective_plans(chain)]
    lowest = min(scored, key=lambda sp: (sp[0].peak_bytes, sp[0].recompute_ms))
    if budget_bytes is None:
        plan = lowest[1]
        return plan, (f"no budget: policy {plan.params['policy']} has the lowest peak",)
    fit = [sp for sp in scored if sp[0].peak_bytes <= budget_bytes]
    if fit:
        plan = min(fit, key=lambda sp: (sp[0].recompute_ms, sp[0].peak_bytes))[1]
        return plan, (f"policy {plan.params['policy']}: the fastest of {len(scored)} that fits",)
    plan = lowest[1]
    return plan, (f"no policy fits the budget: policy {plan.params['policy']} has the lowest peak",)


def recompute_floor(chain: Chain, plan: Plan) -> float:
    """A lower bound on ``simulate(chain, plan).recompute_ms``, in O(layers): every layer inside
    a top-level checkpoint runs its forward again at least once, less the last one's tail
    (PyTorch's early stop; a layer's tail is at most its forward). Exact for single-level plans
    storing plainly (the baselines); nested checkpoints and selective options only add. A bound
    for pruning, not a score: tests hold it against the simulator."""
    L = chain.layers
    return sum(sum(L[i].fwd_ms for i in range(r.start, r.stop)) - L[r.stop - 1].tail_ms
               for r in plan.items if not isinstance(r, Store))


@lru_cache(maxsize=16)  # budget-independent: every budget planned on a chain reuses them
def _baselines(chain: Chain, k: int) -> tuple[tuple[Plan, float], ...]:
    """The baselines' plans (``baseline_candidates``), least ``recompute_floor`` first."""
    return tuple(sorted(((cand, recompute_floor(chain, cand)) for cand in baseline_candidates(chain, k)),
                        key=lambda pf: pf[1]))


@lru_cache(maxsize=256)
def _baseline_score(chain: Chain, plan: Plan) -> Score:
    return simulate(chain, plan)


def _safety_net(chain: Chain, plan: Plan, budget: int, k: int) -> tuple[Plan, tuple[str, ...]]:
    """Never return a plan that a baseline beats at the same budget: one that recomputes less
    (when the DP is not exact: rounded slots, grouped layers), or as little at a lower peak (a tie
    the DP breaks either way). Only baselines whose ``recompute_floor`` is at most the best plan's
    recompute are simulated (1000 layers: 38 simulations, 0.5 s, before)."""
    best, best_score = plan, simulate(chain, plan)
    tied = False
    for cand, floor in _baselines(chain, k):
        if floor * (1 - 1e-9) > best_score.recompute_ms * (1 + 1e-9):
            break  # least floor first: no baseline left recomputes as little as the best
        sc = _baseline_score(chain, cand)
        if sc.peak_bytes > budget:
            continue
        if sc.recompute_ms < best_score.recompute_ms * (1 - 1e-9):
            best, best_score, tied = cand, sc, False
        elif sc.recompute_ms <= best_score.recompute_ms * (1 + 1e-9) and sc.peak_bytes < best_score.peak_bytes:
            best, best_score, tied = cand, sc, True
    if best is plan:
        return plan, ()
    label = best.strategy + (f" (k={best.params['k']})" if "k" in best.params else "")
    won = Plan("dp", chain.n_layers, best.items, {**plan.params, "from": label})
    if tied:
        return won, (f"the {label} plan recomputes as little at a lower peak and is returned",)
    return won, (f"the {label} plan beat the rounded DP at this budget and is returned",)


INFEASIBLE_NOTE = "infeasible: "


def compare(chain: Chain, strategies: tuple[str, ...] | list[str] = STRATEGIES,
            budget_bytes: int | None = None, k: int = 2, **dp_options: Any) -> tuple[PlanResult, ...]:
    """``plan_chain`` for each strategy at one budget.

    Contract for a budget below the smallest feasible peak: no exception; every row has
    ``fits=False`` (``dp``'s row holds the smallest-peak plan, ``chen``'s its lowest-peak grid
    point) and the ``dp``/``chen`` rows carry the infeasibility message as their last note. A
    CLI prints the table, then exits with :class:`ckplan.errors.InfeasibleBudgetError`'s code
    (3); ``infeasible_budget(rows)`` says when. ``selective`` has no row on a chain without
    selective options.
    """
    rows: list[PlanResult] = []
    for s in strategies:
        if s in NEEDS_OPTIONS and not chain.has_options:
            continue  # nothing to compare: the profile has no selective options
        try:
            rows.append(plan_chain(chain, s, budget_bytes, k, **dp_options))
        except InfeasibleBudgetError as err:
            if s == "selective":
                raise
            plan = (_floor_plan(chain, s, k, dp_options) if s in ("dp", "dp-layer") else
                    plan_chen(chain, budget_bytes))
            rows.append(PlanResult(s, plan, simulate(chain, plan), budget_bytes, False,
                                   notes=(INFEASIBLE_NOTE + err.message,)))
    return tuple(rows)


def _floor_plan(chain: Chain, strategy: str, k: int, dp_options: dict[str, Any]) -> Plan:
    """The least-recompute plan of ``strategy`` (dp, dp-layer) at the smallest peak it reaches: where
    that peak is set by what no plan changes (the optimizer step), it is ``none``, not a plan that
    recomputes for nothing."""
    floor = solve.min_peak_plan(chain if strategy == "dp" else chain.without_options())
    try:
        return plan_chain(chain, strategy, simulate(chain, floor).peak_bytes, k, **dp_options).plan
    except InfeasibleBudgetError:  # a table's bound above the plan's own peak: that plan
        return floor if strategy == "dp" else replace(floor, strategy="dp-layer")


def infeasible_budget(rows: tuple[PlanResult, ...] | list[PlanResult]) -> str | None:
    """The infeasibility message when ``compare``'s budget is below the smallest feasible peak
    (the caller should exit 3 after showing the rows), else None."""
    for r in rows:
        if r.fits is False and r.notes and r.notes[-1].startswith(INFEASIBLE_NOTE):
            return r.notes[-1][len(INFEASIBLE_NOTE):]
    return None
