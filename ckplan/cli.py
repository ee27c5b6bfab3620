"""ckplan's command line: each command parses options, calls one api function, renders.

Errors become one ``Error: ...`` line on stderr and the exit code of their class (ckplan.errors).
"""
from __future__ import annotations

import functools
import sys
from enum import Enum
from pathlib import Path
from typing import Optional

import typer

from .errors import CkplanError, UsageError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Profile, plan and benchmark activation checkpointing for PyTorch models.")


class Fmt(str, Enum):
    table = "table"
    json = "json"
    csv = "csv"


def _fail(message: str, code: int) -> None:
    from .render import stderr
    stderr.print(f"[bold red]Error:[/] {message}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def guarded(fn):
    """Run a command; map ckplan errors to exit codes and keep tracebacks behind --debug."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        debug = kwargs.get("debug", False)
        try:
            return fn(*args, **kwargs)
        except CkplanError as e:
            if debug:
                raise
            _fail(str(e), e.exit_code)
        except KeyboardInterrupt:
            _fail("interrupted; no partial report was written", 130)
        except typer.Exit:
            raise
        except Exception as e:  # a bug in ckplan or the model: one line, traceback with --debug
            if debug:
                raise
            _fail(f"{type(e).__name__}: {e} (run with --debug for the traceback)", 1)
    return wrapper


def _write_out(path: Path, doc: dict, frame=None) -> None:
    from .report import to_json, write_csv, write_text
    if path.suffix.lower() == ".csv":
        if frame is None:
            raise UsageError(f"-o {path}: this command writes JSON, not CSV", tip="use a .json file name")
        write_csv(path, frame)
    else:
        write_text(path, to_json(doc))


SPEC_ARG = typer.Argument(..., help="Model spec (YAML), e.g. configs/gpt2-small.yaml.")
DEVICE_OPT = typer.Option("auto", "--device", help="auto, cpu, cuda or meta (fake tensors: nothing allocated).")
FORMAT_OPT = typer.Option(Fmt.table, "--format", "-f", help="What goes to stdout: table, json or csv.")
OUT_OPT = typer.Option(None, "--output", "-o", help="Also write the result to FILE (.json or .csv).")
BATCH_OPT = typer.Option(None, "--batch-size", "-b", min=1, help="Override input.batch_size.")
SEQ_OPT = typer.Option(None, "--seq-len", min=1, help="Override the first input dimension (sequence length).")
PREC_OPT = typer.Option(None, "--precision", help="Override train.precision: fp32, bf16 or fp16.")
OPTIM_OPT = typer.Option(None, "--optimizer", help="Override train.optimizer: adamw, sgd-momentum or sgd.")
ACCUM_OPT = typer.Option(None, "--accum", min=1, help="Override train.accum (gradient-accumulation steps).")
DEBUG_OPT = typer.Option(False, "--debug", help="Show tracebacks.")


@app.command()
@guarded
def profile(
    spec: Path = SPEC_ARG,
    device: str = DEVICE_OPT,
    fmt: Fmt = FORMAT_OPT,
    output: Optional[Path] = OUT_OPT,
    batch_size: Optional[int] = BATCH_OPT,
    seq_len: Optional[int] = SEQ_OPT,
    precision: Optional[str] = PREC_OPT,
    optimizer: Optional[str] = OPTIM_OPT,
    accum: Optional[int] = ACCUM_OPT,
    repeats: int = typer.Option(3, "--repeats", min=1, help="Timed repeats (the median is reported)."),
    debug: bool = DEBUG_OPT,
):
    """Per-layer parameter, output and saved-for-backward bytes, times, FLOPs and the predicted peak."""
    from . import api, render, report
    s = api.load(spec, batch_size=batch_size, seq_len=seq_len, precision=precision,
                 optimizer=optimizer, accum=accum)
    prof = api.profile(s, device=device, repeats=repeats)
    doc = report.profile_doc(prof)
    if output is not None:
        _write_out(output, doc, report.profile_frame(prof))
        render.info(f"wrote {output}")
    _emit(fmt, doc, report.profile_frame(prof), lambda: render.profile_table(prof))


def _emit(fmt: Fmt, doc: dict, frame, table) -> None:
    from .report import to_json
    if fmt == Fmt.json:
        sys.stdout.write(to_json(doc))
    elif fmt == Fmt.csv:
        if frame is None:
            raise UsageError("--format csv is not available for this command", tip="use --format json")
        sys.stdout.write(frame.to_csv(index=False))
    else:
        table()


def main() -> None:
    app()


if __name__ == "__main__":
    main()
