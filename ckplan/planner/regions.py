"""Plans of one region per layer: each chain layer stored, stored with one selective option, or
recomputed whole in a checkpoint of its own (``full``), never a checkpoint over several layers.

That is the plan space a whole-model ``torch.compile`` can run (:mod:`ckplan.whole_compile`: each
layer a checkpoint region the partitioner honours), and what Hugging Face-style per-layer
checkpointing and torch's SAC policies choose from, layer by layer.

``plan_regions`` finds the plan with the least recompute time whose simulated peak fits the
budget, exactly. In such a plan every op of layer ``s``'s forward and backward (its recompute
included) peaks at the bytes the earlier layers hold for backward plus a term that depends on
layer ``s``'s own choice only; the loss's ops at all the layers' held bytes plus a constant, and
the embeddings' and the optimizer's at constants. Each choice's held bytes, recompute time and
term are read from the simulator's trace of the plan with that layer changed and every other layer
stored. Then rotor's recursion from the chain's end: a suffix plan needs
``max(term(choice), held(choice) + what the rest needs)`` above what the layers before it hold, at
its summed time, and the Pareto frontier of (need, time) is kept for each suffix. Where a frontier
grows past ``max_points`` (long heterogeneous chains) its needs are merged onto a grid and the
result is no longer guaranteed optimal (``RegionsResult.exact``); the plan returned is checked by
the simulator either way.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .budget import held_for_backward_bytes
from .chain import STORE, Chain
from .plan import Checkpoint, Plan, Store
from .simulate import simulate, trace

FULL = "full"
MAX_POINTS = 20_000


@dataclass(frozen=True)
class Choice:
    option: str  # store, an Option's name, or full
    held_bytes: int  # held for backward, less what the layer holds stored
    recompute_ms: float
    term_bytes: int  # the peak of the layer's own ops, less what the layers before it hold


@dataclass(frozen=True)
class RegionsResult:
    plan: Plan
    peak_bytes: int  # the simulator's
    exact: bool  # no frontier was merged onto a grid


def regions_plan(options: Sequence[str], strategy: str = "regions", *, checkpoints: bool = True) -> Plan:
    """The plan whose layer ``i`` runs as ``options[i]`` (``store``, a selective option or ``full``):
    ``full`` is ``Checkpoint(i, i + 1)``, or with ``checkpoints=False`` the layer's option of that
    name (a whole-model compiled chain's, :mod:`ckplan.planner.whole`)."""
    items = [Checkpoint(i, i + 1, (Store(i),)) if o == FULL and checkpoints else Store(i, o)
             for i, o in enumerate(options)]
    return Plan(strategy, len(items), tuple(items))


def _stage_peaks(chain: Chain, plan: Plan) -> dict:
    peaks: dict = {}
    for ev in trace(chain, plan):
        peaks[ev.stage] = max(peaks.get(ev.stage, 0), ev.peak_bytes)
    return peaks


def layer_choices(chain: Chain, allowed: Sequence[str] | None = None, *,
                  checkpoints: bool = True) -> list[list[Choice]]:
    """Each layer's choices (store, its options, those in ``allowed`` when given, and full: a
    checkpoint, or with ``checkpoints=False`` the option of that name), priced from the simulator's
    trace of the plan with that layer changed and the others stored."""
    n = chain.n_layers
    base = [STORE] * n
    held0 = held_for_backward_bytes(chain, regions_plan(base))
    ms0 = simulate(chain, regions_plan(base)).recompute_ms
    out = []
    for i, ly in enumerate(chain.layers):
        names = [STORE, *(o.name for o in ly.options
                          if (allowed is None or o.name in allowed) and not (checkpoints and o.name == FULL))]
        if checkpoints:
            names.append(FULL)
        row = []
        for name in names:
            opts = list(base)
            opts[i] = name
            plan = regions_plan(opts, checkpoints=checkpoints)
            row.append(Choice(name, held_for_backward_bytes(chain, plan) - held0,
                              simulate(chain, plan).recompute_ms - ms0, _stage_peaks(chain, plan)[i]))
        out.append(row)
    return out


Point = tuple[int, float, tuple[str, ...]]  # (need, time, the suffix's options)


def _pareto(points: list[Point], max_points: int) -> tuple[list[Point], bool]:
    points.sort(key=lambda p: (p[0], p[1]))
    kept: list[Point] = []
    for p in points:  # by need ascending: keep a point only if it is faster than every smaller one
        if not kept or p[1] < kept[-1][1]:
            kept.append(p)
    if len(kept) <= max_points:
        return kept, True
    lo, hi = kept[0][0], kept[-1][0]
    grid = max(1, -(-(hi - lo) // max_points))
    merged: dict[int, Point] = {}
    for p in kept:  # per grid cell, the fastest: the last of the cell (time falls along kept)
        merged[(p[0] - lo) // grid] = p
    return sorted(merged.values(), key=lambda p: (p[0], p[1])), False


def frontier(chain: Chain, allowed: Sequence[str] | None = None, max_points: int = MAX_POINTS, *,
             checkpoints: bool = True) -> tuple[list[tuple[int, float, tuple[str, ...]]], bool]:
    """Every one-region-per-layer plan on the (peak, recompute) frontier: (peak bytes, ms, options)
    by peak ascending, and whether it is exact."""
    n = chain.n_layers
    choices = layer_choices(chain, allowed, checkpoints=checkpoints)
    store = _stage_peaks(chain, regions_plan([STORE] * n))
    fixed = max(v for k, v in store.items() if k is None or k < 0)  # embeddings, optimizer
    points: list[Point] = [(store[n], 0.0, ())]  # the loss: all the layers' held bytes + this
    exact = True
    for i in range(n - 1, -1, -1):
        nxt = [(max(c.term_bytes, c.held_bytes + need), c.recompute_ms + t, (c.option, *opts))
               for need, t, opts in points for c in choices[i]]
        points, ok = _pareto(nxt, max_points)
        exact = exact and ok
    return [(max(fixed, need), t, opts) for need, t, opts in points], exact


def scored_frontier(chain: Chain, allowed: Sequence[str] | None = None, max_points: int = MAX_POINTS, *,
                    checkpoints: bool = True) -> tuple[list[tuple[int, float, tuple[str, ...]]], bool]:
    """The frontier's plans and the plans with one choice on every layer, each with the
    simulator's own peak: (peak, ms, options), and whether every frontier peak was the
    simulator's (``exact``). Where the per-layer terms do not hold (side inputs that checkpoints
    keep, autocast copies), the simulator's peaks decide and optimality is no longer proven."""
    points, exact = frontier(chain, allowed, max_points, checkpoints=checkpoints)
    names = {c.option for row in layer_choices(chain, allowed, checkpoints=checkpoints) for c in row}
    uniform = [tuple([o] * chain.n_layers) for o in sorted(names)
               if all(o == STORE or (o == FULL and checkpoints) or any(x.name == o for x in ly.options)
                      for ly in chain.layers)]
    out = []
    for peak, t, opts in points:
        true = simulate(chain, regions_plan(opts, checkpoints=checkpoints)).peak_bytes
        exact = exact and true == peak
        out.append((true, t, opts))
    seen = {opts for _, _, opts in out}
    for opts in uniform:
        if opts not in seen:
            sc = simulate(chain, regions_plan(opts, checkpoints=checkpoints))
            out.append((sc.peak_bytes, sc.recompute_ms, opts))
    return sorted(out, key=lambda p: (p[0], p[1])), exact


def plan_regions(chain: Chain, budget_bytes: int, *, allowed: Sequence[str] | None = None,
                 max_points: int = MAX_POINTS, strategy: str = "dp-regions",
                 checkpoints: bool = True) -> RegionsResult | None:
    """The one-region-per-layer plan with the least recompute whose simulated peak fits
    ``budget_bytes``; None when none fits (see :func:`scored_frontier` for ``exact``)."""
    points, exact = scored_frontier(chain, allowed, max_points, checkpoints=checkpoints)
    best = None
    for peak, t, opts in points:
        if peak <= budget_bytes and (best is None or t < best[1]):
            best = (peak, t, opts)
    if best is None:
        return None
    return RegionsResult(regions_plan(best[2], strategy, checkpoints=checkpoints), best[0], exact)
