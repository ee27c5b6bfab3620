"""Each strategy's memory/time frontier (``ckplan plan --sweep``): the baselines at their
parameters' grids, ``dp`` at evenly spaced budgets, every point scored by the simulator."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any

from ..errors import UsageError
from . import limits
from . import solve as dp
from .baselines import chen_grid, cut_at_breaks, none_peak, plan_chen_threshold, plan_every_k, plan_none, plan_sqrtn
from .chain import Chain
from .plan import Plan
from .simulate import simulate
from .strategies import ALL_STRATEGIES, STRATEGIES, common_policies, plan_chain, selective_plans

__all__ = ["MAX_SWEEP_POINTS", "FrontierPoint", "check_sweep_points", "sweep"]


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


def _point(strategy: str, chain: Chain, plan: Plan, budget: int | None = None,
           k: int | None = None, threshold: int | None = None) -> FrontierPoint:
    sc = simulate(chain, plan)
    return FrontierPoint(strategy, budget, k, threshold, sc.peak_bytes, sc.recompute_ms,
                         sc.step_ms, sc.overhead, plan.n_checkpoints)


# The most budgets a dp frontier is read at: more points than a plot or a table can show (the DP
# runs once per distinct plan, but each point is a row of the sweep's CSV).
MAX_SWEEP_POINTS = 10_000


def check_sweep_points(n_points: int, *, what: str = "points") -> None:
    """Raise :class:`UsageError` for a number of frontier points outside 2..MAX_SWEEP_POINTS."""
    if isinstance(n_points, bool) or not isinstance(n_points, int) or not 2 <= n_points <= MAX_SWEEP_POINTS:
        raise UsageError(f"{what} {n_points!r} is not a number of budgets from 2 to {MAX_SWEEP_POINTS}",
                         tip=f"a chain has far fewer distinct plans than {MAX_SWEEP_POINTS} points show; the "
                             "default 20 draws the frontier")


def sweep(chain: Chain, strategies: tuple[str, ...] | list[str] = STRATEGIES,
          n_points: int = 20, **dp_options) -> tuple[FrontierPoint, ...]:
    """Each strategy's memory/time frontier.

    ``dp``: ``n_points`` budgets evenly spaced from the smallest feasible peak to the peak
    without checkpointing, all read from one DP table. ``every-k``: k = 1..16, then doubling,
    up to n. ``chen``: its threshold grid. ``sqrtn`` / ``none``: one point each.
    ``selective``: one point per policy every layer has (none on a chain without options).
    ``n_points`` is at most :data:`MAX_SWEEP_POINTS`.
    """
    check_sweep_points(n_points, what="n_points")
    n = chain.n_layers
    rows: list[FrontierPoint] = []
    for s in strategies:
        if s == "none":
            rows.append(_point(s, chain, plan_none(n)))
        elif s == "sqrtn":
            p = cut_at_breaks(plan_sqrtn(n), chain.breaks)
            rows.append(_point(s, chain, p, k=p.params["k"]))
        elif s == "every-k":
            ks = sorted({*range(1, min(n, 16) + 1), *(2 ** i for i in range(5, 30) if 2 ** i < n), n})
            rows.extend(_point(s, chain, cut_at_breaks(plan_every_k(n, kk), chain.breaks), k=kk) for kk in ks)
        elif s == "chen":
            rows.extend(_point(s, chain, plan_chen_threshold(chain, b), threshold=b)
                        for b in chen_grid(chain))
        elif s == "selective":
            if chain.has_options and common_policies(chain):
                rows.extend(_point(s, chain, p) for p in selective_plans(chain))
        elif s in ("dp", "dp-layer"):
            pass  # below, once the baselines' points are known
        else:
            raise UsageError(f"unknown strategy {s!r}", tip=f"choose one of {', '.join(ALL_STRATEGIES)}")
    if "dp" in strategies:
        baselines = list(rows) or [_point(s, chain, p) for s, p in
                                   (("every-k", plan_every_k(n, 1)),
                                    ("sqrtn", cut_at_breaks(plan_sqrtn(n), chain.breaks)))]
        rows.extend(_dp_frontier(chain, max(2, n_points), dp_options, baselines))
    if "dp-layer" in strategies and chain.has_options:
        plain = chain.without_options()
        pts = _dp_frontier(plain, max(2, n_points), dp_options,
                           [_point("every-k", plain, plan_every_k(n, 1)),
                            _point("sqrtn", plain, cut_at_breaks(plan_sqrtn(n), chain.breaks))])
        rows.extend(replace(p, strategy="dp-layer") for p in pts if p.strategy == "dp")
    return tuple(rows)


def _dp_frontier(chain: Chain, n_points: int, dp_options: dict,
                 baselines: list[FrontierPoint] | None = None) -> list[FrontierPoint]:
    """dp at ``n_points`` even budgets plus at every baseline point's own peak, so the frontier
    is evaluated exactly where it is compared; a plan that fits a lower budget (or a baseline
    plan that fits) is kept when the rounded tables find nothing better.

    The budgets are solved from the largest down: the plan found at budget ``b``, of peak ``p``,
    is the best for every budget in ``[p, b]`` too (any of them admits it, and none admits a
    better one than ``b`` does), so the DP runs once per distinct plan, not once per point."""
    n = chain.n_layers
    lo = dp.min_peak(chain)
    banded = dp.plans_banded(chain, **dp_options) and n > limits.EXACT_MAX_LAYERS
    if not chain.all_kept or banded or chain.has_holds:
        # the tables plan on a bound of this chain, or the banded DP (one budget at a time)
        # beats the grouped tables, or held layers (held.py): plan_dp per budget
        hi = none_peak(chain)

        def solve_one(b: int) -> Plan | None:
            return plan_chain(chain, "dp", b, **dp_options).plan
        solve: Callable[[int], Plan | None] = solve_one
    else:
        solver = dp.DPSolver(chain, max_slots=dp_options.get("max_slots"),
                             mode=dp_options.get("mode", "auto"), groups=dp_options.get("groups"))
        hi = solver.none_peak
        solve = solver.solve
    budgets = {lo + (hi - lo) * t // (n_points - 1) for t in range(n_points)}
    budgets |= {p.peak_bytes for p in (baselines or []) if lo <= p.peak_bytes <= hi}
    order = sorted(budgets)
    points: dict[int, FrontierPoint] = {}  # id(plan) -> its point, each plan simulated once

    def point_of(plan: Plan) -> FrontierPoint:
        if id(plan) not in points:
            points[id(plan)] = _point("dp", chain, plan)
        return points[id(plan)]

    none = Plan("dp", n, plan_none(n).items)
    found: dict[int, Plan | None] = {}
    cur: Plan | None = None
    for b in reversed(order):
        if b >= hi:
            cur = none
        elif cur is None or point_of(cur).peak_bytes > b:
            cur = solve(b)  # None: the rounded tables found nothing this low
        found[b] = cur
    fallbacks = [(p.peak_bytes, p.recompute_ms, p) for p in (baselines or [])]
    out: list[FrontierPoint] = []
    prev: Plan | None = None  # a plan that fits a lower budget fits this one too
    for b in order:
        plan = found[b] or prev or dp.near_min_plan(chain, b)[0]
        if prev is not None and point_of(prev).recompute_ms < point_of(plan).recompute_ms:
            plan = prev
        prev = plan
        point = replace(point_of(plan), budget_bytes=b)
        for peak, ms, base in fallbacks:  # rounded tables: never report worse than a baseline
            if peak <= b and ms < point.recompute_ms:
                point = replace(base, strategy="dp", budget_bytes=b, k=None, threshold_bytes=None)
        out.append(point)
    return out
