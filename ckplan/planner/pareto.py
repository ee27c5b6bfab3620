"""The exact DP in bytes: rotor's recursion (``dp.py``) with a Pareto frontier per sub-chain.

``C(s, e, m)``, the least recompute of units ``[s, e)`` with ``m`` bytes available, is a
non-increasing step function of ``m``. Instead of sampling it on slots, each sub-chain keeps its
breakpoints exactly: sorted ``(mem[k], cost[k])`` with ``mem`` increasing and ``cost`` strictly
decreasing, ``C(s, e, m) = cost[k]`` for the last ``mem[k] <= m`` (infeasible below ``mem[0]``,
which is the min-peak table's ``R(s, e)``). The options of the recursion are shifts and sums of
such functions, and their minimum is a running minimum over the union of their breakpoints,
so every table entry is exact and the DP is optimal at *every* budget by construction, whatever
the sizes (no slots, no rounding).

Each breakpoint remembers the option that made it (``Store(s)`` or the checkpoint ``[s, j)``), so
a plan is read top-down in exact bytes: at ``m`` the breakpoint ``k`` gives the option, whose
sub-chains are read at what is left; each gets at least what it had at ``mem[k]``, so the plan
costs at most ``cost[k]`` (hence exactly) and fits (each option's needs were checked at
``mem[k] <= m``).

Cost: O(U^2) frontier merges, each over the breakpoints of its ``e - s - 1`` splits (numpy, all
splits at once). Frontiers stay short on real chains (tens to a few hundred breakpoints), which
``max_points`` bounds: a solve that would exceed it stops and returns None, and the caller falls
back to the slot tables (``dp.py``). ``keep_above`` drops breakpoints that no budget of interest
needs: a sub-chain never gets more than the top budget plus the largest amount an inner plan
starts with above its parent, so points above that (bar the first) are cut.

Names as in ``tables.py``'s legend (``store_req``, ``inner_extra``, ``fnone``, ``hold``, ``x_out``,
``fwd_prefix_ms``).
"""
from __future__ import annotations

import numpy as np

from .groups import Units
from .tables import PairCosts, Step, reconstruct

STORE = -1
Frontier = tuple[np.ndarray, np.ndarray, np.ndarray]  # (bytes, recompute ms, choice)
_EMPTY: Frontier = (np.zeros(0, dtype=np.int64), np.zeros(0), np.zeros(0, dtype=np.int64))


class ParetoTable:
    """Exact frontiers ``F[(s, e)] = (mem, cost, choice)`` of the sub-chains a plan of the whole
    chain with at most ``top_bytes`` available can reach; ``choice`` is ``-1`` for ``Store(s)``
    or ``j`` for the checkpoint ``[s, j)``. ``R`` is the min-peak table (``PeakTable.R``).

    ``top_bytes`` bounds the work: ``cap[s, e]`` (:func:`reach_caps`), the most bytes [s, e)
    can be given, cuts every frontier above it, and sub-chains no plan reaches (their least
    need is above their cap) are skipped. Near the smallest peak most sub-chains are then
    unreachable or have a few breakpoints. One table answers every budget up to ``top_bytes``.

    ``ok`` is False when some frontier exceeded ``max_points`` (the table is then unusable)."""

    def __init__(self, u: Units, pc: PairCosts, R: np.ndarray, top_bytes: int,
                 max_points: int | None = None, max_cost: float | None = None):
        self.u, self.pc, self.top = u, pc, int(top_bytes)
        U = u.size
        P = pc.fwd_prefix_ms
        hold, xo = u.hold, u.x_out
        # A plan's parts cost no more than the plan: with an upper bound on the optimum (a
        # plan that fits), dearer breakpoints and checkpoints are never part of an optimal plan.
        ub = np.inf if max_cost is None else float(max_cost) * (1 + 1e-9) + 1e-9
        self.max_cost = ub
        cap = reach_caps(u, pc, R, self.top, ub)
        self.ok = True
        self.n_points = 0
        F: dict[tuple[int, int], Frontier] = {}
        shifted: dict[tuple[int, int], Frontier] = {}  # F[j, e] as the rest of [., j): + x[j-1]
        i64 = np.int64
        for e in range(1, U + 1):
            for s in range(e - 1, -1, -1):
                c_se = int(cap[s, e])
                if c_se < R[s, e]:
                    continue  # no plan within top_bytes reaches [s, e)
                sr = int(pc.store_req[s, e])
                mems, costs, chs = [], [], []
                if s + 1 == e:
                    mems.append(np.array([sr], dtype=i64))
                    costs.append(np.zeros(1))
                    chs.append(np.full(1, STORE, dtype=i64))
                elif max(sr, int(hold[s]) + int(R[s + 1, e])) <= c_se:
                    rm, rc, _ = F[(s + 1, e)]
                    mems.append(np.maximum(rm + int(hold[s]), sr))
                    costs.append(rc)
                    chs.append(np.full(len(rm), STORE, dtype=i64))
                if e - s >= 2:
                    js = np.arange(s + 1, e)
                    need = np.maximum(np.maximum(pc.fnone[s, js], xo[js - 1] + R[js, e]),
                                      pc.inner_extra[js, e] + R[s, js])
                    js = js[(need <= c_se) & (P[js] - P[s] <= ub)]
                    if len(js):
                        seg = _splits(s, e, js, shifted, F, pc, P, c_se)
                        mems.append(seg[0])
                        costs.append(seg[1])
                        chs.append(seg[2])
                f = _envelope(np.concatenate(mems), np.concatenate(costs), np.concatenate(chs),
                              c_se, ub)
                F[(s, e)] = f
                k = len(f[0])
                self.n_points = max(self.n_points, k)
                if max_points is not None and k > max_points:
                    self.ok = False
                    self.F = F
                    return
                if s >= 1:
                    shifted[(s, e)] = (f[0] + int(xo[s - 1]), f[1], np.full(k, s, dtype=i64))
        self.F = F


    def cost(self, avail: int) -> float:
        """Least recompute of the whole chain with ``avail`` bytes (inf when infeasible)."""
        if avail > self.top:
            raise ValueError(f"the table answers up to {self.top} bytes, not {avail}")
        m, c, _ = self.F.get((0, self.u.size), _EMPTY)
        k = int(np.searchsorted(m, avail, side="right")) - 1
        return float(c[k]) if k >= 0 else float("inf")

    def frontier(self) -> tuple[np.ndarray, np.ndarray]:
        """The whole chain's breakpoints: (bytes above the start, least recompute)."""
        m, c, _ = self.F.get((0, self.u.size), _EMPTY)
        return m, c

    def _choose(self, s: int, e: int, mb: int) -> Step:
        m, _, ch = self.F.get((s, e), _EMPTY)
        k = int(np.searchsorted(m, mb, side="right")) - 1
        if k < 0:
            raise RuntimeError(f"Pareto DP reconstruction: no plan of [{s}, {e}) fits {mb} bytes")
        j = int(ch[k])
        if j == STORE:
            return None, mb - int(self.u.hold[s]), None
        return j, mb - int(self.u.x_out[j - 1]), mb - int(self.pc.inner_extra[j, e])

    def ranges(self, avail: int) -> list[tuple[int, int]]:
        """Checkpointed layer ranges of the optimal plan with ``avail`` bytes above the start."""
        if avail > self.top:
            raise ValueError(f"the table answers up to {self.top} bytes, not {avail}")
        return reconstruct(self.u.bounds, self.u.size, avail, self._choose)


def _splits(s: int, e: int, js: np.ndarray, shifted: dict[tuple[int, int], Frontier],
            F: dict[tuple[int, int], Frontier], pc: PairCosts, P: np.ndarray,
            cap: int) -> Frontier:
    """Breakpoints of the checkpoint options ``[s, j)`` of ``[s, e)`` for every ``j`` in ``js``
    at once: for each j the sum of the rest's and the inner plan's step functions, at the union
    of their breakpoints. Segments are keyed ``(j - s) * K + bytes`` so one searchsorted
    serves every j."""
    rest = [shifted[(int(j), e)] for j in js]
    am = np.concatenate([r[0] for r in rest])
    ac = np.concatenate([r[1] for r in rest])
    aj = np.concatenate([r[2] for r in rest])
    inner = [F[(s, int(j))] for j in js]
    bj = np.repeat(js, [len(f[0]) for f in inner])
    bm = np.concatenate([f[0] for f in inner]) + pc.inner_extra[bj, e]
    bc = np.concatenate([f[1] for f in inner])
    ka, kb = am <= cap, bm <= cap  # breakpoints above the cap only make points above it
    am, ac, aj, bm, bc, bj = am[ka], ac[ka], aj[ka], bm[kb], bc[kb], bj[kb]
    if not len(am) or not len(bm):
        return am[:0], ac[:0], aj[:0]
    lo = min(int(am.min()), int(bm.min()))
    K = max(int(am.max()), int(bm.max())) - lo + 1
    ak = (aj - s) * K + (am - lo)  # sorted: j ascending, bytes ascending within each j
    bk = (bj - s) * K + (bm - lo)
    tk = np.concatenate([ak, bk])
    tj = np.concatenate([aj, bj])
    ia = np.searchsorted(ak, tk, side="right") - 1
    ib = np.searchsorted(bk, tk, side="right") - 1
    ok = (ia >= 0) & (ib >= 0)
    ok[ok] &= (aj[ia[ok]] == tj[ok]) & (bj[ib[ok]] == tj[ok])
    tk, tj, ia, ib = tk[ok], tj[ok], ia[ok], ib[ok]
    mem = np.maximum(tk - (tj - s) * K + lo, pc.fnone[s, tj])
    return mem, ac[ia] + bc[ib] + (P[tj] - P[s]), tj


def _envelope(mem: np.ndarray, cost: np.ndarray, choice: np.ndarray, cap: int,
              ub: float) -> Frontier:
    """Lower envelope of step functions given by all their breakpoints, up to ``cap`` bytes and
    ``ub`` ms: sort by memory, keep each point strictly cheaper than every point before it (of
    points with equal bytes, the cheapest)."""
    low = (mem <= cap) & (cost <= ub)
    mem, cost, choice = mem[low], cost[low], choice[low]
    if not len(mem):
        return mem, cost, choice
    order = np.argsort(mem, kind="stable")
    mem, cost, choice = mem[order], cost[order], choice[order]
    run = np.minimum.accumulate(cost)
    keep = np.empty(len(cost), dtype=bool)
    keep[0] = True
    keep[1:] = cost[1:] < run[:-1]
    mem, cost, choice = mem[keep], cost[keep], choice[keep]
    last = np.empty(len(mem), dtype=bool)  # equal bytes: the later kept point is cheaper
    last[-1] = True
    last[:-1] = mem[1:] != mem[:-1]
    return mem[last], cost[last], choice[last]


def reach_caps(u: Units, pc: PairCosts, R: np.ndarray, top: int,
               ub: float = np.inf) -> np.ndarray:
    """``cap[s, e]``: the most bytes a plan of the whole chain with ``top`` bytes can give the
    sub-chain [s, e) (below ``R[s, e]`` when none can). Top-down by decreasing length: a
    sub-chain passes its cap minus what an option keeps to that option's sub-chains, for each
    option whose least need fits its cap (checkpoints recomputing more than ``ub`` ms never
    do)."""
    U = u.size
    hold, xo = u.hold, u.x_out
    cap = np.full((U + 1, U + 1), -1, dtype=np.int64)
    cap[0, U] = top
    for n in range(U, 1, -1):
        for s in range(0, U - n + 1):
            e = s + n
            c = cap[s, e]
            if c < R[s, e]:
                continue
            if max(pc.store_req[s, e], hold[s] + R[s + 1, e]) <= c:
                cap[s + 1, e] = max(cap[s + 1, e], c - hold[s])
            js = np.arange(s + 1, e)
            ok = (np.maximum(np.maximum(pc.fnone[s, js], xo[js - 1] + R[js, e]),
                             pc.inner_extra[js, e] + R[s, js]) <= c)
            ok &= pc.fwd_prefix_ms[js] - pc.fwd_prefix_ms[s] <= ub
            js = js[ok]
            if len(js):
                cap[js, e] = np.maximum(cap[js, e], c - xo[js - 1])
                cap[s, js] = np.maximum(cap[s, js], c - pc.inner_extra[js, e])
    return cap
