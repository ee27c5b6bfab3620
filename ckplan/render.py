"""Human-readable output: rich tables on stdout, the only module that imports rich."""
from __future__ import annotations

import sys

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from .records import Profile
from .units import format_bytes, format_flops, format_ms

# Piped output (files, CI logs, README examples) gets wide tables instead of rich's 80 columns.
stdout = Console(soft_wrap=False, width=None if sys.stdout.isatty() else 200)
stderr = Console(stderr=True)


def profile_table(prof: Profile) -> None:
    est = " (estimated)" if prof.times_estimated else ""
    t = Table(title=f"ckplan profile: {prof.model} | {prof.device} | batch {prof.batch_size} | "
                    f"{prof.precision} | {prof.optimizer}", title_justify="left")
    for col in ("#", "layer", "type", "params", "output", "saved", f"fwd{est}", f"bwd{est}",
                "fwd FLOPs", "fwd tmp", "bwd tmp"):
        t.add_column(col, justify="left" if col in ("layer", "type") else "right")
    for r in prof.layers:
        t.add_row("" if r.role != "chain" else str(r.index), r.name, r.type, format_bytes(r.param_bytes),
                  format_bytes(r.output_bytes), format_bytes(r.saved_bytes), format_ms(r.fwd_ms),
                  format_ms(r.bwd_ms), format_flops(r.fwd_flops), format_bytes(r.fwd_tmp_bytes),
                  format_bytes(r.bwd_tmp_bytes))
    stdout.print(t)
    tt = prof.totals
    s = Table(show_header=False, box=None, title="totals", title_justify="left")
    s.add_column(justify="left")
    s.add_column(justify="right")
    rows = [
        ("parameters", tt.param_bytes), ("buffers", tt.buffer_bytes), ("gradients", tt.grad_bytes),
        (f"optimizer state ({prof.optimizer})", tt.optimizer_bytes),
        ("optimizer step transient", tt.optimizer_tmp_bytes), ("inputs", tt.input_bytes),
        ("activations (saved for backward)", tt.activation_bytes),
        ("predicted peak, no checkpointing", tt.predicted_peak_bytes),
    ]
    if tt.measured_peak_bytes is not None:
        rows.append(("measured peak, forward+backward (optimizer state included)", tt.measured_peak_bytes))
    for k, v in rows:
        s.add_row(k, format_bytes(v))
    stdout.print(s)
    chosen = "detected" if prof.chain_detected else "from the spec"
    stdout.print(f"chain: [bold]{prof.chain}[/] ({len(prof.chain_layers)} layers, {chosen}); "
                 f"device: {prof.device_name}" + (
                     f", {format_bytes(prof.device_free_bytes)} free of {format_bytes(prof.device_total_bytes)}"
                     if prof.device_free_bytes is not None else ""))
    for note in prof.notes:
        stdout.print(escape(f"note: {note}"))


def info(msg: str) -> None:
    stderr.print(escape(msg), highlight=False)


def _pct(x):
    return "-" if x is None else f"{x * 100:.1f}%"


def plan_tables(rep) -> None:
    from .units import format_bytes, format_ms
    prof = rep.profile
    budget = "none" if rep.budget_bytes is None else f"{format_bytes(rep.budget_bytes)} ({rep.budget_bytes} bytes)"
    stdout.print(f"ckplan plan: {prof.model} | {len(prof.chain_layers)} layers in {prof.chain} | "
                 f"batch {prof.batch_size} | {prof.precision} | {prof.optimizer} | device {prof.device}")
    stdout.print(escape(f"budget: {budget} ({rep.budget_source}); no checkpointing peaks at "
                        f"{format_bytes(rep.none_peak_bytes)}"))
    t = Table(title="strategies" if len(rep.results) > 1 else None, title_justify="left")
    for col in ("strategy", "predicted peak", "saved vs none", "recompute", "overhead", "fits", "ckpts",
                "peak reached at"):
        t.add_column(col, justify="left" if col in ("strategy", "peak reached at") else "right")
    for row in rep.summary_rows():
        fits = "-" if row["fits"] is None else ("yes" if row["fits"] else "[red]no[/]")
        t.add_row(row["strategy"], format_bytes(row["predicted_peak_bytes"]),
                  f"{format_bytes(row['saved_bytes'])} ({_pct(row['saved_fraction'])})",
                  format_ms(row["predicted_recompute_ms"]), _pct(row["predicted_overhead"]), fits,
                  str(row["n_checkpoints"]), row["peak_at"])
    stdout.print(t)
    c = rep.chosen
    p = Table(title=f"plan ({c.strategy}), layer by layer", title_justify="left")
    for col in ("layers", "names", "first forward", "checkpoint depth", "forward runs"):
        p.add_column(col, justify="left" if col in ("names", "first forward") else "right")
    runs: list[list] = []  # consecutive layers with the same decision share a row
    for d in c.plan.per_layer():
        key = (d.stored, d.depth, d.forwards)
        if runs and runs[-1][0] == key:
            runs[-1][2] = d.layer
        else:
            runs.append([key, d.layer, d.layer])
    names = [r.name for r in prof.chain_layers]
    for (stored, depth, fwd), a, b in runs:
        p.add_row(str(a) if a == b else f"{a}-{b}", names[a] if a == b else f"{names[a]} .. {names[b]}",
                  "stored" if stored else "recomputed", str(depth), str(fwd))
    stdout.print(p)
    stdout.print(escape(f"plan: {c.plan.describe()}"), soft_wrap=True)
    ranges = ", ".join(f"[{r.start}, {r.stop})" + (f" depth {r.depth}" if r.depth > 1 else "")
                       for r in c.plan.recomputed_ranges()) or "none"
    stdout.print(escape(f"checkpoint boundaries after layers: {list(c.plan.boundaries()) or 'none'}; "
                        f"recomputed ranges: {ranges}"))
    for note in c.notes:
        stdout.print(escape(f"note: {note}"))


def sweep_table(points) -> None:
    from .units import format_bytes, format_ms
    t = Table(title="memory vs recompute frontier", title_justify="left")
    for col in ("strategy", "param", "predicted peak", "recompute", "overhead", "ckpts"):
        t.add_column(col, justify="left" if col == "strategy" else "right")
    for pt in points:
        param = (f"budget {format_bytes(pt.budget_bytes)}" if pt.budget_bytes is not None else
                 f"k={pt.k}" if pt.k is not None else
                 f"B={format_bytes(pt.threshold_bytes)}" if pt.threshold_bytes is not None else "")
        t.add_row(pt.strategy, param, format_bytes(pt.peak_bytes), format_ms(pt.recompute_ms),
                  _pct(pt.overhead), str(pt.n_checkpoints))
    stdout.print(t)


def bench_table(res) -> None:
    from .units import format_bytes, format_ms
    budget = "" if res.budget_bytes is None else f" | budget {format_bytes(res.budget_bytes)}"
    t = Table(title=f"ckplan bench: {res.model} | {res.device_name} | batch {res.batch_size} | "
                    f"{res.precision} | accum {res.accum} | {res.steps} timed steps{budget}",
              title_justify="left")
    for col in ("strategy", "status", "predicted peak", "measured peak", "error", "fwd+bwd pred / meas",
                "held for bwd pred / meas", "step (median)",
                "min-max", "slowdown", "predicted", "max |dgrad|"):
        t.add_column(col, justify="left" if col in ("strategy", "status") else "right")
    for r in res.rows:
        t.add_row(r.strategy, r.status if r.status == "ok" else f"[red]{r.status}[/]",
                  format_bytes(r.predicted_peak_bytes), format_bytes(r.measured_peak_bytes),
                  _pct(r.peak_error),
                  "-" if r.measured_fwd_bwd_peak_bytes is None else
                  f"{format_bytes(r.predicted_fwd_bwd_peak_bytes)} / {format_bytes(r.measured_fwd_bwd_peak_bytes)}",
                  "-" if r.measured_activation_bytes is None else
                  f"{format_bytes(r.predicted_activation_bytes)} / {format_bytes(r.measured_activation_bytes)}",
                  format_ms(r.step_ms),
                  "-" if r.step_ms_min is None else f"{format_ms(r.step_ms_min)}-{format_ms(r.step_ms_max)}",
                  "-" if r.slowdown is None else f"{r.slowdown:.2f}x",
                  "-" if r.predicted_overhead is None else f"{1 + r.predicted_overhead:.2f}x",
                  "-" if r.max_grad_diff is None else f"{r.max_grad_diff:.1e}")
    stdout.print(t)
    for r in res.rows:
        if r.message:
            stdout.print(escape(f"{r.strategy}: {r.message}"))
    for note in res.notes:
        stdout.print(escape(f"note: {note}"))


class progress_bar:
    """A rich progress bar on stderr; call the instance with a description to advance it."""

    def __init__(self, total: int, label: str):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
        self.p = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                          TimeElapsedColumn(), console=stderr, transient=True)
        self.task = self.p.add_task(label, total=total)

    def __enter__(self):
        self.p.start()
        return self

    def __exit__(self, *exc):
        self.p.stop()

    def __call__(self, description: str) -> None:
        self.p.update(self.task, advance=1, description=description)
