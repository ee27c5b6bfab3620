"""How a ckplan command ends: errors as one ``Error: ...`` line with their exit code
(:func:`guarded` for ckplan's own and any other error, :class:`OneLineErrors` for click's usage
errors), the error document ``--format json`` prints instead of the command's, SIGTERM as an
interrupt, and the fast exit once a command is done (:func:`exit_now`).
"""
from __future__ import annotations

import atexit
import contextlib
import functools
import os
import signal
import sys
import threading
from typing import NoReturn

import typer
from typer.core import TyperGroup

try:  # typer 0.2x vendors click as typer._click; older typer uses click itself
    from typer._click import exceptions as _cx
except ImportError:  # pragma: no cover
    from click import exceptions as _cx

from .. import render
from ..errors import CkplanError, Terminated, first_line
from ..options import Fmt
from ..records import SCHEMA_VERSION
from ..report import to_json
from .output import _Stdout


def error_line(message: str) -> None:
    render.stderr.print("Error:", style="bold red", end=" ", highlight=False)
    render.stderr.print(render.clean(message), markup=False, highlight=False, soft_wrap=True)


class OneLineErrors(TyperGroup):
    """Click's usage errors as one ``Error: ...`` line and a tip (exit 2), like ckplan's own errors."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        try:
            rv = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except _cx.NoArgsIsHelpError as e:
            typer.echo(e.ctx.get_help())
            sys.exit(2)
        except _cx.UsageError as e:
            where = e.ctx.command_path if e.ctx is not None else "ckplan"
            message = e.format_message().replace("Value error, ", "").rstrip(".")
            if _asks_json(sys.argv[1:] if args is None else list(args)):  # one document on stdout, as always
                sys.stdout.write(to_json(error_document("UsageError", message, f"see `{where} --help`",
                                                        e.exit_code)))
            error_line(f"{message}. Tip: see `{where} --help`")
            sys.exit(e.exit_code)
        except _cx.ClickException as e:
            error_line(e.format_message())
            sys.exit(e.exit_code)
        except typer.Abort:
            error_line("aborted")
            sys.exit(1)
        sys.exit(rv if isinstance(rv, int) else 0)


def _asks_json(args: list[str]) -> bool:
    """Whether a command line asks for ``--format json`` (read before click could parse it)."""
    for a, b in zip(args, [*args[1:], ""]):
        if (a in ("--format", "-f") and b == "json") or a in ("--format=json", "-fjson"):
            return True
    return False


def exit_now(code: object) -> NoReturn:
    """End the process once a command is done, with ``sys.exit``'s code: other threads joined,
    every exit handler run (compiler worker pools, temporary folders, finalizers) and the standard
    streams flushed, but without the interpreter freeing its modules one by one, which after torch
    and its compiler have loaded takes 1-2 s and frees nothing the operating system would not."""
    if code is None:
        code = 0
    elif not isinstance(code, int):
        sys.stderr.write(f"{code}\n")  # as sys.exit does with a message
        code = 1
    # what the interpreter does at exit first: run threading's own exit hooks (a ThreadPoolExecutor's
    # tells its idle workers to stop; TorchInductor compiles on such a pool), then join the threads
    shutdown = getattr(threading, "_shutdown", None)
    if shutdown is not None:
        shutdown()
    else:  # pragma: no cover  (every CPython ckplan supports has it)
        for thread in threading.enumerate():
            if thread is not threading.main_thread() and not thread.daemon:
                thread.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed pipe (`| head`): nothing to lose
            stream.flush()
    os._exit(code)


def fail(message: str, code: int) -> None:
    error_line(message)
    raise typer.Exit(code)

def error_document(kind: str, message: str, tip: str | None, code: int) -> dict:
    """What ``--format json`` prints on stdout when a command ends in an error before its document:
    the same schema version as every document, and the error's exit code, class, message and tip."""
    return {"schema_version": SCHEMA_VERSION,
            "error": {"exit_code": code, "kind": kind, "message": message, "tip": tip}}


def guarded(fn):
    """Run a command; map ckplan errors to exit codes and keep tracebacks behind --debug. With
    ``--format json``, an error before the command's document is a document too (stdout is never
    empty for a script that parses it); the ``Error:`` line still goes to stderr."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        debug = kwargs.get("debug", False)
        as_json = kwargs.get("fmt") == Fmt.json

        def failed(kind: str, message: str, tip: str | None, code: int, line: str) -> None:
            if as_json and not _Stdout.written:
                sys.stdout.write(to_json(error_document(kind, message, tip, code)))
            fail(line, code)

        _Stdout.written = False
        try:
            with _sigterm_raises():
                return fn(*args, **kwargs)
        except CkplanError as e:
            if debug:
                raise
            # an error raised from another (the model's own) has a traceback worth seeing; one
            # ckplan error re-raised with more context has not
            cause = e.__cause__
            while isinstance(cause, CkplanError):
                cause = cause.__cause__
            failed(type(e).__name__, e.message, e.tip, e.exit_code,
                   str(e) + (" (run with --debug for the traceback)" if cause is not None else ""))
        except KeyboardInterrupt as e:
            what = "terminated (SIGTERM)" if isinstance(e, Terminated) else "interrupted"
            failed("Interrupted", f"{what}; no partial report was written", None, interrupt_code(e),
                   f"{what}; no partial report was written")
        except typer.Exit:
            raise
        except Exception as e:  # a bug in ckplan or the model: one line, traceback with --debug
            if debug:
                raise
            line = f"{type(e).__name__}: {first_line(str(e))}"
            failed(type(e).__name__, line, "run with --debug for the traceback", 1,
                   f"{line} (run with --debug for the traceback)")
    return wrapper


def interrupt_code(e: BaseException) -> int:
    """128 + the signal that stopped the command: 143 for SIGTERM, 130 for Ctrl-C."""
    return 128 + getattr(e, "signum", 2)


@contextlib.contextmanager
def _sigterm_raises():
    """SIGTERM raises :class:`Terminated` in the main thread while a command runs (Python's default
    ends the process at once: no message, no clean-up)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def raise_terminated(signum, frame):
        raise Terminated()
    old = signal.signal(signal.SIGTERM, raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)
