"""dp against brute force on the Hugging Face sweep's chains (reports/cpu/hf-sweep/specs).

    python scripts/dp_vs_brute.py [NAME ...] > reports/cpu/hf-sweep/dp-vs-brute.txt

Each spec is profiled on fake tensors with the CPU's kernels (`--device meta --target cpu`, no
selective options); on chains of up to 6 layers every nested plan (any nesting) is scored by the
simulator, and at each distinct peak among them `dp`'s plan at that budget is compared with the
least recompute of the plans that fit. One line per spec: budgets checked, how many `dp` does not
reach the optimum at (or cannot plan), the worst relative excess of recompute, and the gap between
`min_peak` and the smallest peak a plan reaches.
"""
import glob
import logging
import math
import os
import sys
import warnings

sys.path.insert(0, "tests")
from brute_plans import all_plans

from ckplan import api
from ckplan.planner import chain_from_profile, min_peak, plan_chain
from ckplan.planner.simulate import peak_of

MAX_LAYERS = 6


def check(path: str) -> str:
    name = os.path.basename(path)[:-5]
    try:
        ch = chain_from_profile(api.profile(api.load(path), device="meta", meta_target="cpu", options=False))
    except Exception as e:
        return f"{name}: not profiled on meta ({type(e).__name__})"
    if ch.n_layers > MAX_LAYERS:
        return f"{name}: {ch.n_layers} layers, not brute-forced"
    scores = [peak_of(ch, items) for items in all_plans(ch.n_layers, True)]
    bad, worst, budgets = 0, 0.0, sorted({p for p, _ in scores})
    for b in budgets:
        best = min(r for p, r in scores if p <= b)
        try:
            got = plan_chain(ch, "dp", b).score.recompute_ms
        except Exception:
            got = math.inf
        if got > best + 1e-9:
            bad += 1
            worst = max(worst, math.inf if got == math.inf else (got - best) / max(best, 1e-12))
    gap = min_peak(ch) - min(p for p, _ in scores)
    return (f"{name}: {ch.n_layers} layers, {len(budgets)} budgets, {bad} not optimal (worst +{worst:.1%}), "
            f"min_peak above the smallest plan peak by {gap} B")


if __name__ == "__main__":
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    names = sys.argv[1:]
    paths = ([f"reports/cpu/hf-sweep/specs/{n}.yaml" for n in names] if names
             else sorted(glob.glob("reports/cpu/hf-sweep/specs/*.yaml")))
    for p in paths:
        print(check(p), flush=True)
