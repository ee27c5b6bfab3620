"""Frontier arithmetic of the exact DP: splits, lower envelopes, and how far each sub-chain is reached."""
from __future__ import annotations

import numpy as np

from ..groups import Units
from .common import Spans
from .pairs import PairCosts
from .peaks import band, nest_starts

STORE = -1


Frontier = tuple[np.ndarray, np.ndarray, np.ndarray]  # (bytes, recompute ms, choice)


_EMPTY: Frontier = (np.zeros(0, dtype=np.int64), np.zeros(0), np.zeros(0, dtype=np.int64))


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
    return mem, ac[ia] + bc[ib] + (pc.ckpt_end_ms[tj] - P[s]), tj


def _envelope(mem: np.ndarray, cost: np.ndarray, choice: np.ndarray, cap: int,
              ub: float) -> Frontier:
    """Lower envelope of step functions given by all their breakpoints, up to ``cap`` bytes and
    ``ub`` ms: sort by memory, keep each point strictly cheaper than every point before it (of
    points with equal bytes, the cheapest)."""
    low = (mem <= cap) & (cost <= ub)
    mem, cost, choice = mem[low], cost[low], choice[low]
    if not len(mem):
        return mem, cost, choice
    # equal bytes: the earlier option first (store options by column, then checkpoints by j)
    order = np.lexsort((np.where(choice < 0, -choice - 2**40, choice), mem))
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
    """``cap`` of :func:`reach`."""
    return reach(u, pc, R, top, ub)[0]


def reach(u: Units, pc: PairCosts, R: np.ndarray, top: int,
          ub: float = np.inf, max_len: int | None = None,
          top_len: int | None = None, nest: Spans = ()) -> tuple[np.ndarray, np.ndarray]:
    """``cap[s, e]``: the most bytes a plan of the whole chain with ``top`` bytes (and at most
    ``ub`` ms of recompute) can give the sub-chain [s, e) (below ``R[s, e]`` when none can), and
    ``kcap[s, e]``: the most recompute such a plan can spend inside [s, e) (negative when none
    reaches it). Top-down by decreasing length: a sub-chain passes its cap minus what an option
    keeps, and its recompute cap minus what the option recomputes outside the sub-chain (a
    checkpoint's forward, an option's own recompute; the sibling's is at least 0), to that
    option's sub-chains, for each option (``Store(s)`` with each selective option included)
    whose least need fits its cap and whose own recompute its recompute cap. Checkpoints span
    at most ``max_len`` units, except top-level ones of up to ``top_len`` units that store every
    unit inside (``band``), or have an inner plan of the band where ``nest`` allows it
    (``nest_starts``)."""
    U = u.size
    L, LT = band(U, max_len, top_len)
    nlo = nest_starts(U, L, LT, nest)
    sa = pc.store_all if LT > L else None  # long top-level checkpoints store every unit inside
    xo = u.x_out
    n_opt = u.n_options
    P, Q = pc.fwd_prefix_ms, pc.ckpt_end_ms
    cap = np.full((U + 1, U + 1), -1, dtype=np.int64)
    kcap = np.full((U + 1, U + 1), -np.inf)
    cap[0, U], kcap[0, U] = top, ub
    for n in range(U, 1, -1):
        for s in range(0, U - n + 1):
            e = s + n
            c, k = cap[s, e], kcap[s, e]
            if c < R[s, e] or k < 0:
                continue
            for o in range(n_opt):
                h, ms = u.opt_hold[s, o], u.opt_ms[s, o]
                if (o == 0 or ms <= k) and max(pc.opt_store_req[o, s, e], h + R[s + 1, e]) <= c:
                    cap[s + 1, e] = max(cap[s + 1, e], c - h)
                    kcap[s + 1, e] = max(kcap[s + 1, e], k - ms if o else k)
            if e == U and sa is not None:  # long top-level checkpoints: no inner sub-chain
                jl = np.arange(s + L + 1, min(e, s + LT + 1))
                okl = (np.maximum(np.maximum(pc.fnone[s, jl], xo[jl - 1] + R[jl, e]),
                                  pc.inner_extra[jl, e] + sa[s, jl]) <= c)
                okl &= Q[jl] - P[s] <= k
                jl = jl[okl]
                cap[jl, e] = np.maximum(cap[jl, e], c - xo[jl - 1])
                kcap[jl, e] = np.maximum(kcap[jl, e], k - (Q[jl] - P[s]))
            js = np.arange(s + 1, min(e, s + (L if e < U else max(L, LT)) + 1))
            js = js[nlo[js] <= s]
            ok = (np.maximum(np.maximum(pc.fnone[s, js], xo[js - 1] + R[js, e]),
                             pc.inner_extra[js, e] + R[s, js]) <= c)
            ok &= Q[js] - P[s] <= k
            js = js[ok]
            if len(js):
                cap[js, e] = np.maximum(cap[js, e], c - xo[js - 1])
                cap[s, js] = np.maximum(cap[s, js], c - pc.inner_extra[js, e])
                kd = k - (Q[js] - P[s])
                kcap[js, e] = np.maximum(kcap[js, e], kd)
                kcap[s, js] = np.maximum(kcap[s, js], kd)
    return cap, kcap
