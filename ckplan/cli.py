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
    from rich.markup import escape

    from .render import stderr
    stderr.print(f"[bold red]Error:[/] {escape(message)}", highlight=False, soft_wrap=True)
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


STRATEGY_NAMES = ("none", "every-k", "sqrtn", "chen", "dp")


@app.command()
@guarded
def plan(
    spec: Optional[Path] = typer.Argument(None, help="Model spec (YAML); or give --profile instead."),
    budget: Optional[str] = typer.Option(None, "--budget", help="Memory budget: 12GB (10^9), 12GiB (2^30), "
                                         "500MB, plain bytes, or 40% of the no-checkpoint peak."),
    strategy: str = typer.Option("dp", "--strategy", "-s", help="dp, chen, sqrtn, every-k, none or all."),
    k: int = typer.Option(2, "--k", min=1, help="Segment length for every-k."),
    profile_file: Optional[Path] = typer.Option(None, "--profile", help="A saved `ckplan profile -f json` "
                                                "result, instead of profiling SPEC again."),
    sweep: bool = typer.Option(False, "--sweep", help="Every strategy's memory/overhead frontier: CSV and "
                               "PNG under --out-dir."),
    points: int = typer.Option(20, "--points", min=2, help="Budgets in the dp frontier of --sweep."),
    out_dir: Path = typer.Option(Path("reports"), "--out-dir", help="Where --sweep writes its files."),
    device: str = DEVICE_OPT,
    fmt: Fmt = FORMAT_OPT,
    output: Optional[Path] = typer.Option(None, "--output", "-o", help="Write the plan JSON here "
                                          "(for `ckplan bench --plan` and `ckplan.apply_plan`)."),
    batch_size: Optional[int] = BATCH_OPT,
    seq_len: Optional[int] = SEQ_OPT,
    precision: Optional[str] = PREC_OPT,
    optimizer: Optional[str] = OPTIM_OPT,
    accum: Optional[int] = ACCUM_OPT,
    debug: bool = DEBUG_OPT,
):
    """Pick checkpoint boundaries under a memory budget (optimal dp, or a baseline), or sweep budgets."""
    from . import api, render, report
    if strategy not in (*STRATEGY_NAMES, "all"):
        raise UsageError(f"--strategy {strategy!r} is not one of {', '.join(STRATEGY_NAMES)}, all")
    s = None
    if spec is not None:
        s = api.load(spec, batch_size=batch_size, seq_len=seq_len, precision=precision,
                     optimizer=optimizer, accum=accum)
    elif profile_file is None:
        raise UsageError("plan needs a SPEC or --profile saved.json",
                         tip="e.g. ckplan plan configs/gpt2-small.yaml --budget 4GB")
    if sweep:
        prof, pts = api.sweep(s, profile_path=profile_file, device=device, points=points)
        files = report.write_sweep(out_dir, prof.model, pts)
        doc = report.envelope("plan-sweep", {"model": prof.model, "device": prof.device,
                                             "files": [str(f) for f in files],
                                             "points": [p.to_dict() for p in pts]})
        render.info("wrote " + ", ".join(str(f) for f in files))
        _emit(fmt, doc, report.sweep_frame(pts), lambda: render.sweep_table(pts))
        return
    rep = api.plan(s, profile_path=profile_file, budget=budget, strategy=strategy, k=k, device=device)
    if rep.budget_bytes is not None:
        from .units import format_bytes
        render.info(f"budget {budget or ''} = {rep.budget_bytes} bytes = {format_bytes(rep.budget_bytes)} "
                    f"({rep.budget_source})")
    else:
        render.info(f"budget: {rep.budget_source}")
    doc = rep.to_doc()
    if output is not None:
        _write_out(output, doc)
        render.info(f"wrote {output}")
    import pandas as pd
    _emit(fmt, doc, pd.DataFrame(rep.summary_rows()), lambda: render.plan_tables(rep))


@app.command()
@guarded
def bench(
    spec: Path = SPEC_ARG,
    compare: str = typer.Option("none,sqrtn,every-k,chen,dp", "--compare", "-c",
                                help="Comma-separated strategies to run."),
    plan_file: Optional[Path] = typer.Option(None, "--plan", help="Also run this plan.json."),
    budget: Optional[str] = typer.Option(None, "--budget", help="Budget for chen and dp (12GB, 12GiB, 40%); "
                                         "default: halfway between the smallest feasible and the no-checkpoint peak."),
    k: int = typer.Option(2, "--k", min=1, help="Segment length for every-k."),
    steps: int = typer.Option(5, "--steps", min=1, help="Timed steps per strategy."),
    warmup: int = typer.Option(1, "--warmup", min=0, help="Warm-up steps per strategy."),
    memory_limit: Optional[str] = typer.Option(None, "--memory-limit", help="CPU only: treat a step whose "
                                               "live tensors pass this size as out of memory."),
    out_dir: Path = typer.Option(Path("reports"), "--out-dir", help="Where CSV, JSON and PNG go."),
    device: str = DEVICE_OPT,
    fmt: Fmt = FORMAT_OPT,
    batch_size: Optional[int] = BATCH_OPT,
    seq_len: Optional[int] = SEQ_OPT,
    precision: Optional[str] = PREC_OPT,
    optimizer: Optional[str] = OPTIM_OPT,
    accum: Optional[int] = ACCUM_OPT,
    debug: bool = DEBUG_OPT,
):
    """Run measured training steps per strategy: real peak memory and slowdown beside the predictions."""
    from . import api, render, report
    strategies = [x.strip() for x in compare.split(",") if x.strip()]
    bad = [x for x in strategies if x not in STRATEGY_NAMES]
    if bad or (not strategies and plan_file is None):
        raise UsageError(f"--compare {compare!r}: unknown strategy {bad[0] if bad else '(none given)'}",
                         tip=f"use a comma-separated list of {', '.join(STRATEGY_NAMES)}")
    report.check_output_dir(out_dir)  # before the run: a finished run's results are never lost
    s = api.load(spec, batch_size=batch_size, seq_len=seq_len, precision=precision,
                 optimizer=optimizer, accum=accum)
    if s.name:
        report.check_output_dir(out_dir, names=report.bench_filenames(s.name, api.resolve_device(device).type))
    n_plans = len(strategies) + (plan_file is not None)
    with render.progress_bar(n_plans * (3 + max(warmup, 1) + steps) + 1, "profiling") as bar:
        res = api.bench(s, strategies=strategies, budget=budget, k=k, steps=steps, warmup=warmup,
                        device=device, plan_path=plan_file, memory_limit=memory_limit, progress=bar)
    # The results first, then the files: a failed write must not take the table with it.
    _emit(fmt, report.bench_doc(res), report.bench_frame(res), lambda: render.bench_table(res))
    write_failed = 0
    try:
        files = report.write_bench(out_dir, res)
        render.info("wrote " + ", ".join(str(f) for f in files))
    except report.ReportsInterrupted as e:
        render.error(str(e))
        raise typer.Exit(130) from None
    except (CkplanError, OSError) as e:
        write_failed = getattr(e, "exit_code", 1)
        why = str(e) if isinstance(e, CkplanError) else f"{e.strerror} ({e.filename or out_dir})"
        render.error(f"the results above were not written to {out_dir}: {why}")
    if res.failed_rows:
        from .errors import WrongResultError
        bad = "; ".join(f"{r.strategy} ({r.status})" for r in res.failed_rows)
        raise WrongResultError(f"{len(res.failed_rows)} plan(s) gave wrong results: {bad}",
                               tip="do not train with them; the table shows why. A layer whose forward "
                                   "changes between calls (state, counters, RNG outside torch) cannot be "
                                   "recomputed: make it deterministic or leave it out of the chain")
    if write_failed:
        raise typer.Exit(write_failed)


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
