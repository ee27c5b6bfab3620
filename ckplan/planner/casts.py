"""Mixed precision: exact feasibility and smallest peak when layers have autocast copies.

Autocast keeps a low-precision copy of each weight until the forward ends (``Layer.cast_bytes``).
A stored layer saves most of them for backward (they are in ``xbar``): the layers inside a
*top-level* checkpoint add all their copies, a stored layer and pre only those no op saves
(``unsaved_cast_bytes``), and only during the forward (``simulate.py``). The DP's sub-problems have
one budget for a sequence's forward and backward alike, so they cannot carry that; this module
handles the top-level sequence on its own, with two budgets.

For every suffix ``[s, U)`` of the top-level sequence (single-layer units, the post last) it keeps
the Pareto frontier of ``(F, B)`` over the suffix's plans: ``F`` the bytes its forward ops need
above the memory at ``s`` (before the copies made earlier are added), ``B`` what its backward ops
and recomputes need. The recursion mirrors ``solve/``'s (``Store(s)`` adds ``hold[s]`` to both;
``Checkpoint[s, j)`` adds ``x[j-1]`` to both and the copies of ``s..j-1`` to ``F`` only; its inner
plan runs during backward, so it needs ``inner_extra[j, U] + R(s, j)`` from the exact min-peak
table); ``Store(s)`` adds its unsaved copies to ``F`` too, and pre's count against the forward of
the whole sequence. A budget is feasible iff a point of the frontier of ``[0, U)`` fits: exact, checked
against brute force over every plan. Frontiers keep only points under the no-checkpoint span.

``ranges`` reads the least-recompute plan that fits any feasible budget: a forward DP over the
top-level sequence whose states are the prefixes' (held bytes, copies, recompute), each step
taken only when the rest can still fit (frontier lookups); inner plans and their recompute come
from the cast-free tables (exact with gcd-sized slots, estimates otherwise). So the plan always
fits, and with exact tables it is the optimum (checked against brute force).
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ..errors import PlannerArgumentError, PlannerBugError
from . import limits
from .chain import Chain
from .groups import Units
from .tables import PairCosts, PeakTable, base_bytes, exact_chooser, fixed_peak, reconstruct

Estimate = Callable[[int, int, int, float], float]


def _pareto(fwd: np.ndarray, bwd: np.ndarray, cap: int) -> tuple[np.ndarray, np.ndarray]:
    """The points not dominated in (fwd, bwd), both at most ``cap``; fwd ascending, bwd
    descending."""
    keep = (fwd <= cap) & (bwd <= cap)
    fwd, bwd = fwd[keep], bwd[keep]
    order = np.lexsort((bwd, fwd))
    fwd, bwd = fwd[order], bwd[order]
    if len(fwd) == 0:
        return fwd, bwd
    best_before = np.concatenate([[np.iinfo(np.int64).max], np.minimum.accumulate(bwd)[:-1]])
    keep = bwd < best_before
    return fwd[keep], bwd[keep]


def top_level_needs(chain: Chain, u: Units, pc: PairCosts) -> tuple[np.ndarray, list[list[int]], np.ndarray]:
    """What top-level items need above the memory at their start, on single-layer units:
    ``bwd_store[s]``, the backward of ``Store(s)`` once the rest has run (solve's ``store_req``,
    second term), which is also what ``B(s)`` needs at the end of a top-level checkpoint
    starting at ``s``; ``fwd_none[s][j - s - 1]``, the peak of the no-saving forward of
    ``[s, j)`` with its layers' autocast copies; ``cum``, the copies' prefix sums."""
    U = u.size
    L = chain.layers
    cum = np.concatenate([[0], np.cumsum([ly.cast_bytes for ly in L])]).astype(np.int64)
    bwd_store = u.bwd_req + pc.grads[np.arange(1, U + 1), U] - u.x_out[U - 1]
    bwd_store[:U - 1] += u.bwd_extra  # beside the loss and its seed (the post's own has them)
    fwd_none = [list(np.maximum.accumulate(row)) for row in fwd_ops(chain, cum)]
    return bwd_store, fwd_none, cum


def fwd_ops(chain: Chain, cum: np.ndarray) -> list[list[int]]:
    """``ops[s][k - s]``: what the no-saving forward op of layer ``k`` in a top-level checkpoint
    ``[s, j)`` needs above the memory at its start, autocast copies included (``cum``: their prefix
    sums)."""
    L = chain.layers
    x = [ly.x_bytes for ly in L]
    tmp = [ly.fn_tmp(ly.fwd_tmp_bytes, ly.cast_bytes) for ly in L]
    return [[(x[k - 1] if k > s else 0) + x[k] + tmp[k] + int(cum[k + 1] - cum[s]) for k in range(s, len(L))]
            for s in range(len(L))]


class CastFrontier:
    """Top-level ``(F, B)`` frontiers of a chain with autocast copies (see the module doc)."""

    def __init__(self, chain: Chain, u: Units, pc: PairCosts, pt: PeakTable, top_bytes: int):
        U = u.size
        if chain.n_layers + 1 != U:
            raise PlannerArgumentError("CastFrontier needs single-layer units")
        self.chain, self.u, self.pc, self.pt = chain, u, pc, pt
        cap = max(0, top_bytes - base_bytes(chain))
        self.cap = cap
        self.bwd_store, self.fwd_none, self.cum = top_level_needs(chain, u, pc)
        # the copies a stored layer leaves unsaved (the post's are in its measured transient)
        self.kept = [ly.unsaved_cast_bytes for ly in chain.layers] + [0]
        self.pre = chain.pre.cast_bytes  # live from the start of the forward to its end
        fronts: list[tuple[np.ndarray, np.ndarray]] = [(np.empty(0, np.int64), np.empty(0, np.int64))] * U
        fronts[U - 1] = _pareto(np.array([u.fwd_req[U - 1]], np.int64),
                                np.array([self.bwd_store[U - 1]], np.int64), cap)
        for s in range(U - 2, -1, -1):
            Fs, Bs = [], []
            F1, B1 = fronts[s + 1]
            Fs.append(self.kept[s] + np.maximum(u.fwd_req[s], u.hold[s] + F1))
            Bs.append(np.maximum(self.bwd_store[s], u.hold[s] + B1))
            for j in range(s + 1, U):
                Fj, Bj = fronts[j]
                if len(Fj) == 0:
                    continue
                cs = int(self.cum[j] - self.cum[s])
                xj = int(u.x_out[j - 1])
                inner = int(pc.inner_extra[j, U] + pt.R[s, j])
                Fs.append(np.maximum(self.fwd_none[s][j - s - 1], xj + cs + Fj))
                Bs.append(np.maximum(inner, xj + Bj))
            fronts[s] = _pareto(np.concatenate(Fs), np.concatenate(Bs), cap)
        self.fronts = fronts

    def need_bytes(self) -> int | None:
        """The least bytes above the chain's start a plan needs, or None above the span."""
        F, B = self.fronts[0]
        return int(np.maximum(F + self.pre, B).min()) if len(F) else None

    def min_peak(self) -> int | None:
        """The exact smallest peak, or None when no plan is under the no-checkpoint span."""
        need = self.need_bytes()
        return None if need is None else max(fixed_peak(self.chain), base_bytes(self.chain) + need)

    def _fits(self, j: int, f_avail: int, b_avail: int) -> bool:
        """Whether some plan of the suffix [j, U) needs at most these forward/backward bytes."""
        F, B = self.fronts[j]
        i = int(np.searchsorted(F, f_avail, side="right")) - 1  # the last point with F <= f_avail
        return i >= 0 and int(B[i]) <= b_avail

    def ranges(self, avail: int, estimate: Estimate | None = None,
               max_states: int | None = None) -> list[tuple[int, int]] | None:
        """Checkpointed layer ranges of the least-recompute plan needing at most ``avail`` bytes
        above the chain's start, or None when there is none.

        A forward DP over the top-level sequence: the states at unit ``s`` are the prefixes'
        ``(held bytes, copies, recompute)``, Pareto-pruned; a step is taken only if the rest can
        still fit (frontier lookup), so every state completes and the plan always fits. A
        checkpoint ``[s, j)`` costs its forward again plus its inner plan's recompute,
        ``estimate(s, j, bytes, K)`` (default: the min-peak table's ``K``); with the exact cost
        table's estimate this is the optimum. Above ``max_states`` states per unit the cheapest
        are kept (still feasible, maybe not optimal)."""
        max_states = limits.CAST_MAX_STATES if max_states is None else max_states
        u, pc, pt = self.u, self.pc, self.pt
        U = u.size
        P = pc.fwd_prefix_ms
        est: Estimate = estimate if estimate is not None else (lambda s, e, mb, k: k)
        if not self._fits(0, avail - self.pre, avail):
            return None
        # A state: (held, copies, recompute, previous unit, index of the state there, step end).
        states: list[list[tuple[int, int, float, int, int, int | None]]] = [[] for _ in range(U)]
        states[0] = [(0, self.pre, 0.0, -1, -1, None)]
        for s in range(U - 1):
            states[s] = _prune(states[s], max_states)
            hold, kept = int(u.hold[s]), self.kept[s]
            for idx, (h, c, cost, _, _, _) in enumerate(states[s]):
                mb = avail - h
                mf = mb - c
                if (u.fwd_req[s] + kept <= mf and self.bwd_store[s] <= mb
                        and self._fits(s + 1, mf - hold - kept, mb - hold)):
                    states[s + 1].append((h + hold, c + kept, cost, s, idx, None))
                for j in range(s + 1, U):
                    if self.fwd_none[s][j - s - 1] > mf:
                        break  # the no-saving forward only grows with j
                    extra = int(pc.inner_extra[j, U])
                    cs = int(self.cum[j] - self.cum[s])
                    xj = int(u.x_out[j - 1])
                    if extra + int(pt.R[s, j]) > mb or not self._fits(j, mf - xj - cs, mb - xj):
                        continue
                    step = (pc.ckpt_end_ms[j] - P[s]) + est(s, j, mb - extra, float(pt.K[s, j]))
                    states[j].append((h + xj, c + cs, cost + step, s, idx, j))
        last = states[U - 1] = _prune(states[U - 1], max_states)
        ends = [i for i, (h, c, _, _, _, _) in enumerate(last)
                if u.fwd_req[U - 1] <= avail - h - c and self.bwd_store[U - 1] <= avail - h]
        if not ends:
            raise PlannerBugError(f"cast frontier: no plan completes within {avail} bytes")
        i = min(ends, key=lambda k: last[k][2])
        out: list[tuple[int, int]] = []
        inner_choose = exact_chooser(u, pc, pt.R, pt.K, est)
        s = U - 1
        while s > 0:
            h, _, _, prev, idx, stop = states[s][i]
            if stop is not None:  # a checkpoint [prev, stop) and its inner plan
                h0 = states[prev][idx][0]
                mb = avail - h0 - int(pc.inner_extra[stop, U])
                out.append((u.bounds[prev][0], u.bounds[stop - 1][1]))
                out.extend(reconstruct(u.bounds, stop, mb, inner_choose, start=prev))
            s, i = prev, idx
        return out


def _prune(states: list[tuple[int, int, float, int, int, int | None]],
           max_states: int) -> list[tuple[int, int, float, int, int, int | None]]:
    """Drop states another beats on held bytes, copies and recompute at once; keep the
    ``max_states`` cheapest."""
    if len(states) <= 1:
        return states
    states = sorted(states, key=lambda t: (t[2], t[0], t[1]))
    h = np.array([t[0] for t in states], dtype=np.int64)
    c = np.array([t[1] for t in states], dtype=np.int64)
    keep: list[int] = []
    for i in range(len(states)):  # sorted by recompute: only earlier states can dominate
        if keep:
            k = np.asarray(keep)
            if bool(np.any((h[k] <= h[i]) & (c[k] <= c[i]))):
                continue
        keep.append(i)
        if len(keep) >= max_states:
            break
    return [states[i] for i in keep]
