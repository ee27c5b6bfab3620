"""Hand-made profile, plan and bench records for the rendering and report tests."""
from __future__ import annotations

from ckplan.bench_records import BenchResult, BenchRow
from ckplan.plan_report import PlanReport
from ckplan.planner import STRATEGIES, chain_from_profile, compare, plan_chain
from ckplan.records import Profile, StageRecord, Totals

MiB = 2**20


def _stage(index, name, type_, role, param, out, saved, fwd=1.25, bwd=2.5):
    return StageRecord(index=index, name=name, type=type_, role=role, param_bytes=param, grad_bytes=param,
                       output_bytes=out, saved_bytes=saved, fwd_ms=fwd, bwd_ms=bwd, fwd_flops=123_456_789_000,
                       bwd_flops=2 * 123_456_789_000, fwd_tmp_bytes=out, bwd_tmp_bytes=2 * out,
                       fwd_peak_bytes=saved, bwd_peak_bytes=saved)


def make_profile(n=12) -> Profile:
    layers = [_stage(-1, "(pre)", "pre", "pre", 150 * MiB, 12 * MiB, 12 * MiB)]
    layers += [_stage(i, f"transformer.h.{i}", "GPT2Block", "chain", 27 * MiB, 12 * MiB, 170 * MiB)
               for i in range(n)]
    layers.append(_stage(n, "(post)", "post", "post", 2 * MiB, 0, 600 * MiB))
    params = sum(r.param_bytes for r in layers)
    act = sum(r.saved_bytes for r in layers)
    totals = Totals(param_bytes=params, buffer_bytes=0, trainable_bytes=params, grad_bytes=params,
                    optimizer_bytes=2 * params, optimizer_tmp_bytes=params, input_bytes=MiB,
                    activation_bytes=act, predicted_peak_bytes=4 * params + act, measured_peak_bytes=None)
    return Profile(model="gpt2-small", device="cpu", device_name="CPU: Some Processor 3.0GHz",
                   chain="transformer.h", chain_detected=True, batch_size=8, precision="fp32",
                   optimizer="adamw", accum=1, input_requires_grad=True, times_estimated=False,
                   layers=tuple(layers), totals=totals, notes=("a note about this profile",))


def _row(strategy, status="ok", **over):
    d = dict(strategy=strategy, status=status, plan="[0, 3) store 3..11", n_checkpoints=4,
             predicted_peak_bytes=1_234 * MiB, measured_peak_bytes=1_240 * MiB, peak_error=0.0048,
             predicted_fwd_bwd_peak_bytes=1_100 * MiB, measured_fwd_bwd_peak_bytes=1_101 * MiB,
             fwd_bwd_peak_error=0.001, predicted_activation_bytes=400 * MiB,
             measured_activation_bytes=401 * MiB, reserved_peak_bytes=None, alloc_retries=None,
             nvml_used_bytes=None, step_ms=812.5, step_ms_min=800.1, step_ms_max=830.9, slowdown=1.23,
             predicted_overhead=0.25, loss=4.5, final_loss=4.4, max_grad_diff=0.0, grad_tolerance=1e-5,
             measured_growth_bytes=300 * MiB, measured_rss_peak_bytes=2_000 * MiB,
             measured_rss_growth_bytes=526 * MiB)
    d.update(over)
    return BenchRow(**d)


def make_bench() -> BenchResult:
    rows = (_row("none", n_checkpoints=0, slowdown=1.0), _row("sqrtn"), _row("every-k"), _row("chen"),
            _row("dp", "wrong-gradients", max_grad_diff=0.031, step_ms=None, step_ms_min=None,
                 step_ms_max=None, slowdown=None, measured_peak_bytes=None, peak_error=None,
                 message="max |grad - grad(none)| = 0.031 over the tolerance"),
            _row("plan:every-k", "OOM", measured_peak_bytes=None, peak_error=None, slowdown=None))
    return BenchResult(model="gpt2-small", device="cpu", device_name="CPU: Some Processor 3.0GHz",
                       batch_size=8, precision="fp32", optimizer="adamw", accum=1, steps=5, warmup=1,
                       budget_bytes=1_300 * MiB, k=2, rows=rows, profile_peak_bytes=2_000 * MiB,
                       notes=("a note",))


def make_plan_report() -> PlanReport:
    prof = make_profile()
    chain = chain_from_profile(prof)
    none = plan_chain(chain, "none")
    budget = (none.score.peak_bytes * 9) // 10
    results = compare(chain, list(STRATEGIES), budget, 2)
    return PlanReport(profile=prof, budget_bytes=budget, budget_source="--budget", strategy="all", k=2,
                      results=tuple(results), chosen=next(r for r in results if r.strategy == "dp"),
                      none_peak_bytes=none.score.peak_bytes, none_step_ms=none.score.step_ms)
