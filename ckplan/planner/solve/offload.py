"""The least-time plan with activation offload (``offload``, a top-level Store option).

Offload is decided at the top level only, so the top-level sequence is planned on its own, as for
autocast copies (``casts.py``): a forward DP over single-layer units whose states are the prefix's
``(held bytes, autocast copies, bytes in flight, time added)``. Each top-level item is

* ``Store(s)``: holds ``xbar[s]``;
* ``Offload(s)``: its forward and backward are a store's; it then holds ``x[s]`` only, and its
  other saved bytes ``o[s]`` stay on the device during the next stage's forward op (the copy out)
  and its last backward op, ``B(s + 1)`` (the copy back; the last layer's come back at its own
  backward): the state's bytes in flight, added to the next item's first forward op and to its
  ``B(s + 1)`` (``transfers.py``);
  it costs the copies' time not hidden behind that stage (``Chain.offload_ms``);
* ``Checkpoint[s, j)``: its forward keeps ``x[j - 1]``, its inner plan is the least-recompute plan
  of the slot tables (exact with gcd-sized slots, as ``casts.py``'s).

Every op's live bytes are the prefix's plus the item's own, so each item is checked when it is
placed (forward against the budget less held bytes and copies, backward against the budget less
held bytes) and a state that cannot go on dies; states another beats on all four are dropped,
which keeps the optimum. Planned on ``chain.conservative()`` without selective options; the plan
is checked by the simulator on the chain itself.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from .. import limits
from ..casts import top_level_needs
from ..chain import Chain
from ..groups import size_gcd
from ..plan import OFFLOAD, STORE, Plan, items_from_ranges
from ..simulate import simulate
from ..tables import CostTable, base_bytes, exact_chooser, fixed_peak, reconstruct
from .common import DPResult, choose_slot, layer_tables

# a state: (held, copies, in flight, time added, previous unit, its state index, step)
# step: -1 store, -2 offload, j > 0 a checkpoint [s, j)
_State = tuple[int, int, int, float, int, int, int]
STORE_STEP, OFFLOAD_STEP = -1, -2


def plan_offload(chain: Chain, budget_bytes: int, none_peak: int) -> Plan | None:
    """The least-time plan of store, offload and checkpoints (inner plans without offload) whose
    simulated peak fits ``budget_bytes``; None when the chain has no host link, has held layers,
    or the DP finds no plan that fits."""
    if not chain.can_offload or chain.has_holds or budget_bytes < fixed_peak(chain):
        return None
    plain = chain.conservative().without_options()
    t = layer_tables(plain)
    u, pc, pt = t.units, t.pairs, t.peaks
    U = u.size
    n = U - 1
    span = max(0, none_peak - base_bytes(plain))
    slots = max(limits.MIN_SLOTS, min(limits.MAX_SLOTS, limits.CELL_BUDGET // (U * U)))
    g = size_gcd(plain)
    q = choose_slot(u, span, g, slots)
    table = CostTable(u, pc, q, max(1, span // q), "up" if q == g else "nearest")
    bwd_store, fwd_none, cum = top_level_needs(plain, u, pc)
    avail = budget_bytes - base_bytes(plain)
    off = [plain.offload_bytes(i) for i in range(n)]
    off_ms = [sum(plain.offload_ms(i)) for i in range(n)]
    P, Q = pc.fwd_prefix_ms, pc.ckpt_end_ms
    cut = set(chain.breaks)
    states: list[list[_State]] = [[] for _ in range(U)]
    states[0] = [(0, 0, 0, 0.0, -1, -1, 0)]
    for s in range(n):
        states[s] = _prune(states[s], limits.CAST_MAX_STATES)
        hold = int(u.hold[s])
        for idx, (h, c, e, cost, _, _, _) in enumerate(states[s]):
            mb = avail - h
            mf = mb - c
            if u.fwd_req[s] + e <= mf and bwd_store[s] + e <= mb:
                states[s + 1].append((h + hold, c, 0, cost, s, idx, STORE_STEP))
                states[s + 1].append((h + int(u.x_out[s]), c, off[s], cost + off_ms[s], s, idx, OFFLOAD_STEP))
            if bwd_store[s] + e > mb:
                continue
            for j in range(s + 1, U):
                if (j - 1 > s and j - 1 in cut) or fwd_none[s][j - s - 1] > mf:
                    break  # no checkpoint spans a break; the no-saving forward only grows with j
                if fwd_none[s][0] + e > mf:
                    break
                extra = int(pc.inner_extra[j, U])
                if extra + int(pt.R[s, j]) > mb:
                    continue
                step = (Q[j] - P[s]) + table.estimate(s, j, mb - extra, float(pt.K[s, j]))
                states[j].append((h + int(u.x_out[j - 1]), c + int(cum[j] - cum[s]), 0, cost + step, s, idx, j))
    last = states[n] = _prune(states[n], limits.CAST_MAX_STATES)
    ends = [i for i, (h, c, e, _, _, _, _) in enumerate(last)  # the last layer's come back at its own backward
            if u.fwd_req[n] + e <= avail - h - c and bwd_store[n] <= avail - h]
    if not ends:
        return None
    plan = _read(plain, u, pc, pt, table, states, min(ends, key=lambda k: last[k][3]), avail)
    return _fewer_offloads(chain, plan, budget_bytes) if simulate(chain, plan).peak_bytes <= budget_bytes else None


def _fewer_offloads(chain: Chain, plan: Plan, budget_bytes: int) -> Plan:
    """``plan`` with each offloaded layer stored instead, last layer first, wherever that still fits
    and costs no more time: among plans of equal time, fewer copies and less host memory."""
    sc = simulate(chain, plan)
    options = list(plan.options())
    for i in reversed(range(chain.n_layers)):
        if options[i] != OFFLOAD:
            continue
        options[i] = STORE
        trial = plan.with_options(options)
        t = simulate(chain, trial)
        if t.peak_bytes <= budget_bytes and t.step_ms <= sc.step_ms:
            plan, sc = trial, t
        else:
            options[i] = OFFLOAD
    return plan


def _read(chain: Chain, u, pc, pt, table: CostTable, states: list[list[_State]], i: int,
          avail: int) -> Plan:
    """The plan of state ``i`` at the post: its top-level steps back to the start."""
    U = u.size
    n = U - 1
    ranges: list[tuple[int, int]] = []
    offloaded: dict[int, str] = {}
    choose = exact_chooser(u, pc, pt.R, pt.K, table.estimate)
    s = n
    while s > 0:
        _, _, _, _, prev, idx, step = states[s][i]
        if step == OFFLOAD_STEP:
            offloaded[prev] = OFFLOAD
        elif step > 0:
            h0 = states[prev][idx][0]
            ranges.append((prev, step))
            ranges.extend(reconstruct(u.bounds, step, avail - h0 - int(pc.inner_extra[step, U]), choose, start=prev))
        s, i = prev, idx
    plan = Plan("dp", n, items_from_ranges(n, ranges), {"offload": True})
    return plan.with_options(offloaded) if offloaded else plan


def _prune(states: list[_State], max_states: int) -> list[_State]:
    """Drop states another beats on held bytes, copies, bytes in flight and time at once; keep
    the ``max_states`` cheapest."""
    if len(states) <= 1:
        return states
    states = sorted(states, key=lambda t: (t[3], t[0], t[1], t[2]))
    arr = np.array([t[:3] for t in states], dtype=np.int64)
    keep: list[int] = []
    for i in range(len(states)):  # sorted by time: only earlier states can dominate
        if keep and bool(np.any(np.all(arr[keep] <= arr[i], axis=1))):
            continue
        keep.append(i)
        if len(keep) >= max_states:
            break
    return [states[i] for i in keep]


def with_offload(chain: Chain, budget_bytes: int, found: DPResult | None,
                 none_peak: int) -> DPResult | None:
    """``found`` (the dp plan without offload, None when none fits), or the offload plan when the
    chain has a host link and that plan is faster at the same budget."""
    if not chain.can_offload or chain.has_holds:
        return found
    best = simulate(chain, found.plan) if found is not None else None
    if best is not None and best.step_ms <= chain.base_step_ms:
        return found  # nothing added: nothing to win
    plan = plan_offload(chain, budget_bytes, none_peak)
    if plan is None:
        return found
    sc = simulate(chain, plan)
    if best is not None and sc.step_ms >= best.step_ms:
        return found
    note = (f"{sum(o == OFFLOAD for o in plan.options())} layer(s) offloaded to host memory "
            f"({sc.transfer_ms:.3g} ms of copies not hidden behind compute)")
    params = {**(found.plan.params if found is not None else {}), "budget_bytes": budget_bytes, "offload": True}
    plan = Plan(plan.strategy, plan.n_layers, plan.items, params)
    if found is None:
        return DPResult(plan, 1, 0, False, chain.n_layers + 1, (note,))
    return replace(found, plan=plan, exact=False, notes=(*found.notes, note))
