"""The correctness tier: what must hold on every torch that pyproject.toml admits.

Runs in the current environment (the torch installed there) and writes one JSON document:

    python scripts/torch_tier.py --out reports/torch-matrix/2.14.1.json
    python scripts/torch_tier.py --table reports/torch-matrix/*.json > reports/torch-matrix/README.md

Each check is a set of the project's own oracle tests (pytest node ids) or a CLI run whose JSON
output is checked here; the tier passes when every check passes. ``scripts/torch_matrix.sh`` runs
it once per torch version, each in its own virtual environment. Exit status: 0 when every check
passed, 1 otherwise.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# name -> (what it shows, pytest node ids)
TESTS: dict[str, tuple[str, list[str]]] = {
    "gradients": ("executor gradients equal to no checkpointing: multi-layer segments (this torch's "
                  "checkpoint frames), per-layer keyword models, selective options (offloaded too, "
                  "from torch 2.14)", [
                      "tests/test_execute.py::test_gradients_equal_with_dropout",
                      "tests/test_execute_models.py::test_target_model_with_per_layer_keywords",
                      "tests/test_execute_models.py::test_multi_layer_segment_keeps_only_input_and_output",
                      "tests/test_execute_models.py::test_hf_alternating_attention_every_plan_same_gradients",
                      "tests/test_execute_options.py::test_zoo_gpt_options_same_gradients",
                      "tests/test_execute_options.py::test_hf_qwen2_options_same_gradients",
                      "tests/test_execute.py::test_an_option_with_what_it_keeps_offloaded_runs_as_planned",
                      "tests/test_torch_compat.py"]),
    "peaks": ("predicted peak equal to the measured one (a small GPT, every strategy)", [
        "tests/test_bench.py::test_measured_peak_matches_prediction[gpt]"]),
    "flops": ("FLOPs counted, grouped-query attention included (a Hugging Face Llama with GQA), and a "
              "Mixtral's experts however this torch runs them, on cpu and meta", [
        "tests/test_flops.py"]),
    "meta": ("profile on meta equal to the CPU profile (attention kernels, GQA), the same with and "
             "without the meta kernel cache; Mixtral-8x7B on meta (its experts run as on the CPU)", [
        "tests/test_profile.py::test_meta_follows_the_cpu_attention_kernel",
        "tests/test_meta_kernels.py",
        "tests/test_configs.py::test_mixtral_8x7b_plans_on_meta"]),
    "meta-autocast": ("bf16 autocast on meta: each device's casts asked of this torch's own autocast "
                      "kernels, and a bf16 meta profile equal to the CPU's measured one", [
        "tests/test_meta_autocast.py::test_casts_are_the_devices_documented_policy",
        "tests/test_meta_autocast.py::test_sum_gets_an_fp32_result_on_cuda_only",
        "tests/test_meta_autocast.py::test_cross_entropy_as_each_device_runs_it",
        "tests/test_meta_autocast.py::test_meta_under_bf16_equals_the_cpu_measurement",
        "tests/test_sdpa.py"]),
    "fsdp2": ("FSDP2 (from torch 2.9 on CPU ranks) and DDP per-rank peaks on 2 gloo ranks, multi-layer "
              "checkpoints, bf16 autocast, FSDP2's MixedPrecisionPolicy and dropout included; a plan "
              "exported under fully_shard; ranks end when gloo's teardown hangs", [
        "tests/test_distributed.py::test_fsdp_per_rank_model_matches_measured_peak",
        "tests/test_distributed.py::test_fsdp_gradients_equal_one_process",
        "tests/test_distributed.py::test_fsdp_multi_layer_checkpoints_per_rank",
        "tests/test_distributed.py::test_ddp_per_rank_model_and_gradients",
        "tests/test_distributed.py::test_bf16_autocast_per_rank",
        "tests/test_distributed.py::test_fsdp_mixed_precision_policy_per_rank",
        "tests/test_distributed.py::test_dropout_rows_are_judged_against_the_ranks_own_run",
        "tests/test_distributed.py::test_a_process_group_that_will_not_go_does_not_hold_the_results",
        "tests/test_export.py::test_fsdp_snippet_under_fully_shard"]),
    "mixed-precision": ("every plan's peak under bf16 autocast equal to the tracker's: this torch's autocast "
                        "cache (parameters' copies, not views'), unsaved copies, the sums of shared "
                        "gradients with and without accumulation", [
        "tests/test_mixed_precision.py::test_every_plan_under_bf16_predicted_to_the_byte",
        "tests/test_mixed_precision.py::test_the_profile_counts_only_the_copies_autocast_caches",
        "tests/test_mixed_precision.py::test_sums_of_gradient_shares_are_profiled_where_autograd_holds_them",
        "tests/test_mixed_precision.py::test_a_tied_embedding_under_accumulation_never_peaks_above_the_prediction"]),
    "side-inputs": ("every plan's peak equal to the live-tensor tracker's on chains whose layers share "
                    "side inputs: made before the chain or by a layer, saved by some layers only, "
                    "their gradients arriving in parts (this torch's autograd graph walked)", [
        "tests/test_side_inputs.py",
        "tests/test_side_inputs_saved.py",
        "tests/test_side_grads.py"]),
    "kept": ("every plan's peak as measured where layers keep tensors outside saved tensors or "
             "outputs only their own ops save", [
        "tests/test_unkept.py",
        "tests/test_own_kept.py",
        "tests/test_unsaved_kept.py"]),
    "compiled": ("plans around torch.compile'd chain layers keep eager's gradients", [
        "tests/test_compiled.py::test_plans_around_compiled_layers_keep_eager_gradients"]),
}

GQA = "configs/hf-llama-gqa.yaml"
CLI: dict[str, tuple[str, list[str]]] = {
    "cli-profile-meta": ("`ckplan profile` on meta (a GQA Llama)",
                         ["profile", GQA, "--device", "meta", "--format", "json"]),
    "cli-plan": ("`ckplan plan` on meta, every strategy (a GQA Llama, half-way budget)",
                 ["plan", GQA, "--device", "meta", "--strategy", "all", "--budget", "50%act",
                  "--format", "json"]),
    "cli-bench-gqa": ("`ckplan bench` on a GQA Llama: every row ok, peaks predicted within 0.1%",
                      ["bench", GQA, "--device", "cpu", "--steps", "1", "--warmup", "1", "--no-options",
                       "--compare", "none,every-k,dp", "--format", "json"]),
}


def _run_pytest(ids: list[str]) -> dict:
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        xml = Path(tmp) / "junit.xml"
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not gpu",
                               f"--junitxml={xml}", *ids], cwd=ROOT, capture_output=True, text=True)
        text = xml.read_text() if xml.exists() else ""
    counts = {k: int(v) for k, v in re.findall(r'(tests|failures|errors|skipped)="(\d+)"', text)[:4]}
    failed = counts.get("failures", 0) + counts.get("errors", 0)
    ran = counts.get("tests", 0) - counts.get("skipped", 0)
    status = "pass" if proc.returncode == 0 and ran > 0 and failed == 0 else "fail"
    tail = "" if status == "pass" else "\n".join(proc.stdout.strip().splitlines()[-15:])
    return {"status": status, "passed": ran - failed, "failed": failed, "skipped": counts.get("skipped", 0),
            "seconds": round(time.time() - t0, 1), "detail": tail}


def _bench_problems(doc: dict) -> list[str]:
    rows = doc.get("rows", [])
    out = [] if rows else ["no rows"]
    for r in rows:
        if r.get("status") != "ok":
            out.append(f"{r.get('strategy')}: {r.get('status')}")
        pred, meas = r.get("predicted_peak_bytes"), r.get("measured_peak_bytes")
        if pred and meas and abs(meas - pred) > 0.001 * pred:
            out.append(f"{r.get('strategy')}: predicted {pred} B, measured {meas} B")
    return out


def _run_cli(args: list[str]) -> dict:
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        extra = ["--out-dir", tmp] if args[0] in ("bench", "profile") else []  # nothing left in reports/
        proc = subprocess.run([sys.executable, "-m", "ckplan", *args, *extra], cwd=ROOT,
                              capture_output=True, text=True)
    problems = [] if proc.returncode == 0 else [f"exit {proc.returncode}: {proc.stderr.strip()[-400:]}"]
    if proc.returncode == 0:
        try:
            doc = json.loads(proc.stdout)
        except json.JSONDecodeError as e:
            doc, problems = {}, [f"stdout is not one JSON document: {e}"]
        if args[0] == "bench":
            problems += _bench_problems(doc)
    return {"status": "fail" if problems else "pass", "seconds": round(time.time() - t0, 1),
            "detail": "; ".join(problems)}


def run_tier(only: list[str] | None) -> dict:
    import torch
    checks = {}
    for name, (what, ids) in TESTS.items():
        if only and name not in only:
            continue
        print(f"[{name}] {what}", file=sys.stderr, flush=True)
        checks[name] = {"what": what, **_run_pytest(ids)}
    for name, (what, args) in CLI.items():
        if only and name not in only:
            continue
        print(f"[{name}] {what}", file=sys.stderr, flush=True)
        checks[name] = {"what": what, **_run_cli(args)}
    try:
        import transformers
        hf = transformers.__version__
    except ImportError:
        hf = None
    return {"schema_version": 1, "torch": torch.__version__.split("+")[0], "torch_build": torch.__version__,
            "transformers": hf, "python": platform.python_version(), "machine": _machine(),
            "date": datetime.date.today().isoformat(), "checks": checks,
            "passed": all(c["status"] == "pass" for c in checks.values())}


def _machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{os.cpu_count()}-core {cpu}, no GPU" if not _has_cuda() else f"{cpu} with CUDA"


def _has_cuda() -> bool:
    import torch
    return torch.cuda.is_available()


def _version_key(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", v)[:3])


def table(paths: list[Path]) -> str:
    docs = sorted((json.loads(p.read_text()) for p in paths), key=lambda d: _version_key(d["torch"]))
    names = list(dict.fromkeys(n for d in docs for n in d["checks"]))
    lines = ["| torch | transformers | " + " | ".join(names) + " | tier |",
             "|---" * (len(names) + 3) + "|"]
    for d in docs:
        cells = []
        for n in names:
            c = d["checks"].get(n)
            if c is None:
                cells.append("not run")
            elif "passed" in c:
                skipped = f", {c['skipped']} skipped" if c.get("skipped") else ""
                cells.append(f"{c['status']} ({c['passed']}{skipped})" if c["status"] == "pass"
                             else f"**fail** ({c['failed']} of {c['passed'] + c['failed']})")
            else:
                cells.append(c["status"] if c["status"] == "pass" else "**fail**")
        lines.append(f"| {d['torch']} | {d['transformers'] or '-'} | " + " | ".join(cells)
                     + f" | {'pass' if d['passed'] else '**fail**'} |")
    what = [f"- `{n}`: {(TESTS.get(n) or CLI.get(n) or ('',))[0]}" for n in names]
    when = sorted({d["date"] for d in docs})
    machines = sorted({d["machine"] for d in docs})
    head = [f"Measured {', '.join(when)} on {'; '.join(machines)} (Python {docs[0]['python']}), one virtual "
            "environment per torch version, by `scripts/torch_matrix.sh`; a cell is the check's status and "
            "how many tests passed (skipped: what this torch cannot run, which ckplan refuses with a "
            "message, such as FSDP2 on CPU ranks before torch 2.9)."]
    fails = [f"- torch {d['torch']}, `{n}`: {c['detail']}" for d in docs for n, c in d["checks"].items()
             if c["status"] != "pass" and c.get("detail")]
    return "\n".join([*head, "", *lines, "", "Checks:", "", *what, *(["", "Failures:", "", *fails] if fails else [])]) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, help="write the JSON document here (default: stdout)")
    ap.add_argument("--only", nargs="*", help="run only these checks")
    ap.add_argument("--table", nargs="*", type=Path, help="print the markdown table of these JSON documents")
    a = ap.parse_args()
    if a.table:
        sys.stdout.write(table(a.table))
        return 0
    doc = run_tier(a.only)
    text = json.dumps(doc, indent=2) + "\n"
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(text)
    else:
        sys.stdout.write(text)
    for name, c in doc["checks"].items():
        print(f"{name}: {c['status']} ({c['seconds']} s){' - ' + c['detail'] if c.get('detail') else ''}",
              file=sys.stderr)
    return 0 if doc["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
