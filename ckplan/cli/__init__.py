"""ckplan's command line: each command parses options, calls one library function (:mod:`ckplan.api`,
:mod:`ckplan.commands`), renders.

Errors become one ``Error: ...`` line on stderr and the exit code of their class (ckplan.errors);
typer/click usage errors (an unknown option, a missing SPEC, ``--k 0``) too, with exit code 2
(:mod:`ckplan.cli.exits`). The options every command shares are declared in
:mod:`ckplan.cli.shared_options`; what a command writes goes through :mod:`ckplan.cli.output`.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

import typer

from .. import api, commands, render, report
from ..calibrate import calibrate as measure_device
from ..device_model import save_device
from ..errors import InfeasibleBudgetError, UsageError
from ..options import CompileScope, Device, DocFmt, ExportTarget, Fmt, Parallel, StrategyOrAll
from .exits import OneLineErrors, exit_now, guarded
from .output import emit, new_folder_removed_on_error, working, write_out
from .shared_options import (
    BENCH_DEVICE_OPT,
    BENCH_FORCE_OPT,
    COMPILE_OPT,
    COMPILE_SCOPE_OPT,
    DEBUG_OPT,
    DEVICE_OPT,
    FORCE_OPT,
    FORMAT_OPT,
    META_CODE,
    OPTIONS_OPT,
    OUT_OPT,
    PARALLEL_OPT,
    SPEC_ARG,
    TARGET_OPT,
    WIDE_OPT,
    given,
    with_overrides,
)

__all__ = ["Fmt", "app", "main"]

app = typer.Typer(cls=OneLineErrors, add_completion=False, no_args_is_help=True,
                  pretty_exceptions_enable=False,
                  help="Profile, plan and benchmark activation checkpointing for PyTorch models.")


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
    target: Optional[str] = TARGET_OPT,
    out_dir: Path = typer.Option(commands.SAVED, "--out-dir", help="Where the profile is saved as "
                                 "profile-NAME-DEVICE.json, which `ckplan plan` and `ckplan bench` read when "
                                 "given no SPEC."),
    force: bool = FORCE_OPT,
    wide: bool = WIDE_OPT,
    debug: bool = DEBUG_OPT,
    **overrides,
):
    """Per-layer parameter, output and saved-for-backward bytes, times, FLOPs and the predicted peak."""
    if output is not None:
        api.check_output_file(output, inputs={"SPEC": spec})
    with new_folder_removed_on_error(out_dir):
        report.check_output_dir(out_dir)  # before the run: a finished profile is never lost
        s = api.load(spec, **given(overrides))
        with working(f"profiling {s.name}") as (progress, note):
            prof = api.profile(s, device=device, repeats=repeats, force=force, progress=progress, note=note,
                               options=options, compile=compile, meta_target=target)
    doc = report.profile_doc(prof)
    emit(fmt, doc, report.profile_frame(prof), lambda: render.profile_table(prof, wide=wide))
    if output is not None:
        write_out(output, doc, report.profile_frame(prof))
        render.info(f"wrote {output}")
    saved = report.profile_path(out_dir, prof)
    if output is None or not saved.exists() or not saved.samefile(output):
        render.info(f"wrote {report.write_profile(out_dir, prof)} (`ckplan plan` and `ckplan bench` with no "
                    "SPEC read it)")


@app.command()
@guarded
@with_overrides
def plan(
    spec: Optional[Path] = typer.Argument(None, metavar="[SPEC]", help="Model spec (YAML); or give --profile; "
                                          "with neither, the newest profile `ckplan profile` saved under "
                                          "reports/."),
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
    points: int = typer.Option(20, "--points", min=2, help="Evenly spaced budgets in the dp frontier of --sweep "
                               "(at most 10000; the DP runs once per distinct plan), plus one at each baseline "
                               "point's peak; the baselines have their own grids."),
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
    compile_scope: CompileScope = COMPILE_SCOPE_OPT,
    offload: Optional[bool] = typer.Option(None, "--offload/--no-offload", help="dp may offload layers' "
                                           "saved activations to pinned host memory where the profile has a "
                                           "host link (a GPU, or meta with a GPU --target; a CPU has none). "
                                           "Default: where it is faster."),
    exact: bool = typer.Option(False, "--exact", help="dp: prove the plan optimal over every nested plan "
                               "(the exact DP: 0.1-0.3 s at 100 layers, seconds at 300) instead of the "
                               "banded DP ckplan uses from 65 to 400 layers."),
    target: Optional[str] = TARGET_OPT,
    force: bool = FORCE_OPT,
    wide: bool = WIDE_OPT,
    debug: bool = DEBUG_OPT,
    **overrides,
):
    """Pick checkpoint boundaries under a memory budget (optimal dp, or a baseline), or sweep budgets."""
    if spec is None and profile_file is None:
        changed = [f"--{k.replace('_', '-')} {v}" for k, v in given(overrides).items()] + \
                  [f"{f} {getattr(v, 'value', v)}" for f, v in (("--device", device), ("--target", target)) if v]
        profile_file, line = commands.plan_without_spec(changed)
        render.info(line)
    common = dict(profile_path=profile_file, device=device, overrides=given(overrides), force=force,
                  meta_target=target)
    if sweep:
        ignored = [name for name, on in (("--budget", budget is not None), ("--world-size", world_size is not None),
                                         ("--parallel", parallel is not None), ("--export", export is not None),
                                         ("-o", output is not None), ("--strategy", strategy != StrategyOrAll.dp),
                                         ("--k", k != 2), ("--exact", exact)) if on]
        return _plan_sweep(spec, common, out_dir, points, options, compile, ignored, fmt, wide)
    sizes, kind = commands.plan_layout(spec, profile_file, world_size, parallel, export, output)
    if len(sizes) > 1:
        return _plan_world_sizes(spec, common, sizes, world_size, kind, budget, strategy, k, exact, output, fmt,
                                 wide)
    return _plan_one(spec, common, budget=budget, strategy=strategy, k=k, world_size=sizes[0], parallel=kind,
                     options=options, compile=compile, offload=offload, exact=exact, export=export, output=output,
                     fmt=fmt, wide=wide, compile_scope=compile_scope.value)


def _plan_sweep(spec, common: dict, out_dir, points, options, compile, ignored, fmt, wide) -> None:
    commands.check_sweep(ignored, out_dir)
    with working("sweeping") as (progress, note):
        prof, pts, files = commands.plan_sweep(spec, out_dir=out_dir, points=points, progress=progress, note=note,
                                               options=options, compile=compile, **common)
    render.info("wrote " + ", ".join(str(f) for f in files))
    emit(fmt, report.sweep_doc(prof, pts, files), report.sweep_frame(pts),
         lambda: render.sweep_table(pts, wide=wide))


def _plan_world_sizes(spec, common: dict, sizes, world_size, kind, budget, strategy, k, exact, output, fmt,
                      wide) -> None:
    commands.check_world_size_table(sizes, world_size, strategy, exact)
    api.check_budget(budget)  # before the progress line: a budget that cannot parse is the only line
    with working("planning per rank") as (progress, note):
        prof, rows = api.world_sizes(spec, world_sizes=sizes, parallel=kind, budget=budget, strategy=strategy, k=k,
                                     progress=progress, note=note, **common)
    doc = report.world_size_doc(prof, rows)
    if output is not None:
        write_out(output, doc)
        render.info(f"wrote {output}")
    emit(fmt, doc, report.records_frame(rows), lambda: render.world_size_table(prof, rows, wide=wide))
    commands.check_some_world_size_fits(rows, budget)


def _plan_one(spec, common: dict, *, budget, exact, export, output, fmt, wide, **kwargs) -> None:
    api.check_budget(budget)  # before the progress line: a budget that cannot parse is the only line
    try:
        with working("planning") as (progress, note):
            rep, doc, exported, closest_peak = commands.plan_one(
                spec, export=export, budget=budget, progress=progress, note=note,
                dp_mode="exact" if exact else "auto", **kwargs, **common)
    except InfeasibleBudgetError as err:  # how the budget was resolved, then the error
        if err.budget_source:
            render.info(commands.budget_line(budget, err.budget_bytes, err.budget_source))
        raise
    render.info(commands.budget_line(budget, rep.budget_bytes, rep.budget_source))
    if output is not None and rep.infeasible is None:
        write_out(output, doc)
        render.info(f"wrote {output}")
    emit(fmt, doc, rep.to_frame(), lambda: render.plan_tables(rep, wide=wide))
    if exported is not None and fmt == Fmt.table:
        render.export_text(exported, closest_peak, rep.chosen.score.peak_bytes, budget_bytes=rep.budget_bytes)
    if rep.infeasible is not None:  # the table is shown; the budget still cannot be met
        raise InfeasibleBudgetError(rep.infeasible, tip=rep.infeasible_tip)


@app.command()
@guarded
def calibrate(
    device: Device = typer.Option(Device.auto, "--device", "-d", help="The device to measure: auto, cpu or cuda."),
    fmt: DocFmt = typer.Option(DocFmt.table, "--format", "-f", help="What goes to stdout: table or json."),
    output: Optional[Path] = typer.Option(None, "--output", "-o", help="Save the device profile (JSON) for "
                                          "`--target FILE` with --device meta."),
    quick: bool = typer.Option(False, "--quick", help="Smaller sizes and fewer repeats (seconds, rougher)."),
    debug: bool = DEBUG_OPT,
):
    """Measure this machine's device model: matmul rates, bandwidth, per-op dispatch, SAC's cost."""
    if output is not None:
        api.check_output_file(output, csv=False)
    dev = api.resolve_device(device)
    if dev.type == "meta":
        raise UsageError("calibrate measures a real device, not meta", tip="use --device cpu or cuda")
    with working(f"calibrating {dev.type}") as (progress, _):
        model = measure_device(dev, quick=quick, progress=progress)
    doc = report.envelope("calibrate", model.to_dict())
    if output is not None:
        save_device(model, output)
        render.info(f"wrote {output}")
    emit(fmt, doc, None, lambda: render.device_table(model))


@app.command()
@guarded
@with_overrides
def bench(
    spec: Optional[Path] = typer.Argument(None, metavar="[SPEC]", help="Model spec (YAML); without it, the spec "
                                          "of the newest profile that `ckplan profile` saved under reports/. "
                                          "A spec is code: `target:` imports and calls any callable; run only "
                                          "specs you trust."),
    compare: str = typer.Option("none,sqrtn,every-k,chen,dp", "--compare", "-c",
                                help="Comma-separated strategies to run, and peers: hf (per-layer, as "
                                "gradient_checkpointing_enable), sac-policy (PyTorch SAC), offload-all (saved "
                                "activations to host memory; CUDA), offload-attn (the attention blocks' only, "
                                "Megatron-style; CUDA), torch-compile."),
    plan_file: Optional[Path] = typer.Option(None, "--plan", help="Also run this plan.json."),
    budget: Optional[str] = typer.Option(None, "--budget", help="Budget for chen and dp (12GB, 12GiB, 40%, 50%act); "
                                         "default: halfway between the smallest feasible and the no-checkpoint peak."),
    k: int = typer.Option(2, "--k", min=1, help="Segment length for every-k."),
    steps: int = typer.Option(5, "--steps", min=1, help="Timed steps per strategy."),
    warmup: int = typer.Option(1, "--warmup", min=0, help="Warm-up steps per strategy (at least one runs: the "
                               "optimizer makes its state then)."),
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
    compile_scope: CompileScope = COMPILE_SCOPE_OPT,
    force: bool = BENCH_FORCE_OPT,
    wide: bool = WIDE_OPT,
    debug: bool = DEBUG_OPT,
    **overrides,
):
    """Run measured training steps per strategy: real peak memory and slowdown beside the predictions."""
    started = time.time()
    strategies, twice = commands.bench_strategies(compare, plan_file)
    if twice:
        render.info(f"note: --compare lists {', '.join(twice)} more than once; each strategy runs once")
    with new_folder_removed_on_error(out_dir):
        report.check_output_dir(out_dir)  # before the run: a finished run's results are never lost
        if spec is None:
            saved, line = commands.bench_without_spec()
            render.info(line)
        s = api.load(saved if spec is None else spec, **given(overrides))
        nproc, kind = commands.bench_ranks(s, nproc, parallel, plan_file)
        if nproc is not None:
            return _bench_distributed(s, nproc, kind, strategies, budget, k, steps, warmup, device, memory_limit,
                                      out_dir, fmt, wide, options, force)
        commands.check_bench_out_dir(s, out_dir, device, compile, compile_scope)
        # The arguments and the plan file are checked before the bar opens: an error is then the
        # only line (a bar closed at once leaves an empty line on a terminal).
        api.check_bench_args(s, k=k, steps=steps, warmup=warmup, budget=budget, memory_limit=memory_limit,
                             device=device, plan_path=plan_file)
        total = commands.bench_progress_total(len(strategies) + (plan_file is not None), warmup, steps, compile)
        with render.progress_bar(total, "profiling") as bar:
            res = api.bench(s, strategies=strategies, budget=budget, k=k, steps=steps, warmup=warmup,
                            device=device, plan_path=plan_file, memory_limit=memory_limit, progress=bar,
                            force=force, options=options, compile=compile, note=render.info,
                            compile_scope=compile_scope.value)
    # The results first, then the files: a failed write must not take the table with it.
    emit(fmt, report.bench_doc(res), report.bench_frame(res), lambda: render.bench_table(res, wide=wide))
    written = commands.write_bench_files(out_dir, res, started)
    if written.error is not None:
        render.error(written.error)
    else:
        render.info("wrote " + ", ".join(str(f) for f in written.files))
        if written.replaced:
            render.info(written.replaced)
    if written.interrupted:
        raise typer.Exit(written.exit_code)
    commands.check_bench_results(res)
    if written.exit_code:
        raise typer.Exit(written.exit_code)
    commands.exit_if_infeasible(res.rows, budget)


def _bench_distributed(s, nproc, parallel, strategies, budget, k, steps, warmup, device, memory_limit,
                       out_dir, fmt, wide, options, force) -> None:
    api.check_nproc(nproc, device, force=force)  # before the "running" line: an error is then the only line
    with working(f"running {nproc} rank{'s' if nproc != 1 else ''} ({parallel})") as (_progress, note):
        res = api.bench_distributed(s, nproc=nproc, parallel=parallel, strategies=strategies, budget=budget, k=k,
                                    steps=steps, warmup=warmup, device=device, memory_limit=memory_limit,
                                    note=note, options=options, force=force)
    emit(fmt, report.dist_bench_doc(res), res.to_frame(), lambda: render.dist_bench_table(res, wide=wide))
    files = report.write_dist_bench(out_dir, res)
    render.info("wrote " + ", ".join(str(f) for f in files))
    commands.check_rank_gradients(res)
    commands.exit_if_infeasible(res.rows, budget)


def main() -> None:
    """The ``ckplan`` command: the process ends as soon as the command is done (``exit_now``)."""
    try:
        app()
    except SystemExit as e:
        exit_now(e.code)

