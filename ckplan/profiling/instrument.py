"""Hooks that cut one forward+backward into per-stage windows and note what each window does.

Stages are what comes before the chain ("pre": embeddings, stem), each chain layer, and what comes
after ("post": head and loss). Forward/backward *windows* are cut by hooks:

* forward: pre starts at the call; layer i starts at its forward pre-hook; post starts when the
  last layer returns and ends when the loss exists;
* backward: post starts at ``loss.backward()``; layer i starts when the gradient of its output
  exists (a tensor hook); pre starts when the gradient of the chain's input exists.

Saved-for-backward bytes (rotor's xbar) come from ``torch.autograd.graph.saved_tensors_hooks``:
every storage autograd saves, still alive when the forward ends, counted once under the stage that
allocated it (the live-tensor tracker knows who allocated what), parameters and buffers excluded.
What the records say per stage is read out by :mod:`ckplan.profiling.readouts`.
"""
from __future__ import annotations

import functools
import weakref
from collections.abc import MutableMapping, MutableSequence
from dataclasses import dataclass, field

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten

from ..chainfind import first_tensor, tensor_leaves
from ..execute import in_place_layer
from ..measure import Clock, storages_of, unique_storage_bytes
from ..records import SideInput
from ..training import forward_loss
from . import readouts
from .flops import FlopCounter
from .meters import Meter
from .opcost import OpCounter
from .readouts import OUTSIDE, Mark, Window
from .side_inputs import SideInputTracker


@dataclass
class Instrument:
    """Hooks that cut one forward+backward into per-stage windows and note what they see."""

    layers: list[nn.Module]
    clock: Clock
    meter: Meter | None = None
    flops: FlopCounter | None = None
    flops_estimated: dict[str, str] = field(default_factory=dict)  # FlopCounter.estimated, all passes
    track_saved: bool = False
    marks: list[Mark] = field(default_factory=list)
    out_bytes: dict[int, int] = field(default_factory=dict)
    x_in_bytes: int = 0
    x_in_requires_grad: bool = False
    alloc_window: dict[int, Window] = field(default_factory=dict)
    saved: dict[int, weakref.ref] = field(default_factory=dict)
    excluded: set[int] = field(default_factory=set)  # storages of parameters and buffers
    current: Window = ("F", -1)  # the window running now
    paused: bool = False  # marks off: a pass timed as a whole (every layer checkpointed)
    # Compiled layers (no tracker): saved storages attributed when first packed (first_seen).
    attribute_on_pack: bool = False
    seen_in: dict[int, tuple[weakref.ref, Window]] = field(default_factory=dict)
    side: SideInputTracker = field(default_factory=SideInputTracker)  # in the measured pass
    side_inputs: tuple[SideInput, ...] = ()
    returned: dict[int, list] = field(default_factory=dict)  # chain layer -> weakrefs to its outputs
    breaks: set[int] = field(default_factory=set)  # layers that did not receive the previous one's output
    # Each boundary's storage (stage -1: the chain input; i: layer i's output), in the measured
    # pass, and whether the plain forward keeps it (``StageRecord.output_kept``).
    out_storage: dict[int, weakref.ref] = field(default_factory=dict)
    kept_at_end: dict[int, bool | None] = field(default_factory=dict)
    saved_at_end: dict[int, int] = field(default_factory=dict)  # readouts.saved_by_stage
    live_at_end: dict[int, int] = field(default_factory=dict)  # readouts.live_by_stage
    # autocast's weight copies (storage key -> (stage, bytes)), noted by the measured pass, and per
    # stage the bytes of those freed once the chain's forward is over (autocast's cache cleared)
    cast_keys: dict[int, tuple[int, int]] = field(default_factory=dict)
    casts_unkept: dict[int, int] = field(default_factory=dict)
    live_after_bwd: dict[int, int] = field(default_factory=dict)
    aliased: set[int] = field(default_factory=set)  # layers returning their input's storage
    # layers whose forward changes a tensor argument in place (``x.mul_(0.5)``), and the
    # arguments' versions at the call of the layer running now
    changes_input: set[int] = field(default_factory=set)
    in_versions: list = field(default_factory=list)
    # layers that put tensors into a container argument (Gemma 4's shared_kv_states), and the
    # containers of the call running now with their contents (ids of the tensors in them)
    writes_container: set[int] = field(default_factory=set)
    containers: list = field(default_factory=list)
    # Early stop (StageRecord.early_*), in the measured pass: the chain layer whose forward is
    # running (between its hooks), the window's peak at its last pack, and per saved storage the
    # layers whose own ops saved it.
    inside: int | None = None
    early_peak: dict[int, int] = field(default_factory=dict)
    early_op: dict[int, int] = field(default_factory=dict)  # ops counted at its last pack (OpCounter)
    packs: dict[int, int] = field(default_factory=dict)  # saved-tensor packs of its own ops (OpCounter)
    packed_by: dict[int, set[int]] = field(default_factory=dict)
    early_kept_at_end: dict[int, int] = field(default_factory=dict)
    outside_saved_at_end: dict[int, int] = field(default_factory=dict)  # readouts.outside_saved_by_stage
    # Per chain layer whose output the forward keeps: whether an op after the layer (the next
    # stage, or the model's code between them) saved it too (StageRecord.output_saved_after).
    saved_after_at_end: dict[int, bool] = field(default_factory=dict)
    # StageRecord.backward_lead_bytes: per packed tensor (id of what pack returned) the chain
    # layer whose own op saved it (None: outside every chain layer), the live bytes at each
    # stage's backward mark, and per chain layer the live bytes above that mark when its backward
    # first unpacked one of its own saved tensors.
    packed_in: dict[int, int | None] = field(default_factory=dict)
    b_live: dict[int, int] = field(default_factory=dict)
    b_early: set[int] = field(default_factory=set)  # B marks made at a first unpack (see unpack)
    lead: dict[int, int] = field(default_factory=dict)

    @property
    def n(self) -> int:
        return len(self.layers)

    def mark(self, phase: str, stage: int) -> None:
        if self.paused:
            return
        live, peak = self.meter.read_and_reset() if self.meter else (0, 0)
        f = self.flops.get_total_flops() if self.flops is not None else 0
        ops = len(self.flops.ops) if isinstance(self.flops, OpCounter) else 0
        self.marks.append(Mark(phase, stage, self.clock.now_ms(), live, peak, f, ops))
        if phase == "B":
            self.b_live[stage] = live
        self.current = (phase, stage)

    def windows(self) -> dict[Window, dict]:
        """(phase, stage) -> {ms, live_start, live_end, peak, flops} of the last step."""
        return readouts.windows(self.marks, self.n)

    def on_alloc(self, key: int, nbytes: int) -> None:
        self.alloc_window[key] = self.current

    def on_free(self, key: int) -> None:
        # The id of a dead storage may be reused (by the wrapper of a storage made before the
        # step, such as the labels, first asked for when an op saves them): forget its window,
        # and which chain layer returned it.
        self.alloc_window.pop(key, None)
        self.side.freed(key)
        cast = self.cast_keys.pop(key, None)
        if cast is not None and self.current[0] == "F" and self.current[1] >= self.n:
            # freed after the chain's forward: by autocast's cache, cleared at the region's end
            self.casts_unkept[cast[0]] = self.casts_unkept.get(cast[0], 0) + cast[1]

    def pack(self, t: torch.Tensor):
        inside = (self.inside if self.track_saved and not self.paused and not self.attribute_on_pack
                  else None)
        if inside is not None and self.meter is not None:
            # every pack counts for the early stop, parameters included
            self.early_peak[inside] = self.meter.peak_now()
        if inside is not None and isinstance(self.flops, OpCounter) and self.track_saved and not self.paused:
            # an op saving its inputs packs them before it runs: a recompute stopping here skips it
            self.early_op[inside] = len(self.flops.ops)
            self.packs[inside] = self.packs.get(inside, 0) + 1
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return t
        k = id(st)
        if self.track_saved and not self.paused and not self.attribute_on_pack and k not in self.excluded:
            # who saved it: a chain layer's own ops, or code outside every chain layer
            self.packed_by.setdefault(k, set()).add(OUTSIDE if inside is None else inside)
        if k not in self.excluded:
            ref = self.saved.get(k)
            if ref is None or ref() is None:
                self.saved[k] = weakref.ref(st)
                if self.attribute_on_pack:
                    self.first_seen(st, self.current)
        # Detached: the same storage, without the grad_fn. An op's output saved by that op and
        # returned as itself would hold its own node (tensor -> grad_fn -> packed tensor), a
        # cycle only the garbage collector frees: a branch the loss does not use (BigBird's
        # pooler under a masked-LM head: its tanh output) then stayed alive in the profiled step
        # and was billed as held for backward, where the plain step frees it at once.
        d = t.detach()
        if self.track_saved and not self.paused:
            self.packed_in[id(d)] = inside  # every pack: ids of dead entries may be reused
        return d

    def unpack(self, t: torch.Tensor) -> torch.Tensor:
        i = self.packed_in.get(id(t)) if self.track_saved and not self.paused else None
        if (i is not None and 0 <= i < self.n and i not in self.b_live and self.current[0] == "B"
                and self.current[1] > i):
            # Layer i's backward has begun before its first output's gradient is complete: it
            # hands the next stage more than one tensor, and the gradient of another (a second
            # stream) reached its ops first. Its window starts here, not in the later stage's.
            self.b_early.add(i)
            self.mark("B", i)
        if i is not None and i not in self.lead and i in self.b_live and self.meter is not None:
            self.lead[i] = max(0, self.meter.live_now() - self.b_live[i])
        return t

    def first_seen(self, st: torch.UntypedStorage, window: Window) -> None:
        """Without a tracker (compiled layers), a saved storage belongs to the window that first
        saved it, unless it came into the window as an argument or left an earlier one as an output."""
        k = id(st)
        seen = self.seen_in.get(k)
        if seen is None or seen[0]() is not st:
            self.seen_in[k] = (weakref.ref(st), window)
            self.alloc_window[k] = window

    def install(self) -> list:
        handles = []
        for i, layer in enumerate(self.layers):
            handles.append(layer.register_forward_pre_hook(self._pre_hook(i), with_kwargs=True))
            handles.append(layer.register_forward_hook(self._post_hook(i), with_kwargs=True))
        return handles

    def _pre_hook(self, i: int):
        def hook(module, args, kwargs):
            if self.attribute_on_pack and not self.paused:
                for st in storages_of((args, kwargs)):
                    self.first_seen(st, ("in", i))
            if self.track_saved and not self.paused:
                self.side.note(i, args, kwargs, self.alloc_window, self.excluded)
                if i > 0 and not self._receives_output_of(i - 1, args, kwargs):
                    self._chain_break(i, args, kwargs)
            if i == 0:
                self._chain_input(args, kwargs)
            if self.track_saved and not self.paused:
                self.in_versions = [(t, t._version) for t in tensor_leaves((args, kwargs))]
                self.containers = [(c, _contents(c)) for c in _containers((args, kwargs))]
            self.mark("F", i)
            self.inside = i
        return hook

    def _chain_break(self, i: int, args, kwargs) -> None:
        """Layer ``i`` did not receive layer ``i - 1``'s output. The boundary is what this layer
        receives, made by the model's code from the previous layer's output in that layer's
        window: a checkpoint ending there leaves it, and a stored layer here saves it (not the
        output itself)."""
        self.breaks.add(i)
        x = first_tensor((args, kwargs))
        if x is not None:
            self.out_storage[i - 1] = weakref.ref(x.untyped_storage())
            self.out_bytes[i - 1] = unique_storage_bytes(x)

    def _chain_input(self, args, kwargs) -> None:
        """Layer 0 is called: the chain input's bytes, and the backward mark of pre at its gradient."""
        x = first_tensor((args, kwargs))
        if x is None:
            return
        if self.track_saved and not self.paused:
            self.out_storage[-1] = weakref.ref(x.untyped_storage())
        self.x_in_bytes = unique_storage_bytes(x)
        self.x_in_requires_grad = x.requires_grad
        if x.requires_grad:
            x.register_hook(lambda g: self.mark("B", -1))

    def _post_hook(self, i: int):
        def hook(module, args, kwargs, out):
            self.inside = None
            if self.attribute_on_pack and not self.paused:
                # made here: saved later (by the next stage), it is this layer's, as the eager
                # pass counts a tensor in the window that allocated it
                for st in storages_of(out):
                    self.first_seen(st, ("F", i))
            if self.track_saved and not self.paused:
                if any(t._version != v for t, v in self.in_versions) and not in_place_layer(module):
                    self.changes_input.add(i)
                self.in_versions = []
                if any(_contents(c) != before for c, before in self.containers):
                    self.writes_container.add(i)
                self.containers = []
                self.side.returned(i, out)
                self.returned[i] = [weakref.ref(t) for t in tensor_leaves(out)]
            y = first_tensor(out)
            if y is not None and self.track_saved and not self.paused:
                self.out_storage[i] = weakref.ref(y.untyped_storage())
            if y is not None:
                self.out_bytes[i] = unique_storage_bytes(y)
                if y.requires_grad:
                    y.register_hook(functools.partial(self._backward_starts, i))
            if i == self.n - 1:
                self.mark("F", self.n)
        return hook

    def _backward_starts(self, i: int, g: torch.Tensor) -> None:
        """The gradient of chain layer ``i``'s output is complete: its backward window starts."""
        if self.track_saved and not self.paused:
            self.side.partials.at_backward(i, g)
        if i not in self.b_early:
            self.mark("B", i)

    def _receives_output_of(self, j: int, args, kwargs) -> bool:
        """Whether a tensor in this call's arguments (inside tuples, lists and dicts too) *is* a
        tensor layer ``j`` returned: the rule by which ``apply_plan`` links the layers of one
        checkpoint (ckplan.execute). A model that changes the output between the two calls
        (``h = h + layer(h)``, a skip connection added) breaks the chain there: a checkpoint
        cannot span the two layers."""
        outs = [r() for r in self.returned.get(j, ())]
        outs = [t for t in outs if t is not None]
        return any(a is t for a in tensor_leaves((args, kwargs)) for t in outs)

    def run(self, model, args, kwargs, loss_fn, precision, device_type) -> torch.Tensor:
        """One forward+backward with marks at every window; returns the loss, detached."""
        self._clear()
        self.mark("F", -1)
        if self.track_saved:
            with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
                loss = forward_loss(model, args, kwargs, loss_fn, precision, device_type)
        else:
            loss = forward_loss(model, args, kwargs, loss_fn, precision, device_type)
        self.mark("B", self.n)
        self._forward_ended()
        if self.track_saved:
            self.side.partials.install(loss, lambda: self.current)
        loss.backward()
        self.mark("end", self.n)
        if self.track_saved:
            self.side_inputs = self.side.summary()
            # what each forward made that outlives its backward while the graph lives (ctx
            # attributes, module caches): StageRecord.kept_after_backward_bytes
            self.live_after_bwd = readouts.live_by_stage(self.alloc_window, self._tracker())
        self.packed_in.clear()
        return loss.detach()

    def _clear(self) -> None:
        """Before a step: forget what the previous step noted (the saved storages and their
        windows stay: ids of dead storages are checked against their weakrefs)."""
        self.marks.clear()
        self.side.clear()
        self.returned.clear()
        self.breaks.clear()
        self.out_storage.clear()
        self.aliased.clear()
        self.changes_input.clear()
        self.writes_container.clear()
        self.early_peak.clear()
        self.early_op.clear()
        self.packs.clear()
        self.packed_by.clear()
        self.inside = None
        self.packed_in.clear()
        self.cast_keys.clear()
        self.casts_unkept.clear()
        self.b_live.clear()
        self.b_early.clear()
        self.lead.clear()

    def _tracker(self):
        return self.meter.tracker if self.meter is not None else None

    def _forward_ended(self) -> None:
        """At the end of the forward, with the graph alive: what each stage left for backward."""
        if not self.track_saved:
            self.saved_at_end, self.live_at_end, self.kept_at_end = {}, {}, {}
            self.saved_after_at_end, self.early_kept_at_end, self.outside_saved_at_end = {}, {}, {}
            return
        moved = self.side.forward_ended(self.packed_by, self.alloc_window)  # side inputs' bytes now
        saved = {k: ref for k, ref in self.saved.items() if k not in moved}
        self.saved_at_end = readouts.saved_by_stage(saved, self.alloc_window)
        self.live_at_end = readouts.live_by_stage(self.alloc_window, self._tracker())
        self.kept_at_end, self.aliased = readouts.kept_boundaries(
            self.out_storage, self.alloc_window, self.saved, self._tracker())
        self.saved_after_at_end = readouts.saved_after(self.kept_at_end, self.out_storage, self.packed_by)
        self.early_kept_at_end = readouts.early_kept_by_stage(saved, self.alloc_window, self.packed_by)
        self.outside_saved_at_end = readouts.outside_saved_by_stage(
            saved, self.alloc_window, self.packed_by, self.out_storage, self.n)


def _containers(obj) -> list:
    """The mutable containers among a call's arguments that pytree keeps whole (a UserDict)."""
    return [v for v in tree_flatten(obj)[0]
            if isinstance(v, (MutableMapping, MutableSequence)) and not isinstance(v, torch.Tensor)]


def _contents(container) -> list[int]:
    """Ids of the tensors a container holds now."""
    values = container.values() if isinstance(container, MutableMapping) else container
    return [id(t) for t in tensor_leaves(list(values))]
