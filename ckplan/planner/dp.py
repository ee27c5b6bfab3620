"""The optimal plan: least recompute time whose simulated peak fits a budget, nested checkpoints allowed.

This is rotor's dynamic program (Beaumont, Eyraud-Dubois, Herrmann, Joly, Shilova, "Optimal
checkpointing for heterogeneous chains: how to train deep neural networks with limited memory",
2019/2021; the same family of schedules as Revolve), written against *our* simulator so that
the two agree exactly.

Sub-problem ``C(s, e, m)``: the least recompute time of a sequence of items covering units
``[s, e)`` when ``m`` bytes are available above the memory at its start, and at that start the
gradient of unit ``e-1``'s output and every parameter gradient of units ``>= e`` already exist.
Both the whole plan (units ``[0, U)``, the post stage being the last unit, always stored) and the
inner plan of every checkpoint are such sequences, which is what makes the recursion close:

* ``Store(s)``, then ``C(s+1, e, m - hold[s])``; feasible when the forward and the backward of
  ``s`` fit (its backward runs after the rest: ``bwd_req[s] + grads(s+1..e-1) - x[e-1]``).
* ``Checkpoint[s, j)`` with ``s < j < e`` (a checkpoint never ends a sequence: dropping it is
  never worse), then ``C(j, e, m - x[j-1])`` for the rest, then its inner plan
  ``C(s, j, m - grads(j..e-1) + x[e-1] - x[j-1])`` costing ``fwd(s..j-1)`` more; feasible when
  the forward that keeps no activations fits.

``m`` is counted in slots of ``slot_bytes``, the same for every budget (one table serves a
whole frontier). When every size is a multiple of the slot (``slot_bytes`` = gcd of all sizes,
used whenever that needs few enough slots) the DP is exact; tests check it against brute force
over every plan. Otherwise sizes are rounded to the nearest slot (rotor rounds up, which is safe
but, on a chain of n stored layers, loses up to n slots). Either way a plan is *read* in exact
bytes: the companion min-peak table ``R(s, e)`` (below, exact integers) says whether an option
can be completed within what is left, and the cost table only ranks the options that can. So a
returned plan never exceeds its budget, by construction, and the simulator re-checks it.

Complexity O(U^3 M) for U units and M slots, vectorised over slots with numpy: for each end
``e`` and each split ``j`` one array operation covers every start ``s < j`` and every slot.

Long chains (more than ``EXACT_MAX_LAYERS`` layers in ``mode="auto"``) would need U^2 M memory
and U^3 M time, so the solver keeps two cheaper tables and returns the better plan:

* the nested DP on at most ``groups`` units of consecutive layers (``groups.py``, exact merged
  costs), optimal among plans that cut only between groups: it matters at tight budgets,
  where deep nesting is the only way down;
* the depth-1 DP on single layers (``_FlatTable``, O(U L M), segments up to L layers): every
  checkpoint's inner plan stores all, but which layers to checkpoint is chosen layer by layer,
  which is what matters on heterogeneous chains.

Measured with scripts/bench_planner.py at 200 and 300 layers: the best of the two equals the
exact optimum at every budget tried above the smallest peak; only a band of 0.1-0.5% of the
range just above the smallest peak is out of both tables' reach, where ``plan_dp`` returns the
smallest-peak plan (storing wherever the slack allows), up to 75% more recompute than optimal.

``min_peak`` solves the companion min-max program ``R(s, e)`` over exact integer bytes: the
smallest available memory for which a plan of [s, e) exists; ``R(0, U)`` gives the smallest
achievable peak. It is solved by sub-chain length so that each length is one set of array
operations (O(U) Python steps, about 1 s at 1000 layers).
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np

from .chain import Chain
from .groups import Units, cheap_cuts, equal_cuts, make_units, size_gcd
from .plan import Plan, items_from_ranges
from .simulate import simulate

INF = np.inf
CELL_BUDGET = 30_000_000  # U * U * slots float32 cells: ~120 MB, under 1 s at 100 layers
SMALL_UNITS = 64  # tables up to this many units use float64
FLAT_CELL_BUDGET = 500_000_000  # U * max_len * slots cells visited by the depth-1 DP: ~1.5 s
MIN_SLOTS, MAX_SLOTS = 500, 8192  # rotor uses 500
EXACT_MAX_LAYERS = 120  # auto mode: above this, group layers
DEFAULT_GROUPS = 100


@dataclass(frozen=True)
class DPResult:
    plan: Plan
    slot_bytes: int  # memory granularity of the DP
    n_slots: int  # slots between the fixed memory and the peak without checkpointing
    exact: bool  # slots divide every size and units are single layers: optimal
    n_units: int  # units the DP worked on (layers + post when not grouped)
    notes: tuple[str, ...] = field(default=())


def _ceil_div(a, q: int):
    return -((-a) // q)


def _near_div(a, q: int):
    """Nearest slot count, but never 0 for a positive size (a free boundary or a free layer
    would bias every estimate the same way)."""
    n = (a + q // 2) // q
    return np.where((a > 0) & (n < 1), 1, n)


class _Matrices:
    """Derived pair quantities of a unit chain, in exact bytes (U x (U+1) int64)."""

    def __init__(self, u: Units):
        U = u.size
        gp = np.concatenate([[0], np.cumsum(u.grad)])
        self.gs = gp[None, :] - gp[:, None]  # gs[j, e] = grads of units j..e-1
        self.P = np.concatenate([[0.0], np.cumsum(u.fwd_ms)])  # P[j] = fwd time of units < j
        xo = u.x_out
        # sreq[s, e]: what Store(s) needs (its forward, and its backward once the rest of a
        # sequence ending at e is done).
        self.sreq = np.zeros((U, U + 1), dtype=np.int64)
        # dlt[j, e]: how much more the inner plan of a checkpoint ending at j starts with than
        # the sequence [., e) it belongs to: the rest's gradients and x[j-1]'s gradient are
        # there, x[e-1]'s gradient is gone.
        self.dlt = np.zeros((U + 1, U + 1), dtype=np.int64)
        for e in range(1, U + 1):
            s = np.arange(e)
            self.sreq[:e, e] = np.maximum(u.fwd_req[:e],
                                          u.bwd_req[:e] + self.gs[s + 1, e] - xo[e - 1])
            j = np.arange(1, e)
            self.dlt[1:e, e] = self.gs[j, e] - xo[e - 1] + xo[j - 1]
        # fnone[s, j]: forward-without-saving peak of units s..j-1 (j <= U-1).
        self.fnone = np.full((U, U + 1), np.int64(2**62), dtype=np.int64)
        for s in range(U - 1):
            run = np.maximum.accumulate(np.concatenate([[u.fn_first[s]], u.fn_next[s + 1:U - 1]]))
            self.fnone[s, s + 1:U] = run


class _CostTable:
    """``C[s, e, m]`` for every sub-sequence, for slots ``m = 0..M``."""

    def __init__(self, u: Units, mx: _Matrices, slot: int, M: int, rounding: str):
        self.u, self.mx, self.q, self.M = u, mx, slot, M
        # float32 halves memory and time on big tables (costs keep ~7 significant digits);
        # small tables stay float64 so that brute-force comparisons are exact.
        self.dtype = DTYPE = np.float64 if u.size <= SMALL_UNITS else np.float32
        U = u.size
        q = slot
        div = _ceil_div if rounding == "up" else _near_div
        # Reading exact bytes: floor for exact or rounded-up tables, nearest slot otherwise.
        self.half = 0 if rounding == "up" else q // 2
        self.hs = div(u.hold, q)
        self.xs = div(u.x_out, q)
        self.ss = div(mx.sreq, q)
        self.ds = div(mx.dlt, q)
        self.fs = np.minimum(div(mx.fnone, q), M + 1)
        P = mx.P
        C = np.empty((U, U + 1, M + 1), dtype=DTYPE)  # every C[s, e] with s < e is written below
        mgrid = np.arange(M + 1)
        for e in range(1, U + 1):
            best = np.full((e, M + 1), INF, dtype=DTYPE)  # min_j C[s,j,m-d] + C[j,e,m-x] + P[j]
            for j in range(e - 1, -1, -1):
                # Finish C[j, e]: every checkpoint [j, j') with j' > j has been added to best[j].
                req = max(0, min(int(self.ss[j, e]), M + 1))
                if j + 1 == e:
                    store = np.zeros(M + 1, dtype=DTYPE)
                else:
                    store = self._shift(C[j + 1, e], int(self.hs[j]))
                store[:req] = INF
                np.minimum(store, best[j] - float(P[j]), out=C[j, e])
                if j == 0:
                    continue
                # Checkpoint [s, j) for every s < j, followed by the rest [j, e).
                rest = self._shift(C[j, e], int(self.xs[j - 1])) + float(P[j])
                val = self._shift_rows(C[:j, j], int(self.ds[j, e]), rest)
                f = self.fs[:j, j]
                w = int(f.max())  # the no-saving forward only rules out the first w slots
                if w > 0:
                    np.putmask(val[:, :w], mgrid[None, :w] < f[:, None], INF)
                np.minimum(best[:j], val, out=best[:j])
        self.C = C

    def _shift(self, a: np.ndarray, d: int) -> np.ndarray:
        """out[m] = a[m - d]; -inf side is infeasible, the top is clipped at M."""
        M = self.M
        out = np.empty(M + 1, dtype=self.dtype)
        if d >= 0:
            d = min(d, M + 1)
            out[:d] = INF
            out[d:] = a[:M + 1 - d]
        else:
            d = max(d, -(M + 1))
            out[:M + 1 + d] = a[-d:]
            out[M + 1 + d:] = a[M]
        return out

    def _shift_rows(self, blk: np.ndarray, d: int, add: np.ndarray) -> np.ndarray:
        """out[s, m] = blk[s, min(m - d, M)] + add[m]."""
        M = self.M
        out = np.empty(blk.shape, dtype=self.dtype)
        if d >= 0:
            d = min(d, M + 1)
            out[:, :d] = INF
            np.add(blk[:, :M + 1 - d], add[d:], out=out[:, d:])
        else:
            d = max(d, -(M + 1))
            np.add(blk[:, -d:], add[:M + 1 + d], out=out[:, :M + 1 + d])
            np.add(blk[:, M:M + 1], add[M + 1 + d:], out=out[:, M + 1 + d:])
        return out

    def _at(self, s: int, e: int, m: int) -> float:
        return INF if m < 0 else float(self.C[s, e, min(m, self.M)])

    def slot_ranges(self, m: int) -> list[tuple[int, int]]:
        """The table's own optimal plan at slot ``m``: the same arithmetic as the table, in
        scalars (its peak may overshoot the budget by the rounding; the caller checks)."""
        u, P, bounds = self.u, self.mx.P, self.u.bounds
        out: list[tuple[int, int]] = []
        todo = [(0, u.size, m)]
        while todo:
            s, e, m = todo.pop()
            while s < e:
                if m < self.ss[s, e]:
                    best = (INF, None)
                elif s + 1 == e:
                    best = (0.0, None)
                else:
                    best = (self._at(s + 1, e, m - int(self.hs[s])), None)
                for j in range(s + 1, e):
                    if m < self.fs[s, j]:
                        continue
                    r = self._at(j, e, m - int(self.xs[j - 1]))
                    if r == INF:
                        continue
                    v = (self._at(s, j, m - int(self.ds[j, e])) + (r + P[j])) - P[s]
                    if v < best[0]:
                        best = (v, j)
                if best[0] == INF:
                    raise RuntimeError(f"DP reconstruction reached an infeasible state ({s}, {e}, {m})")
                j = best[1]
                if j is None:
                    m -= int(self.hs[s])
                    s += 1
                else:
                    out.append((bounds[s][0], bounds[j - 1][1]))
                    todo.append((s, j, min(m - int(self.ds[j, e]), self.M)))
                    m -= int(self.xs[j - 1])
                    s = j
        return out

    def estimate(self, s: int, e: int, avail: int, fallback: float) -> float:
        """The table's recompute for [s, e) with ``avail`` exact bytes."""
        if avail < 0:
            return INF
        v = float(self.C[s, e, min((avail + self.half) // self.q, self.M)])
        return v if v < INF else 1e18 + fallback

    def ranges(self, avail: int, pt: _PeakTable) -> list[tuple[int, int]]:
        """Checkpointed layer ranges of a plan for the whole chain with ``avail`` exact bytes.

        Feasibility is decided in exact bytes by the min-peak table (an option is taken only
        if its own needs and its sub-chains' smallest needs fit), and among feasible options
        the cost table's estimate picks; so the plan always fits, whatever the rounding, and
        with gcd-sized slots it is the optimum. Iterative: plans can nest deeper than
        Python's recursion limit."""
        return _reconstruct(self.u, self.mx, pt.R, pt.K, avail, self.estimate)


class _FlatTable:
    """Plans of depth 1 at layer granularity (every checkpoint's inner plan stores all):
    ``C1(s, m)`` for suffixes ``[s, U)`` only, O(U^2 M) instead of O(U^3 M), so long chains
    keep layer-by-layer choices (which layer to checkpoint matters most on heterogeneous
    chains). A checkpoint [s, j) is feasible when its no-saving forward fits and its stored
    recompute fits in what is left once the later layers' gradients exist:
    ``grads(j..) + x[j-1] + R_store(s, j)``, all exact bytes rounded once."""

    def __init__(self, u: Units, mx: _Matrices, slot: int, M: int, rounding: str,
                 max_len: int | None = None):
        self.u, self.mx, self.q, self.M = u, mx, slot, M
        U = u.size
        q = slot
        div = _ceil_div if rounding == "up" else _near_div
        hold = u.hold
        H = np.concatenate([[0], np.cumsum(hold)])
        # thr[s, j]: bytes the checkpoint [s, j) needs at the start of s (U-1 x U, j > s).
        thr = np.full((U, U), np.int64(2**62), dtype=np.int64)
        for j in range(1, U):  # checkpoint [s, j), j <= U-1 (never the post)
            a = H[:j] + mx.sreq[:j, j]  # storing k..: H[k] - H[s] + sreq[k, j]
            r_store = np.maximum.accumulate(a[::-1])[::-1] - H[:j]
            thr[:j, j] = np.maximum(mx.fnone[:j, j], mx.dlt[j, U] + r_store)
        self.max_len = max_len or U
        self.half = 0 if rounding == "up" else q // 2
        self.thr = thr
        self.ts = np.minimum(div(thr, q), M + 1)
        self.hs = div(hold, q)
        self.xs = div(u.x_out, q)
        self.ss = div(mx.sreq[:, U], q)
        P = mx.P
        self.dtype = np.float64 if U <= SMALL_UNITS else np.float32
        C = np.empty((U, M + 1), dtype=self.dtype)
        S = np.full((U, M + 1), INF, dtype=self.dtype)  # S[j] = C[j, m - x[j-1]] + P[j]
        mgrid = np.arange(M + 1)
        C[U - 1] = 0.0
        C[U - 1, :max(0, min(int(self.ss[U - 1]), M + 1))] = INF
        if U > 1:
            S[U - 1] = self._shift(C[U - 1], int(self.xs[U - 2])) + float(P[U - 1])
        for s in range(U - 2, -1, -1):
            store = self._shift(C[s + 1], int(self.hs[s]))
            store[:max(0, min(int(self.ss[s]), M + 1))] = INF
            hi = min(U, s + 1 + self.max_len)
            t = self.ts[s, s + 1:hi]
            val = np.where(mgrid[None, :] < t[:, None], INF, S[s + 1:hi])
            np.minimum(store, val.min(axis=0) - float(P[s]), out=C[s])
            if s >= 1:
                S[s] = self._shift(C[s], int(self.xs[s - 1])) + float(P[s])
        self.C, self.S = C, S
        # Exact bytes: R1[s] the least a depth-1 plan of [s, U) needs, K1[s] its recompute.
        big = np.int64(2**62)
        R1 = np.full(U, big, dtype=np.int64)
        K1 = np.zeros(U)
        R1[U - 1] = mx.sreq[U - 1, U]
        for s in range(U - 2, -1, -1):
            hi = min(U, s + 1 + self.max_len)
            r = np.maximum(thr[s, s + 1:hi], u.x_out[s:hi - 1] + R1[s + 1:hi])
            k = int(np.argmin(r))
            rs = max(mx.sreq[s, U], hold[s] + R1[s + 1])
            if rs <= r[k]:
                R1[s], K1[s] = rs, K1[s + 1]
            else:
                R1[s], K1[s] = r[k], (P[s + 1 + k] - P[s]) + K1[s + 1 + k]
        self.R1, self.K1 = R1, K1

    def _shift(self, a: np.ndarray, d: int) -> np.ndarray:
        out = np.empty(self.M + 1, dtype=self.dtype)
        d = min(d, self.M + 1)
        out[:d] = INF
        out[d:] = a[:self.M + 1 - d]
        return out

    def slot_ranges(self, m: int) -> list[tuple[int, int]]:
        """The table's own optimal plan at slot ``m`` (see ``_CostTable.slot_ranges``)."""
        u, P, U = self.u, self.mx.P, self.u.size
        out: list[tuple[int, int]] = []
        s = 0
        while s < U - 1:
            store = INF
            if m >= self.ss[s] and m - self.hs[s] >= 0:
                store = float(self.C[s + 1, m - int(self.hs[s])])
            hi = min(U, s + 1 + self.max_len)
            vals = np.where(self.ts[s, s + 1:hi] <= m, self.S[s + 1:hi, m], INF) - P[s]
            k = int(np.argmin(vals))
            if min(store, vals[k]) == INF:
                raise RuntimeError(f"flat DP reconstruction reached an infeasible state ({s}, {m})")
            if store <= vals[k]:
                m -= int(self.hs[s])
                s += 1
            else:
                j = s + 1 + k
                out.append((u.bounds[s][0], u.bounds[j - 1][1]))
                m -= int(self.xs[j - 1])
                s = j
        return out

    def ranges(self, avail: int) -> list[tuple[int, int]]:
        """Like ``_CostTable.ranges``: exact feasibility from R1, the table's estimates pick."""
        u, mx, P, U, q, M = self.u, self.mx, self.mx.P, self.u.size, self.q, self.M
        out: list[tuple[int, int]] = []
        s, mb = 0, avail
        while s < U - 1:
            def est(rows: np.ndarray, left: np.ndarray) -> np.ndarray:
                idx = np.clip((left + self.half) // q, 0, M)
                v = self.C[rows, idx]
                return np.where(v < INF, v, 1e18 + self.K1[rows])

            store = INF
            if max(mx.sreq[s, U], u.hold[s] + self.R1[s + 1]) <= mb:
                store = float(est(np.array([s + 1]), np.array([mb - u.hold[s]]))[0])
            hi = min(U, s + 1 + self.max_len)
            js = np.arange(s + 1, hi)
            left = mb - u.x_out[js - 1]
            ok = np.maximum(self.thr[s, js], u.x_out[js - 1] + self.R1[js]) <= mb
            vals = np.where(ok, (P[js] - P[s]) + est(js, left), INF)
            k = int(np.argmin(vals))
            if min(store, vals[k]) == INF:
                raise RuntimeError(f"flat DP reconstruction: no feasible option at ({s}, {mb})")
            if store <= vals[k]:
                mb -= int(u.hold[s])
                s += 1
            else:
                j = int(js[k])
                out.append((u.bounds[s][0], u.bounds[j - 1][1]))
                mb -= int(u.x_out[j - 1])
                s = j
        return out


def _skew(A: np.ndarray, l: int, ns: int) -> np.ndarray:
    """View V[k-1, s] = A[l-k, s+k] for k = 1..l-1, s < ns (A is (W, W), C-contiguous):
    the table entry of the sub-chain [s+k, s+l) when A is stored by (length, start)."""
    W = A.shape[1]
    it = A.itemsize
    start = A[l - 1, 1:]
    return np.lib.stride_tricks.as_strided(start, shape=(l - 1, ns), strides=(-(W - 1) * it, it),
                                           writeable=False)


def _diag(v: np.ndarray, off: int, l: int, ns: int) -> np.ndarray:
    """View V[k-1, s] = v[s + k - 1 + off] for k = 1..l-1, s < ns."""
    it = v.itemsize
    return np.lib.stride_tricks.as_strided(v[off:], shape=(l - 1, ns), strides=(it, it),
                                           writeable=False)


class _PeakTable:
    """``R[s, e]``: the least bytes above the start for which [s, e) has a plan (exact ints),
    with ``K[s, e]`` the least recompute among the options reaching it (a tie-break only)."""

    def __init__(self, u: Units, mx: _Matrices, with_cost: bool = True):
        # Sub-chains are solved by increasing length l = e - s, all starts at once: every
        # option of a length-l sub-chain only needs shorter ones. Tables are stored by
        # (length, start), so "the rest [s+k, s+l)" is a skewed strided view (_skew).
        U = u.size
        W = U + 1
        self.u, self.mx = u, mx
        big = np.int64(2**62)
        ln, st = np.meshgrid(np.arange(W), np.arange(W), indexing="ij")
        en = ln + st
        ok = (en <= U) & (st < U)
        sc, ec = np.where(ok, st, 0), np.where(ok, en, 0)
        FN = np.where(ok, mx.fnone[sc, ec], big)  # FN[k, s] = fnone(s, s + k)
        SR = np.where(ok, mx.sreq[sc, ec], big)  # SR[l, s] = sreq(s, s + l)
        DL = np.where(en <= U, mx.dlt[st, np.where(en <= U, en, 0)], 0)  # DL[l, j] = dlt(j, j + l)
        P = mx.P
        xo = u.x_out
        D = np.full((W, W), big, dtype=np.int64)  # D[l, s] = R(s, s + l)
        KD = np.zeros((W, W))  # KD[l, s] = K(s, s + l)
        for l in range(1, U + 1):
            ns = U - l + 1
            if l == 1:
                D[1, :ns], KD[1, :ns] = SR[1, :ns], 0.0
                continue
            sr = np.maximum(SR[l, :ns], u.hold[:ns] + D[l - 1, 1:ns + 1])
            v = np.maximum(FN[1:l, :ns], _diag(xo, 0, l, ns) + _skew(D, l, ns))
            np.maximum(v, _skew(DL, l, ns) + D[1:l, :ns], out=v)
            vmin = v.min(axis=0)
            if with_cost:
                sk = KD[l - 1, 1:ns + 1]
                kc = (_diag(P, 1, l, ns) - P[:ns]) + _skew(KD, l, ns) + KD[1:l, :ns]
                kmin = np.where(v == vmin, kc, INF).min(axis=0)
                store = (sr < vmin) | ((sr == vmin) & (sk <= kmin))
                KD[l, :ns] = np.where(store, sk, kmin)
            else:
                store = sr <= vmin
            D[l, :ns] = np.where(store, sr, vmin)
        R = np.full((U, W), big, dtype=np.int64)
        K = np.full((U, W), INF)
        R[sc[ok], ec[ok]] = D[ok]
        K[sc[ok], ec[ok]] = KD[ok]
        self.R, self.K = R, K

    def ranges(self, avail: int) -> list[tuple[int, int]]:
        """Checkpointed layer ranges of a plan fitting ``avail`` exact bytes (at least
        ``R[0, U]``): like ``_CostTable.ranges``, with K, the recompute of the smallest-peak
        completions, as the estimate. Slack is spent greedily on storing."""
        return _reconstruct(self.u, self.mx, self.R, self.K, avail, lambda s, e, mb, k: k)



def _reconstruct(u: Units, mx: _Matrices, R, K, avail: int, estimate) -> list[tuple[int, int]]:
    """Checkpointed layer ranges of a plan for the whole chain with ``avail`` exact bytes.

    Feasibility is decided in exact bytes by the min-peak table ``R`` (an option is taken only
    if its own needs and its sub-chains' smallest needs fit); among feasible options
    ``estimate(s, e, bytes, K[s, e])`` picks the cheapest. Iterative: plans can nest deeper
    than Python's recursion limit."""
    P, xo, bounds = mx.P, u.x_out, u.bounds
    out: list[tuple[int, int]] = []
    todo = [(0, u.size, avail)]
    while todo:
        s, e, mb = todo.pop()
        while s < e:
            best: tuple[float, int | None] | None = None
            if s + 1 == e:
                if mx.sreq[s, e] <= mb:
                    best = (0.0, None)
            elif max(mx.sreq[s, e], u.hold[s] + R[s + 1, e]) <= mb:
                best = (estimate(s + 1, e, mb - int(u.hold[s]), K[s + 1, e]), None)
            for j in range(s + 1, e):
                if max(mx.fnone[s, j], xo[j - 1] + R[j, e], mx.dlt[j, e] + R[s, j]) > mb:
                    continue
                est = ((P[j] - P[s]) + estimate(s, j, mb - int(mx.dlt[j, e]), K[s, j])
                       + estimate(j, e, mb - int(xo[j - 1]), K[j, e]))
                if best is None or est < best[0]:
                    best = (est, j)
            if best is None:
                raise RuntimeError(f"DP reconstruction: no feasible option at ({s}, {e}, {mb})")
            j = best[1]
            if j is None:
                mb -= int(u.hold[s])
                s += 1
            else:
                out.append((bounds[s][0], bounds[j - 1][1]))
                todo.append((s, j, mb - int(mx.dlt[j, e])))
                mb -= int(xo[j - 1])
                s = j
    return out

def fixed_peak(chain: Chain) -> int:
    """The part of the peak no plan changes: pre forward/backward and the optimizer step."""
    p, pre = chain.persistent_bytes, chain.pre
    grads = sum(ly.grad_bytes for ly in chain.layers) + chain.post.grad_bytes
    pre_b = p + pre.retained_bytes + chain.delta_in_bytes + grads
    pre_after = pre_b + pre.grad_bytes - pre.retained_bytes - chain.delta_in_bytes
    return max(p + pre.retained_bytes + pre.fwd_tmp_bytes, pre_b + pre.bwd_tmp_bytes, pre_after,
               chain.opt_step_peak_bytes)


def base_bytes(chain: Chain) -> int:
    """Memory at the start of the chain's forward: persistent + what pre keeps."""
    return chain.persistent_bytes + chain.pre.retained_bytes


def _units_for(chain: Chain, mode: str, groups: int | None, cuts: str = "cheap") -> Units:
    n = chain.n_layers
    if mode not in ("auto", "exact", "grouped"):
        raise ValueError(f"dp mode must be auto, exact or grouped, not {mode!r}")
    g = groups or DEFAULT_GROUPS
    if mode == "exact" or (mode == "auto" and n <= EXACT_MAX_LAYERS) or g >= n:
        return make_units(chain)
    return make_units(chain, cheap_cuts(chain, g) if cuts == "cheap" else equal_cuts(n, g))


@lru_cache(maxsize=16)  # chains are immutable and hashable; plan_chain and sweep ask twice
def min_peak(chain: Chain) -> int:
    """The smallest peak any plan reaches (exact: a min-max DP over bytes, every layer a unit)."""
    u = make_units(chain)
    pt = _PeakTable(u, _Matrices(u), with_cost=False)
    return max(fixed_peak(chain), base_bytes(chain) + int(pt.R[0, u.size]))


def min_peak_plan(chain: Chain, budget_bytes: int | None = None) -> Plan:
    """A plan reaching ``min_peak`` (or fitting ``budget_bytes``, which must be at least
    that), storing wherever the slack allows; exact, but not least-recompute."""
    u = make_units(chain)
    pt = _PeakTable(u, _Matrices(u))
    need = int(pt.R[0, u.size])
    avail = need if budget_bytes is None else max(need, budget_bytes - base_bytes(chain))
    items = items_from_ranges(chain.n_layers, pt.ranges(avail))
    return Plan("dp", chain.n_layers, items, {"budget_bytes": budget_bytes, "min_peak": True})


@dataclass(frozen=True)
class _Reader:
    """One DP table seen from the top."""

    name: str
    need_bytes: int  # the least bytes above the chain's start any plan of this table needs
    ranges: Callable[[int], list[tuple[int, int]]]  # checkpointed ranges for exact avail bytes
    slot_bytes: int
    top: np.ndarray  # the table's least recompute at each slot
    slot_ranges: Callable[[int], list[tuple[int, int]]]  # the table's own plan at a slot


class DPSolver:
    """DP tables for one chain, reusable for every budget below the unrestricted peak
    (``sweep`` reads a whole frontier from them). Slots do not depend on the budget.

    Each table is read two ways and the better plan kept: top-down in exact bytes (an option
    is taken only if the exact min-peak tables say it can be completed within what is left,
    and the cost table ranks those), which always fits; and the table's own optimal plan at the
    budget's slot, stepping down a slot while the simulator says it overshoots. With gcd-sized
    slots (``exact``) both are the optimum. ``rounding="nearest"`` (default) rounds sizes to the
    nearest slot so rounding errors cancel instead of adding up along the chain;
    ``rounding="up"`` is rotor's conservative rounding, kept for comparison.

    Long chains (``mode="grouped"``, or ``"auto"`` above ``EXACT_MAX_LAYERS`` layers) get two
    tables: the nested DP on groups of layers, and the depth-1 DP on single layers
    (:class:`_FlatTable`); ``solve`` returns the better plan of the two.
    """

    def __init__(self, chain: Chain, *, max_slots: int | None = None, mode: str = "auto",
                 groups: int | None = None, rounding: str = "nearest", cuts: str = "cheap",
                 flat: bool | None = None, top_bytes: int | None = None):
        from .strategies import plan_none  # strategies imports this module

        if rounding not in ("nearest", "up"):
            raise ValueError(f"rounding must be 'nearest' or 'up', not {rounding!r}")
        self.chain = chain
        self.units = _units_for(chain, mode, groups, cuts)
        self.grouped = self.units.size < chain.n_layers + 1
        self.none_peak = simulate(chain, plan_none(chain.n_layers)).peak_bytes
        top = self.none_peak if top_bytes is None else top_bytes
        self.span = max(0, top - base_bytes(chain))
        g = size_gcd(chain)
        U = self.units.size
        slots = max_slots or max(MIN_SLOTS, min(MAX_SLOTS, CELL_BUDGET // (U * U)))
        q = choose_slot(self.units, self.span, g, slots)
        M = int(self.span // q)
        mx = _Matrices(self.units)
        table = _CostTable(self.units, mx, q, M, "up" if q == g else rounding)
        peaks = _PeakTable(self.units, mx)
        self.readers = [_Reader("nested", int(peaks.R[0, U]), lambda a: table.ranges(a, peaks),
                                q, table.C[0, U], table.slot_ranges)]
        if flat if flat is not None else self.grouped:
            lu = make_units(chain)
            N = lu.size
            max_len = min(N, max(64, 8 * math.isqrt(N)))
            slots = max_slots or max(MIN_SLOTS, min(MAX_SLOTS, FLAT_CELL_BUDGET // (N * max_len)))
            fq = choose_slot(lu, self.span, g, slots)
            ft = _FlatTable(lu, _Matrices(lu), fq, int(self.span // fq), "up" if fq == g else rounding,
                            max_len)
            self.readers.append(_Reader("flat", int(ft.R1[0]), ft.ranges, fq, ft.C[0], ft.slot_ranges))
        self.slot_bytes = int(q)
        self.M = M
        self.exact = q == g and not self.grouped

    def solve(self, budget_bytes: int) -> Plan | None:
        """The best plan the tables give at this budget, or None when none of them reaches
        it (grouped tables can miss budgets near the smallest peak; the caller decides)."""
        if budget_bytes < fixed_peak(self.chain):
            return None
        avail = budget_bytes - base_bytes(self.chain)
        best: tuple[float, Plan] | None = None
        for r in self.readers:
            if r.need_bytes > avail:
                continue
            for plan in (self._plan(r.ranges(avail), budget_bytes, r.name),
                         self._scan(r, budget_bytes)):
                if plan is not None:
                    cost = simulate(self.chain, plan).recompute_ms
                    if best is None or cost < best[0]:
                        best = (cost, plan)
        return None if best is None else best[1]

    def _plan(self, ranges: list[tuple[int, int]], budget_bytes: int, name: str) -> Plan:
        n = self.chain.n_layers
        plan = Plan("dp", n, items_from_ranges(n, ranges), {"budget_bytes": budget_bytes})
        peak = simulate(self.chain, plan).peak_bytes
        if peak > budget_bytes:  # exact feasibility forbids this
            raise RuntimeError(f"dp ({name}) plan peaks at {peak} > budget {budget_bytes}: planner bug")
        return plan

    def _scan(self, r: _Reader, budget_bytes: int, max_reads: int = 64) -> Plan | None:
        """The table's own plan at the budget's slot, or at the next lower slots while it
        overshoots (rounding): often better than the exact-bytes read, never needed for
        feasibility."""
        n = self.chain.n_layers
        m = min((budget_bytes - base_bytes(self.chain)) // r.slot_bytes, len(r.top) - 1)
        for _ in range(max_reads):
            if m < 0 or r.top[m] == INF:
                return None
            plan = Plan("dp", n, items_from_ranges(n, r.slot_ranges(m)), {"budget_bytes": budget_bytes})
            peak = simulate(self.chain, plan).peak_bytes
            if peak <= budget_bytes:
                return plan
            m -= 1
        return None


def choose_slot(units: Units, span: int, g: int, max_slots: int) -> int:
    """Slot size: the gcd of all sizes when that needs at most ``max_slots`` slots (exact);
    otherwise the size in [span / max_slots, 1.25 x that] that divides the units' kept and
    output bytes most evenly, so that repeated layers (transformer blocks) round exactly and
    their rounding errors do not pile up along the chain."""
    if span // g <= max_slots:
        return g
    q0 = -(-span // max_slots)
    vals = np.concatenate([units.hold[:-1], units.x_out[:-1]]).astype(np.float64)
    uniq, counts = np.unique(vals, return_counts=True)
    cands = {q0}
    for v in uniq[np.argsort(-counts)][:8]:
        for k in range(max(1, int(v // (1.25 * q0))), int(v // q0) + 1):
            if q0 <= int(v) // k <= 1.25 * q0:
                cands.add(int(v) // k)
    def err(q: int) -> float:
        r = vals / q
        return float(np.abs(r - np.round(r)).sum())
    return min(sorted(cands), key=err)


def plan_dp(chain: Chain, budget_bytes: int, *, max_slots: int | None = None, mode: str = "auto",
            groups: int | None = None, rounding: str = "nearest") -> DPResult:
    """The least-recompute plan whose simulated peak fits ``budget_bytes``.

    Raises :class:`ckplan.errors.InfeasibleBudgetError` when even ``min_peak`` does not fit.
    """
    from .strategies import plan_none

    notes: list[str] = []
    solver = DPSolver(chain, max_slots=max_slots, mode=mode, groups=groups, rounding=rounding)
    if budget_bytes >= solver.none_peak:
        plan = Plan("dp", chain.n_layers, plan_none(chain.n_layers).items,
                    {"budget_bytes": budget_bytes})
        return DPResult(plan, solver.slot_bytes, solver.M, True, solver.units.size,
                        ("the plan without checkpointing fits",))
    plan = solver.solve(budget_bytes)
    exact = solver.exact
    if plan is None:
        lowest = min_peak(chain)
        if budget_bytes < lowest:
            raise infeasible_error(chain, budget_bytes, lowest)
        plan = min_peak_plan(chain, budget_bytes)
        exact = False
        notes.append("the grouped tables cannot reach a budget this close to the smallest peak: "
                     "returned the smallest-peak plan")
    if solver.grouped:
        notes.append(f"long chain: best of nested plans on {solver.units.size - 1} groups of "
                     f"layers and single-level plans on all {chain.n_layers} layers (near-optimal)")
    elif not solver.exact:
        notes.append(f"recompute estimated in slots of {solver.slot_bytes} bytes: the plan fits "
                     "exactly but may recompute slightly more than the optimum")
    return DPResult(plan, solver.slot_bytes, solver.M, exact, solver.units.size, tuple(notes))


def infeasible_error(chain: Chain, budget_bytes: int, lowest: int):
    from ..errors import InfeasibleBudgetError
    from ..units import format_bytes as fb

    fixed = []
    if chain.param_bytes:
        fixed.append(f"parameters {fb(chain.param_bytes)}")
    if chain.total_grad_bytes:
        fixed.append(f"gradients {fb(chain.total_grad_bytes)}")
    if chain.optimizer_bytes:
        fixed.append(f"optimizer state {fb(chain.optimizer_bytes)}")
    known = chain.param_bytes + chain.total_grad_bytes + chain.optimizer_bytes
    if fixed:
        parts = ", ".join(fixed[:-1]) + (" and " if len(fixed) > 1 else "") + fixed[-1]
        tail = f"; {parts} alone take {fb(known)}"
    else:
        tail = (f"; memory no plan can free (parameters, batch, optimizer state) is "
                f"{fb(chain.persistent_bytes)}")
    return InfeasibleBudgetError(
        f"budget {fb(budget_bytes)} is below the smallest feasible peak {fb(lowest)} "
        f"(recompute everything, nested){tail}",
        tip="try a smaller --batch-size, --precision bf16, or --optimizer sgd",
        budget_bytes=budget_bytes, min_peak_bytes=lowest, persistent_bytes=chain.persistent_bytes)
