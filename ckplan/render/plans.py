"""``ckplan plan``: the strategies, the chosen plan layer by layer, ``--export``, ``--sweep`` and
``--world-size``."""
from __future__ import annotations

from rich.console import Console

from ..planner.plan import OFFLOAD, STORE
from ..planner.plan_items import is_offloaded, kept_option
from ..units import format_bytes, format_ms
from . import consoles
from .consoles import clean, escape
from .tables import Col, batch, pct, precision, print_table


def plan_tables(rep, *, wide: bool = False, console: Console | None = None) -> None:
    out = console or consoles.stdout
    prof = rep.profile
    budget = "none" if rep.budget_bytes is None else f"{format_bytes(rep.budget_bytes)} ({rep.budget_bytes} bytes)"
    ranks = f" per rank of {rep.world_size} ({rep.parallel})" if rep.world_size > 1 else ""
    out.print(escape(f"ckplan plan: {prof.model}{ranks} | {len(prof.chain_layers)} layers in {prof.chain} | "
                     f"{batch(prof, per_rank=bool(ranks))} | {precision(prof)} | {prof.optimizer} | "
                     f"device {prof.device}"), soft_wrap=True)
    out.print(escape(f"budget: {budget} ({rep.budget_source}); no checkpointing peaks at "
                     f"{format_bytes(rep.none_peak_bytes)}"), soft_wrap=True)
    cols = [Col("strategy", left=True), Col("predicted peak"), Col("saved vs none", 1), Col("recompute", 2),
            Col("overhead"), Col("fits"), Col("ckpts"), Col("peak reached at", 3, left=True, fold=True)]
    rows = []
    for row in rep.summary_rows():
        fits = "-" if row["fits"] is None else ("yes" if row["fits"] else "[red]no[/]")
        rows.append([row["strategy"], format_bytes(row["predicted_peak_bytes"]),
                     f"{format_bytes(row['saved_bytes'])} ({pct(row['saved_fraction'])})",
                     format_ms(row["predicted_recompute_ms"]) + (f" + {format_ms(row['predicted_transfer_ms'])} copies"
                                                                 if row["predicted_transfer_ms"] else ""),
                     pct(row["predicted_overhead"]), fits,
                     str(row["n_checkpoints"]), escape(str(row["peak_at"]))])
    print_table(out, cols, rows, wide, title="strategies" if len(rep.results) > 1 else None)
    c = rep.chosen
    runs: list[list] = []  # consecutive layers with the same decision share a row
    for d, option in zip(c.plan.per_layer(), c.plan.options()):
        first = ("recomputed" if not d.stored else "offloaded" if option == OFFLOAD else
                 f"offloaded ({kept_option(option)})" if is_offloaded(option) else
                 "stored" if option == STORE else f"stored ({option})")
        key = (first, d.depth, d.forwards)
        if runs and runs[-1][0] == key:
            runs[-1][2] = d.layer
        else:
            runs.append([key, d.layer, d.layer])
    released = c.plan.releases()  # offloaded layers: after whose forward their device bytes go
    for run in runs:
        if run[0][0].startswith("offloaded"):
            lo, hi = released[run[1]], released[run[2]]
            run[0] = (f"{run[0][0]}, freed after F({lo})" + (f"..F({hi})" if hi != lo else ""), *run[0][1:])
    names = [r.name for r in prof.chain_layers]
    cols = [Col("layers"), Col("names", 1, left=True, fold=True), Col("first forward", left=True),
            Col("checkpoint depth"), Col("forward runs")]
    rows = [[str(a) if a == b else f"{a}-{b}", escape(names[a] if a == b else f"{names[a]} .. {names[b]}"),
             first, str(depth), str(fwd)]
            for (first, depth, fwd), a, b in runs]
    print_table(out, cols, rows, wide, title=f"plan ({c.strategy}), layer by layer")
    out.print(escape(f"plan: {c.plan.describe(runs=True)}"), soft_wrap=True)
    ranges = ", ".join(f"[{r.start}, {r.stop})" + (f" depth {r.depth}" if r.depth > 1 else "")
                       for r in c.plan.recomputed_ranges()) or "none"
    out.print(escape(f"checkpoint boundaries after layers: {list(c.plan.boundaries()) or 'none'}; "
                     f"recomputed ranges: {ranges}"), soft_wrap=True)
    for note in (*getattr(rep, "notes", ()), *c.notes):
        out.print(escape(f"note: {note}"), soft_wrap=True)


def export_text(exported, closest_peak_bytes: int, planned_peak_bytes: int, *, budget_bytes: int | None = None,
                console: Console | None = None) -> None:
    """The framework snippet of ``plan --export``, with what it applies when it is not the plan, and
    whether that fits the budget."""
    out = console or consoles.stdout
    verdict = ("exact: applies this plan" if exported.exact else
               f"not exact: applies {exported.closest_plan.describe()}, predicted peak "
               f"{format_bytes(closest_peak_bytes)} (the plan: {format_bytes(planned_peak_bytes)})")
    if budget_bytes is not None and closest_peak_bytes > budget_bytes:
        verdict += f", above the budget {format_bytes(budget_bytes)}: it does not fit"
    out.print(escape(f"--export {exported.target}: {verdict}"), soft_wrap=True)
    if exported.message:
        out.print(escape(exported.message), soft_wrap=True)
    out.print(clean(exported.text), markup=False, highlight=False, soft_wrap=True)


def sweep_table(points, *, wide: bool = False, console: Console | None = None) -> None:
    cols = [Col("strategy", left=True), Col("param"), Col("predicted peak"), Col("recompute", 1),
            Col("overhead"), Col("ckpts", 2)]
    rows = []
    for pt in points:
        param = (f"budget {format_bytes(pt.budget_bytes)}" if pt.budget_bytes is not None else
                 f"k={pt.k}" if pt.k is not None else
                 f"B={format_bytes(pt.threshold_bytes)}" if pt.threshold_bytes is not None else "")
        rows.append([pt.strategy, param, format_bytes(pt.peak_bytes), format_ms(pt.recompute_ms),
                     pct(pt.overhead), str(pt.n_checkpoints)])
    print_table(console or consoles.stdout, cols, rows, wide, title="memory vs recompute frontier")


def world_size_table(prof, rows, *, wide: bool = False, console: Console | None = None) -> None:
    """``plan --world-size 8,16,...``: what one rank needs at each world size."""
    out = console or consoles.stdout
    kind = rows[0].kind if rows else ""
    out.print(escape(f"ckplan plan: {prof.model} per rank under {kind} | {batch(prof, per_rank=True)} | "
                     f"{precision(prof)} | {prof.optimizer} | device {prof.device}"), soft_wrap=True)
    cols = [Col("ranks"), Col("fixed / rank", 2), Col("none peak"), Col("plan peak"), Col("lowest peak", 1),
            Col("fits"), Col("overhead"), Col("step", 4), Col("comm", 5), Col("plan", left=True, fold=True)]
    body = []
    for r in rows:
        fits = "-" if r.fits is None else ("yes" if r.fits else "[red]no[/]")
        body.append([str(r.world_size), format_bytes(r.persistent_bytes), format_bytes(r.none_peak_bytes),
                     format_bytes(r.plan_peak_bytes), format_bytes(r.min_peak_bytes), fits, pct(r.overhead),
                     format_ms(r.step_ms) if r.step_ms is not None else "-",
                     format_ms(r.comm_ms) if r.comm_ms is not None else "-",
                     escape(r.plan) if r.plan else "-"])
    print_table(out, cols, body, wide, title=f"{rows[0].strategy if rows else ''} per rank")
    # why a world size has no plan, under the table (in a cell it would widen the table to the
    # message): the world sizes, and the message of the largest (the nearest to fitting)
    unplanned = [r for r in rows if not r.plan and r.message]
    if unplanned:
        sizes = ", ".join(str(r.world_size) for r in unplanned)
        last = unplanned[-1]
        out.print(escape(f"no plan at {sizes} ranks" + (f"; at {last.world_size}" if len(unplanned) > 1 else "")
                         + f": {last.message}"), soft_wrap=True)
