"""What a command writes: the spinner while a long step runs (:func:`working`), its result on
stdout as a table, JSON or CSV (:func:`emit`) and in the ``-o`` file (:func:`write_out`), and the
output folders it created removed again when it fails early (:func:`new_folder_removed_on_error`).
"""
from __future__ import annotations

import contextlib
import sys
from pathlib import Path

from .. import render
from ..errors import UsageError
from ..options import Fmt
from ..report import to_json, write_csv, write_text


class _Stdout:
    """Whether the running command has written its document to stdout (:func:`emit`)."""

    written = False


@contextlib.contextmanager
def working(text: str):
    """A spinner on stderr while a long step runs; yields (progress, note) callbacks for the api."""
    if not render.stderr.is_terminal:
        # Logs and pipes get no spinner: each step as a line of its own instead.
        render.info(text)
        yield render.info, render.info
        return
    with render.stderr.status(render.escape(text)) as status:
        def progress(msg: str) -> None:
            status.update(render.escape(msg))
        yield progress, render.info


@contextlib.contextmanager
def new_folder_removed_on_error(folder: Path):
    """Remove the folders this run created for ``folder`` (the output check creates them before the
    run) when the command fails while they are still empty: an early error leaves nothing behind."""
    created = []
    p = Path(folder)
    while not (p.exists() or p.is_symlink()) and p != p.parent:
        created.append(p)  # deepest first
        p = p.parent
    try:
        yield
    except BaseException:
        for d in created:
            try:
                d.rmdir()  # only an empty folder goes
            except OSError:
                break
        raise


def write_out(path: Path, doc: dict, frame=None) -> None:
    if path.suffix.lower() == ".csv":
        if frame is None:
            raise UsageError(f"-o {path}: this command writes JSON, not CSV", tip="use a .json file name")
        write_csv(path, frame)
    else:
        write_text(path, to_json(doc))

def emit(fmt: Fmt, doc: dict, frame, table) -> None:
    _Stdout.written = True
    if fmt == Fmt.json:
        sys.stdout.write(to_json(doc))
    elif fmt == Fmt.csv:
        if frame is None:
            raise UsageError("--format csv is not available for this command", tip="use --format json")
        text = frame.to_csv(index=False)
        if sys.stdout.isatty():  # the data as it is for a pipe or a file; a terminal gets no raw controls
            text = render.clean(text)
        sys.stdout.write(text)
    else:
        table()

