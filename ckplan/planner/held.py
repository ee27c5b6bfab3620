"""The DP for chains with held layers (``Layer.held_bytes``: FSDP2 per rank). Pure Python.

In the backward of a top-level checkpoint ``[s, t)`` every layer of it is held (FSDP2 keeps a
unit forwarded during backward unsharded until its own backward; ``planner.parallel``): the
simulator adds ``held[s..t-1]`` when that backward starts and frees each after its layer's
backward, and every op there takes the layers' held transients (``simulate.py``). So the cost
of an inner plan differs from that of the same layers at the top level, where nothing is held;
the recursion of ``solve/`` closes again with two kinds of sub-chains:

* *inner* sub-chains ``[s, e)``, ``e <= n``: every sub-chain of an inner plan (a checkpoint's
  inner plan is one, and so is what follows an item in it). Their layers' held bytes are live at
  their start and go with each layer's backward, so these are ``solve/``'s sub-problems on
  :func:`inner_costs`: the held transients, gradients less the held bytes (what a backward
  frees), and ``Store(s)``'s forward with what the backward of layer ``e`` left beside it and,
  unless ``s = e - 1`` (the checkpoint's last layer, which FSDP2 unsharded before the
  recompute, or a layer forwarded there already), the all-gather buffer (``Layer.gather_bytes``).
  ``PeakTable`` / ``ParetoTable`` solve them unchanged.
* the *top level*, the tails ``[s, U)`` (the post last): ``Store(s)`` and a checkpoint's first
  forward as in ``solve/`` (the chain's own costs, :func:`top_costs`); a checkpoint ``[s, j)``'s
  inner plan is an inner sub-chain that starts ``inner_extra[j, U] + held[s..j-1]`` above the
  tail's start. Its first layer's backward also has the backward prefetch of the layer before
  beside it (``gather_bytes[s-1]``), a single-layer checkpoint's recompute too; the backward is
  the inner plan's last op, with the same live bytes whatever the plan, so it is one more
  requirement of the checkpoint (with selective options on layer ``s``: its costliest option's,
  on the safe side, as the inner plan's choice is not known there).

``TopLevel`` solves the top level in exact bytes: the min-max ``R`` (smallest peak) and the
Pareto frontiers of least recompute, the inner plans' frontiers from ``ParetoTable`` on the
inner costs. Against brute force under the simulator: ``tests/test_planner_parallel.py``.

Applies to fully kept chains without autocast copies of up to ``HELD_MAX_LAYERS`` layers (per
rank chains of real models are); ``solve/`` plans the others on :func:`without_holds`, at
budgets lowered until the simulated plan fits (never over budget, not proven optimal; its
``min_peak`` is then the lowest peak those plans reach).
"""
from __future__ import annotations

from dataclasses import replace
from functools import lru_cache

import numpy as np

from ..errors import PlannerArgumentError, PlannerBugError
from . import limits
from .baselines import none_peak, plan_none
from .chain import STORE, Chain
from .held_costs import _beside, held_applies, inner_costs, inner_tables, top_costs, without_holds
from .plan import Plan, items_from_ranges
from .simulate import simulate
from .tables import (
    INF,
    ParetoTable,
    _envelope,
    base_bytes,
    exact_chooser,
    fixed_peak,
    reconstruct_options,
)

__all__ = ["TopLevel", "held_applies", "inner_costs", "inner_tables", "min_peak", "min_peak_plan",
           "plan_held", "top_costs", "top_level", "without_holds"]

UNCAPPED = 2**60  # bytes: the inner table's "top" (see TopLevel.frontier)


class TopLevel:
    """The top level of a held chain over its tails (module doc): ``R[s]`` the least bytes above
    the start of ``[s, U)`` any plan needs and ``K[s]`` its recompute (a tie-break), built once
    per chain; ``frontier`` the least-recompute frontiers up to a span.

    ``prefetch``: the option of a multi-layer checkpoint's first layer whose backward gets the
    prefetch beside it, ``"worst"`` (its costliest: every plan read fits) or ``"least"`` (its
    cheapest: a lower bound on the smallest peak and the least recompute, so a plan of the
    first that reaches it is optimal). The same without selective options."""

    def __init__(self, chain: Chain, prefetch: str = "worst"):
        if prefetch not in ("worst", "least"):
            raise PlannerArgumentError(f"prefetch must be 'worst' or 'least', not {prefetch!r}")
        self.chain = chain
        L = chain.layers
        n = len(L)
        self.U = U = n + 1
        self.ut, self.pt = ut, pt = top_costs(chain)
        self.ua, self.pa, self.RA, self.KA = inner_tables(chain)
        h = np.array([ly.held_bytes for ly in L], dtype=np.int64)
        hp = np.concatenate([[0], np.cumsum(h)])
        gp = np.concatenate([[0], np.cumsum(ut.grad)])
        xo = ut.x_out
        n_opt = ut.n_options
        # the backward prefetch beside a top-level checkpoint's first layer
        pf = [L[s - 1].gather_bytes if s > 0 else 0 for s in range(n)]
        # per (s, j), j <= n: how far above the tail's start the inner plan starts, and what the
        # checkpoint needs besides its rest and its inner plan (its first forward, the prefetch)
        self.off = np.full((U, U + 1), 0, dtype=np.int64)
        self.fixed = np.full((U, U + 1), 0, dtype=np.int64)
        # a single-layer checkpoint [s, s + 1), its layer stored with option o: all it needs
        # besides its rest (the inner plan is that one layer)
        self.single = np.full((U, n_opt), np.iinfo(np.int64).max // 4, dtype=np.int64)
        for s, ly in enumerate(L):
            d = L[s - 1].x_bytes if s > 0 else chain.delta_in_bytes
            grad = ly.grad_bytes - ly.held_bytes
            backs = []  # each option's backward with the prefetch
            for o, name in enumerate(ut.opt_names[s]):
                v = ly.held(False, _beside(chain, s + 1))
                v = v if name == STORE else v.option(name)
                b = v.xbar_bytes + v.x_bytes + max(v.bwd_tmp_bytes + pf[s],
                                                   d + grad - v.xbar_bytes - v.x_bytes)
                backs.append(b)
                f = (v.stop_xbar_bytes + v.stop_fwd_tmp_bytes if name == STORE else
                     v.xbar_bytes + v.fwd_tmp_bytes) + pf[s]
                need = int(pt.inner_extra[s + 1, U]) + int(h[s]) + max(f, b - int(xo[s]))
                self.single[s, o] = max(int(pt.fnone[s, s + 1]), need)
            js = np.arange(s + 2, n + 1)
            self.off[s, js] = pt.inner_extra[js, U] + hp[js] - hp[s]
            back = max(backs) if prefetch == "worst" else min(backs)
            pfs = (pt.inner_extra[js, U] + h[s] + back + gp[js] - gp[s + 1] - xo[js - 1]
                   if pf[s] else 0)
            self.fixed[s, js] = np.maximum(pt.fnone[s, js], pfs)
        self.P, self.Q = pt.fwd_prefix_ms, pt.ckpt_end_ms
        self._min_max()

    def _min_max(self) -> None:
        U, pt = self.U, self.pt
        R = np.zeros(U + 1, dtype=np.int64)
        K = np.zeros(U + 1)
        R[U - 1], K[U - 1] = int(pt.store_req[U - 1, U]), 0.0
        for s in range(U - 2, -1, -1):
            best: tuple[int, float] | None = None
            for r, k in self._options(s, R, K):
                if best is None or r < best[0] or (r == best[0] and k < best[1]):
                    best = (r, k)
            assert best is not None
            R[s], K[s] = best
        self.R, self.K = R, K

    def _options(self, s: int, R: np.ndarray, K: np.ndarray):
        """(bytes, recompute estimate) of every first step at the tail ``[s, U)``."""
        U, ut, pt = self.U, self.ut, self.pt
        xo = ut.x_out
        for o in range(ut.n_options):
            ms = float(ut.opt_ms[s, o])
            if o and ms == INF:
                continue
            yield (max(int(pt.opt_store_req[o, s, U]), int(ut.opt_hold[s, o]) + int(R[s + 1])),
                   float(K[s + 1]) + ms)
            yield (max(int(self.single[s, o]), int(xo[s]) + int(R[s + 1])),
                   float(self.Q[s + 1] - self.P[s]) + ms + float(K[s + 1]))
        for j in range(s + 2, U):
            yield (max(int(self.fixed[s, j]), int(xo[j - 1]) + int(R[j]),
                       int(self.off[s, j]) + int(self.RA[s, j])),
                   float(self.Q[j] - self.P[s]) + float(self.KA[s, j]) + float(K[j]))

    @property
    def need_bytes(self) -> int:
        """The least bytes above the chain's start any plan needs."""
        return int(self.R[0])

    def min_peak_parts(self, avail: int) -> tuple[list[tuple[int, int]], dict[int, int]]:
        """Checkpointed ranges and ``{unit: option}`` of a plan needing at most ``avail`` bytes
        (at least ``need_bytes``): at each step the feasible option whose smallest-peak
        completion recomputes least (slack spent on storing, as ``PeakTable.parts``)."""
        U, ut = self.U, self.ut
        ranges: list[tuple[int, int]] = []
        chosen: dict[int, int] = {}
        inner = exact_chooser(self.ua, self.pa, self.RA, self.KA, None)
        s, m = 0, avail
        while s < U - 1:
            steps = []
            for o in range(ut.n_options):
                ms = float(ut.opt_ms[s, o])
                if o and ms == INF:
                    continue
                h = int(ut.opt_hold[s, o])
                if max(int(self.pt.opt_store_req[o, s, U]), h + int(self.R[s + 1])) <= m:
                    steps.append((float(self.K[s + 1]) + ms, ("store", s + 1, o)))
                if max(int(self.single[s, o]), int(ut.x_out[s]) + int(self.R[s + 1])) <= m:
                    steps.append((float(self.Q[s + 1] - self.P[s]) + ms + float(self.K[s + 1]),
                                  ("ckpt", s + 1, o)))
            for j in range(s + 2, U):
                if max(int(self.fixed[s, j]), int(ut.x_out[j - 1]) + int(self.R[j]),
                       int(self.off[s, j]) + int(self.RA[s, j])) <= m:
                    steps.append((float(self.Q[j] - self.P[s]) + float(self.KA[s, j]) + float(self.K[j]),
                                  ("ckpt", j, -1)))
            if not steps:
                raise PlannerBugError(f"held DP: no step fits at ({s}, {m})")
            _, (kind, j, o) = min(steps, key=lambda t: t[0])
            s, m = self._take(s, m, kind, j, o, ranges, chosen,
                              lambda a, b, mb: reconstruct_options(self.ua.bounds, b, mb, inner, start=a))
        return ranges, chosen

    def _take(self, s: int, m: int, kind: str, j: int, o: int, ranges: list[tuple[int, int]],
              chosen: dict[int, int], read) -> tuple[int, int]:
        """Record one top-level step; the next tail and what it has."""
        ut = self.ut
        if kind == "store":
            if o:
                chosen[s] = o
            return s + 1, m - int(ut.opt_hold[s, o])
        ranges.append((ut.bounds[s][0], ut.bounds[j - 1][1]))
        if o >= 0:  # a single-layer checkpoint, its layer stored with option o
            if o:
                chosen[s] = o
        else:
            r2, o2 = read(s, j, m - int(self.off[s, j]))
            ranges.extend(r2)
            chosen.update(o2)
        return j, m - int(ut.x_out[j - 1])

    def frontier(self, cap: int, ub: float | None = None) -> Frontiers | None:
        """The least-recompute frontiers up to ``cap`` bytes (None when the inner frontiers
        outgrow ``HELD_PARETO_MAX_POINTS``), pruned by ``ub``, the recompute of a plan that fits.

        The inner table is given no bytes cap: it would reach its sub-chains through its own
        columns ``e = U``, which are not the top level's (only the recompute cap, which every
        path there passes, prunes it)."""
        inner = ParetoTable(self.ua, self.pa, self.RA, UNCAPPED, limits.HELD_PARETO_MAX_POINTS, ub)
        if not inner.ok:
            return None
        return Frontiers(self, inner, cap)


class Frontiers:
    """``F[s]``: the (bytes, least recompute, choice) breakpoints of the tail ``[s, U)``; a
    choice is ``-1 - o`` for ``Store(s)`` with option ``o``, else ``j * n_opt + o`` for the
    checkpoint ``[s, j)`` (``o``: the option of a single-layer checkpoint's layer; 0 else)."""

    def __init__(self, top: TopLevel, inner: ParetoTable, cap: int):
        self.top, self.inner, self.cap = top, inner, cap
        U, ut, pt = top.U, top.ut, top.pt
        n_opt = ut.n_options
        xo = ut.x_out
        i64 = np.int64
        F: list = [None] * U
        F[U - 1] = _envelope(np.array([int(pt.store_req[U - 1, U])], dtype=i64), np.zeros(1),
                             np.array([-1], dtype=i64), cap, INF)
        for s in range(U - 2, -1, -1):
            mems, costs, chs = [], [], []
            rm, rc, _ = F[s + 1]
            for o in range(n_opt):
                ms = float(ut.opt_ms[s, o])
                if o and ms == INF:
                    continue
                mems.append(np.maximum(rm + int(ut.opt_hold[s, o]), int(pt.opt_store_req[o, s, U])))
                costs.append(rc + ms)
                chs.append(np.full(len(rm), -1 - o, dtype=i64))
                mems.append(np.maximum(rm + int(xo[s]), int(top.single[s, o])))
                costs.append(rc + ms + float(top.Q[s + 1] - top.P[s]))
                chs.append(np.full(len(rm), (s + 1) * n_opt + o, dtype=i64))
            for j in range(s + 2, U):
                x, off, fx = int(xo[j - 1]), int(top.off[s, j]), int(top.fixed[s, j])
                if max(fx, x + int(top.R[j]), off + int(top.RA[s, j])) > cap:
                    continue  # no plan with this checkpoint within the cap
                am, ac, _ = inner._get(s, j)
                jm, jc, _ = F[j]
                if not len(am) or not len(jm):
                    continue
                at = np.maximum(np.concatenate([jm + x, am + off]), fx)
                at = at[at <= cap]
                c = _stair(jm, jc, at - x) + _stair(am, ac, at - off) + float(top.Q[j] - top.P[s])
                ok = np.isfinite(c)
                mems.append(at[ok])
                costs.append(c[ok])
                chs.append(np.full(int(ok.sum()), j * n_opt, dtype=i64))
            F[s] = _envelope(np.concatenate(mems), np.concatenate(costs), np.concatenate(chs), cap, INF)
        self.F = F

    def cost(self, avail: int) -> float:
        m, c, _ = self.F[0]
        k = int(np.searchsorted(m, avail, side="right")) - 1
        return float(c[k]) if k >= 0 else INF

    def parts(self, avail: int) -> tuple[list[tuple[int, int]], dict[int, int]]:
        """Checkpointed ranges and ``{unit: option}`` of the least-recompute plan within
        ``avail`` bytes above the chain's start (it must be feasible)."""
        top = self.top
        U, n_opt = top.U, top.ut.n_options
        ranges: list[tuple[int, int]] = []
        chosen: dict[int, int] = {}
        s, m = 0, avail
        while s < U - 1:
            mem, _, ch = self.F[s]
            k = int(np.searchsorted(mem, m, side="right")) - 1
            if k < 0:
                raise PlannerBugError(f"held DP reconstruction: no plan of [{s}, {U}) fits {m} bytes")
            c = int(ch[k])
            if c < 0:
                s, m = top._take(s, m, "store", s + 1, -1 - c, ranges, chosen, None)
            else:
                j, o = divmod(c, n_opt)
                single = j == s + 1
                s, m = top._take(s, m, "ckpt", j, o if single else -1, ranges, chosen,
                                 lambda a, b, mb: reconstruct_options(top.ua.bounds, b, mb,
                                                                      self.inner._choose, start=a))
        return ranges, chosen


def _stair(mem: np.ndarray, cost: np.ndarray, at: np.ndarray) -> np.ndarray:
    """The staircase (``mem`` ascending, ``cost`` descending) at each of ``at``: the cost of the
    last breakpoint at most there (inf below the first)."""
    k = np.searchsorted(mem, at, side="right") - 1
    return np.where(k >= 0, cost[np.maximum(k, 0)], INF)


@lru_cache(maxsize=16)
def top_level(chain: Chain, prefetch: str = "worst") -> TopLevel:
    return TopLevel(chain, prefetch)


def bound_exact(chain: Chain) -> bool:
    """Whether the prefetch's option does not matter (``TopLevel``): no layer with selective
    options after one with an all-gather buffer."""
    L = chain.layers
    return not any(L[s].options and L[s - 1].gather_bytes for s in range(1, len(L)))


def plan_from_parts(chain: Chain, top: TopLevel, parts: tuple[list[tuple[int, int]], dict[int, int]],
                    params: dict) -> Plan:
    ranges, chosen = parts
    n = chain.n_layers
    plan = Plan("dp", n, items_from_ranges(n, ranges), params)
    return plan.with_options(top.ut.option_names(chosen)) if chosen else plan


def min_peak(chain: Chain) -> int:
    """The smallest peak of a held chain (``held_applies``): exact, bar the prefetch's option
    (``TopLevel``): then the smallest peak a plan of the safe tables reaches."""
    lowest = max(fixed_peak(chain), base_bytes(chain) + top_level(chain).need_bytes)
    if chain.unsaved_bytes:  # the tables' bound can pass the plan without checkpoints
        return min(lowest, none_peak(chain))
    return lowest


def min_peak_plan(chain: Chain, budget_bytes: int | None = None) -> Plan:
    """A plan reaching ``min_peak`` (or fitting ``budget_bytes``), slack spent on storing."""
    n = chain.n_layers
    params = {"budget_bytes": budget_bytes, "min_peak": True}
    if chain.unsaved_bytes and min_peak(chain) == none_peak(chain):
        return Plan("dp", n, plan_none(n).items, params)
    top = top_level(chain)
    avail = top.need_bytes if budget_bytes is None else max(top.need_bytes, budget_bytes - base_bytes(chain))
    return plan_from_parts(chain, top, top.min_peak_parts(avail), params)


def least_recompute_plan(chain: Chain, budget_bytes: int) -> tuple[Plan | None, float]:
    """The least-recompute plan within ``budget_bytes`` (at least ``min_peak``), or None when
    the inner frontiers outgrow their limit; and a lower bound on the optimum's recompute (its
    own when ``bound_exact``). The frontiers stop at the budget, pruned by the recompute of the
    smallest-peak plan that spends the slack on storing (an upper bound on the optimum)."""
    top = top_level(chain)
    base = base_bytes(chain)
    ub = simulate(chain, min_peak_plan(chain, budget_bytes)).recompute_ms
    fr = top.frontier(max(0, budget_bytes - base), ub)
    if fr is None:
        return None, 0.0
    avail = budget_bytes - base
    cost = fr.cost(avail)
    if cost == INF:
        raise PlannerBugError(f"held dp found no plan at budget {budget_bytes} above the smallest peak "
                              f"{min_peak(chain)}")
    plan = plan_from_parts(chain, top, fr.parts(avail), {"budget_bytes": budget_bytes})
    if bound_exact(chain):
        return plan, cost
    low = Frontiers(top_level(chain, "least"), fr.inner, fr.cap)
    return plan, low.cost(avail)


def plan_held(chain: Chain, budget_bytes: int) -> tuple[Plan, bool, tuple[str, ...]]:
    """The least-recompute plan of a held chain (``held_applies``) at a budget from ``min_peak``
    up to below the peak without checkpoints: (plan, proven optimal, notes)."""
    notes: list[str] = []
    plan, low = least_recompute_plan(chain, budget_bytes)
    exact = True
    if plan is None:
        exact = False
        notes.append("held layers: the exact frontiers outgrew their limit; the smallest-peak "
                     "plan with the slack spent on storing")
        plan = replace(min_peak_plan(chain, budget_bytes), params={"budget_bytes": budget_bytes})
    elif simulate(chain, plan).recompute_ms > low * (1 + 1e-9) + 1e-9:
        exact = False
        notes.append("the backward prefetch beside a top-level checkpoint's first layer was "
                     "counted with that layer's costliest selective option (safe: the plan "
                     "fits, but may recompute more than the optimum)")
    return plan, exact, tuple(notes)
