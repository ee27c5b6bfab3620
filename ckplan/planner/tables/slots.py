"""Least-recompute tables in slots: nested (``CostTable``) and depth-1 (``FlatTable``)."""
from __future__ import annotations

import numpy as np

from ...errors import PlannerBugError
from .. import limits
from ..groups import Units
from .common import BIG, INF, Step, ceil_div, near_div, shift
from .compiled import jitted
from .pairs import PairCosts
from .peaks import PeakTable
from .reader import exact_chooser, reconstruct, reconstruct_options


class CostTable:
    """``C[s, e, m]``: least recompute of every sub-sequence, for slots ``m = 0..M``;
    ``Store(s)`` takes the best of the unit's selective options (``Units.opt_*``)."""

    def __init__(self, u: Units, pc: PairCosts, slot: int, M: int, rounding: str):
        self.u, self.pc, self.slot, self.M = u, pc, slot, M
        # float32 halves memory and time on big tables (costs keep ~7 significant digits);
        # small tables stay float64 so that brute-force comparisons are exact.
        self.dtype = DTYPE = np.float64 if u.size <= limits.SMALL_UNITS else np.float32
        U = u.size
        div = ceil_div if rounding == "up" else near_div
        # Reading exact bytes: floor for exact or rounded-up tables, nearest slot otherwise.
        self.half = 0 if rounding == "up" else slot // 2
        self.hold_slots = div(u.hold, slot)
        self.x_slots = div(u.x_out, slot)
        self.store_slots = div(pc.store_req, slot)
        self.inner_slots = div(pc.inner_extra, slot)
        self.fnone_slots = np.minimum(div(pc.fnone, slot), M + 1)
        n_opt = u.n_options
        self.opt_hold_slots = div(u.opt_hold, slot)
        self.opt_store_slots = div(pc.opt_store_req, slot)
        self.opts = [[o for o in range(1, n_opt) if np.isfinite(u.opt_ms[s, o])] for s in range(U)]
        P = pc.fwd_prefix_ms
        C = np.empty((U, U + 1, M + 1), dtype=DTYPE)  # every C[s, e] with s < e is written below
        kernel = jitted("_cost_kernel", U)
        if kernel is not None:  # the same sums in the same precision (identical tables)
            i64 = np.int64
            kernel(C, np.empty((U, M + 1), dtype=DTYPE), np.empty(M + 1, dtype=DTYPE),
                   np.array([INF, 0.0], dtype=DTYPE), np.ascontiguousarray(self.store_slots, dtype=i64),
                   np.ascontiguousarray(self.hold_slots, dtype=i64),
                   np.ascontiguousarray(self.opt_hold_slots, dtype=i64),
                   np.ascontiguousarray(self.opt_store_slots, dtype=i64),
                   np.ascontiguousarray(u.opt_ms, dtype=DTYPE),
                   np.ascontiguousarray(self.x_slots, dtype=i64),
                   np.ascontiguousarray(self.inner_slots, dtype=i64),
                   np.ascontiguousarray(self.fnone_slots, dtype=i64), P.astype(DTYPE),
                   pc.ckpt_end_ms.astype(DTYPE))
            self.C = C
            return
        mgrid = np.arange(M + 1)
        for e in range(1, U + 1):
            best = np.full((e, M + 1), INF, dtype=DTYPE)  # min_j C[s,j,m-d] + C[j,e,m-x] + Q[j]
            for j in range(e - 1, -1, -1):
                # Finish C[j, e]: every checkpoint [j, j') with j' > j has been added to best[j].
                req = max(0, min(int(self.store_slots[j, e]), M + 1))
                if j + 1 == e:
                    store = np.zeros(M + 1, dtype=DTYPE)
                else:
                    store = shift(C[j + 1, e], int(self.hold_slots[j]), M, DTYPE)
                store[:req] = INF
                for o in self.opts[j]:  # Store(j) with a selective option
                    ms = float(u.opt_ms[j, o])
                    if j + 1 == e:
                        so = np.full(M + 1, ms, dtype=DTYPE)
                    else:
                        so = shift(C[j + 1, e], int(self.opt_hold_slots[j, o]), M, DTYPE) + DTYPE(ms)
                    so[:max(0, min(int(self.opt_store_slots[o, j, e]), M + 1))] = INF
                    np.minimum(store, so, out=store)
                np.minimum(store, best[j] - float(P[j]), out=C[j, e])
                if j == 0:
                    continue
                # Checkpoint [s, j) for every s < j, followed by the rest [j, e).
                rest = shift(C[j, e], int(self.x_slots[j - 1]), M, DTYPE) + float(pc.ckpt_end_ms[j])
                val = shift(C[:j, j], int(self.inner_slots[j, e]), M, DTYPE, add=rest)
                f = self.fnone_slots[:j, j]
                w = int(f.max())  # the no-saving forward only rules out the first w slots
                if w > 0:
                    np.putmask(val[:, :w], mgrid[None, :w] < f[:, None], INF)
                np.minimum(best[:j], val, out=best[:j])
        self.C = C

    def _at(self, s: int, e: int, m: int) -> float:
        return INF if m < 0 else float(self.C[s, e, min(m, self.M)])

    def _slot_choose(self, s: int, e: int, m: int) -> Step:
        P, Q = self.pc.fwd_prefix_ms, self.pc.ckpt_end_ms
        best: tuple[float, int | None] = (INF, None)
        bo = 0
        for o in [0, *self.opts[s]]:
            if m < self.opt_store_slots[o, s, e]:
                continue
            ms = float(self.u.opt_ms[s, o])
            v = ms if s + 1 == e else self._at(s + 1, e, m - int(self.opt_hold_slots[s, o])) + ms
            if o == 0 or v < best[0]:
                best, bo = (v, None), o
        for j in range(s + 1, e):
            if m < self.fnone_slots[s, j]:
                continue
            r = self._at(j, e, m - int(self.x_slots[j - 1]))
            if r == INF:
                continue
            v = (self._at(s, j, m - int(self.inner_slots[j, e])) + (r + Q[j])) - P[s]
            if v < best[0]:
                best = (v, j)
        if best[0] == INF:
            raise PlannerBugError(f"DP reconstruction reached an infeasible state ({s}, {e}, {m})")
        pick = best[1]
        if pick is None:
            return None, m - int(self.opt_hold_slots[s, bo]), None, bo
        return pick, m - int(self.x_slots[pick - 1]), min(m - int(self.inner_slots[pick, e]), self.M), 0

    def slot_ranges(self, m: int) -> list[tuple[int, int]]:
        """The table's own optimal plan at slot ``m``: the same arithmetic as the table, in
        scalars (its peak may overshoot the budget by the rounding; the caller checks)."""
        return self.slot_parts(m)[0]

    def slot_parts(self, m: int) -> tuple[list[tuple[int, int]], dict[int, int]]:
        """``slot_ranges`` and the selective option of each unit stored with one."""
        return reconstruct_options(self.u.bounds, self.u.size, m, self._slot_choose)

    def estimate(self, s: int, e: int, avail: int, fallback: float) -> float:
        """The table's recompute for [s, e) with ``avail`` exact bytes."""
        if avail < 0:
            return INF
        v = float(self.C[s, e, min((avail + self.half) // self.slot, self.M)])
        return v if v < INF else 1e18 + fallback

    def ranges(self, avail: int, pt: PeakTable) -> list[tuple[int, int]]:
        """Checkpointed layer ranges of a plan for the whole chain with ``avail`` exact bytes.

        Feasibility is decided in exact bytes by the min-peak table (an option is taken only
        if its own needs and its sub-chains' smallest needs fit), and among feasible options
        the cost table's estimate picks; so the plan always fits, whatever the rounding, and
        with gcd-sized slots it is the optimum."""
        return self.parts(avail, pt)[0]

    def parts(self, avail: int, pt: PeakTable) -> tuple[list[tuple[int, int]], dict[int, int]]:
        """``ranges`` and the selective option of each unit stored with one."""
        return reconstruct_options(self.u.bounds, self.u.size, avail,
                                   exact_chooser(self.u, self.pc, pt.R, pt.K, self.estimate))


class FlatTable:
    """Plans of depth 1 at layer granularity (every checkpoint's inner plan stores all):
    ``C1(s, m)`` for suffixes ``[s, U)`` only, O(U^2 M) instead of O(U^3 M), so long chains
    keep layer-by-layer choices (which layer to checkpoint matters most on heterogeneous
    chains). A checkpoint [s, j) is feasible when its no-saving forward fits and its stored
    recompute fits in what is left once the later layers' gradients exist:
    ``grads(j..) + x[j-1] + R_store(s, j)``, all exact bytes rounded once."""

    def __init__(self, u: Units, pc: PairCosts, slot: int, M: int, rounding: str,
                 max_len: int | None = None, top_bytes: int | None = None):
        self.u, self.pc, self.slot, self.M = u, pc, slot, M
        U = u.size
        div = ceil_div if rounding == "up" else near_div
        hold = u.hold
        H = np.concatenate([[0], np.cumsum(hold)])
        # thr[s, j]: bytes the checkpoint [s, j) needs at the start of s (U-1 x U, j > s).
        thr = np.full((U, U), BIG, dtype=np.int64)
        for j in range(1, U):  # checkpoint [s, j), j <= U-1 (never the post)
            a = H[:j] + pc.store_req[:j, j]  # storing k..: H[k] - H[s] + store_req[k, j]
            r_store = np.maximum.accumulate(a[::-1])[::-1] - H[:j]
            thr[:j, j] = np.maximum(pc.fnone[:j, j], pc.inner_extra[j, U] + r_store)
        self.max_len = max_len or U
        self.half = 0 if rounding == "up" else slot // 2
        self.thr = thr
        self.thr_slots = np.minimum(div(thr, slot), M + 1)
        self.hold_slots = div(hold, slot)
        self.x_slots = div(u.x_out, slot)
        self.store_slots = div(pc.store_req[:, U], slot)
        # Exact bytes: R1[s] the least a depth-1 plan of [s, U) needs, K1[s] its recompute.
        R1 = np.full(U, BIG, dtype=np.int64)
        K1 = np.zeros(U)
        R1[U - 1] = pc.store_req[U - 1, U]
        for s in range(U - 2, -1, -1):
            hi = min(U, s + 1 + self.max_len)
            r = np.maximum(thr[s, s + 1:hi], u.x_out[s:hi - 1] + R1[s + 1:hi])
            k = int(np.argmin(r))
            rs = max(pc.store_req[s, U], hold[s] + R1[s + 1])
            if rs <= r[k]:
                R1[s], K1[s] = rs, K1[s + 1]
            else:
                R1[s], K1[s] = r[k], (pc.ckpt_end_ms[s + 1 + k] - pc.fwd_prefix_ms[s]) + K1[s + 1 + k]
        self.R1, self.K1 = R1, K1
        # no depth-1 plan fits up to ``top_bytes``: no cost table (``built`` False)
        self.built = top_bytes is None or int(R1[0]) <= top_bytes
        if not self.built:
            self.C = self.S = np.empty((0, 0))
            return
        P, Q = pc.fwd_prefix_ms, pc.ckpt_end_ms
        self.dtype = DTYPE = np.float64 if U <= limits.SMALL_UNITS else np.float32
        C = np.empty((U, M + 1), dtype=DTYPE)
        S = np.full((U, M + 1), INF, dtype=DTYPE)  # S[j] = C[j, m - x[j-1]] + Q[j]
        mgrid = np.arange(M + 1)
        C[U - 1] = 0.0
        C[U - 1, :max(0, min(int(self.store_slots[U - 1]), M + 1))] = INF
        if U > 1:
            S[U - 1] = shift(C[U - 1], int(self.x_slots[U - 2]), M, DTYPE) + float(Q[U - 1])
        masked_min = jitted("_masked_min", U)
        for s in range(U - 2, -1, -1):
            store = shift(C[s + 1], int(self.hold_slots[s]), M, DTYPE)
            store[:max(0, min(int(self.store_slots[s]), M + 1))] = INF
            hi = min(U, s + 1 + self.max_len)
            t = self.thr_slots[s, s + 1:hi]
            if masked_min is not None:  # the same minimum, without the (L, M) temporary
                low = masked_min(S, s + 1, hi, np.ascontiguousarray(t, dtype=np.int64))
            else:
                low = np.where(mgrid[None, :] < t[:, None], INF, S[s + 1:hi]).min(axis=0)
            np.minimum(store, low - float(P[s]), out=C[s])
            if s >= 1:
                S[s] = shift(C[s], int(self.x_slots[s - 1]), M, DTYPE) + float(Q[s])
        self.C, self.S = C, S

    def _slot_choose(self, s: int, e: int, m: int) -> Step:
        U, P = self.u.size, self.pc.fwd_prefix_ms
        if s == U - 1:  # the post: always stored
            return None, m, None, 0
        store = INF
        if m >= self.store_slots[s] and m - self.hold_slots[s] >= 0:
            store = float(self.C[s + 1, m - int(self.hold_slots[s])])
        hi = min(U, s + 1 + self.max_len)
        vals = np.where(self.thr_slots[s, s + 1:hi] <= m, self.S[s + 1:hi, m], INF) - P[s]
        k = int(np.argmin(vals))
        if min(store, vals[k]) == INF:
            raise PlannerBugError(f"flat DP reconstruction reached an infeasible state ({s}, {m})")
        if store <= vals[k]:
            return None, m - int(self.hold_slots[s]), None, 0
        j = s + 1 + k
        return j, m - int(self.x_slots[j - 1]), None, 0

    def slot_ranges(self, m: int) -> list[tuple[int, int]]:
        """The table's own optimal plan at slot ``m`` (see ``CostTable.slot_ranges``)."""
        return reconstruct(self.u.bounds, self.u.size, m, self._slot_choose)

    def _exact_choose(self, s: int, e: int, mb: int) -> Step:
        u, pc, U, slot, M = self.u, self.pc, self.u.size, self.slot, self.M
        P = pc.fwd_prefix_ms
        if s == U - 1:  # the post: always stored
            return None, mb, None, 0

        def est(rows: np.ndarray, left: np.ndarray) -> np.ndarray:
            idx = np.clip((left + self.half) // slot, 0, M)
            v = self.C[rows, idx]
            return np.where(v < INF, v, 1e18 + self.K1[rows])

        store = INF
        if max(pc.store_req[s, U], u.hold[s] + self.R1[s + 1]) <= mb:
            store = float(est(np.array([s + 1]), np.array([mb - u.hold[s]]))[0])
        hi = min(U, s + 1 + self.max_len)
        js = np.arange(s + 1, hi)
        left = mb - u.x_out[js - 1]
        ok = np.maximum(self.thr[s, js], u.x_out[js - 1] + self.R1[js]) <= mb
        vals = np.where(ok, (pc.ckpt_end_ms[js] - P[s]) + est(js, left), INF)
        k = int(np.argmin(vals))
        if min(store, vals[k]) == INF:
            raise PlannerBugError(f"flat DP reconstruction: no feasible option at ({s}, {mb})")
        if store <= vals[k]:
            return None, mb - int(u.hold[s]), None, 0
        j = int(js[k])
        return j, mb - int(u.x_out[j - 1]), None, 0

    def ranges(self, avail: int) -> list[tuple[int, int]]:
        """Like ``CostTable.ranges``: exact feasibility from R1, the table's estimates pick."""
        return reconstruct(self.u.bounds, self.u.size, avail, self._exact_choose)
