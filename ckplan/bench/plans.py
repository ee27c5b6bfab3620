"""The rows to bench: each strategy planned on the profile's chain, the given plans, and the budget
dp and chen plan for when none is given."""
from __future__ import annotations

from ..bench_records import ERROR, INFEASIBLE
from ..errors import InfeasibleBudgetError, SpecError
from ..peers import COMPILE_PEERS, PEER_NAMES
from ..planner import Plan, default_budget, held_for_backward_bytes, no_gain_reason, plan_chain, simulate, with_releases
from ..planner.plan import RELEASE
from ..planner.simulate import forward_backward_peak
from .entry import Entry
from .peer_rows import peer_entry


def bench_budget(chain, strategies: list[str], budget_bytes: int | None, notes: list[str]) -> int | None:
    """dp and chen need a budget; without one, the planner's bench rule (halfway between the
    smallest feasible and the no-checkpoint peak: always feasible, and a real trade-off)."""
    if budget_bytes is not None or not {"dp", "chen", "torch-compile"} & set(strategies):
        return budget_bytes
    reason = no_gain_reason(chain)
    b = default_budget(chain, mode="bench", free_device_bytes=None)
    assert b is not None  # the bench rule always gives a budget
    notes.append(reason if reason else f"no --budget: dp and chen planned for {b.description}")
    return b.bytes


def peer_row(chain, name: str) -> Entry | None:
    """The row of peer ``name`` (a torch-compile peer gets its compiled copy later), None for
    ckplan's own strategies."""
    if name in COMPILE_PEERS:
        return Entry(name, None, kind="peer")
    if name in PEER_NAMES:
        return peer_entry(chain, name)
    return None


def plan_entries(chain, strategies: list[str], budget_bytes: int | None, k: int,
                  extra_plans: dict[str, Plan], extra_chain=None) -> list[Entry]:
    """Each strategy planned on the profile's chain (or marked infeasible), then the given plans,
    scored on ``extra_chain`` (the chain with their options kept; default ``chain``)."""
    entries: list[Entry] = []
    for s in strategies:
        peer = peer_row(chain, s)
        if peer is not None:
            entries.append(peer)
            continue
        try:
            res = plan_chain(chain, s, budget_bytes, k)
        except InfeasibleBudgetError as err:
            entries.append(Entry(s, None, status=INFEASIBLE, message=err.message))
            continue
        except SpecError as err:  # selective without an option every layer keeps: the other rows go on
            if s != "selective":
                raise
            entries.append(Entry(s, None, status=ERROR, message=f"{err.message} ({err.tip})"))
            continue
        entries.append(Entry(s, res.plan, res.score.peak_bytes, forward_backward_peak(chain, res.plan),
                              held_for_backward_bytes(chain, res.plan), res.score.overhead))
    scoring = chain if extra_chain is None else extra_chain
    for name, plan in extra_plans.items():
        if RELEASE not in plan.params:  # its offloaded layers released where the profile's copies are done
            plan = with_releases(scoring, plan)
        sc = simulate(scoring, plan)
        entries.append(Entry(name, plan, sc.peak_bytes, forward_backward_peak(scoring, plan),
                              held_for_backward_bytes(scoring, plan), sc.overhead))
    return entries
