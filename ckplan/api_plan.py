"""Planning commands: one plan (:func:`plan`), every strategy's frontier (:func:`sweep`), per-rank
peaks at several world sizes (:func:`world_sizes`), and a plan as another framework's snippet
(:func:`export`); each from a spec profiled now or a saved profile.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from .api_profile import META_TIMES, profile
from .api_whole import plan_spec_whole
from .arguments import Note, Progress, check_budget, check_positive, load, note_or_warn, tick
from .device_model import target_device
from .documents import load_profile
from .errors import InfeasibleBudgetError, UsageError
from .export import export_plan
from .measure import nvml_memory
from .options import STRATEGIES, Device, Strategy
from .plan_report import PlanReport
from .planner import (
    chain_from_profile,
    compare,
    default_budget,
    infeasible_budget,
    no_gain_reason,
    parse_budget,
    plan_chain,
    simulate,
)
from .planner import sweep as _sweep
from .planner.frontier import check_sweep_points
from .planner.parallel import KINDS, per_rank_chain_from_profile, world_size_table
from .profiling.notes import CHANGES_INPUT_NOTE, CONTAINER_NOTE
from .records import Profile
from .sac import OFFLOAD_OPTIONS
from .sdpa import default_target
from .spec import Spec
from .units import format_bytes


def resolve_budget(budget: str | int | float, prof: Profile):
    """The :class:`ckplan.planner.Budget` for ``budget`` (``12GB``, ``12GiB``, bytes, ``40%`` of
    the no-checkpoint peak, ``50%act``: that peak with half its activations)."""
    return parse_budget(budget, chain_from_profile(prof), what="budget")


def plan(spec: Spec | str | Path | None = None, *, profile_path: str | Path | None = None,
         budget: str | int | float | None = None, strategy: str = "dp", k: int = 2,
         device: str | Device | None = None, overrides: dict | None = None, force: bool = False,
         progress: Progress | None = None, note: Note | None = None, world_size: int = 1,
         parallel: str = "fsdp", options: bool | Sequence[str] = False, compile: bool = False,
         dp_mode: str = "auto", meta_target: str | None = None, offload: bool | None = None,
         compile_scope: str = "layers"):
    """Profile (or load a saved profile), then plan one strategy or all of them at one budget.

    ``spec``: a Spec or a spec file (``overrides`` applied); or ``profile_path``, a saved profile,
    which fixes the model and batch (giving both, or overrides with it, is an error).
    ``world_size`` > 1 plans for one rank of ``parallel`` (``fsdp``: FSDP2 with every chain layer
    one unit; ``ddp``) with :func:`ckplan.planner.parallel.per_rank_chain_from_profile`: the budget
    and every peak are per rank. ``options``: profiling the spec also measures selective options
    (:func:`profile_model`); a saved profile has the ones it was made with. ``dp_mode``:
    ``"auto"`` (exact DP up to 64 layers, banded DP to 400, grouped tables above) or ``"exact"``
    (the proven optimum at any length; slow on long chains). ``meta_target``: with
    ``device="meta"``, the device the profile stands for (:func:`profile`). ``offload``: dp may
    offload layers to pinned host memory when the profile has a host link (``Profile.host_bw``):
    None or True (True asked for: a note says so where there is no link), False never.
    ``compile_scope="model"``: dp for a whole-model ``torch.compile``, one checkpoint region per
    chain layer (:mod:`ckplan.api_whole`; it profiles the spec and measures whole-model steps).
    """
    strategy = "all" if str(strategy) == "all" else str(Strategy.parse(strategy, what="strategy"))
    check_positive("k", k)
    check_budget(budget)
    if compile_scope == "model":
        if profile_path is not None or spec is None or world_size > 1:
            raise UsageError("--compile-scope model plans from a SPEC on one device: it measures whole-model "
                             "compiled steps, which a saved profile does not hold",
                             tip="give the spec, without --profile and --world-size")
        return plan_spec_whole(load(spec, **{k: v for k, v in (overrides or {}).items() if v is not None}),
                               budget=budget, strategy=strategy, device=device, force=force, progress=progress,
                               note=note, options=options)
    if compile_scope != "layers":
        raise UsageError(f"compile scope {compile_scope!r} is not layers or model", tip="--compile-scope layers|model")
    prof = _profile_for_plan(spec, profile_path, device, overrides, force, progress, note, options, compile,
                             meta_target)
    tick(progress, f"planning {strategy} for {prof.model}")
    chain = chain_for(prof, world_size, parallel)
    if offload is False:
        chain = replace(chain, d2h_bytes_per_ms=0.0, h2d_bytes_per_ms=0.0)
    no_link = (f"--offload: nothing is offloaded: the profile has no host link (profiled on {prof.device}"
               f"{'' if prof.device != 'meta' else ' without a GPU --target'})"
               if offload is True and not chain.can_offload else None)
    budget_bytes, source = _budget_for_plan(budget, prof, chain)
    infeasible = infeasible_tip = None
    if strategy == "all":
        # compare() never raises for an infeasible budget: every row says fits=False, and the
        # caller shows the table before exiting 3 (InfeasibleBudgetError, see report_infeasible).
        results = compare(chain, list(STRATEGIES), budget_bytes, k, mode=dp_mode)
        chosen = next(r for r in results if r.strategy == "dp")
        infeasible = infeasible_budget(results)
        if infeasible is not None:
            try:  # the same error plan_chain raises for one strategy, for its tip
                plan_chain(chain, "dp", budget_bytes, k)
            except InfeasibleBudgetError as err:
                infeasible_tip = err.tip
    else:
        try:
            chosen = plan_chain(chain, strategy, budget_bytes, k, mode=dp_mode)
        except InfeasibleBudgetError as err:
            err.budget_source = source  # how the budget was resolved (50%act: from what), for the CLI
            raise
        results = (chosen,)
    none = plan_chain(chain, "none")
    compiled = ("planned for the compiled chain layers (profiled with --compile): apply the plan inside "
                "`with ckplan.compiled_layers(model):`, entered before `ckplan.apply_plan`") if prof.compiled else None
    layer_notes = tuple(n for n in prof.notes if n.startswith((CHANGES_INPUT_NOTE, CONTAINER_NOTE, META_TIMES)))
    notes = tuple(n for n in (_parallel_note(world_size, parallel, prof.precision, chain, prof.param_dtype,
                                             prof.reduce_dtype),
                              no_gain_reason(chain),
                              compiled, no_link, *layer_notes) if n)
    return PlanReport(profile=prof, budget_bytes=budget_bytes, budget_source=source, strategy=strategy,
                      k=k, results=tuple(results), chosen=chosen, none_peak_bytes=none.score.peak_bytes,
                      none_step_ms=none.score.step_ms, infeasible=infeasible, infeasible_tip=infeasible_tip,
                      notes=notes, world_size=world_size, parallel=str(parallel) if world_size > 1 else None)


def sweep(spec: Spec | str | Path | None = None, *, profile_path: str | Path | None = None,
          device: str | Device | None = None, points: int = 20, strategies: tuple[str, ...] | None = None,
          overrides: dict | None = None, force: bool = False, progress: Progress | None = None,
          note: Note | None = None, options: bool | Sequence[str] = False, compile: bool = False,
          meta_target: str | None = None):
    """Every strategy's memory/recompute frontier: (profile, frontier points)."""
    check_sweep_points(points, what="points")
    names = [str(Strategy.parse(s, what="strategy")) for s in (strategies or STRATEGIES)]
    prof = _profile_for_plan(spec, profile_path, device, overrides, force, progress, note, options, compile,
                             meta_target)
    tick(progress, f"sweeping {points} budgets for {prof.model}")
    chain = chain_from_profile(prof)
    reason = no_gain_reason(chain)
    if reason:
        note_or_warn(note, reason)
    return prof, _sweep(chain, names, points)


def chain_for(prof: Profile, world_size: int, parallel: str):
    """The planner's chain: one process, or one rank of ``parallel`` on ``world_size`` ranks."""
    check_positive("world_size", world_size)
    if world_size == 1 and prof.param_dtype is not None:  # FSDP2 on one rank: fp32 masters
        return per_rank_chain_from_profile(prof, 1, "fsdp")
    if world_size == 1:  # an option may also offload what it keeps where this torch can run that
        return replace(chain_from_profile(prof), offload_options=OFFLOAD_OPTIONS and not prof.compiled)
    if str(parallel) not in KINDS:
        raise UsageError(f"parallel={str(parallel)!r} is not one of {', '.join(KINDS)}")
    return per_rank_chain_from_profile(prof, world_size, str(parallel))


def _parallel_note(world_size: int, parallel: str, precision: str = "fp32", chain=None,
                   param_dtype: str | None = None, reduce_dtype: str | None = None) -> str | None:
    policy = (f"; FSDP2's MixedPrecisionPolicy: parameters all-gathered and computed in {param_dtype}, fp32 "
              f"shards and optimizer state, reduce-scatter in {reduce_dtype or 'fp32'}" if param_dtype else "")
    if world_size == 1:
        return f"one rank of FSDP2{policy}" if param_dtype else None
    casts = 0 if chain is None else chain.pre.cast_bytes + sum(ly.cast_bytes for ly in chain.layers)
    mixed = ("" if precision == "fp32" else
             f"; {precision} autocast caches a copy of every weight to the end of the forward, unsharded as "
             f"on one device ({format_bytes(casts)} of the chain's per rank); FSDP2's MixedPrecisionPolicy "
             "is not modelled")
    if str(parallel) == "fsdp":
        return (f"per rank of FSDP2 on {world_size} ranks: parameters, gradients and optimizer state "
                "sharded; every chain layer is one FSDP unit (its all-gathered parameters and "
                "reduce-scatter buffers are transients), the rest is the root unit; budget and peaks "
                f"are per rank{mixed}{policy}")
    return (f"per rank of DDP on {world_size} ranks: parameters, gradients and optimizer state "
            f"replicated, plus DDP's gradient buckets; budget and peaks are per rank{mixed}")


def world_sizes(spec: Spec | str | Path | None = None, *, world_sizes: list[int], parallel: str = "fsdp",
                profile_path: str | Path | None = None, budget: str | int | float | None = None,
                strategy: str = "dp", k: int = 2, device: str | Device | None = None,
                overrides: dict | None = None, force: bool = False, progress: Progress | None = None,
                note: Note | None = None, meta_target: str | None = None):
    """Per-rank peaks with and without the plan at each world size: (profile, rows)."""
    strategy = str(Strategy.parse(strategy, what="strategy"))
    for w in world_sizes:
        check_positive("world_size", w)
    if str(parallel) not in KINDS:
        raise UsageError(f"parallel={str(parallel)!r} is not one of {', '.join(KINDS)}")
    check_budget(budget)
    prof = _profile_for_plan(spec, profile_path, device, overrides, force, progress, note,
                             meta_target=meta_target)
    tick(progress, f"planning {len(world_sizes)} world sizes for {prof.model}")
    # a meta profile's device model also prices the collectives (its link and network bandwidths)
    priced = target_device(meta_target, default_target())[1] if prof.device == "meta" else None
    rows = []
    for w in world_sizes:
        b = None
        if budget is not None:  # shares are of that world size's per-rank peaks
            b = parse_budget(budget, per_rank_chain_from_profile(prof, w, str(parallel)), what="budget").bytes
        rows += world_size_table(prof, [w], str(parallel), strategy, b, k, device=priced)
    return prof, tuple(rows)


def export(rep, target: str):
    """The snippet that applies ``rep``'s chosen plan in ``target`` (hf, torchtitan, lightning,
    fsdp), or the closest plan it can express (:func:`ckplan.export.export_plan`)."""
    prof = rep.profile
    layer_class = prof.chain_layers[0].type if prof.chain_layers else None
    policy = (prof.param_dtype, prof.reduce_dtype or "fp32") if prof.param_dtype else None
    chain = chain_for(prof, rep.world_size, rep.parallel or "fsdp")  # the chain the plan was made on
    fits = None if rep.budget_bytes is None else (lambda p: simulate(chain, p).peak_bytes <= rep.budget_bytes)
    ex = export_plan(rep.chosen.plan, str(target), chain_path=prof.chain, layer_class=layer_class,
                     model_name=prof.model, policy=policy, fits=fits)
    if str(target).strip().lower() == "torchtitan" and prof.param_dtype is None:
        ex = replace(ex, message=f"{ex.message} On sharded ranks torchtitan trains under FSDP2's "
                     "MixedPrecisionPolicy by default (mixed_precision_param bfloat16): plan with "
                     "`parallel: {param_dtype: bf16}` in the spec for what it runs.".strip())
    closest_peak = simulate(chain, ex.closest_plan).peak_bytes
    return ex, closest_peak


def _profile_for_plan(spec, profile_path, device, overrides, force, progress, note,
                      options: bool | Sequence[str] = False, compile: bool = False,
                      meta_target: str | None = None) -> Profile:
    given = {k: v for k, v in (overrides or {}).items() if v is not None}
    if profile_path is not None:
        ignored = (["SPEC (spec)"] if spec is not None else []) + \
                  [f"{k}={getattr(v, 'value', v)!r}" for k, v in given.items()] + \
                  ([f"device={getattr(device, 'value', device)!r}"] if device is not None else []) + \
                  ([f"target={getattr(meta_target, 'value', meta_target)!r}"] if meta_target is not None else [])
        if ignored:
            raise UsageError(f"a saved profile ({profile_path}) fixes the model, batch and device; "
                             f"{', '.join(ignored)} would be ignored",
                             tip="drop --profile to profile the spec with these settings, or drop them "
                                 "to plan from the saved profile")
        return load_profile(profile_path)
    if spec is None:
        raise UsageError("plan needs a SPEC or --profile saved.json",
                         tip="e.g. ckplan plan configs/gpt2-small.yaml --budget 4GB")
    spec = load(spec, **given)
    return profile(spec, device=device, force=force, progress=progress, note=note, options=options,
                   compile=compile, meta_target=meta_target)


def _budget_for_plan(budget, prof: Profile, chain) -> tuple[int | None, str]:
    """The budget bytes and where they came from: the user's text, else the one default rule."""
    if budget is not None:
        b = parse_budget(budget, chain, what="budget")
        return b.bytes, f"--budget: {b.description}"
    free = None
    if prof.device == "cuda":
        info = nvml_memory(0)
        free = info.free_bytes if info is not None else None
    b = default_budget(chain, mode="plan", free_device_bytes=free)
    if b is None:
        return None, "none given: planned for the smallest feasible peak"
    return b.bytes, f"none given: {b.description} (NVML)"

