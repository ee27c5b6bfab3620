"""Tables that fit the terminal: essential columns always, the others by rank as the width allows
(see :mod:`ckplan.render`)."""
from __future__ import annotations

import os
from dataclasses import dataclass

from rich.console import Console
from rich.table import Table
from rich.text import Text

from ..units import format_bytes
from . import consoles


@dataclass(frozen=True)
class Col:
    header: str
    rank: int = 0  # 0: essential, always shown; then the lower the rank, the sooner it is added
    left: bool = False  # text is left-aligned, numbers right-aligned
    fold: bool = False  # long names may break over lines; other values are never cut


_FOLDED = 40


def width_limit(console: Console, wide: bool) -> int | None:
    """The width a table must fit, or None for every column at full width."""
    if wide:
        return None
    if console is not consoles.stdout:  # a console made by the caller (tests, embedding) knows its width
        return console.width
    cols = os.environ.get("COLUMNS", "")
    if cols.isdigit() and int(cols) > 0:
        return int(cols)
    return console.width if console.is_terminal else None


def cell_len(text: str) -> int:
    """Width of a cell: its longest line."""
    return max(Text.from_markup(line).cell_len for line in text.split("\n"))


def print_table(console: Console, cols: list[Col], rows: list[list[str]], wide: bool, **table_kw) -> None:
    """Build and print a table with the columns that fit (see the module docstring)."""
    limit = width_limit(console, wide)
    full = [max([cell_len(c.header)] + [cell_len(r[i]) for r in rows]) for i, c in enumerate(cols)]
    # The narrowest a column may get without cutting a value: headers may wrap at spaces, values not.
    least = [max([len(w) for w in c.header.split()] + ([] if c.fold else [cell_len(r[i]) for r in rows]))
             for i, c in enumerate(cols)]
    keep = {i for i, c in enumerate(cols) if c.rank == 0}
    if limit is None:
        keep = set(range(len(cols)))
    else:
        # borders and padding: 3 per column, 1 more; an essential column that folds (a plan, a
        # name) counts at most _FOLDED wide here, so that it does not push the others out
        used = 1 + sum(min(full[i], _FOLDED) if cols[i].fold else full[i] for i in keep) + 3 * len(keep)
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


def batch(prof, per_rank: bool = False) -> str:
    """A profile's batch for a header, with its gradient-accumulation micro-batches when there are several."""
    accum = getattr(prof, "accum", 1)
    return (f"batch {prof.batch_size}{' per rank' if per_rank else ''}"
            + (f" | accum {accum}" if accum > 1 else ""))


def precision(prof) -> str:
    """A profile's precision for a header: autocast's, or FSDP2's policy parameter dtype."""
    dtype = getattr(prof, "param_dtype", None)
    if not dtype:
        return prof.precision
    reduce = getattr(prof, "reduce_dtype", None)
    return f"{dtype} params, {reduce} reduce (FSDP2 policy)" if reduce == dtype else f"{dtype} params (FSDP2 policy)"


def pct(x):
    return "-" if x is None else f"{x * 100:.1f}%"


def peak_diff(predicted: int | None, measured: int | None) -> str:
    """Measured minus predicted peak: ``0 B`` when equal; signed bytes while under 0.1% of the
    prediction, so that a few bytes' difference shows; a signed share above that (``+`` is a
    measurement above its prediction)."""
    if predicted is None or measured is None:
        return "-"
    d = measured - predicted
    if d == 0:
        return "0 B"
    if predicted and abs(d) >= predicted / 1000:
        return f"{d / predicted:+.1%}"
    return f"{'+' if d > 0 else '-'}{format_bytes(abs(d))}"


def pair(a: int | None, b: int | None) -> str:
    return "-" if b is None else f"{format_bytes(a)} / {format_bytes(b)}"
