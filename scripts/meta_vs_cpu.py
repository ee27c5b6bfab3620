"""Profile Hugging Face sweep specs on meta and compare them with the CPU.

    python scripts/meta_vs_cpu.py mixtral qwen2_moe megatron-bert
    python scripts/meta_vs_cpu.py --precision bf16 mixtral bart swin

fp32 (default): the `none` and `every-k` (k=2) peaks simulated from the meta profile against the
CPU bench's predicted and measured ones (reports/cpu/hf-sweep/bench-NAME-cpu.json). bf16/fp16:
the spec profiled under autocast on the CPU (real tensors, options included) and on meta with the
CPU's autocast rules (`--target cpu`), every layer's bytes compared: saved, output, autocast
copies, forward and backward peaks, and per option its kept bytes, unkept copies and forward peak.
"""
import argparse
import json
import logging
import warnings
from pathlib import Path

from ckplan import api
from ckplan.planner import chain_from_profile, plan_chain
from ckplan.planner.simulate import simulate

SWEEP = Path("reports/cpu/hf-sweep")


def cpu_rows(name: str) -> dict:
    p = SWEEP / f"bench-{name}-cpu.json"
    return {r["strategy"]: r for r in json.loads(p.read_text())["rows"]} if p.exists() else {}


def against_bench(name: str) -> str:
    rows = cpu_rows(name)
    prof = api.profile(api.load(SWEEP / "specs" / f"{name}.yaml"), device="meta")
    chain = chain_from_profile(prof)
    out = []
    for strategy in ("none", "every-k"):
        peak = simulate(chain, plan_chain(chain, strategy, None, 2).plan).peak_bytes
        row = rows.get(strategy)
        ref = (row["predicted_peak_bytes"], row["measured_peak_bytes"]) if row else None
        out.append(f"{strategy} meta {peak} cpu pred/meas {ref} diff {peak - ref[0] if ref else None}")
    return f"{name} " + " | ".join(out)


def _bytes(r, bwd: bool = True) -> tuple:
    return (r.saved_bytes, r.output_bytes, r.cast_bytes, r.fwd_peak_bytes, *((r.bwd_peak_bytes,) if bwd else ()),
            tuple((o.name, o.saved_bytes, o.cast_bytes, o.fwd_peak_bytes) for o in r.options))


def against_cpu_profile(name: str, precision: str) -> str:
    spec = api.load(SWEEP / "specs" / f"{name}.yaml", precision=precision)
    cpu = api.profile(spec, device="cpu", repeats=1, warmup=0, options=True)
    meta = api.profile(spec, device="meta", meta_target="cpu", options=True)
    pairs = list(zip(cpu.layers, meta.layers))
    same = sum(_bytes(a) == _bytes(b) for a, b in pairs)
    fwd_same = sum(_bytes(a, False) == _bytes(b, False) for a, b in pairs)
    worst = max((abs(x - y) for a, b in pairs for x, y in zip(_bytes(a)[:5], _bytes(b)[:5])), default=0)
    peak_cpu, peak_meta = cpu.totals.predicted_peak_bytes, meta.totals.predicted_peak_bytes
    return (f"{name}: stages equal {same}/{len(pairs)} (forward {fwd_same}), largest difference {worst} B; "
            f"predicted peak cpu {peak_cpu} meta {peak_meta} (diff {peak_meta - peak_cpu}); "
            f"measured {cpu.totals.measured_peak_bytes}; copies {sum(r.cast_bytes for r in meta.layers)} B")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("names", nargs="+")
    ap.add_argument("--precision", default="fp32", choices=("fp32", "bf16", "fp16"))
    a = ap.parse_args()
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    for name in a.names:
        try:
            line = against_bench(name) if a.precision == "fp32" else against_cpu_profile(name, a.precision)
        except Exception as e:  # each failure is one line of the report
            line = f"{name}: FAIL {type(e).__name__}: {str(e)[:150]}"
        print(line, flush=True)


if __name__ == "__main__":
    main()
