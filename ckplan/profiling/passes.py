"""The memory passes of a profile: the measured pass (the one that counts: sizes, FLOPs, windows),
the no-save pass (a checkpoint's first forward) and the recompute-kept passes (what a recompute
leaves alive after the backward).

Under autocast, ``cast_bytes`` are the low-precision weight copies a stage's forward makes
(``aten._to_copy`` of a parameter): autocast caches them until its region ends, checkpoint or not.
"""
from __future__ import annotations

import gc
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from .. import meta_autocast
from ..device_model import OpCost
from ..execute import apply_plan
from ..measure import LiveTensorTracker
from ..planner.baselines import cut_at_breaks
from ..planner.plan import Checkpoint, Plan, Store
from ..records import SideInput
from ..sdpa import SdpaOnMeta
from ..training import forward_loss
from .instrument import Instrument
from .meters import Meter
from .opcost import OpCounter
from .readouts import Window
from .step import Step, zero_grads


@dataclass(frozen=True)
class MeasuredPass:
    """What the measured pass saw, per stage where keyed by an int (-1 pre .. n post)."""

    windows: dict[Window, dict]
    peak: int  # peak live bytes of forward+backward above the step start
    saved: dict[int, int]  # saved-for-backward bytes still alive when the forward ends
    out_bytes: dict[int, int]  # storage bytes of each chain layer's output
    x_in_bytes: int
    x_in_requires_grad: bool
    grad_window: dict[int, int]  # id(parameter) -> stage whose backward first holds its gradient
    cast_bytes: dict[int, int]  # autocast's weight copies first made in the stage's forward
    # per stage, gradient shares summed between backwards (GradShares.held): made, done
    grads_held: tuple[dict[int, int], dict[int, int]] = field(default_factory=lambda: ({}, {}))
    casts_unkept: dict[int, int] = field(default_factory=dict)  # of those, gone when the forward ends
    # every storage a stage's forward made that is alive when the forward ends (saved or not)
    live_at_end: dict[int, int] = field(default_factory=dict)
    side_inputs: tuple[SideInput, ...] = ()
    kept: dict[int, bool | None] = field(default_factory=dict)  # StageRecord.output_kept per stage
    saved_after: dict[int, bool] = field(default_factory=dict)  # StageRecord.output_saved_after
    in_place: frozenset[int] = frozenset()  # StageRecord.output_in_place
    changes_input: frozenset[int] = frozenset()  # Instrument.changes_input
    writes_container: frozenset[int] = frozenset()  # Instrument.writes_container
    early_peak: dict[int, int] = field(default_factory=dict)  # StageRecord.early_peak_bytes
    early_op: dict[int, int] = field(default_factory=dict)  # Instrument.early_op: the recompute's last op
    packs: dict[int, int] = field(default_factory=dict)  # Instrument.packs
    early_kept: dict[int, int] = field(default_factory=dict)  # StageRecord.early_kept_bytes
    early: bool = False  # the early_* fields were measured (not in compiled passes)
    lead: dict[int, int] = field(default_factory=dict)  # StageRecord.backward_lead_bytes
    after_bwd: dict[int, int] = field(default_factory=dict)  # StageRecord.kept_after_backward_bytes
    carried: dict[int, int] = field(default_factory=dict)  # SideInputTracker.carried
    breaks: frozenset[int] = frozenset()  # Instrument.breaks
    outside_saved: dict[int, int] = field(default_factory=dict)  # Instrument.outside_saved_at_end
    ops: tuple[OpCost, ...] = ()  # every op of the pass in order (the windows' ``ops`` index it)


def param_and_buffer_storages(params: list[nn.Parameter], model: nn.Module) -> set[int]:
    """Storage ids of the parameters and buffers: persistent memory, never a stage's saved bytes."""
    return {id(p.untyped_storage()) for p in params} | {id(b.untyped_storage()) for b in model.buffers()}


def measured_pass(inst: Instrument, step: Step, params: list[nn.Parameter], model: nn.Module) -> MeasuredPass:
    """The pass that counts: tracker (attribution, CPU/meta bytes), allocator (CUDA), FLOPs."""
    inst.track_saved = True
    inst.excluded = param_and_buffer_storages(params, model)
    # A parameter's gradient first exists in the backward of the last stage that used it in
    # the forward (a tied embedding: in post, where the head uses it, although AccumulateGrad
    # only runs once the embedding's share arrives in pre).
    param_ids = {id(p.untyped_storage()): p for p in params}
    shares = GradShares(param_ids, accumulating=any(p.grad is not None for p in params))
    last_use = shares.last
    # autocast copies a weight to the low precision once per forward and caches the copy until
    # the autocast region ends: an aten._to_copy of a parameter, made under autocast (a copy of
    # a view, FalconLinear's ``weight.T``, is not cached: an ordinary tensor).
    cast_bytes: dict[int, int] = {}
    autocast_on = step.precision != "fp32"

    low = meta_autocast.LOW.get(step.precision)

    def on_op(func, inputs: set[int], new: list[tuple[int, int]], args: tuple, kwargs: dict) -> None:
        phase, stage = inst.current
        if phase != "F":
            return
        used = shares.used(stage, inputs)
        # (torch.is_autocast_enabled() reads False here: autocast's kernel excludes its own key.)
        if (autocast_on and used and new and func is torch.ops.aten._to_copy.default and args
                and meta_autocast.autocast_caches(args[0], kwargs.get("dtype"), low)):
            cast_bytes[stage] = cast_bytes.get(stage, 0) + sum(nbytes for _, nbytes in new)
            inst.cast_keys.update((key, (stage, nbytes)) for key, nbytes in new)
            shares.cached(stage, new)

    tracker = LiveTensorTracker(on_alloc=inst.on_alloc, on_op=on_op, on_free=inst.on_free)
    inst.flops = OpCounter()
    with inst.flops, tracker:
        inst.meter = Meter(step.device, tracker)
        step.run(inst)
        grad_window = {id(p): last_use.get(sid, -1) for sid, p in param_ids.items()
                       if p.grad is not None}
        held_made, held_done = shares.held()
    result = MeasuredPass(
        windows=inst.windows(), peak=max(m.peak for m in inst.marks), saved=inst.saved_at_end,
        out_bytes={i: b + inst.side.carried.get(i, 0) for i, b in inst.out_bytes.items()},
        x_in_bytes=inst.x_in_bytes, x_in_requires_grad=inst.x_in_requires_grad, grad_window=grad_window,
        grads_held=(held_made, held_done),
        cast_bytes=cast_bytes, casts_unkept=dict(inst.casts_unkept), live_at_end=inst.live_at_end,
        side_inputs=inst.side_inputs,
        kept=dict(inst.kept_at_end), after_bwd=dict(inst.live_after_bwd), carried=dict(inst.side.carried),
        breaks=frozenset(inst.breaks), outside_saved=dict(inst.outside_saved_at_end),
        saved_after=dict(inst.saved_after_at_end),
        in_place=frozenset(i for i in inst.aliased if inst.kept_at_end.get(i)),
        changes_input=frozenset(inst.changes_input),
        writes_container=frozenset(inst.writes_container),
        early_peak=dict(inst.early_peak), early_op=dict(inst.early_op), packs=dict(inst.packs),
        early_kept=dict(inst.early_kept_at_end),
        early=True,
        lead=dict(inst.lead), ops=tuple(inst.flops.ops))
    inst.flops_estimated.update(inst.flops.estimated)
    inst.track_saved, inst.flops, inst.meter = False, None, None
    return result


class GradShares:
    """Gradients whose shares several stages' backwards make, summed by autograd before they go
    on: the sum is held from the backward of the last stage that used the tensor in the forward
    to the backward of the first. Two kinds: an autocast copy several stages read (its
    low-precision gradient, summed before the cast's backward), and, when accumulating
    (``.grad`` already there), a parameter several stages use (an embedding tied to the head:
    summed before AccumulateGrad adds it; without accumulation the sum becomes ``.grad``,
    counted in ``grad_bytes``)."""

    def __init__(self, param_ids: dict[int, nn.Parameter], accumulating: bool):
        self.param_ids, self.accumulating = param_ids, accumulating
        self.first: dict[int, int] = {}  # parameter storage -> the first stage using it
        self.last: dict[int, int] = {}  # ... and the last
        self.copies: dict[int, list[int]] = {}  # cached copy's storage -> [made in, last read in, bytes]

    def used(self, stage: int, inputs: set[int]) -> set[int]:
        """Note an op of ``stage``'s forward reading ``inputs``; returns the parameters among them."""
        used = inputs & self.param_ids.keys()
        for sid in used:
            self.last[sid] = stage
            self.first.setdefault(sid, stage)
        for key in inputs & self.copies.keys():
            self.copies[key][1] = stage
        return used

    def cached(self, stage: int, new: list[tuple[int, int]]) -> None:
        for key, nbytes in new:
            self.copies[key] = [stage, stage, nbytes]

    def held(self) -> tuple[dict[int, int], dict[int, int]]:
        """Per stage: the bytes of sums that appear in its backward, and of those completed there."""
        made: dict[int, int] = {}
        done: dict[int, int] = {}
        spans = [(last, first, nbytes) for first, last, nbytes in self.copies.values()]
        if self.accumulating:
            spans += [(self.last[sid], self.first[sid], p.numel() * p.element_size())
                      for sid, p in self.param_ids.items() if sid in self.first and p.grad is not None]
        for last, first, nbytes in spans:
            if first < last:
                made[last] = made.get(last, 0) + nbytes
                done[first] = done.get(first, 0) + nbytes
        return made, done


def nosave_pass(inst: Instrument, step: Step) -> tuple[dict[int, int], dict[int, int]]:
    """Per chain layer: its forward window's peak above the window's start when no op saves
    anything (``StageRecord.nosave_peak_bytes``): a checkpoint's first forward, measured; and the
    bytes it allocated that are still alive when the forward ends (``unsaved_kept_bytes``: kept
    by something no saved-tensor hook sees). The forward runs once more under saved-tensor hooks
    that keep nothing; there is no backward."""
    made_in: dict[int, Window] = {}
    tracker = LiveTensorTracker(on_alloc=lambda key, _: made_in.__setitem__(key, inst.current),
                                on_free=lambda key: made_in.pop(key, None))
    inst.track_saved = False
    try:
        with tracker:
            inst.meter = Meter(step.device, tracker)
            inst.marks.clear()
            inst.mark("F", -1)
            with torch.autograd.graph.saved_tensors_hooks(_keep_nothing, _nothing_kept):
                if step.meta_target is None:
                    loss = forward_loss(step.model, step.args, step.kwargs, step.loss_fn,
                                        step.precision, step.device.type)
                else:
                    with SdpaOnMeta(step.meta_target), meta_autocast.targeting(step.meta_target):
                        loss = forward_loss(step.model, step.args, step.kwargs, step.loss_fn,
                                            step.precision, step.device.type)
            inst.mark("B", inst.n)
            kept: dict[int, int] = {}
            for key, nbytes in tracker.live_storages().items():
                phase, stage = made_in.get(key, ("", -1))
                if phase == "F" and 0 <= stage < inst.n:
                    kept[stage] = kept.get(stage, 0) + nbytes
            del loss
            windows = inst.windows()
    finally:
        inst.meter = None
    peaks = {i: max(0, windows[("F", i)]["peak"] - windows[("F", i)]["live_start"]) for i in range(inst.n)}
    return peaks, kept


def _keep_nothing(t: torch.Tensor) -> None:
    return None


def _nothing_kept(_: None) -> torch.Tensor:  # pragma: no cover - this graph is never backwarded
    raise RuntimeError("the no-save pass has no backward")


def recompute_kept(inst: Instrument, step: Step, params: list[nn.Parameter], chain_path: str,
                   breaks: frozenset[int]) -> tuple[dict[int, int], dict[int, int]]:
    """``StageRecord.recompute_kept_bytes`` and ``recompute_chain_kept_bytes``: what each layer's
    recompute leaves alive after the backward with every layer in its own checkpoint, and, only
    when some layer leaves anything, with the whole chain in one checkpoint (cut at its breaks:
    what a layer leaves when a later layer of its checkpoint holds the recompute's graph)."""
    n = len(inst.layers)
    alone = _recompute_kept_pass(inst, step, params, chain_path, breaks, single=True)
    if not any(alone.values()):
        return alone, {}
    return alone, _recompute_kept_pass(inst, step, params, chain_path, breaks, single=False) if n > 1 else {}


def _recompute_plan(n: int, breaks: frozenset[int], single: bool) -> Plan:
    """Every layer in its own checkpoint (``single``), or the whole chain in one, cut at its breaks."""
    items = (tuple(Checkpoint(i, i + 1, (Store(i),)) for i in range(n)) if single else
             (Checkpoint(0, n, tuple(Store(i) for i in range(n))),))
    return cut_at_breaks(Plan("recompute-kept", n, items), tuple(sorted(breaks)))


def _recompute_hooks(layers: list[nn.Module], current: list[int | None]) -> list:
    """Hooks that set ``current[0]`` to the layer whose recompute (its second call in the step)
    is running, and back to None when a call returns."""
    calls = [0] * len(layers)

    def pre(i):
        def hook(module, args):
            calls[i] += 1
            if calls[i] > 1:  # the second run of the layer in this step: its recompute
                current[0] = i
        return hook

    def post(i):
        def hook(module, args, out):
            current[0] = None
        return hook

    return [h for i, layer in enumerate(layers)
            for h in (layer.register_forward_pre_hook(pre(i)), layer.register_forward_hook(post(i)))]


def _recompute_kept_pass(inst: Instrument, step: Step, params: list[nn.Parameter], chain_path: str,
                         breaks: frozenset[int], single: bool) -> dict[int, int]:
    """Per chain layer: bytes its recompute made that are still alive when the backward is over,
    in one tracked step with every layer in its own checkpoint (``single``) or the whole chain in
    one (cut at its breaks), as ``apply_plan`` runs them. A layer that keeps a tensor of its
    forward on the module (research code's ``self.last_attn = attn``, RecurrentGemma's state)
    keeps the recompute's instead, and the recompute's graph behind it (back through the layers
    recomputed before it in the same checkpoint) until its next forward: no plan without
    checkpoints shows it. Empty when the model cannot run that way."""
    n = len(inst.layers)
    if n < 1:
        return {}
    current: list[int | None] = [None]
    made: dict[int, int] = {}
    tracker = LiveTensorTracker(
        on_alloc=lambda key, _: made.__setitem__(key, current[0]) if current[0] is not None else None,
        on_free=lambda key: made.pop(key, None))
    handles = _recompute_hooks(inst.layers, current)
    plan = _recompute_plan(n, breaks, single)
    inst.paused = True
    out: dict[int, int] = {}
    try:
        with apply_plan(step.model, plan, chain=chain_path), tracker:
            step.run(inst)
            gc.collect()  # cycles a recompute leaves (its frame and hooks) are garbage, not kept
            live = tracker.live_storages()
            # a recompute stopped early never reaches the layer's forward hook, so the layer's
            # backward runs with it still marked: its parameters' gradients are not left by it
            for prm in params:
                if prm.grad is not None:
                    live.pop(id(prm.grad.untyped_storage()), None)
            for key, i in made.items():
                if key in live:
                    out[i] = out.get(i, 0) + live[key]
    except torch.cuda.OutOfMemoryError:
        raise
    except Exception:
        out = {}
    finally:
        inst.paused = False
        for h in handles:
            h.remove()
        zero_grads(params)
    return out
