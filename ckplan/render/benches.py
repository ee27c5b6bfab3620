"""``ckplan bench``: the rows of one process, and of each rank with ``--nproc``."""
from __future__ import annotations

from rich.console import Console

from ..bench_records import OVER_BUDGET
from ..units import format_bytes, format_ms
from . import consoles
from .consoles import escape
from .tables import Col, pair, peak_diff, print_table


def bench_table(res, *, wide: bool = False, console: Console | None = None) -> None:
    """The bench's rows; wrong results (wrong-gradients, non-finite) and failures in red."""
    out = console or consoles.stdout
    budget = "" if res.budget_bytes is None else f" | budget {format_bytes(res.budget_bytes)}"
    title = escape(f"ckplan bench: {res.model} | {res.device_name} | batch {res.batch_size} | "
                   f"{res.precision} | accum {res.accum} | {res.steps} timed steps{budget}")
    rss = any(r.measured_rss_growth_bytes is not None for r in res.rows)
    cols = [Col("strategy", left=True), Col("status", left=True), Col("predicted peak"),
            Col("measured peak"), Col("error"), Col("fwd+bwd pred / meas", 4),
            Col("held for bwd pred / meas", 5), Col("growth tensors / RSS", 6 if rss else 99),
            Col("step (median)", 2), Col("min-max", 7), Col("slowdown"), Col("predicted", 3),
            Col("max |dgrad|", 1)]
    rows = []
    for r in res.rows:
        red = "[red]{}[/]".format
        dgrad = "-" if r.max_grad_diff is None else f"{r.max_grad_diff:.1e}"
        rows.append([
            escape(r.strategy), r.status if r.status == "ok" else red(r.status),
            format_bytes(r.predicted_peak_bytes), format_bytes(r.measured_peak_bytes),
            peak_diff(r.predicted_peak_bytes, r.measured_peak_bytes),
            pair(r.predicted_fwd_bwd_peak_bytes, r.measured_fwd_bwd_peak_bytes),
            pair(r.predicted_activation_bytes, r.measured_activation_bytes),
            "-" if r.measured_rss_growth_bytes is None else
            f"{format_bytes(r.measured_growth_bytes)} / {format_bytes(r.measured_rss_growth_bytes)}",
            format_ms(r.step_ms),
            "-" if r.step_ms_min is None else f"{format_ms(r.step_ms_min)}-{format_ms(r.step_ms_max)}",
            "-" if r.slowdown is None else f"{'~' if r.slowdown_within_noise else ''}{r.slowdown:.2f}x",
            "-" if r.predicted_overhead is None else f"{1 + r.predicted_overhead:.2f}x",
            red(dgrad) if r.status == "wrong-gradients" else dgrad,
        ])
    if not rss:  # CUDA, or no /proc: the column would be all dashes
        del cols[7]
        for row in rows:
            del row[7]
    print_table(out, cols, rows, wide, title=title)
    for r in res.rows:
        if r.message:
            line = escape(f"{r.strategy}: {r.message}")
            out.print(f"[red]{line}[/]" if r.failed or r.status == OVER_BUDGET else line, soft_wrap=True)
    for note in res.notes:
        out.print(escape(f"note: {note}"), soft_wrap=True)
    noisy = [r.strategy for r in res.rows if r.slowdown is not None and r.slowdown_within_noise]
    if noisy:
        out.print(escape(f"note: ~ ({', '.join(noisy)}): within noise, the timed rounds ran both faster "
                         "and slower than none's (the median is shown)"), soft_wrap=True)


def dist_bench_table(res, *, wide: bool = False, console: Console | None = None) -> None:
    """``bench --nproc N``: predicted and measured peak per strategy and rank."""
    out = console or consoles.stdout
    budget = format_bytes(res.budget_bytes) if res.budget_bytes else "none"
    ranks = f"{res.world_size} rank{'s' if res.world_size != 1 else ''}"
    out.print(escape(f"ckplan bench: {res.model} | {res.kind} on {ranks} ({res.backend}, "
                     f"{res.device}) | batch {res.batch_size} per rank | {res.optimizer} | budget {budget} per "
                     f"rank | one process without checkpointing: {format_bytes(res.single_process_peak_bytes)}"),
              soft_wrap=True)
    cols = [Col("strategy", left=True), Col("rank"), Col("status", left=True), Col("predicted peak"),
            Col("measured peak"), Col("error"), Col("step", 1), Col("max |dgrad|", 2),
            Col("torch tracker", 3)]
    body = []
    for r in res.rows:
        status = r.status if r.status == "ok" else f"[red]{escape(r.status)}[/]"  # each rank's own
        body.append([r.strategy, str(r.rank), status, format_bytes(r.predicted_peak_bytes),
                     format_bytes(r.measured_peak_bytes), peak_diff(r.predicted_peak_bytes, r.measured_peak_bytes),
                     format_ms(r.step_ms),
                     "-" if r.max_grad_diff is None else f"{r.max_grad_diff:.1e}",
                     format_bytes(r.torch_tracker_peak_bytes)])
    print_table(out, cols, body, wide)
    for r in res.rows:
        if r.status == OVER_BUDGET and r.rank == 0:
            out.print(f"[red]{escape(f'{r.strategy}: {r.message}')}[/]", soft_wrap=True)
    for note in res.notes:
        out.print(escape(f"note: {note}"), soft_wrap=True)
