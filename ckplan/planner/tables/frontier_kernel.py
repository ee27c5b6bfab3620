"""The Pareto frontiers' compiled kernel (numba, ``compiled.jitted``) and its helpers.

Plain Python here; ``compiled.jitted`` compiles the helpers first, then the kernel. The numpy
twin is ``pareto.ParetoTable._build_numpy``; tests compare the two.
"""
from __future__ import annotations

import numpy as np

from ..limits import GALLOP_AFTER, GALLOP_BLOCK
from .common import BIG


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


# One loop over every sub-chain, 180 lines: split into functions, numba would pass the frontier
# buffers and their counters in and out on every point (kept whole for speed).
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
