"""Profile Hugging Face sweep specs on meta and compare the `none` and `every-k` (k=2) peaks with
the CPU bench's predicted and measured ones (reports/cpu/hf-sweep/bench-NAME-cpu.json).

    python scripts/meta_vs_cpu.py mixtral qwen2_moe megatron-bert
"""
import json
import sys
from pathlib import Path

from ckplan import api
from ckplan.planner import chain_from_profile, plan_chain
from ckplan.planner.simulate import simulate

SWEEP = Path("reports/cpu/hf-sweep")


def cpu_rows(name: str) -> dict:
    p = SWEEP / f"bench-{name}-cpu.json"
    return {r["strategy"]: r for r in json.loads(p.read_text())["rows"]} if p.exists() else {}


def main(names: list[str]) -> None:
    for name in names:
        rows = cpu_rows(name)
        try:
            prof = api.profile(api.load(SWEEP / "specs" / f"{name}.yaml"), device="meta")
        except Exception as e:  # each failure is one line of the report
            print(f"{name}: FAIL {type(e).__name__}: {str(e)[:150]}", flush=True)
            continue
        chain = chain_from_profile(prof)
        out = []
        for strategy in ("none", "every-k"):
            peak = simulate(chain, plan_chain(chain, strategy, None, 2).plan).peak_bytes
            row = rows.get(strategy)
            ref = (row["predicted_peak_bytes"], row["measured_peak_bytes"]) if row else None
            out.append(f"{strategy} meta {peak} cpu pred/meas {ref} diff {peak - ref[0] if ref else None}")
        print(name, " | ".join(out), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
