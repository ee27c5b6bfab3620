"""The baselines: ``none``, ``every-k``, ``sqrtn`` and ``chen``, each a :class:`Plan`.

* ``none``: store everything.
* ``every-k``: checkpoint consecutive segments of k layers (k = 1 is Hugging Face's
  ``gradient_checkpointing_enable``).
* ``sqrtn``: ``torch.utils.checkpoint.checkpoint_sequential`` with ceil(sqrt(n)) segments; its
  last segment is not checkpointed.
* ``chen``: Chen, Xu, Zhang, Guestrin 2016, "Training Deep Nets with Sublinear Memory Cost",
  budgeted greedy: walk the layers adding up output sizes and close a segment when the running
  total passes a threshold B; B is searched on a grid around sqrt(x * y), with x the bytes the
  sqrt(n) plan keeps at its boundaries and y its largest segment. B bounds segment size, not the
  peak, so under a budget we pick the grid point with least recompute that fits (else the
  lowest peak; ``plan_chain`` then reports the budget infeasible).
"""
from __future__ import annotations

import math
from dataclasses import replace
from functools import lru_cache

from ..errors import UsageError
from .chain import Chain
from .plan import Checkpoint, Item, Plan, Store
from .simulate import simulate


def _segment(start: int, stop: int) -> Checkpoint:
    return Checkpoint(start, stop, tuple(Store(i) for i in range(start, stop)))


def cut_at_breaks(plan: Plan, breaks: tuple[int, ...]) -> Plan:
    """``plan`` with every checkpoint (at any depth) that spans a break (``Chain.breaks``: a
    layer that does not receive the previous layer's output) cut there into several; the
    pieces keep their inner items. Unchanged when nothing spans a break."""
    if not breaks:
        return plan

    def lo_hi(it: Item) -> tuple[int, int]:
        return (it.layer, it.layer + 1) if isinstance(it, Store) else (it.start, it.stop)

    def cut(items: tuple[Item, ...]) -> list[Item]:
        out: list[Item] = []
        for it in items:
            if isinstance(it, Store):
                out.append(it)
                continue
            inner = cut(it.inner)
            edges = [it.start, *(b for b in breaks if it.start < b < it.stop), it.stop]
            for a, b in zip(edges, edges[1:]):
                out.append(Checkpoint(a, b, tuple(x for x in inner if a <= lo_hi(x)[0] and lo_hi(x)[1] <= b)))
        return out
    items = tuple(cut(plan.items))
    return plan if items == plan.items else replace(plan, items=items)


@lru_cache(maxsize=32)  # the same (frozen) plan each time: its score is remembered too
def plan_none(n_layers: int) -> Plan:
    return Plan("none", n_layers, tuple(Store(i) for i in range(n_layers)))


def none_peak(chain: Chain) -> int:
    """The simulated peak of one step without checkpointing (every layer stored)."""
    return simulate(chain, plan_none(chain.n_layers)).peak_bytes


def plan_every_k(n_layers: int, k: int = 2) -> Plan:
    if not isinstance(k, int) or k < 1:
        raise UsageError(f"every-k needs k >= 1, got {k!r}", tip="use --k 2 (every two layers)")
    items = tuple(_segment(s, min(s + k, n_layers)) for s in range(0, n_layers, k))
    return Plan("every-k", n_layers, items, {"k": k})


def plan_sqrtn(n_layers: int) -> Plan:
    """checkpoint_sequential(functions, segments=ceil(sqrt(n))): equal segments of
    n // segments layers, every one checkpointed except the last, which runs stored."""
    segments = math.ceil(math.sqrt(n_layers))
    size = n_layers // segments
    items: list[Item] = []
    end = -1
    for start in range(0, size * (segments - 1), size):
        end = start + size - 1
        items.append(_segment(start, end + 1))
    items.extend(Store(i) for i in range(end + 1, n_layers))
    return Plan("sqrtn", n_layers, tuple(items), {"segments": segments, "k": size})


def plan_chen_threshold(chain: Chain, threshold_bytes: int) -> Plan:
    """Chen et al.'s greedy for one threshold: close a segment once its outputs pass it."""
    items: list[Item] = []
    start, total = 0, 0
    for i, ly in enumerate(chain.layers):
        total += ly.x_bytes
        if total > threshold_bytes:
            items.append(_segment(start, i + 1))
            start, total = i + 1, 0
    if start < chain.n_layers:
        items.append(_segment(start, chain.n_layers))
    return cut_at_breaks(Plan("chen", chain.n_layers, tuple(items), {"threshold_bytes": int(threshold_bytes)}),
                         chain.breaks)


def chen_grid(chain: Chain) -> tuple[int, ...]:
    """Thresholds around sqrt(x * y) of the sqrt(n) plan, a factor 2^(1/4) apart."""
    sq = plan_sqrtn(chain.n_layers)
    segs = [it for it in sq.items if isinstance(it, Checkpoint)] or [_segment(0, chain.n_layers)]
    x = sum(chain.layers[c.stop - 1].x_bytes for c in segs)
    y = max(sum(chain.layers[i].x_bytes for i in range(c.start, c.stop)) for c in segs)
    b0 = math.sqrt(max(x, 1) * max(y, 1))
    return tuple(sorted({max(0, int(b0 * 2 ** (k / 4))) for k in range(-8, 9)}))


def plan_chen(chain: Chain, budget_bytes: int | None = None) -> Plan:
    """Without a budget: the paper's B = sqrt(x * y). With one: least recompute that fits,
    else the lowest peak on the grid."""
    grid = chen_grid(chain)
    if budget_bytes is None:
        return plan_chen_threshold(chain, grid[len(grid) // 2])
    scored = [(p, simulate(chain, p)) for p in (plan_chen_threshold(chain, b) for b in grid)]
    fit = [ps for ps in scored if ps[1].peak_bytes <= budget_bytes]
    if fit:
        return min(fit, key=lambda ps: (ps[1].recompute_ms, ps[1].peak_bytes))[0]
    return min(scored, key=lambda ps: (ps[1].peak_bytes, ps[1].recompute_ms))[0]


def baseline_candidates(chain: Chain, k: int = 2) -> list[Plan]:
    """The baselines' plans, for the dp safety net and tests."""
    n = chain.n_layers
    ks = sorted({k, *range(1, min(n, 16) + 1), math.ceil(math.sqrt(n)), n})
    plans = [plan_none(n), plan_sqrtn(n)] + [plan_every_k(n, kk) for kk in ks if kk <= n]
    return [cut_at_breaks(p, chain.breaks) for p in plans] + [plan_chen_threshold(chain, b) for b in chen_grid(chain)]
