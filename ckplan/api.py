"""One function per command; the CLI and Python users call these.

Each returns frozen records (ckplan.records, ckplan.planner, ckplan.bench); nothing here prints.
The commands live by what they do: :mod:`ckplan.api_profile` (preflight, profile),
:mod:`ckplan.api_plan` (plan, sweep, world sizes, export), :mod:`ckplan.documents` (the plan and
profile files read, the output files checked), :mod:`ckplan.arguments` (the arguments checked
before a run); this module runs the benches and names them all.
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from .api_plan import export, plan, resolve_budget, sweep, world_sizes
from .api_profile import meta_cuda_note, predicted_peak_none, preflight, profile, profile_model
from .arguments import (
    Note,
    Progress,
    bench_args,
    check_budget,
    check_meta_target,
    check_positive,
    check_train_args,
    compile_options,
    load,
    note_or_warn,
    option_names,
    resolve_device,
)
from .bench import run_bench
from .chainfind import resolve_chain
from .distributed import bench_distributed as _bench_distributed
from .distributed import check_run, check_world, rank_chain
from .documents import (
    PLAN_TIP,
    check_output_dir,
    check_output_file,
    check_plan_chain,
    load_profile,
    plan_of,
    read_plan,
    read_plan_document,
)
from .errors import DependencyError, SpecError, UsageError
from .options import OFFLOAD_PEERS, PEERS, Device, Strategy
from .planner import parse_budget
from .planner.plan import PARTITIONER_BUDGET
from .profile_doc import MAX_PROFILE_INT, profile_problem
from .spec import Spec, build_model, make_batch, to_loss
from .whole_compile import partitioner_budget

__all__ = [
    "MAX_PROFILE_INT", "PLAN_TIP", "Note", "Progress", "bench", "bench_distributed", "check_bench_args",
    "check_budget", "check_meta_target", "check_nproc", "check_output_dir", "check_output_file",
    "check_plan_chain", "check_positive", "check_train_args", "compile_options", "export", "load",
    "load_profile", "meta_cuda_note", "option_names", "plan", "plan_of", "predicted_peak_none", "preflight",
    "profile", "profile_model", "profile_problem", "read_plan", "read_plan_document", "resolve_budget",
    "resolve_device", "sweep", "world_sizes",
]


def bench(spec: Spec, *, strategies: list[str], budget: str | int | float | None = None, k: int = 2,
          steps: int = 5, warmup: int = 1, device: str | Device | None = "auto",
          plan_path: str | Path | None = None, memory_limit: str | int | None = None, progress=None,
          force: bool = False, note: Note | None = None, options: bool | Sequence[str] = False,
          compile: bool = False, compile_scope: str = "layers"):
    """Profile the spec's model, plan every strategy, and run measured training steps.

    ``options``: the profile also measures selective options (see :func:`profile_model`).
    ``compile``: the chain layers are profiled compiled and every ckplan row (``none`` too) runs
    with them compiled, its plan applied around them (:mod:`ckplan.compiled`); peers run as always.
    ``compile_scope="model"`` (implies ``compile``): every ckplan row runs as one whole-model
    ``torch.compile`` with a checkpoint region per chain layer (:mod:`ckplan.whole_compile`), and
    ``dp`` plans in that space (:mod:`ckplan.bench.whole_rows`).

    Every argument is checked before anything runs; on cpu/cuda a meta pass first checks that the
    step fits (:func:`preflight`; ``force=True`` runs anyway).
    """
    strategies = [s if s in PEERS else str(Strategy.parse(s, what="strategy")) for s in strategies]
    if spec.parallel.param_dtype is not None:
        raise UsageError(f"parallel.param_dtype {spec.parallel.param_dtype} is FSDP2's MixedPrecisionPolicy, which "
                         "runs on ranks, not one process", tip="bench it on ranks: --nproc 2 --parallel fsdp")
    if compile_scope not in ("layers", "model"):
        raise UsageError(f"compile scope {compile_scope!r} is not layers or model",
                         tip="--compile-scope layers (each chain layer compiled) or model (the whole model)")
    whole = compile_scope == "model"
    compile = compile or whole
    limit, dev, plan_read = _check_bench(spec, k=k, steps=steps, warmup=warmup, budget=budget,
                                         memory_limit=memory_limit, device=device, plan_path=plan_path)
    for peer in (p for p in OFFLOAD_PEERS if p in strategies and dev.type != "cuda"):
        raise UsageError(f"--compare {peer} needs a CUDA device (this bench runs on {dev.type}): it offloads "
                         "saved activations to host memory, where a CPU's already are",
                         tip=f"drop {peer} from --compare, or bench on a GPU (--device cuda)")
    if plan_read is not None and "offload" in plan_read[0].options() and dev.type != "cuda":
        raise UsageError(f"--plan {plan_path} offloads layers to host memory, which needs a CUDA device (this bench "
                         f"runs on {dev.type})", tip="bench it on the GPU it was planned for (--device cuda)")
    if plan_read is not None and PARTITIONER_BUDGET in plan_read[0].params:
        partitioner_budget(plan_read[0])  # a bad value: one message before anything runs
        if not whole:
            raise UsageError(f"--plan {plan_path} leaves the model to torch.compile's partitioner "
                             f"({PARTITIONER_BUDGET} {plan_read[0].params[PARTITIONER_BUDGET]})",
                             tip="bench it with --compile-scope model, the scope it was planned for")
    # min-cut options have no region inside a whole-model compile: not measured for it
    names = compile_options(option_names(options, compile=compile and not whole), compile, dev.type)
    extra = {}
    plan_doc: dict = {}
    where = f"--plan {plan_path}"
    if plan_read is not None:
        p, plan_doc = plan_read
        extra[f"plan:{p.strategy}"] = p
    held: list[str] = []  # a skipped preflight is said only if the real run works (else its error says it)
    preflight(spec, dev.type, force=force, note=note, hold=held)  # no progress ticks: the bar counts steps
    model = build_model(spec, str(dev))
    batch = make_batch(spec, str(dev))
    prof = profile_model(model, *batch, name=spec.name or type(model).__name__, chain=spec.chain,
                         device=dev, optimizer=spec.train.optimizer, precision=spec.train.precision,
                         accum=spec.train.accum, lr=spec.train.lr, spec=spec.model_dump(mode="json"),
                         options=names, compile=compile)
    for text in held:
        note_or_warn(note, text)
    if plan_path is not None:  # the chain the profile found (where the meta build could not tell)
        check_plan_chain(plan_doc, prof.chain, where)
        n = len(prof.chain_layers)
        if p.n_layers != n:
            raise SpecError(f"{where}: the plan is for {p.n_layers} layers but chain {prof.chain!r} has {n}",
                            tip="make the plan for this model (the same spec, the same chain): "
                                "`ckplan plan SPEC --budget ... -o plan.json`")
        made_for = plan_doc.get("model")
        if isinstance(made_for, str) and made_for != prof.model:
            note_or_warn(note, f"{where} was made for model {made_for!r}, this spec is {prof.model!r}: it is applied "
                        "because its chain and layer count match; check that it is the same model")
    budget_bytes = resolve_budget(budget, prof).bytes if budget is not None else None
    return run_bench(model, batch, to_loss, prof, strategies=strategies, budget_bytes=budget_bytes,
                     k=k, steps=steps, warmup=warmup, device=dev, lr=spec.train.lr,
                     extra_plans=extra, memory_limit_bytes=limit, progress=progress,
                     scope=compile_scope)


def check_bench_args(spec: Spec, *, k: int = 2, steps: int = 5, warmup: int = 1,
                     budget: str | int | float | None = None,
                     memory_limit: str | int | None = None, device: str | Device | None = "auto",
                     plan_path: str | Path | None = None) -> None:
    """Raise now what :func:`bench` would raise for its arguments and its plan file, before it starts."""
    _check_bench(spec, k=k, steps=steps, warmup=warmup, budget=budget, memory_limit=memory_limit,
                 device=device, plan_path=plan_path)


def _check_bench(spec: Spec, *, k, steps, warmup, budget, memory_limit, device, plan_path):
    """(memory limit in bytes or None, device, (plan, plan document) or None), every argument checked."""
    limit, dev = bench_args(k, steps, warmup, budget, memory_limit, device)
    plan_read = None
    if plan_path is not None:  # a bad plan file fails before the (long) profile, not after
        where = f"--plan {plan_path}"
        body, doc = read_plan_document(plan_path, where=where)
        check_plan_chain(doc, spec.chain, where)  # the spec names its chain: nothing built yet
        chain, n = _meta_chain(spec)
        check_plan_chain(doc, chain, where)
        plan_read = plan_of(body, where, chain_layers=n), doc
    return limit, dev, plan_read


def _meta_chain(spec: Spec) -> tuple[str | None, int | None]:
    """The spec's chain path and length, from its model built on the meta device (nothing is
    allocated); ``(spec.chain, None)`` when it cannot be built there (the real run will say why)."""
    try:
        path, container, _ = resolve_chain(build_model(spec, "meta"), spec.chain)
    except (SpecError, UsageError, DependencyError):
        raise
    except Exception:  # a model that cannot be built on meta: checked after the real build
        return spec.chain, None
    return path, len(container)


def bench_distributed(spec: Spec, *, nproc: int, parallel: str = "fsdp", strategies: list[str],
                      budget: str | int | float | None = None, k: int = 2, steps: int = 3, warmup: int = 1,
                      device: str | Device | None = "auto", memory_limit: str | int | None = None,
                      timeout_s: float = 600.0, note: Note | None = None,
                      options: bool | Sequence[str] = False, force: bool = False):
    """Run ``nproc`` ranks of ``parallel`` (gloo on CPU, NCCL on CUDA; ckplan's launcher, which
    ends every rank however the run ends) and gather per-rank predicted and measured peaks
    (:func:`ckplan.distributed.bench_distributed`). ``nproc`` is checked against the machine
    first (GPUs, cores, open files, memory); ``force`` lets a few ranks more per core, or past
    the memory estimate, run anyway. ``options``: the profile also measures selective options
    (as :func:`profile`), which the per-rank plans may then use (each option with its FSDP
    unit's buffers)."""
    strategies = [str(Strategy.parse(s, what="strategy")) for s in strategies]
    check_positive("nproc", nproc)
    limit, dev = bench_args(k, steps, warmup, budget, memory_limit, device)
    notes = check_nproc(nproc, dev.type, force=force)  # before a profile that would be thrown away
    check_run(spec, nproc, str(parallel), dev.type)
    prof = profile(spec, device=dev.type, note=note, options=options, force=force)
    budget_bytes = None
    if budget is not None:  # per rank: a share is of one rank's peak
        budget_bytes = parse_budget(budget, rank_chain(prof, spec, nproc, str(parallel)), what="budget").bytes
    return _bench_distributed(spec, profile=prof, device=dev.type, nproc=nproc, kind=str(parallel),
                              strategies=strategies, budget_bytes=budget_bytes, k=k, steps=steps, warmup=warmup,
                              timeout_s=timeout_s, memory_limit_bytes=limit, force=force, machine_notes=notes)


def check_nproc(nproc: int, device: str | Device | None = "auto", *, force: bool = False) -> list[str]:
    """Refuse ``nproc`` ranks that this machine cannot run on ``device`` (NCCL: a GPU each; gloo
    on the CPU: a core each, or up to ``ckplan.launch.MAX_RANKS_PER_CPU`` with ``force``, and the
    open-file limit), before anything is built; returns notes for what ``force`` let through.
    :func:`bench_distributed` checks the same, and the ranks' memory once it has profiled."""
    check_positive("nproc", nproc)
    dev = resolve_device(device)
    return check_world(nproc, dev.type, force=force) if dev.type in ("cpu", "cuda") else []

