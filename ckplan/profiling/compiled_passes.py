"""Passes with the chain layers compiled (:mod:`ckplan.compiled`, ``--compile``).

The eager measured pass runs first (FLOPs, gradient windows, autocast's copies: a dispatch mode
would make the compiled layers run eagerly); a pass with the layers compiled then gives the bytes
each saves (attributed as they are packed: arguments and earlier outputs are not the layer's), the
windows' memory (CUDA: the allocator; CPU: the allocator's events from the PyTorch profiler) and,
in the timed passes, the times.

Selective options on compiled layers: a compiled layer stored with option P runs P's SAC compiled
in (``CompiledForward.with_option``), so what it keeps is what its compiled forward saves,
attributed per layer as packed. Its recompute runs inside the compiled backward and cannot be timed
apart: it is the layer's forward+backward time with P minus without, paired per round with a plain
compiled pass run just before (the CPU's step time drifts over a process), the median over rounds
of each layer type's total shared by FLOPs as the layers' own times are (``smoothed_chain_ms``),
within [0, the layer's forward]. FLOPs stay eager's: ``recompute_flops`` is 0.
"""
from __future__ import annotations

import statistics
from contextlib import contextmanager
from dataclasses import replace

import torch
import torch.nn as nn

from ..compiled import CompiledLayers, compile_unavailable
from ..errors import ModelRunError, UsageError
from ..measure import AllocatorTimeline
from .instrument import Instrument
from .meters import Meter, TimelineMeter
from .option_passes import OptionPass
from .passes import MeasuredPass, param_and_buffer_storages
from .readouts import Window
from .step import Step, zero_grads
from .timing import Times, smoothed_chain_ms, timing_passes


def compiled_layers(layers: list[nn.Module], device: torch.device) -> CompiledLayers:
    why = compile_unavailable(device.type)
    if why:
        raise UsageError(f"cannot compile the chain layers: {why}", tip="run without --compile")
    return CompiledLayers(layers)


@contextmanager
def compile_errors():
    """A failure inside torch.compile (Dynamo, AOTAutograd, Inductor) as one ModelRunError."""
    try:
        yield
    except (ModelRunError, UsageError):
        raise
    except torch.cuda.OutOfMemoryError:
        raise
    except Exception as e:
        # Imported here, once something failed: importing torch._dynamo takes seconds.
        from torch._dynamo.exc import TorchDynamoException
        if not isinstance(e, TorchDynamoException):
            raise
        first = (str(e).strip().splitlines() or [""])[0][:300]
        raise ModelRunError(f"torch.compile failed on the chain layers: {type(e).__name__}: {first}",
                            tip="profile without --compile (the plan is then for eager layers)") from e


def compiled_run(inst: Instrument, step: Step, params: list[nn.Parameter], model: nn.Module,
                 eager: MeasuredPass, compiled: CompiledLayers, options: tuple[str, ...], repeats: int,
                 warmup: int, accum: int) -> tuple[MeasuredPass, Times, list[OptionPass]]:
    """After the eager passes: the measured pass, the timed passes and the option passes with the
    chain layers compiled."""
    with compile_errors(), compiled:
        for _ in range(max(1, warmup)):
            step.run(inst)  # compiles (one graph per layer class), then settles
            zero_grads(params)
        if accum > 1:
            step.run(inst)  # measure a later micro-batch, which adds into the gradients, as eager does
        measured = compiled_pass(inst, step, params, model, eager)
        zero_grads(params)
        times = timing_passes(inst, step, params, repeats)
        option_passes = compiled_option_passes(inst, step, params, model, measured, options, repeats, accum)
    return measured, times, option_passes


def compiled_pass(inst: Instrument, step: Step, params: list[nn.Parameter], model: nn.Module,
                  eager: MeasuredPass) -> MeasuredPass:
    """The measured pass with the chain layers compiled, without tracker or FLOP counter: windows'
    bytes from the allocator (CUDA) or the profiler's allocator events (CPU), saved bytes per
    chain layer by first pack (arguments and earlier outputs are not the layer's). FLOPs, gradient
    windows, autocast copies and the pre/post stages' saved bytes stay the eager pass's."""
    inst.track_saved = inst.attribute_on_pack = True
    inst.saved.clear()
    inst.alloc_window.clear()
    inst.seen_in.clear()
    inst.excluded = param_and_buffer_storages(params, model)
    try:
        if step.device.type == "cuda":
            inst.meter = Meter(step.device, None)
            step.run(inst)
        else:
            _run_on_timeline(inst, step)
        windows = inst.windows()
        saved = dict(inst.saved_at_end)
    finally:
        inst.track_saved = inst.attribute_on_pack = False
        inst.meter = None
        inst.seen_in.clear()
    for key, w in windows.items():
        w["flops"] = eager.windows.get(key, {}).get("flops", 0)
    for s in (-1, inst.n):
        saved[s] = eager.saved.get(s, 0)
    # (what a compiled layer's graph saves of its input is not attributed here: boundaries are
    # taken as kept, output_kept None)
    return replace(eager, windows=windows, peak=max(m.peak for m in inst.marks), saved=saved,
                   live_at_end={}, kept={}, in_place=frozenset(), early=False)


def _run_on_timeline(inst: Instrument, step: Step) -> None:
    """CPU: one step with the marks as points of the allocator's timeline, their live and peak
    bytes filled in from it afterwards."""
    timeline = AllocatorTimeline()
    inst.meter = TimelineMeter(timeline)  # type: ignore[assignment]
    with timeline:
        step.run(inst)
    at = timeline.replay()
    if len(at) != len(inst.marks):
        raise ModelRunError(f"the profiler saw {len(at)} of the pass's {len(inst.marks)} marks",
                            tip="profile without --compile")
    for m, (live, peak) in zip(inst.marks, at):
        m.live, m.peak = live, peak


@contextmanager
def _compiled_under_option(layers: list[nn.Module], name: str | None):
    """Every compiled chain layer's forward stored with option ``name`` (None: as installed)."""
    installed = [layer.__dict__["forward"] for layer in layers]
    if name is not None:
        for layer, fwd in zip(layers, installed):
            layer.forward = fwd.with_option(name)
    try:
        yield
    finally:
        for layer, fwd in zip(layers, installed):
            layer.forward = fwd


# Per round: plain (None) or option name -> per chain layer, forward + backward milliseconds.
_Round = dict[str | None, list[float]]


def compiled_option_passes(inst: Instrument, step: Step, params: list[nn.Parameter], model: nn.Module,
                           plain: MeasuredPass, options: tuple[str, ...], repeats: int,
                           accum: int) -> list[OptionPass]:
    """Per option: a warm-up pass (it compiles), the measured pass; then ``max(3, repeats)``
    rounds of a plain compiled pass followed by one pass per option, every chain layer under it."""
    if not options:
        return []
    measured: dict[str, MeasuredPass] = {}
    for name in options:
        with _compiled_under_option(inst.layers, name):
            step.run(inst)  # compiles the option's graph
            zero_grads(params)  # the measured backward makes the gradients, as the plain pass's does
            if accum > 1:
                step.run(inst)  # the measured micro-batch finds the gradients there, as in measure_step
            m = compiled_pass(inst, step, params, model, plain)
        measured[name] = replace(m, live_at_end={i: m.saved.get(i, 0) for i in range(inst.n)})
        zero_grads(params)
    times, rounds = _paired_rounds(inst, step, params, options, max(3, repeats))
    kinds = [type(layer).__name__ for layer in inst.layers]
    flops = [plain.windows[("F", i)]["flops"] + plain.windows.get(("B", i), {}).get("flops", 0)
             for i in range(inst.n)]
    fwd = smoothed_chain_ms(kinds, flops, [statistics.median(times[None][("F", i)]) for i in range(inst.n)])
    out = []
    for name in options:
        extra = _option_extra_ms(name, rounds, kinds, flops)
        recompute = {i: [min(max(0.0, extra[i]), fwd[i])] for i in range(inst.n)}
        out.append(OptionPass(name, measured[name], times[name], recompute, whole=True))
    return out


def _paired_rounds(inst: Instrument, step: Step, params: list[nn.Parameter], options: tuple[str, ...],
                   n_rounds: int) -> tuple[dict[str | None, dict[Window, list[float]]], list[_Round]]:
    """Paired rounds: per round, the plain pass and one pass per option back to back, so a slow
    stretch of the machine shifts both sides of each difference alike. Returns each side's window
    times over all rounds, and per round each side's forward+backward per chain layer."""
    times: dict[str | None, dict[Window, list[float]]] = {None: {}, **{n: {} for n in options}}
    rounds: list[_Round] = []
    for _ in range(n_rounds):
        fb: _Round = {}
        for name in (None, *options):
            with _compiled_under_option(inst.layers, name):
                step.run(inst)
                zero_grads(params)
            windows = inst.windows()
            for key, w in windows.items():
                times[name].setdefault(key, []).append(w["ms"])
            fb[name] = [windows[("F", i)]["ms"] + windows.get(("B", i), {}).get("ms", 0.0) for i in range(inst.n)]
        rounds.append(fb)
    return times, rounds


def _option_extra_ms(name: str, rounds: list[_Round], kinds: list[str], flops: list[int]) -> list[float]:
    """Per chain layer, what option ``name`` adds to its forward+backward: per layer type, the
    median over rounds of the type's summed difference, shared by FLOPs (a type with a FLOP-free
    layer: each layer's own median difference)."""
    extra = [statistics.median(r[name][i] - r[None][i] for r in rounds) for i in range(len(kinds))]
    for kind in dict.fromkeys(kinds):
        idx = [i for i, k in enumerate(kinds) if k == kind]
        total_flops = sum(flops[i] for i in idx)
        if total_flops > 0 and all(flops[i] > 0 for i in idx):
            total = statistics.median(sum(r[name][i] - r[None][i] for i in idx) for r in rounds)
            for i in idx:
                extra[i] = total * flops[i] / total_flops
    return extra
