"""Local improvement of a plan under a budget, every step checked by the simulator.

It moves one checkpoint boundary by one layer, drops a checkpoint, splits one in two at its cheapest
inner boundary, or joins two top-level neighbours into one (ending anywhere from the first's end to
the second's, or starting anywhere between their starts), keeps the first move that lowers the
recompute and still fits, and repeats until no move helps or ``max_sims`` simulations are spent.
Never over budget, never worse than the start; not optimal."""
from __future__ import annotations

from ...errors import PlannerArgumentError, SpecError
from ..chain import Chain
from ..plan import items_from_ranges
from ..simulate import peak_of

Ranges = list[tuple[int, int]]


def _moves(ranges: Ranges, n: int, x: list[int], breaks: tuple[int, ...] = ()) -> list[Ranges]:
    out: list[Ranges] = []
    if breaks:  # no range may span a break (Chain.breaks)
        return [m for m in _moves(ranges, n, x) if not any(a < b < c for a, c in m for b in breaks)]
    for i, (a, b) in enumerate(ranges):
        rest = ranges[:i] + ranges[i + 1:]
        out.append(rest)  # drop: its layers are stored in the enclosing sequence
        for na, nb in ((a + 1, b), (a, b - 1), (a - 1, b), (a, b + 1)):
            if 0 <= na < nb <= n and (na, nb) not in rest:
                out.append(rest + [(na, nb)])
        if b - a >= 2:  # split at the smallest boundary inside
            m = min(range(a + 1, b), key=lambda k: x[k - 1])
            if (a, m) not in rest and (m, b) not in rest:
                out.append(rest + [(a, m), (m, b)])
    top = sorted(r for r in ranges if not any(o != r and o[0] <= r[0] and r[1] <= o[1] for o in ranges))
    for (a, b), (c, d) in zip(top, top[1:]):  # two neighbours at the top level as one, ending anywhere between
        rest = [r for r in ranges if not (a <= r[0] and r[1] <= d)]
        out += [rest + [(a, e)] for e in range(b + 1, d + 1)] + [rest + [(s, d)] for s in range(a, c) if s != a]
    return out


def improve(chain: Chain, ranges: Ranges, budget_bytes: int, max_sims: int = 3000) -> Ranges:
    """A plan (its checkpointed ranges) at least as cheap as ``ranges`` that fits the budget
    (``ranges`` itself must fit)."""
    n = chain.n_layers
    x = [ly.x_bytes for ly in chain.layers]
    cur = sorted(ranges)
    peak, cost = peak_of(chain, items_from_ranges(n, cur))
    if peak > budget_bytes:
        raise PlannerArgumentError(f"the start plan peaks at {peak} > budget {budget_bytes}")
    sims = 0
    while sims < max_sims:
        for cand in _moves(cur, n, x, chain.breaks):
            try:
                items = items_from_ranges(n, cand)
            except SpecError:  # overlapping without nesting
                continue
            sims += 1
            p, c = peak_of(chain, items)
            if p <= budget_bytes and c < cost * (1 - 1e-12):
                cur, cost = sorted(cand), c
                break
            if sims >= max_sims:
                break
        else:
            break
    return cur
