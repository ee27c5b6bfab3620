"""Meta-predicted step times against GPU benches: how well a device model prices a GPU ckplan never ran on.

For each bench JSON (``reports/cuda``; any bench of a shipped config), the spec is profiled on fake tensors (``--device meta``)
at the bench's batch, precision and optimizer, for ``--target`` (a built-in device model or a
device profile file), and every row the bench measured is scored on that meta profile's chain:
the plan the row ran (its ``plan`` string), or for the peers ``hf`` (every layer in its own
checkpoint) and ``sac-policy`` (``sac-compute`` on every layer). Printed: per row, the predicted
and measured step time and slowdown and their errors; ``--out FILE`` writes the same as markdown.

    python scripts/meta_vs_gpu.py --target h200 --out reports/cuda/meta-vs-h200.md \\
        reports/cuda/bench-gpt2-small-cuda.json reports/cuda/b8/bench-gpt2-small-cuda.json \\
        reports/cuda/bench-bert-large-cuda.json
"""
from __future__ import annotations

import argparse
import importlib
import json
import re
import sys
import time
from datetime import date
from pathlib import Path

from ckplan import api
from ckplan.planner import chain_from_profile, min_peak, plan_chain, simulate
from ckplan.planner.plan import FETCH, RELEASE, Checkpoint, Plan, Store

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = {"gpt2-small": "configs/gpt2-small.yaml", "bert-large": "configs/bert-large.yaml"}
calibration = importlib.import_module("ckplan.planner.calibrate")  # the module, not its function
_TOKEN = re.compile(r"C\[(\d+),(\d+)\)\{|\}|S(\d+)\.\.S(\d+)(?::([\w+-]+))?|S(\d+)(?::([\w+-]+))?")


def parse_plan(text: str, n_layers: int, releases: str = "") -> Plan:
    """The plan a ``Plan.describe()`` string writes (``C[a,b){...}``, ``S7``, ``S7:opt``, ``S3..S9``,
    ``S3..S9:opt``), with a bench row's offload release and fetch points (``"0:3:1 1:5:2"``; none:
    the next layer's)."""
    stack: list[tuple[int, int, list]] = [(0, n_layers, [])]
    for m in _TOKEN.finditer(text):
        if m.group(1) is not None:
            stack.append((int(m.group(1)), int(m.group(2)), []))
        elif m.group(0) == "}":
            start, stop, inner = stack.pop()
            stack[-1][2].append(Checkpoint(start, stop, tuple(inner)))
        elif m.group(3) is not None:
            stack[-1][2].extend(Store(i, m.group(5) or "store") for i in range(int(m.group(3)), int(m.group(4)) + 1))
        else:
            stack[-1][2].append(Store(int(m.group(6)), m.group(7) or "store"))
    points = [list(map(int, p.split(":"))) for p in releases.split()]
    params = {RELEASE: {p[0]: p[1] for p in points}, FETCH: {p[0]: p[2] for p in points if len(p) > 2}}
    return Plan("measured", n_layers, tuple(stack[0][2]), params)


def peer_plan(strategy: str, n: int) -> Plan | None:
    if strategy == "hf":
        return Plan("hf", n, tuple(Checkpoint(i, i + 1, (Store(i),)) for i in range(n)))
    if strategy == "sac-policy":
        return Plan("sac-policy", n, tuple(Store(i, "sac-compute") for i in range(n)))
    return None


def compare(bench_path: Path, target: str) -> tuple[dict, list[dict]]:
    bench = json.loads(bench_path.read_text())
    spec = api.load(ROOT / CONFIGS.get(bench["model"], f"configs/{bench['model']}.yaml"), batch_size=bench["batch_size"],
                    precision=bench["precision"], optimizer=bench["optimizer"])
    t0 = time.time()
    prof = api.profile(spec, device="meta", meta_target=target, options=True)
    # every measured option stays in the chain, dominated or not: the rows ran them
    undominated, calibration.undominated = calibration.undominated, lambda layer, options: tuple(options)
    try:
        chain = chain_from_profile(prof)
    finally:
        calibration.undominated = undominated
    base = chain.base_step_ms
    rows = {r["strategy"]: r for r in bench["rows"]}
    none_ms = rows["none"]["step_ms"]
    out = []
    for r in bench["rows"]:
        if r.get("status") != "ok" or r.get("step_ms") is None:
            continue
        plan = peer_plan(r["strategy"], chain.n_layers) if r.get("kind") == "peer" else \
            parse_plan(r["plan"], chain.n_layers, r.get("offload_release", ""))
        if plan is None:
            continue
        sim = simulate(chain, plan)
        pred_step = sim.step_ms
        out.append(dict(strategy=r["strategy"], plan=plan.describe(runs=True), pred_step_ms=pred_step,
                        pred_peak=sim.peak_bytes, meas_peak=r.get("measured_peak_bytes"),
                        meas_step_ms=r["step_ms"], pred_slowdown=pred_step / base,
                        meas_slowdown=r["step_ms"] / none_ms))
    agree = plan_agreement(prof, bench, chain)
    head = dict(agree=agree,
                bench=str(bench_path.relative_to(ROOT)) if bench_path.is_relative_to(ROOT) else str(bench_path),
                model=bench["model"], batch=bench["batch_size"], optimizer=bench["optimizer"],
                precision=bench["precision"], device=bench.get("device_name"), meta_s=time.time() - t0)
    return head, out


def plan_agreement(prof, bench: dict, scored) -> dict | None:
    """The dp plan meta chooses, against the one the bench chose from the device's own profile.

    The bench plans dp halfway between its profile's smallest feasible peak and its peak without
    checkpointing (when no ``--budget`` was given); meta plans at the same point of its own range
    (its peaks are its own CUDA-rule peaks, not the device's bytes). Both plans are scored on the
    meta chain; the measured step of the meta plan is known only when it equals a measured row.
    """
    rows = {r["strategy"]: r for r in bench["rows"] if r.get("status") == "ok" and r.get("plan")}
    if "dp" not in rows:
        return None
    n_layers = scored.n_layers
    chain = chain_from_profile(prof)  # the planner's own chain: dominated options dropped
    lo, hi = min_peak(chain), simulate(chain, Plan("none", n_layers, tuple(Store(i) for i in range(n_layers)))).peak_bytes
    halfway = any("halfway" in n for n in bench.get("notes", []))
    budget = (lo + hi) // 2 if halfway else bench["budget_bytes"]
    meta_plan = plan_chain(chain, "dp", budget).plan
    gpu_plan = parse_plan(rows["dp"]["plan"], n_layers, rows["dp"].get("offload_release", ""))
    same_as = next((name for name, r in rows.items() if parse_plan(r["plan"], n_layers).describe(runs=True)
                    == meta_plan.describe(runs=True)), None)
    return dict(meta=meta_plan.describe(runs=True), gpu=gpu_plan.describe(runs=True),
                equal=meta_plan.describe(runs=True) == gpu_plan.describe(runs=True), same_as=same_as,
                meta_measured=rows[same_as]["step_ms"] if same_as else None, gpu_measured=rows["dp"]["step_ms"],
                meta_pred=simulate(scored, meta_plan).step_ms / scored.base_step_ms,
                gpu_pred=simulate(scored, gpu_plan).step_ms / scored.base_step_ms)


def markdown(target: str, results: list[tuple[dict, list[dict]]]) -> str:
    lines = [f"# Meta-predicted against measured step times ({target} device model)", "",
             f"`python scripts/meta_vs_gpu.py --target {target} ...` on a 2-core CPU, {date.today()}: each spec "
             "profiled on fake tensors at the bench's batch, precision and optimizer, each measured row's "
             "plan scored on that profile's chain. Step error = (predicted - measured) / measured; "
             "slowdown error in points; peaks are the plan's simulated peak on the meta chain against "
             "`torch.cuda.max_memory_allocated`; the meta profile counts the CUDA runtime's cuBLAS "
             "workspaces as the device model gives them (`runtime_bytes`).", ""]
    for head, rows in results:
        lines += [f"## {head['model']}, batch {head['batch']}, {head['precision']}, {head['optimizer']} "
                  f"(`{head['bench']}`, measured on {head['device']})", "",
                  "| row | predicted step | measured step | error | predicted slowdown | measured | points "
                  "| predicted peak | measured peak | peak error |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            err = (r["pred_step_ms"] - r["meas_step_ms"]) / r["meas_step_ms"]
            pts = (r["pred_slowdown"] - r["meas_slowdown"]) * 100
            lines.append(f"| {r['strategy']} | {r['pred_step_ms']:.1f} ms | {r['meas_step_ms']:.1f} ms | "
                         f"{err:+.1%} | {r['pred_slowdown']:.3f} | {r['meas_slowdown']:.3f} | {pts:+.1f} | "
                         + _peak_cells(r["pred_peak"], r["meas_peak"]))
        a = head.get("agree")
        if a is not None:
            verdict = ("the same plan" if a["equal"] else
                       f"another plan, measured as the `{a['same_as']}` row: {a['meta_measured']:.1f} ms against "
                       f"{a['gpu_measured']:.1f} ms ({a['meta_measured'] / a['gpu_measured'] - 1:+.1%})"
                       if a["same_as"] else "another plan, not among the measured rows")
            lines += ["", f"dp at the bench's budget: meta chooses `{a['meta']}`; the device's profile chose "
                      f"`{a['gpu']}`: {verdict}. Predicted on meta: {a['meta_pred']:.3f} against {a['gpu_pred']:.3f}."]
        lines.append("")
    return "\n".join(lines)


def _peak_cells(pred: int, meas: int | None) -> str:
    if meas is None:
        return f"{pred:,} B | - | - |"
    return f"{pred:,} B | {meas:,} B | {(pred - meas) / meas:+.2%} ({(pred - meas) / 2**20:+.1f} MiB) |"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("benches", nargs="+", type=Path)
    ap.add_argument("--target", default="h200")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    results = [compare(p.resolve(), a.target) for p in a.benches]
    text = markdown(a.target, results)
    print(text)
    if a.out:
        a.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
