"""The profile's rows (:class:`ckplan.records.StageRecord`): pre, one per chain layer, post; sizes
from the measured pass, times from the timed ones (on meta: the window's ops priced by the target's
device model, or FLOPs at the assumed rate without one)."""
from __future__ import annotations

import statistics
from dataclasses import replace

import torch.nn as nn

from ..device_model import DeviceModel, ops_ms
from ..measure import unique_storage_bytes
from ..records import CHAIN, POST, PRE, StageRecord
from .passes import MeasuredPass
from .timing import Times, meta_ms, recompute_factor, smoothed_chain_ms, timed_recompute_ms


def stage_rows(layers: list[nn.Module], chain_path: str, params: list[nn.Parameter],
               measured: MeasuredPass, times: Times, meta: bool,
               device: DeviceModel | None = None) -> tuple[StageRecord, ...]:
    """pre, one row per chain layer, post: sizes from the measured pass, times from the timed ones."""
    n = len(layers)
    param_bytes, grad_bytes = _param_and_grad_bytes(layers, params, measured.grad_window)
    shared, done = measured.grads_held
    fwd_med, bwd_med = _window_ms(n, measured, times, meta, device)
    recompute: dict[int, float | None] = {s: None for s in range(n)}
    if not meta:
        recompute = _smooth_chain(layers, measured, times, fwd_med, bwd_med)
    elif device is not None and measured.early:
        recompute = {s: _early_stop_ms(device, measured, s) for s in range(n)}
    rows = []
    for s in range(-1, n + 1):
        fw, bw = measured.windows[("F", s)], measured.windows.get(("B", s))
        role = PRE if s == -1 else POST if s == n else CHAIN
        chain, early = role == CHAIN, role == CHAIN and measured.early
        rows.append(StageRecord(
            index=s,
            name="(pre)" if role == PRE else "(post)" if role == POST else f"{chain_path}.{s}",
            type=role if role != CHAIN else type(layers[s]).__name__,
            role=role,
            param_bytes=param_bytes[s],
            grad_bytes=grad_bytes[s],
            output_bytes=measured.x_in_bytes if role == PRE else 4 if role == POST
            else measured.out_bytes.get(s, 0),
            saved_bytes=measured.saved.get(s, 0),
            fwd_ms=float(fwd_med[s]), bwd_ms=float(bwd_med[s]),
            fwd_flops=int(fw["flops"]), bwd_flops=int(bw["flops"] if bw else 0),
            fwd_tmp_bytes=max(0, fw["peak"] - fw["live_end"]),
            bwd_tmp_bytes=max(0, bw["peak"] - bw["live_start"]) if bw else 0,
            fwd_peak_bytes=fw["peak"],
            bwd_peak_bytes=bw["peak"] if bw else 0,
            cast_bytes=measured.cast_bytes.get(s, 0),
            recompute_ms=recompute.get(s),
            output_kept=measured.kept.get(s) if role != POST else None,
            output_in_place=s in measured.in_place,
            changes_input=s in measured.changes_input,
            # (with several tensors handed on, the flag is the first's: taken as saved after,
            # so a checkpoint ending there frees none of them early, on the safe side)
            output_saved_after=measured.saved_after.get(s) if chain and not measured.carried.get(s) else None,
            # a layer that saves nothing does not run in a recompute that ends with it
            early_peak_bytes=measured.early_peak.get(s, fw["live_start"]) if early else None,
            early_kept_bytes=measured.early_kept.get(s, 0) if early else None,
            backward_lead_bytes=measured.lead.get(s, 0) if early else None,
            shared_grad_bytes=shared.get(s, 0),
            shared_grad_done_bytes=done.get(s, 0),
            unsaved_cast_bytes=measured.casts_unkept.get(s, 0),
        ))
    return tuple(rows)


def _param_and_grad_bytes(layers: list[nn.Module], params: list[nn.Parameter],
                          grad_window: dict[int, int]) -> tuple[dict[int, int], dict[int, int]]:
    """Per stage: its parameters' bytes and their gradients'. Chain layers own theirs; the rest go
    to pre or post by where their gradient appeared."""
    n = len(layers)
    owner: dict[int, int] = {}
    for i, layer in enumerate(layers):
        for p in layer.parameters():
            owner.setdefault(id(p), i)
    param_bytes = {s: 0 for s in range(-1, n + 1)}
    grad_bytes = {s: 0 for s in range(-1, n + 1)}
    for p in params:
        stage = owner.get(id(p))
        if stage is None:
            stage = n if grad_window.get(id(p)) == n else -1
        param_bytes[stage] += unique_storage_bytes(p)
        if id(p) in grad_window:
            grad_bytes[grad_window[id(p)]] += p.numel() * p.element_size()
    return param_bytes, grad_bytes


def _window_ms(n: int, measured: MeasuredPass, times: Times, meta: bool,
               device: DeviceModel | None) -> tuple[dict[int, float], dict[int, float]]:
    """Per stage: forward and backward milliseconds, the medians of the timed passes (on meta:
    the windows' FLOPs at the assumed rate)."""
    fwd_med: dict[int, float] = {}
    bwd_med: dict[int, float] = {}
    for s in range(-1, n + 1):
        fw, bw = measured.windows[("F", s)], measured.windows.get(("B", s))
        if meta and device is not None:  # the device model's price of the window's ops
            fwd_med[s] = ops_ms(device, measured.ops[slice(*fw["ops"])])
            bwd_med[s] = ops_ms(device, measured.ops[slice(*bw["ops"])]) if bw else 0.0
        elif meta:
            fwd_med[s] = meta_ms(fw["flops"])
            bwd_med[s] = meta_ms(bw["flops"] if bw else 0)
        else:
            fwd_med[s] = statistics.median(times.windows[("F", s)])
            bwd_med[s] = statistics.median(times.windows[("B", s)]) if ("B", s) in times.windows else 0.0
    return fwd_med, bwd_med


def _early_stop_ms(device: DeviceModel, measured: MeasuredPass, s: int) -> float:
    """On meta: the price of chain layer ``s`` alone in a checkpoint, whose recompute PyTorch stops
    once the last tensor its forward saved is back (the ops from that pack on are skipped; a
    layer that saves nothing is not run again), with the checkpoint's hooks on the host: three
    calls per tensor the layer saves (``DeviceModel.ckpt_hook_ms``)."""
    start, stop = measured.windows[("F", s)]["ops"]
    hooks = 3 * measured.packs.get(s, 0) * device.ckpt_hook_ms
    return ops_ms(device, measured.ops[start:min(stop, measured.early_op.get(s, start))], host_extra_ms=hooks)


def _smooth_chain(layers: list[nn.Module], measured: MeasuredPass, times: Times,
                  fwd_med: dict[int, float], bwd_med: dict[int, float]) -> dict[int, float | None]:
    """The chain layers' forward and backward medians shared by FLOPs within each layer type
    (``smoothed_chain_ms``, in place), and their recompute times: timed per layer where every
    layer was, else the forward times the step pairs' recompute factor."""
    n = len(layers)
    kinds = [type(layer).__name__ for layer in layers]
    chain = range(n)
    for med, phase in ((fwd_med, "F"), (bwd_med, "B")):
        smooth = smoothed_chain_ms(kinds, [measured.windows[(phase, s)]["flops"]
                                           if (phase, s) in measured.windows else 0 for s in chain],
                                   [med[s] for s in chain])
        med.update(zip(chain, smooth))
    timed = timed_recompute_ms(kinds, [measured.windows[("F", s)]["flops"] for s in chain],
                               [fwd_med[s] for s in chain], times.recompute)
    if timed is None:  # the step pairs' factor: the checkpoints' whole cost, hooks included
        factor = recompute_factor(times.pairs, sum(fwd_med[s] for s in chain))
        timed = [fwd_med[s] * factor for s in chain]
    else:  # the recompute as timed, and on a CPU what the timing does not see: the hooks'
        # calls in the first forward and in the backward (one each per saved tensor) and the
        # checkpoint's own frame
        hook, call = times.ckpt_host_ms
        timed = [t + 2 * measured.packs.get(s, 0) * hook + call for s, t in zip(chain, timed)]
    return dict(zip(chain, timed))


def with_recompute_memory(rows: tuple[StageRecord, ...], nosave: tuple[dict[int, int], dict[int, int]],
                          measured: MeasuredPass, leftover: dict[int, int],
                          chained: dict[int, int]) -> tuple[StageRecord, ...]:
    """The chain rows with what a checkpoint over the layer peaks at and cannot drop, from the
    no-save pass and the recompute-kept passes (eager layers only)."""
    peaks, unsaved = nosave
    return tuple(replace(r, nosave_peak_bytes=peaks.get(r.index),
                         unsaved_kept_bytes=unsaved.get(r.index, 0) + measured.outside_saved.get(r.index, 0),
                         recompute_kept_bytes=leftover.get(r.index, 0),
                         recompute_chain_kept_bytes=chained.get(r.index, 0),
                         kept_after_backward_bytes=measured.after_bwd.get(r.index, 0))
                 if r.role == CHAIN else r
                 for r in rows)
