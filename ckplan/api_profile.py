"""Profiling commands: the meta-pass preflight (:func:`preflight`), a spec's step
(:func:`profile`) and any model's step (:func:`profile_model`), as :class:`ckplan.records.Profile`.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from .arguments import (
    Note,
    Progress,
    check_meta_target,
    check_positive,
    check_train_args,
    compile_options,
    note_or_warn,
    option_names,
    resolve_device,
    tick,
)
from .calibrate import host_bandwidths
from .chainfind import tensor_leaves
from .device_model import DeviceModel, target_device
from .errors import DependencyError, SpecError, UsageError
from .measure import cuda_runtime_bytes, device_info
from .options import OPTIMIZER_ALIASES, Device
from .param_dtype import cast_like_fsdp
from .planner import predicted_peak_none as _predicted_peak_none
from .preflight import available_memory, decide
from .profiler import measure_step
from .records import Profile, Totals
from .sdpa import default_target
from .spec import Spec, batch_bytes, build_model, make_batch, to_loss
from .training import optimizer_memory, optimizer_step_ms
from .units import format_bytes


def preflight(spec: Spec, device: str | Device | None = "auto", *, force: bool = False,
              progress: Progress | None = None, note: Note | None = None, hold: list[str] | None = None):
    """Predict the step's peak with a meta pass and refuse a real-device run that cannot fit.

    Returns the :class:`ckplan.preflight.Verdict`, or None when the peak could not be predicted
    (meta device; a model the meta pass cannot run, e.g. one that reads tensor values: then what
    is known without it, the batch and the parameters, must still fit). Raises
    :class:`UsageError` naming the predicted peak, the available memory and the fixes, unless
    ``force``. ``hold``: the "preflight skipped" note goes there instead of to ``note``, for the
    caller to show only when the real run works (when it fails too, its error says it once).
    """
    dev = resolve_device(device)
    if dev.type not in ("cpu", "cuda"):
        return None
    tick(progress, f"preflight: predicting the peak on the meta device ({spec.name})")
    model = None
    try:
        model = built(spec, "meta")
        args, kwargs = make_batch(spec, "meta")
        # The meta pass follows the attention kernels of the device the run will use.
        meta = profile_model(model, args, kwargs, name=spec.name or type(model).__name__,
                             chain=spec.chain, device="meta", optimizer=spec.train.optimizer,
                             precision=spec.train.precision, accum=spec.train.accum, lr=spec.train.lr,
                             repeats=1, warmup=0, meta_target=dev.type, param_dtype=spec.parallel.param_dtype,
                             reduce_dtype=spec.parallel.reduce_dtype)
    except (SpecError, UsageError, DependencyError):
        raise  # the same mistake would stop the real run: say it now
    except Exception as e:  # the model cannot run on fake tensors; the real run may still work
        text = str(getattr(e, "message", e)).strip()
        first = text.splitlines()[0] if text else ""
        first = first if len(first) <= 240 else first[:240] + "..."
        why = f"the meta pass failed ({type(e).__name__}: {first})"
        _known_part_fits(spec, model, dev.type, why, force, note)
        skipped = f"preflight skipped: {why}, so ckplan cannot tell beforehand whether one step fits on {dev.type}"
        if hold is not None:
            hold.append(skipped)
        else:
            note_or_warn(note, skipped)
        return None
    verdict = decide(meta.totals.predicted_peak_bytes, available_memory(dev), dev.type)
    if not verdict.fits:
        if not force:
            raise UsageError(verdict.message(), tip=verdict.tip())
        note_or_warn(note, f"running anyway (force): {verdict.message()}")
    return verdict


def _known_part_fits(spec: Spec, model, device_type: str, why: str, force: bool, note: Note | None) -> None:
    """When the meta pass fails, what is known without it must still fit: the batch (from its
    shape) and the parameters and buffers (of the meta model, when it was built). Raises
    :class:`UsageError` (unless ``force``) before the real run allocates them."""
    known = spec.input.nbytes()
    what = "the batch"
    if model is not None:
        tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}
        known += sum(t.numel() * t.element_size() for t in tensors.values())
        what = "the parameters, buffers and batch"
    verdict = decide(known, available_memory(device_type), device_type)
    if verdict.fits:
        return
    message = (f"{why}, and {what} alone take {format_bytes(known)} ({format_bytes(verdict.needed_bytes)} with "
               f"the {device_type} allocator's margin), more than the {format_bytes(verdict.available_bytes)} "
               f"available ({verdict.source})")
    if not force:
        raise UsageError(message, tip=verdict.tip())
    note_or_warn(note, f"running anyway (force): {message}")


def built(spec: Spec, device: str) -> torch.nn.Module:
    """The spec's model on ``device``, as one rank computes it: under FSDP2's MixedPrecisionPolicy
    (``parallel.param_dtype``) in that dtype, its inputs cast per unit."""
    model = build_model(spec, device)
    if spec.parallel.param_dtype is not None:
        cast_like_fsdp(model, spec.chain, spec.parallel.param_dtype)
    return model


def profile(spec: Spec, *, device: str | Device | None = "auto", repeats: int = 3, warmup: int = 1,
            force: bool = False, progress: Progress | None = None, note: Note | None = None,
            options: bool | Sequence[str] = False, compile: bool = False,
            meta_target: str | None = None) -> Profile:
    """Build the spec's model and batch on ``device`` and profile one training step.

    On cpu/cuda a meta pass first checks that the step fits (:func:`preflight`); ``force=True``
    runs anyway. ``options``: also measure selective options; ``compile``: measure the chain
    layers compiled (see :func:`profile_model`). ``meta_target`` (``device="meta"`` only): the
    device the fake-tensor profile stands for, 'cpu' or 'cuda' (default: cuda when this machine
    has a GPU, else cpu).
    """
    check_positive("repeats", repeats)
    check_positive("warmup", warmup, minimum=0)
    dev = resolve_device(device)
    meta_target = check_meta_target(meta_target, dev.type)
    held: list[str] = []  # a skipped preflight is said only if the real run works (else its error says it)
    preflight(spec, dev.type, force=force, progress=progress, note=note, hold=held)
    tick(progress, f"building {spec.name} on {dev.type}")
    model = built(spec, str(dev))
    args, kwargs = make_batch(spec, str(dev))
    names = compile_options(option_names(options, compile=compile), compile, dev.type)
    tick(progress, f"profiling one training step of {spec.name} on {dev.type}"
                    + ("" if dev.type == "meta" else f" ({warmup} warm-up, {repeats} timed)")
                    + (f", then {len(names)} selective options" if names else "")
                    + (", then with the chain layers compiled" if compile else ""))
    prof = profile_model(model, args, kwargs, name=spec.name or type(model).__name__, chain=spec.chain,
                         device=dev, optimizer=spec.train.optimizer, precision=spec.train.precision,
                         accum=spec.train.accum, lr=spec.train.lr, repeats=repeats, warmup=warmup,
                         spec=spec.model_dump(mode="json"), options=names, compile=compile,
                         meta_target=meta_target, param_dtype=spec.parallel.param_dtype,
                         reduce_dtype=spec.parallel.reduce_dtype)
    for text in held:
        note_or_warn(note, text)
    return prof


def profile_model(model, args, kwargs, *, name: str, chain: str | None, device, optimizer: str = "adamw",
                  precision: str = "fp32", accum: int = 1, lr: float = 1e-4, repeats: int = 3,
                  warmup: int = 1, spec: dict | None = None, loss_fn=to_loss,
                  meta_target: str | None = None, options: bool | Sequence[str] = False,
                  compile: bool = False, param_dtype: str | None = None,
                  reduce_dtype: str | None = None) -> Profile:
    """Profile any model on a sample batch; the model is not changed.

    On ``device="meta"``, ``meta_target`` ('cpu' or 'cuda'; default: cuda when this machine has
    one, else cpu) is the device whose attention kernels the fake pass follows.
    ``options``: also measure the chain layers' selective options (:mod:`ckplan.sac`; True: all
    of ``POLICIES``, or a list of names), one more measured step (and ``repeats`` timed ones) each.
    ``compile``: measure the chain layers compiled with ``torch.compile`` (:mod:`ckplan.compiled`;
    not on meta), their options compiled in: the plans are then for compiled layers, to be run
    inside ``ckplan.compiled_layers(model)``.
    ``param_dtype``: the model's parameters are in FSDP2's MixedPrecisionPolicy dtype
    (:func:`ckplan.param_dtype.cast_like_fsdp`), recorded for the per-rank model with the
    policy's ``reduce_dtype`` (default fp32).
    """
    check_train_args(optimizer=optimizer, precision=precision, accum=accum)
    if reduce_dtype not in (None, "fp32") and reduce_dtype != param_dtype:
        raise UsageError(f"reduce_dtype={reduce_dtype!r} with param_dtype={param_dtype!r}: the policy's reduce is "
                         "planned in fp32 or in the param dtype", tip="pass reduce_dtype='fp32' or the param dtype")
    optimizer = OPTIMIZER_ALIASES.get(str(optimizer), str(optimizer))
    precision = str(precision)
    dev = torch.device(str(device)) if not isinstance(device, torch.device) else device
    m = measure_step(model, args, kwargs, loss_fn, chain=chain, device=dev, precision=precision,
                     repeats=repeats, warmup=warmup, accum=accum, meta_target=meta_target,
                     options=option_names(options, compile=compile), compile=compile)
    params = list(dict.fromkeys(model.parameters()))
    trainable = [p for p in params if p.requires_grad]
    # On meta the optimizer is the one the target device runs (foreach on CUDA, counters on the host).
    kind, device_model = target_device(meta_target, default_target())
    opt_dev = dev.type if dev.type != "meta" else kind
    priced = device_model if dev.type == "meta" else None
    opt_state, opt_tmp, opt_scalars = optimizer_memory(trainable, optimizer, lr, opt_dev)
    info = device_info(dev)
    runtime = cuda_runtime_bytes(dev, [*params, *(p.grad for p in params), *model.buffers(),
                                      *tensor_leaves((args, kwargs))]) if dev.type == "cuda" else 0
    if dev.type == "meta" and kind == "cuda" and device_model is not None:
        runtime = device_model.runtime_bytes  # the target's cuBLAS workspaces, which fake tensors do not make
    param_bytes = sum(p.untyped_storage().nbytes() for p in params)
    buffer_bytes = sum(b.untyped_storage().nbytes() for b in dict.fromkeys(model.buffers()))
    inputs = batch_bytes(args, kwargs)
    notes = list(m.notes)
    if dev.type == "meta":
        notes += _meta_notes(model, m.notes, device_model, kind, precision, runtime)
    totals = Totals(
        param_bytes=param_bytes, buffer_bytes=buffer_bytes,
        trainable_bytes=sum(p.numel() * p.element_size() for p in trainable),
        grad_bytes=m.grad_bytes, optimizer_bytes=opt_state, optimizer_tmp_bytes=opt_tmp,
        input_bytes=inputs, activation_bytes=sum(r.saved_bytes for r in m.rows)
        + sum(si.bytes for si in m.side_inputs if si.saved_by),
        predicted_peak_bytes=0,
        # With accumulation the measured micro-batch is a later one, which starts with every
        # gradient held (ckplan.profiler): the peak above its start sits on top of them.
        measured_peak_bytes=None if dev.type == "meta" else
        param_bytes + buffer_bytes + inputs + opt_state + runtime + m.measured_peak_rel
        + (m.grad_bytes if accum > 1 else 0),
        optimizer_ms=optimizer_step_ms(trainable, optimizer, lr, dev, priced_by=priced),
        optimizer_scalar_bytes=opt_scalars, runtime_bytes=runtime,
    )
    prof = Profile(
        model=name, device=dev.type, device_name=info.name, chain=m.chain_path,
        chain_detected=m.chain_detected, batch_size=_batch_size(args, kwargs), precision=precision,
        optimizer=optimizer, accum=accum, input_requires_grad=m.input_requires_grad,
        times_estimated=dev.type == "meta", layers=m.rows, totals=totals,
        device_total_bytes=info.total_bytes, device_free_bytes=info.free_bytes,
        notes=tuple(notes), spec=spec or {}, compiled=compile, side_inputs=m.side_inputs,
        chain_breaks=m.chain_breaks, flops_estimated=m.flops_estimated,
        host_bw=_host_link(dev, device_model if kind == "cuda" else None), param_dtype=param_dtype,
        reduce_dtype=(reduce_dtype or "fp32") if param_dtype else None,
    )
    return replace(prof, totals=replace(totals, predicted_peak_bytes=predicted_peak_none(prof)))


def _meta_notes(model, measured_notes, device_model: DeviceModel | None, kind: str, precision: str,
                runtime: int) -> list[str]:
    """What a meta profile says of its times, of the sizes fake tensors cannot know, and of autocast."""
    rnns = sorted({type(mod).__name__ for mod in model.modules() if isinstance(mod, torch.nn.RNNBase)})
    notes = [meta_time_note(device_model) if not rnns else meta_time_note(device_model).replace(
        "sizes and FLOPs are exact", f"sizes and FLOPs are exact but for the {', '.join(rnns)} layers")]
    if rnns:
        notes.append(f"meta device: {', '.join(rnns)} sizes are a lower bound: the device's fused kernel "
                     "(oneDNN's LSTM on a CPU, cuDNN's recurrent kernels on CUDA) keeps a workspace for its "
                     "backward that fake tensors cannot size (an LSTM on a CPU saves about twice the meta "
                     "bytes); profile this model on the device")
    if precision != "fp32":
        notes.append(f"meta device: autocast ({precision}) replayed as {kind}'s autocast casts (torch's own "
                     "rules, asked once per function on fake tensors; ckplan.meta_autocast)")
    if kind == "cuda":
        notes.append(meta_cuda_note(any("memory-efficient" in n for n in measured_notes), runtime,
                                    device_model.name if device_model is not None else "cuda"))
    return notes


def _host_link(dev: torch.device, device_model: DeviceModel | None) -> tuple[float, float]:
    """Pinned host copy bandwidths for activation offload: measured on CUDA (128 MiB each way),
    on meta the GPU target's device model's; none on a CPU."""
    if dev.type == "cuda":
        return host_bandwidths(dev, 128 * 2**20, 5)
    if dev.type == "meta" and device_model is not None and device_model.host_bw > 0:
        return device_model.host_bw, device_model.host_bw
    return 0.0, 0.0


META_TIMES = "meta device: sizes and FLOPs are exact; times "  # how meta_time_note begins, for plan's notes


def meta_time_note(device: DeviceModel | None) -> str:
    """What a meta profile's times are: the device model that priced them, or the assumed rate."""
    if device is None:
        return (META_TIMES + "are estimated from FLOPs at an assumed "
                "100 TFLOP/s (no device model for a CPU: --target FILE from `ckplan calibrate` prices "
                "this machine's ops)")
    return (f"{META_TIMES}come from the {device.name} device model "
            f"(each op's roofline: max of FLOPs at {device.rate('matmul', 'float32') / 1e12:.3g} TFLOP/s "
            f"fp32 matmul x {device.matmul_eff:.3g} (attention x {device.attention_eff:.3g}), bytes at "
            f"{device.memory_bw / 1e9:.4g} GB/s x {device.memory_eff:.3g}, {device.dispatch_ms * 1e3:.3g} us "
            f"dispatch, {device.view_ms * 1e3:.3g} us per view; SAC "
            f"+{device.sac_dispatch_ms * 1e3:.3g} us per op; checkpoint hooks {device.ckpt_hook_ms * 1e3:.3g} us "
            f"per saved tensor and call; {device.source}), not measured")


def meta_cuda_note(efficient_attention: bool, runtime: int = 0, device: str = "cuda") -> str:
    """What a meta profile for a CUDA target counts of the CUDA runtime's own memory, and what it
    leaves out, as measured on an H200."""
    if runtime:
        text = (f"meta device for a CUDA target: the CUDA runtime's own allocator blocks (cuBLAS workspaces "
                f"and cuBLASLt's, for the forward's and the backward's thread) counted as the {device} device model's "
                f"{runtime / 2**20:.1f} MiB (torch's defaults; CUBLAS_WORKSPACE_CONFIG changes them)")
    else:
        text = (f"meta device for a CUDA target: not included are the CUDA runtime's own allocator blocks "
                f"(cuBLAS workspaces, one per thread: 66.0 MiB on an H200 with torch 2.11; the {device} device "
                "model has no runtime_bytes: `ckplan calibrate` on the GPU measures them)")
    if efficient_attention:
        text += ("; not included: the memory-efficient attention backward's workspace (fp32 on an H200: two "
                 "query-sized buffers, 24 MiB per layer backward for gpt2-small at 8 x 512)")
    return text + ("; leave that much room in the budget, or profile on the GPU"
                   if efficient_attention or not runtime else "")


def predicted_peak_none(prof: Profile) -> int:
    """Peak of one step without checkpointing, by the planner's memory model (README)."""
    return _predicted_peak_none(prof)


def _batch_size(args, kwargs) -> int:
    for t in list(args) + list(kwargs.values()):
        if isinstance(t, torch.Tensor) and t.dim() > 0:
            return int(t.shape[0])
    return 1

