"""A fast bound for the banded DP on long chains: the band's plan on sizes rounded coarsely."""
from __future__ import annotations

import math
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

import numpy as np

from .. import limits
from ..chain import Chain
from ..plan import Plan
from ..simulate import simulate
from ..tables import (
    INF,
    PairCosts,
    ParetoTable,
    PeakTable,
    base_bytes,
    jitted,
)
from .band import Prebuilt
from .common import (
    layer_tables,
    plan_from,
)


@dataclass(frozen=True)
class Coarse:
    """``_coarse_plan``'s answer: a plan that fits, and the rounded table's least recompute at
    the budget itself (an estimate of the optimum, not a bound: ``banded_plan``'s
    ``trim_scale``)."""

    plan: Plan
    recompute_ms: float  # the plan's, simulated
    estimate_ms: float


def _coarse_plan(chain: Chain, budget_bytes: int, band: int = limits.COARSE_BAND,
                 slots: int = limits.COARSE_SLOTS, top: int = limits.COARSE_TOP) -> Coarse | None:
    """A plan that fits ``budget_bytes``, near the banded DP's, fast: the banded DP (band
    ``band``, long top-level checkpoints of up to ``top`` layers) on the chain with every size
    in units of ``avail / slots`` bytes, rounded stochastically (frontiers of at most ``slots``
    points). Rounded sizes do not add up to the exact ones, so the plan read at the budget may
    not fit: the same table is read again lower by the overshoot the simulator found (plus 1,
    2, 4, ... units, at most ``COARSE_READS`` reads) until a plan fits; None when none does.
    Not optimal: a bound (``banded_plan``'s ``bound``) and, with the table's least recompute
    at the budget itself, a scale for absolute thinning (``_scale``).

    Rounding every size up instead always fits but loses ``layers x unit / 2`` bytes: at 1000
    layers half-way up the range its plan recomputed 28% more than the optimum, against 1.5-7%
    this way (0-4% at 10%, 4-40% at 90%: random, MLP-like and block chains, two seeds each); band
    4 and ``top`` 64 build the table in 60% of band 16's time for a bound as good."""
    t = layer_tables(chain)
    u = t.units
    avail = budget_bytes - base_bytes(chain)
    q = max(1, avail // slots)
    rng = np.random.default_rng(0)

    def near(a):
        # stochastic rounding (seeded: plans reproducible): rounding errors of like-sized
        # layers cancel instead of adding up (nearest rounding of 1000 equal layers is off by
        # the same amount 1000 times)
        if a is None:
            return None
        a = np.asarray(a, dtype=np.int64)
        lo, rest = a // q, a % q
        return lo + (rng.random(a.shape) * q < rest)
    ru = replace(u, hold=near(u.hold), fwd_req=near(u.fwd_req), bwd_req=near(u.bwd_req),
                 x_out=near(u.x_out), fn_first=near(u.fn_first), fn_next=near(u.fn_next),
                 grad=near(u.grad), opt_hold=near(u.opt_hold), opt_fwd_req=near(u.opt_fwd_req),
                 opt_bwd_req=near(u.opt_bwd_req), bwd_extra=int(near(u.bwd_extra)),
                 fwd_req_stop=near(u.fwd_req_stop), lead=near(u.lead))
    rpc = PairCosts(ru)
    n, a = chain.n_layers, avail // q
    band, top = min(band, n), min(max(top, band), n)
    peaks = PeakTable(ru, rpc, band, top)
    if int(peaks.R[0, ru.size]) > a:
        return None
    pt = ParetoTable(ru, rpc, peaks.R, a, limits.BAND_MAX_POINTS, None, max_len=band, top_len=top)
    if not pt.ok:
        return None
    at, extra = a, 1
    for _ in range(limits.COARSE_READS):
        if pt.cost(at) == INF:
            return None
        plan = plan_from(chain, u, *pt.parts(at), {"budget_bytes": budget_bytes})
        sc = simulate(chain, plan)
        over = sc.peak_bytes - budget_bytes
        if over <= 0:
            return Coarse(plan, sc.recompute_ms, float(pt.cost(a)))
        # the next read lower by this plan's overshoot (plans near it err alike), and then some
        at, extra = at - (over + q - 1) // q - extra, 2 * extra
    return None


def _coarse_beside_inner(chain: Chain, budget_bytes: int,
                         top: int | None) -> tuple[Coarse | None, Prebuilt | None]:
    """``_coarse_plan``, and meanwhile (a second thread, when there is a second CPU and the
    compiled kernels, which release the GIL) the first band's inner frontiers of the exact
    banded table, which need no bound: 1000 layers, ~0.2 s of the ~0.3 s the coarse plan takes.
    Without them: the coarse plan alone (the banded DP then builds its table whole)."""
    t = layer_tables(chain)
    u, pc = t.units, t.pairs
    n = chain.n_layers
    L = min(limits.BAND_START, n)
    LT = max(L, n if top is None else min(top, n))
    if (os.cpu_count() or 1) < 2 or n <= L or jitted("_pareto_kernel", u.size) is None:
        return _coarse_plan(chain, budget_bytes), None
    if LT > L:
        _ = pc.store_all  # a cached property: filled here, not raced for by the two threads
    avail = budget_bytes - base_bytes(chain)

    def inner() -> Prebuilt:
        peaks = PeakTable(u, pc, L, LT)
        return Prebuilt(L, LT, peaks, ParetoTable.inner_part(u, pc, peaks.R, avail, limits.BAND_MAX_POINTS,
                                                         max_len=L, top_len=LT,
                                                         max_total=limits.BAND_MAX_TOTAL))
    with ThreadPoolExecutor(max_workers=1) as pool:
        fut = pool.submit(inner)
        coarse = _coarse_plan(chain, budget_bytes)
        return coarse, fut.result()


def _scale(coarse: Coarse | None) -> float | None:
    """An estimate of the optimum for absolute thinning: the geometric mean of the coarse plan's
    recompute (above the optimum: 1-40% at 1000 layers, most at high budgets) and the rounded
    table's estimate (below it by about as much); measured within 15% of the answer."""
    if coarse is None or coarse.estimate_ms <= 0:
        return None
    return math.sqrt(coarse.recompute_ms * coarse.estimate_ms)
