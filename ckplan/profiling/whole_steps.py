"""Whole-model compiled steps: the model compiled whole (:mod:`ckplan.whole_compile`) with every
chain layer given one choice (stored, recomputed whole, a SAC option), one forward+backward of each
measured, for :func:`ckplan.planner.whole.whole_model_chain`.

Per step: the bytes held after the forward, the forward's and the backward's peaks (CPU: the
PyTorch profiler's allocator events; CUDA: the allocator), its time from rounds that interleave the
steps (paired with the every-layer-stored step round by round), and what the partitioned graph
saves per chain layer
(:class:`ckplan.measure.compiled_graph.SavedForBackward`). Each compiled copy is returned too: the
bench runs its rows on them.

dp's choice among these steps, checked by measuring the plans it picks: :mod:`ckplan.whole_choice`.
"""
from __future__ import annotations

import gc
import statistics
from dataclasses import replace

import torch

from ..measure import AllocatorTimeline, Clock
from ..planner import Plan
from ..planner.plan import STORE
from ..planner.whole import FULL, WholeStep, option_plan
from ..sac import POLICIES
from ..training import forward_loss
from ..whole_compile import CompiledModel

WHAT = {STORE: "stored", FULL: "recomputed whole"}


ROUNDS = 3  # timed rounds, the steps interleaved in each (the CPU's speed drifts over minutes)


def _fwd_bwd(cm: CompiledModel, model, batch, loss_fn, profile, device: torch.device):
    args, kwargs = batch

    def run(after_forward=None, after_backward=None) -> None:
        loss = forward_loss(cm.module, args, kwargs, loss_fn, profile.precision, device.type)
        if after_forward is not None:
            after_forward()
        loss.backward()
        del loss
        if after_backward is not None:
            after_backward()
        model.zero_grad(set_to_none=True)
    return run


def measure_whole(model, batch, loss_fn, profile, device: torch.device, plan: Plan) -> tuple[CompiledModel, WholeStep]:
    """``plan``'s whole-model compiled copy, compiled here, and its measured forward+backward's
    memory and saved bytes (not its time: :func:`whole_steps` times the steps side by side)."""
    cm = CompiledModel(model, plan, profile.chain)
    fwd_bwd = _fwd_bwd(cm, model, batch, loss_fn, profile, device)
    with cm.compiling():
        fwd_bwd()  # compiles
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        marks: list[int] = []

        def mark() -> None:
            marks.append(torch.cuda.memory_allocated() - base)
            marks.append(torch.cuda.max_memory_allocated() - base)
            torch.cuda.reset_peak_memory_stats()
        fwd_bwd(mark, mark)
        held, fwd_peak, bwd_peak = marks[0], marks[1], marks[3]
    else:
        tl = AllocatorTimeline()
        with tl:
            fwd_bwd(tl.mark, tl.mark)
        (held, fwd_peak), (_, bwd_peak) = tl.replay()[:2]
    n = len(profile.chain_layers)
    saved = tuple(cm.saved.bytes.get(f"L{i}", 0) for i in range(n))
    return cm, WholeStep(held, fwd_peak, bwd_peak, 0.0, saved)


def whole_steps(model, batch, loss_fn, profile, device: torch.device, chain, tick) -> tuple[dict, dict]:
    """One step per choice a layer of ``chain`` has (stored, recomputed whole, each SAC option
    every layer has), and their compiled copies, both by choice. Times: one untimed pass each,
    then :data:`ROUNDS` rounds with the steps interleaved; each step's time is the stored step's
    median plus the median over rounds of its difference from the stored step in that round."""
    n = len(profile.chain_layers)
    names = [o for o in POLICIES if all(any(x.name == o for x in ly.options) for ly in chain.layers)]
    steps, made = {}, {}
    for name in [STORE, FULL, *names]:
        tick(f"compiling the whole model: every layer {WHAT.get(name, 'stored with ' + name)}")
        made[name], steps[name] = measure_whole(model, batch, loss_fn, profile, device, option_plan([name] * n))
    runs = {name: _fwd_bwd(cm, model, batch, loss_fn, profile, device) for name, cm in made.items()}
    for run in runs.values():
        run()  # the first pass after the memory step runs slower
    times: dict[str, list[float]] = {name: [] for name in runs}
    clock = Clock(device)
    for r in range(ROUNDS):
        tick(f"timing the whole-model steps, round {r + 1} of {ROUNDS}")
        for name, run in runs.items():
            times[name].append(clock.time_ms(run))
    base = statistics.median(times[STORE])
    for name, step in steps.items():
        extra = statistics.median(t - t0 for t, t0 in zip(times[name], times[STORE]))
        steps[name] = replace(step, fwd_bwd_ms=base + extra)
    return steps, made


def paired_ms(run_store, run, store_ms: float, device: torch.device) -> float:
    """A step's forward+backward time from :data:`ROUNDS` rounds interleaved with the stored step's
    (``run_store``, measured at ``store_ms``): ``store_ms`` plus the median difference per round."""
    run()
    clock = Clock(device)
    diffs = []
    for _ in range(ROUNDS):
        t0 = clock.time_ms(run_store)
        diffs.append(clock.time_ms(run) - t0)
    return store_ms + statistics.median(diffs)


def pair_timer(model, batch, loss_fn, profile, device: torch.device, store_copy: CompiledModel, store_ms: float):
    """``timed(copy) -> ms`` for :func:`mincut_search`: a copy's forward+backward paired round by
    round with the stored step's copy (measured at ``store_ms``)."""
    run_store = _fwd_bwd(store_copy, model, batch, loss_fn, profile, device)
    return lambda cm: paired_ms(run_store, _fwd_bwd(cm, model, batch, loss_fn, profile, device), store_ms, device)


