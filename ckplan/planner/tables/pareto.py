"""Exact Pareto frontiers of (bytes, recompute) per sub-chain: the least-recompute DP in bytes."""
from __future__ import annotations

import numpy as np

from ...errors import PlannerArgumentError, PlannerBugError
from ..groups import Units
from . import frontier_kernel
from .common import Spans, Step
from .compiled import jitted
from .frontiers import _EMPTY, STORE, Frontier, _envelope, _splits, reach
from .pairs import PairCosts
from .peaks import band, nest_spans, nest_starts
from .reader import reconstruct_options


def _kernel_args(u: Units, pc: PairCosts) -> tuple:
    """The pair costs and unit columns ``_pareto_kernel`` and ``_caps_kernel`` read."""
    i64 = np.int64
    return (np.ascontiguousarray(pc.opt_store_req, dtype=i64), np.ascontiguousarray(u.opt_hold, dtype=i64),
            np.ascontiguousarray(u.opt_ms, dtype=np.float64), np.ascontiguousarray(pc.fnone, dtype=i64),
            np.ascontiguousarray(u.x_out, dtype=i64), np.ascontiguousarray(pc.inner_extra, dtype=i64),
            np.ascontiguousarray(pc.fwd_prefix_ms, dtype=np.float64),
            np.ascontiguousarray(pc.ckpt_end_ms, dtype=np.float64))


def _fresh_state(U: int) -> tuple:
    """``_pareto_kernel``'s state before any frontier: (off, ln, mem, cost, ch, used, ok, most)."""
    return (np.full((U + 1, U + 1), -1, dtype=np.int64), np.zeros((U + 1, U + 1), dtype=np.int64),
            np.empty(1 << 12, dtype=np.int64), np.empty(1 << 12, dtype=np.float64),
            np.empty(1 << 12, dtype=np.int64), 0, True, 0)


class InnerPart:
    """``ParetoTable.inner_part``'s frontiers (the kernel's state), for one table's arguments."""

    def __init__(self, key: tuple, held: tuple, state: tuple):
        self._key, self._held, self._state = key, held, state  # held: the keyed objects stay alive
        self._taken = False

    def check(self, u: Units, pc: PairCosts, R: np.ndarray, top: int, L: int, LT: int,
              max_points: int | None, max_total: int | None, nest: Spans) -> None:
        if self._key != (id(u), id(pc), id(R), top, L, LT, max_points, max_total, nest):
            raise PlannerArgumentError("inner part built for another table (units, pair costs, R, top "
                                       "bytes, band or limits differ)")

    def take_state(self) -> tuple:
        """The state to add the tails to, in place (column ``U`` of ``off``/``ln``, the flat
        arrays past ``used``): the part's own arrays the first time (copying them cost 0.08 s at
        1000 layers), then copies with column ``U`` cleared, so one part serves several tables."""
        off, ln, mem, cost, ch, used, ok, most = self._state
        if not self._taken:
            self._taken = True
            return self._state
        off, ln = off.copy(), ln.copy()
        off[:, -1], ln[:, -1] = -1, 0
        room = used + max(used, 1 << 12)
        grown = []
        for a in (mem, cost, ch):
            b = np.empty(room, dtype=a.dtype)
            b[:used] = a[:used]
            grown.append(b)
        return (off, ln, *grown, used, ok, most)


class ParetoTable:
    """Exact frontiers ``F[(s, e)] = (mem, cost, choice)`` of the sub-chains a plan of the whole
    chain with at most ``top_bytes`` available can reach; ``choice`` is ``-1 - o`` for
    ``Store(s)`` with option column ``o`` (``-1``: store, ``Units.opt_*``), ``j`` for the
    checkpoint ``[s, j)``, or ``U + j`` for a long top-level checkpoint ``[s, j)`` that stores
    every unit inside (``top_len``). ``R`` is the min-peak table (``PeakTable.R``).

    ``top_bytes`` bounds the work: ``cap[s, e]`` (:func:`reach_caps`), the most bytes [s, e)
    can be given, cuts every frontier above it, and sub-chains no plan reaches (their least
    need is above their cap) are skipped. Near the smallest peak most sub-chains are then
    unreachable or have a few breakpoints. One table answers every budget up to ``top_bytes``.

    ``ok`` is False when some frontier exceeded ``max_points``, or all of them together
    ``max_total`` (the table is then unusable).

    ``max_len``, ``top_len``: only plans whose checkpoints span at most ``max_len`` units, except
    top-level ones of up to ``top_len`` (default ``max_len``) units that store every unit inside
    (the banded DP: optimal among those plans; ``R`` should then be
    ``PeakTable(u, pc, max_len, top_len, nest).R``). ``nest``: pairs ``(lo, e)``; a top-level
    checkpoint ``[s, e)`` with ``s >= lo`` of up to ``top_len`` units may also have an inner plan
    of the band (checkpoints of at most ``max_len`` units inside; ``nest_starts``).

    ``trim`` (0: off) thins the tails' frontiers ``F[(s, U)]``, where long chains spend their
    time, at every ``trim_every``-th start ``s`` (``s % trim_every == 0``): of their points (bytes
    up, recompute down) only the first and each one at least ``trim`` (relative) cheaper than the
    last kept survive (:func:`_trim`). Every point left is still a real plan's exact (bytes,
    recompute), so plans fit exactly as before; a thinned tail's least recompute at any budget is
    at most ``1 / (1 - trim)`` times what its parts give, and an untrimmed tail's is exactly what
    its parts give, so the whole chain's is within ``(1 - trim) ** -k`` of the optimum, k the
    number of top-level items (stored units and checkpoints) of an optimal plan that start at a
    thinned tail: at most ``ceil(U / trim_every)``. Thinning every 8th tail by 8 times as much
    keeps that bound and builds half the points (the tails in between grow little). The table
    is then not exact.

    ``trim_abs`` (ms, 0: off) thins the same tails by an absolute amount: a point survives only
    when it is ``trim_abs`` cheaper than the last kept (with ``trim`` too: cheaper than
    ``last x (1 - trim) - trim_abs``). The least recompute is then within ``k x trim_abs`` of
    the optimum (``(optimum + k trim_abs) / (1 - trim) ** k`` with both). Where the tails'
    recompute is small (their last layers), relative thinning keeps points a few microseconds
    apart; absolute thinning keeps at most ``max_cost / trim_abs`` per tail."""

    def __init__(self, u: Units, pc: PairCosts, R: np.ndarray, top_bytes: int,
                 max_points: int | None = None, max_cost: float | None = None,
                 max_len: int | None = None, top_len: int | None = None, trim: float = 0.0,
                 max_total: int | None = None, trim_every: int = 1, trim_abs: float = 0.0,
                 inner: InnerPart | None = None, nest: Spans = ()):
        self.trim_abs = float(trim_abs)
        self.u, self.pc, self.top = u, pc, int(top_bytes)
        if not 0.0 <= trim < 1.0:
            raise PlannerArgumentError(f"trim must be in [0, 1), not {trim}")
        if trim_every < 1:
            raise PlannerArgumentError(f"trim_every must be at least 1, not {trim_every}")
        if not trim_abs >= 0.0:
            raise PlannerArgumentError(f"trim_abs must be at least 0 ms, not {trim_abs}")
        self.trim, self.trim_every = float(trim), int(trim_every)
        U = u.size
        L, LT = band(U, max_len, top_len)
        self.max_len, self.top_len = L, LT
        self.nest = nest_spans(nest)
        nlo = nest_starts(U, L, LT, self.nest)
        sa = pc.store_all if LT > L else np.zeros((1, 1), dtype=np.int64)
        # A plan's parts cost no more than the plan: with an upper bound on the optimum (a
        # plan that fits), dearer breakpoints and checkpoints are never part of an optimal plan.
        ub = np.inf if max_cost is None else float(max_cost) * (1 + 1e-9) + 1e-9
        self.max_cost = ub
        self._flat: tuple | None = None
        self._F: dict[tuple[int, int], Frontier] | None = None
        kernel, caps = jitted("_pareto_kernel", U), jitted("_caps_kernel", U)
        if kernel is None or caps is None:
            self._build_numpy(R, ub, max_points, L, LT, sa, max_total, nlo)
            return
        args = _kernel_args(u, pc)
        Ri = np.ascontiguousarray(R, dtype=np.int64)
        cap, kcap = caps(U, Ri, self.top, ub, *args, L, LT, sa, nlo)
        limits = (-1 if max_points is None else int(max_points), L, LT, sa, self.trim,
                  -1 if max_total is None else int(max_total), self.trim_every, self.trim_abs, nlo)
        if inner is None:
            state = _fresh_state(U)
            e_lo = 1
        else:  # the sub-chains ending before the last unit, built beforehand
            inner.check(u, pc, R, self.top, L, LT, max_points, max_total, self.nest)
            state = inner.take_state()
            e_lo = U
            if not state[6]:
                e_lo = U + 1  # the inner part alone outgrew the limits: nothing more to build
        off, ln, mem, cost, ch, used, ok, most = (
            kernel(U, Ri, cap, kcap, *args, *limits, e_lo, U, *state[:6], state[7])
            if e_lo <= U else state)
        self._flat = (off, ln, mem[:used], cost[:used], ch[:used])
        self.ok, self.n_points, self.total_points = bool(ok), int(most), int(used)

    @staticmethod
    def inner_part(u: Units, pc: PairCosts, R: np.ndarray, top_bytes: int,
                   max_points: int | None = None, max_len: int | None = None,
                   top_len: int | None = None, max_total: int | None = None,
                   nest: Spans = ()) -> InnerPart | None:
        """The frontiers of the sub-chains ``[s, e)`` with ``e < U`` of the table with these
        arguments at *any* recompute bound (caps from ``top_bytes`` alone), for
        ``ParetoTable(..., inner=...)`` to build only the tails ``[s, U)`` on: the tails it then
        builds equal those of a table built whole (a sub-chain's frontier within the caps of a
        bound is its frontier at no bound cut to them, and the tails cut what they read to their
        own caps). They need no bound, so a caller can build them while it looks for one
        (``solve.plan_dp``: beside the coarse plan). None without the compiled kernels."""
        U = u.size
        kernel, caps = jitted("_pareto_kernel", U), jitted("_caps_kernel", U)
        if kernel is None or caps is None:
            return None
        L, LT = band(U, max_len, top_len)
        spans = nest_spans(nest)
        nlo = nest_starts(U, L, LT, spans)
        sa = pc.store_all if LT > L else np.zeros((1, 1), dtype=np.int64)
        args = _kernel_args(u, pc)
        Ri = np.ascontiguousarray(R, dtype=np.int64)
        cap, kcap = caps(U, Ri, int(top_bytes), np.inf, *args, L, LT, sa, nlo)
        state = _fresh_state(U)
        out = kernel(U, Ri, cap, kcap, *args, -1 if max_points is None else int(max_points), L, LT,
                     sa, 0.0, -1 if max_total is None else int(max_total), 1, 0.0, nlo, 1, U - 1,
                     *state[:6], state[7])
        return InnerPart((id(u), id(pc), id(R), int(top_bytes), L, LT, max_points, max_total, spans),
                         (u, pc, R), out)

    def _build_numpy(self, R: np.ndarray, ub: float, max_points: int | None, L: int,
                     LT: int, sa: np.ndarray, max_total: int | None, nlo: np.ndarray) -> None:
        """The frontiers with numpy (without numba): every option's breakpoints at once."""
        u, pc = self.u, self.pc
        U = u.size
        P = pc.fwd_prefix_ms
        xo = u.x_out
        cap, kcap = reach(u, pc, R, self.top, ub, L, LT, self.nest)
        ohold, oms = u.opt_hold, u.opt_ms
        self.ok = True
        self.n_points = self.total_points = 0
        F: dict[tuple[int, int], Frontier] = {}
        shifted: dict[tuple[int, int], Frontier] = {}  # F[j, e] as the rest of [., j): + x[j-1]
        i64 = np.int64
        for e in range(1, U + 1):
            for s in range(e - 1, -1, -1):
                c_se, k_se = int(cap[s, e]), float(kcap[s, e])
                if c_se < R[s, e] or k_se < 0:
                    continue  # no plan within top_bytes (and ub ms) reaches [s, e)
                mems, costs, chs = [], [], []
                # Store(s) with each of its options (o = 0: store)
                for o in [o for o in range(u.n_options) if o == 0 or oms[s, o] <= k_se]:
                    sr, ho, ms = int(pc.opt_store_req[o, s, e]), int(ohold[s, o]), float(oms[s, o])
                    if s + 1 == e:
                        mems.append(np.array([sr], dtype=i64))
                        costs.append(np.full(1, ms))
                        chs.append(np.full(1, STORE - o, dtype=i64))
                    elif max(sr, ho + int(R[s + 1, e])) <= c_se:
                        rm, rc, _ = F[(s + 1, e)]
                        mems.append(np.maximum(rm + ho, sr))
                        costs.append(rc + ms if o else rc)
                        chs.append(np.full(len(rm), STORE - o, dtype=i64))
                if e - s >= 2:
                    js = np.arange(s + 1, min(e, s + (L if e < U else max(L, LT)) + 1))
                    js = js[nlo[js] <= s]  # over L units: top-level, at a nest end
                    need = np.maximum(np.maximum(pc.fnone[s, js], xo[js - 1] + R[js, e]),
                                      pc.inner_extra[js, e] + R[s, js])
                    js = js[(need <= c_se) & (pc.ckpt_end_ms[js] - P[s] <= k_se)]
                    if len(js):
                        seg = _splits(s, e, js, shifted, F, pc, P, c_se)
                        mems.append(seg[0])
                        costs.append(seg[1])
                        chs.append(seg[2])
                if e == U and LT > L:  # long top-level checkpoints, every unit inside stored
                    js = np.arange(s + L + 1, min(e, s + LT + 1))  # (choice U + j)
                    fixed = np.maximum(pc.fnone[s, js], pc.inner_extra[js, e] + sa[s, js])
                    dps = pc.ckpt_end_ms[js] - P[s]
                    ok = (np.maximum(fixed, xo[js - 1] + R[js, e]) <= c_se) & (dps <= k_se)
                    for j, fx, d in zip(js[ok].tolist(), fixed[ok].tolist(), dps[ok].tolist()):
                        rm, rc, _ = shifted[(j, e)]
                        mems.append(np.maximum(rm, fx))
                        costs.append(rc + d)
                        chs.append(np.full(len(rm), U + j, dtype=i64))
                f = _envelope(np.concatenate(mems), np.concatenate(costs), np.concatenate(chs),
                              c_se, k_se) if mems else _EMPTY
                if (self.trim > 0 or self.trim_abs > 0) and e == U and s % self.trim_every == 0 and len(f[0]) > 1:
                    # fresh arrays: trimmed in place
                    k = frontier_kernel._trim(f[0], f[1], f[2], len(f[0]), self.trim, self.trim_abs)
                    f = (f[0][:k], f[1][:k], f[2][:k])
                F[(s, e)] = f
                k = len(f[0])
                self.n_points = max(self.n_points, k)
                self.total_points += k
                if ((max_points is not None and k > max_points)
                        or (max_total is not None and self.total_points > max_total)):
                    self.ok = False
                    self._F = F
                    return
                if s >= 1:
                    shifted[(s, e)] = (f[0] + int(xo[s - 1]), f[1], np.full(k, s, dtype=i64))
        self._F = F

    @property
    def F(self) -> dict[tuple[int, int], Frontier]:
        """Every frontier built, keyed ``(s, e)``."""
        if self._F is None:
            assert self._flat is not None
            ss, es = np.nonzero(self._flat[0] >= 0)
            self._F = {(int(a), int(b)): self._get(int(a), int(b)) for a, b in zip(ss, es)}
        return self._F

    def _get(self, s: int, e: int) -> Frontier:
        if self._flat is None:
            assert self._F is not None
            return self._F.get((s, e), _EMPTY)
        off, ln, mem, cost, ch = self._flat
        b = int(off[s, e])
        if b < 0:
            return _EMPTY
        k = b + int(ln[s, e])
        return mem[b:k], cost[b:k], ch[b:k]


    def cost(self, avail: int) -> float:
        """Least recompute of the whole chain with ``avail`` bytes (inf when infeasible)."""
        if avail > self.top:
            raise PlannerArgumentError(f"the table answers up to {self.top} bytes, not {avail}")
        m, c, _ = self._get(0, self.u.size)
        k = int(np.searchsorted(m, avail, side="right")) - 1
        return float(c[k]) if k >= 0 else float("inf")

    def frontier(self) -> tuple[np.ndarray, np.ndarray]:
        """The whole chain's breakpoints: (bytes above the start, least recompute)."""
        m, c, _ = self._get(0, self.u.size)
        return m, c

    def _choose(self, s: int, e: int, mb: int) -> Step:
        m, _, ch = self._get(s, e)
        k = int(np.searchsorted(m, mb, side="right")) - 1
        if k < 0:
            raise PlannerBugError(f"Pareto DP reconstruction: no plan of [{s}, {e}) fits {mb} bytes")
        j = int(ch[k])
        if j <= STORE:
            o = STORE - j
            return None, mb - int(self.u.opt_hold[s, o]), None, o
        U = self.u.size
        if j > U:  # a long top-level checkpoint [s, j - U): every unit inside stored
            return j - U, mb - int(self.u.x_out[j - U - 1]), None, 0
        return j, mb - int(self.u.x_out[j - 1]), mb - int(self.pc.inner_extra[j, e]), 0

    def ranges(self, avail: int) -> list[tuple[int, int]]:
        """Checkpointed layer ranges of the optimal plan with ``avail`` bytes above the start."""
        return self.parts(avail)[0]

    def parts(self, avail: int) -> tuple[list[tuple[int, int]], dict[int, int]]:
        """``ranges`` and the selective option of each unit stored with one."""
        if avail > self.top:
            raise PlannerArgumentError(f"the table answers up to {self.top} bytes, not {avail}")
        return reconstruct_options(self.u.bounds, self.u.size, avail, self._choose)
