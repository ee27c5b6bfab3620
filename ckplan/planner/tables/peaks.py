"""The min-peak table ``R(s, e)`` in exact bytes, whole or restricted to a band."""
from __future__ import annotations

import numpy as np

from ..groups import Units
from .common import BIG, INF, Spans
from .compiled import jitted
from .pairs import PairCosts
from .reader import exact_chooser, reconstruct_options


def band(U: int, max_len: int | None, top_len: int | None) -> tuple[int, int]:
    """The band ``(L, LT)``: checkpoints span at most L units, except top-level ones of up to LT
    units that store every unit inside (``U``, ``U``: unrestricted, the exact DP)."""
    L = U if max_len is None else max(1, min(int(max_len), U))
    return L, (L if top_len is None else max(1, min(int(top_len), U)))


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
        self.R, self.K = _peaks_numpy(u, pc, L, LT, sa, nlo)

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


def _peaks_numpy(u: Units, pc: PairCosts, L: int, LT: int, sa: np.ndarray,
                 nlo: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``PeakTable``'s ``(R, K)``, vectorised by length (``_peak_kernel``'s numpy twin)."""
    U = u.size
    W = U + 1
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
        _long_tops(pc, xo, D, KD, P, Q, s0, L, LT, sa, nlo, vmin, kmin)
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
    return R, K


def _long_tops(pc: PairCosts, xo: np.ndarray, D: np.ndarray, KD: np.ndarray, P: np.ndarray,
               Q: np.ndarray, s0: int, L: int, LT: int, sa: np.ndarray, nlo: np.ndarray,
               vmin: np.ndarray, kmin: np.ndarray) -> None:
    """The tail ``[s0, U)``'s long top-level checkpoints (longer than the band): nesting the
    band's (where ``nest`` allows), then storing every unit inside; lowers ``vmin[-1]``,
    ``kmin[-1]`` in place."""
    U = pc.store_req.shape[0]
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
