"""The DP's tables: pair costs, least recompute (nested and depth-1, in slots; nested in exact
bytes) and least peak, and the one
routine that reads a plan out of any of them. The solver that builds and reads them is ``dp.py``
(its docstring states the recursion these tables implement).

Legend (the names follow rotor's paper and stay short because the array code is dense):

* ``U``: number of units (groups of layers, ``groups.py``; the post stage is the last unit);
  ``s``/``j``/``e``: unit indices, a sub-sequence is ``[s, e)`` and a checkpoint ``[s, j)``.
* ``M``: the top slot (slots ``m = 0..M``); ``slot``: bytes per slot; ``m``/``mb``: memory
  available above the start of a sub-sequence, in slots / in exact bytes.
* ``fwd_prefix_ms[j]``: forward time of units ``< j`` (rotor's P), and ``ckpt_end_ms[j]`` (Q) the
  same less the tail of unit ``j-1`` (``Layer.tail_ms``: what PyTorch's checkpoint does not redo
  after the last saved tensor), so a checkpoint ``[s, j)`` recomputes ``Q[j] - P[s]``.
* Pair costs (:class:`PairCosts`, exact bytes): ``store_req[s, e]`` what ``Store(s)`` needs in a
  sequence ending at ``e`` (``opt_store_req[o, s, e]`` the same with selective option ``o``,
  ``o = 0`` being ``store``; options are the ``opt_*`` columns of ``Units``);
  ``inner_extra[j, e]`` how much more the inner plan of a checkpoint ending at ``j`` starts with;
  ``fnone[s, j]`` the peak of the forward of ``[s, j)`` keeping no activations; ``grads[j, e]``
  the parameter gradients of units ``j..e-1``.
* ``*_slots``: the same quantities rounded to slots (``hold_slots``, ``x_slots``,
  ``store_slots``, ``inner_slots``, ``fnone_slots``, ``thr_slots``).
* ``C``: least recompute; ``R``: least bytes (min-peak table); ``K``: recompute of the plan
  reaching ``R`` (a tie-break).
* ``ParetoTable`` (end of the file): ``C`` in exact bytes, ``F[(s, e)] = (mem, cost, choice)``
  breakpoints per sub-chain; ``cap[s, e]`` the most bytes a sub-chain can be given, ``ub`` the
  recompute of a plan known to fit.
* The band ``(L, LT)`` (``band``; ``PeakTable``/``ParetoTable``'s ``max_len``/``top_len``,
  ``dp.banded_plan``): plans whose checkpoints span at most ``L`` units, except top-level ones of
  up to ``LT`` units that store every unit inside (``store_all[s, j]``, ``PairCosts``; choice
  ``U + j`` in the frontiers). Only the tails ``[s, U)`` and sub-chains of at most ``L`` units
  are reached. ``nest`` (``Spans``, pairs ``(lo, e)``): a top-level checkpoint ``[s, e)`` with
  ``s >= lo`` may also span up to ``LT`` units with an inner plan of the band (choice ``e``, as
  any checkpoint); the sub-chains ``[s, e)`` down to ``nlo[e]`` (``nest_starts``) are then
  reached too.
"""
from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from functools import cached_property
from typing import Any

import numpy as np

from .chain import Chain
from .groups import Units

INF = np.inf
BIG = np.int64(2**62)  # bytes nothing satisfies
TOP = np.int64(2**63 - 1)  # above BIG plus any size
SMALL_UNITS = 64  # tables up to this many units use float64

# A reconstruction step: (j, m for the rest, m for the inner plan, option). ``j`` is None for
# ``Store(s)`` (with option column ``option``, 0 = ``store``), else the checkpoint is ``[s, j)``
# (option 0); an inner plan of None means "store all".
Step = tuple["int | None", int, "int | None", int]
Chooser = Callable[[int, int, int], Step]


def fixed_peak(chain: Chain) -> int:
    """The part of the peak no plan changes: pre forward/backward and the optimizer step (side
    inputs counted as live throughout, as in ``base_bytes``)."""
    p, pre = chain.persistent_bytes + chain.side_bytes + chain.side_grad_bytes + chain.unsaved_bytes, chain.pre
    grads = sum(ly.grad_bytes for ly in chain.layers) + chain.post.grad_bytes
    pre_b = p + pre.retained_bytes + chain.delta_in_bytes + grads + chain.post.backward_hold_bytes
    pre_after = pre_b + pre.grad_bytes - pre.retained_bytes - chain.delta_in_bytes
    return max(p + pre.retained_bytes + pre.fwd_tmp_bytes, pre_b + pre.bwd_tmp_bytes, pre_after,
               chain.opt_step_peak_bytes)


def base_bytes(chain: Chain) -> int:
    """Memory at the start of the chain's forward: persistent + what pre keeps + the side inputs
    (``Chain.side_inputs``). The tables take the side inputs as live until the step ends: the
    simulator frees them earlier (when the chain's forward ends, or after the backward of the
    first item holding their layers), so every plan peaks no higher than the tables say and a
    plan they fit fits; near the smallest peak the tables may give up at most ``side_bytes``.
    The side inputs' gradients (``SideInput.grad_bytes``) and what checkpointed layers keep
    outside saved tensors (``Layer.unsaved_kept_bytes``, all layers') are counted the same way."""
    return (chain.persistent_bytes + chain.pre.retained_bytes + chain.side_bytes + chain.side_grad_bytes
            + chain.unsaved_bytes)


def ceil_div(a: Any, q: int) -> Any:
    return -((-a) // q)


def near_div(a: Any, q: int) -> Any:
    """Nearest slot count, but never 0 for a positive size (a free boundary or a free layer
    would bias every estimate the same way)."""
    n = (a + q // 2) // q
    return np.where((a > 0) & (n < 1), 1, n)


def shift(a: np.ndarray, d: int, M: int, dtype: Any, add: np.ndarray | None = None) -> np.ndarray:
    """``out[..., m] = a[..., min(m - d, M)] (+ add[m])`` along the last axis: infeasible
    (INF) where ``m - d < 0``; a negative ``d`` reads the top slot ``M`` past the end."""
    out = np.empty(a.shape, dtype=dtype)

    def put(dst: np.ndarray, src: np.ndarray, extra: np.ndarray | None) -> None:
        if extra is None:
            dst[...] = src
        else:
            np.add(src, extra, out=dst)

    if d >= 0:
        d = min(d, M + 1)
        out[..., :d] = INF
        put(out[..., d:], a[..., :M + 1 - d], None if add is None else add[d:])
    else:
        d = max(d, -(M + 1))
        k = M + 1 + d
        put(out[..., :k], a[..., -d:], None if add is None else add[:k])
        put(out[..., k:], a[..., M:M + 1], None if add is None else add[k:])
    return out


class PairCosts:
    """Derived pair quantities of a unit chain, in exact bytes (U x (U+1) int64)."""

    def __init__(self, u: Units):
        U = u.size
        gp = np.concatenate([[0], np.cumsum(u.grad)])
        self._gp = gp
        self.fwd_prefix_ms = np.concatenate([[0.0], np.cumsum(u.fwd_ms)])
        # Q: a checkpoint [s, j) recomputes ckpt_end_ms[j] - fwd_prefix_ms[s], its units' forward
        # less the tail of unit j-1 (Layer.tail_ms); Q[0] = 0
        self.ckpt_end_ms = self.fwd_prefix_ms - np.concatenate([[0.0], u.tail_ms])
        xo = u.x_out
        n_opt = u.n_options
        xe = np.concatenate([[0], xo]).astype(np.int64)  # xe[e] = x_out[e - 1]
        lead = np.zeros(U + 1, dtype=np.int64)  # lead[j] = Units.lead[j - 1]
        if u.lead is not None:
            lead[1:] = u.lead[:U]
        # store_req[s, e]: what Store(s) needs (its forward, and its backward once the rest of a
        # sequence ending at e is done); opt_store_req[o] the same with option o (BIG + small
        # where unit s has no option o). inner_extra[j, e] (1 <= j < e): how much more the inner
        # plan of a checkpoint ending at j starts with than the sequence [., e) it belongs to:
        # the rest's gradients and x[j-1]'s gradient are there (and Units.lead), x[e-1]'s
        # gradient is gone. fnone[s, j] (j <= U-1): forward-without-saving peak of units
        # s..j-1, max(fn_first[s], fn_next[s+1..j-1]).
        fr = np.ascontiguousarray(np.column_stack([u.fwd_req] + [u.opt_fwd_req[:, o] for o in range(1, n_opt)]),
                                  dtype=np.int64)
        br = np.ascontiguousarray(np.column_stack([u.bwd_req] + [u.opt_bwd_req[:, o] for o in range(1, n_opt)]),
                                  dtype=np.int64)
        kernel = jitted("_pair_kernel", U)
        args = (U, np.ascontiguousarray(gp, dtype=np.int64), xe, lead, fr, br,
                np.ascontiguousarray(u.fn_first, dtype=np.int64),
                np.ascontiguousarray(u.fn_next, dtype=np.int64))
        self.opt_store_req, self.inner_extra, self.fnone = (kernel or _pair_numpy)(*args)
        self.store_req = self.opt_store_req[0]
        # A sub-chain ending before the post ends a recompute (only inner plans reach it): a unit
        # stored last there runs as PyTorch's early stop leaves it (Units.fwd_req_stop).
        if u.fwd_req_stop is not None and U > 1:
            ends = np.arange(1, U)
            self.store_req[ends - 1, ends] = np.maximum(u.fwd_req_stop[ends - 1],
                                                        u.bwd_req[ends - 1] - xo[ends - 1])
        # The top level's backward (sub-chains [s, U), the post last) runs beside the loss and
        # its seed (Units.bwd_extra): a unit's backward there, and the inner plan of a checkpoint
        # there (whose forwards were measured without them); inner plans inherit it.
        c = int(u.bwd_extra)
        if c:
            for o in range(n_opt):
                self.opt_store_req[o, :U - 1, U] = np.maximum(
                    u.opt_fwd_req[:U - 1, o] if o else u.fwd_req[:U - 1],
                    (u.opt_bwd_req[:U - 1, o] if o else u.bwd_req[:U - 1])
                    + self.grads_to_end[1:U] - xo[U - 1] + c)
            self.inner_extra[1:U, U] += c
        # A checkpoint cannot span a break (Chain.breaks): such ranges need more than any budget.
        for b in u.breaks:
            from_before = np.array([a for a, _ in u.bounds]) < b
            to_after = np.array([c for _, c in u.bounds]) > b
            span = from_before[:U - 1, None] & to_after[None, :U - 1]  # span[s, j - 1]: [s, j) crosses b
            self.fnone[:U - 1, 1:U][span] = BIG
        self.hold = u.hold

    @cached_property
    def grads(self) -> np.ndarray:
        """``grads[j, e]``: the parameter gradients of units j..e-1 ((U+1) x (U+1), on first use)."""
        return self._gp[None, :] - self._gp[:, None]

    @property
    def grads_to_end(self) -> np.ndarray:
        """``grads[j, U]`` for j = 0..U."""
        return self._gp[-1] - self._gp

    @cached_property
    def store_all(self) -> np.ndarray:
        """``store_all[s, e]``: the least bytes above the start of the plan of [s, e) that stores
        every unit (``store``): the recursion's ``Store`` branch all the way. BIG where e <= s.
        The inner plan of the banded DP's long top-level checkpoints."""
        sr = self.store_req
        U = sr.shape[0]
        out = np.full((U + 1, U + 1), BIG, dtype=np.int64)
        for s in range(U - 1, -1, -1):
            out[s, s + 1] = sr[s, s + 1]
            if s + 2 <= U:
                out[s, s + 2:] = np.maximum(sr[s, s + 2:], self.hold[s] + out[s + 1, s + 2:])
        return out


def _pair_numpy(U: int, gp: np.ndarray, xe: np.ndarray, lead: np.ndarray, fr: np.ndarray,
                br: np.ndarray, fn_first: np.ndarray, fn_next: np.ndarray) -> tuple:
    """``PairCosts``' (opt_store_req, inner_extra, fnone), vectorised (``_pair_kernel``'s
    numpy twin: tests compare them)."""
    n_opt = fr.shape[1]
    cols = np.arange(U + 1)
    below = cols[None, :] > np.arange(U)[:, None]  # below[s, e]: s < e
    later = gp[None, :] - gp[1:U + 1, None] - xe[None, :]  # grads of s+1..e-1, less x[e-1]
    osr = np.zeros((n_opt, U, U + 1), dtype=np.int64)
    for o in range(n_opt):
        np.copyto(osr[o], np.maximum(fr[:U, o, None], br[:U, o, None] + later), where=below)
    inner = np.zeros((U + 1, U + 1), dtype=np.int64)
    np.copyto(inner, gp[None, :] - gp[:, None] - xe[None, :] + (xe + lead)[:, None],
              where=(cols[None, :] > cols[:, None]) & (cols[:, None] >= 1))
    fnone = np.full((U, U + 1), BIG, dtype=np.int64)
    if U > 1:
        run = np.where(cols[None, 1:U] - 1 > np.arange(U - 1)[:, None], fn_next[None, :U - 1],
                       np.iinfo(np.int64).min)
        run[np.arange(U - 1), np.arange(U - 1)] = fn_first[:U - 1]
        np.maximum.accumulate(run, axis=1, out=run)
        fnone[:U - 1, 1:U] = np.where(below[:U - 1, 1:U], run, BIG)
    return osr, inner, fnone


def _pair_kernel(U: int, gp: np.ndarray, xe: np.ndarray, lead: np.ndarray, fr: np.ndarray,
                 br: np.ndarray, fn_first: np.ndarray, fn_next: np.ndarray) -> tuple:
    """:func:`_pair_numpy`, compiled (one pass, no temporaries: 1000 units 0.09 -> 0.02 s)."""
    n_opt = fr.shape[1]
    osr = np.zeros((n_opt, U, U + 1), dtype=np.int64)
    inner = np.zeros((U + 1, U + 1), dtype=np.int64)
    fnone = np.full((U, U + 1), BIG, dtype=np.int64)
    for s in range(U):
        for e in range(s + 1, U + 1):
            later = gp[e] - gp[s + 1] - xe[e]
            for o in range(n_opt):
                osr[o, s, e] = max(fr[s, o], br[s, o] + later)
    for j in range(1, U + 1):
        base = xe[j] + lead[j] - gp[j]
        for e in range(j + 1, U + 1):
            inner[j, e] = gp[e] - xe[e] + base
    for s in range(U - 1):
        run = fn_first[s]
        fnone[s, s + 1] = run
        for j in range(s + 2, U):
            if fn_next[j - 1] > run:
                run = fn_next[j - 1]
            fnone[s, j] = run
    return osr, inner, fnone


def reconstruct(bounds: tuple[tuple[int, int], ...], stop: int, m0: int, choose: Chooser,
                start: int = 0) -> list[tuple[int, int]]:
    """The checkpointed *layer* ranges of ``reconstruct_options``' plan."""
    return reconstruct_options(bounds, stop, m0, choose, start)[0]


def reconstruct_options(bounds: tuple[tuple[int, int], ...], stop: int, m0: int, choose: Chooser,
                        start: int = 0) -> tuple[list[tuple[int, int]], dict[int, int]]:
    """The one plan reader: walk units ``[start, stop)`` taking ``choose``'s step at every unit,
    and the inner plan of every checkpoint the same way; return the checkpointed *layer* ranges
    and ``{unit: option column}`` for the units stored with a selective option (every unit is
    stored exactly once, at its innermost depth; ``Units.option_names`` gives the names).
    Iterative: plans can nest deeper than Python's recursion limit."""
    out: list[tuple[int, int]] = []
    opts: dict[int, int] = {}
    todo = [(start, stop, m0)]
    while todo:
        s, e, m = todo.pop()
        while s < e:
            j, m_rest, m_inner, o = choose(s, e, m)
            if j is None:
                if o:
                    opts[s] = o
                s += 1
            else:
                out.append((bounds[s][0], bounds[j - 1][1]))
                if m_inner is not None:
                    todo.append((s, j, m_inner))
                s = j
            m = m_rest
    return out, opts


def exact_chooser(u: Units, pc: PairCosts, R: np.ndarray, K: np.ndarray,
                  estimate: Callable[[int, int, int, float], float] | None,
                  long: tuple[int, int] | None = None) -> Chooser:
    """Steps in exact bytes: an option is taken only if its own needs and its sub-chains'
    smallest needs ``R`` fit; among those ``estimate(s, e, bytes, K[s, e])`` picks (plus the
    recompute of a selective option of ``Store(s)``); ``estimate=None`` is ``K`` itself
    (checkpoints then ranked all at once). Feasibility of the checkpoints is checked at once.
    ``long=(L, LT)`` (with ``estimate=None``): the banded tables' long top-level checkpoints too
    (``PeakTable(u, pc, L, LT)``)."""
    P, Q, xo = pc.fwd_prefix_ms, pc.ckpt_end_ms, u.x_out
    n_opt = u.n_options
    U = u.size

    def choose(s: int, e: int, mb: int) -> Step:
        best: tuple[float, int | None] | None = None
        bo = 0
        for o in range(n_opt):
            h, ms = int(u.opt_hold[s, o]), float(u.opt_ms[s, o])
            if o and ms == INF:
                continue
            if s + 1 == e:
                if pc.opt_store_req[o, s, e] <= mb and (best is None or ms < best[0]):
                    best, bo = (ms, None), o
            elif max(pc.opt_store_req[o, s, e], h + R[s + 1, e]) <= mb:
                k1 = K[s + 1, e]
                est = (k1 if estimate is None else estimate(s + 1, e, mb - h, k1)) + ms
                if best is None or est < best[0]:
                    best, bo = (est, None), o
        js = np.arange(s + 1, e)
        need = np.maximum(np.maximum(pc.fnone[s, js], xo[js - 1] + R[js, e]),
                          pc.inner_extra[js, e] + R[s, js])
        js = js[need <= mb]
        if estimate is None:
            if len(js):  # the sums of the loop below, all at once
                ests = ((Q[js] - P[s]) + K[s, js]) + K[js, e]
                k = int(np.argmin(ests))  # the first least, as the loop's strict <
                if best is None or ests[k] < best[0]:
                    best = (ests[k], int(js[k]))
            if long is not None and e == U:  # long checkpoints, every unit inside stored
                jl = np.arange(s + long[0] + 1, min(e, s + long[1] + 1))
                need = np.maximum(np.maximum(pc.fnone[s, jl], xo[jl - 1] + R[jl, e]),
                                  pc.inner_extra[jl, e] + pc.store_all[s, jl])
                jl = jl[need <= mb]
                if len(jl):
                    ests = (Q[jl] - P[s]) + K[jl, e]
                    k = int(np.argmin(ests))
                    if best is None or ests[k] < best[0]:
                        best = (ests[k], U + int(jl[k]))
        else:
            for j in js.tolist():
                est = ((Q[j] - P[s]) + estimate(s, j, mb - int(pc.inner_extra[j, e]), K[s, j])
                       + estimate(j, e, mb - int(xo[j - 1]), K[j, e]))
                if best is None or est < best[0]:
                    best = (est, j)
        if best is None:
            raise RuntimeError(f"DP reconstruction: no feasible option at ({s}, {e}, {mb})")
        pick = best[1]
        if pick is None:
            return None, mb - int(u.opt_hold[s, bo]), None, bo
        if pick > U:  # long: no inner plan to read
            return pick - U, mb - int(xo[pick - U - 1]), None, 0
        return pick, mb - int(xo[pick - 1]), mb - int(pc.inner_extra[pick, e]), 0

    return choose


class CostTable:
    """``C[s, e, m]``: least recompute of every sub-sequence, for slots ``m = 0..M``;
    ``Store(s)`` takes the best of the unit's selective options (``Units.opt_*``)."""

    def __init__(self, u: Units, pc: PairCosts, slot: int, M: int, rounding: str):
        self.u, self.pc, self.slot, self.M = u, pc, slot, M
        # float32 halves memory and time on big tables (costs keep ~7 significant digits);
        # small tables stay float64 so that brute-force comparisons are exact.
        self.dtype = DTYPE = np.float64 if u.size <= SMALL_UNITS else np.float32
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
            raise RuntimeError(f"DP reconstruction reached an infeasible state ({s}, {e}, {m})")
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
        self.dtype = DTYPE = np.float64 if U <= SMALL_UNITS else np.float32
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
            raise RuntimeError(f"flat DP reconstruction reached an infeasible state ({s}, {m})")
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
            raise RuntimeError(f"flat DP reconstruction: no feasible option at ({s}, {mb})")
        if store <= vals[k]:
            return None, mb - int(u.hold[s]), None, 0
        j = int(js[k])
        return j, mb - int(u.x_out[j - 1]), None, 0

    def ranges(self, avail: int) -> list[tuple[int, int]]:
        """Like ``CostTable.ranges``: exact feasibility from R1, the table's estimates pick."""
        return reconstruct(self.u.bounds, self.u.size, avail, self._exact_choose)


def band(U: int, max_len: int | None, top_len: int | None) -> tuple[int, int]:
    """The band ``(L, LT)``: checkpoints span at most L units, except top-level ones of up to LT
    units that store every unit inside (``U``, ``U``: unrestricted, the exact DP)."""
    L = U if max_len is None else max(1, min(int(max_len), U))
    return L, (L if top_len is None else max(1, min(int(top_len), U)))


Spans = tuple[tuple[int, int], ...]  # ``(lo, e)`` pairs: ``nest`` of the banded tables


def nest_starts(U: int, L: int, LT: int, nest: Spans = ()) -> np.ndarray:
    """``nlo[e]``: the first start ``s`` of the sub-chains ``[s, e)``, ``e < U``, that a plan of
    the band reaches: ``e - L``, or, for each ``(lo, e)`` of ``nest``, ``max(lo, e - max(L,
    LT))``: there a top-level checkpoint ``[s, e)`` with ``s >= lo`` may be longer than L units
    with an inner plan of the band (checkpoints of at most ``L`` units inside)."""
    nlo = np.maximum(np.arange(U + 1, dtype=np.int64) - L, 0)
    for lo, e in nest:
        if 0 < e < U:
            nlo[e] = min(nlo[e], max(0, lo, e - max(L, LT)))
    return nlo


def nest_spans(nest: Spans) -> Spans:
    """``nest`` in a canonical form (each end once, with its lowest start; sorted)."""
    low: dict[int, int] = {}
    for lo, e in nest:
        low[int(e)] = min(low.get(int(e), int(lo)), int(lo))
    return tuple(sorted((lo, e) for e, lo in low.items()))


def _skew(A: np.ndarray, n: int, ns: int) -> np.ndarray:
    """View V[k-1, s] = A[n-k, s+k] for k = 1..n-1, s < ns (A is (W, W), C-contiguous):
    the table entry of the sub-chain [s+k, s+n) when A is stored by (length, start)."""
    W = A.shape[1]
    it = A.itemsize
    start = A[n - 1, 1:]
    return np.lib.stride_tricks.as_strided(start, shape=(n - 1, ns), strides=(-(W - 1) * it, it),
                                           writeable=False)


def _diag(v: np.ndarray, off: int, n: int, ns: int) -> np.ndarray:
    """View V[k-1, s] = v[s + k - 1 + off] for k = 1..n-1, s < ns."""
    it = v.itemsize
    return np.lib.stride_tricks.as_strided(v[off:], shape=(n - 1, ns), strides=(it, it),
                                           writeable=False)


class PeakTable:
    """``R[s, e]``: the least bytes above the start for which [s, e) has a plan (exact ints),
    with ``K[s, e]`` the least recompute among the options reaching it (a tie-break only).
    ``Store(s)`` takes the best of the unit's selective options (``Units.opt_*``).

    ``max_len``, ``top_len`` (the banded DP, ``ParetoTable``): plans whose checkpoints span at
    most ``max_len`` units, except top-level ones of up to ``top_len`` (default ``max_len``)
    units that store every unit inside (``PairCosts.store_all``), or, where ``nest`` allows it,
    that nest checkpoints of at most ``max_len`` units inside. Only the entries such plans of
    ``[0, U)`` reach are filled (tails ``[s, U)``, sub-chains of at most ``max_len`` units and
    those of ``nest``), the others stay infeasible."""

    def __init__(self, u: Units, pc: PairCosts, max_len: int | None = None,
                 top_len: int | None = None, nest: Spans = ()):
        # Sub-chains are solved by increasing length n = e - s, all starts at once: every
        # option of a length-n sub-chain only needs shorter ones. Tables are stored by
        # (length, start), so "the rest [s+k, s+n)" is a skewed strided view (_skew).
        U = u.size
        W = U + 1
        L, LT = band(U, max_len, top_len)
        self.u, self.pc, self.max_len, self.top_len = u, pc, L, LT
        self.nest = nest_spans(nest)
        nlo = nest_starts(U, L, LT, self.nest)
        sa = pc.store_all if LT > L else np.zeros((1, 1), dtype=np.int64)
        kernel = jitted("_peak_kernel", U)
        if kernel is not None:
            i64 = np.int64
            self.R, self.K = kernel(
                U, np.ascontiguousarray(pc.opt_store_req, dtype=i64),
                np.ascontiguousarray(u.opt_hold, dtype=i64), np.ascontiguousarray(u.opt_ms, dtype=np.float64),
                np.ascontiguousarray(pc.fnone, dtype=i64), np.ascontiguousarray(u.x_out, dtype=i64),
                np.ascontiguousarray(pc.inner_extra.T, dtype=i64),
                np.ascontiguousarray(pc.fwd_prefix_ms, dtype=np.float64),
                np.ascontiguousarray(pc.ckpt_end_ms, dtype=np.float64), L, LT, sa, nlo)
            return
        ln, st = np.meshgrid(np.arange(W), np.arange(W), indexing="ij")
        en = ln + st
        ok = (en <= U) & (st < U)
        sc, ec = np.where(ok, st, 0), np.where(ok, en, 0)
        FN = np.where(ok, pc.fnone[sc, ec], BIG)  # FN[k, s] = fnone(s, s + k)
        n_opt = u.n_options
        # SR[o][n, s] = opt_store_req(o, s, s + n)
        SR = [np.where(ok, pc.opt_store_req[o][sc, ec], BIG) for o in range(n_opt)]
        opt_ok = [np.isfinite(u.opt_ms[:, o]) for o in range(n_opt)]
        # DL[n, j] = inner_extra(j, j + n)
        DL = np.where(en <= U, pc.inner_extra[st, np.where(en <= U, en, 0)], 0)
        P, Q = pc.fwd_prefix_ms, np.ascontiguousarray(pc.ckpt_end_ms, dtype=np.float64)
        xo = u.x_out
        D = np.full((W, W), BIG, dtype=np.int64)  # D[n, s] = R(s, s + n)
        KD = np.zeros((W, W))  # KD[n, s] = K(s, s + n)
        for n in range(1, U + 1):
            ns = U - n + 1
            if n == 1:
                D[1, :ns], KD[1, :ns] = SR[0][1, :ns], 0.0
                for o in range(1, n_opt):  # the least need, then the least recompute
                    r1, k1 = SR[o][1, :ns], u.opt_ms[:ns, o]
                    better = opt_ok[o][:ns] & ((r1 < D[1, :ns]) | ((r1 == D[1, :ns]) & (k1 < KD[1, :ns])))
                    D[1, :ns] = np.where(better, r1, D[1, :ns])
                    KD[1, :ns] = np.where(better, k1, KD[1, :ns])
                continue
            sr = np.maximum(SR[0][n, :ns], u.hold[:ns] + D[n - 1, 1:ns + 1])
            sk = KD[n - 1, 1:ns + 1]
            for o in range(1, n_opt):
                ro = np.maximum(SR[o][n, :ns], u.opt_hold[:ns, o] + D[n - 1, 1:ns + 1])
                ko = KD[n - 1, 1:ns + 1] + u.opt_ms[:ns, o]
                better = opt_ok[o][:ns] & ((ro < sr) | ((ro == sr) & (ko < sk)))
                sr, sk = np.where(better, ro, sr), np.where(better, ko, sk)
            nj = min(n - 1, L)  # checkpoints [s, s + k) for k <= nj
            v = np.maximum(FN[1:nj + 1, :ns], _diag(xo, 0, n, ns)[:nj] + _skew(D, n, ns)[:nj])
            np.maximum(v, _skew(DL, n, ns)[:nj] + D[1:nj + 1, :ns], out=v)
            vmin = v.min(axis=0)
            kc = (_diag(Q, 1, n, ns)[:nj] - P[:ns]) + _skew(KD, n, ns)[:nj] + KD[1:nj + 1, :ns]
            kmin = np.where(v == vmin, kc, INF).min(axis=0)
            s0 = U - n  # the tail [s0, U): long top-level checkpoints
            js = np.arange(s0 + L + 1, min(U, s0 + max(L, LT) + 1))
            js = js[nlo[js] <= s0]  # with an inner plan of the band (``nest``)
            if len(js):
                vl = np.maximum(np.maximum(pc.fnone[s0, js], xo[js - 1] + D[U - js, js]),
                                pc.inner_extra[js, U] + D[js - s0, s0])
                kl = ((Q[js] - P[s0]) + KD[U - js, js]) + KD[js - s0, s0]
                lo = vl.min()
                if lo < vmin[-1]:
                    vmin[-1], kmin[-1] = lo, kl[vl == lo].min()
                elif lo == vmin[-1]:
                    kmin[-1] = min(kmin[-1], kl[vl == lo].min())
            js = np.arange(s0 + L + 1, min(U, s0 + LT + 1))  # every unit inside stored
            if len(js):
                vl = np.maximum(np.maximum(pc.fnone[s0, js], xo[js - 1] + D[U - js, js]),
                                pc.inner_extra[js, U] + sa[s0, js])
                kl = (Q[js] - P[s0]) + KD[U - js, js]
                lo = vl.min()
                if lo < vmin[-1]:
                    vmin[-1], kmin[-1] = lo, kl[vl == lo].min()
                elif lo == vmin[-1]:
                    kmin[-1] = min(kmin[-1], kl[vl == lo].min())
            store = (sr < vmin) | ((sr == vmin) & (sk <= kmin))
            KD[n, :ns] = np.where(store, sk, kmin)
            D[n, :ns] = np.where(store, sr, vmin)
            if n > L:  # only the tail [U - n, U) and the nest ends' sub-chains are reached
                far = nlo[n:U] > np.arange(ns - 1)  # [s, s + n) for s < ns - 1
                KD[n, :ns - 1][far], D[n, :ns - 1][far] = INF, BIG
        R = np.full((U, W), BIG, dtype=np.int64)
        K = np.full((U, W), INF)
        R[sc[ok], ec[ok]] = D[ok]
        K[sc[ok], ec[ok]] = KD[ok]
        self.R, self.K = R, K

    def ranges(self, avail: int) -> list[tuple[int, int]]:
        """Checkpointed layer ranges of a plan fitting ``avail`` exact bytes (at least
        ``R[0, U]``): like ``CostTable.ranges``, with K, the recompute of the smallest-peak
        completions, as the estimate. Slack is spent greedily on storing."""
        return self.parts(avail)[0]

    def parts(self, avail: int) -> tuple[list[tuple[int, int]], dict[int, int]]:
        """``ranges`` and the selective option of each unit stored with one (see
        ``reconstruct_options``)."""
        return reconstruct_options(self.u.bounds, self.u.size, avail,
                                   exact_chooser(self.u, self.pc, self.R, self.K, None))


# ---- The exact DP in bytes (Pareto frontiers) ---------------------------------------------
# The exact DP in bytes: rotor's recursion (``dp.py``) with a Pareto frontier per sub-chain.
#
# ``C(s, e, m)``, the least recompute of units ``[s, e)`` with ``m`` bytes available, is a
# non-increasing step function of ``m``. Instead of sampling it on slots, each sub-chain keeps its
# breakpoints exactly: sorted ``(mem[k], cost[k])`` with ``mem`` increasing and ``cost`` strictly
# decreasing, ``C(s, e, m) = cost[k]`` for the last ``mem[k] <= m`` (infeasible below ``mem[0]``,
# which is the min-peak table's ``R(s, e)``). The options of the recursion are shifts and sums of
# such functions, and their minimum is a running minimum over the union of their breakpoints,
# so every table entry is exact and the DP is optimal at *every* budget by construction, whatever
# the sizes (no slots, no rounding).
#
# Each breakpoint remembers the option that made it (``Store(s)`` or the checkpoint ``[s, j)``), so
# a plan is read top-down in exact bytes: at ``m`` the breakpoint ``k`` gives the option, whose
# sub-chains are read at what is left; each gets at least what it had at ``mem[k]``, so the plan
# costs at most ``cost[k]`` (hence exactly) and fits (each option's needs were checked at
# ``mem[k] <= m``).
#
# Cost: O(U^2) frontier merges, each over the breakpoints of its ``e - s - 1`` splits (numpy, all
# splits at once; compiled with numba when installed, see "Compiled frontiers" below).
# Frontiers stay short on real chains (tens to a few hundred breakpoints), which
# ``max_points`` bounds: a solve that would exceed it stops and returns None, and the caller falls
# back to the slot tables (``dp.py``). ``keep_above`` drops breakpoints that no budget of interest
# needs: a sub-chain never gets more than the top budget plus the largest amount an inner plan
# starts with above its parent, so points above that (bar the first) are cut.
#
# Names as in ``tables.py``'s legend (``store_req``, ``inner_extra``, ``fnone``, ``hold``, ``x_out``,
# ``fwd_prefix_ms``).

STORE = -1
Frontier = tuple[np.ndarray, np.ndarray, np.ndarray]  # (bytes, recompute ms, choice)
_EMPTY: Frontier = (np.zeros(0, dtype=np.int64), np.zeros(0), np.zeros(0, dtype=np.int64))


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
            raise ValueError("inner part built for another table (units, pair costs, R, top "
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
            raise ValueError(f"trim must be in [0, 1), not {trim}")
        if trim_every < 1:
            raise ValueError(f"trim_every must be at least 1, not {trim_every}")
        if not trim_abs >= 0.0:
            raise ValueError(f"trim_abs must be at least 0 ms, not {trim_abs}")
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
        (``dp.plan_dp``: beside the coarse plan). None without the compiled kernels."""
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
                    k = _trim(f[0], f[1], f[2], len(f[0]), self.trim, self.trim_abs)
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
            raise ValueError(f"the table answers up to {self.top} bytes, not {avail}")
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
            raise RuntimeError(f"Pareto DP reconstruction: no plan of [{s}, {e}) fits {mb} bytes")
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
            raise ValueError(f"the table answers up to {self.top} bytes, not {avail}")
        return reconstruct_options(self.u.bounds, self.u.size, avail, self._choose)


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


# ---- Compiled frontiers (numba, optional) ---------------------------------------------------
# The same recursion as ``ParetoTable``'s numpy path, in loops compiled by numba when it is
# installed (``pip install ckplan[fast]``): every frontier is built by merging, one option after
# another, each option's sorted breakpoints into the running lower envelope (two pointers, linear),
# instead of sorting the union of all of them. Ties are broken the same way (of points with equal
# bytes and equal recompute, the earlier option: store options by column, then checkpoints by
# ``j``), so both paths give identical tables; tests compare them. A checkpoint's two-pointer walk
# starts where its points can come under the recompute cap and stops where the envelope is already
# cheaper than its cheapest point (what is skipped would be dropped by the merge). The slot tables
# (``CostTable``, ``FlatTable``'s inner minimum) are compiled the same way: the same sums in the
# same precision, identical tables. ``CKPLAN_NUMBA=0`` (or ``tables.USE_NUMBA = False``) forces
# the numpy path.

USE_NUMBA = os.environ.get("CKPLAN_NUMBA", "1") != "0"
# Smaller tables take the numpy path until numba is loaded: it takes milliseconds there, while
# loading numba and the compiled kernels takes about half a second per process (and compiling
# them, the first time on a machine, several seconds; numba caches them on disk).
NUMBA_MIN_UNITS = 40
# The frontier kernel's walk over a checkpoint's points gallops over envelope segments it cannot
# beat, starting GALLOP_BLOCK segments wide, at its start and after GALLOP_AFTER points in a row
# that the envelope drops (73% of the points walked at 100 layers near the smallest peak were in
# walks that added nothing): 1.3x on the kernel there, identical tables.
GALLOP_BLOCK, GALLOP_AFTER = 16, 16
_JIT: dict[str, Any] = {}


def _grow(a: np.ndarray, need: int) -> np.ndarray:
    if need <= len(a):
        return a
    out = np.empty(max(need, 2 * len(a)), dtype=a.dtype)
    out[:len(a)] = a
    return out


def _merge_into(em: np.ndarray, ec: np.ndarray, ech: np.ndarray, ne: int,
                cm: np.ndarray, cc: np.ndarray, cch: np.ndarray, nc: int,
                om: np.ndarray, oc: np.ndarray, och: np.ndarray, cap: int, ub: float) -> int:
    """Lower envelope of the envelope ``E`` (first ``ne`` points) and the candidate points
    (sorted by bytes, first ``nc``), into ``o*``; candidates above ``cap`` bytes or ``ub`` ms
    are dropped; of equal bytes, ``E``'s point first (the earlier option wins ties)."""
    i = 0
    k = 0
    n = 0
    run = np.inf
    while i < ne or k < nc:
        if k >= nc or (i < ne and em[i] <= cm[k]):
            m, c, h = em[i], ec[i], ech[i]
            i += 1
        else:
            m, c, h = cm[k], cc[k], cch[k]
            k += 1
            if m > cap or c > ub:
                continue
        if c < run:
            if n > 0 and om[n - 1] == m:
                n -= 1
            om[n], oc[n], och[n] = m, c, h
            n += 1
            run = c
    return n


def _gallop_width(q: int, g: int, ne: int) -> int:
    """The gallop's next block from envelope point ``q`` of ``ne``: ``g`` points, halved (or cut
    to what is left) while it runs past the envelope; below 2, the gallop stops."""
    while g >= 2 and q + g >= ne:
        g = ne - 1 - q if ne - 1 - q < g else g // 2
    return g


def _first_at_most(cost: np.ndarray, b: int, n: int, add: float, dp: float, lim: float) -> int:
    """The first ``i < n`` with ``(cost[b + i] + add) + dp <= lim`` (``cost`` non-increasing
    from ``b``), ``n`` when none."""
    lo, hi = 0, n
    while lo < hi:
        mid = (lo + hi) // 2
        if (cost[b + mid] + add) + dp <= lim:
            hi = mid
        else:
            lo = mid + 1
    return lo


def _first_mem(mem: np.ndarray, b: int, lo: int, n: int, add: int, lim: int) -> int:
    """The first ``i`` in ``[lo, n)`` with ``mem[b + i] + add >= lim`` (``mem`` increasing
    from ``b``), ``n`` when none."""
    hi = n
    while lo < hi:
        mid = (lo + hi) // 2
        if mem[b + mid] + add >= lim:
            hi = mid
        else:
            lo = mid + 1
    return lo


def _shifted_candidates(mem: np.ndarray, cost: np.ndarray, ba: int, la: int, xa: int, fixed: int,
                        dp: float, c_se: int, k_se: float, em: np.ndarray, ec: np.ndarray, ne: int,
                        cm: np.ndarray, cc: np.ndarray, cch: np.ndarray, choice: int) -> int:
    """The points ``(max(mem[ba + i] + xa, fixed), cost[ba + i] + dp)`` of the frontier at
    ``[ba, ba + la)`` within ``c_se`` bytes and ``k_se`` ms that the envelope (``em``, ``ec``:
    ``ne`` points) does not already beat, into ``cm``/``cc``/``cch`` (room for ``la``) with
    ``choice``; returns their number. A stored layer's option (the rest's frontier shifted by
    what the option holds, plus its recompute) and a long top-level checkpoint (the rest's,
    shifted by the checkpoint's input) are both such shifts. Envelope segments that no point can
    beat are galloped over: the merge would drop every point there (tests compare the tables
    with the numpy path, which merges every point)."""
    if fixed > c_se:
        return 0
    while la > 0 and mem[ba + la - 1] + xa > c_se:
        la -= 1
    if la == 0:
        return 0
    pa = _first_at_most(cost, ba, la, 0.0, dp, k_se)  # the first under the cap
    if pa == la:
        return 0
    cmin = cost[ba + la - 1] + dp
    q = -1
    if ne > 0:  # its cheapest point no cheaper than the envelope at its first point
        q = np.searchsorted(em[:ne], max(mem[ba + pa] + xa, fixed), side="right") - 1
        if q >= 0 and cmin >= ec[q]:
            return 0
        # nor any point where the envelope is already as cheap as its cheapest
        qs = _first_at_most(ec, 0, ne, 0.0, 0.0, cmin)
        if qs < ne:
            if fixed >= em[qs]:
                return 0
            la = _first_mem(mem, ba, pa, la, xa, em[qs])
    nc = 0
    i = pa
    rej = GALLOP_AFTER
    while i < la:
        if rej >= GALLOP_AFTER and q >= 0:
            # On [em[q], em[q + g]) the envelope is at most ec[q] and these points cost at least
            # the last one below em[q + g] (both non-increasing): when that is >= ec[q], skip.
            rej = 0
            g = GALLOP_BLOCK
            while True:
                g = _gallop_width(q, g, ne)
                if g < 2:
                    break
                tend = em[q + g]
                ni = i if fixed >= tend else _first_mem(mem, ba, i, la, xa, tend)
                if ni == i or cost[ba + ni - 1] + dp >= ec[q]:
                    i = ni
                    q += g
                    g *= 2
                else:
                    g //= 2
            if i >= la:
                break
        m = max(mem[ba + i] + xa, fixed)
        c = cost[ba + i] + dp
        i += 1
        while q + 1 < ne and em[q + 1] <= m:
            q += 1
        if q >= 0 and c >= ec[q]:
            rej += 1
            continue  # the merge would drop it
        rej = 0
        cm[nc], cc[nc], cch[nc] = m, c, choice
        nc += 1
    return nc


def _trim(em: np.ndarray, ec: np.ndarray, ech: np.ndarray, ne: int, trim: float,
          eps: float = 0.0) -> int:
    """Keep the first point and each point at least ``trim`` (relative) cheaper than the last
    point kept, in place; returns how many are kept."""
    n = 1
    last = ec[0]
    for i in range(1, ne):
        c = ec[i]
        if c < last * (1.0 - trim) - eps:
            em[n], ec[n], ech[n] = em[i], c, ech[i]
            n += 1
            last = c
    return n


def _pareto_kernel(U: int, R: np.ndarray, cap: np.ndarray, kcap: np.ndarray, osr: np.ndarray,
                   ohold: np.ndarray, oms: np.ndarray, fnone: np.ndarray, xo: np.ndarray,
                   inner: np.ndarray, P: np.ndarray, Q: np.ndarray, max_points: int,
                   L: int, LT: int, sa: np.ndarray, trim: float, max_total: int,
                   trim_every: int, trim_abs: float, nlo: np.ndarray, e_lo: int, e_hi: int,
                   off: np.ndarray,
                   ln: np.ndarray, mem: np.ndarray, cost: np.ndarray, ch: np.ndarray,
                   used: int, most: int) -> tuple:
    """``ParetoTable``'s frontiers of the sub-chains ``[s, e)`` with ``e_lo <= e <= e_hi``,
    compiled, added to the flat arrays (``mem``/``cost``/``ch``: ``used`` points; frontier
    ``(s, e)`` is ``[off, off + ln)``, offset -1 where skipped): returns (off, ln, mem, cost,
    ch, used, ok, most points). Ends ``e < U`` never read the tails, so they can be built
    first, apart (``ParetoTable.inner_part``)."""
    n_opt = osr.shape[0]
    em = np.empty(64, dtype=np.int64)
    ec = np.empty(64, dtype=np.float64)
    ech = np.empty(64, dtype=np.int64)
    tm, tc, tch = em.copy(), ec.copy(), ech.copy()
    cm, cc, cch = em.copy(), ec.copy(), ech.copy()
    for e in range(e_lo, e_hi + 1):
        for s in range(e - 1, -1, -1):
            c_se, k_se = cap[s, e], kcap[s, e]
            if c_se < R[s, e] or k_se < 0:
                continue
            ne = 0
            for o in range(n_opt):
                if o > 0 and not oms[s, o] <= k_se:
                    continue
                sr, ho, ms = osr[o, s, e], ohold[s, o], oms[s, o]
                if s + 1 == e:
                    nc = 1
                    cm[0], cc[0], cch[0] = sr, ms, -1 - o
                elif max(sr, ho + R[s + 1, e]) <= c_se and off[s + 1, e] >= 0:
                    b, nc = off[s + 1, e], ln[s + 1, e]
                    if nc > len(cm):
                        cm, cc, cch = _grow(cm, nc), _grow(cc, nc), _grow(cch, nc)
                    if o > 0 and ne > 0:  # only what beats the options before it
                        nc = _shifted_candidates(mem, cost, b, nc, ho, sr, ms, c_se, k_se, em, ec, ne,
                                                 cm, cc, cch, -1 - o)
                        if nc == 0:
                            continue
                    else:
                        for k in range(nc):
                            cm[k] = max(mem[b + k] + ho, sr)
                            cc[k] = cost[b + k] + ms if o else cost[b + k]
                            cch[k] = -1 - o
                else:
                    continue
                if ne + nc > len(tm):
                    tm, tc, tch = _grow(tm, ne + nc), _grow(tc, ne + nc), _grow(tch, ne + nc)
                n = _merge_into(em, ec, ech, ne, cm, cc, cch, nc, tm, tc, tch, c_se, k_se)
                em, ec, ech, tm, tc, tch, ne = tm, tc, tch, em, ec, ech, n
            for j in range(s + 1, min(e, s + (L if e < U else max(L, LT)) + 1)):
                if s < nlo[j]:
                    continue  # a top-level checkpoint over L units, not at a nest end
                fn = fnone[s, j]
                xa, xb = xo[j - 1], inner[j, e]
                need = max(fn, xa + R[j, e], xb + R[s, j])
                dp = Q[j] - P[s]
                if need > c_se or not dp <= k_se or off[j, e] < 0 or off[s, j] < 0:
                    continue
                ba, la, bb, lb = off[j, e], ln[j, e], off[s, j], ln[s, j]
                while la > 0 and mem[ba + la - 1] + xa > c_se:
                    la -= 1
                while lb > 0 and mem[bb + lb - 1] + xb > c_se:
                    lb -= 1
                if la == 0 or lb == 0:
                    continue
                # Skip what cannot come under k_se (the other side at its cheapest), and the
                # whole checkpoint when its cheapest point is no cheaper than the envelope
                # where its first point lies: neither changes the envelope.
                amin, bmin = cost[ba + la - 1], cost[bb + lb - 1]
                pa = _first_at_most(cost, ba, la, bmin, dp, k_se)
                pb = _first_at_most(cost, bb, lb, amin, dp, k_se)
                if pa == la or pb == lb:
                    continue
                q = -1
                if ne > 0:
                    m0 = max(mem[ba + pa] + xa, mem[bb + pb] + xb, fn)
                    q = np.searchsorted(em[:ne], m0, side="right") - 1
                    if q >= 0 and (amin + bmin) + dp >= ec[q]:
                        continue
                    # Nor is any point where the envelope is already as cheap as that cheapest
                    # point: stop both sides there.
                    qs = _first_at_most(ec, 0, ne, 0.0, 0.0, (amin + bmin) + dp)
                    if qs < ne:
                        la = _first_mem(mem, ba, pa, la, xa, em[qs])
                        lb = _first_mem(mem, bb, pb, lb, xb, em[qs])
                if la + lb > len(cm):
                    cm, cc, cch = _grow(cm, la + lb), _grow(cc, la + lb), _grow(cch, la + lb)
                nc = 0
                ia, ib = -1, -1
                rej = GALLOP_AFTER
                while pa < la or pb < lb:
                    if rej >= GALLOP_AFTER and q >= 0:
                        # Gallop over envelope segments no point of this checkpoint can beat: on
                        # [em[q], em[q + g]) the envelope is at most ec[q] and the checkpoint's
                        # points at least its cost just below em[q + g] (both non-increasing),
                        # so when that cost is >= ec[q] the merge would drop every point there.
                        # Skipping them changes nothing (tests compare with the numpy path).
                        rej = 0
                        g = GALLOP_BLOCK
                        while True:
                            g = _gallop_width(q, g, ne)
                            if g < 2:
                                break
                            tend = em[q + g]
                            na = _first_mem(mem, ba, pa, la, xa, tend)
                            nb = _first_mem(mem, bb, pb, lb, xb, tend)
                            ja = na - 1 if na > pa else ia
                            jb = nb - 1 if nb > pb else ib
                            if ja < 0 or jb < 0 or (cost[ba + ja] + cost[bb + jb]) + dp >= ec[q]:
                                pa, pb, ia, ib = na, nb, ja, jb
                                q += g
                                g *= 2
                            else:
                                g //= 2
                        if not (pa < la or pb < lb):
                            break
                    ta = mem[ba + pa] + xa if pa < la else BIG
                    tb = mem[bb + pb] + xb if pb < lb else BIG
                    t = min(ta, tb)
                    if ta == t:
                        ia = pa
                        pa += 1
                    if tb == t:
                        ib = pb
                        pb += 1
                    if ia >= 0 and ib >= 0:
                        m = max(t, fn)
                        c = (cost[ba + ia] + cost[bb + ib]) + dp
                        if c > k_se:
                            continue
                        while q + 1 < ne and em[q + 1] <= m:  # the envelope at m: ec[q]
                            q += 1
                        if q >= 0 and c >= ec[q]:
                            rej += 1
                            continue  # the merge would drop it
                        rej = 0
                        cm[nc], cc[nc], cch[nc] = m, c, j
                        nc += 1
                if nc == 0:
                    continue
                if ne + nc > len(tm):
                    tm, tc, tch = _grow(tm, ne + nc), _grow(tc, ne + nc), _grow(tch, ne + nc)
                n = _merge_into(em, ec, ech, ne, cm, cc, cch, nc, tm, tc, tch, c_se, k_se)
                em, ec, ech, tm, tc, tch, ne = tm, tc, tch, em, ec, ech, n
            # Long top-level checkpoints [s, j) storing every unit inside: the rest's points
            # shifted by x[j-1], at least the inner plan's fixed need (choice U + j).
            for j in range(s + L + 1, min(e, s + LT + 1) if e == U else 0):
                if P[j - 1] - P[s] > k_se:
                    break  # dp >= P[j-1] - P[s] grows with j: no later j fits the recompute cap
                dp = Q[j] - P[s]
                xa = xo[j - 1]
                fixed = max(fnone[s, j], inner[j, e] + sa[s, j])
                if max(fixed, xa + R[j, e]) > c_se or not dp <= k_se or off[j, e] < 0:
                    continue
                ba, la = off[j, e], ln[j, e]
                if la > len(cm):
                    cm, cc, cch = _grow(cm, la), _grow(cc, la), _grow(cch, la)
                nc = _shifted_candidates(mem, cost, ba, la, xa, fixed, dp, c_se, k_se, em, ec, ne,
                                         cm, cc, cch, U + j)
                if nc == 0:
                    continue
                if ne + nc > len(tm):
                    tm, tc, tch = _grow(tm, ne + nc), _grow(tc, ne + nc), _grow(tch, ne + nc)
                n = _merge_into(em, ec, ech, ne, cm, cc, cch, nc, tm, tc, tch, c_se, k_se)
                em, ec, ech, tm, tc, tch, ne = tm, tc, tch, em, ec, ech, n
            if (trim > 0.0 or trim_abs > 0.0) and e == U and s % trim_every == 0 and ne > 1:
                ne = _trim(em, ec, ech, ne, trim, trim_abs)  # ``ParetoTable``'s trim
            if used + ne > len(mem):
                mem, cost, ch = _grow(mem, used + ne), _grow(cost, used + ne), _grow(ch, used + ne)
            mem[used:used + ne] = em[:ne]
            cost[used:used + ne] = ec[:ne]
            ch[used:used + ne] = ech[:ne]
            off[s, e], ln[s, e] = used, ne
            used += ne
            most = max(most, ne)
            if (max_points >= 0 and ne > max_points) or (max_total >= 0 and used > max_total):
                return off, ln, mem, cost, ch, used, False, most
    return off, ln, mem, cost, ch, used, True, most


def _caps_kernel(U: int, R: np.ndarray, top: int, ub: float, osr: np.ndarray, ohold: np.ndarray,
                 oms: np.ndarray, fnone: np.ndarray, xo: np.ndarray, inner: np.ndarray,
                 P: np.ndarray, Q: np.ndarray, L: int, LT: int,
                 sa: np.ndarray, nlo: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """:func:`reach`, compiled (``L``, ``LT``, ``sa``, ``nlo``: the band, ``ParetoTable``)."""
    n_opt = osr.shape[0]
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
                h, ms = ohold[s, o], oms[s, o]
                if (o == 0 or ms <= k) and max(osr[o, s, e], h + R[s + 1, e]) <= c:
                    cap[s + 1, e] = max(cap[s + 1, e], c - h)
                    kcap[s + 1, e] = max(kcap[s + 1, e], k - ms if o else k)
            for j in range(s + 1, min(e, s + (L if e < U else max(L, LT)) + 1)):
                if s < nlo[j]:
                    continue  # a top-level checkpoint over L units, not at a nest end
                dp = Q[j] - P[s]
                if max(fnone[s, j], xo[j - 1] + R[j, e], inner[j, e] + R[s, j]) <= c and dp <= k:
                    cap[j, e] = max(cap[j, e], c - xo[j - 1])
                    cap[s, j] = max(cap[s, j], c - inner[j, e])
                    kcap[j, e] = max(kcap[j, e], k - dp)
                    kcap[s, j] = max(kcap[s, j], k - dp)
            if e == U:  # long top-level checkpoints: no inner sub-chain to reach
                for j in range(s + L + 1, min(e, s + LT + 1)):
                    dp = Q[j] - P[s]
                    if max(fnone[s, j], xo[j - 1] + R[j, e], inner[j, e] + sa[s, j]) <= c and dp <= k:
                        cap[j, e] = max(cap[j, e], c - xo[j - 1])
                        kcap[j, e] = max(kcap[j, e], k - dp)
    return cap, kcap


def _peak_kernel(U: int, osr: np.ndarray, ohold: np.ndarray, oms: np.ndarray, fnone: np.ndarray,
                 xo: np.ndarray, innerT: np.ndarray, P: np.ndarray,
                 Q: np.ndarray, L: int, LT: int, sa: np.ndarray,
                 nlo: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``PeakTable``'s R and K, compiled: the same options, comparisons and sums in the same
    order (identical tables); with ``L < U``, the banded plans (``PeakTable``): only the entries
    they reach are filled (tails ``[s, U)`` and sub-chains of at most ``L`` units); ``sa`` is
    ``PairCosts.store_all`` (read only where ``LT > L``). ``innerT[e, j]`` is ``inner_extra[j, e]``; ``RT``/``KT`` are
    transposed copies so that the inner loop over ``j`` reads contiguous rows."""
    n_opt = osr.shape[0]
    W = U + 1
    R = np.full((U, W), BIG, dtype=np.int64)
    K = np.full((U, W), np.inf)
    RT = np.full((W, U + 1), BIG, dtype=np.int64)
    KT = np.full((W, U + 1), np.inf)
    vbuf = np.empty(U + 1, dtype=np.int64)
    for e in range(1, U + 1):
        for s in range(e - 1, -1, -1):
            if e < U and s < nlo[e]:
                break  # no plan of [0, U) reaches [s, e): R stays BIG
            if s + 1 == e:
                r, k = osr[0, s, e], 0.0
                for o in range(1, n_opt):
                    r1, k1 = osr[o, s, e], oms[s, o]
                    if np.isfinite(k1) and (r1 < r or (r1 == r and k1 < k)):
                        r, k = r1, k1
            else:
                rn, kn = RT[e, s + 1], KT[e, s + 1]
                sr, sk = max(osr[0, s, e], ohold[s, 0] + rn), kn
                for o in range(1, n_opt):
                    ro, ko = max(osr[o, s, e], ohold[s, o] + rn), kn + oms[s, o]
                    if np.isfinite(oms[s, o]) and (ro < sr or (ro == sr and ko < sk)):
                        sr, sk = ro, ko
                # two branch-free passes (vectorised): the least need, then the least
                # recompute among the splits reaching it
                fn, rt, it, rs = fnone[s, s + 1:e], RT[e, s + 1:e], innerT[e, s + 1:e], R[s, s + 1:e]
                xs, pj, kt, ks = xo[s:e - 1], Q[s + 1:e], KT[e, s + 1:e], K[s, s + 1:e]
                nj = min(e - s - 1, L)  # checkpoints [s, s + 1 + i) for i < nj
                vs = vbuf[:nj]
                vmin, kmin = TOP, np.inf  # every v is below TOP
                for i in range(nj):
                    vs[i] = max(fn[i], xs[i] + rt[i], it[i] + rs[i])
                    vmin = min(vmin, vs[i])
                ps = P[s]
                for i in range(nj):
                    if vs[i] == vmin:
                        kmin = min(kmin, ((pj[i] - ps) + kt[i]) + ks[i])
                if e == U:  # long top-level checkpoints with an inner plan of the band
                    for j in range(s + L + 1, min(e, s + max(L, LT) + 1)):
                        if s < nlo[j]:
                            continue
                        v = max(fnone[s, j], xo[j - 1] + RT[e, j], innerT[e, j] + R[s, j])
                        kj = ((Q[j] - ps) + KT[e, j]) + K[s, j]
                        if v < vmin:
                            vmin, kmin = v, kj
                        elif v == vmin:
                            kmin = min(kmin, kj)
                    # and every unit inside stored
                    for j in range(s + L + 1, min(e, s + LT + 1)):
                        v = max(fnone[s, j], xo[j - 1] + RT[e, j], innerT[e, j] + sa[s, j])
                        kj = (Q[j] - ps) + KT[e, j]
                        if v < vmin:
                            vmin, kmin = v, kj
                        elif v == vmin:
                            kmin = min(kmin, kj)
                if sr < vmin or (sr == vmin and sk <= kmin):
                    r, k = sr, sk
                else:
                    r, k = vmin, kmin
            R[s, e], K[s, e], RT[e, s], KT[e, s] = r, k, r, k
    for s in range(U):
        K[s, s] = 0.0  # as the numpy table: the empty sub-chain costs nothing (and fits nowhere)
    return R, K


def _shifted(C: np.ndarray, s: int, e: int, m: int, d: int, M: int, inf: Any) -> Any:
    """``shift(C[s, e], d, M)[m]``: ``C[s, e, min(m - d, M)]``, ``inf`` where ``m - d < 0``."""
    k = m - d
    if k < 0:
        return inf
    return C[s, e, min(k, M)]


def _cost_kernel(C: np.ndarray, best: np.ndarray, rest: np.ndarray, consts: np.ndarray,
                 store_slots: np.ndarray, hold_slots: np.ndarray, ohold: np.ndarray, osr: np.ndarray,
                 oms: np.ndarray, x_slots: np.ndarray, inner_slots: np.ndarray,
                 fnone_slots: np.ndarray, P: np.ndarray, Q: np.ndarray) -> None:
    """``CostTable``'s loops, compiled, into ``C``: every sum in the table's precision (``oms``,
    ``P``, ``Q`` and ``consts`` = (inf, 0) are given in it), as the numpy path; ``best`` and ``rest``
    are scratch."""
    U, M1 = C.shape[0], C.shape[2]
    M = M1 - 1
    n_opt = oms.shape[1]
    inf, zero = consts[0], consts[1]
    for e in range(1, U + 1):
        best[:e] = inf  # min_j C[s,j,m-d] + C[j,e,m-x] + Q[j]
        for j in range(e - 1, -1, -1):
            # Finish C[j, e]: every checkpoint [j, j') with j' > j has been added to best[j].
            req = max(0, min(store_slots[j, e], M1))
            h = hold_slots[j]
            pj, qj = P[j], Q[j]
            for m in range(M1):
                if m < req:
                    v = inf
                elif j + 1 == e:
                    v = zero
                else:
                    v = _shifted(C, j + 1, e, m, h, M, inf)
                for o in range(1, n_opt):  # Store(j) with a selective option
                    ms = oms[j, o]
                    if not np.isfinite(ms) or m < max(0, min(osr[o, j, e], M1)):
                        continue
                    so = ms if j + 1 == e else _shifted(C, j + 1, e, m, ohold[j, o], M, inf) + ms
                    if so < v:
                        v = so
                b = best[j, m] - pj
                C[j, e, m] = b if b < v else v
            if j == 0:
                continue
            # Checkpoint [s, j) for every s < j, followed by the rest [j, e): from the first
            # slot where the rest, the inner plan and the no-saving forward all fit.
            xs = x_slots[j - 1]
            lo = M1
            for m in range(M1):
                rest[m] = _shifted(C, j, e, m, xs, M, inf) + qj
                if lo == M1 and rest[m] < inf:
                    lo = m
            d = inner_slots[j, e]
            mid = min(M1, max(0, M + d + 1))  # below it C[s, j, m - d], from it C[s, j, M]
            for s in range(j):
                m0 = max(lo, fnone_slots[s, j], d)
                if m0 < mid:  # slices indexed from 0: the loop is vectorised
                    src, add, dst = C[s, j, m0 - d:mid - d], rest[m0:mid], best[s, m0:mid]
                    for k in range(mid - m0):
                        dst[k] = min(dst[k], src[k] + add[k])
                m1 = max(m0, mid)
                if m1 < M1:
                    top, add, dst = C[s, j, M], rest[m1:], best[s, m1:]
                    for k in range(M1 - m1):
                        dst[k] = min(dst[k], top + add[k])

def _masked_min(S: np.ndarray, lo: int, hi: int, t: np.ndarray) -> np.ndarray:
    """``FlatTable``'s ``out[m] = min(S[j, m] for lo <= j < hi if m >= t[j - lo])`` (inf
    where none), compiled."""
    out = np.full(S.shape[1], np.inf, dtype=S.dtype)
    for j in range(lo, hi):
        a = max(0, t[j - lo])
        src, dst = S[j, a:], out[a:]
        for k in range(len(dst)):  # slices indexed from 0, unconditional stores: vectorised
            dst[k] = min(dst[k], src[k])
    return out


def jitted(name: str, units: int) -> Any:
    """The compiled kernel ``name`` for a table on ``units`` units, or None for the numpy path
    (numba not installed, ``USE_NUMBA`` off, or fewer than ``NUMBA_MIN_UNITS`` units while no
    kernel is loaded yet). Compiled once per process, cached on disk by numba; they release the
    GIL (``nogil``: ``dp.plan_dp`` builds two tables at once on two threads)."""
    if not USE_NUMBA or (units < NUMBA_MIN_UNITS and not _JIT):
        return None
    if name not in _JIT:
        try:  # imported here, not at the top: loading numba costs every ckplan import ~0.3 s
            numba = importlib.import_module("numba")
        except ImportError:
            _JIT[name] = None
            return None
        g = globals()
        # called from the kernels: compiled first
        for helper in ("_grow", "_merge_into", "_first_at_most", "_first_mem", "_shifted",
                       "_gallop_width", "_shifted_candidates", "_trim"):
            if helper not in _JIT:
                _JIT[helper] = g[helper] = numba.njit(cache=True, nogil=True)(g[helper])
        _JIT[name] = numba.njit(cache=True, nogil=True)(g[name])
    return _JIT[name]
