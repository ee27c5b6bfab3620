"""Result assembly: each row from what was measured, the noise rule for slowdowns, dp's frontier,
and the :class:`~ckplan.records.BenchResult`."""
from __future__ import annotations

import statistics

from ..bench_records import (
    OK,
    OVER_BUDGET,
    BenchResult,
    BenchRow,
    FrontierPoint,
    above_budget_note,
    over_budget,
    peak_error,
)
from ..errors import CkplanError
from ..planner import sweep
from ..planner.regions import scored_frontier
from ..planner.whole import WHOLE_OPTIONS
from ..records import Profile
from ..units import format_bytes
from .entry import Entry


def row_of(e: Entry, none: Entry | None, budget_bytes: int | None = None) -> BenchRow:
    """The row of ``e``; ``budget_bytes``: the explicit --budget (a row predicted to fit it that
    measured above it is ``over-budget``)."""
    none_ms = statistics.median(none.times) if none is not None else None
    noisy, rlo, rhi = (within_noise(e.times, none.times) if none is not None and e is not none
                       and e.status == OK else (False, None, None))
    measured = e.mem.get("measured") if e.status == OK else None
    med = statistics.median(e.times) if e.times and e.status == OK else None
    fb = e.mem.get("fwd_bwd") if e.status == OK else None
    status, message = e.status, e.message
    if status == OK and over_budget(e.predicted_peak, measured, budget_bytes):
        status = OVER_BUDGET
        message = "; ".join(m for m in (message, f"measured above the budget it was predicted to fit "
                                                 f"({measured - budget_bytes} bytes over)") if m)
    elif (status == OK and e.predicted_peak is None and measured is not None and budget_bytes is not None
          and measured > budget_bytes):  # a peer claims no peak; say where it landed against the budget
        message = "; ".join(m for m in (message, f"measured {measured - budget_bytes} bytes above the budget") if m)
    return BenchRow(
        strategy=e.name, status=status, plan=e.plan.describe() if e.plan else e.plan_text,
        n_checkpoints=e.plan.n_checkpoints if e.plan else 0,
        predicted_peak_bytes=e.predicted_peak, measured_peak_bytes=measured,
        peak_error=peak_error(e.predicted_peak, measured),
        predicted_fwd_bwd_peak_bytes=e.predicted_fb_peak, measured_fwd_bwd_peak_bytes=fb,
        fwd_bwd_peak_error=peak_error(e.predicted_fb_peak, fb),
        predicted_activation_bytes=e.predicted_act,
        measured_activation_bytes=e.mem.get("act") if e.status == OK else None,
        reserved_peak_bytes=e.mem.get("reserved"), alloc_retries=e.mem.get("retries"),
        nvml_used_bytes=e.mem.get("nvml"),
        step_ms=med, step_ms_min=min(e.times) if med is not None else None,
        step_ms_max=max(e.times) if med is not None else None,
        slowdown=(med / none_ms) if med is not None and none_ms else None,
        predicted_overhead=e.predicted_overhead, loss=e.loss, final_loss=e.final_loss,
        max_grad_diff=e.grad_diff, message=message, grad_tolerance=e.grad_tol,
        measured_growth_bytes=e.mem.get("growth") if e.status == OK else None,
        measured_rss_peak_bytes=e.mem.get("rss_peak") if e.status == OK else None,
        measured_rss_growth_bytes=e.mem.get("rss_growth") if e.status == OK else None,
        kind=e.kind, slowdown_within_noise=noisy, slowdown_ratio_min=rlo, slowdown_ratio_max=rhi,
        offload_release=_offload_points(e.plan) if e.plan else "")


def _offload_points(plan) -> str:
    """An offloading plan's points per layer, ``layer:release:fetch`` (the last layer: no fetch)."""
    fetches = plan.fetches()
    return " ".join(f"{i}:{r}" + (f":{fetches[i]}" if i in fetches else "") for i, r in sorted(plan.releases().items()))


def within_noise(times: list[float], ref_times: list[float]) -> tuple[bool, float | None, float | None]:
    """Whether a row's slowdown against ``none`` is inside the timing noise, and the paired ratios'
    min and max.

    The rule: timed steps are interleaved, so round ``i`` of a row and round ``i`` of ``none`` ran
    under the same load; ``r_i = t_i / t_none_i``. When the ratios straddle 1 (``min r <= 1 <= max r``:
    some rounds faster than none, some slower) the difference is inside the noise and the table
    marks the median slowdown ``~`` with a note. Fewer than one paired round: not judged (False, None, None).
    """
    ratios = [t / r for t, r in zip(times, ref_times) if r > 0]
    if not ratios:
        return False, None, None
    lo, hi = min(ratios), max(ratios)
    return lo <= 1.0 <= hi, lo, hi


# Fewer timed steps than this give a slowdown without a noise estimate worth the name.
FEW_STEPS = 3


def few_steps_note(steps: int, rows) -> str | None:
    """The caveat for slowdowns from fewer than :data:`FEW_STEPS` timed steps: each is one or two
    steps against as many of ``none``, so a cold or disturbed step decides it, and a row faster
    than ``none`` (which does the least work) shows the noise."""
    if steps >= FEW_STEPS:
        return None
    fast = [f"{r.strategy} {r.slowdown:.2f}x" for r in rows
            if r.slowdown is not None and r.slowdown < 1.0 and r.strategy != "none"]
    text = (f"--steps {steps}: each slowdown is {'one step' if steps == 1 else f'{steps} steps'} against "
            f"{'one' if steps == 1 else 'as many'} of none, so the timing noise is unknown and one slow step "
            "decides it")
    if fast:
        text += f" ({', '.join(fast)}: faster than none, which recomputes nothing, so that is noise)"
    return text + f"; use --steps {max(5, FEW_STEPS)} or more (the default is 5) for slowdowns to compare"


FRONTIER_POINTS = 16


def frontier_of(chain) -> tuple[FrontierPoint, ...]:
    """dp's predicted frontier (and dp-layer's when the chain has selective options)."""
    names = ["dp", "dp-layer"] if chain.has_options else ["dp"]
    try:
        pts = sweep(chain, names, FRONTIER_POINTS)
    except CkplanError:  # a frontier is a picture; never fail a bench for it
        return ()
    return tuple(FrontierPoint(p.strategy, p.peak_bytes, 1.0 + p.overhead) for p in pts if p.strategy in names)


def regions_frontier_of(chain) -> tuple[FrontierPoint, ...]:
    """The one-region-per-layer plans' predicted frontier (``--compile-scope model``), thinned to
    about :data:`FRONTIER_POINTS` points evenly spread over their peaks."""
    points, _ = scored_frontier(chain, WHOLE_OPTIONS, checkpoints=False)
    if not points:
        return ()
    lo, hi = points[0][0], points[-1][0]
    step = max(1, (hi - lo) // FRONTIER_POINTS)
    picked: dict[int, tuple[int, float]] = {}
    for peak, ms, _ in points:  # the fastest of each cell
        cell = (peak - lo) // step
        if cell not in picked or ms < picked[cell][1]:
            picked[cell] = (peak, ms)
    base = chain.base_step_ms
    return tuple(FrontierPoint("dp", peak, 1.0 + ms / base) for peak, ms in sorted(picked.values()))


def bench_result(profile: Profile, entries: list[Entry], chain, notes: list[str], *, steps: int, warmup: int,
                 budget_bytes: int | None, k: int, explicit_budget: int | None, scope: str = "layers") -> BenchResult:
    """The rows (``explicit_budget``: the --budget a row predicted to fit must measure under), the
    few-steps caveat, dp's frontier, all in one :class:`BenchResult`."""
    none = next((e for e in entries if e.name == "none" and e.times), None)
    rows = tuple(row_of(e, none, explicit_budget) for e in entries)
    few = few_steps_note(steps, rows)
    if few:
        notes.append(few)
    above = above_budget_note(rows, explicit_budget, format_bytes)
    if above:
        notes.append(above)
    return BenchResult(model=profile.model, device=profile.device, device_name=profile.device_name,
                       batch_size=profile.batch_size, precision=profile.precision,
                       optimizer=profile.optimizer, accum=profile.accum, steps=steps, warmup=warmup,
                       budget_bytes=budget_bytes, k=k, rows=rows,
                       profile_peak_bytes=profile.totals.predicted_peak_bytes, notes=tuple(notes),
                       frontier=regions_frontier_of(chain) if scope == "model" else frontier_of(chain),
                       compiled=profile.compiled, compile_scope=scope if profile.compiled else "layers")
