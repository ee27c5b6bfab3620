"""ckplan's command line: each command parses options, calls one api function, renders.

Errors become one ``Error: ...`` line on stderr and the exit code of their class (ckplan.errors);
typer/click usage errors (an unknown option, a missing SPEC, ``--k 0``) too, with exit code 2.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import sys
from pathlib import Path
from typing import Optional

import typer
from typer.core import TyperGroup

try:  # typer 0.2x vendors click as typer._click; older typer uses click itself
    from typer._click import exceptions as _cx
except ImportError:  # pragma: no cover
    from click import exceptions as _cx

from .errors import CkplanError, InfeasibleBudgetError, UsageError, first_line
from .launch import MAX_RANKS_PER_CPU
from .options import PEERS, Device, ExportTarget, Fmt, Optimizer, Parallel, Precision, Strategy, StrategyOrAll, Target
from .records import OVER_BUDGET

__all__ = ["Fmt", "app", "main"]


def _error_line(message: str) -> None:
    from .render import clean, stderr
    stderr.print("Error:", style="bold red", end=" ", highlight=False)
    stderr.print(clean(message), markup=False, highlight=False, soft_wrap=True)


class _OneLineErrors(TyperGroup):
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
            _error_line(f"{message}. Tip: see `{where} --help`")
            sys.exit(e.exit_code)
        except _cx.ClickException as e:
            _error_line(e.format_message())
            sys.exit(e.exit_code)
        except typer.Abort:
            _error_line("aborted")
            sys.exit(1)
        sys.exit(rv if isinstance(rv, int) else 0)


app = typer.Typer(cls=_OneLineErrors, add_completion=False, no_args_is_help=True,
                  pretty_exceptions_enable=False,
                  help="Profile, plan and benchmark activation checkpointing for PyTorch models.")


def _fail(message: str, code: int) -> None:
    _error_line(message)
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
            # an error raised from another (the model's own) has a traceback worth seeing
            _fail(str(e) + (" (run with --debug for the traceback)" if e.__cause__ is not None else ""),
                  e.exit_code)
        except KeyboardInterrupt:
            _fail("interrupted; no partial report was written", 130)
        except typer.Exit:
            raise
        except Exception as e:  # a bug in ckplan or the model: one line, traceback with --debug
            if debug:
                raise
            _fail(f"{type(e).__name__}: {first_line(str(e))} (run with --debug for the traceback)", 1)
    return wrapper


@contextlib.contextmanager
def _working(text: str):
    """A spinner on stderr while a long step runs; yields (progress, note) callbacks for the api."""
    from . import render
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
def _new_folder_removed_on_error(folder: Path):
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


def _write_out(path: Path, doc: dict, frame=None) -> None:
    from .report import to_json, write_csv, write_text
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
                          "stands for, cpu or cuda (its attention kernels and optimizer; default: cuda when "
                          "this machine has a GPU, else cpu).")
FORCE_OPT = typer.Option(False, "--force", help="Run on cpu/cuda even when the meta-pass preflight predicts "
                         "that one step does not fit in the memory available.")
BENCH_FORCE_OPT = typer.Option(False, "--force", help="Run on cpu/cuda even when the meta-pass preflight predicts "
                               "that one step does not fit in the memory available; with --nproc, also run "
                               f"gloo ranks beyond a core each (up to {MAX_RANKS_PER_CPU} per core) or the "
                               "ranks' memory estimate.")
COMPILE_OPT = typer.Option(False, "--compile", help="Measure (and, in bench, run) each chain layer compiled "
                           "with torch.compile, the plan applied around the compiled layers (selective "
                           "options compiled in, plus mincut-50 and mincut-20: torch.compile's min-cut "
                           "partitioner at that activation memory budget, per layer).")
OPTIONS_OPT = typer.Option(True, "--options/--no-options", help="Also measure each chain layer's selective "
                           "recompute options (sac-compute, sac-linear, sac-attn; with --compile also mincut-50, "
                           "mincut-20): one more measured step "
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


def _given(overrides: dict) -> dict:
    return {k: (v.value if hasattr(v, "value") else v) for k, v in overrides.items() if v is not None}


@app.command()
@guarded
@with_overrides
def profile(
    spec: Path = SPEC_ARG,
    device: Device = DEVICE_OPT,
    fmt: Fmt = FORMAT_OPT,
    output: Optional[Path] = OUT_OPT,
    repeats: int = typer.Option(3, "--repeats", min=1, help="Timed repeats (the median is reported)."),
    options: bool = OPTIONS_OPT,
    compile: bool = COMPILE_OPT,
    target: Optional[Target] = TARGET_OPT,
    force: bool = FORCE_OPT,
    wide: bool = WIDE_OPT,
    debug: bool = DEBUG_OPT,
    **overrides,
):
    """Per-layer parameter, output and saved-for-backward bytes, times, FLOPs and the predicted peak."""
    from . import api, render, report
    if output is not None:
        api.check_output_file(output, inputs={"SPEC": spec})
    s = api.load(spec, **_given(overrides))
    with _working(f"profiling {s.name}") as (progress, note):
        prof = api.profile(s, device=device, repeats=repeats, force=force, progress=progress, note=note,
                           options=options, compile=compile, meta_target=target)
    doc = report.profile_doc(prof)
    if output is not None:
        _write_out(output, doc, report.profile_frame(prof))
        render.info(f"wrote {output}")
    _emit(fmt, doc, report.profile_frame(prof), lambda: render.profile_table(prof, wide=wide))


@app.command()
@guarded
@with_overrides
def plan(
    spec: Optional[Path] = typer.Argument(None, metavar="[SPEC]", help="Model spec (YAML); or give --profile instead."),
    budget: Optional[str] = typer.Option(None, "--budget", help="Memory budget: 12GB (10^9), 12GiB (2^30), "
                                         "500MB, plain bytes, 40% of the no-checkpoint peak, or 50%act "
                                         "(the no-checkpoint peak with 50% of its activations: 100%act is "
                                         "that peak)."),
    strategy: StrategyOrAll = typer.Option(StrategyOrAll.dp, "--strategy", "-s",
                                           help="One strategy, or all to compare them."),
    k: int = typer.Option(2, "--k", min=1, help="Segment length for every-k."),
    profile_file: Optional[Path] = typer.Option(None, "--profile", help="A saved `ckplan profile -f json` "
                                                "result, instead of profiling SPEC again (no SPEC, "
                                                "overrides or --device with it)."),
    sweep: bool = typer.Option(False, "--sweep", help="Every strategy's memory/overhead frontier: CSV and "
                               "PNG under --out-dir."),
    points: int = typer.Option(20, "--points", min=2, help="Budgets in the dp frontier of --sweep (at most "
                               "10000; the DP runs once per distinct plan)."),
    out_dir: Path = typer.Option(Path("reports"), "--out-dir", help="Where --sweep writes its files."),
    device: Optional[Device] = typer.Option(None, "--device", help="auto (the default), cpu, cuda or meta "
                                            "(fake tensors: no memory allocated" + META_CODE + ")."),
    fmt: Fmt = FORMAT_OPT,
    output: Optional[Path] = typer.Option(None, "--output", "-o", help="Write the plan JSON here "
                                          "(for `ckplan bench --plan` and `ckplan.apply_plan`)."),
    world_size: Optional[str] = typer.Option(None, "--world-size", help="Plan for one rank of N ranks "
                                             "(--parallel); 8,16,32,64 prints a per-rank table."),
    parallel: Optional[Parallel] = PARALLEL_OPT,
    export: Optional[ExportTarget] = typer.Option(None, "--export", help="Also print the snippet that "
                                                  "applies the plan in hf, torchtitan, lightning or fsdp "
                                                  "(or the closest plan it can express)."),
    options: bool = OPTIONS_OPT,
    compile: bool = COMPILE_OPT,
    exact: bool = typer.Option(False, "--exact", help="dp: prove the plan optimal over every nested plan "
                               "(the exact DP: 0.1-0.3 s at 100 layers, seconds at 300) instead of the "
                               "banded DP ckplan uses from 65 to 400 layers."),
    target: Optional[Target] = TARGET_OPT,
    force: bool = FORCE_OPT,
    wide: bool = WIDE_OPT,
    debug: bool = DEBUG_OPT,
    **overrides,
):
    """Pick checkpoint boundaries under a memory budget (optimal dp, or a baseline), or sweep budgets."""
    from . import api, render, report
    if sweep:
        ignored = [name for name, given in (("--budget", budget is not None), ("--world-size", world_size is not None),
                                            ("--parallel", parallel is not None), ("--export", export is not None),
                                            ("-o", output is not None), ("--strategy", strategy != StrategyOrAll.dp),
                                            ("--k", k != 2), ("--exact", exact)) if given]
        if ignored:
            raise UsageError(f"--sweep with {', '.join(ignored)}: a sweep plans every strategy over a range of "
                             "budgets for one process and writes its frontier under --out-dir; "
                             f"{'it' if len(ignored) == 1 else 'they'} would be ignored",
                             tip="drop " + ", ".join(ignored) + ", or plan one budget without --sweep")
        api.check_output_dir(out_dir)
        with _working("sweeping") as (progress, note):
            prof, pts = api.sweep(spec, profile_path=profile_file, device=device, points=points,
                                  overrides=_given(overrides), force=force, progress=progress, note=note,
                                  options=options, compile=compile, meta_target=target)
        files = report.write_sweep(out_dir, prof.model, pts)
        render.info("wrote " + ", ".join(str(f) for f in files))
        _emit(fmt, report.sweep_doc(prof, pts, files), report.sweep_frame(pts),
              lambda: render.sweep_table(pts, wide=wide))
        return
    given_parallel = parallel
    if world_size is None and spec is not None and profile_file is None:  # the spec's own parallel:
        par = api.load(spec).parallel
        world_size, parallel = str(par.world_size), parallel or par.kind
    sizes = _world_sizes(world_size)
    parallel = str(parallel or "fsdp")
    _check_world_size_options(sizes, given_parallel, export, output)
    if output is not None:
        # plan writes JSON only: refused now, not after the run; nor may it replace its own input
        api.check_output_file(output, csv=False, inputs={"--profile": profile_file, "SPEC": spec})
    if len(sizes) > 1:
        if strategy == StrategyOrAll.all:
            raise UsageError("--strategy all with several --world-size values",
                             tip="pick one strategy for the per-rank table, or one world size")
        if exact:
            raise UsageError(f"--exact with several --world-size values ({world_size}): the per-rank "
                             "table plans with the default dp",
                             tip="give one world size to prove its plan optimal, e.g. "
                                 f"--world-size {sizes[-1]} --exact")
        with _working("planning per rank") as (progress, note):
            prof, rows = api.world_sizes(spec, world_sizes=sizes, parallel=parallel, profile_path=profile_file,
                                         budget=budget, strategy=strategy, k=k, device=device,
                                         overrides=_given(overrides), force=force, progress=progress, note=note,
                                         meta_target=target)
        doc = report.world_size_doc(prof, rows)
        if output is not None:
            _write_out(output, doc)
            render.info(f"wrote {output}")
        _emit(fmt, doc, report.records_frame(rows), lambda: render.world_size_table(prof, rows, wide=wide))
        if budget is not None and rows and all(r.plan_peak_bytes is None for r in rows):
            from .units import format_bytes
            lows = ", ".join(f"{r.world_size} ranks: {format_bytes(r.min_peak_bytes)}" for r in rows)
            raise InfeasibleBudgetError(f"--budget {budget}: no world size fits; the budget is below the smallest "
                                        f"feasible peak per rank at every world size ({lows})",
                                        tip="raise --budget to at least one of these peaks, or add larger world "
                                            "sizes (fsdp shards the fixed memory)")
        return
    try:
        with _working("planning") as (progress, note):
            rep = api.plan(spec, profile_path=profile_file, budget=budget, strategy=strategy, k=k,
                           device=device, overrides=_given(overrides), force=force, progress=progress,
                           note=note, world_size=sizes[0], parallel=parallel, options=options,
                           compile=compile, dp_mode="exact" if exact else "auto", meta_target=target)
    except InfeasibleBudgetError as err:  # how the budget was resolved, then the error
        if err.budget_source:
            render.info(_budget_line(budget, err.budget_bytes, err.budget_source))
        raise
    render.info(_budget_line(budget, rep.budget_bytes, rep.budget_source))
    doc = rep.to_doc()
    exported = None
    if export is not None:
        exported, closest_peak = api.export(rep, str(export))
        doc["export"] = {**exported.to_dict(), "closest_predicted_peak_bytes": closest_peak}
    if output is not None and rep.infeasible is None:
        _write_out(output, doc)
        render.info(f"wrote {output}")
    _emit(fmt, doc, rep.to_frame(), lambda: render.plan_tables(rep, wide=wide))
    if exported is not None and fmt == Fmt.table:
        render.export_text(exported, closest_peak, rep.chosen.score.peak_bytes)
    if rep.infeasible is not None:  # the table is shown; the budget still cannot be met
        raise InfeasibleBudgetError(rep.infeasible, tip=rep.infeasible_tip)


def _world_sizes(text: str | None) -> list[int]:
    if text is None:
        return [1]
    try:
        sizes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        sizes = []
    if not sizes or any(w < 1 for w in sizes):
        raise UsageError(f"--world-size {text!r} is not a number of ranks or a comma-separated list of them",
                         tip="e.g. --world-size 8, or --world-size 8,16,32,64 for a per-rank table")
    return sizes


def _check_world_size_options(sizes: list[int], parallel, export, output, flag: str = "--world-size") -> None:
    """Refuse, before any profile, the options that several world sizes (or one process) would ignore.
    ``flag``: the option that gave the sizes (bench's ``--nproc``)."""
    many = ",".join(map(str, sizes))
    if len(sizes) > 1 and export is not None:
        raise UsageError(f"--export {export.value} with several --world-size values ({many}): a snippet "
                         "applies one plan, and the per-rank table has one per world size",
                         tip=f"give one world size to export its plan, e.g. --world-size {sizes[-1]} "
                             f"--export {export.value}")
    if len(sizes) > 1 and output is not None:
        raise UsageError(f"-o {output} with several --world-size values ({many}): -o writes a plan file "
                         "(for `ckplan bench --plan` and `ckplan.apply_plan`), and the per-rank table is "
                         "one plan per world size",
                         tip=f"give one world size to write its plan, e.g. --world-size {sizes[-1]} -o "
                             f"{output}; for the table as JSON use --format json > table.json")
    if parallel is not None and max(sizes) == 1:
        kind = getattr(parallel, "value", parallel)
        what = "the plan is for one process" if flag == "--world-size" else "bench runs one rank"
        raise UsageError(f"--parallel {kind} needs several ranks: without {flag} N (N > 1) {what} "
                         "and --parallel would be ignored",
                         tip=f"add {flag} N (e.g. {flag} {8 if flag == '--world-size' else 2} --parallel {kind}) "
                             "or set parallel.world_size in the spec; or drop --parallel")


def _budget_line(budget, budget_bytes: int | None, source: str) -> str:
    from .units import format_bytes
    if budget_bytes is None:
        return f"budget: {source}"
    return f"budget {budget or ''} = {budget_bytes} bytes = {format_bytes(budget_bytes)} ({source})"


@app.command()
@guarded
@with_overrides
def bench(
    spec: Path = SPEC_ARG,
    compare: str = typer.Option("none,sqrtn,every-k,chen,dp", "--compare", "-c",
                                help="Comma-separated strategies to run, and peers: hf (per-layer, as "
                                "gradient_checkpointing_enable), sac-policy (PyTorch SAC), torch-compile."),
    plan_file: Optional[Path] = typer.Option(None, "--plan", help="Also run this plan.json."),
    budget: Optional[str] = typer.Option(None, "--budget", help="Budget for chen and dp (12GB, 12GiB, 40%, 50%act); "
                                         "default: halfway between the smallest feasible and the no-checkpoint peak."),
    k: int = typer.Option(2, "--k", min=1, help="Segment length for every-k."),
    steps: int = typer.Option(5, "--steps", min=1, help="Timed steps per strategy."),
    warmup: int = typer.Option(1, "--warmup", min=0, help="Warm-up steps per strategy."),
    memory_limit: Optional[str] = typer.Option(None, "--memory-limit", help="CPU only: treat a step whose "
                                               "live tensors pass this size as out of memory."),
    out_dir: Path = typer.Option(Path("reports"), "--out-dir", help="Where CSV, JSON and PNG go."),
    device: Device = BENCH_DEVICE_OPT,
    fmt: Fmt = FORMAT_OPT,
    nproc: Optional[int] = typer.Option(None, "--nproc", min=1, help="Run this many ranks (gloo on CPU: at "
                                        "most one per core; NCCL on CUDA: one per GPU) under --parallel and "
                                        "report per-rank peaks (default: the spec's parallel.world_size when > 1)."),
    parallel: Optional[Parallel] = PARALLEL_OPT,
    options: bool = OPTIONS_OPT,
    compile: bool = COMPILE_OPT,
    force: bool = BENCH_FORCE_OPT,
    wide: bool = WIDE_OPT,
    debug: bool = DEBUG_OPT,
    **overrides,
):
    """Run measured training steps per strategy: real peak memory and slowdown beside the predictions."""
    import time

    from . import api, render, report
    started = time.time()
    listed = [x.strip() for x in compare.split(",") if x.strip()]
    strategies = list(dict.fromkeys(listed))  # each strategy runs once, in the order first given
    bad = [x for x in strategies if x not in (*STRATEGY_NAMES, *PEERS)]
    if bad or (not strategies and plan_file is None):
        raise UsageError(f"--compare {compare!r}: unknown strategy {bad[0] if bad else '(none given)'}",
                         tip=f"use a comma-separated list of {', '.join(STRATEGY_NAMES)} and the peers "
                             f"{', '.join(PEERS)}")
    if len(strategies) < len(listed):
        twice = sorted({x for x in listed if listed.count(x) > 1}, key=listed.index)
        render.info(f"note: --compare lists {', '.join(twice)} more than once; each strategy runs once")
    with _new_folder_removed_on_error(out_dir):
        report.check_output_dir(out_dir)  # before the run: a finished run's results are never lost
        s = api.load(spec, **_given(overrides))
        if nproc is None and s.parallel.world_size > 1:
            nproc = s.parallel.world_size
        if nproc is None and parallel is not None:
            raise UsageError(f"--parallel {parallel.value} needs several ranks: without --nproc N bench runs one "
                             "process and --parallel would be ignored",
                             tip=f"add --nproc N (e.g. --nproc 2 --parallel {parallel.value}) or set "
                                 "parallel.world_size in the spec; or drop --parallel")
        if nproc == 1 and parallel is not None:
            _check_world_size_options([nproc], parallel, None, None, flag="--nproc")
        parallel = str(parallel or s.parallel.kind)
        if nproc is not None:
            if plan_file is not None:
                raise UsageError("--plan with --nproc",
                                 tip="the distributed bench plans per rank itself; drop --plan")
            _bench_distributed(s, nproc, parallel, strategies, budget, k, steps, warmup, device, memory_limit,
                               out_dir, fmt, wide, options, force)
            return
        if s.name:
            dev_type = api.resolve_device(device).type
            report.check_output_dir(out_dir, names=report.bench_filenames(
                s.name, f"{dev_type}-compiled" if compile else dev_type))
        # The arguments and the plan file are checked before the bar opens: an error is then the
        # only line (a bar closed at once leaves an empty line on a terminal).
        api.check_bench_args(s, k=k, steps=steps, warmup=warmup, budget=budget, memory_limit=memory_limit,
                             device=device, plan_path=plan_file)
        n_plans = len(strategies) + (plan_file is not None)
        with render.progress_bar(n_plans * (3 + max(warmup, 1) + steps) + 1, "profiling") as bar:
            res = api.bench(s, strategies=strategies, budget=budget, k=k, steps=steps, warmup=warmup,
                            device=device, plan_path=plan_file, memory_limit=memory_limit, progress=bar,
                            force=force, options=options, compile=compile, note=render.info)
    # The results first, then the files: a failed write must not take the table with it.
    _emit(fmt, report.bench_doc(res), report.bench_frame(res), lambda: render.bench_table(res, wide=wide))
    write_failed = 0
    try:
        replaced = report.replaced_note([out_dir / n for n in report.bench_filenames(res.model, res.device_tag)],
                                        since=started)
        files = report.write_bench(out_dir, res)
        render.info("wrote " + ", ".join(str(f) for f in files))
        if replaced:
            render.info(replaced)
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
        if all(r.kind == "peer" for r in res.failed_rows):
            raise WrongResultError(f"{len(res.failed_rows)} peer row(s) gave wrong results: {bad}",
                                   tip="ckplan's own rows passed the gradient check; the table says why "
                                       "each peer failed (drop it from --compare to exit 0)")
        raise WrongResultError(f"{len(res.failed_rows)} plan(s) gave wrong results: {bad}",
                               tip="do not train with them; the table shows why. A layer whose forward "
                                   "changes between calls (state, counters, RNG outside torch) cannot be "
                                   "recomputed: make it deterministic or leave it out of the chain")
    if write_failed:
        raise typer.Exit(write_failed)
    _exit_if_infeasible(res.rows, budget)


def _exit_if_infeasible(rows, budget) -> None:
    """Exit 3 (as ``plan`` does) when a strategy could not be planned at the --budget asked for,
    or was predicted to fit it and measured above it (``over-budget``); bench's table and files
    are written first. Without --budget bench picks a feasible one (and no row is over it)."""
    if budget is None:
        return
    bad = {r.strategy: r.message for r in rows if r.status == "infeasible"}
    if bad:
        first, why = next(iter(bad.items()))
        raise InfeasibleBudgetError(f"--budget {budget}: {', '.join(bad)} could not be planned (the other rows "
                                    f"ran, the files are written): {first}: {why}",
                                    tip="raise --budget to at least the smallest feasible peak, or drop --budget "
                                        "(bench then plans halfway between the smallest feasible and the "
                                        "no-checkpoint peak)")
    over = list(dict.fromkeys(r.strategy for r in rows if r.status == OVER_BUDGET))
    if over:
        raise InfeasibleBudgetError(f"--budget {budget}: {', '.join(over)} measured above the budget they were "
                                    "predicted to fit (the table shows by how much; the files are written)",
                                    tip="the prediction was short for these plans: do not rely on them at this "
                                        "budget; a lower --budget by the overshoot gives plans with that much "
                                        "headroom")


def _bench_distributed(s, nproc, parallel, strategies, budget, k, steps, warmup, device, memory_limit,
                       out_dir, fmt, wide, options, force) -> None:
    from . import api, render, report
    api.check_nproc(nproc, device, force=force)  # before the "running" line: an error is then the only line
    with _working(f"running {nproc} ranks ({parallel})") as (_progress, note):
        res = api.bench_distributed(s, nproc=nproc, parallel=parallel, strategies=strategies, budget=budget, k=k,
                                    steps=steps, warmup=warmup, device=device, memory_limit=memory_limit,
                                    note=note, options=options, force=force)
    _emit(fmt, report.dist_bench_doc(res), res.to_frame(), lambda: render.dist_bench_table(res, wide=wide))
    files = report.write_dist_bench(out_dir, res)
    render.info("wrote " + ", ".join(str(f) for f in files))
    bad = [r for r in res.rows if r.grad_ok is False]
    if bad:
        from .errors import WrongResultError
        names = dict.fromkeys(r.strategy for r in bad)
        where = {name: [str(r.rank) for r in bad if r.strategy == name] for name in names}
        raise WrongResultError("gradients differ from one process for "
                               + ", ".join(f"{name} (rank {', '.join(ranks)})" for name, ranks in where.items()),
                               tip="do not train with these plans; the table shows each rank's largest difference")
    _exit_if_infeasible(res.rows, budget)


def _emit(fmt: Fmt, doc: dict, frame, table) -> None:
    from .report import to_json
    if fmt == Fmt.json:
        sys.stdout.write(to_json(doc))
    elif fmt == Fmt.csv:
        if frame is None:
            raise UsageError("--format csv is not available for this command", tip="use --format json")
        text = frame.to_csv(index=False)
        if sys.stdout.isatty():  # the data as it is for a pipe or a file; a terminal gets no raw controls
            from .render import clean
            text = clean(text)
        sys.stdout.write(text)
    else:
        table()


def main() -> None:
    app()


if __name__ == "__main__":
    main()
