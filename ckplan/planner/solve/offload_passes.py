"""The passes after the offload DP (``offload.py``): copies back started earlier where that
fits and saves time (fetch points), and offloaded layers stored again where that costs nothing.
Both score plans with the simulator, fetch and release points included."""
from __future__ import annotations

from .. import limits
from ..chain import Chain
from ..plan import FETCH, Plan
from ..plan_items import is_offloaded, kept_option
from ..simulate import simulate_items, with_releases
from ..transfers import EPS_MS


def fewer_offloads(chain: Chain, plan: Plan, budget_bytes: int) -> Plan:
    """``plan`` with each offloaded layer stored instead, last layer first, wherever that still fits
    and costs no more time: among plans of equal time, fewer copies and less host memory. Scored
    with the release points the replay chooses, which the plan returned carries."""
    sc = simulate_items(chain, plan.items, fetches=plan.fetches())
    options = list(plan.options())
    for i in reversed(range(chain.n_layers)):
        was = options[i]
        if not is_offloaded(was):
            continue
        options[i] = kept_option(was)
        trial = plan.with_options(options)
        t = simulate_items(chain, trial.items, fetches=trial.fetches())
        if t.peak_bytes <= budget_bytes and t.step_ms <= sc.step_ms:
            plan, sc = trial, t
        else:
            options[i] = was
    later = {i: f for i, f in plan.fetches().items() if f > i + 1}  # the layers still offloaded
    params = {k: v for k, v in plan.params.items() if k != FETCH} | ({FETCH: later} if later else {})
    return with_releases(chain, Plan(plan.strategy, plan.n_layers, plan.items, params))


def earlier_fetches(chain: Chain, plan: Plan, budget_bytes: int) -> Plan:
    """``plan`` with copies back started earlier, at the backward of a later layer than the next
    (fetch points, ``params.offload_fetch``), wherever that still fits and saves time: the layers
    needed first tried first, each up to ``limits.OFFLOAD_LOOKAHEAD`` layers further up."""
    releases, fetches = plan.releases(), plan.fetches()
    best = simulate_items(chain, plan.items, releases, fetches)
    trials = 0
    for i in sorted(fetches, reverse=True):
        for k in range(fetches[i] + 1, min(fetches[i] + limits.OFFLOAD_LOOKAHEAD, chain.n_layers - 1) + 1):
            if best.transfer_ms <= 0 or trials >= limits.OFFLOAD_FETCH_TRIALS:
                break
            trial = {**fetches, i: k}
            t = simulate_items(chain, plan.items, releases, trial)
            trials += 1
            if t.peak_bytes <= budget_bytes and t.step_ms < best.step_ms - EPS_MS:
                fetches, best = trial, t
    if fetches == plan.fetches():
        return plan
    return Plan(plan.strategy, plan.n_layers, plan.items, {**plan.params, FETCH: dict(sorted(fetches.items()))})
