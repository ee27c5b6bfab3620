"""Selective options (names from ckplan.sac) measured on eager layers: per option, one more
measured step (and ``repeats`` timed ones) with every chain layer under it.

Every chain layer runs under ``ckplan.sac.run_with_option`` (one non-reentrant checkpoint with the
option's SAC policy), exactly as ckplan.execute installs a top-level ``Store(i, option)``, and the
step is measured again. The checkpoint's own saved-tensor hooks hide what the layer keeps from the
instrument's pack hook, so a layer's kept bytes are live bytes: the storages its forward window
made that are still alive when the forward ends (the SAC cache and the output). The recompute is
the second call of the layer's forward (the first is the forward itself), timed by the same clock;
on meta its time is its FLOPs (backward FLOPs with the option minus without) at the assumed rate,
as every meta time is, so ops without FLOPs (pointwise ones) are free there.
"""
from __future__ import annotations

import statistics
from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch
import torch.nn as nn

from ..device_model import DeviceModel, ops_ms
from ..forwards import forwards_replaced
from ..measure import Clock, TrackerLimitExceeded
from ..records import CHAIN, OptionRecord, StageRecord
from ..sac import policy_fn, run_with_option, warm_up
from .instrument import Instrument
from .passes import MeasuredPass, measured_pass
from .readouts import Window
from .step import Step, zero_grads
from .timing import NoWait, meta_ms, smoothed_chain_ms, whole_step_ms

# Devices whose option costs come from whole steps (_option_step_extra_ms): where kernels run
# asynchronously to the CPU. On CPU the windows are the time itself.
WHOLE_STEP_OPTION_COSTS = ("cuda",)


@dataclass(frozen=True)
class OptionPass:
    name: str
    measured: MeasuredPass
    times: dict[Window, list[float]]  # window -> milliseconds of the timed passes
    recompute_ms: dict[int, list[float]]  # chain layer -> its recompute's milliseconds, per timed pass
    # recompute_ms is already all the option adds to the layer's forward+backward (compiled);
    # else that is the recompute plus what SAC's dispatch mode adds around it (_option_cost_ms)
    whole: bool = False
    # CUDA: what the option adds to a whole forward+backward run as training runs it, the device
    # waited for only at the step's ends (_option_step_extra_ms); None elsewhere
    step_extra_ms: float | None = None


class _OptionForward:
    """A chain layer's forward under one option, its recompute (the second call) timed."""

    def __init__(self, fwd, name: str, index: int, clock: Clock, recompute_ms: dict[int, list[float]],
                 step: Step):
        self.fwd, self.name, self.index, self.clock, self.recompute_ms = fwd, name, index, clock, recompute_ms
        self.step = step

    def __call__(self, *args, **kwargs):
        calls = 0

        def timed(*a, **k):
            nonlocal calls
            calls += 1
            if calls == 1:
                return self.fwd(*a, **k)
            t0 = self.clock.now_ms()
            try:  # non-reentrant recompute stops early by raising once it has what it needs
                with self.step.recomputing():
                    return self.fwd(*a, **k)
            finally:
                self.recompute_ms.setdefault(self.index, []).append(self.clock.now_ms() - t0)

        return run_with_option(timed, self.name, *args, **kwargs)


@contextmanager
def _layers_under_option(layers: list[nn.Module], name: str, clock: Clock, step: Step):
    """Every chain layer's forward under option ``name``; yields layer -> recompute times (ms)."""
    recompute_ms: dict[int, list[float]] = {}
    with forwards_replaced(layers, lambda i, fwd: _OptionForward(fwd, name, i, clock, recompute_ms, step)):
        yield recompute_ms


def _option_step_extra_ms(inst: Instrument, step: Step, params: list[nn.Parameter], name: str,
                          rounds: int) -> float:
    """What option ``name`` on every chain layer adds to a step on CUDA: pairs of whole steps,
    plain then under the option, back to back; the difference of the medians (at least 0).
    The per-window times wait for the GPU at every layer, which exposes the CPU time of SAC's
    dispatch modes; in training it runs while the GPU works (gpt2-small, 8 x 512 on an H200:
    windows said 1.96 ms per layer for sac-compute, the steps 0.1 ms)."""
    plain: list[float] = []
    under: list[float] = []
    for _ in range(rounds):
        plain.append(whole_step_ms(inst, step, params))
        with _layers_under_option(inst.layers, name, NoWait(), step):  # type: ignore[arg-type]
            under.append(whole_step_ms(inst, step, params))
    return max(0.0, statistics.median(under) - statistics.median(plain))


def option_pass(inst: Instrument, step: Step, params: list[nn.Parameter], model: nn.Module,
                name: str, repeats: int, accum: int) -> OptionPass:
    """The measured pass (and ``repeats`` timed ones) with every chain layer under option ``name``."""
    policy_fn(name)  # an unknown option fails before anything runs
    with _layers_under_option(inst.layers, name, inst.clock, step) as recompute_ms:
        if accum > 1:
            step.run(inst)  # the measured micro-batch finds the gradients there, as in measure_step
        measured = measured_pass(inst, step, params, model)
        zero_grads(params)
        recompute_ms.clear()
        times: dict[Window, list[float]] = {}
        for _ in range(repeats):
            step.run(inst)
            zero_grads(params)
            for key, w in inst.windows().items():
                times.setdefault(key, []).append(w["ms"])
    extra = _option_step_extra_ms(inst, step, params, name, max(3, repeats)) \
        if step.device.type in WHOLE_STEP_OPTION_COSTS and repeats else None
    return OptionPass(name, measured, times, {i: list(v) for i, v in recompute_ms.items()},
                      step_extra_ms=extra)


def eager_option_passes(inst: Instrument, step: Step, params: list[nn.Parameter], model: nn.Module,
                        options: tuple[str, ...], repeats: int,
                        accum: int) -> tuple[list[OptionPass], list[str]]:
    """One ``option_pass`` per option, and a note per option the model cannot run under."""
    passes: list[OptionPass] = []
    notes: list[str] = []
    warm_up()
    for name in options:
        try:
            passes.append(option_pass(inst, step, params, model, name, repeats, accum))
        except RuntimeError as e:  # SAC refuses the model (an in-place op on a cached output)
            if isinstance(e, (torch.OutOfMemoryError, TrackerLimitExceeded)):
                raise
            zero_grads(params)
            first = str(e).strip().split("\n")[0]
            notes.append(f"option {name!r} left out: the chain layers cannot run under it "
                         f"({type(e).__name__}: {first})")
    return passes, notes


def _option_cost_ms(p: OptionPass, rows: tuple[StageRecord, ...]) -> dict[int, float]:
    """Per chain layer, what option ``p`` adds to its forward+backward: the recompute timed in
    its backward, plus what running under SAC's dispatch mode adds to the forward and to the rest
    of the backward (each at least 0: window under the option minus the plain window; on
    gpt2-small blocks 2-4 ms of forward beside a 4.4 ms `sac-compute` recompute, which alone
    under-priced `dp` by a point), shared within a layer type by forward FLOPs as the layers' own
    times are (``smoothed_chain_ms``): equal layers get equal costs."""
    chain = [r for r in rows if r.role == CHAIN]
    vals = []
    for r in chain:
        i = r.index
        rec = statistics.median(p.recompute_ms[i]) if p.recompute_ms.get(i) else 0.0
        if p.whole:
            vals.append(rec)
            continue
        fwd = p.times.get(("F", i))
        bwd = p.times.get(("B", i))
        more_f = statistics.median(fwd) - r.fwd_ms if fwd else 0.0
        more_b = statistics.median(bwd) - rec - r.bwd_ms if bwd else 0.0
        vals.append(rec + max(0.0, more_f) + max(0.0, more_b))
    if p.step_extra_ms is not None:  # CUDA: the windows' shares of what the whole steps measured
        total = sum(vals)
        if total > 0:
            vals = [v * p.step_extra_ms / total for v in vals]
        else:  # by forward FLOPs
            weights = [r.fwd_flops for r in chain] if any(r.fwd_flops for r in chain) else [1] * len(chain)
            vals = [p.step_extra_ms * w / sum(weights) for w in weights]
    smooth = smoothed_chain_ms([r.type for r in chain], [r.fwd_flops for r in chain], vals)
    return {r.index: v for r, v in zip(chain, smooth)}


def with_options(rows: tuple[StageRecord, ...], plain: MeasuredPass, passes: list[OptionPass],
                 meta: bool, device: DeviceModel | None = None) -> tuple[StageRecord, ...]:
    """The chain rows with one OptionRecord per measured option (on meta with a device model:
    priced by :func:`meta_option_ms`)."""
    if not passes:
        return rows
    costs = {} if meta else {p.name: _option_cost_ms(p, rows) for p in passes}
    out = []
    for r in rows:
        if r.role != CHAIN:
            out.append(r)
            continue
        i = r.index
        opts = []
        for p in passes:
            fw, bw = p.measured.windows[("F", i)], p.measured.windows.get(("B", i))
            bwd_flops = bw["flops"] if bw else 0
            plain_bw = plain.windows.get(("B", i))
            flops = max(0, bwd_flops - (plain_bw["flops"] if plain_bw else 0))
            if meta and device is not None:
                recompute_ms, bwd_ms = meta_option_ms(device, plain, p.measured, i)
            elif meta:
                recompute_ms = meta_ms(flops)
                bwd_ms = meta_ms(bwd_flops)
            else:
                recompute_ms = costs[p.name][i]
                if p.whole:  # compiled: clamped to the forward of its own rounds; the row's is the bound
                    recompute_ms = min(recompute_ms, r.fwd_ms)
                bwd_ms = statistics.median(p.times[("B", i)]) if p.times.get(("B", i)) else r.bwd_ms
            opts.append(OptionRecord(
                name=p.name, saved_bytes=p.measured.live_at_end.get(i, 0),
                recompute_ms=float(recompute_ms), recompute_flops=int(flops), bwd_ms=float(bwd_ms),
                fwd_peak_bytes=fw["peak"], bwd_peak_bytes=bw["peak"] if bw else 0,
                cast_bytes=p.measured.casts_unkept.get(i, 0)))
        out.append(replace(r, options=tuple(opts)))
    return tuple(out)


def meta_option_ms(device: DeviceModel, plain: MeasuredPass, under: MeasuredPass, i: int) -> tuple[float, float]:
    """(what the option adds to layer ``i``'s step, its backward) on ``device``: its forward and
    its backward (which begins with the recompute, every op of the forward replayed through the
    policy) priced with SAC's dispatch, less the plain
    layer's (:func:`ckplan.device_model.ops_ms`: the host's dispatch hides behind the device's
    work until it outlasts it). The option runs in a checkpoint of its own, whose hooks the host
    calls for every tensor the layer saves: once in the forward, twice in the backward (the pack
    in the recompute, the unpack); counted on the plain pass, whose hooks saw them."""
    def priced(m: MeasuredPass, phase: str, sac: bool) -> float:
        w = m.windows.get((phase, i))
        if not w:
            return 0.0
        calls = (1 if phase == "F" else 2) * plain.packs.get(i, 0) if sac else 0  # the frame's hooks see all
        # the forward runs every op under the policy; the backward replays them all (the recompute)
        # before the layer's backward ops, which run plainly
        replayed = len(range(*under.windows[("F", i)]["ops"])) if sac and phase == "B" else 0
        return ops_ms(device, m.ops[slice(*w["ops"])], sac=sac and phase == "F", sac_ops=replayed,
                      host_extra_ms=calls * device.ckpt_hook_ms)

    bwd = priced(under, "B", True)
    extra = max(0.0, bwd - priced(plain, "B", False)) + max(0.0, priced(under, "F", True) - priced(plain, "F", False))
    return extra, bwd
