"""The least-time plan with activation offload (``offload``, a top-level Store option).

Offload is decided at the top level only, so the top-level sequence is planned on its own, as for
autocast copies (``casts.py``): a forward DP over single-layer units whose states are the prefix's
``(held bytes, autocast copies, bytes coming back, copies out in flight, time added)``. Each
top-level item is

* ``Store(s)``: holds ``xbar[s]``, and its copies no op saves to the forward's end (pre's from the
  start); ``Store(s, option)``: a selective option's bytes and copies it
  does not keep, and its recompute time (the option columns of ``groups.make_units``);
* ``Offload(s, option)`` (``sac-compute+offload``, where ``Chain.offload_options``; a run of its
  own, ``plan_offload``): the option's store, what it keeps but its output sent to the host as below;
* ``Offload(s)``: its forward and backward are a store's; it then holds ``x[s]`` only, and its
  other saved bytes ``o[s]`` join the queue of copies out (``transfers.py``): they stay on the
  device until the first layer's forward that ends once the copy is done, or until the last
  layer's forward ends (the step waits there for the rest); in the backward they are on the
  device from ``B(s + d)``, its fetch point, d from 1 to ``window`` (1 unless ``plan_offload``
  runs the DP wider; the last layer's come back at its own backward), the state's bytes coming
  back (per unit: each layer's backward from the fetch point on, and the whole of a checkpoint
  that starts after it, on the safe side); the copy back's time not hidden by ``B(s + 1)`` ..
  ``B(s + d)`` is added (exact with d = 1, where the queue of copies back is empty at each fetch;
  with more, a queued copy may wait longer than priced, which the simulator scores);
* ``Checkpoint[s, j)``: its forward keeps ``x[j - 1]``, its inner plan is the least-recompute plan
  of the slot tables (exact with gcd-sized slots, as ``casts.py``'s).

Every op's live bytes are the prefix's plus the item's own plus the copies out in flight, so each
item is checked when it is placed (each forward op against the budget less held bytes, copies
and the queue's bytes then, backward against the budget less held bytes) and a state that cannot
go on dies; states another beats on all of them at once (the queue: no later, and no more bytes
in flight at any time) are dropped, which keeps the optimum (past ``limits.OFFLOAD_MAX_STATES``
states, fewer on long chains, a unit keeps the cheapest). Planned on ``chain.conservative()``,
checkpoints' inner plans without selective options; the plan is checked by the simulator on the
chain itself, with the release points the replay chose written into it (``simulate.with_releases``).
"""
from __future__ import annotations

from bisect import bisect_left, bisect_right
from dataclasses import replace

from .. import limits
from ..casts import fwd_ops, top_level_needs
from ..chain import Chain
from ..groups import BIG, make_units, size_gcd
from ..plan import FETCH, OFFLOAD, Plan, items_from_ranges
from ..plan_items import OFFLOADED, is_offloaded
from ..simulate import simulate, simulate_items
from ..tables import CostTable, base_bytes, exact_chooser, fixed_peak, reconstruct
from ..transfers import EPS_MS
from .common import DPResult, choose_slot, layer_tables
from .offload_passes import earlier_fetches, fewer_offloads

# the copies out in flight, in queue order: when each is done (ms from the forward's start, on the
# clock of the replay: layers' forward times) and the bytes of it and every later one (suffix sums)
_Dones = tuple[float, ...]
_Sufs = tuple[int, ...]
# a state: (held, copies, coming back, dones, sufs, time added, previous unit, its state index, step);
# coming back: per unit from this one on (``window`` entries), the bytes of copies back already
# started there (an offloaded layer's bytes are back from its fetch point, ``window`` layers on)
# step: -1 store, -2 offload, -2 - o the selective option in column o, OFFLOAD_OPTION - o that option
# with what it keeps offloaded, j > 0 a checkpoint [s, j)
_Back = tuple[int, ...]
_State = tuple[int, int, _Back, _Dones, _Sufs, float, int, int, int]
STORE_STEP, OFFLOAD_STEP, OFFLOAD_OPTION = -1, -2, -10_000
FETCH_CODE = 1_000_000  # an offload whose copy back starts d layers on: its step less FETCH_CODE * (d - 1)
SAC = "sac-"  # the options run by a SAC policy, whose cache saved-tensor hooks can reach (ckplan.sac)


def _enqueue(dones: _Dones, sufs: _Sufs, clock: float, ms: float, nbytes: int) -> tuple[_Dones, _Sufs]:
    """A copy of ``ms`` and ``nbytes`` joins the queue at ``clock``."""
    done = max(clock, dones[-1] if dones else clock) + ms
    return dones + (done,), tuple(x + nbytes for x in sufs) + (nbytes,)


def _shift(back: _Back, k: int, add: int = 0, upto: int = 0) -> _Back:
    """The bytes coming back ``k`` units on, ``add`` more at the first ``upto`` units (a layer just
    offloaded, whose copy back starts ``upto`` layers after it)."""
    out = back[k:] + (0,) * min(k, len(back))
    return tuple(x + add if d < upto else x for d, x in enumerate(out)) if add else out


def _released(dones: _Dones, sufs: _Sufs, lo: int, at: float, last: bool) -> tuple[_Dones, _Sufs, float]:
    """The queue at a layer's forward end ``at``, copies ``[0, lo)`` done and released, and the
    time the step waits there: after the last layer's forward, for every copy."""
    if last:
        return (), (), max(0.0, dones[-1] - at) if lo < len(dones) else 0.0
    return dones[lo:], sufs[lo:], 0.0


def _copies(chain: Chain, window: int = 1) -> tuple[list[float], list[int], list[float], list[float]]:
    """When each layer's forward ends (the replay's clock, summed the same way), what offloading
    it moves, its copy out's time and its copy back's time not hidden by the backward of the
    ``window`` layers after it (1: the next layer's, where the DP's copies back start)."""
    L, n = chain.layers, chain.n_layers
    clock = [0.0]
    for ly in L:
        clock.append(clock[-1] + ly.fwd_ms)
    off = [chain.offload_bytes(i) for i in range(n)]
    out_ms = [off[i] / chain.d2h_bytes_per_ms for i in range(n)]
    back_ms = [max(0.0, off[i] / chain.h2d_bytes_per_ms - sum(ly.bwd_ms for ly in L[i + 1:i + 1 + window]))
               for i in range(n)]
    return clock, off, out_ms, back_ms


def plan_offload(chain: Chain, budget_bytes: int, none_peak: int, *, lookahead: bool = True) -> Plan | None:
    """The least-time plan of store, offload and checkpoints (inner plans without offload) whose
    simulated peak fits ``budget_bytes``, copies back starting at the next layer's backward, and
    then (``lookahead``) earlier where that fits and saves time (``offload_passes.earlier_fetches``); None when
    the chain has no host link, has held layers, or the DP finds no plan that fits.

    On chains of up to ``limits.OFFLOAD_WIDE_MAX_LAYERS`` layers the DP also runs (a) with
    ``lookahead``, where some copy back is not hidden by the next layer's backward but would be by
    the next ``limits.OFFLOAD_LOOKAHEAD`` layers', with a fetch point chosen per offloaded layer
    (``_least_time``'s ``window``: it then offloads layers whose copies back only an earlier start
    hides), and (b) where the chain allows it
    (``Chain.offload_options``), with selective options that also send what they keep to the host
    (``sac-compute+offload``: more choices per layer, which the states' cap can prune the best path
    of, so they are a plan of their own); each plan gets its fetch points and the fastest that fits
    is returned."""
    if not chain.can_offload or chain.has_holds or budget_bytes < fixed_peak(chain):
        return None
    runs = [(1, False)]
    full = chain.conservative()
    if chain.n_layers <= limits.OFFLOAD_WIDE_MAX_LAYERS:  # longer chains: planned once
        if full.offload_options and any(o.name.startswith(SAC) for ly in full.layers for o in ly.options):
            runs.append((1, True))  # options that send what they keep to the host
        wide = limits.OFFLOAD_LOOKAHEAD
        if lookahead and _copies(full, 1)[3] != _copies(full, wide)[3]:
            runs.append((wide, False))  # an earlier start hides more
    best, best_ms = None, 0.0
    for window, moved in runs:
        plan = _least_time(chain, budget_bytes, none_peak, window, moved)
        if plan is None:
            continue
        if lookahead:
            plan = earlier_fetches(chain, plan, budget_bytes)
        sc = simulate(chain, plan)
        if sc.peak_bytes <= budget_bytes and (best is None or sc.step_ms < best_ms - EPS_MS):
            best, best_ms = plan, sc.step_ms
    return best


def _tables(plain: Chain, none_peak: int) -> tuple:
    """The single-layer tables of ``plain`` and its recompute-cost table (slots as the DP's)."""
    t = layer_tables(plain)
    u, pc, pt = t.units, t.pairs, t.peaks
    U = u.size
    span = max(0, none_peak - base_bytes(plain))
    slots = max(limits.MIN_SLOTS, min(limits.MAX_SLOTS, limits.CELL_BUDGET // (U * U)))
    g = size_gcd(plain)
    q = choose_slot(u, span, g, slots)
    return u, pc, pt, CostTable(u, pc, q, max(1, span // q), "up" if q == g else "nearest")


def _least_time(chain: Chain, budget_bytes: int, none_peak: int, window: int, moved: bool) -> Plan | None:
    """The DP (module doc) with copies back started 1 to ``window`` layers on, selective options
    also offloaded where ``moved``; the plan checked by the simulator."""
    full = chain.conservative()
    plain = full.without_options()
    u, pc, pt, table = _tables(plain, none_peak)
    U, n = u.size, u.size - 1
    bwd_store, _, cum = top_level_needs(plain, u, pc)
    ops = fwd_ops(plain, cum)
    avail = budget_bytes - base_bytes(plain)
    clock, off, out_ms, _ = _copies(plain, 1)
    back_by = [[], *(_copies(plain, d)[3] for d in range(1, window + 1))]  # [d][s]: not hidden by d layers
    P, Q, cut = pc.fwd_prefix_ms, pc.ckpt_end_ms, set(chain.breaks)
    stores = _top_stores(full, u, bwd_store)
    sent_by = [[], *(_top_offloads(full, stores, d, moved) for d in range(1, window + 1))]
    states: list[list[_State]] = [[] for _ in range(U)]
    states[0] = [(0, plain.pre.cast_bytes, (0,) * window, (), (), 0.0, -1, -1, 0)]  # pre's unsaved copies
    cap = max(limits.OFFLOAD_MIN_STATES, min(limits.OFFLOAD_MAX_STATES, limits.OFFLOAD_STATE_WORK // (U * U)))
    for s in range(n):
        states[s] = _prune(states[s], cap)
        hold, end, kept = int(u.hold[s]), clock[s + 1], plain.layers[s].unsaved_cast_bytes  # kept: to F's end
        for idx, (h, c, back, dones, sufs, cost, _, _, _) in enumerate(states[s]):
            mb = avail - h
            mf = mb - c
            inflight = sufs[0] if sufs else 0
            lo = bisect_right(dones, end + EPS_MS)
            here, later = back[0], (back[1] if window > 1 else 0)  # at B(s); from B(s + 1) on
            # where its copy back may start: d layers on, only where that hides more than d - 1
            dists = [d for d in range(1, max(1, min(window, n - 1 - s)) + 1)
                     if d == 1 or back_by[d][s] < back_by[d - 1][s] - EPS_MS]
            for col, o_hold, o_fwd, o_bwd, o_cast, o_ms in stores[s]:  # top-level store with an option
                if o_bwd + here <= mb and o_fwd + o_cast + inflight <= mf:
                    d1, s1, wait = _released(dones, sufs, lo, end, s == n - 1)
                    states[s + 1].append((h + o_hold, c + o_cast, _shift(back, 1), d1, s1, cost + o_ms + wait, s,
                                          idx, -2 - col))
                    for d in dists if col in sent_by[1][s] else ():  # and what the option keeps offloaded
                        o_off, o_out, o_back = sent_by[d][s][col]
                        if d > 1 and o_back >= sent_by[d - 1][s][col][2] - EPS_MS:
                            continue  # started earlier it hides no more
                        d2, s2 = _enqueue(d1, s1, end, o_out, o_off) if s < n - 1 else ((), ())
                        w2 = wait + (o_out if s == n - 1 else 0.0)  # the last layer's: waited for at once
                        states[s + 1].append((h + o_hold - o_off, c + o_cast, _shift(back, 1, o_off, d * (s < n - 1)),
                                              d2, s2, cost + o_ms + w2 + o_back, s, idx,
                                              OFFLOAD_OPTION - col - FETCH_CODE * (d - 1)))
            if bwd_store[s] + here > mb:
                continue  # B(s), with the copies back started by then
            if u.fwd_req[s] + kept + inflight <= mf:
                d1, s1, wait = _released(dones, sufs, lo, end, s == n - 1)
                states[s + 1].append((h + hold, c + kept, _shift(back, 1), d1, s1, cost + wait, s, idx, STORE_STEP))
                d2, s2 = _enqueue(d1, s1, end, out_ms[s], off[s])
                if s == n - 1:
                    d2, s2, wait = (), (), wait + out_ms[s]
                for d in dists:
                    states[s + 1].append((h + int(u.x_out[s]), c + kept, _shift(back, 1, off[s], d * (s < n - 1)), d2,
                                          s2, cost + wait + back_by[d][s], s, idx, OFFLOAD_STEP - FETCH_CODE * (d - 1)))
            run, lo = 0, 0  # from here: copies done by each layer's end
            for j in range(s + 1, U):
                k = j - 1
                if k > s and k in cut:
                    break  # no checkpoint spans a break
                run = max(run, ops[s][k - s] + (sufs[lo] if lo < len(sufs) else 0))
                if run > mf:
                    break  # the no-saving forward's peak only grows with j
                lo = bisect_right(dones, clock[j] + EPS_MS, lo)
                extra = int(pc.inner_extra[j, U]) + later  # copies back started before B(s) reach it
                if extra + int(pt.R[s, j]) > mb:
                    continue
                step = (Q[j] - P[s]) + table.estimate(s, j, mb - extra, float(pt.K[s, j]))
                dk, sk, wait = _released(dones, sufs, lo, clock[j], k == n - 1)
                states[j].append((h + int(u.x_out[k]), c + int(cum[j] - cum[s]), _shift(back, j - s), dk, sk,
                                  cost + step + wait, s, idx, j))
    last = states[n] = _prune(states[n], cap)
    ends = [i for i, st in enumerate(last)  # the queue is empty: waited for
            if u.fwd_req[n] <= avail - st[0] - st[1] and bwd_store[n] <= avail - st[0]]
    if not ends:
        return None
    plan = _read(plain, u, pc, pt, table, states, min(ends, key=lambda k: last[k][5]), avail, full)
    if simulate_items(chain, plan.items, fetches=plan.fetches()).peak_bytes > budget_bytes:
        return None
    return fewer_offloads(chain, plan, budget_bytes)


def _top_offloads(full: Chain, stores, window: int, moved: bool) -> list[dict[int, tuple[int, float, float]]]:
    """Per layer, {option column: (bytes it moves to the host, its copy out's time, its copy back's
    time not hidden by the backward of the ``window`` layers after it)} for the selective options
    whose kept tensors may go to the host as well (``moved`` and ``Chain.offload_options``: SAC
    policies)."""
    out: list[dict[int, tuple[int, float, float]]] = [{} for _ in stores]
    if not (moved and full.offload_options and full.can_offload):
        return out
    L = full.layers
    for s, cols in enumerate(stores):
        hidden = sum(ly.bwd_ms for ly in L[s + 1:s + 1 + window])
        for col, *_ in cols:
            name = L[s].options[col - 1].name
            if not name.startswith(SAC):
                continue  # a compiled layer's min-cut option keeps its tensors inside the graph
            nbytes = full.offload_bytes(s, name)
            if nbytes > 0:
                out[s][col] = (nbytes, nbytes / full.d2h_bytes_per_ms,
                               max(0.0, nbytes / full.h2d_bytes_per_ms - hidden))
    return out


def _top_stores(full: Chain, u, bwd_store) -> list[list[tuple[int, int, int, int, int, float]]]:
    """Per layer, its selective options as top-level stores: ``(option column, bytes held, forward
    need, backward need, autocast copies it does not keep, recompute ms)``, from the option columns
    of the chain's single-layer units (``groups.make_units``; column 0, ``store``, is the DP's own)."""
    if not full.has_options:
        return [[] for _ in range(u.size - 1)]
    uo = make_units(full)
    out: list[list[tuple[int, int, int, int, int, float]]] = []
    for s in range(u.size - 1):
        rest = int(bwd_store[s]) - int(u.bwd_req[s])  # what B(s) needs beside its own requirement
        opts = full.layers[s].options
        out.append([(col, int(uo.opt_hold[s, col]), int(uo.opt_fwd_req[s, col]), int(uo.opt_bwd_req[s, col]) + rest,
                     opts[col - 1].cast_bytes, float(uo.opt_ms[s, col]))
                    for col in range(1, uo.n_options) if uo.opt_hold[s, col] < BIG])
    return out


def _read(chain: Chain, u, pc, pt, table: CostTable, states: list[list[_State]], i: int,
          avail: int, full: Chain) -> Plan:
    """The plan of state ``i`` at the post: its top-level steps back to the start."""
    U = u.size
    n = U - 1
    ranges: list[tuple[int, int]] = []
    offloaded: dict[int, str] = {}
    fetch: dict[int, int] = {}  # copies back started later than the next layer's backward
    choose = exact_chooser(u, pc, pt.R, pt.K, table.estimate)
    s = n
    while s > 0:
        prev, idx, step = states[s][i][6:]
        if step < OFFLOAD_STEP and (-step) >= FETCH_CODE:  # an offload fetched d layers on
            d = 1 + (-step) // FETCH_CODE
            step += FETCH_CODE * (d - 1)
            fetch[prev] = prev + d
        if step == OFFLOAD_STEP:
            offloaded[prev] = OFFLOAD
        elif step <= OFFLOAD_OPTION:  # a selective option's column, what it keeps offloaded
            offloaded[prev] = full.layers[prev].options[OFFLOAD_OPTION - step - 1].name + OFFLOADED
        elif step < OFFLOAD_STEP:  # a selective option's column
            offloaded[prev] = full.layers[prev].options[-3 - step].name
        elif step > 0:
            h0 = states[prev][idx][0]
            ranges.append((prev, step))
            ranges.extend(reconstruct(u.bounds, step, avail - h0 - int(pc.inner_extra[step, U]), choose, start=prev))
        s, i = prev, idx
    plan = Plan("dp", n, items_from_ranges(n, ranges), {"offload": True, **({FETCH: fetch} if fetch else {})})
    return plan.with_options(offloaded) if offloaded else plan


def _prune(states: list[_State], max_states: int) -> list[_State]:
    """Drop states another beats on held bytes, copies, bytes coming back, queue and time at
    once; keep the ``max_states`` cheapest."""
    if len(states) <= 1:
        return states
    states = sorted(states, key=lambda t: (t[5], t[0], t[1], sum(t[2]), t[3][-1] if t[3] else 0.0))
    keep: list[_State] = []
    for st in states:  # sorted by time: only earlier states can dominate
        if any(_beats(k, st) for k in keep):
            continue
        keep.append(st)
        if len(keep) >= max_states:
            break
    return keep


def _beats(a: _State, b: _State) -> bool:
    """``a`` (no more time) is as good as ``b`` whatever comes after (both at the same unit): no
    more bytes held, copies or coming back, its queue done no later, and no more bytes in flight at
    any time."""
    if a[0] > b[0] or a[1] > b[1] or any(x > y for x, y in zip(a[2], b[2])):
        return False
    da, sa, db, sb = a[3], a[4], b[3], b[4]
    if not da:
        return True
    if not db or da[-1] > db[-1] + EPS_MS or sa[0] > sb[0]:
        return False
    # bytes in flight drop only where a copy is done: compare them just before each of a's
    for i in range(1, len(da)):
        k = bisect_left(db, da[i] - EPS_MS)
        if sa[i] > (sb[k] if k < len(sb) else 0):
            return False
    return True


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
    note = (f"{sum(is_offloaded(o) for o in plan.options())} layer(s) offloaded to host memory "
            f"({sc.transfer_ms:.3g} ms of copies not hidden behind compute); the copies queue behind the "
            "forward, and each layer's device memory is freed after the forward of the layer its copy is "
            "done by (the plan's params.offload_release)")
    params = {**(found.plan.params if found is not None else {}), **plan.params, "budget_bytes": budget_bytes,
              "offload": True}
    plan = Plan(plan.strategy, plan.n_layers, plan.items, params)
    if found is None:
        return DPResult(plan, 1, 0, False, chain.n_layers + 1, (note,))
    return replace(found, plan=plan, exact=False, notes=(*found.notes, note))
