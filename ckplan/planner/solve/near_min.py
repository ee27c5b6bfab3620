"""Plans just above the smallest peak of a long chain, where the grouped tables find none."""
from __future__ import annotations

from ...errors import PlannerBugError
from .. import limits
from ..chain import Chain
from ..groups import cheap_cuts, make_units
from ..plan import Plan, items_from_ranges
from ..simulate import simulate
from ..tables import (
    PairCosts,
    ParetoTable,
    PeakTable,
    base_bytes,
)
from .improve import improve
from .lowest import min_peak_kept, min_peak_plan_kept
from .solver import DPSolver


def near_min_plan(chain: Chain, budget_bytes: int) -> tuple[Plan, str]:
    """A plan for a budget at or just above the smallest peak on a long chain, where the
    grouped tables find none. Candidates: the smallest-peak plan spending the slack on storing,
    improved locally (``improve`` below); and, when ``U^2 x NEAR_MIN_MIN_SLOTS`` cells fit in
    ``NEAR_MIN_CELLS``, the nested DP on single layers with slots spread over this budget
    only (fine where it matters, read in exact bytes so the plan fits); else, when at most
    ``NEAR_MIN_UNITS`` units, the exact DP on groups cut at the smallest-peak plan's boundaries
    (reachable by construction) and at ``NEAR_MIN_GROUPS`` cheap ones. The cheapest; it fits
    (checked by the simulator), and is near-optimal, not optimal. Also returns how it was
    found, for the notes.

    With selective options: the better of the smallest-peak plan with options (slack spent
    greedily) and, when the budget is reachable without options, this search without them."""
    if chain.has_options:
        best = min_peak_plan_kept(chain, budget_bytes)
        how = "returned the smallest-peak plan with selective options"
        plain = chain.without_options()
        if budget_bytes >= min_peak_kept(plain):
            alt, alt_how = near_min_plan(plain, budget_bytes)
            if simulate(chain, alt).recompute_ms < simulate(chain, best).recompute_ms:
                best, how = alt, alt_how + " (without selective options)"
        return best, how
    n = chain.n_layers
    start = min_peak_plan_kept(chain, budget_bytes)
    ranges = [(r.start, r.stop) for r in start.recomputed_ranges()]
    better = improve(chain, ranges, budget_bytes, max_sims=max(20, min(limits.NEAR_MIN_SIMS, 50_000 // n)))
    best = Plan("dp", n, items_from_ranges(n, better), {"budget_bytes": budget_bytes})
    cost = simulate(chain, best).recompute_ms
    how = "returned the smallest-peak plan, improved locally"
    cands: list[tuple[Plan, str]] = []
    U = n + 1
    slots = min(limits.NEAR_MIN_SLOTS, limits.NEAR_MIN_CELLS // (U * U))
    ends = {e for r in ranges for e in r}
    cuts = sorted((set(cheap_cuts(chain, limits.NEAR_MIN_GROUPS)) | ends) - {n})
    if slots >= limits.NEAR_MIN_MIN_SLOTS:
        solver = DPSolver(chain, mode="exact", pareto=False, max_slots=slots, top_bytes=budget_bytes)
        plan = solver.solve(budget_bytes)
        if plan is not None:
            cands.append((plan, f"planned on single layers in {slots} slots up to the budget "
                                "(near-optimal)"))
    elif len(cuts) + 1 <= limits.NEAR_MIN_UNITS:
        u = make_units(chain, cuts)
        pc = PairCosts(u)
        avail = budget_bytes - base_bytes(chain)
        pt = ParetoTable(u, pc, PeakTable(u, pc).R, avail, None, cost)
        if pt.cost(avail) < cost:
            cands.append((Plan("dp", n, items_from_ranges(n, pt.ranges(avail)),
                               {"budget_bytes": budget_bytes}),
                          f"planned exactly on {u.size - 1} groups cut at the smallest-peak plan's "
                          "boundaries (near-optimal)"))
    for plan, text in cands:
        sc = simulate(chain, plan)
        if sc.peak_bytes > budget_bytes:
            raise PlannerBugError(f"dp (near the smallest peak) plan peaks at {sc.peak_bytes} > "
                                  f"budget {budget_bytes}")
        if sc.recompute_ms < cost:
            best, cost, how = plan, sc.recompute_ms, text
    return best, how
