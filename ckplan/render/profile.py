"""``ckplan profile``: the per-layer table, the totals, and each chain layer's selective options."""
from __future__ import annotations

from rich.console import Console
from rich.table import Table

from ..planner import plan_none
from ..planner.calibrate import TIE_BYTES, TIE_FWD, chain_from_profile
from ..planner.simulate import forward_backward_peak
from ..records import Profile
from ..units import format_bytes, format_flops, format_ms
from . import consoles
from .consoles import escape
from .tables import Col, batch, cell_len, precision, print_table, width_limit


def profile_table(prof: Profile, *, wide: bool = False, console: Console | None = None) -> None:
    out = console or consoles.stdout
    est = " | times estimated (see the notes)" if prof.times_estimated else ""
    cols = [Col("#"), Col("layer", left=True, fold=True), Col("type", 1, left=True, fold=True),
            Col("params"), Col("output"), Col("saved"), Col("fwd"), Col("bwd"), Col("fwd FLOPs", 2),
            Col("fwd tmp", 3), Col("bwd tmp", 4)]
    rows = [["" if r.role != "chain" else str(r.index), escape(r.name), escape(r.type),
             format_bytes(r.param_bytes), format_bytes(r.output_bytes), format_bytes(r.saved_bytes),
             format_ms(r.fwd_ms), format_ms(r.bwd_ms), format_flops(r.fwd_flops),
             format_bytes(r.fwd_tmp_bytes), format_bytes(r.bwd_tmp_bytes)] for r in prof.layers]
    print_table(out, cols, rows, wide, title=escape(f"ckplan profile: {prof.model} | {prof.device} | {batch(prof)} | "
                                                     f"{precision(prof)} | {prof.optimizer}{est}"))
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
        unsaved = sum(si.bytes for si in prof.side_inputs if not si.saved_by)  # saved: in the activations
        if unsaved:
            totals.insert(-1, ("side inputs (masks, ids; kept by checkpoints)", unsaved))
        side_grads = sum(si.grad_bytes for si in prof.side_inputs)
        if side_grads:  # held from the last reader's backward to the maker's, recomputes between
            totals.insert(-1, ("side-input gradients (held through recomputes)", side_grads))
    if tt.measured_peak_bytes is not None:
        what = "forward+backward" if prof.accum == 1 else "a later micro-batch's fwd+bwd"
        chain = chain_from_profile(prof)
        fwd_bwd = forward_backward_peak(chain, plan_none(chain.n_layers))
        if fwd_bwd != tt.predicted_peak_bytes:  # the optimizer step peaks higher: compare like with like
            totals.append((f"predicted peak, {what}", fwd_bwd))
        held = "optimizer state included" if prof.accum == 1 else "gradients held"
        totals.append((f"measured peak, {what} ({held})", tt.measured_peak_bytes))
    for k, v in totals:
        s.add_row(k, format_bytes(v))
    if tt.optimizer_ms is not None:
        s.add_row("optimizer step time (priced by the device model)" if prof.times_estimated
                  else "optimizer step time (timed on stand-ins)", format_ms(tt.optimizer_ms))
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
    out = console or consoles.stdout
    names = prof.option_names
    kept = _kept_options(prof)
    cols = [Col("#"), Col("layer", 2, left=True, fold=True), Col("store"), Col("full", 1)]
    cols += [Col(n) for n in names]
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
    limit = width_limit(out, wide)
    title = "selective options: kept for backward +forward redone"
    if limit is None or _width(cols, rows, range(len(cols))) <= limit:
        print_table(out, cols, rows, wide, title=title)
    else:  # too wide for the terminal: bytes over the time in each cell, then names over two
        rows = table("\n")  # lines, or else as many option columns per table as fit beside the layer's
        split = [*cols[:4], *(Col(n.replace("-", "-\n", 1)) for n in names)]
        if _width(cols, rows, range(len(cols))) > limit >= _width(split, rows, range(len(cols))):
            cols = split
        first, group = [0, 1, 2, 3], []
        for i in range(4, len(cols)):
            if group and _width(cols, rows, first + group + [i]) > limit:
                print_table(out, [cols[j] for j in first + group], [[r[j] for j in first + group] for r in rows],
                            wide, title=title)
                group, title = [], None
            group.append(i)
        print_table(out, [cols[j] for j in first + group], [[r[j] for j in first + group] for r in rows],
                    wide, title=title)
    if kept is not None and any(o.name not in kept[r.index] for r in prof.chain_layers for o in r.options):
        out.print("*: beaten by store, full or another option on both memory and time (or a near tie "
                  f"with an earlier one: bytes within {TIE_BYTES:.0%}, time within {TIE_FWD:.0%} of the "
                  "forward); the planner leaves it out", soft_wrap=True)


def _width(cols: list[Col], rows: list[list[str]], shown) -> int:
    """A table's width with columns ``shown`` at their widest line (3 per column for borders and
    padding, 1 more)."""
    return 1 + sum(max(cell_len(line) for text in (cols[i].header, *(r[i] for r in rows))
                       for line in text.split("\n")) + 3 for i in shown)


def _kept_options(prof: Profile) -> list[set[str]] | None:
    """The options the planner keeps for each chain layer (None when the profile cannot be planned)."""
    try:
        chain = chain_from_profile(prof)
    except (ValueError, KeyError):
        return None
    return [{o.name for o in ly.options} for ly in chain.layers]
