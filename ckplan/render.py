"""Human-readable output: rich tables on stdout, the only module that imports rich.

Tables fit the terminal: each table names its essential columns (always shown) and ranks the
others; as many of those as fit the width are added, in rank order, and shown in the table's own
column order. ``wide=True`` shows every column. The width is ``COLUMNS`` when set, else the
terminal's; piped output with no ``COLUMNS`` (files, CI logs) gets every column at full width.
JSON and CSV always carry every field.
"""
from __future__ import annotations

import os
import sys
import unicodedata
from dataclasses import dataclass

from rich.console import Console
from rich.markup import escape as _markup_escape
from rich.table import Table
from rich.text import Text

from .records import OVER_BUDGET, Profile
from .units import format_bytes, format_flops, format_ms

# Piped output (files, CI logs, README examples) gets wide tables instead of rich's 80 columns.
stdout = Console(soft_wrap=False, width=None if sys.stdout.isatty() else 200)
stderr = Console(stderr=True)


def clean(text: str) -> str:
    """``text`` with control and format characters (ESC, CR, backspace, bidi overrides) shown as
    escapes (``\\x1b``): a model name, a layer name or a profile's text reaches the terminal as
    text, never as a command to it. Newlines and tabs stay."""
    text = str(text)
    if text.isprintable():
        return text
    out = []
    for ch in text:
        if ch in "\n\t" or unicodedata.category(ch) not in ("Cc", "Cf", "Cs", "Zl", "Zp"):
            out.append(ch)
        else:
            out.append(f"\\x{ord(ch):02x}" if ord(ch) < 0x100 else f"\\u{ord(ch):04x}")
    return "".join(out)


def escape(text: str) -> str:
    """``text`` for rich markup: control characters shown (:func:`clean`), brackets escaped."""
    return _markup_escape(clean(text))


@dataclass(frozen=True)
class _Col:
    header: str
    rank: int = 0  # 0: essential, always shown; then the lower the rank, the sooner it is added
    left: bool = False  # text is left-aligned, numbers right-aligned
    fold: bool = False  # long names may break over lines; other values are never cut


def _width_limit(console: Console, wide: bool) -> int | None:
    """The width a table must fit, or None for every column at full width."""
    if wide:
        return None
    if console is not stdout:  # a console made by the caller (tests, embedding) knows its width
        return console.width
    cols = os.environ.get("COLUMNS", "")
    if cols.isdigit() and int(cols) > 0:
        return int(cols)
    return console.width if console.is_terminal else None


def _cell_len(text: str) -> int:
    """Width of a cell: its longest line."""
    return max(Text.from_markup(line).cell_len for line in text.split("\n"))


def _print_table(console: Console, cols: list[_Col], rows: list[list[str]], wide: bool, **table_kw) -> None:
    """Build and print a table with the columns that fit (see the module docstring)."""
    limit = _width_limit(console, wide)
    full = [max([_cell_len(c.header)] + [_cell_len(r[i]) for r in rows]) for i, c in enumerate(cols)]
    # The narrowest a column may get without cutting a value: headers may wrap at spaces, values not.
    least = [max([len(w) for w in c.header.split()] + ([] if c.fold else [_cell_len(r[i]) for r in rows]))
             for i, c in enumerate(cols)]
    keep = {i for i, c in enumerate(cols) if c.rank == 0}
    if limit is None:
        keep = set(range(len(cols)))
    else:
        used = 1 + sum(full[i] + 3 for i in keep)  # borders and padding: 3 per column, 1 more
        for i in sorted((i for i, c in enumerate(cols) if c.rank > 0), key=lambda i: cols[i].rank):
            if used + full[i] + 3 <= limit:
                keep.add(i)
                used += full[i] + 3
    shown = sorted(keep)
    width = {i: full[i] for i in shown}
    if limit is not None:
        # Too wide with every value on one line and every header too: narrow the columns with the
        # most to give, down to their least (headers wrap at spaces, long names fold), until it fits.
        excess = 1 + sum(width[i] + 3 for i in shown) - limit
        for i in sorted(shown, key=lambda i: least[i] - full[i]):
            if excess <= 0:
                break
            cut = min(excess, full[i] - least[i])
            width[i] -= cut
            excess -= cut
    t = Table(title_justify="left", **table_kw)
    for i in shown:
        c = cols[i]
        t.add_column(c.header, justify="left" if c.left else "right", width=width[i],
                     overflow="fold" if c.fold else "ellipsis")
    for r in rows:
        t.add_row(*(r[i] for i in shown))
    if limit is not None:
        console.print(t)
        return
    # Every column at full width, wider than the console if need be (print(width=) cannot widen).
    natural = 1 + sum(width[i] + 3 for i in shown)
    saved = getattr(console, "_width", None)
    console.width = max(console.width, natural)
    try:
        console.print(t, crop=False)
    finally:
        console._width = saved


def profile_table(prof: Profile, *, wide: bool = False, console: Console | None = None) -> None:
    out = console or stdout
    est = " | times estimated from FLOPs" if prof.times_estimated else ""
    cols = [_Col("#"), _Col("layer", left=True, fold=True), _Col("type", 1, left=True, fold=True),
            _Col("params"), _Col("output"), _Col("saved"), _Col("fwd"), _Col("bwd"), _Col("fwd FLOPs", 2),
            _Col("fwd tmp", 3), _Col("bwd tmp", 4)]
    rows = [["" if r.role != "chain" else str(r.index), escape(r.name), escape(r.type),
             format_bytes(r.param_bytes), format_bytes(r.output_bytes), format_bytes(r.saved_bytes),
             format_ms(r.fwd_ms), format_ms(r.bwd_ms), format_flops(r.fwd_flops),
             format_bytes(r.fwd_tmp_bytes), format_bytes(r.bwd_tmp_bytes)] for r in prof.layers]
    _print_table(out, cols, rows, wide, title=escape(f"ckplan profile: {prof.model} | {prof.device} | batch "
                                                     f"{prof.batch_size} | {prof.precision} | {prof.optimizer}{est}"))
    tt = prof.totals
    s = Table(show_header=False, box=None, title="totals", title_justify="left")
    s.add_column(justify="left")
    s.add_column(justify="right")
    totals = [
        ("parameters", tt.param_bytes), ("buffers", tt.buffer_bytes), ("gradients", tt.grad_bytes),
        (f"optimizer state ({prof.optimizer})", tt.optimizer_bytes),
        ("optimizer step transient", tt.optimizer_tmp_bytes), ("inputs", tt.input_bytes),
        ("activations (saved for backward)", tt.activation_bytes),
        ("predicted peak, no checkpointing", tt.predicted_peak_bytes),
    ]
    if tt.runtime_bytes:
        totals.insert(-2, ("CUDA runtime (cuBLAS workspaces, outside tensors)", tt.runtime_bytes))
    if prof.side_inputs:  # after the activations: what checkpoints keep besides them
        totals.insert(-1, ("side inputs (masks, ids; kept by checkpoints)",
                           sum(si.bytes for si in prof.side_inputs)))
        side_grads = sum(si.grad_bytes for si in prof.side_inputs)
        if side_grads:  # held from the last reader's backward to the maker's, recomputes between
            totals.insert(-1, ("side-input gradients (held through recomputes)", side_grads))
    if tt.measured_peak_bytes is not None:
        totals.append(("measured peak, forward+backward (optimizer state included)", tt.measured_peak_bytes))
    for k, v in totals:
        s.add_row(k, format_bytes(v))
    if tt.optimizer_ms is not None:
        s.add_row("optimizer step time (timed on stand-ins)", format_ms(tt.optimizer_ms))
    out.print(s)
    if prof.compiled:
        out.print("chain layers profiled compiled (torch.compile): plans for them run inside "
                  "ckplan.compiled_layers(model)")
    chosen = "detected" if prof.chain_detected else "from the spec"
    out.print(escape(f"chain: {prof.chain}") + f" ({len(prof.chain_layers)} layers, {chosen}); "
              f"device: {escape(prof.device_name)}" + (
                  f", {format_bytes(prof.device_free_bytes)} free of {format_bytes(prof.device_total_bytes)}"
                  if prof.device_free_bytes is not None else ""), soft_wrap=True)
    for note in prof.notes:
        out.print(escape(f"note: {note}"), soft_wrap=True)
    if prof.option_names:
        options_table(prof, wide=wide, console=out)


def options_table(prof: Profile, *, wide: bool = False, console: Console | None = None) -> None:
    """Each chain layer's selective options: bytes kept for backward and the forward time redone.

    ``*`` marks an option the planner leaves out: ``store``, ``full`` (recompute the layer: keeps
    its output, redoes its forward) or another option keeps no more and redoes no more.
    """
    out = console or stdout
    names = prof.option_names
    kept = _kept_options(prof)
    cols = [_Col("#"), _Col("layer", 2, left=True, fold=True), _Col("store"), _Col("full", 1)]
    cols += [_Col(n) for n in names]
    def table(sep: str) -> list[list[str]]:
        rows = []
        for r in prof.chain_layers:
            row = [str(r.index), escape(r.name), format_bytes(max(r.saved_bytes, r.output_bytes)),
                   f"{format_bytes(r.output_bytes)}{sep}+"
                   f"{format_ms(r.fwd_ms if r.recompute_ms is None else r.recompute_ms)}"]
            for n in names:
                o = r.option(n)
                row.append("-" if o is None else
                           f"{format_bytes(max(o.saved_bytes, r.output_bytes))}{sep}+{format_ms(o.recompute_ms)}"
                           + ("" if kept is None or n in kept[r.index] else "*"))
            rows.append(row)
        return rows

    rows = table(" ")
    limit = _width_limit(out, wide)
    essential = [i for i, c in enumerate(cols) if c.rank == 0]
    if limit is not None and 1 + sum(max(_cell_len(cols[i].header), *(_cell_len(r[i]) for r in rows)) + 3
                                     for i in essential) > limit:
        rows = table("\n")  # too wide for the terminal: bytes over the time in each cell
    _print_table(out, cols, rows, wide, title="selective options: kept for backward +forward redone")
    if kept is not None and any(o.name not in kept[r.index] for r in prof.chain_layers for o in r.options):
        from .planner.calibrate import TIE_BYTES, TIE_FWD
        out.print("*: beaten by store, full or another option on both memory and time (or a near tie "
                  f"with an earlier one: bytes within {TIE_BYTES:.0%}, time within {TIE_FWD:.0%} of the "
                  "forward); the planner leaves it out", soft_wrap=True)


def _kept_options(prof: Profile) -> list[set[str]] | None:
    """The options the planner keeps for each chain layer (None when the profile cannot be planned)."""
    from .planner.calibrate import chain_from_profile
    try:
        chain = chain_from_profile(prof)
    except (ValueError, KeyError):
        return None
    return [{o.name for o in ly.options} for ly in chain.layers]


def info(msg: str) -> None:
    stderr.print(escape(msg), highlight=False)


def error(msg: str) -> None:
    """One ``Error: ...`` line on stderr, as the CLI prints for every failure."""
    stderr.print(f"[bold red]Error:[/] {escape(msg)}", highlight=False, soft_wrap=True)


def _pct(x):
    return "-" if x is None else f"{x * 100:.1f}%"


def plan_tables(rep, *, wide: bool = False, console: Console | None = None) -> None:
    out = console or stdout
    prof = rep.profile
    budget = "none" if rep.budget_bytes is None else f"{format_bytes(rep.budget_bytes)} ({rep.budget_bytes} bytes)"
    out.print(escape(f"ckplan plan: {prof.model} | {len(prof.chain_layers)} layers in {prof.chain} | "
                     f"batch {prof.batch_size} | {prof.precision} | {prof.optimizer} | device {prof.device}"),
              soft_wrap=True)
    out.print(escape(f"budget: {budget} ({rep.budget_source}); no checkpointing peaks at "
                     f"{format_bytes(rep.none_peak_bytes)}"), soft_wrap=True)
    cols = [_Col("strategy", left=True), _Col("predicted peak"), _Col("saved vs none", 1), _Col("recompute", 2),
            _Col("overhead"), _Col("fits"), _Col("ckpts"), _Col("peak reached at", 3, left=True, fold=True)]
    rows = []
    for row in rep.summary_rows():
        fits = "-" if row["fits"] is None else ("yes" if row["fits"] else "[red]no[/]")
        rows.append([row["strategy"], format_bytes(row["predicted_peak_bytes"]),
                     f"{format_bytes(row['saved_bytes'])} ({_pct(row['saved_fraction'])})",
                     format_ms(row["predicted_recompute_ms"]), _pct(row["predicted_overhead"]), fits,
                     str(row["n_checkpoints"]), escape(str(row["peak_at"]))])
    _print_table(out, cols, rows, wide, title="strategies" if len(rep.results) > 1 else None)
    c = rep.chosen
    runs: list[list] = []  # consecutive layers with the same decision share a row
    for d in c.plan.per_layer():
        key = (d.stored, d.depth, d.forwards)
        if runs and runs[-1][0] == key:
            runs[-1][2] = d.layer
        else:
            runs.append([key, d.layer, d.layer])
    names = [r.name for r in prof.chain_layers]
    cols = [_Col("layers"), _Col("names", 1, left=True, fold=True), _Col("first forward", left=True),
            _Col("checkpoint depth"), _Col("forward runs")]
    rows = [[str(a) if a == b else f"{a}-{b}", escape(names[a] if a == b else f"{names[a]} .. {names[b]}"),
             "stored" if stored else "recomputed", str(depth), str(fwd)]
            for (stored, depth, fwd), a, b in runs]
    _print_table(out, cols, rows, wide, title=f"plan ({c.strategy}), layer by layer")
    out.print(escape(f"plan: {c.plan.describe(runs=True)}"), soft_wrap=True)
    ranges = ", ".join(f"[{r.start}, {r.stop})" + (f" depth {r.depth}" if r.depth > 1 else "")
                       for r in c.plan.recomputed_ranges()) or "none"
    out.print(escape(f"checkpoint boundaries after layers: {list(c.plan.boundaries()) or 'none'}; "
                     f"recomputed ranges: {ranges}"), soft_wrap=True)
    for note in (*getattr(rep, "notes", ()), *c.notes):
        out.print(escape(f"note: {note}"), soft_wrap=True)


def export_text(exported, closest_peak_bytes: int, planned_peak_bytes: int, *,
                console: Console | None = None) -> None:
    """The framework snippet of ``plan --export``, with what it applies when it is not the plan."""
    out = console or stdout
    verdict = ("exact: applies this plan" if exported.exact else
               f"not exact: applies {exported.closest_plan.describe()}, predicted peak "
               f"{format_bytes(closest_peak_bytes)} (the plan: {format_bytes(planned_peak_bytes)})")
    out.print(escape(f"--export {exported.target}: {verdict}"), soft_wrap=True)
    if exported.message:
        out.print(escape(exported.message), soft_wrap=True)
    out.print(clean(exported.text), markup=False, highlight=False, soft_wrap=True)


def sweep_table(points, *, wide: bool = False, console: Console | None = None) -> None:
    cols = [_Col("strategy", left=True), _Col("param"), _Col("predicted peak"), _Col("recompute", 1),
            _Col("overhead"), _Col("ckpts", 2)]
    rows = []
    for pt in points:
        param = (f"budget {format_bytes(pt.budget_bytes)}" if pt.budget_bytes is not None else
                 f"k={pt.k}" if pt.k is not None else
                 f"B={format_bytes(pt.threshold_bytes)}" if pt.threshold_bytes is not None else "")
        rows.append([pt.strategy, param, format_bytes(pt.peak_bytes), format_ms(pt.recompute_ms),
                     _pct(pt.overhead), str(pt.n_checkpoints)])
    _print_table(console or stdout, cols, rows, wide, title="memory vs recompute frontier")


def world_size_table(prof, rows, *, wide: bool = False, console: Console | None = None) -> None:
    """``plan --world-size 8,16,...``: what one rank needs at each world size."""
    out = console or stdout
    kind = rows[0].kind if rows else ""
    out.print(escape(f"ckplan plan: {prof.model} per rank under {kind} | batch {prof.batch_size} per rank | "
                     f"{prof.precision} | {prof.optimizer} | device {prof.device}"), soft_wrap=True)
    cols = [_Col("ranks"), _Col("fixed / rank", 1), _Col("none peak"), _Col("plan peak"), _Col("lowest peak", 2),
            _Col("fits"), _Col("overhead"), _Col("plan", 3, left=True, fold=True)]
    body = []
    for r in rows:
        fits = "-" if r.fits is None else ("yes" if r.fits else "[red]no[/]")
        body.append([str(r.world_size), format_bytes(r.persistent_bytes), format_bytes(r.none_peak_bytes),
                     format_bytes(r.plan_peak_bytes), format_bytes(r.min_peak_bytes), fits, _pct(r.overhead),
                     escape(r.plan or r.message)])
    _print_table(out, cols, body, wide, title=f"{rows[0].strategy if rows else ''} per rank")


def dist_bench_table(res, *, wide: bool = False, console: Console | None = None) -> None:
    """``bench --nproc N``: predicted and measured peak per strategy and rank."""
    out = console or stdout
    budget = format_bytes(res.budget_bytes) if res.budget_bytes else "none"
    out.print(escape(f"ckplan bench: {res.model} | {res.kind} on {res.world_size} ranks ({res.backend}, "
                     f"{res.device}) | batch {res.batch_size} per rank | {res.optimizer} | budget {budget} per "
                     f"rank | one process without checkpointing: {format_bytes(res.single_process_peak_bytes)}"),
              soft_wrap=True)
    cols = [_Col("strategy", left=True), _Col("rank"), _Col("status", left=True), _Col("predicted peak"),
            _Col("measured peak"), _Col("error"), _Col("step", 1), _Col("max |dgrad|", 2),
            _Col("torch tracker", 3)]
    body = []
    for r in res.rows:
        status = r.status if r.status == "ok" else f"[red]{escape(r.status)}[/]"  # each rank's own
        body.append([r.strategy, str(r.rank), status, format_bytes(r.predicted_peak_bytes),
                     format_bytes(r.measured_peak_bytes), _pct(r.peak_error), format_ms(r.step_ms),
                     "-" if r.max_grad_diff is None else f"{r.max_grad_diff:.1e}",
                     format_bytes(r.torch_tracker_peak_bytes)])
    _print_table(out, cols, body, wide)
    for r in res.rows:
        if r.status == OVER_BUDGET and r.rank == 0:
            out.print(f"[red]{escape(f'{r.strategy}: {r.message}')}[/]", soft_wrap=True)
    for note in res.notes:
        out.print(escape(f"note: {note}"), soft_wrap=True)


def _pair(a: int | None, b: int | None) -> str:
    return "-" if b is None else f"{format_bytes(a)} / {format_bytes(b)}"


def bench_table(res, *, wide: bool = False, console: Console | None = None) -> None:
    """The bench's rows; wrong results (wrong-gradients, non-finite) and failures in red."""
    out = console or stdout
    budget = "" if res.budget_bytes is None else f" | budget {format_bytes(res.budget_bytes)}"
    title = escape(f"ckplan bench: {res.model} | {res.device_name} | batch {res.batch_size} | "
                   f"{res.precision} | accum {res.accum} | {res.steps} timed steps{budget}")
    rss = any(r.measured_rss_growth_bytes is not None for r in res.rows)
    cols = [_Col("strategy", left=True), _Col("status", left=True), _Col("predicted peak"),
            _Col("measured peak"), _Col("error"), _Col("fwd+bwd pred / meas", 4),
            _Col("held for bwd pred / meas", 5), _Col("growth tensors / RSS", 6 if rss else 99),
            _Col("step (median)", 2), _Col("min-max", 7), _Col("slowdown"), _Col("predicted", 3),
            _Col("max |dgrad|", 1)]
    rows = []
    for r in res.rows:
        red = "[red]{}[/]".format
        dgrad = "-" if r.max_grad_diff is None else f"{r.max_grad_diff:.1e}"
        rows.append([
            escape(r.strategy), r.status if r.status == "ok" else red(r.status),
            format_bytes(r.predicted_peak_bytes), format_bytes(r.measured_peak_bytes), _pct(r.peak_error),
            _pair(r.predicted_fwd_bwd_peak_bytes, r.measured_fwd_bwd_peak_bytes),
            _pair(r.predicted_activation_bytes, r.measured_activation_bytes),
            "-" if r.measured_rss_growth_bytes is None else
            f"{format_bytes(r.measured_growth_bytes)} / {format_bytes(r.measured_rss_growth_bytes)}",
            format_ms(r.step_ms),
            "-" if r.step_ms_min is None else f"{format_ms(r.step_ms_min)}-{format_ms(r.step_ms_max)}",
            "-" if r.slowdown is None else ("~1.00x (within noise)" if r.slowdown_within_noise
                                            else f"{r.slowdown:.2f}x"),
            "-" if r.predicted_overhead is None else f"{1 + r.predicted_overhead:.2f}x",
            red(dgrad) if r.status == "wrong-gradients" else dgrad,
        ])
    if not rss:  # CUDA, or no /proc: the column would be all dashes
        del cols[7]
        for row in rows:
            del row[7]
    _print_table(out, cols, rows, wide, title=title)
    for r in res.rows:
        if r.message:
            line = escape(f"{r.strategy}: {r.message}")
            out.print(f"[red]{line}[/]" if r.failed or r.status == OVER_BUDGET else line, soft_wrap=True)
    for note in res.notes:
        out.print(escape(f"note: {note}"), soft_wrap=True)


class progress_bar:
    """A rich progress bar on stderr; call the instance with a description to advance it."""

    def __init__(self, total: int, label: str):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
        self.p = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                          TimeElapsedColumn(), console=stderr, transient=True)
        self.task = self.p.add_task(label, total=total)
        # Logs and pipes get no bar (rich draws none there): each new step as a line instead.
        self.lines = not stderr.is_terminal
        self.total, self.done, self.last = total, 0, label

    def __enter__(self):
        if self.lines:
            info(f"[0/{self.total}] {self.last}")
        else:
            self.p.start()
        return self

    def __exit__(self, *exc):
        if not self.lines:
            self.p.stop()

    def __call__(self, description: str) -> None:
        self.done += 1
        if self.lines:
            if description != self.last:
                info(f"[{self.done}/{self.total}] {description}")
                self.last = description
            return
        self.p.update(self.task, advance=1, description=escape(description))
