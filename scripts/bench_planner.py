"""Time the dp planner on random heterogeneous chains and measure what its shortcuts cost.

    python scripts/bench_planner.py                 # timings at 100 and 1000 layers
    python scripts/bench_planner.py --gap 200       # grouped / rounded DP vs the exact optimum

Timings: ``plan_chain(chain, "dp", budget)`` end to end (table, reconstruction, simulation),
at budgets 10%, 50% and 90% of the way from the smallest feasible peak to the peak without
checkpointing; ``min_peak`` is timed apart (plan_chain only needs it when a budget is too tight).

Gap: the exact optimum comes from the exact DP on gcd-sized slots, which needs small integer
sizes (memory grows with n^2 x slots); each faster configuration is scored by the simulator.
No timing here is asserted anywhere: these are figures for the README.
"""
from __future__ import annotations

import argparse
import platform
import time

import numpy as np

from ckplan.planner import min_peak, plan_chain, plan_none, simulate
from ckplan.planner.dp import DPSolver
from ckplan.planner.synthetic import random_chain


def timed(fn):
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t


def bench_speed(sizes: list[int], seeds: int) -> None:
    print(f"# dp timings ({platform.processor() or platform.machine()}, "
          f"{platform.python_version()}, numpy {np.__version__})")
    print("layers seed  min_peak_s  budget  plan_chain_s  units  slots  slot_bytes  exact  overhead")
    for n in sizes:
        for seed in range(seeds):
            ch = random_chain(n, seed, scale=1_000_003)  # sizes not multiples of a round slot
            lo, t_lo = timed(lambda: min_peak(ch))
            hi = simulate(ch, plan_none(n)).peak_bytes
            for f in (0.1, 0.5, 0.9):
                b = int(lo + f * (hi - lo))
                r, t = timed(lambda: plan_chain(ch, "dp", b))
                assert r.fits
                units = n + 1 if r.exact or "grouped" not in " ".join(r.notes) else None
                print(f"{n:6d} {seed:4d}  {t_lo:10.2f}  {f:5.0%}  {t:12.2f}  "
                      f"{units or '-':>5}  {(hi - ch.persistent_bytes) // r.slot_bytes:5d}  "
                      f"{r.slot_bytes:10d}  {str(r.exact):5}  {r.score.overhead:8.1%}")


CONFIGS = {
    "exact, auto slots": dict(mode="exact"),
    "exact, 500 slots rounded up (rotor)": dict(mode="exact", max_slots=500, rounding="up"),
    "grouped 100 (auto)": dict(mode="grouped", groups=100),
    "grouped 150": dict(mode="grouped", groups=150),
}


def bench_gap(n: int, seeds: int, max_size: int) -> None:
    print(f"# gap to the exact optimum, {n} layers, sizes 1..{max_size} (x) bytes")
    print("config                                   seed  build_s  mean_gap  max_gap")
    for seed in range(seeds):
        ch = random_chain(n, seed, max_size=max_size)
        ref, t_ref = timed(lambda: DPSolver(ch, mode="exact", max_slots=10**6))
        assert ref.exact
        print(f"{'exact optimum (gcd slots: ' + str(ref.M) + ')':40s} {seed:4d}  {t_ref:7.2f}")
        lo, hi = min_peak(ch), ref.none_peak
        budgets = [int(lo + f * (hi - lo)) for f in np.linspace(0.02, 0.95, 12)]
        best = [simulate(ch, ref.solve(b)).recompute_ms for b in budgets]
        for name, kw in CONFIGS.items():
            solver, t = timed(lambda: DPSolver(ch, **kw))
            gaps = []
            for b, r0 in zip(budgets, best):
                plan = solver.solve(b)
                r = simulate(ch, plan).recompute_ms if plan else float("inf")
                gaps.append(r / r0 - 1 if r0 > 0 else (0.0 if r == 0 else float("inf")))
            print(f"{name:40s} {seed:4d}  {t:7.2f}  {np.mean(gaps):8.2%}  {max(gaps):7.2%}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, nargs="*", default=[100, 1000])
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--gap", type=int, nargs="*", default=[], help="chain lengths for the gap study")
    ap.add_argument("--max-size", type=int, default=10, help="largest output size in the gap study")
    args = ap.parse_args()
    if args.layers:
        bench_speed(args.layers, args.seeds)
    for n in args.gap:
        bench_gap(n, args.seeds, args.max_size)


if __name__ == "__main__":
    main()
