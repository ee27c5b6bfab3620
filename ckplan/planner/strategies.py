"""Every strategy returns a :class:`Plan`, and only the simulator scores them.

* ``none``: store everything.
* ``every-k``: checkpoint consecutive segments of k layers (k = 1 is Hugging Face's
  ``gradient_checkpointing_enable``).
* ``sqrtn``: ``torch.utils.checkpoint.checkpoint_sequential`` with ceil(sqrt(n)) segments; its
  last segment is not checkpointed.
* ``chen``: Chen, Xu, Zhang, Guestrin 2016, "Training Deep Nets with Sublinear Memory Cost",
  budgeted greedy: walk the layers adding up output sizes and close a segment when the running
  total passes a threshold B; B is searched on a grid around sqrt(x * y), with x the bytes the
  sqrt(n) plan keeps at its boundaries and y its largest segment. B bounds segment size, not the
  peak, so under a budget we pick the grid point with least recompute that fits (else the
  lowest peak).
* ``dp``: the optimal nested plan under a budget (``dp.py``, rotor).

``plan_chain`` is the public entry point; ``compare`` runs several strategies at one budget and
``sweep`` draws each strategy's memory/time frontier.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from ..errors import UsageError
from .chain import Chain
from .plan import Checkpoint, Item, Plan, Store
from .simulate import Score, simulate

STRATEGIES = ("none", "every-k", "sqrtn", "chen", "dp")


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


@dataclass(frozen=True)
class FrontierPoint:
    """One point of a strategy's memory/time trade-off (a row of the sweep CSV)."""

    strategy: str
    budget_bytes: int | None  # dp: the budget asked for; others: None
    k: int | None  # every-k / sqrtn segment length
    threshold_bytes: int | None  # chen's B
    peak_bytes: int
    recompute_ms: float
    step_ms: float
    overhead: float
    n_checkpoints: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# ---- the baselines -------------------------------------------------------------------------
def _segment(start: int, stop: int) -> Checkpoint:
    return Checkpoint(start, stop, tuple(Store(i) for i in range(start, stop)))


def plan_none(n_layers: int) -> Plan:
    return Plan("none", n_layers, tuple(Store(i) for i in range(n_layers)))


def plan_every_k(n_layers: int, k: int = 2) -> Plan:
    if not isinstance(k, int) or k < 1:
        raise UsageError(f"every-k needs k >= 1, got {k!r}", tip="use --k 2 (every two layers)")
    items = tuple(_segment(s, min(s + k, n_layers)) for s in range(0, n_layers, k))
    return Plan("every-k", n_layers, items, {"k": k})


def plan_sqrtn(n_layers: int) -> Plan:
    """checkpoint_sequential(functions, segments=ceil(sqrt(n))): equal segments of
    n // segments layers, every one checkpointed except the last, which runs stored."""
    segments = math.ceil(math.sqrt(n_layers))
    size = n_layers // segments
    items: list[Item] = []
    end = -1
    for start in range(0, size * (segments - 1), size):
        end = start + size - 1
        items.append(_segment(start, end + 1))
    items.extend(Store(i) for i in range(end + 1, n_layers))
    return Plan("sqrtn", n_layers, tuple(items), {"segments": segments, "k": size})


def plan_chen_threshold(chain: Chain, threshold_bytes: int) -> Plan:
    """Chen et al.'s greedy for one threshold: close a segment once its outputs pass it."""
    items: list[Item] = []
    start, total = 0, 0
    for i, ly in enumerate(chain.layers):
        total += ly.x_bytes
        if total > threshold_bytes:
            items.append(_segment(start, i + 1))
            start, total = i + 1, 0
    if start < chain.n_layers:
        items.append(_segment(start, chain.n_layers))
    return Plan("chen", chain.n_layers, tuple(items), {"threshold_bytes": int(threshold_bytes)})


def chen_grid(chain: Chain) -> tuple[int, ...]:
    """Thresholds around sqrt(x * y) of the sqrt(n) plan, a factor 2^(1/4) apart."""
    sq = plan_sqrtn(chain.n_layers)
    segs = [it for it in sq.items if isinstance(it, Checkpoint)] or [_segment(0, chain.n_layers)]
    x = sum(chain.layers[c.stop - 1].x_bytes for c in segs)
    y = max(sum(chain.layers[i].x_bytes for i in range(c.start, c.stop)) for c in segs)
    b0 = math.sqrt(max(x, 1) * max(y, 1))
    return tuple(sorted({max(0, int(b0 * 2 ** (k / 4))) for k in range(-8, 9)}))


def plan_chen(chain: Chain, budget_bytes: int | None = None) -> Plan:
    """Without a budget: the paper's B = sqrt(x * y). With one: least recompute that fits,
    else the lowest peak on the grid."""
    grid = chen_grid(chain)
    if budget_bytes is None:
        return plan_chen_threshold(chain, grid[len(grid) // 2])
    scored = [(p, simulate(chain, p)) for p in (plan_chen_threshold(chain, b) for b in grid)]
    fit = [ps for ps in scored if ps[1].peak_bytes <= budget_bytes]
    if fit:
        return min(fit, key=lambda ps: (ps[1].recompute_ms, ps[1].peak_bytes))[0]
    return min(scored, key=lambda ps: (ps[1].peak_bytes, ps[1].recompute_ms))[0]


def baseline_candidates(chain: Chain, k: int = 2) -> list[Plan]:
    """The baselines' plans, for the dp safety net and tests."""
    n = chain.n_layers
    ks = sorted({k, *range(1, min(n, 16) + 1), math.ceil(math.sqrt(n)), n})
    plans = [plan_none(n), plan_sqrtn(n)] + [plan_every_k(n, kk) for kk in ks if kk <= n]
    return plans + [plan_chen_threshold(chain, b) for b in chen_grid(chain)]


# ---- public entry points ------------------------------------------------------------------
def plan_chain(chain: Chain, strategy: str, budget_bytes: int | None = None, k: int = 2, *,
               max_slots: int | None = None, mode: str = "auto",
               groups: int | None = None) -> PlanResult:
    """Plan ``chain`` with one strategy and score it.

    Only ``chen`` and ``dp`` look at the budget; for the others ``fits`` says whether they
    happen to fit. ``dp`` without a budget plans for the smallest feasible peak. ``dp`` raises
    :class:`ckplan.errors.InfeasibleBudgetError` when no plan fits.
    """
    from . import dp

    n = chain.n_layers
    slot, exact, notes = None, None, ()
    if strategy == "none":
        plan = plan_none(n)
    elif strategy == "every-k":
        plan = plan_every_k(n, k)
    elif strategy == "sqrtn":
        plan = plan_sqrtn(n)
    elif strategy == "chen":
        plan = plan_chen(chain, budget_bytes)
    elif strategy == "dp":
        target = dp.min_peak(chain) if budget_bytes is None else budget_bytes
        res = dp.plan_dp(chain, target, max_slots=max_slots, mode=mode,
                         groups=groups)
        plan, slot, exact, notes = res.plan, res.slot_bytes, res.exact, res.notes
        if budget_bytes is None:
            notes += ("no budget: planned for the smallest feasible peak",)
        if not exact:
            plan, extra = _safety_net(chain, plan, target, k)
            notes += extra
    else:
        raise UsageError(f"unknown strategy {strategy!r}",
                         tip=f"choose one of {', '.join(STRATEGIES)}")
    score = simulate(chain, plan)
    fits = None if budget_bytes is None else score.peak_bytes <= budget_bytes
    return PlanResult(strategy, plan, score, budget_bytes, fits, slot, exact, tuple(notes))


def _safety_net(chain: Chain, plan: Plan, budget: int, k: int) -> tuple[Plan, tuple[str, ...]]:
    """When the DP is not exact (rounded slots, grouped layers), never return a plan that a
    baseline beats at the same budget."""
    best, best_score = plan, simulate(chain, plan)
    for cand in baseline_candidates(chain, k):
        sc = simulate(chain, cand)
        if sc.peak_bytes <= budget and sc.recompute_ms < best_score.recompute_ms * (1 - 1e-12):
            best, best_score = cand, sc
    if best is plan:
        return plan, ()
    label = best.strategy + (f" (k={best.params['k']})" if "k" in best.params else "")
    won = Plan("dp", chain.n_layers, best.items, {**plan.params, "from": label})
    return won, (f"the {label} plan beat the rounded DP at this budget and is returned",)


def compare(chain: Chain, strategies: tuple[str, ...] | list[str] = STRATEGIES,
            budget_bytes: int | None = None, k: int = 2, **dp_options) -> tuple[PlanResult, ...]:
    """``plan_chain`` for each strategy at one budget."""
    return tuple(plan_chain(chain, s, budget_bytes, k, **dp_options) for s in strategies)


def _point(strategy: str, chain: Chain, plan: Plan, budget: int | None = None,
           k: int | None = None, threshold: int | None = None) -> FrontierPoint:
    sc = simulate(chain, plan)
    return FrontierPoint(strategy, budget, k, threshold, sc.peak_bytes, sc.recompute_ms,
                         sc.step_ms, sc.overhead, plan.n_checkpoints)


def sweep(chain: Chain, strategies: tuple[str, ...] | list[str] = STRATEGIES,
          n_points: int = 20, **dp_options) -> tuple[FrontierPoint, ...]:
    """Each strategy's memory/time frontier.

    ``dp``: ``n_points`` budgets evenly spaced from the smallest feasible peak to the peak
    without checkpointing, all read from one DP table. ``every-k``: k = 1..16, then doubling,
    up to n. ``chen``: its threshold grid. ``sqrtn`` / ``none``: one point each.
    """
    n = chain.n_layers
    rows: list[FrontierPoint] = []
    for s in strategies:
        if s == "none":
            rows.append(_point(s, chain, plan_none(n)))
        elif s == "sqrtn":
            p = plan_sqrtn(n)
            rows.append(_point(s, chain, p, k=p.params["k"]))
        elif s == "every-k":
            ks = sorted({*range(1, min(n, 16) + 1), *(2 ** i for i in range(5, 30) if 2 ** i < n), n})
            rows.extend(_point(s, chain, plan_every_k(n, kk), k=kk) for kk in ks)
        elif s == "chen":
            rows.extend(_point(s, chain, plan_chen_threshold(chain, b), threshold=b)
                        for b in chen_grid(chain))
        elif s == "dp":
            pass  # below, once the baselines' points are known
        else:
            raise UsageError(f"unknown strategy {s!r}", tip=f"choose one of {', '.join(STRATEGIES)}")
    if "dp" in strategies:
        baselines = list(rows) or [_point(s, chain, p) for s, p in
                                   (("every-k", plan_every_k(n, 1)), ("sqrtn", plan_sqrtn(n)))]
        rows.extend(_dp_frontier(chain, max(2, n_points), dp_options, baselines))
    return tuple(rows)


def _dp_frontier(chain: Chain, n_points: int, dp_options: dict,
                 baselines: list[FrontierPoint] | None = None) -> list[FrontierPoint]:
    """dp at ``n_points`` even budgets plus at every baseline point's own peak, so the frontier
    is evaluated exactly where it is compared; a plan that fits a lower budget (or a baseline
    plan that fits) is kept when the rounded tables find nothing better."""
    from . import dp

    lo = dp.min_peak(chain)
    solver = dp.DPSolver(chain, max_slots=dp_options.get("max_slots"),
                         mode=dp_options.get("mode", "auto"), groups=dp_options.get("groups"))
    hi = solver.none_peak
    budgets = {lo + (hi - lo) * t // (n_points - 1) for t in range(n_points)}
    budgets |= {p.peak_bytes for p in (baselines or []) if lo <= p.peak_bytes <= hi}
    fallbacks = [(p.peak_bytes, p.recompute_ms, p) for p in (baselines or [])]
    out: list[FrontierPoint] = []
    prev: Plan | None = None  # a plan that fits a lower budget fits this one too
    for b in sorted(budgets):
        if b >= hi:
            plan = Plan("dp", chain.n_layers, plan_none(chain.n_layers).items, {"budget_bytes": b})
        else:
            plan = solver.solve(b) or prev or dp.min_peak_plan(chain, b)
            if prev is not None and (simulate(chain, prev).recompute_ms
                                     < simulate(chain, plan).recompute_ms):
                plan = prev
        prev = plan
        point = _point("dp", chain, plan, budget=b)
        for peak, ms, base in fallbacks:  # rounded tables: never report worse than a baseline
            if peak <= b and ms < point.recompute_ms:
                point = replace(base, strategy="dp", budget_bytes=b, k=None, threshold_bytes=None)
        out.append(point)
    return out
