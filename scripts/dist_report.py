"""Per-rank predicted against measured peaks on 2 gloo ranks, every strategy at the per-rank
smallest peak (the budget dp plans for), for reports/cpu/dist.

    python scripts/dist_report.py configs/gpt2-small.yaml configs/gpt-small-dist.yaml --kind fsdp

For each spec: one profile (no selective options), the per-rank chain with FSDP2's padding
(``distributed.rank_chain``), its smallest peak, then ``distributed.bench_distributed`` with
none, every-k (k=2), sqrtn and dp at that budget, and every-k with one checkpoint over the
whole chain (k = n), one memory step per strategy (no gradient check, one timed step). Prints
one line per strategy and rank: predicted and measured peak, and the error against the
prediction (what ``ckplan bench --nproc 2`` shows).
"""
from __future__ import annotations

import argparse
import time

from ckplan import api
from ckplan.distributed import bench_distributed, rank_chain
from ckplan.planner import min_peak


def report(path: str, kind: str, nproc: int) -> list[str]:
    spec = api.load(path)
    prof = api.profile(spec, device="cpu", repeats=1, warmup=0)
    chain = rank_chain(prof, spec, nproc, kind)
    lo = min_peak(chain)
    n = chain.n_layers
    lines = [f"## {path}: {spec.input.batch_size} x {spec.input.shape} tokens per rank, {spec.train.optimizer}; "
             f"{kind} on {nproc} ranks; per-rank smallest peak {lo} bytes (the budget)"]
    t0 = time.monotonic()
    rows = []
    for strategies, k in ((["none", "every-k", "sqrtn", "dp"], 2), (["every-k"], n)):
        res = bench_distributed(spec, nproc=nproc, kind=kind, strategies=strategies, k=k, budget_bytes=lo,
                                steps=1, warmup=1, check_grads=False, profile=prof, timeout_s=3600)
        rows += [(f"{r.strategy}" + (f" k={k}" if r.strategy == "every-k" else ""), r) for r in res.rows]
    for name, r in rows:
        err = "-" if r.peak_error is None else f"{r.peak_error:.3%}"
        fits = "" if r.strategy != "dp" else (" (<= budget)" if r.measured_peak_bytes <= lo else " (OVER budget)")
        lines.append(f"{name:11s} rank {r.rank} {r.status:6s} pred {r.predicted_peak_bytes:>13} "
                     f"meas {r.measured_peak_bytes:>13} err {err}{fits}  {r.plan}")
    lines.append(f"({time.monotonic() - t0:.0f} s on the ranks)")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("specs", nargs="+")
    ap.add_argument("--kind", default="fsdp", choices=["fsdp", "ddp"])
    ap.add_argument("--nproc", type=int, default=2)
    args = ap.parse_args()
    for path in args.specs:
        print("\n".join(report(path, args.kind, args.nproc)), flush=True)


if __name__ == "__main__":
    main()
