"""Time the dp planner on random heterogeneous chains and measure what its shortcuts cost.

    python scripts/bench_planner.py                 # timings at 100 and 1000 layers
    python scripts/bench_planner.py --gap 200       # grouped / rounded DP vs the exact optimum
    python scripts/bench_planner.py --casts         # timings with autocast copies (mixed precision)

Timings: ``plan_chain(chain, "dp", budget)`` end to end (tables, reconstruction, simulation,
the baselines' safety net), at budgets 0%, 10%, 50% and 90% of the way from the smallest
feasible peak to the peak without checkpointing; ``min_peak`` is timed apart (plan_chain needs
it only when the tables find nothing, e.g. at 0%).

Gap: the exact optimum comes from the exact DP on gcd-sized slots, which needs small integer
sizes (memory grows with n^2 x slots); each faster configuration is scored by the simulator.
"missed": budgets where a configuration's tables found no plan (plan_dp then returns the
smallest-peak plan, which is what the gap counts). No timing here is asserted anywhere: these are
figures for the README.
"""
from __future__ import annotations

import argparse
import platform
import time

import numpy as np

from ckplan.planner import min_peak, min_peak_plan, plan_chain, plan_none, simulate
from ckplan.planner.dp import DPSolver
from ckplan.planner.synthetic import random_chain, uniform_chain, with_casts


def timed(fn):
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t


def bench_speed(sizes: list[int], seeds: int, casts: bool = False) -> None:
    print(f"# dp timings{' with autocast copies' if casts else ''} "
          f"({platform.processor() or platform.machine()}, "
          f"{platform.python_version()}, numpy {np.__version__})")
    print("layers seed  min_peak_s  budget  plan_chain_s  fits  exact  overhead  slot_bytes")
    for n in sizes:
        for seed in range(seeds):
            ch = random_chain(n, seed, scale=1_000_003)  # sizes not multiples of a round slot
            if casts:
                ch = with_casts(ch, seed)
            lo, t_lo = timed(lambda: min_peak(ch))
            hi = simulate(ch, plan_none(n)).peak_bytes
            for f in (0.0, 0.1, 0.5, 0.9):
                b = int(lo + f * (hi - lo))
                r, t = timed(lambda: plan_chain(ch, "dp", b))
                print(f"{n:6d} {seed:4d}  {t_lo:10.2f}  {f:6.0%}  {t:12.2f}  {r.fits!s:5} "
                      f"{r.exact!s:5}  {r.score.overhead:8.2%}  {r.slot_bytes:10d}", flush=True)


CONFIGS = {
    "auto (what plan_chain uses)": dict(),
    "nested on 100 groups only": dict(mode="grouped", groups=100, flat=False),
    "depth-1 on layers only": dict(mode="grouped", groups=1),
    "layers, 500 slots, rounded up (rotor)": dict(mode="exact", max_slots=500, rounding="up"),
    "layers, 500 slots, nearest + check": dict(mode="exact", max_slots=500),
}

FAMILIES = {
    # heterogeneous: every size drawn at random per layer
    "heterogeneous": lambda n, seed, size: random_chain(n, seed, max_size=size),
    # homogeneous: identical blocks (a transformer), where nesting matters at tight budgets
    "identical": lambda n, seed, size: uniform_chain(n, x_bytes=2, xbar_bytes=5, grad_bytes=1,
                                                     fwd_ms=1.0 + seed, bwd_ms=2.0),
}


def bench_gap(n: int, seeds: int, max_size: int) -> None:
    print(f"# gap to the exact optimum at {n} layers (12 budgets from the smallest peak to the "
          "peak without checkpointing)")
    print("family         config                                  seed  build_s  "
          "gap@min  mean_gap  max_gap  missed   (mean/max over the 11 budgets above the smallest peak)")
    for family, make in FAMILIES.items():
        for seed in range(seeds if family == "heterogeneous" else 1):
            ch = make(n, seed, max_size)
            ref, t_ref = timed(lambda: DPSolver(ch, mode="exact", max_slots=10**6))
            assert ref.exact
            print(f"{family:14s} {'exact (' + str(ref.M) + ' gcd slots)':40s}{seed:4d}  {t_ref:7.2f}",
                  flush=True)
            lo, hi = min_peak(ch), ref.none_peak
            budgets = [int(lo + f * (hi - lo)) for f in np.linspace(0.0, 0.95, 12)]
            best = [simulate(ch, ref.solve(b)).recompute_ms for b in budgets]
            for name, kw in CONFIGS.items():
                solver, t = timed(lambda: DPSolver(ch, **kw))
                gaps, missed = [], 0
                for b, r0 in zip(budgets, best):
                    plan = solver.solve(b)
                    if plan is None:  # plan_dp falls back to the smallest-peak plan
                        missed += 1
                        plan = min_peak_plan(ch, b)
                    r = simulate(ch, plan).recompute_ms
                    gaps.append(r / r0 - 1 if r0 > 0 else 0.0)
                print(f"{family:14s} {name:40s}{seed:4d}  {t:7.2f}  {gaps[0]:9.2%}  "
                      f"{np.mean(gaps[1:]):8.2%}  {max(gaps[1:]):7.2%}  {missed:6d}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, nargs="*", default=[100, 1000])
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--gap", type=int, nargs="*", default=[], help="chain lengths for the gap study")
    ap.add_argument("--max-size", type=int, default=6, help="largest output size in the gap study")
    ap.add_argument("--casts", action="store_true", help="add autocast copies to the timed chains")
    args = ap.parse_args()
    if args.layers:
        bench_speed(args.layers, args.seeds, args.casts)
    for n in args.gap:
        bench_gap(n, args.seeds, args.max_size)


if __name__ == "__main__":
    main()
