"""The library behind ``ckplan plan`` and ``ckplan bench``: each of their modes as one function
(a sweep, a per-rank table over several world sizes, one plan; the one-process and the
distributed bench, bench's output folder, progress steps and files), the saved profile they
read when given no SPEC, with the option combinations a mode would ignore refused before
anything runs, and the exit each result calls for (:class:`ckplan.errors.InfeasibleBudgetError`,
:class:`ckplan.errors.WrongResultError`).
Nothing here prints; ``ckplan.cli`` renders.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from . import api, report
from .bench_records import OVER_BUDGET
from .errors import CkplanError, InfeasibleBudgetError, UsageError, WrongResultError
from .options import PEERS, CompileScope, Strategy, StrategyOrAll
from .spec import Spec, validate
from .units import format_bytes

STRATEGY_NAMES = Strategy.names()
SAVED = Path("reports")  # where ``ckplan profile`` saves its profile (its --out-dir's default)


# ---- no SPEC: the newest saved profile ---------------------------------------------------------

def newest_profile(folder: Path = SAVED) -> Path | None:
    """The newest ``profile-*.json`` that ``ckplan profile`` saved in ``folder``; None when none."""
    try:
        found = [(p.stat().st_mtime, str(p), p) for p in Path(folder).glob(report.PROFILE_GLOB) if p.is_file()]
    except OSError:
        return None
    return max(found)[2] if found else None


def saved_profile(command: str, folder: Path = SAVED) -> tuple[Path, str]:
    """The profile ``command`` uses when given no SPEC, and the line that says so (stderr)."""
    path = newest_profile(folder)
    if path is None:
        raise UsageError(f"{command} was given no SPEC, and {folder}/ holds no profile-*.json from `ckplan profile`",
                         tip=f"give a spec: ckplan {command} configs/gpt2-small.yaml; or run `ckplan profile "
                             f"SPEC` first (it saves {folder}/profile-NAME-DEVICE.json), then `ckplan {command}`")
    when = time.strftime("%Y-%m-%d %H:%M", time.localtime(path.stat().st_mtime))
    return path, f"the newest profile under {folder}/ (saved {when} by `ckplan profile`)"


def plan_without_spec(changed: list[str], folder: Path = SAVED) -> tuple[Path, str]:
    """``ckplan plan`` with no SPEC and no --profile: the newest saved profile, which fixes the
    model, batch and device, so ``changed`` (the options that would change them) are refused."""
    path, what = saved_profile("plan", folder)
    if changed:
        flags = " ".join(changed)
        raise UsageError(f"{flags}: plan was given no SPEC, so it plans from {path}, {what}, whose model, batch "
                         "and device are fixed; profiling them again needs the spec",
                         tip=f"give the spec: ckplan plan SPEC {flags} --budget ...")
    return path, f"no SPEC: planning from {path}, {what}; give SPEC or --profile FILE for another"


def bench_without_spec(folder: Path = SAVED) -> tuple[Spec, str]:
    """``ckplan bench`` with no SPEC: the spec of the newest saved profile, and the line saying so."""
    path, what = saved_profile("bench", folder)
    spec = spec_of_saved_profile(path)
    return spec, f"no SPEC: benchmarking {spec.name}, the spec in {path}, {what}; give SPEC for another"


def _saved_spec(path: Path) -> Spec | None:
    """The spec a saved profile was made from (its overrides applied); None when it holds none."""
    prof = api.load_profile(path)
    return validate(prof.spec, source=str(path)) if prof.spec else None


def spec_of_saved_profile(path: Path) -> Spec:
    """The spec of a saved profile, to run it again."""
    spec = _saved_spec(path)
    if spec is None:
        raise UsageError(f"{path} holds no spec (a profile of a model given in Python, not a spec file)",
                         tip="give the spec: ckplan bench SPEC")
    return spec


# ---- plan --------------------------------------------------------------------------------------

def check_sweep(ignored: list[str], out_dir: Path) -> None:
    """Refuse, before any profile, the options a sweep would ignore (``ignored``: those given) and
    an ``--out-dir`` it could not write."""
    if ignored:
        raise UsageError(f"--sweep with {', '.join(ignored)}: a sweep plans every strategy over a range of "
                         "budgets for one process and writes its frontier under --out-dir; "
                         f"{'it' if len(ignored) == 1 else 'they'} would be ignored",
                         tip="drop " + ", ".join(ignored) + ", or plan one budget without --sweep")
    api.check_output_dir(out_dir)


def plan_sweep(spec, *, out_dir: Path, **kwargs):
    """``plan --sweep`` (checked by :func:`check_sweep`): every strategy's frontier
    (:func:`ckplan.api.sweep`) written under ``out_dir``; ``(profile, points, files)``."""
    prof, pts = api.sweep(spec, **kwargs)
    return prof, pts, report.write_sweep(out_dir, prof.model, pts)


def world_sizes_of(text: str | None) -> list[int]:
    """The world sizes of ``--world-size`` (``8`` or ``8,16,32``); ``[1]`` without it."""
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


def plan_layout(spec, profile_path, world_size: str | None, parallel, export, output) -> tuple[list[int], str]:
    """The world sizes and parallel kind a plan is for (the spec's own ``parallel``, whose world
    size ``--world-size`` and whose kind ``--parallel`` replace), the options they would ignore
    refused, and ``-o`` checked."""
    given_parallel = parallel
    # the spec's own parallel: the file's, or the one a saved profile was made from; --world-size
    # replaces its world size only, --parallel its kind
    made_from = (api.load(spec) if profile_path is None and spec is not None else
                 _saved_spec(profile_path) if profile_path is not None else None)
    if made_from is not None:
        par = made_from.parallel
        world_size = str(par.world_size) if world_size is None else world_size
        parallel = parallel or par.kind
    sizes = world_sizes_of(world_size)
    check_world_size_options(sizes, given_parallel, export, output)
    if output is not None:
        # plan writes JSON only: refused now, not after the run; nor may it replace its own input
        api.check_output_file(output, csv=False, inputs={"--profile": profile_path, "SPEC": spec})
    return sizes, str(parallel or "fsdp")


def check_world_size_options(sizes: list[int], parallel, export, output, flag: str = "--world-size") -> None:
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


def check_world_size_table(sizes: list[int], world_size: str, strategy, exact: bool) -> None:
    """Refuse, before any profile, what the per-rank table over several world sizes cannot do."""
    if strategy == StrategyOrAll.all:
        raise UsageError("--strategy all with several --world-size values",
                         tip="pick one strategy for the per-rank table, or one world size")
    if exact:
        raise UsageError(f"--exact with several --world-size values ({world_size}): the per-rank "
                         "table plans with the default dp",
                         tip="give one world size to prove its plan optimal, e.g. "
                             f"--world-size {sizes[-1]} --exact")


def check_some_world_size_fits(rows, budget) -> None:
    """Exit 3 (after the table) when ``--budget`` fits no world size of the per-rank table."""
    if budget is not None and rows and all(r.plan_peak_bytes is None for r in rows):
        lows = ", ".join(f"{r.world_size} ranks: {format_bytes(r.min_peak_bytes)}" for r in rows)
        raise InfeasibleBudgetError(f"--budget {budget}: no world size fits; the budget is below the smallest "
                                    f"feasible peak per rank at every world size ({lows})",
                                    tip="raise --budget to at least one of these peaks, or add larger world "
                                        "sizes (fsdp shards the fixed memory)")


def plan_one(spec, *, export, **kwargs):
    """One plan (``api.plan``), with ``--export``'s snippet: ``(report, doc, export or None,
    closest plan's peak or None)``."""
    rep = api.plan(spec, **kwargs)
    doc = rep.to_doc()
    exported = closest_peak = None
    if export is not None:
        exported, closest_peak = api.export(rep, str(export))
        doc["export"] = {**exported.to_dict(), "closest_predicted_peak_bytes": closest_peak}
    return rep, doc, exported, closest_peak


def budget_line(budget, budget_bytes: int | None, source: str) -> str:
    """How the budget was resolved, as the line ``plan`` shows first."""
    if budget_bytes is None:
        return f"budget: {source}"
    return f"budget {budget or ''} = {budget_bytes} bytes = {format_bytes(budget_bytes)} ({source})"


# ---- bench -------------------------------------------------------------------------------------

def bench_strategies(compare: str, plan_file) -> tuple[list[str], list[str]]:
    """The strategies and peers of ``--compare``, each once in the order first given, and the
    ones listed more than once."""
    listed = [x.strip() for x in compare.split(",") if x.strip()]
    strategies = list(dict.fromkeys(listed))  # each strategy runs once, in the order first given
    bad = [x for x in strategies if x not in (*STRATEGY_NAMES, *PEERS)]
    if bad or (not strategies and plan_file is None):
        raise UsageError(f"--compare {compare!r}: unknown strategy {bad[0] if bad else '(none given)'}",
                         tip=f"use a comma-separated list of {', '.join(STRATEGY_NAMES)} and the peers "
                             f"{', '.join(PEERS)}")
    twice = sorted({x for x in listed if listed.count(x) > 1}, key=listed.index) if len(strategies) < len(listed) \
        else []
    return strategies, twice


def bench_ranks(spec, nproc: int | None, parallel, plan_file) -> tuple[int | None, str]:
    """How many ranks a bench runs (None: one process; the spec's ``parallel.world_size`` when
    ``--nproc`` is not given) and their parallel kind, the options that would be ignored refused."""
    if nproc is None and spec.parallel.world_size > 1:
        nproc = spec.parallel.world_size
    if nproc is None and parallel is not None:
        raise UsageError(f"--parallel {parallel.value} needs several ranks: without --nproc N bench runs one "
                         "process and --parallel would be ignored",
                         tip=f"add --nproc N (e.g. --nproc 2 --parallel {parallel.value}) or set "
                             "parallel.world_size in the spec; or drop --parallel")
    if nproc == 1 and parallel is not None:
        check_world_size_options([nproc], parallel, None, None, flag="--nproc")
    if nproc is not None and plan_file is not None:
        raise UsageError("--plan with --nproc", tip="the distributed bench plans per rank itself; drop --plan")
    return nproc, str(parallel or spec.parallel.kind)


def bench_device_tag(dev_type: str, compile: bool, scope: CompileScope) -> str:
    """The device in bench's file names: ``cpu``, ``cpu-compiled`` or ``cpu-compiled-model``."""
    if scope == CompileScope.model:
        return f"{dev_type}-compiled-model"
    return f"{dev_type}-compiled" if compile else dev_type


def check_bench_out_dir(spec, out_dir: Path, device, compile: bool, scope: CompileScope) -> None:
    """Refuse, before the run, an ``out_dir`` where bench's files for ``spec`` cannot be written."""
    if spec.name:
        dev_type = api.resolve_device(device).type
        report.check_output_dir(out_dir, names=report.bench_filenames(spec.name,
                                                                      bench_device_tag(dev_type, compile, scope)))


def bench_progress_total(n_plans: int, warmup: int, steps: int, compile: bool) -> int:
    """The steps of bench's progress bar: per plan its reference, memory and gradient steps, the
    warm-up (at least one runs) and the timed steps; one for the profile; with --compile two more
    (the reference checked eager, and none measured as the compiled rows are)."""
    return n_plans * (3 + max(warmup, 1) + steps) + 1 + 2 * compile


@dataclass(frozen=True)
class BenchFiles:
    """What writing bench's files came to: the files and the note on those it replaced, or the
    error line and the exit code it calls for (``interrupted``: a signal during the writes)."""

    files: tuple[Path, ...] = ()
    replaced: str | None = None
    error: str | None = None
    exit_code: int = 0
    interrupted: bool = False


def write_bench_files(out_dir: Path, res, started: float) -> BenchFiles:
    """Write bench's files (after its table: a failed write must not take the table with it)."""
    try:
        replaced = report.replaced_note([out_dir / n for n in report.bench_filenames(res.model, res.device_tag)],
                                        since=started)
        files = report.write_bench(out_dir, res)
    except report.ReportsInterrupted as e:
        return BenchFiles(error=str(e), exit_code=128 + e.signum, interrupted=True)
    except (CkplanError, OSError) as e:
        why = str(e) if isinstance(e, CkplanError) else f"{e.strerror} ({e.filename or out_dir})"
        return BenchFiles(error=f"the results above were not written to {out_dir}: {why}",
                          exit_code=getattr(e, "exit_code", 1))
    return BenchFiles(files=tuple(files), replaced=replaced)


def check_bench_results(res) -> None:
    """Exit 4 when a bench row gave wrong results (the table and files are written first)."""
    if not res.failed_rows:
        return
    bad = "; ".join(f"{r.strategy} ({r.status})" for r in res.failed_rows)
    if all(r.kind == "peer" for r in res.failed_rows):
        raise WrongResultError(f"{len(res.failed_rows)} peer row(s) gave wrong results: {bad}",
                               tip="ckplan's own rows passed the gradient check; the table says why "
                                   "each peer failed (drop it from --compare to exit 0)")
    raise WrongResultError(f"{len(res.failed_rows)} plan(s) gave wrong results: {bad}",
                           tip="do not train with them; the table shows why. A layer whose forward "
                               "changes between calls (state, counters, RNG outside torch) cannot be "
                               "recomputed: make it deterministic or leave it out of the chain")


def check_rank_gradients(res) -> None:
    """Exit 4 when a rank's gradients differ from one process's."""
    bad = [r for r in res.rows if r.grad_ok is False]
    if bad:
        names = dict.fromkeys(r.strategy for r in bad)
        where = {name: [str(r.rank) for r in bad if r.strategy == name] for name in names}
        raise WrongResultError("gradients differ from one process for "
                               + ", ".join(f"{name} (rank {', '.join(ranks)})" for name, ranks in where.items()),
                               tip="do not train with these plans; the table shows each rank's largest difference")


def exit_if_infeasible(rows, budget) -> None:
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
