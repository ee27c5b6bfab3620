"""An exact DP on chains with unkept boundaries, in the simulator's own terms (``replay.py``).

What an item of a sequence holds depends on its neighbours only: a checkpoint after a plain
``Store`` keeps its input when no op does (``_input_hold``), a checkpoint's boundary is released
once read when a plain ``Store`` (or post) comes next (``_boundary_released``), a checkpoint inside
a recompute whose inner plan starts with a plain ``Store`` frees its input (or the boundary of the
checkpoint before it) once its own recompute is over, and the first and last layers of a
recompute take the input's, the copy's and the early stop's sizes. So the suffix of a sequence
from layer ``j`` to its end ``e`` is planned knowing only whether it is the top level, what the
item before it was (none, a plain store, a checkpoint), the bytes its enclosing checkpoint frees
between its forward and its backward (``gap``) and which kind of item it starts with; its net
change of live bytes is the same for every plan of it. A suffix's peak above its start is the
largest of its first item's own ops and, for each sub-suffix it plans (the rest of the sequence,
the first item's inner plan), where that starts plus its peak: each sub-suffix is planned on its
own under the bytes left. Rotor's recursion, over rotor's grammar (no checkpoint ends where the
inner plan around it ends), with each suffix's Pareto frontier of (peak above its start,
recompute) in exact bytes; a budget reads the top one and follows the choices down.

Chains it models (:func:`direct_applies`): no offload, held layers, autocast copies, side inputs,
lead bytes or tensors kept outside saved tensors; selective options are left out (plain plans).
Every plan's peak and recompute equal the simulator's (``tests/test_unkept.py`` checks it against
brute force), and its plans are simulated again where they are used.
"""
from __future__ import annotations

import math
from functools import lru_cache

import numpy as np

from ..chain import Chain
from ..plan import Checkpoint, Item, Store

NONE, STORED, CKPT = 0, 1, 2  # the item before a suffix; and the kind a suffix starts with (ANY: either)
ANY = 0
_Key = tuple[int, int, bool, int, int, int]  # (j, e, top, prev, gap, first)
_NEVER = 1 << 62  # the need of a suffix no plan covers (a kind it cannot start with)


def direct_applies(chain: Chain) -> bool:
    """Whether :class:`DirectDP` models every op of ``chain``'s plain plans."""
    if chain.can_offload or chain.has_holds or chain.has_casts or chain.side_inputs:
        return False
    return not any(ly.lead_bytes or ly.unsaved_kept_bytes or ly.kept_after_bytes or ly.recompute_kept_bytes
                   or ly.recompute_chain_kept_bytes for ly in chain.layers)


class DirectDP:
    """The cheapest plan of rotor's grammar (every stored layer plain) under a budget, and the
    smallest peak, on a chain :func:`direct_applies` to. Frontiers are built on the first
    ``solve`` (16 layers: about 0.15 s), then each budget reads them."""

    def __init__(self, chain: Chain):
        self.chain = chain
        L = chain.layers
        n = self.n = chain.n_layers
        self.x = [ly.x_bytes for ly in L]
        self.hold = [chain.input_hold(i) for i in range(n)]
        self.freeable = [not (ly.x_kept and ly.x_kept_next) for ly in L]  # released once read
        self.fwd = [0.0]
        for ly in L:
            self.fwd.append(self.fwd[-1] + ly.fwd_ms)
        # a checkpoint's first forward of [j, k): its ops' peak above the bytes before it
        self.span_peak = [[0] * (n + 1) for _ in range(n + 1)]
        for j in range(n):
            top = 0
            for k in range(j + 1, n + 1):
                i, ly = k - 1, L[k - 1]
                own = 0 if ly.x_kept or ly.in_place else ly.x_bytes
                tmp = ly.fn_tmp(max(0, ly.fwd_tmp_bytes - own - self.hold[i]))
                if i == j and ly.copies_input and not ly.in_place:  # the copy of its input it is given
                    tmp += chain.copy_bytes(i)
                top = max(top, (self.x[i - 1] if i > j else 0) + self.x[i] + tmp)
                self.span_peak[j][k] = top
        self.breaks = chain.breaks
        pre, post = chain.pre, chain.post
        self.base = chain.persistent_bytes + pre.retained_bytes
        self.fronts: dict[_Key, tuple[np.ndarray, np.ndarray]] = {}
        self.need_memo: dict[_Key, tuple[int, int]] = {}
        self.top: _Key = (0, n, True, NONE, 0, ANY)
        _, delta = self._least(self.top)  # the same for every plan
        end = self.base + delta
        after = end + pre.grad_bytes - pre.retained_bytes - chain.delta_in_bytes
        rest = after - post.backward_hold_bytes
        self.fixed = max(self.base + pre.fwd_tmp_bytes, end + pre.bwd_tmp_bytes, after, rest,
                         chain.opt_step_peak_bytes)

    def _spans_break(self, j: int, k: int) -> bool:
        return any(j < b < k for b in self.breaks)

    # ---- one item's parts -------------------------------------------------------------------
    def _store(self, key: _Key, rest: tuple[int, int] | None) -> tuple[list[int], int, int]:
        """``Store(j)`` first in the suffix ``key``: (peaks of its own ops above the suffix's
        start, where the rest of the suffix starts, the suffix's net change), given the rest's
        net change ``rest[1]`` (None: it is the last item)."""
        j, e, top, prev, gap, _ = key
        ly = self.chain.layers[j]
        m1 = pend = freed = 0
        if prev == CKPT and self.freeable[j - 1]:  # the checkpoint before releases its boundary
            freed = self.x[j - 1]
            if self.chain.layers[j - 1].x_kept:
                pend = freed  # after this forward (only its maker's ops saved it)
            else:
                m1 = -freed
        first = not top and prev == NONE  # first in a recompute: its input is the checkpoint's
        dup = self.hold[j] if first else 0
        xbar = ly.xbar_bytes
        copied = first and (ly.in_place or ly.copies_input)
        if copied:  # given a copy of what it changes in place, which it keeps
            xbar += self.chain.copy_bytes(j)
        last = j + 1 == e
        if not top and last and not copied and ly.early_xbar_bytes is not None:
            peaks = [m1 + ly.stop_xbar_bytes + max(0, ly.stop_fwd_tmp_bytes - dup)]
        else:
            peaks = [m1 + xbar + max(0, ly.fwd_tmp_bytes - dup)]
        m2 = m1 + xbar - pend
        if pend:  # the release: after an early stop, the whole xbar is live there
            peaks.append(m2)
        if last:
            m, more = self._interlude(m2, top, gap, 0, 0)
            peaks += more
        else:
            assert rest is not None
            m = m2 + rest[1]
        d = self.x[j - 1] if j > 0 else self.chain.delta_in_bytes
        after = m + d + ly.grad_bytes - xbar - ly.x_bytes
        peaks.append(max(m + ly.bwd_tmp_bytes, after))
        return peaks, m2, after + freed

    def _interlude(self, m: int, top: bool, gap: int, release_now: int, release_after: int) -> tuple[int, list[int]]:
        """From the last item's forward to its backward: post at the top level (releasing the
        last checkpoint's boundary), the gap inside a recompute."""
        if not top:
            return m - gap, []
        post = self.chain.post
        m -= release_now
        live = m + post.xbar_bytes + post.loss_bytes
        peaks = [live + post.fwd_tmp_bytes]
        m = live - release_after + post.loss_bytes
        after = m + self.x[-1] + post.grad_bytes - post.xbar_bytes
        peaks.append(max(m + post.bwd_tmp_bytes, after))
        return after, peaks

    def _ckpt_head(self, key: _Key, k: int) -> tuple[int, int]:
        """Checkpoint [j, k) first in the suffix: (its input hold, its first forward's peak)."""
        j, _, top, prev, _, _ = key
        hold = (self.hold[0] if top and j == 0 else 0) if prev == NONE else self.hold[j] if prev == STORED else 0
        return hold, hold + self.span_peak[j][k]

    def _inner_gap(self, key: _Key, hold: int, inner_first: int) -> tuple[int, int, int]:
        """(gap of the inner plan, hold freed after the backward, boundary before freed) of a
        checkpoint first in ``key`` whose inner plan starts with ``inner_first``."""
        j, _, top, prev, _, _ = key
        if top or inner_first != STORED:
            return 0, hold, 0
        if hold:
            return hold, 0, 0
        if prev == CKPT and self.freeable[j - 1]:
            return self.x[j - 1], 0, self.x[j - 1]
        return 0, 0, 0

    def _choices(self, key: _Key):
        """Each first item allowed in ``key``: ("S",) or ("C", k, inner first)."""
        j, e, top, _, _, first = key
        if first in (ANY, STORED):
            yield ("S",)
        if first in (ANY, CKPT):
            for k in range(j + 1, e + 1 if top else e):
                if self._spans_break(j, k):
                    continue
                yield ("C", k, STORED)
                if k - j >= 2:
                    yield ("C", k, CKPT)

    def _parts(self, key: _Key, ch: tuple) -> tuple[int, float, list[tuple[_Key, int]], int]:
        """Choice ``ch`` first in ``key`` as (the peak of its own ops, its own recompute, the
        sub-suffixes it plans with the bytes each starts above the suffix's start, the suffix's
        net change): its need is the largest of the first and each start plus that sub-suffix's
        need, its recompute the sum."""
        j, e, top, _, gap, _ = key
        if ch[0] == "S":
            cost = 0.0 if top else self.fwd[j + 1] - self.fwd[j] - (self.chain.layers[j].tail_ms if j + 1 == e else 0.0)
            if j + 1 == e:
                peaks, _, delta = self._store(key, None)
                return max(peaks), cost, [], delta
            rkey = (j + 1, e, top, STORED, gap, ANY)
            peaks, m2, delta = self._store(key, self._least(rkey))
            return max(peaks), cost, [(rkey, m2)], delta
        k, inner_first = ch[1], ch[2]
        hold, own = self._ckpt_head(key, k)
        cost = 0.0 if top else self.fwd[k] - self.fwd[j]
        mf = hold + self.x[k - 1]
        subs: list[tuple[_Key, int]] = []
        if k == e:  # the last item of the top level: post reads (and may release) its boundary
            rel, kept = self.freeable[k - 1], self.chain.layers[k - 1].x_kept
            m, more = self._interlude(mf, top, gap, self.x[k - 1] if rel and not kept else 0,
                                      self.x[k - 1] if rel and kept else 0)
            own = max(own, *more)
            b = m - (0 if rel else self.x[k - 1])
        else:
            rkey = (k, e, top, CKPT, gap, ANY)
            subs.append((rkey, mf))
            b = mf + self._least(rkey)[1] - self.x[k - 1]
        igap, unhold, freed = self._inner_gap(key, hold, inner_first)
        ikey = (j, k, False, NONE, igap, inner_first)
        subs.append((ikey, b))
        return own, cost, subs, b + self._least(ikey)[1] - unhold + freed

    # ---- the smallest need (min peak) ---------------------------------------------------------
    def _least(self, key: _Key) -> tuple[int, int]:
        """(the least peak of the suffix ``key`` above its start, its net change, the same for
        every plan of it)."""
        got = self.need_memo.get(key)
        if got is not None:
            return got
        best: tuple[int, int] | None = None
        for ch in self._choices(key):
            own, _, subs, delta = self._parts(key, ch)
            need = max([own] + [off + self._least(sk)[0] for sk, off in subs])
            if best is None or need < best[0]:
                best = (need, delta)
        if best is None:
            best = (_NEVER, 0)
        self.need_memo[key] = best
        return best

    # ---- the cheapest plan under a budget: each suffix's frontier of (need, recompute) ----------
    def _frontier(self, key: _Key) -> tuple[np.ndarray, np.ndarray]:
        """The suffix's Pareto frontier: needs ascending, the least recompute within each,
        strictly falling."""
        got = self.fronts.get(key)
        if got is not None:
            return got
        if key[5] == ANY:
            parts = [self._frontier(key[:5] + (first,)) for first in (STORED, CKPT)]
        else:
            parts = [self._choice_frontier(key, ch) for ch in self._choices(key)]
        got = _pareto(parts)
        self.fronts[key] = got
        return got

    def _choice_frontier(self, key: _Key, ch: tuple) -> tuple[np.ndarray, np.ndarray]:
        """The frontier of the suffix's plans that start with ``ch`` (not pruned)."""
        own, cost, subs, _ = self._parts(key, ch)
        if not subs:
            return np.array([own], dtype=np.int64), np.array([cost])
        fronts = [(self._frontier(sk), off) for sk, off in subs]
        if len(fronts) == 1:  # one sub-suffix: its frontier, shifted
            (n, c), off = fronts[0]
            return np.maximum(n + off, own), c + cost
        # the least recompute at each need where either sub-suffix's frontier steps
        (n1, c1), off1 = fronts[0]
        (n2, c2), off2 = fronts[1]
        if len(n1) == 0 or len(n2) == 0:
            return n1[:0], c1[:0]
        n1, n2 = n1 + off1, n2 + off2
        needs = np.maximum(np.concatenate([n1, n2]), max(own, int(n1[0]), int(n2[0])))
        i1 = np.searchsorted(n1, needs, side="right") - 1
        i2 = np.searchsorted(n2, needs, side="right") - 1
        return needs, c1[i1] + c2[i2] + cost

    def _cost_at(self, key: _Key, avail: int) -> float:
        needs, costs = self._frontier(key)
        i = int(np.searchsorted(needs, avail, side="right")) - 1
        return float(costs[i]) if i >= 0 else math.inf

    def _items(self, key: _Key, avail: int) -> list[Item]:
        """The plan of the suffix ``key`` reaching its frontier's least recompute within ``avail``."""
        want = self._cost_at(key, avail)
        for ch in self._choices(key):
            own, cost, subs, _ = self._parts(key, ch)
            if own > avail:
                continue
            got = cost + sum(self._cost_at(sk, avail - off) for sk, off in subs)
            if got <= want + 1e-9 * max(1.0, abs(want)):
                break
        else:  # pragma: no cover - the frontier's value comes from one of the choices
            raise RuntimeError("unkept DP: no choice reaches the frontier")
        j, e = key[0], key[1]
        plans = {sk: self._items(sk, avail - off) for sk, off in subs}
        if ch[0] == "S":
            return [Store(j)] + (plans[subs[0][0]] if subs else [])
        k = ch[1]
        inner = plans[subs[-1][0]]
        return [Checkpoint(j, k, tuple(inner))] + (plans[subs[0][0]] if k < e else [])

    # ---- the answers ------------------------------------------------------------------------
    def min_peak(self) -> int:
        return max(self.fixed, self.base + self._least(self.top)[0])

    def solve(self, budget_bytes: int) -> tuple[tuple[Item, ...], float] | None:
        """The cheapest plan whose peak fits ``budget_bytes`` (its items and recompute), or None."""
        avail = budget_bytes - self.base
        if budget_bytes < self.fixed or self._cost_at(self.top, avail) == math.inf:
            return None
        return tuple(self._items(self.top, avail)), self._cost_at(self.top, avail)


def _pareto(parts: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """The Pareto frontier of several (needs, recomputes) point sets."""
    needs = np.concatenate([p[0] for p in parts]) if parts else np.zeros(0, dtype=np.int64)
    costs = np.concatenate([p[1] for p in parts]) if parts else np.zeros(0)
    if len(needs) == 0:
        return needs.astype(np.int64), costs
    order = np.lexsort((costs, needs))
    needs, costs = needs[order], costs[order]
    best = np.minimum.accumulate(costs)
    keep = np.ones(len(needs), dtype=bool)
    keep[1:] = costs[1:] < best[:-1] - 1e-12 * np.maximum(1.0, np.abs(best[:-1]))
    return needs[keep], costs[keep]


@lru_cache(maxsize=8)
def direct_dp(chain: Chain) -> DirectDP:
    """The chain's :class:`DirectDP`, its frontiers kept for the next budget."""
    return DirectDP(chain)
