"""The one plan reader: a plan's checkpointed ranges and options, step by step from any table."""
from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ...errors import PlannerBugError
from ..groups import Units
from .common import INF, Chooser, Step
from .pairs import PairCosts


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
            raise PlannerBugError(f"DP reconstruction: no feasible option at ({s}, {e}, {mb})")
        pick = best[1]
        if pick is None:
            return None, mb - int(u.opt_hold[s, bo]), None, bo
        if pick > U:  # long: no inner plan to read
            return pick - U, mb - int(xo[pick - U - 1]), None, 0
        return pick, mb - int(xo[pick - 1]), mb - int(pc.inner_extra[pick, e]), 0

    return choose
