"""What every ckplan command shares: errors as one ``Error: ...`` line and their exit codes
(:func:`guarded`, :class:`OneLineErrors`), the spinner, the output (:func:`emit`,
:func:`write_out`), and the options declared once (``SPEC_ARG``, ``DEVICE_OPT``, the overrides).
"""
from __future__ import annotations

import atexit
import contextlib
import functools
import inspect
import os
import signal
import sys
import threading
from pathlib import Path
from typing import NoReturn, Optional

import typer
from typer.core import TyperGroup

try:  # typer 0.2x vendors click as typer._click; older typer uses click itself
    from typer._click import exceptions as _cx
except ImportError:  # pragma: no cover
    from click import exceptions as _cx

from . import render
from .errors import CkplanError, Terminated, UsageError, first_line
from .launch import MAX_RANKS_PER_CPU
from .options import Device, Fmt, Optimizer, Precision, Strategy
from .records import SCHEMA_VERSION
from .report import to_json, write_csv, write_text


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


class _Stdout:
    """Whether the running command has written its document to stdout (:func:`emit`)."""

    written = False


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


SPEC_ARG = typer.Argument(..., metavar="SPEC", help="Model spec (YAML), e.g. configs/gpt2-small.yaml. A spec is code: "
                          "`target:` imports and calls any callable; run only specs you trust.")


META_CODE = ("; the model's code still runs on meta: a spec's `target:` is imported and called, so run only "
             "specs you trust")


DEVICE_OPT = typer.Option(Device.auto, "--device", help="auto, cpu, cuda or meta (fake tensors: no memory "
                          "allocated" + META_CODE + ").")


BENCH_DEVICE_OPT = typer.Option(Device.auto, "--device", help="auto, cpu or cuda (bench runs real training steps; "
                                "meta cannot run them).")


FORMAT_OPT = typer.Option(Fmt.table, "--format", "-f", help="What goes to stdout: table, json or csv.")


OUT_OPT = typer.Option(None, "--output", "-o", help="Also write the result to FILE (.json or .csv).")


TARGET_OPT = typer.Option(None, "--target", help="With --device meta: the device the fake-tensor profile "
                          "stands for: cpu, cuda (priced as an H100), h100, h200, a100, l4, or a device profile "
                          "from `ckplan calibrate` (its kernels, optimizer and the device model that prices "
                          "its times; default: cuda when this machine has a GPU, else cpu).")


FORCE_OPT = typer.Option(False, "--force", help="Run on cpu/cuda even when the meta-pass preflight predicts "
                         "that one step does not fit in the memory available.")


BENCH_FORCE_OPT = typer.Option(False, "--force", help="Run on cpu/cuda even when the meta-pass preflight predicts "
                               "that one step does not fit in the memory available; with --nproc, also run "
                               f"gloo ranks beyond a core each (up to {MAX_RANKS_PER_CPU} per core) or the "
                               "ranks' memory estimate.")


COMPILE_OPT = typer.Option(False, "--compile", help="Measure (and, in bench, run) each chain layer compiled "
                           "with torch.compile, the plan applied around the compiled layers (selective "
                           "options compiled in, plus mincut-80, mincut-50 and mincut-20: torch.compile's min-cut "
                           "partitioner at that activation memory budget, per layer).")


COMPILE_SCOPE_OPT = typer.Option("layers", "--compile-scope", help="With --compile: layers (each chain layer "
                                  "compiled, the plan around them) or model (implies --compile: the whole model "
                                  "compiled, every chain layer a checkpoint region; dp then plans one region per "
                                  "layer: stored, a selective option, or recomputed whole; the whole model is "
                                  "compiled and measured once per choice first).")


OPTIONS_OPT = typer.Option(True, "--options/--no-options", help="Also measure each chain layer's selective "
                           "recompute options (sac-compute, sac-linear, sac-attn; with --compile also mincut-80, "
                           "mincut-50, mincut-20): one more measured step "
                           "each; --no-options skips them.")


PARALLEL_OPT = typer.Option(None, "--parallel", help="With --world-size / --nproc: fsdp (FSDP2, every chain "
                             "layer one unit) or ddp (default: the spec's parallel.kind, else fsdp).")


WIDE_OPT = typer.Option(False, "--wide", help="Every column of the tables, however wide the terminal.")


DEBUG_OPT = typer.Option(False, "--debug", help="Show tracebacks.")


# The overrides every command that builds a model takes, declared once: `with_overrides` adds them
# to a command's options and hands them over as **overrides (names as in api.load).
BATCH_OPT = typer.Option(None, "--batch-size", "-b", min=1, help="Override input.batch_size.")


SEQ_OPT = typer.Option(None, "--seq-len", min=1, help="Override the first input dimension (sequence length).")


PREC_OPT = typer.Option(None, "--precision", help="Override train.precision.")


OPTIM_OPT = typer.Option(None, "--optimizer", help="Override train.optimizer.")


ACCUM_OPT = typer.Option(None, "--accum", min=1, help="Override train.accum (gradient-accumulation steps).")


OVERRIDES = (("batch_size", Optional[int], BATCH_OPT), ("seq_len", Optional[int], SEQ_OPT),
             ("precision", Optional[Precision], PREC_OPT), ("optimizer", Optional[Optimizer], OPTIM_OPT),
             ("accum", Optional[int], ACCUM_OPT))


STRATEGY_NAMES = Strategy.names()


def with_overrides(fn):
    """Give a command ``def cmd(..., **overrides)`` the options --batch-size, --seq-len, --precision,
    --optimizer and --accum (typer reads ``__signature__``)."""
    sig = inspect.signature(fn)
    params = [p for p in sig.parameters.values() if p.kind is not p.VAR_KEYWORD]
    params += [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=opt, annotation=ann)
               for name, ann, opt in OVERRIDES]
    fn.__signature__ = sig.replace(parameters=params)
    return fn


def given(overrides: dict) -> dict:
    return {k: (v.value if hasattr(v, "value") else v) for k, v in overrides.items() if v is not None}


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

