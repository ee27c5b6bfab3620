"""Plan the Hugging Face sweep specs on fake tensors for a GPU and check every offloading plan.

For each spec in reports/cpu/hf-sweep/specs: a meta profile for ``--target`` (selective options
measured), then ``dp`` at five budgets from the smallest feasible peak to the peak without
checkpointing. Each plan must fit its budget, and replayed with the release points it carries it
must give what the simulator's own choice of release points gives (peak and time, at the plan's
fetch points). One line per
spec: the budgets' results, how many layers each plan offloads and its predicted overhead.

    python scripts/offload_sweep.py [--target h100] [--precision fp32] [NAME ...]
"""
from __future__ import annotations

import argparse
import logging
import time
import warnings
from pathlib import Path

from ckplan import api
from ckplan.errors import CkplanError
from ckplan.planner import chain_from_profile, min_peak, plan_chain, plan_none, simulate
from ckplan.planner.plan import is_offloaded
from ckplan.planner.simulate import simulate_items

SPECS = Path("reports/cpu/hf-sweep/specs")
SHARES = (0.0, 0.25, 0.5, 0.75, 0.95)


def check(path: Path, target: str, precision: str) -> str:
    t0 = time.time()
    spec = api.load(path, precision=precision)
    chain = chain_from_profile(api.profile(spec, device="meta", meta_target=target, options=True))
    n = chain.n_layers
    lo, hi = min_peak(chain), simulate(chain, plan_none(n)).peak_bytes
    cells = []
    for share in SHARES:
        budget = int(lo + share * (hi - lo))
        try:
            res = plan_chain(chain, "dp", budget)
        except CkplanError as e:
            cells.append(f"{share}: {type(e).__name__}")
            continue
        sc, auto = simulate(chain, res.plan), simulate_items(chain, res.plan.items, fetches=res.plan.fetches())
        ok = sc.peak_bytes <= budget and sc.peak_bytes == auto.peak_bytes and abs(sc.step_ms - auto.step_ms) < 1e-6
        cells.append(f"{share}: {'ok' if ok else 'BAD'} offloads {sum(map(is_offloaded, res.plan.options()))}, "
                     f"{sc.overhead:+.1%}")
    return f"{path.stem} ({n} layers, {time.time() - t0:.1f} s): " + " | ".join(cells)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("names", nargs="*")
    ap.add_argument("--target", default="h100")
    ap.add_argument("--precision", default="fp32", choices=("fp32", "bf16", "fp16"))
    a = ap.parse_args()
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    paths = [SPECS / f"{n}.yaml" for n in a.names] if a.names else sorted(SPECS.glob("*.yaml"))
    for path in paths:
        try:
            line = check(path, a.target, a.precision)
        except Exception as e:  # each failure is one line of the report
            line = f"{path.stem}: FAIL {type(e).__name__}: {str(e)[:150]}"
        print(line, flush=True)


if __name__ == "__main__":
    main()
