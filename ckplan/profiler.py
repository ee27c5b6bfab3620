"""Per-stage costs of one training step, measured with hooks (real tensors) or on fake ones (meta).

Pipeline (torchinfo's shape): resolve the chain -> install hooks -> passes (measured, no-save,
recompute-kept, timed, per option) -> per-stage rows -> notes. Hooks are always removed and the
model restored in ``finally``. The parts live in :mod:`ckplan.profiling`: the windows and what is
counted in them in ``profiling.instrument``, times in ``profiling.timing``, selective options in
``profiling.option_passes``, compiled layers in ``profiling.compiled_passes``.

Known limitations: a chain layer must be called exactly once per step, in order, with the hidden
state as its first tensor argument; work between two layers is billed to the later one; on meta,
times are a device model's (``ckplan.device_model``), and autocast is the target's replayed
(``ckplan.meta_autocast``).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from .chainfind import other_chains, resolve_chain
from .compiled import CompiledLayers
from .device_model import target_device
from .errors import UsageError
from .measure import Clock, KeptFreedMemory
from .measure.meta_kernels import MetaKernelCache
from .profiling.compiled_passes import compiled_layers, compiled_run
from .profiling.instrument import Instrument
from .profiling.notes import chain_breaks, step_notes
from .profiling.option_passes import OptionPass, eager_option_passes, with_options
from .profiling.option_sample import sampled_passes
from .profiling.passes import MeasuredPass, measured_pass, nosave_pass, recompute_kept
from .profiling.rows import stage_rows, with_recompute_memory
from .profiling.step import Step, hooks_installed, model_errors, state_restored, zero_grads
from .profiling.timing import Times, timing_passes
from .records import SideInput, StageRecord
from .sac import check_option, policy_fn
from .sdpa import default_target


@dataclass(frozen=True)
class StepMeasurement:
    """What ``measure_step`` returns: the rows plus the facts that totals need."""

    rows: tuple[StageRecord, ...]
    input_requires_grad: bool
    measured_peak_rel: int  # peak live bytes of forward+backward above the step start
    grad_bytes: int
    chain_path: str
    chain_detected: bool
    notes: tuple[str, ...] = ()  # what the profile assumed (on meta: the attention kernels)
    side_inputs: tuple[SideInput, ...] = ()
    chain_breaks: tuple[int, ...] = ()  # Profile.chain_breaks
    flops_estimated: tuple[str, ...] = ()  # Profile.flops_estimated


def measure_step(model: nn.Module, args: tuple, kwargs: dict, loss_fn, *, chain: str | None,
                 device: torch.device, precision: str = "fp32", repeats: int = 3, warmup: int = 1,
                 accum: int = 1, meta_target: str | None = None,
                 options: tuple[str, ...] = (), compile: bool = False) -> StepMeasurement:
    """Profile one training forward+backward of ``model`` on the batch; the model is left as found.

    ``options`` (names from ckplan.sac.POLICIES) are measured too: per option, one more measured
    step (and ``repeats`` timed ones, not on meta) with every chain layer under that option.

    On meta, attention follows the kernels of the device ``meta_target`` names ("cpu", "cuda", a
    built-in device model or a device profile file; default: cuda when this machine has a GPU,
    else cpu; see ckplan.sdpa), and its device model prices every op's time
    (:mod:`ckplan.device_model`; a CPU without a calibration: FLOPs at an assumed rate).

    ``compile``: the chain layers are measured compiled (:mod:`ckplan.compiled`; see
    :mod:`ckplan.profiling.compiled_passes`).
    """
    kind, device_model = target_device(meta_target, default_target())
    chain_path, container, detected = resolve_chain(model, chain)
    layers = list(container)
    meta = device.type == "meta"
    _check_compile_and_options(device, options, compile)
    compiled = compiled_layers(layers, device) if compile else None
    params = list(dict.fromkeys(model.parameters()))
    step = Step(model, args, kwargs, loss_fn, precision, device, kind if meta else None)
    inst = Instrument(layers, Clock(device))
    kept = KeptFreedMemory(device)
    # On meta, the no-save pass and the options are measured on three layers where the chain's
    # middle layers are one layer (profiling.option_sample), after the plain passes; elsewhere
    # with them, on every layer.
    sampled = meta and compiled is None
    # On meta, below every mode that watches the ops: each meta kernel runs once per shape.
    with MetaKernelCache() if meta else contextlib.nullcontext():
        with kept, model_errors(meta), state_restored(model, params, device), hooks_installed(inst):
            run = _run_passes(inst, step, params, chain_path, compiled, () if sampled else options,
                              repeats=repeats, warmup=warmup, accum=accum, later=sampled)
        sdpa_note = step.sdpa_note  # the attention calls of the plain step, not of an option's
        if sampled:
            _meta_sampled_passes(run, inst, container, step, params, chain_path, options, accum)
    measured = run.measured
    priced = device_model if meta else None
    rows = stage_rows(layers, chain_path, params, measured, run.times, meta, priced)
    if compiled is None:
        rows = with_recompute_memory(rows, run.nosave, measured, run.leftover, run.chained)
    rows = with_options(rows, measured, run.option_passes, meta, priced)
    notes = step_notes(rows, measured, sdpa_note=sdpa_note, option_notes=run.option_notes,
                       flops_estimated=inst.flops_estimated, unsaved_kept=run.nosave[1],
                       kept_memory=kept.active, compiled_graphs=compiled.graphs if compiled is not None else None)
    if step.unasked:
        notes += (f"meta device: torch's autocast could not be asked on fake tensors how it casts "
                  f"{', '.join(sorted(step.unasked)[:8])}; these calls ran in their inputs' precision",)
    breaks, breaks_note = chain_breaks(measured.breaks, len(layers))
    if breaks_note:
        notes += (breaks_note,)
    others = other_chains(model, chain_path) if detected else None
    if others:
        notes += (others,)
    return StepMeasurement(rows, measured.x_in_requires_grad, measured.peak, sum(r.grad_bytes for r in rows),
                           chain_path, detected, notes, measured.side_inputs, breaks,
                           tuple(sorted(inst.flops_estimated)))


def _meta_sampled_passes(run: _Passes, inst: Instrument, container: nn.Module, step: Step,
                         params: list[nn.Parameter], chain_path: str, options: tuple[str, ...], accum: int) -> None:
    """On meta, after the plain passes: the no-save pass and the options on three chain layers where
    that measures the same (``sampled_passes``), else on every layer; then what recomputes leave."""
    got = sampled_passes(inst.layers, container, step, params, step.model, run.measured, options, accum)
    with model_errors(True), state_restored(step.model, params, step.device), hooks_installed(inst):
        if got is not None:
            run.nosave, run.option_passes, run.option_notes = got
        else:
            zero_grads(params)
            run.nosave = nosave_pass(inst, step)
            if options:
                zero_grads(params)
                run.option_passes, run.option_notes = eager_option_passes(inst, step, params, step.model, options,
                                                                          0, accum)
        run.leftover, run.chained = _left_by_recomputes(inst, step, params, chain_path, run.measured, run.nosave)


def _check_compile_and_options(device: torch.device, options: tuple[str, ...], compile: bool) -> None:
    """Fail before anything runs: compiled layers on meta, an unknown option, or one that needs
    compiled layers (mincut-*) without them."""
    if compile and device.type == "meta":
        raise UsageError(f"compiled layers are measured on cpu or cuda (device {device.type!r})",
                         tip="profile on cpu or cuda to compile the layers")
    for name in options:
        check_option(name)
        if not compile:
            policy_fn(name)


@dataclass
class _Passes:
    """What the passes of one profile measured, for the rows and the notes."""

    measured: MeasuredPass
    nosave: tuple[dict[int, int], dict[int, int]]  # passes.nosave_pass: (peaks, kept) per chain layer
    leftover: dict[int, int]  # StageRecord.recompute_kept_bytes
    chained: dict[int, int]  # StageRecord.recompute_chain_kept_bytes
    times: Times
    option_passes: list[OptionPass]
    option_notes: list[str] = field(default_factory=list)


def _left_by_recomputes(inst: Instrument, step: Step, params: list[nn.Parameter], chain_path: str,
                        measured: MeasuredPass, nosave: tuple[dict[int, int], dict[int, int]]):
    """``recompute_kept``'s two readings, run only where a layer keeps something no saved-tensor
    hook sees (a tensor on the module shows up so): only such a layer can leave anything after a
    recompute."""
    loose = any(b for i, b in (*nosave[1].items(), *measured.after_bwd.items()) if 0 <= i < inst.n)
    return recompute_kept(inst, step, params, chain_path, measured.breaks) if loose else ({}, {})


def _run_passes(inst: Instrument, step: Step, params: list[nn.Parameter], chain_path: str,
                compiled: CompiledLayers | None, options: tuple[str, ...], *, repeats: int, warmup: int,
                accum: int, later: bool = False) -> _Passes:
    """Warm-up, then every pass of the profile, in train mode from zero gradients (``later``: the
    no-save and recompute-kept passes are left to the caller, ``_meta_sampled_passes``)."""
    model, meta = step.model, step.device.type == "meta"
    model.train()
    zero_grads(params)
    for _ in range(0 if meta else warmup):
        step.run(inst)
        zero_grads(params)
    if accum > 1:
        # With gradient accumulation every micro-batch after the first finds the gradients
        # already there and adds into them: measure that micro-batch, the one that peaks.
        step.run(inst)
    measured = measured_pass(inst, step, params, model)
    zero_grads(params)
    if later:
        return _Passes(measured, ({}, {}), {}, {}, Times({}, []), [])
    nosave = nosave_pass(inst, step)
    leftover, chained = (({}, {}) if compiled is not None else
                         _left_by_recomputes(inst, step, params, chain_path, measured, nosave))
    if compiled is not None:
        measured, times, option_passes = compiled_run(inst, step, params, model, measured, compiled,
                                                      options, repeats, warmup, accum)
        return _Passes(measured, nosave, leftover, chained, times, option_passes)
    times = Times({}, []) if meta else timing_passes(inst, step, params, repeats)
    option_passes, option_notes = eager_option_passes(inst, step, params, model, options,
                                                      0 if meta else repeats, accum)
    return _Passes(measured, nosave, leftover, chained, times, option_passes, option_notes)
