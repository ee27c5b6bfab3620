"""Time the dp planner and measure its gap to the exact optimum, with and without its faster paths.

    python scripts/bench_planner.py --speed 10 30 100 300 1000      # seconds per plan
    python scripts/bench_planner.py --gap 8 30 100 --seeds 3         # gap to the exact optimum
    python scripts/bench_planner.py --gap 200 --seeds 1 --fracs 0 0.001 0.01
    python scripts/bench_planner.py --breakpoints 8 30 --seeds 4     # at every budget breakpoint
    python scripts/bench_planner.py --speed 100 --casts              # mixed precision
    python scripts/bench_planner.py --speed 24 100 --options 2        # selective options
    python scripts/bench_planner.py --gap 24 100 --options 2         # their exactness gap
    python scripts/bench_planner.py --speed 100 --numpy              # without numba (fallback)
    python scripts/bench_planner.py --gap 100 200 --family mlp       # other chain families
    python scripts/bench_planner.py --band-gap 1000 --options 2      # long chains: trimmed tails
    python scripts/bench_planner.py --gap 65 128 200 --options 2 --family longrun --one-byte \
        --no-before --fracs 0 0.0001 0.001 0.01 0.1 0.5 0.9          # best checkpoint > the band

Chains: ``random_chain(n, seed, max_size=1_000_003)``, heterogeneous layers whose sizes (up to a
million bytes, gcd 1) do not divide into slots; ``--scaled`` uses ``scale=1_000_003`` instead
(every size a multiple of 1000003 bytes). ``--family mlp|xbar4|transformer``: the same times,
every output 1000003 bytes and each layer keeping about 1x, 4x or 16x that (+-5%): layers that
keep little besides their output (where long checkpoints pay) up to transformer-like blocks.
``--family longrun`` (``synthetic.long_run_chain``): near the smallest peak the optimum wraps a
run of cheap layers in one top-level checkpoint longer than the band, with short ones inside.
Budgets: a fraction of the way from the smallest feasible peak (0) to the peak without
checkpointing (1); ``--one-byte`` adds the smallest peak plus one byte.

* ``after``: ``plan_chain(chain, "dp", budget)``, what the CLI runs (exact byte-level DP up to
  64 layers; the banded DP, ``solve.banded_plan``, from 65 to 400, with long nested top-level
  checkpoints where its plans end one (``nest``), its tails' frontiers thinned above 200 (within
  4.6% of the band's optimum); above 400 the same without nesting with selective options, else
  grouped tables, with the banded DP, else ``near_min_plan``, just above the smallest peak).
* ``before``: the previous solver, kept as ``DPSolver(chain, pareto=False)`` (slot tables over
  the whole range, budget-independent), falling back to the smallest-peak plan where its tables
  find nothing, as ``plan_dp`` did.
* reference: the exact DP in bytes (``tables.ParetoTable``) bounded to the budget and to the
  cheaper of the two plans' recompute, which is exact by construction (tests check it against
  brute force and against the gcd-slot DP); slow on long chains (minutes at 200 layers).

``--options K``: every layer gets K selective options (``synthetic.with_options``). ``--speed``
then also times the same chain without options at the same fraction of its own range
(``plain_s``; ``ratio`` = after_s / plain_s) and reports both overheads; ``--gap``'s reference is the exact DP with options (``before`` ignores
them: slot tables), and ``plain_gap`` is the exact plan without options against it (what the
options gain).

The tables are compiled with numba when it is installed (``pip install ckplan[fast]``);
``--numpy`` times the numpy path instead. Before timing, two small plans (exact and grouped) load
numba and its compiled kernels (about 1-2 s once per process, not counted; the header says which
path). Timed plans clear the layer tables (``layer_tables``) but not what is cached per chain
across budgets: ``min_peak`` and the dp safety net's baseline scores (those it needs), so the
first budget of a 1000-layer chain may pay up to ~0.3 s more than the others.

``--band-gap``: chains too long for the exact reference; the reference is the banded DP without
the thinning (``banded_plan(..., trim=0)``), the optimum among the band's plans.

Gap = recompute / reference - 1 (0 is optimal). No figure here is asserted anywhere.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import math
import os
import platform
import re
import statistics
import time
from dataclasses import replace

import numpy as np

from ckplan.planner import limits, min_peak, min_peak_plan, plan_chain, plan_none, simulate, tables
from ckplan.planner.solve import DPSolver, banded_plan, layer_tables
from ckplan.planner.synthetic import long_run_chain, random_chain, with_casts, with_options
from ckplan.planner.tables import ParetoTable, base_bytes

WIDE = 1_000_003


FAMILIES = {"random": 0, "mlp": 1, "xbar4": 4, "transformer": 16, "blocks": -1, "longrun": -2}


def make_chain(n: int, seed: int, scaled: bool, options: int = 0, family: str = "random"):
    """``random``: ``random_chain``. The others keep its times and transients but give every
    layer the same output (``WIDE`` bytes) and a saved size of about 1x (``mlp``: layers that
    keep little besides their output), 4x (``xbar4``) or 16x (``transformer``) that, +-5%.
    ``blocks``: every p-th layer (p of 2-5, drawn per seed) keeps 2x-40x an output more and takes
    1x-20x longer (attention among cheap layers), most outputs equal, a few 0.2x-3x.
    ``longrun``: ``synthetic.long_run_chain``, a run of 20-79 cheap layers passing on little of
    what they keep, before a layer with a large backward: near the smallest peak its best plan
    has a top-level checkpoint longer than the band (``limits.BAND_START``) with checkpoints inside."""
    if family == "blocks":
        return _blocks_chain(n, seed, options)
    if family == "longrun":
        return long_run_chain(n, seed, options=options, size=WIDE)
    if family == "random":
        if scaled:
            return random_chain(n, seed, scale=WIDE, options=options)
        return random_chain(n, seed, max_size=WIDE, options=options)
    rng = np.random.default_rng(seed)
    base = random_chain(n, seed, max_size=WIDE)
    ratio = FAMILIES[family]
    layers = tuple(replace(ly, x_bytes=WIDE,
                           xbar_bytes=WIDE + int(WIDE * max(0.0, ratio * rng.uniform(0.95, 1.05) - 1)) + 7)
                   for ly in base.layers)
    ch = replace(base, layers=layers)
    return with_options(ch, seed, options=options) if options else ch


def timed(fn):
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t


def before(chain, budget):
    """The previous plan_dp: slot tables over the whole range, smallest-peak plan where they miss."""
    solver = DPSolver(chain, pareto=False)
    return solver.solve(budget) or min_peak_plan(chain, budget)


def _blocks_chain(n: int, seed: int, options: int):
    rng = np.random.default_rng(100 + seed)
    p = int(rng.integers(2, 6))
    r, tr = float(rng.choice([2, 4, 16, 40])), float(rng.choice([1, 5, 20]))
    base = random_chain(n, seed, max_size=WIDE)
    layers = []
    for i, ly in enumerate(base.layers):
        big = i % p == 0
        x = WIDE if rng.random() < 0.8 else int(WIDE * rng.uniform(0.2, 3))
        xbar = x + (int(WIDE * r * rng.uniform(0.8, 1.2)) if big else int(WIDE * rng.uniform(0, 0.3)))
        f = (tr if big else 1.0) * rng.uniform(0.5, 1.5)
        layers.append(replace(ly, x_bytes=x, xbar_bytes=xbar, fwd_ms=f, bwd_ms=2 * f))
    ch = replace(base, layers=tuple(layers))
    return with_options(ch, seed, options=options) if options else ch


def warm_up() -> str:
    """Load numba and the compiled kernels once (not timed); which path the tables take."""
    w = random_chain(tables.NUMBA_MIN_UNITS, 0, max_size=1000, options=1)
    plan_chain(w, "dp", min_peak(w))
    # the grouped tables' kernels too (slot table, depth-1 minimum), as on long chains
    mid = (min_peak(w) + simulate(w, plan_none(w.n_layers)).peak_bytes) // 2
    plan_chain(w, "dp", mid, mode="grouped", groups=10)
    if tables.jitted("_pareto_kernel", tables.NUMBA_MIN_UNITS) is None:
        return "numpy tables"
    return f"numba {importlib.metadata.version('numba')} tables"


def header(what: str) -> None:
    path = warm_up()
    print(f"# {what} ({platform.processor() or platform.machine()}, {os.cpu_count()} cpus, "
          f"python {platform.python_version()}, numpy {np.__version__}, {path})")


def bench_speed(sizes: list[int], seeds: int, fracs: list[float], scaled: bool, casts: bool,
                compare: bool, options: int = 0, family: str = "random") -> None:
    header("seconds per dp plan" + (" with autocast copies" if casts else "")
           + (f" with {options} selective options per layer" if options else ""))
    print("layers seed  budget  after_s  exact  overhead" + ("  before_s  overhead" if compare else "")
          + ("   plain_s  overhead  ratio" if options else ""))
    ratios: list[float] = []
    for n in sizes:
        for seed in range(seeds):
            ch = make_chain(n, seed, scaled, options, family)
            if casts:
                ch = with_casts(ch, seed)
            lo = min_peak(ch)  # cached per chain: timed plans below include the tables
            hi = simulate(ch, plan_none(n)).peak_bytes
            for f in fracs:
                b = int(lo + f * (hi - lo))
                layer_tables.cache_clear()
                r, t = timed(lambda: plan_chain(ch, "dp", b))
                line = (f"{n:6d} {seed:4d}  {f:6.1%}  {t:7.2f}  {r.exact!s:5}  "
                        f"{r.score.overhead:8.2%}")
                if compare:
                    layer_tables.cache_clear()
                    p, t0 = timed(lambda: before(ch, b))
                    line += f"  {t0:8.2f}  {simulate(ch, p).overhead:8.2%}"
                if options:  # the same chain without options, at the same fraction of its range
                    plain = ch.without_options()
                    bp = int(min_peak(plain) + f * (hi - min_peak(plain)))
                    layer_tables.cache_clear()
                    rp, tp = timed(lambda: plan_chain(plain, "dp", bp))
                    ratios.append(t / tp)
                    line += f"  {tp:8.2f}  {rp.score.overhead:8.2%}  {t / tp:5.2f}"
                print(line, flush=True)
    if ratios:
        print(f"# time with options / without: median {statistics.median(ratios):.2f}, "
              f"max {max(ratios):.2f} over {len(ratios)} plans")


def bench_gap(n: int, seeds: int, fracs: list[float], scaled: bool, options: int = 0,
              family: str = "random", one_byte: bool = False, compare: bool = True) -> None:
    """``one_byte``: also the budget one byte above the smallest peak (``+1B``); ``compare``
    False leaves out the previous solver (its slot tables take seconds per budget past 150
    layers). ``longest``: the most layers a checkpoint of the exact optimum spans."""
    header(f"gap to the exact optimum at {n} layers, {seeds} {family} chains"
           + (f", {options} selective options per layer" if options else ""))
    print("layers seed   budget  before_gap  after_gap  before_s  after_s  ref_s  longest"
          + ("  plain_gap" if options else ""))
    labels = ([f"{fracs[0]:7.2%}"] if fracs else []) + (["    +1B"] if one_byte else []) + [
        f"{f:7.2%}" for f in fracs[1:]]
    rows: dict[str, list[tuple[float, float]]] = {k: [] for k in labels}
    for seed in range(seeds):
        ch = make_chain(n, seed, scaled, options, family)
        lo = min_peak(ch)
        hi = simulate(ch, plan_none(n)).peak_bytes
        t = layer_tables(ch)
        points = [int(lo + fracs[0] * (hi - lo))] if fracs else []
        points += ([lo + 1] if one_byte else []) + [int(lo + f * (hi - lo)) for f in fracs[1:]]
        for label, b in zip(labels, points):
            if compare:
                old, t_old = timed(lambda: before(ch, b))
                so = simulate(ch, old)
            new, t_new = timed(lambda: plan_chain(ch, "dp", b))
            sn = new.score
            assert sn.peak_bytes <= b and new.fits and (not compare or so.peak_bytes <= b)
            avail = b - base_bytes(ch)
            bound = min(so.recompute_ms, sn.recompute_ms) if compare else sn.recompute_ms
            ref, t_ref = timed(lambda: ParetoTable(t.units, t.pairs, t.peaks.R, avail, None, bound))
            r0 = ref.cost(avail)
            longest = max((e - s for s, e in ref.ranges(avail)), default=0)
            gap = (lambda r: _rel(r, r0))
            g_old = gap(so.recompute_ms) if compare else float("nan")
            g_new = gap(sn.recompute_ms)
            rows[label].append((g_old, g_new))
            line = (f"{n:6d} {seed:4d}  {label}  {_pct(g_old, 10)}  {g_new:9.2%}  "
                    f"{f'{t_old:8.2f}' if compare else '       -'}  {t_new:7.2f}  {t_ref:5.1f}  "
                    f"{longest:7d}")
            if options:
                plain = ch.without_options()
                if b >= min_peak(plain):
                    line += f"  {gap(plan_chain(plain, 'dp', b).score.recompute_ms):9.2%}"
                else:
                    line += "  infeasible"
            print(line, flush=True)
    print(f"# summary at {n} layers: gap per budget, max / median over {seeds} chains")
    print(" budget   before_max  before_med   after_max  after_med")
    for label, gs in rows.items():
        o, a = [g[0] for g in gs], [g[1] for g in gs]
        print(f"{label}  {_pct(max(o), 10)}  {_pct(statistics.median(o), 10)}  {max(a):10.2%}  "
              f"{statistics.median(a):9.2%}", flush=True)


def _rel(r: float, r0: float) -> float:
    """``r / r0 - 1`` (0 within float noise: a plan found by another path may sum its times in
    another order)."""
    if r0 <= 0:
        return 0.0 if r == 0 else float("inf")
    g = r / r0 - 1
    return 0.0 if abs(g) < 1e-12 else g


def _pct(g: float, width: int) -> str:
    return f"{'-':>{width}}" if math.isnan(g) else f"{g:{width}.2%}"


def bench_band_gap(n: int, seeds: int, fracs: list[float], options: int = 0,
                   family: str = "random") -> None:
    """Chains too long for the exact reference: the gap of ``plan_chain``'s plan to the banded DP
    without trimming (``banded_plan(..., trim=0)``, bounded by that plan: the optimum among the
    band's plans, long top-level checkpoints of any length included, which the thinned tails of
    long chains approximate); ``stated``: the bound the plan's note states."""
    header(f"gap to the untrimmed banded DP at {n} layers, {seeds} {family} chains"
           + (f", {options} selective options per layer" if options else ""))
    print("layers seed  budget  after_s  after_gap  stated  ref_s  band")
    for seed in range(seeds):
        ch = make_chain(n, seed, False, options, family)
        lo = min_peak(ch)
        hi = simulate(ch, plan_none(n)).peak_bytes
        for f in fracs:
            b = int(lo + f * (hi - lo))
            layer_tables.cache_clear()
            new, t_new = timed(lambda: plan_chain(ch, "dp", b))
            assert new.fits and new.score.peak_bytes <= b
            limit, limits.BAND_MAX_TOTAL = limits.BAND_MAX_TOTAL, 10**9  # the reference: no work limit
            try:
                ref, t_ref = timed(lambda: banded_plan(ch, b, bound=new.plan, trim=0.0))
            finally:
                limits.BAND_MAX_TOTAL = limit
            stated = next((m.group(1) + "%" for x in new.notes
                           for m in [re.search(r"within (\d+\.\d)%", x)] if m), "-")
            if ref is None:
                print(f"{n:6d} {seed:4d}  {f:6.1%}  {t_new:7.2f}  {'no ref':>9}  {stated:>6}  "
                      f"{t_ref:5.1f}  -")
                continue
            r0 = simulate(ch, ref.plan).recompute_ms
            g = new.score.recompute_ms / r0 - 1 if r0 > 0 else 0.0
            print(f"{n:6d} {seed:4d}  {f:6.1%}  {t_new:7.2f}  {g:9.3%}  {stated:>6}  {t_ref:5.1f}  "
                  f"{ref.band}", flush=True)


def bench_breakpoints(n: int, seeds: int, scaled: bool, family: str = "random") -> None:
    """The gap at *every* budget where the optimum changes (the exact frontier's breakpoints):
    where rounded slots hurt most, and what fixed fractions of the range mostly miss."""
    header(f"gap at every breakpoint of the exact frontier, {n} layers, {seeds} chains")
    print("layers seed  budgets  before_max  before_med  before>1%   after_max  after_med  after>1%")
    for seed in range(seeds):
        ch = make_chain(n, seed, scaled, family=family)
        t = layer_tables(ch)
        base, lo = base_bytes(ch), min_peak(ch)
        hi = simulate(ch, plan_none(n)).peak_bytes
        ub = simulate(ch, min_peak_plan(ch)).recompute_ms
        ref = ParetoTable(t.units, t.pairs, t.peaks.R, hi - base, None, ub)
        solver_old, solver_new = DPSolver(ch, pareto=False), DPSolver(ch)
        g_old, g_new = [], []
        for m in ref.frontier()[0]:
            b = int(base + m)
            if b < lo or b >= hi:
                continue
            r0 = ref.cost(int(m))
            old = solver_old.solve(b) or min_peak_plan(ch, b)
            new = solver_new.solve(b)
            for plan, out in ((old, g_old), (new, g_new)):
                sc = simulate(ch, plan)
                assert sc.peak_bytes <= b
                out.append(sc.recompute_ms / r0 - 1 if r0 > 0 else 0.0)
        print(f"{n:6d} {seed:4d}  {len(g_old):7d}  {max(g_old):10.2%}  {statistics.median(g_old):10.2%}"
              f"  {sum(g > 0.01 for g in g_old):9d}  {max(g_new):10.2%}  "
              f"{statistics.median(g_new):9.2%}  {sum(g > 0.01 for g in g_new):8d}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--speed", type=int, nargs="*", default=[], help="chain lengths to time")
    ap.add_argument("--gap", type=int, nargs="*", default=[], help="chain lengths for the gap study")
    ap.add_argument("--breakpoints", type=int, nargs="*", default=[],
                    help="chain lengths for the gap at every breakpoint of the exact frontier")
    ap.add_argument("--band-gap", type=int, nargs="*", default=[],
                    help="chain lengths for the gap to the untrimmed banded DP (long chains)")
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--fracs", type=float, nargs="*", default=None,
                    help="budget fractions (default: 0 0.1 0.5 0.9 for --speed, "
                         "0 0.001 0.01 0.03 0.1 0.3 0.6 0.9 for --gap)")
    ap.add_argument("--scaled", action="store_true", help="sizes multiples of 1000003 bytes")
    ap.add_argument("--casts", action="store_true", help="add autocast copies to the timed chains")
    ap.add_argument("--before", action="store_true", help="--speed: also time the previous solver")
    ap.add_argument("--options", type=int, default=0,
                    help="selective options per layer (--speed: also time without them; --gap: "
                         "gap of the plan without them)")
    ap.add_argument("--numpy", action="store_true", help="numpy tables even if numba is installed")
    ap.add_argument("--one-byte", action="store_true",
                    help="--gap: also one byte above the smallest peak (after the first fraction)")
    ap.add_argument("--no-before", action="store_true",
                    help="--gap: leave out the previous solver (slow past 150 layers)")
    ap.add_argument("--family", choices=sorted(FAMILIES), default="random",
                    help="chains: random (default), same-size outputs keeping ~1x (mlp), 4x "
                         "(xbar4) or 16x (transformer) of them, big slow layers every few (blocks), "
                         "or a long run of cheap layers before a large backward (longrun)")
    args = ap.parse_args()
    if args.numpy:
        limits.USE_NUMBA = False
    if not args.speed and not args.gap and not args.breakpoints and not args.band_gap:
        args.speed = [10, 30, 100, 300, 1000]
    if args.speed:
        bench_speed(args.speed, args.seeds, args.fracs or [0.0, 0.1, 0.5, 0.9], args.scaled,
                    args.casts, args.before, args.options, args.family)
    for n in args.breakpoints:
        bench_breakpoints(n, args.seeds, args.scaled, args.family)
    for n in args.band_gap:
        bench_band_gap(n, args.seeds, args.fracs or [0.0, 0.001, 0.01, 0.1, 0.5, 0.9],
                       args.options, args.family)
    for n in args.gap:
        bench_gap(n, args.seeds, args.fracs or [0.0, 0.001, 0.01, 0.03, 0.1, 0.3, 0.6, 0.9],
                  args.scaled, args.options, args.family, args.one_byte, not args.no_before)


if __name__ == "__main__":
    main()
