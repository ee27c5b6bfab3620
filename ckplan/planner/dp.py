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

``m`` is counted in slots of ``slot_bytes``. Slot counts are rounded so that the DP is
conservative: requirements and memory taken are rounded up, memory given back is rounded down,
so a plan it returns never exceeds the budget in the exact simulator. When every size is a
multiple of the slot (``slot_bytes`` = gcd of all sizes) the DP is exact.

Complexity O(U^3 M) for U units and M slots, vectorised over slots with numpy: for each end
``e`` and each split ``j`` one array operation covers every start ``s < j`` and every slot.
Long chains are grouped into at most ``groups`` units (``groups.py``), exact over plans that
only cut between groups.

``min_peak`` solves the companion min-max program over exact integer bytes: the smallest
available memory for which a plan exists, i.e. the smallest achievable peak.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .chain import Chain
from .groups import Units, equal_cuts, make_units, size_gcd
from .plan import Checkpoint, Item, Plan, Store
from .simulate import simulate

INF = np.inf
CELL_BUDGET = 20_000_000  # U * U * slots float64 cells: ~160 MB, ~1 s at 100 layers
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
    return (a + q // 2) // q


class _Matrices:
    """Derived pair quantities of a unit chain, in exact bytes (U x (U+1) int64)."""

    def __init__(self, u: Units):
        U = u.size
        self.U = U
        gp = np.concatenate([[0], np.cumsum(u.grad)])
        self.gs = gp[None, :] - gp[:, None]  # gs[j, e] = grads of units j..e-1
        self.P = np.concatenate([[0.0], np.cumsum(u.fwd_ms)])  # P[j] = fwd time of units < j
        xo = u.x_out
        # Store s inside a sequence ending at e.
        self.sreq = np.zeros((U, U + 1), dtype=np.int64)
        # Checkpoint [j-?..j) inside [., e): memory the inner gets back/loses, indexed [j, e].
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
        U = u.size
        q = slot
        div = _ceil_div if rounding == "up" else _near_div
        self.hs = div(u.hold, q)
        self.xs = div(u.x_out, q)
        self.ss = div(mx.sreq, q)
        self.ds = div(mx.dlt, q)
        self.fs = np.minimum(div(mx.fnone, q), M + 1)
        P = mx.P
        C = np.empty((U, U + 1, M + 1))  # every C[s, e] with s < e is written below
        mgrid = np.arange(M + 1)
        for e in range(1, U + 1):
            best = np.full((e, M + 1), INF)  # min over j of C[s,j,m-d] + C[j,e,m-x] + P[j]
            for j in range(e - 1, -1, -1):
                # Finish C[j, e]: every checkpoint [j, j') with j' > j has been added to best[j].
                req = max(0, min(int(self.ss[j, e]), M + 1))
                if j + 1 == e:
                    store = np.zeros(M + 1)
                else:
                    store = self._shift(C[j + 1, e], int(self.hs[j]))
                store[:req] = INF
                np.minimum(store, best[j] - P[j], out=C[j, e])
                if j == 0:
                    continue
                # Checkpoint [s, j) for every s < j, followed by the rest [j, e).
                rest = self._shift(C[j, e], int(self.xs[j - 1])) + P[j]
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
        out = np.empty(M + 1)
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
        out = np.empty(blk.shape)
        if d >= 0:
            d = min(d, M + 1)
            out[:, :d] = INF
            np.add(blk[:, :M + 1 - d], add[d:], out=out[:, d:])
        else:
            d = max(d, -(M + 1))
            np.add(blk[:, -d:], add[:M + 1 + d], out=out[:, :M + 1 + d])
            np.add(blk[:, M:M + 1], add[M + 1 + d:], out=out[:, M + 1 + d:])
        return out

    # Scalar versions of the same arithmetic, for reconstruction.
    def _at(self, s: int, e: int, m: int) -> float:
        if m < 0:
            return INF
        return float(self.C[s, e, min(m, self.M)])

    def _options(self, s: int, e: int, m: int):
        """(value, choice) pairs at (s, e, m); choice None = Store, else the checkpoint end j."""
        P = self.mx.P
        req = int(self.ss[s, e])
        if m < req:
            store = INF
        elif s + 1 == e:
            store = 0.0
        else:
            store = self._at(s + 1, e, m - int(self.hs[s]))
        yield store, None
        for j in range(s + 1, e):
            if m < self.fs[s, j]:
                continue
            r = self._at(j, e, m - int(self.xs[j - 1]))
            if r == INF:
                continue
            c = self._at(s, j, m - int(self.ds[j, e]))
            yield (c + (r + P[j])) - P[s], j

    def items(self, s: int, e: int, m: int) -> list[Item]:
        """Reconstruct the optimal sequence for units [s, e) at slot m."""
        out: list[Item] = []
        bounds = self.u.bounds
        U = self.u.size
        while s < e:
            value, choice = min(self._options(s, e, m), key=lambda vc: vc[0])
            if value == INF:
                raise RuntimeError(f"DP reconstruction reached an infeasible state ({s}, {e}, {m})")
            if choice is None:
                if s < U - 1:  # the post unit is not a layer
                    a, b = bounds[s]
                    out.extend(Store(i) for i in range(a, b))
                m -= int(self.hs[s])
                s += 1
            else:
                j = choice
                inner = self.items(s, j, min(m - int(self.ds[j, e]), self.M))
                out.append(Checkpoint(bounds[s][0], bounds[j - 1][1], tuple(inner)))
                m -= int(self.xs[j - 1])
                s = j
        return out


class _PeakTable:
    """``R[s, e]``: the least bytes above the start for which [s, e) has a plan (exact ints),
    with ``K[s, e]`` the least recompute among the options reaching it (a tie-break only)."""

    def __init__(self, u: Units, mx: _Matrices):
        U = u.size
        self.u, self.mx = u, mx
        big = np.int64(2**62)
        R = np.full((U, U + 1), big, dtype=np.int64)
        K = np.full((U, U + 1), INF)
        P = mx.P
        xo = u.x_out
        for e in range(1, U + 1):
            bestR = np.full(e, big, dtype=np.int64)
            bestK = np.full(e, INF)
            for j in range(e - 1, -1, -1):
                if j + 1 == e:
                    sr, sk = mx.sreq[j, e], 0.0
                else:
                    sr, sk = max(mx.sreq[j, e], u.hold[j] + R[j + 1, e]), K[j + 1, e]
                if sr < bestR[j] or (sr == bestR[j] and sk <= bestK[j]):  # ties: store
                    R[j, e], K[j, e] = sr, sk
                else:
                    R[j, e], K[j, e] = bestR[j], bestK[j]
                if j == 0:
                    continue
                v = np.maximum(np.maximum(mx.fnone[:j, j], xo[j - 1] + R[j, e]),
                               mx.dlt[j, e] + R[:j, j])
                k = (P[j] - P[:j]) + K[j, e] + K[:j, j]
                better = (v < bestR[:j]) | ((v == bestR[:j]) & (k < bestK[:j]))
                bestR[:j] = np.where(better, v, bestR[:j])
                bestK[:j] = np.where(better, k, bestK[:j])
        self.R, self.K = R, K

    def items(self, s: int, e: int) -> list[Item]:
        """A plan reaching R[s, e]: among options that reach it, least recompute."""
        u, mx, R, K = self.u, self.mx, self.R, self.K
        out: list[Item] = []
        U = u.size
        while s < e:
            target = R[s, e]
            if s + 1 == e:
                sr, sk = mx.sreq[s, e], 0.0
            else:
                sr, sk = max(mx.sreq[s, e], u.hold[s] + R[s + 1, e]), K[s + 1, e]
            best = (sr, sk, None) if sr == target else (None, INF, None)
            for j in range(s + 1, e):
                v = max(mx.fnone[s, j], u.x_out[j - 1] + R[j, e], mx.dlt[j, e] + R[s, j])
                k = (mx.P[j] - mx.P[s]) + K[j, e] + K[s, j]
                if v == target and k < best[1]:
                    best = (v, k, j)
            if best[0] is None:
                raise RuntimeError("min-peak reconstruction found no option")
            j = best[2]
            if j is None:
                if s < U - 1:
                    a, b = u.bounds[s]
                    out.extend(Store(i) for i in range(a, b))
                s += 1
            else:
                inner = self.items(s, j)
                out.append(Checkpoint(u.bounds[s][0], u.bounds[j - 1][1], tuple(inner)))
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


def _units_for(chain: Chain, mode: str, groups: int | None) -> Units:
    n = chain.n_layers
    if mode not in ("auto", "exact", "grouped"):
        raise ValueError(f"dp mode must be auto, exact or grouped, not {mode!r}")
    g = groups or DEFAULT_GROUPS
    if mode == "exact" or (mode == "auto" and n <= EXACT_MAX_LAYERS) or g >= n:
        return make_units(chain)
    return make_units(chain, equal_cuts(n, g))


def min_peak(chain: Chain) -> int:
    """The smallest peak any plan reaches (exact: a min-max DP over bytes, every layer a unit)."""
    u = make_units(chain)
    pt = _PeakTable(u, _Matrices(u))
    return max(fixed_peak(chain), base_bytes(chain) + int(pt.R[0, u.size]))


def min_peak_plan(chain: Chain) -> Plan:
    """A plan reaching ``min_peak`` (ties broken towards less recompute)."""
    u = make_units(chain)
    pt = _PeakTable(u, _Matrices(u))
    return Plan("dp", chain.n_layers, tuple(pt.items(0, u.size)), {"budget_bytes": None,
                                                                    "min_peak": True})


class DPSolver:
    """One cost table per chain, reusable for every budget below the unrestricted peak
    (``sweep`` reads a whole frontier from it). The slots are the same for every budget.

    ``rounding="nearest"`` (default) rounds each size to the nearest slot, so rounding errors
    cancel instead of adding up along the chain; the plan read at slot ``m`` is then checked in
    the exact simulator and, if it overshoots, the next lower ``m`` is read, and so on: the
    returned plan is the one of the largest ``m`` that fits, which keeps the result monotone in
    the budget. ``rounding="up"`` is rotor's conservative rounding: the first read always fits,
    but a chain of n stored layers can lose up to n slots. With gcd-sized slots both are exact.
    """

    def __init__(self, chain: Chain, *, max_slots: int | None = None, mode: str = "auto",
                 groups: int | None = None, rounding: str = "nearest",
                 top_bytes: int | None = None):
        from .strategies import plan_none  # strategies imports this module

        if rounding not in ("nearest", "up"):
            raise ValueError(f"rounding must be 'nearest' or 'up', not {rounding!r}")
        self.chain = chain
        self.rounding = rounding
        self.units = _units_for(chain, mode, groups)
        self.grouped = self.units.size < chain.n_layers + 1
        self.none_peak = simulate(chain, plan_none(chain.n_layers)).peak_bytes
        top = self.none_peak if top_bytes is None else top_bytes
        span = max(0, top - base_bytes(chain))
        g = size_gcd(chain)
        U = self.units.size
        if max_slots is None:
            max_slots = max(MIN_SLOTS, min(MAX_SLOTS, CELL_BUDGET // (U * U)))
        q = choose_slot(self.units, span, g, max_slots)
        self.slot_bytes = int(q)
        self.M = int(span // q)
        self.exact = q == g and not self.grouped
        self.table = _CostTable(self.units, _Matrices(self.units), self.slot_bytes, self.M,
                                "up" if q == g else rounding)
        self.reads = 0  # plans read from the table (for benchmarks)

    def slots_for(self, budget_bytes: int) -> int:
        return (budget_bytes - base_bytes(self.chain)) // self.slot_bytes

    def solve(self, budget_bytes: int) -> Plan | None:
        """The DP's plan at this budget, or None when it finds none (the caller decides)."""
        if budget_bytes < fixed_peak(self.chain):
            return None
        U = self.units.size
        m = min(self.slots_for(budget_bytes), self.M)
        while m >= 0 and self.table.C[0, U, m] < INF:
            items = self.table.items(0, U, m)
            self.reads += 1
            plan = Plan("dp", self.chain.n_layers, tuple(items), {"budget_bytes": budget_bytes})
            peak = simulate(self.chain, plan).peak_bytes
            if peak <= budget_bytes:
                return plan
            if self.table_is_conservative:  # the rounding argument forbids this
                raise RuntimeError(f"dp plan peaks at {peak} > budget {budget_bytes}: planner bug")
            m -= 1
        return None

    @property
    def table_is_conservative(self) -> bool:
        return self.rounding == "up" or self.slot_bytes == size_gcd(self.chain)


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
            if int(v) // k >= q0:
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
        plan = Plan("dp", chain.n_layers, min_peak_plan(chain).items,
                    {"budget_bytes": budget_bytes, "min_peak": True})
        exact = False
        notes.append("the budget is within the DP's slot rounding of the smallest peak: "
                     "returned the smallest-peak plan")
    if solver.grouped:
        notes.append(f"{chain.n_layers} layers grouped into {solver.units.size - 1} units: "
                     "optimal among plans that cut between groups")
    elif not solver.exact:
        notes.append(f"memory counted in slots of {solver.slot_bytes} bytes: the plan fits "
                     "(checked in the simulator) but may recompute a little more than the optimum")
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
        tail = f"; memory no plan can free (parameters, batch, optimizer state) is {fb(chain.persistent_bytes)}"
    return InfeasibleBudgetError(
        f"budget {fb(budget_bytes)} is below the smallest feasible peak {fb(lowest)} "
        f"(recompute everything, nested){tail}",
        tip="try a smaller --batch-size, --precision bf16, or --optimizer sgd",
        budget_bytes=budget_bytes, min_peak_bytes=lowest, persistent_bytes=chain.persistent_bytes)
