"""Whole-model compiled steps: the model compiled whole (:mod:`ckplan.compiled_model`) with every
chain layer given one choice (stored, recomputed whole, a SAC option), one forward+backward of each
measured, for :func:`ckplan.planner.whole.whole_model_chain`.

Per step: the bytes held after the forward, the forward's and the backward's peaks (CPU: the
PyTorch profiler's allocator events; CUDA: the allocator), its time from rounds that interleave the
steps (paired with the every-layer-stored step round by round), and what the partitioned graph
saves per chain layer
(:class:`ckplan.measure.compiled_graph.SavedForBackward`). Each compiled copy is returned too: the
bench runs its rows on them.
"""
from __future__ import annotations

import gc
import statistics
import time
from dataclasses import replace

import torch

from ..compiled_model import CompiledModel
from ..measure import AllocatorTimeline
from ..planner import Plan
from ..planner.plan import STORE
from ..planner.regions import RegionsResult
from ..planner.whole import FULL, WholeStep, option_plan, plan_whole, whole_peak
from ..sac import POLICIES
from ..training import forward_loss

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


def _timed(run, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    run()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3


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
    for r in range(ROUNDS):
        tick(f"timing the whole-model steps, round {r + 1} of {ROUNDS}")
        for name, run in runs.items():
            times[name].append(_timed(run, device))
    base = statistics.median(times[STORE])
    for name, step in steps.items():
        extra = statistics.median(t - t0 for t, t0 in zip(times[name], times[STORE]))
        steps[name] = replace(step, fwd_bwd_ms=base + extra)
    return steps, made


CHECKS = 4  # plans of mixed choices compiled and measured before dp settles on one of the measured plans


def checked_plan(chain, budget_bytes: int | None, measure, tick) -> tuple[RegionsResult, dict, dict, list[str]]:
    """dp's whole-model plan (:func:`ckplan.planner.whole.plan_whole`), each plan it picks that mixes
    choices compiled and measured (``measure(plan) -> (CompiledModel, WholeStep)``) before it is
    taken: in one graph the partitioner decides a region's neighbourhood too (what crosses a layer
    boundary, what no layer is named on), so a mixed plan's peak may differ from the sum of the
    uniform steps' terms (gpt at 3 x 64: -4% to +3%). The misses come from stored layers, whose
    ops the partitioner places over the whole graph; a region's ops carry tags it honours (the same
    toy: a mix of SAC regions alone missed by 0.06%). A plan is re-chosen with the measured peaks
    known and the largest miss so far added to every unmeasured mixed plan's peak (the misses of
    plans with a stored layer to those, of plans of regions only to those), up to :data:`CHECKS`
    times; then among the measured plans only. Returns the result, the checked peaks
    (options -> bytes, persistent included), their compiled copies (options -> copy) and a line per
    check (the plan, its predicted and measured peak)."""
    checked: dict[tuple[str, ...], int] = {}
    made: dict[tuple[str, ...], CompiledModel] = {}
    lines: list[str] = []
    margin = region_margin = 0
    for _ in range(CHECKS):
        res = plan_whole(chain, budget_bytes, checked, margin=margin, region_margin=region_margin)
        opts = res.plan.options()
        if len(set(opts)) == 1 or opts in checked:
            return res, checked, made, lines
        tick(f"checking dp's plan: the whole model compiled with {runs_text(opts)}")
        made[opts], step = measure(res.plan)
        checked[opts] = chain.persistent_bytes + max(step.fwd_peak_bytes, step.bwd_peak_bytes)
        predicted = whole_peak(chain, res.plan)
        if STORE in opts:
            margin = max(margin, checked[opts] - predicted)
        else:
            region_margin = max(region_margin, checked[opts] - predicted)
        lines.append(f"{runs_text(opts)}: predicted {predicted:,} B, measured {checked[opts]:,} B"
                     + (" (over the budget)" if budget_bytes is not None and checked[opts] > budget_bytes else ""))
    return plan_whole(chain, budget_bytes, checked, only_measured=True), checked, made, lines


def runs_text(options) -> str:
    """Layers' options as runs: ``0-11 store, 12-23 sac-compute``."""
    out, start = [], 0
    for i in range(1, len(options) + 1):
        if i == len(options) or options[i] != options[start]:
            out.append(f"{start}{'' if i - 1 == start else f'-{i - 1}'} {options[start]}")
            start = i
    return ", ".join(out)
