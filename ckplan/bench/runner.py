"""The bench's steps in order: plan the rows, check gradients, warm up, one memory step each, then
timed rounds interleaved."""
from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import replace

import torch

from ..bench_records import OK, BenchResult
from ..chainfind import resolve_chain
from ..compiled import CompiledLayers
from ..execute import remove_plan
from ..measure import KEPT_MEMORY_NOTE, Clock, KeptFreedMemory
from ..planner import Plan, chain_from_profile
from ..planner.plan import STORE
from ..planner.plan_items import kept_option
from ..profiling.whole_steps import measure_whole, pair_timer
from ..records import Profile
from ..sac import OFFLOAD_OPTIONS, POLICIES
from ..training import make_optimizer
from ..whole_choice import mincut_search
from .compiled_rows import compile_entries, compile_notes, eager_cross_check, profiler_cross_check
from .entry import Entry
from .gradients import check_gradients
from .memory import RSS_NOTE, memory_step
from .peer_rows import peer_predictions
from .plans import bench_budget, plan_entries
from .result import bench_result
from .status import guarded
from .steps import Run, Stepper
from .whole_rows import SCOPE_NOTE, steps_note, whole_chain, whole_entries


def run_bench(model, batch, loss_fn, profile: Profile, *, strategies: list[str], budget_bytes: int | None,
              k: int, steps: int, warmup: int, device: torch.device, lr: float,
              extra_plans: dict[str, Plan] | None = None, memory_limit_bytes: int | None = None,
              progress: Callable[[str], None] | None = None, scope: str = "layers") -> BenchResult:
    """Bench ``strategies`` (and ``extra_plans``) on ``model``; see :mod:`ckplan.bench`.

    Names in :data:`ckplan.peers.PEER_NAMES` among ``strategies`` are peers, run the same way.
    ``scope="model"`` (a compiled profile): ckplan's rows run as whole-model compiled copies
    (:mod:`ckplan.bench.whole_rows`)."""
    tick = progress or _silent
    extra_plans = extra_plans or {}
    # a given plan (made on meta, say) may store layers with options this profile measured but
    # found dominated: they stay in the chain that scores it
    used = tuple(sorted({kept_option(o) for p in extra_plans.values() for o in p.options()} - {STORE}))
    whole = scope == "model"
    chain = chain_from_profile(profile, keep=POLICIES if whole else ())
    if not whole and not profile.compiled:  # an option may also offload what it keeps (torch 2.14 on)
        chain = replace(chain, offload_options=OFFLOAD_OPTIONS)
    notes = list(profile.notes)
    if whole:
        chain, made, uniform = whole_chain(model, batch, loss_fn, profile, device, chain, tick)
        notes.append(steps_note(uniform))
    explicit = budget_bytes  # a row predicted to fit it that measures above it is over-budget
    budget_bytes = bench_budget(chain, strategies, budget_bytes, notes)
    if whole:
        measure = functools.partial(measure_whole, model, batch, loss_fn, profile, device)
        timed = pair_timer(model, batch, loss_fn, profile, device, made[STORE], uniform[STORE].fwd_bwd_ms)
        mincut = functools.partial(mincut_search, chain, budget_bytes, uniform[STORE], measure, timed, tick)
        entries = whole_entries(chain, strategies, budget_bytes, k, model, profile, made, extra_plans, measure, tick,
                                mincut)
    else:
        entries = plan_entries(chain, strategies, budget_bytes, k, extra_plans,
                               chain_from_profile(profile, keep=used) if used else chain)
    compile_entries(entries, model, chain, budget_bytes, device, fresh_cache=not whole)
    peer_predictions(entries, model, profile, notes)
    runnable = [e for e in entries if e.runnable]
    run = Run(model, batch, loss_fn, profile, device, memory_limit_bytes)
    if profile.compiled and not whole:
        _, container, _ = resolve_chain(model, profile.chain)
        run.layers = CompiledLayers(list(container))
    try:
        check_gradients(run, runnable, tick, notes, eager_reference=whole)
        if run.layers is not None:
            eager_cross_check(run, runnable, tick, notes)
        run.opt = make_optimizer(model.parameters(), profile.optimizer, lr, device.type)
        run.stepper = Stepper(model, run.opt, batch, loss_fn, profile.precision, profile.accum, device)
        _warm_up(run, runnable, warmup, tick)
        for e in runnable:
            if e.status == OK:
                tick(f"memory: {e.name}")
                guarded(run, e, memory_step)
        profiler_cross_check(run, runnable, tick)
        with KeptFreedMemory(device) as kept:
            _timed_rounds(run, runnable, steps, tick)
        if kept.active and KEPT_MEMORY_NOTE not in notes:
            notes.append(KEPT_MEMORY_NOTE)
        compile_notes(run, runnable, notes)
        if whole:
            notes.append(SCOPE_NOTE)
        if run.layers is not None:
            notes.append(f"--compile: ckplan's rows ran with each chain layer's forward compiled (torch.compile, "
                         f"TorchInductor; {run.layers.graphs} graph(s) compiled), the plan applied around "
                         "them, predicted from the compiled layers' profile; peers ran as they are")
    finally:
        remove_plan(model)
    if device.type == "cpu" and any("rss_peak" in e.mem for e in runnable):
        notes.append(RSS_NOTE)
    return bench_result(profile, entries, chain, notes, steps=steps, warmup=max(warmup, 1),  # the steps run
                        budget_bytes=budget_bytes, k=k, explicit_budget=explicit, scope=scope)


def _silent(msg: str) -> None:
    pass


def _warm_up(run: Run, entries: list[Entry], warmup: int, tick) -> None:
    """At least one step first: the optimizer creates its state then, and the prediction is for a
    steady-state step."""
    for _ in range(max(warmup, 1)):
        for e in entries:
            tick(f"warm-up: {e.name}")
            guarded(run, e, _plain_step)
    for e in entries:
        if e.compiled is not None:
            e.warm_graphs = e.compiled.graphs


def _plain_step(run: Run, e: Entry) -> None:
    run.step(e)


def _timed_rounds(run: Run, entries: list[Entry], steps: int, tick) -> None:
    """Step 3: one untimed round (the tracked step leaves caches cold), then timed steps,
    strategies interleaved round by round."""
    clock = Clock(run.device)
    for e in entries:
        tick(f"settle: {e.name}")
        guarded(run, e, _plain_step)
    for _ in range(steps):
        for e in entries:
            if e.status == OK:
                tick(f"timing: {e.name}")
                guarded(run, e, _timed_step, clock)


def _timed_step(run: Run, e: Entry, clock: Clock) -> None:
    t0 = clock.now_ms()
    e.final_loss = run.step(e)
    e.times.append(clock.now_ms() - t0)
