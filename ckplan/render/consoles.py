"""The consoles (stdout for tables, stderr for messages), text made safe for the terminal, and the
progress bar."""
from __future__ import annotations

import sys
import unicodedata

from rich.console import Console
from rich.markup import escape as _markup_escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

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


def info(msg: str) -> None:
    """One progress line on stderr, never broken (a log keeps it whole; a terminal wraps it)."""
    stderr.print(escape(msg), highlight=False, soft_wrap=True)


def error(msg: str) -> None:
    """One ``Error: ...`` line on stderr, as the CLI prints for every failure."""
    stderr.print(f"[bold red]Error:[/] {escape(msg)}", highlight=False, soft_wrap=True)


class progress_bar:
    """A rich progress bar on stderr; call the instance with a description to advance it."""

    def __init__(self, total: int, label: str):
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
