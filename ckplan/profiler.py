"""Per-stage costs of one training step, measured with hooks (real tensors) or on fake ones (meta).

Pipeline (torchinfo's shape): resolve the chain -> install hooks -> run forward+backward ->
per-stage rows -> totals. Hooks are always removed and the model restored in ``finally``.

Stages are what comes before the chain ("pre": embeddings, stem), each chain layer, and what comes
after ("post": head and loss). Forward/backward *windows* are cut by hooks:

* forward: pre starts at the call; layer i starts at its forward pre-hook; post starts when the
  last layer returns and ends when the loss exists;
* backward: post starts at ``loss.backward()``; layer i starts when the gradient of its output
  exists (a tensor hook); pre starts when the gradient of the chain's input exists.

Saved-for-backward bytes (rotor's xbar) come from ``torch.autograd.graph.saved_tensors_hooks``:
every storage autograd saves, still alive when the forward ends, counted once under the stage that
allocated it (the live-tensor tracker knows who allocated what), parameters and buffers excluded.
Under autocast, ``cast_bytes`` are the low-precision weight copies a stage's forward makes
(``aten._to_copy`` of a parameter): autocast caches them until its region ends, checkpoint or not.

Selective options (``options=``, names from ckplan.sac): per option one more measured step (and
``repeats`` timed ones) with every chain layer under it, as ckplan.execute runs ``Store(i, option)``.
A layer's kept bytes are then live bytes (what its forward window made that is alive when the
forward ends), since the checkpoint's saved-tensor hooks hide the SAC cache from pack hooks; its
recompute time is the clock around the recompute (on meta: the recomputed FLOPs at the assumed rate,
so ops without FLOPs, pointwise ones, are free there). See ``_option_pass``.

Times (cpu/cuda): each window is the median of ``repeats`` timed passes. Chain layers of one type
whose layers all have FLOPs then share that type's measured total in proportion to their FLOPs,
so equal layers (transformer blocks) get bit-equal costs and the DP's plan does not follow timing
noise from one profile to the next. Each timed pass is paired with one where every chain layer
runs in its own checkpoint; the median of (checkpointed - plain) / chain forward is the
*recompute factor* (recomputing in backward need not cost what the first forward's window
measured), and ``recompute_ms`` = factor * ``fwd_ms`` per chain layer.

On meta, ``F.scaled_dot_product_attention`` runs the kernel the target device would choose
(ckplan.sdpa: fused kernels keep a logsumexp, the math path the attention matrix).

Known limitations: a chain layer must be called exactly once per step, in order, with the hidden
state as its first tensor argument; work between two layers is billed to the later one; on meta,
times are FLOPs divided by an assumed rate (``ASSUMED_FLOPS_PER_S``), and autocast is not modelled.
"""
from __future__ import annotations

import functools
import gc
import statistics
import time
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

import torch
import torch.nn as nn

from .chainfind import first_tensor, resolve_chain, tensor_leaves
from .errors import ModelRunError, UsageError, first_line
from .execute import apply_plan, spans_layers
from .measure import (
    KEPT_MEMORY_NOTE,
    AllocatorTimeline,
    Clock,
    KeptFreedMemory,
    LiveTensorTracker,
    TrackerLimitExceeded,
    storages_of,
    unique_storage_bytes,
)
from .profiling.flops import FlopCounter, estimated_note
from .records import CHAIN, POST, PRE, OptionRecord, SideInput, StageRecord
from .sac import check_option, policy_fn, run_with_option
from .sdpa import TARGETS, SdpaOnMeta, default_target
from .training import forward_loss
from .units import format_bytes

# packed_by's mark for a tensor saved outside every chain layer (pre, post, the model's own code)
_OUTSIDE = -2
ASSUMED_FLOPS_PER_S = 100e12  # meta-device time estimates: an accelerator at 100 TFLOP/s sustained


@dataclass
class _Mark:
    phase: str  # "F", "B" or "end"
    stage: int  # -1 pre, 0..n-1 chain, n post
    t_ms: float
    live: int  # live bytes at the mark (relative to the step start)
    peak: int  # peak live bytes since the previous mark
    flops: int  # cumulative FLOPs at the mark


class _Meter:
    """Live/peak bytes relative to the step start: the tracker on CPU/meta, the allocator on CUDA."""

    def __init__(self, device: torch.device, tracker: LiveTensorTracker | None):
        self.cuda = device.type == "cuda"
        self.device = device
        self.tracker = tracker
        if self.cuda:
            torch.cuda.synchronize(device)
            self.base = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)

    def read_and_reset(self) -> tuple[int, int]:
        if self.cuda:
            torch.cuda.synchronize(self.device)
            live = torch.cuda.memory_allocated(self.device) - self.base
            peak = torch.cuda.max_memory_allocated(self.device) - self.base
            torch.cuda.reset_peak_memory_stats(self.device)
            return live, peak
        if self.tracker is None:
            return 0, 0
        live, peak = self.tracker.live, self.tracker.peak
        self.tracker.reset_peak()
        return live, peak

    def peak_now(self) -> int:
        """The peak since the last ``read_and_reset``, without resetting it."""
        if self.cuda:
            return torch.cuda.max_memory_allocated(self.device) - self.base
        return self.tracker.peak if self.tracker is not None else 0

    def live_now(self) -> int:
        """Live bytes now, on the scale of the marks."""
        if self.cuda:
            return torch.cuda.memory_allocated(self.device) - self.base
        return self.tracker.live if self.tracker is not None else 0


@dataclass
class _Instrument:
    """Hooks that cut one forward+backward into per-stage windows and note what they see."""

    layers: list[nn.Module]
    clock: Clock
    meter: _Meter | None = None
    flops: FlopCounter | None = None
    flops_estimated: dict[str, str] = field(default_factory=dict)  # FlopCounter.estimated, all passes
    track_saved: bool = False
    marks: list[_Mark] = field(default_factory=list)
    out_bytes: dict[int, int] = field(default_factory=dict)
    x_in_bytes: int = 0
    x_in_requires_grad: bool = False
    alloc_window: dict[int, tuple[str, int]] = field(default_factory=dict)
    saved: dict[int, weakref.ref] = field(default_factory=dict)
    excluded: set[int] = field(default_factory=set)  # storages of parameters and buffers
    _current: tuple[str, int] = ("F", -1)
    paused: bool = False  # marks off: a pass timed as a whole (every layer checkpointed)
    # Compiled layers (no tracker): saved storages attributed when first packed (_first_seen).
    attribute_on_pack: bool = False
    seen_in: dict[int, tuple[weakref.ref, tuple[str, int]]] = field(default_factory=dict)
    # Side inputs (records.SideInput), in the measured pass: storages the chain layers receive
    # besides the hidden state, made before the chain or by an earlier layer's forward; those dead
    # when the backward starts.
    # (ref, bytes, layers that received it, the chain layer that made it or -1 for before the chain)
    side_seen: dict[int, tuple[weakref.ref, int, set[int], int]] = field(default_factory=dict)
    side_gone: list = field(default_factory=list)  # side_seen's records whose storage died and whose id was reused
    # chain layer -> bytes of the tensors besides the first it hands to the next layer only
    carried: dict[int, int] = field(default_factory=dict)
    returned: dict[int, list] = field(default_factory=dict)  # chain layer -> weakrefs to its outputs
    breaks: set[int] = field(default_factory=set)  # layers that did not receive the previous one's output
    # storage -> bytes of the gradient its tensors received in the backward (a side input that
    # requires grad: T5's position bias, from a parameter), from a hook on each such tensor
    side_grad: dict[int, int] = field(default_factory=dict)
    _side_kept: list[tuple[tuple[int, ...], int, int, int]] = field(default_factory=list)
    chain_made: dict[int, int] = field(default_factory=dict)  # storage -> the chain layer it left
    side_inputs: tuple[SideInput, ...] = ()
    # Each boundary's storage (stage -1: the chain input; i: layer i's output), in the measured
    # pass, and whether the plain forward keeps it (``StageRecord.output_kept``).
    out_storage: dict[int, weakref.ref] = field(default_factory=dict)
    kept_at_end: dict[int, bool | None] = field(default_factory=dict)
    live_after_bwd: dict[int, int] = field(default_factory=dict)
    aliased: set[int] = field(default_factory=set)  # layers returning their input's storage
    # Early stop (StageRecord.early_*), in the measured pass: the chain layer whose forward is
    # running (between its hooks), the window's peak at its last pack, and per saved storage the
    # layers whose own ops saved it.
    _inside: int | None = None
    early_peak: dict[int, int] = field(default_factory=dict)
    packed_by: dict[int, set[int]] = field(default_factory=dict)
    early_kept_at_end: dict[int, int] = field(default_factory=dict)
    outside_saved_at_end: dict[int, int] = field(default_factory=dict)  # _outside_saved_by_stage
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
        self.marks.append(_Mark(phase, stage, self.clock.now_ms(), live, peak, f))
        if phase == "B":
            self.b_live[stage] = live
        self._current = (phase, stage)

    def on_alloc(self, key: int, nbytes: int) -> None:
        self.alloc_window[key] = self._current

    def on_free(self, key: int) -> None:
        # The id of a dead storage may be reused (by the wrapper of a storage made before the
        # step, such as the labels, first asked for when an op saves them): forget its window,
        # and which chain layer returned it.
        self.alloc_window.pop(key, None)
        self.chain_made.pop(key, None)

    def pack(self, t: torch.Tensor):
        inside = (self._inside if self.track_saved and not self.paused and not self.attribute_on_pack
                  else None)
        if inside is not None and self.meter is not None:
            # every pack counts for the early stop, parameters included
            self.early_peak[inside] = self.meter.peak_now()
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return t
        k = id(st)
        if self.track_saved and not self.paused and not self.attribute_on_pack and k not in self.excluded:
            # who saved it: a chain layer's own ops, or code outside every chain layer
            self.packed_by.setdefault(k, set()).add(_OUTSIDE if inside is None else inside)
        if k not in self.excluded:
            ref = self.saved.get(k)
            if ref is None or ref() is None:
                self.saved[k] = weakref.ref(st)
                if self.attribute_on_pack:
                    self._first_seen(st, self._current)
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
        if (i is not None and 0 <= i < self.n and i not in self.b_live and self._current[0] == "B"
                and self._current[1] > i):
            # Layer i's backward has begun before its first output's gradient is complete: it
            # hands the next stage more than one tensor, and the gradient of another (a second
            # stream) reached its ops first. Its window starts here, not in the later stage's.
            self.b_early.add(i)
            self.mark("B", i)
        if i is not None and i not in self.lead and i in self.b_live and self.meter is not None:
            self.lead[i] = max(0, self.meter.live_now() - self.b_live[i])
        return t

    def _first_seen(self, st: torch.UntypedStorage, window: tuple[str, int]) -> None:
        """Without a tracker (compiled layers), a saved storage belongs to the window that first
        saved it, unless it came into the window as an argument or left an earlier one as an output."""
        k = id(st)
        seen = self.seen_in.get(k)
        if seen is None or seen[0]() is not st:
            self.seen_in[k] = (weakref.ref(st), window)
            self.alloc_window[k] = window

    def _not_made_here(self, obj, i: int) -> None:
        for st in storages_of(obj):
            self._first_seen(st, ("in", i))

    def install(self) -> list:
        handles = []
        for i, layer in enumerate(self.layers):
            handles.append(layer.register_forward_pre_hook(self._pre_hook(i), with_kwargs=True))
            handles.append(layer.register_forward_hook(self._post_hook(i), with_kwargs=True))
        return handles

    def _pre_hook(self, i: int):
        def hook(module, args, kwargs):
            if self.attribute_on_pack and not self.paused:
                self._not_made_here((args, kwargs), i)
            if self.track_saved and not self.paused:
                self._note_side_inputs(i, args, kwargs)
                if i > 0 and not self._receives_output_of(i - 1, args, kwargs):
                    self.breaks.add(i)
                    # The boundary is what this layer receives, made by the model's code from the
                    # previous layer's output in that layer's window: a checkpoint ending there
                    # leaves it, and a stored layer here saves it (not the output itself).
                    x = first_tensor((args, kwargs))
                    if x is not None:
                        self.out_storage[i - 1] = weakref.ref(x.untyped_storage())
                        self.out_bytes[i - 1] = unique_storage_bytes(x)
            if i == 0:
                x = first_tensor((args, kwargs))
                if x is not None and self.track_saved and not self.paused:
                    self.out_storage[-1] = weakref.ref(x.untyped_storage())
                if x is not None:
                    self.x_in_bytes = unique_storage_bytes(x)
                    self.x_in_requires_grad = x.requires_grad
                    if x.requires_grad:
                        x.register_hook(lambda g: self.mark("B", -1))
            self.mark("F", i)
            self._inside = i
        return hook

    def _post_hook(self, i: int):
        def hook(module, args, kwargs, out):
            self._inside = None
            if self.attribute_on_pack and not self.paused:
                # made here: saved later (by the next stage), it is this layer's, as the eager
                # pass counts a tensor in the window that allocated it
                for st in storages_of(out):
                    self._first_seen(st, ("F", i))
            if self.track_saved and not self.paused:
                for st in storages_of(out):
                    self.chain_made.setdefault(id(st), i)
                self.returned[i] = [weakref.ref(t) for t in tensor_leaves(out)]
            y = first_tensor(out)
            if y is not None and self.track_saved and not self.paused:
                self.out_storage[i] = weakref.ref(y.untyped_storage())
            if y is not None:
                self.out_bytes[i] = unique_storage_bytes(y)
                if y.requires_grad:
                    y.register_hook(lambda g: None if i in self.b_early else self.mark("B", i))
            if i == self.n - 1:
                self.mark("F", self.n)
        return hook

    def _receives_output_of(self, j: int, args, kwargs) -> bool:
        """Whether a tensor in this call's arguments (inside tuples, lists and dicts too) *is* a
        tensor layer ``j`` returned: the rule by which ``apply_plan`` links the layers of one
        checkpoint (ckplan.execute). A model that changes the output between the two calls
        (``h = h + layer(h)``, a skip connection added) breaks the chain there: a checkpoint
        cannot span the two layers."""
        outs = [r() for r in self.returned.get(j, ())]
        outs = [t for t in outs if t is not None]
        return any(a is t for a in tensor_leaves((args, kwargs)) for t in outs)

    def _note_side_inputs(self, i: int, args, kwargs) -> None:
        x = first_tensor((args, kwargs))
        hidden = {id(st) for st in storages_of(x)} if x is not None else set()
        for st in storages_of((args, kwargs)):
            k = id(st)
            if k in hidden or k in self.excluded:
                continue
            made = self.alloc_window.get(k)
            if k in self.chain_made:
                by = self.chain_made[k]  # another output of an earlier layer (T5's position bias)
            elif made is None or made == ("F", -1):
                by = -1
            elif made[0] == "F" and 0 <= made[1] < i:
                by = made[1]
            else:
                continue  # made between two layers, outside any layer: not modelled
            seen = self.side_seen.get(k)
            if seen is None or seen[0]() is not st:
                if seen is not None:  # a dead one whose id this storage reuses: keep its record
                    self.side_gone.append((k, seen))
                self.side_seen[k] = (weakref.ref(st), st.nbytes(), {i}, by)
                for t in tensor_leaves((args, kwargs)):
                    if t.requires_grad and storages_of(t) and id(storages_of(t)[0]) == k:
                        t.register_hook(functools.partial(self._side_grad, k))
            else:
                seen[2].add(i)

    def _side_grad(self, key: int, g: torch.Tensor) -> None:
        """A side input's gradient, complete (summed over the layers that read it): the engine
        held it from the backward of the last of them to here, the backward of what made it."""
        self.side_grad[key] = self.side_grad.get(key, 0) + unique_storage_bytes(g)

    def _note_side_kept(self) -> None:
        """At the end of the forward: the side inputs, as (layers, made by, bytes, storage id).
        Bytes only for those no longer alive (nothing saved them: a saved one is in its saver's
        ``saved_bytes``); the living ones are listed for their gradients (``_side_inputs``)."""
        self._side_kept = []
        for k, (ref, nbytes, layers, by) in [*self.side_gone, *self.side_seen.items()]:
            # One made by a chain layer counts when it skips a layer (given to layers after the
            # next one, as T5's position bias is to every later block); a tensor carried from
            # one layer to the next only is chain state, not a side input.
            if nbytes and (by < 0 or max(layers) > by + 1):
                self._side_kept.append((tuple(sorted(layers)), by, nbytes if ref() is None else 0, k))
            elif nbytes and by >= 0:  # a second tensor handed to the next layer: the boundary
                self.carried[by] = self.carried.get(by, 0) + nbytes
        self.side_seen.clear()
        self.side_gone.clear()

    def _side_inputs(self) -> tuple[SideInput, ...]:
        """After the backward: the side inputs, bytes and gradient bytes summed per set of layers
        and maker."""
        by_layers: dict[tuple[tuple[int, ...], int], tuple[int, int]] = {}
        for layers, by, nbytes, k in self._side_kept:
            g = self.side_grad.get(k, 0)
            if nbytes or g:
                b0, g0 = by_layers.get((layers, by), (0, 0))
                by_layers[(layers, by)] = (b0 + nbytes, g0 + g)
        self._side_kept = []
        self.side_grad.clear()
        return tuple(SideInput(b, ls, by, g) for (ls, by), (b, g) in sorted(by_layers.items()))

    def run(self, model, args, kwargs, loss_fn, precision, device_type) -> torch.Tensor:
        self.marks.clear()
        self.side_seen.clear()
        self.side_gone.clear()
        self.carried.clear()
        self.returned.clear()
        self.breaks.clear()
        self.side_grad.clear()
        self.chain_made.clear()
        self.out_storage.clear()
        self.aliased.clear()
        self.early_peak.clear()
        self.packed_by.clear()
        self._inside = None
        self.packed_in.clear()
        self.b_live.clear()
        self.b_early.clear()
        self.lead.clear()
        self.mark("F", -1)
        if self.track_saved:
            with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
                loss = forward_loss(model, args, kwargs, loss_fn, precision, device_type)
        else:
            loss = forward_loss(model, args, kwargs, loss_fn, precision, device_type)
        self.mark("B", self.n)
        if self.track_saved:
            self._note_side_kept()
        self.saved_at_end = self._saved_by_stage() if self.track_saved else {}
        self.live_at_end = self._live_by_stage() if self.track_saved else {}
        self.kept_at_end = self._kept_boundaries() if self.track_saved else {}
        self.saved_after_at_end = self._saved_after() if self.track_saved else {}
        self.early_kept_at_end = self._early_kept_by_stage() if self.track_saved else {}
        self.outside_saved_at_end = self._outside_saved_by_stage() if self.track_saved else {}
        loss.backward()
        self.mark("end", self.n)
        if self.track_saved:
            self.side_inputs = self._side_inputs()
            # what each forward made that outlives its backward while the graph lives (ctx
            # attributes, module caches): StageRecord.kept_after_backward_bytes
            self.live_after_bwd = self._live_by_stage()
        self.packed_in.clear()
        return loss.detach()

    def _saved_by_stage(self) -> dict[int, int]:
        out: dict[int, int] = {}
        for k, ref in self.saved.items():
            st = ref()
            window = self.alloc_window.get(k)
            if st is None or window is None or window[0] != "F":
                continue  # freed already, or not made during this forward (inputs, buffers)
            out[window[1]] = out.get(window[1], 0) + st.nbytes()
        return out

    def _early_kept_by_stage(self) -> dict[int, int]:
        """Per chain layer: bytes of the storages its forward made and its own ops saved, alive
        when the forward ends (what a recompute stopped at its last saved tensor leaves)."""
        out: dict[int, int] = {}
        for k, ref in self.saved.items():
            st = ref()
            window = self.alloc_window.get(k)
            if st is None or window is None or window[0] != "F" or window[1] not in self.packed_by.get(k, ()):
                continue
            out[window[1]] = out.get(window[1], 0) + st.nbytes()
        return out

    def _outside_saved_by_stage(self) -> dict[int, int]:
        """Per chain layer i but the last: bytes of the storages made in its window (the layer
        or the model's code after it, before the next layer) that only code outside every chain
        layer saved (a norm the container applies between layers; PoolFormer's stages between
        the patch embeddings its chain is made of), besides the boundary. A checkpoint over
        layer i does not drop them: they are kept whatever the plan."""
        out: dict[int, int] = {}
        for k, ref in self.saved.items():
            st = ref()
            window = self.alloc_window.get(k)
            if st is None or window is None or window[0] != "F" or not 0 <= window[1] < self.n - 1:
                continue
            who = self.packed_by.get(k, ())
            if not who or any(w != _OUTSIDE for w in who):
                continue
            boundary = self.out_storage.get(window[1])
            if boundary is not None and boundary() is st:
                continue
            out[window[1]] = out.get(window[1], 0) + st.nbytes()
        return out

    def _saved_after(self) -> dict[int, bool]:
        """Per chain layer whose output is kept: whether some op after the layer saved it too,
        or only the layer's own ops did
        (a block ending with a ReLU, read next by a pooling that saves nothing: HF ResNet's last
        stage). A checkpoint ending at such a layer saves nothing inside, so PyTorch frees the
        output once the next stage has read it."""
        out: dict[int, bool] = {}
        for i, kept in self.kept_at_end.items():
            ref = self.out_storage.get(i)
            st = ref() if ref is not None else None
            if i < 0 or not kept or st is None:
                continue
            # made here, or an earlier layer's storage returned in place (the layers before
            # cannot have saved it on the layer's behalf: they ran before it changed it)
            out[i] = any(who == _OUTSIDE or who > i for who in self.packed_by.get(id(st), ()))
        return out

    def _kept_boundaries(self) -> dict[int, bool | None]:
        """Per boundary (-1: the chain input, i: layer i's output) whether the forward keeps it
        for backward: some op saved its storage and it is alive. None where that does not say
        what a plan keeps (the storage was made outside the stage that returned it: an in-place
        or pass-through layer), or it is alive without being saved (referenced elsewhere). The
        chain input made before the forward (the batch itself) is kept: persistent memory."""
        out: dict[int, bool | None] = {}
        for i, ref in self.out_storage.items():
            st = ref()
            if st is None:  # freed already: nothing kept it
                out[i] = False
                continue
            k = id(st)
            made = self.alloc_window.get(k)
            if i == -1 and made is None:
                out[i] = True  # the batch (or a buffer): alive for the whole step anyway
                continue
            if made != ("F", i):
                # Returned in place (ReLU(inplace=True)) or passed through: the storage is the
                # earlier boundary's, already in that stage's saved bytes when some op saved it.
                prev = self.out_storage.get(i - 1)
                same = i >= 0 and prev is not None and prev() is st
                ref_saved = self.saved.get(k)
                out[i] = True if same and ref_saved is not None and ref_saved() is st else None
                if same:
                    self.aliased.add(i)
                continue
            ref_saved = self.saved.get(k)
            if ref_saved is not None and ref_saved() is st:
                out[i] = True
            else:
                tracker = self.meter.tracker if self.meter is not None else None
                live = tracker.live_storages() if tracker is not None else {}
                out[i] = None if k in live else False
        return out

    def _live_by_stage(self) -> dict[int, int]:
        """Bytes of the storages each stage's forward window allocated that are still alive."""
        tracker = self.meter.tracker if self.meter is not None else None
        if tracker is None:
            return {}
        out: dict[int, int] = {}
        for k, nbytes in tracker.live_storages().items():
            window = self.alloc_window.get(k)
            if window is not None and window[0] == "F":
                out[window[1]] = out.get(window[1], 0) + nbytes
        return out

    def windows(self) -> dict[tuple[str, int], dict]:
        """(phase, stage) -> {ms, live_start, live_end, peak, flops} from consecutive marks."""
        order = [(m.phase, m.stage) for m in self.marks if m.phase == "F"]
        expected = [("F", s) for s in range(-1, self.n + 1)]
        if order != expected:
            got = [s for _, s in order[1:-1] if s < self.n]  # (F(n) is marked after the last layer)
            if not got:  # no layer's hooks fired: called as layer.forward(...), not layer(...)
                raise ModelRunError(
                    f"the model never called the {self.n} chain layers as modules: no forward hook of "
                    "theirs fired, so it calls them some other way (`layer.forward(x)` skips PyTorch's "
                    "module hooks, as SqueezeBERT's encoder does), and ckplan can neither measure nor "
                    "checkpoint them there",
                    tip="set `chain:` to a container the model calls as `layer(x)`, or change the "
                        "model's loop to call `layer(...)` instead of `layer.forward(...)`")
            raise ModelRunError(
                f"the chain's layers were not called once each, in order: saw layer calls {got[:12]}"
                f"{'...' if len(got) > 12 else ''} for {self.n} layers",
                tip="set `chain:` to a container whose entries the model calls exactly once per step")
        out = {}
        for a, b in zip(self.marks, self.marks[1:]):
            out[(a.phase, a.stage)] = dict(ms=b.t_ms - a.t_ms, live_start=a.live, live_end=b.live,
                                           peak=max(b.peak, a.live, b.live), flops=b.flops - a.flops)
        return out


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

    On meta, attention follows the kernels that ``meta_target`` ("cpu" or "cuda"; default: cuda
    when this machine has a GPU, else cpu) would run (see ckplan.sdpa); ``notes`` say which.

    ``compile``: the chain layers are measured compiled (:mod:`ckplan.compiled`): after the eager
    measured pass (FLOPs, gradient windows, autocast's copies: a dispatch mode would make the
    compiled layers run eagerly), a pass with the layers compiled gives the bytes each saves
    (attributed as they are packed), the windows' memory (CUDA: the allocator; CPU: the
    allocator's events from the PyTorch profiler) and, in the timed passes, the times.
    """
    if meta_target not in (None, *TARGETS):
        raise UsageError(f"meta_target {meta_target!r} is not one of {', '.join(TARGETS)}",
                         tip="name the device the meta profile stands for: meta_target='cpu' or 'cuda'")
    chain_path, container, detected = resolve_chain(model, chain)
    layers = list(container)
    meta = device.type == "meta"
    if compile and meta:
        raise UsageError(f"compiled layers are measured on cpu or cuda (device {device.type!r})",
                         tip="profile on cpu or cuda to compile the layers")
    for name in options:
        check_option(name)  # an unknown option fails before anything runs
        if not compile:
            policy_fn(name)  # and one that needs compiled layers (mincut-*) without them
    compiled = _compiled_layers(layers, device) if compile else None
    params = list(dict.fromkeys(model.parameters()))
    step = _Step(model, args, kwargs, loss_fn, precision, device,
                 (meta_target or default_target()) if meta else None)
    inst = _Instrument(layers, Clock(device))
    kept = KeptFreedMemory(device)
    option_notes: list[str] = []
    with kept, _model_errors(meta), _state_restored(model, params, device), _hooks_installed(inst):
        model.train()
        _zero(params)
        for _ in range(0 if meta else warmup):
            step.run(inst)
            _zero(params)
        if accum > 1:
            # With gradient accumulation every micro-batch after the first finds the gradients
            # already there and adds into them: measure that micro-batch, the one that peaks.
            step.run(inst)
        measured = _measured_pass(inst, step, params, model)
        _zero(params)
        nosave = _nosave_pass(inst, step)
        # Only a layer that keeps something no saved-tensor hook sees (a tensor on the module
        # shows up so) can leave anything after a recompute: the tracked steps run for those.
        loose = any(b for i, b in (*nosave[1].items(), *measured.after_bwd.items()) if 0 <= i < len(layers))
        leftover, chained = (({}, {}) if compiled is not None or not loose else
                             _recompute_kept(inst, step, params, chain_path, measured.breaks))
        if compiled is not None:
            with _compile_errors(), compiled:
                for _ in range(max(1, warmup)):
                    step.run(inst)  # compiles (one graph per layer class), then settles
                    _zero(params)
                measured = _compiled_pass(inst, step, params, model, measured)
                _zero(params)
                times = _timing_passes(inst, step, params, repeats)
                option_passes = _compiled_option_passes(inst, step, params, model, measured, options,
                                                        repeats, accum)
        else:
            times = _Times({}, []) if meta else _timing_passes(inst, step, params, repeats)
            option_passes = []
            for name in options:
                try:
                    option_passes.append(_option_pass(inst, step, params, model, name,
                                                      0 if meta else repeats, accum))
                except RuntimeError as e:  # SAC refuses the model (an in-place op on a cached output)
                    if isinstance(e, (torch.OutOfMemoryError, TrackerLimitExceeded)):
                        raise
                    _zero(params)
                    first = str(e).strip().split("\n")[0]
                    option_notes.append(f"option {name!r} left out: the chain layers cannot run under it "
                                        f"({type(e).__name__}: {first})")
    rows = _stage_rows(layers, chain_path, params, measured, times, meta)
    if compiled is None:
        rows = tuple(replace(r, nosave_peak_bytes=nosave[0].get(r.index),
                             unsaved_kept_bytes=nosave[1].get(r.index, 0) + measured.outside_saved.get(r.index, 0),
                             recompute_kept_bytes=leftover.get(r.index, 0),
                             recompute_chain_kept_bytes=chained.get(r.index, 0),
                             kept_after_backward_bytes=measured.after_bwd.get(r.index, 0))
                     if r.role == CHAIN else r
                     for r in rows)
    rows = _with_options(rows, measured, option_passes, meta)
    notes: tuple[str, ...] = (step.sdpa_note,) if step.sdpa_note else ()
    notes += tuple(option_notes)
    flop_note = estimated_note(inst.flops_estimated)
    if flop_note:
        notes += (flop_note,)
    unkept = [r for r in rows if r.output_kept is False]
    if unkept:
        names = ", ".join("the chain input" if r.index < 0 else f"layer {r.index}" for r in unkept[:8])
        more = f" and {len(unkept) - 8} more" if len(unkept) > 8 else ""
        notes += (f"outputs no op saves (freed once the next stage has run; a checkpoint starting "
                  f"there keeps them): {names}{more}; their saved bytes leave them out "
                  "(README: memory model)",)
    if compiled is None:
        # Alive when a forward that saves nothing ends (a custom autograd Function keeping a
        # tensor as a ctx attribute, a cache on the module): the saved-tensor hooks do not see
        # it, so a checkpoint does not drop it (StageRecord.unsaved_kept_bytes, modelled).
        loose = {i: b for i, b in nosave[1].items() if b > 0}
        if loose:
            names = ", ".join(f"layer {i} ({format_bytes(b)})" for i, b in list(loose.items())[:8])
            notes += (f"tensors a checkpoint cannot drop (kept with nothing saved: a custom autograd "
                      f"Function's ctx attributes, or a cache): {names}{' and more' if len(loose) > 8 else ''}; "
                      "planned as kept until the backward ends, and checkpointing those layers saves "
                      "less (README: memory model)",)
    if measured.carried:
        # A layer that hands the next one several tensors (two streams, (hidden, residual) pairs):
        # they are one boundary, and its backward starts at the first of their gradients.
        names = ", ".join(f"layer {i} ({format_bytes(b)})" for i, b in list(sorted(measured.carried.items()))[:8])
        more = " and more" if len(measured.carried) > 8 else ""
        notes += (f"{CARRIED_NOTE}: {names}{more}",)
    own = [r.index for r in rows if r.output_saved_after is False]
    if own:
        names = ", ".join(f"layer {i}" for i in own[:8]) + (f" and {len(own) - 8} more" if len(own) > 8 else "")
        notes += (f"outputs saved only by their own layer's ops (nothing after them saves them, so a "
                  f"checkpoint ending there frees them once the next stage has run): {names} "
                  "(README: memory model)",)
    if kept.active:
        notes += (KEPT_MEMORY_NOTE,)
    if compiled is not None:
        notes += (f"chain layers compiled (torch.compile, TorchInductor; {compiled.graphs} graph(s)): "
                  "their saved bytes, memory and times are the compiled layers'; FLOPs are eager's",)
    left = {r.index: r.recompute_kept_bytes for r in rows if r.role == CHAIN and r.recompute_kept_bytes}
    if left:
        names = ", ".join(f"layer {i} ({format_bytes(b)})" for i, b in list(left.items())[:8])
        notes += (f"{LEFT_NOTE}: {names}{' and more' if len(left) > 8 else ''}",)
    outside = {i: b for i, b in sorted(measured.outside_saved.items()) if b > 0}
    if outside and compiled is None:
        names = ", ".join(f"layer {i} ({format_bytes(b)})" for i, b in list(outside.items())[:8])
        notes += (f"{OUTSIDE_NOTE}: {names}{' and more' if len(outside) > 8 else ''}",)
    breaks = tuple(sorted(measured.breaks))
    if not spans_layers() and len(layers) > 1:
        # Plans made here must be what the executor runs here: one-layer checkpoints.
        breaks = tuple(range(1, len(layers)))
        notes += (SPAN_NOTE.format(version=torch.__version__),)
    elif breaks:
        names = ", ".join(str(b) for b in breaks[:12]) + (" ..." if len(breaks) > 12 else "")
        notes += (f"{BREAKS_NOTE}: {names}",)
    return StepMeasurement(rows, measured.x_in_requires_grad, measured.peak, sum(r.grad_bytes for r in rows),
                           chain_path, detected, notes, measured.side_inputs, breaks,
                           tuple(sorted(inst.flops_estimated)))


SPAN_NOTE = ("torch {version}'s checkpoint frames cannot span several layers here (ckplan.execute."
             "spans_layers): every checkpoint is one layer, in the plans and their predicted peaks")
LEFT_NOTE = ("layers whose recompute leaves tensors alive after the backward (a tensor of the forward "
             "kept on the module, as `self.last_attn = attn` does, holds the recompute's graph until "
             "the layer's next forward): planned as kept to the end of the step with the layer's input, "
             "on the safe side (README: known limits)")
OUTSIDE_NOTE = ("tensors the model's own code saves between two chain layers (outside every layer: "
                "a checkpoint does not drop them; planned as kept until the backward ends, and "
                "checkpointing the layer before saves less; README: known limits)")
BREAKS_NOTE = ("layers that do not receive the previous layer's output as an argument (the model "
               "changes it between the two calls: a residual added in the loop, a skip connection): "
               "no checkpoint spans such a boundary, and every plan is cut there; layers")
CARRIED_NOTE = ("layers that hand the next layer more than one tensor (counted together as the "
                "boundary a checkpoint keeps; rotor's model has one tensor per boundary): on such "
                "chains ckplan's tests predict checkpointed plans exactly or within one boundary "
                "tensor, either way (README: known limits); bytes besides the first")


class _Step:
    """One forward+backward of the model through the instrument; on meta, SDPA as on the target."""

    def __init__(self, model, args, kwargs, loss_fn, precision: str, device: torch.device,
                 meta_target: str | None):
        self.model, self.args, self.kwargs, self.loss_fn = model, args, kwargs, loss_fn
        self.precision, self.device, self.meta_target = precision, device, meta_target
        self.sdpa_note = ""
        self.sdpa: SdpaOnMeta | None = None  # the meta attention mode of the step running now

    def run(self, inst: _Instrument) -> None:
        if self.meta_target is None:
            inst.run(self.model, self.args, self.kwargs, self.loss_fn, self.precision, self.device.type)
            return
        sdpa = self.sdpa = SdpaOnMeta(self.meta_target)
        try:
            with sdpa:
                inst.run(self.model, self.args, self.kwargs, self.loss_fn, self.precision, self.device.type)
        finally:
            self.sdpa = None
        self.sdpa_note = sdpa.note()

    @contextmanager
    def recomputing(self):
        """Around a recompute in the backward: the autograd engine does not carry torch-function
        modes into it, so on meta the attention mode is entered again (else the recompute would
        take another SDPA path than the forward and selective checkpointing's cache would miss)."""
        sdpa = self.sdpa
        if sdpa is None or sdpa in _function_modes():
            yield
            return
        with sdpa:
            yield


def _function_modes() -> list:
    from torch.overrides import _get_current_function_mode_stack
    return list(_get_current_function_mode_stack())


def _zero(params: list[nn.Parameter]) -> None:
    for p in params:
        p.grad = None


@contextmanager
def _model_errors(meta: bool):
    """The model's own exceptions as ModelRunError, with the likely fix."""
    try:
        yield
    except ModelRunError:
        raise
    except torch.cuda.OutOfMemoryError as e:
        raise ModelRunError(f"out of GPU memory while profiling: {str(e).splitlines()[0]}",
                            tip="profile with a smaller --batch-size, or with --device meta") from e
    except Exception as e:
        if meta and "meta" in str(e):
            raise ModelRunError(
                f"the model reads tensor values in its forward or backward ({str(e).splitlines()[0]}), "
                "which fake (meta) tensors cannot provide",
                tip="profile it on --device cpu or cuda (with a smaller --batch-size / --seq-len if needed)") from e
        # the model's traceback is this error's __cause__ (the CLI shows it with --debug)
        raise ModelRunError(f"the model raised {type(e).__name__} during the profiled step: "
                            f"{first_line(str(e))}") from e


@contextmanager
def _state_restored(model: nn.Module, params: list[nn.Parameter], device: torch.device):
    """Gradients, buffers (running stats; not on meta), RNG states and train mode as they were."""
    saved_grads = [p.grad for p in params]
    was_training = model.training
    buffers = [] if device.type == "meta" else [(b, b.detach().clone()) for b in model.buffers()]
    rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if device.type == "cuda" else None
    try:
        yield
    finally:
        for p, g in zip(params, saved_grads):
            p.grad = g
        with torch.no_grad():
            for b, v in buffers:
                b.copy_(v)
        torch.set_rng_state(rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
        model.train(was_training)


@contextmanager
def _hooks_installed(inst: _Instrument):
    handles = inst.install()
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@dataclass(frozen=True)
class _MeasuredPass:
    """What the measured pass saw, per stage where keyed by an int (-1 pre .. n post)."""

    windows: dict[tuple[str, int], dict]
    peak: int  # peak live bytes of forward+backward above the step start
    saved: dict[int, int]  # saved-for-backward bytes still alive when the forward ends
    out_bytes: dict[int, int]  # storage bytes of each chain layer's output
    x_in_bytes: int
    x_in_requires_grad: bool
    grad_window: dict[int, int]  # id(parameter) -> stage whose backward first holds its gradient
    cast_bytes: dict[int, int]  # autocast's weight copies first made in the stage's forward
    # every storage a stage's forward made that is alive when the forward ends (saved or not)
    live_at_end: dict[int, int] = field(default_factory=dict)
    side_inputs: tuple[SideInput, ...] = ()
    kept: dict[int, bool | None] = field(default_factory=dict)  # StageRecord.output_kept per stage
    saved_after: dict[int, bool] = field(default_factory=dict)  # StageRecord.output_saved_after
    in_place: frozenset[int] = frozenset()  # StageRecord.output_in_place
    early_peak: dict[int, int] = field(default_factory=dict)  # StageRecord.early_peak_bytes
    early_kept: dict[int, int] = field(default_factory=dict)  # StageRecord.early_kept_bytes
    early: bool = False  # the early_* fields were measured (not in compiled passes)
    lead: dict[int, int] = field(default_factory=dict)  # StageRecord.backward_lead_bytes
    after_bwd: dict[int, int] = field(default_factory=dict)  # StageRecord.kept_after_backward_bytes
    carried: dict[int, int] = field(default_factory=dict)  # _Instrument.carried
    breaks: frozenset[int] = frozenset()  # _Instrument.breaks
    outside_saved: dict[int, int] = field(default_factory=dict)  # _Instrument.outside_saved_at_end


def _recompute_kept(inst: _Instrument, step: _Step, params: list[nn.Parameter], chain_path: str,
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


def _recompute_kept_pass(inst: _Instrument, step: _Step, params: list[nn.Parameter], chain_path: str,
                         breaks: frozenset[int], single: bool) -> dict[int, int]:
    """Per chain layer: bytes its recompute made that are still alive when the backward is over,
    in one tracked step with every layer in its own checkpoint (``single``) or the whole chain in
    one (cut at its breaks), as ``apply_plan`` runs them. A layer that keeps a tensor of its
    forward on the module (research code's ``self.last_attn = attn``, RecurrentGemma's state)
    keeps the recompute's instead, and the recompute's graph behind it (back through the layers
    recomputed before it in the same checkpoint) until its next forward: no plan without
    checkpoints shows it. Empty when the model cannot run that way."""
    from .planner.baselines import cut_at_breaks
    from .planner.plan import Checkpoint, Plan, Store

    n = len(inst.layers)
    if n < 1:
        return {}
    calls = [0] * n
    current: list[int | None] = [None]
    made: dict[int, int] = {}
    tracker = LiveTensorTracker(
        on_alloc=lambda key, _: made.__setitem__(key, current[0]) if current[0] is not None else None,
        on_free=lambda key: made.pop(key, None))

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

    handles = [h for i, layer in enumerate(inst.layers)
               for h in (layer.register_forward_pre_hook(pre(i)), layer.register_forward_hook(post(i)))]
    items = (tuple(Checkpoint(i, i + 1, (Store(i),)) for i in range(n)) if single else
             (Checkpoint(0, n, tuple(Store(i) for i in range(n))),))
    plan = cut_at_breaks(Plan("recompute-kept", n, items), tuple(sorted(breaks)))
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
        _zero(params)
    return out


def _nosave_pass(inst: _Instrument, step: _Step) -> tuple[dict[int, int], dict[int, int]]:
    """Per chain layer: its forward window's peak above the window's start when no op saves
    anything (``StageRecord.nosave_peak_bytes``): a checkpoint's first forward, measured; and the
    bytes it allocated that are still alive when the forward ends (``unsaved_kept_bytes``: kept
    by something no saved-tensor hook sees). The forward runs once more under saved-tensor hooks
    that keep nothing; there is no backward."""
    made_in: dict[int, tuple[str, int]] = {}
    tracker = LiveTensorTracker(on_alloc=lambda key, _: made_in.__setitem__(key, inst._current),
                                on_free=lambda key: made_in.pop(key, None))
    inst.track_saved = False
    try:
        with tracker:
            inst.meter = _Meter(step.device, tracker)
            inst.marks.clear()
            inst.mark("F", -1)
            with torch.autograd.graph.saved_tensors_hooks(_keep_nothing, _nothing_kept):
                if step.meta_target is None:
                    loss = forward_loss(step.model, step.args, step.kwargs, step.loss_fn,
                                        step.precision, step.device.type)
                else:
                    with SdpaOnMeta(step.meta_target):
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


def _measured_pass(inst: _Instrument, step: _Step, params: list[nn.Parameter],
                   model: nn.Module) -> _MeasuredPass:
    """The pass that counts: tracker (attribution, CPU/meta bytes), allocator (CUDA), FLOPs."""
    inst.track_saved = True
    inst.excluded = {id(p.untyped_storage()) for p in params} | {
        id(b.untyped_storage()) for b in model.buffers()}
    # A parameter's gradient first exists in the backward of the last stage that used it in
    # the forward (a tied embedding: in post, where the head uses it, although AccumulateGrad
    # only runs once the embedding's share arrives in pre).
    param_ids = {id(p.untyped_storage()): p for p in params}
    last_use: dict[int, int] = {}
    # autocast copies a weight to the low precision once per forward and caches the copy until
    # the autocast region ends: an aten._to_copy of a parameter, made under autocast.
    cast_bytes: dict[int, int] = {}
    autocast_on = step.precision != "fp32" and step.device.type != "meta"

    def on_op(func, inputs: set[int], new: list[tuple[int, int]]) -> None:
        phase, stage = inst._current
        if phase != "F":
            return
        used = inputs & param_ids.keys()
        for sid in used:
            last_use[sid] = stage
        # (torch.is_autocast_enabled() reads False here: autocast's kernel excludes its own key.)
        if autocast_on and used and new and func is torch.ops.aten._to_copy.default:
            cast_bytes[stage] = cast_bytes.get(stage, 0) + sum(nbytes for _, nbytes in new)

    tracker = LiveTensorTracker(on_alloc=inst.on_alloc, on_op=on_op, on_free=inst.on_free)
    inst.flops = FlopCounter()
    with inst.flops, tracker:
        inst.meter = _Meter(step.device, tracker)
        step.run(inst)
        grad_window = {id(p): last_use.get(sid, -1) for sid, p in param_ids.items()
                       if p.grad is not None}
    result = _MeasuredPass(
        windows=inst.windows(), peak=max(m.peak for m in inst.marks), saved=inst.saved_at_end,
        out_bytes={i: b + inst.carried.get(i, 0) for i, b in inst.out_bytes.items()}, x_in_bytes=inst.x_in_bytes,
        x_in_requires_grad=inst.x_in_requires_grad, grad_window=grad_window, cast_bytes=cast_bytes,
        live_at_end=inst.live_at_end, side_inputs=inst.side_inputs, kept=dict(inst.kept_at_end),
        after_bwd=dict(inst.live_after_bwd), carried=dict(inst.carried), breaks=frozenset(inst.breaks),
        outside_saved=dict(inst.outside_saved_at_end),
        saved_after=dict(inst.saved_after_at_end),
        in_place=frozenset(i for i in inst.aliased if inst.kept_at_end.get(i)),
        early_peak=dict(inst.early_peak), early_kept=dict(inst.early_kept_at_end), early=True,
        lead=dict(inst.lead))
    inst.flops_estimated.update(inst.flops.estimated)
    inst.track_saved, inst.flops, inst.meter = False, None, None
    return result


def _compiled_layers(layers: list[nn.Module], device: torch.device):
    from .compiled import CompiledLayers, compile_unavailable
    why = compile_unavailable(device.type)
    if why:
        raise UsageError(f"cannot compile the chain layers: {why}", tip="run without --compile")
    return CompiledLayers(layers)


@contextmanager
def _compile_errors():
    """A failure inside torch.compile (Dynamo, AOTAutograd, Inductor) as one ModelRunError."""
    try:
        yield
    except (ModelRunError, UsageError):
        raise
    except torch.cuda.OutOfMemoryError:
        raise
    except Exception as e:
        from torch._dynamo.exc import TorchDynamoException
        if not isinstance(e, TorchDynamoException):
            raise
        first = (str(e).strip().splitlines() or [""])[0][:300]
        raise ModelRunError(f"torch.compile failed on the chain layers: {type(e).__name__}: {first}",
                            tip="profile without --compile (the plan is then for eager layers)") from e


class _TimelineMeter:
    """CPU memory of compiled layers: each mark is a point in an :class:`AllocatorTimeline`; the
    live and peak bytes are filled in after the pass (``_compiled_pass``)."""

    tracker = None

    def __init__(self, timeline: AllocatorTimeline):
        self.timeline = timeline

    def read_and_reset(self) -> tuple[int, int]:
        self.timeline.mark()
        return 0, 0


def _compiled_pass(inst: _Instrument, step: _Step, params: list[nn.Parameter], model: nn.Module,
                   eager: _MeasuredPass) -> _MeasuredPass:
    """The measured pass with the chain layers compiled, without tracker or FLOP counter: windows'
    bytes from the allocator (CUDA) or the profiler's allocator events (CPU), saved bytes per
    chain layer by first pack (arguments and earlier outputs are not the layer's). FLOPs, gradient
    windows, autocast copies and the pre/post stages' saved bytes stay the eager pass's."""
    inst.track_saved = inst.attribute_on_pack = True
    inst.saved.clear()
    inst.alloc_window.clear()
    inst.seen_in.clear()
    inst.excluded = {id(p.untyped_storage()) for p in params} | {
        id(b.untyped_storage()) for b in model.buffers()}
    try:
        if step.device.type == "cuda":
            inst.meter = _Meter(step.device, None)
            step.run(inst)
        else:
            timeline = AllocatorTimeline()
            inst.meter = _TimelineMeter(timeline)
            with timeline:
                step.run(inst)
            at = timeline.replay()
            if len(at) != len(inst.marks):
                raise ModelRunError(f"the profiler saw {len(at)} of the pass's {len(inst.marks)} marks",
                                    tip="profile without --compile")
            for m, (live, peak) in zip(inst.marks, at):
                m.live, m.peak = live, peak
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


@dataclass(frozen=True)
class _Times:
    """The timed passes: window -> milliseconds per pass, and per pair of passes the step time
    without checkpoints and with every chain layer checkpointed (same load: run back to back)."""

    windows: dict[tuple[str, int], list[float]]
    pairs: list[tuple[float, float]]
    # chain layer -> its recompute in the checkpointed passes, timed around the call (ms)
    recompute: dict[int, list[float]] = field(default_factory=dict)


# Before the timed passes, plain passes run until the step time stops falling (CPU: the first
# steps of a process fault in fresh pages; BERT-large 1x512 took 15, 11, 7.4, 6.9 ... 6.3 s).
SETTLE_MAX_PASSES = 8
SETTLE_TOLERANCE = 0.05


def _settle(inst: _Instrument, step: _Step, params: list[nn.Parameter]) -> int:
    """Plain passes until one is not faster than the best so far by more than SETTLE_TOLERANCE
    (at most SETTLE_MAX_PASSES); returns how many ran."""
    best = float("inf")
    for k in range(1, SETTLE_MAX_PASSES + 1):
        t0 = inst.clock.now_ms()
        step.run(inst)
        _zero(params)
        ms = inst.clock.now_ms() - t0
        if ms > best * (1 - SETTLE_TOLERANCE):
            return k
        best = min(best, ms)
    return SETTLE_MAX_PASSES


def _timing_passes(inst: _Instrument, step: _Step, params: list[nn.Parameter],
                   repeats: int) -> _Times:
    """With hooks only (no tracker, no FLOP counter): ``repeats`` passes with every chain layer in a
    checkpoint (each layer's recompute timed), then plain passes until the step time settles
    (``_settle``), then ``repeats`` plain passes whose windows are the layers' times. The plain
    passes come last and back to back, as steady training steps run (a plain pass right after a
    checkpointed one ran up to 40% slower on BERT-large, the allocator faulting in fresh pages)."""
    times: dict[tuple[str, int], list[float]] = {}
    recompute: dict[int, list[float]] = {}
    cks: list[float] = []
    for _ in range(repeats):
        ck = _checkpointed_pass(inst, step, params, recompute)
        if ck is None:  # a model that cannot run checkpointed: recompute at fwd_ms
            cks, recompute = [], {}
            break
        cks.append(ck)
    _settle(inst, step, params)
    plains: list[float] = []
    for _ in range(repeats):
        step.run(inst)
        _zero(params)
        plains.append(inst.marks[-1].t_ms - inst.marks[0].t_ms)
        for key, w in inst.windows().items():
            times.setdefault(key, []).append(w["ms"])
    return _Times(times, list(zip(plains, cks)), recompute)


def _checkpointed_pass(inst: _Instrument, step: _Step, params: list[nn.Parameter],
                       recompute: dict[int, list[float]] | None = None) -> float | None:
    """Milliseconds of one forward+backward with every chain layer in its own non-reentrant
    checkpoint (every-k k=1, as the executor runs it): what recomputing every layer really adds.
    Each layer's recompute (the second call of its forward, in the backward) is timed into
    ``recompute``. None when the model fails that way (the profile does not: its times stay the
    windows')."""
    from torch.utils.checkpoint import checkpoint

    saved = []
    got: dict[int, list[float]] = {}
    for i, layer in enumerate(inst.layers):
        own = layer.__dict__.get("forward")
        orig = layer.forward

        def fwd(*args, _orig=orig, _i=i, **kwargs):
            if not torch.is_grad_enabled():
                return _orig(*args, **kwargs)
            calls = 0

            def timed(*a, **k):
                nonlocal calls
                calls += 1
                if calls == 1:
                    return _orig(*a, **k)
                t0 = inst.clock.now_ms()
                try:  # the non-reentrant recompute stops early by raising once it has what it needs
                    return _orig(*a, **k)
                finally:
                    got.setdefault(_i, []).append(inst.clock.now_ms() - t0)

            return checkpoint(timed, *args, use_reentrant=False, preserve_rng_state=True, **kwargs)

        saved.append((layer, own))
        layer.forward = fwd
    inst.paused = True
    try:
        t0 = inst.clock.now_ms()
        step.run(inst)
        ms: float | None = inst.clock.now_ms() - t0
        if recompute is not None:
            for i, v in got.items():
                recompute.setdefault(i, []).extend(v)
    except torch.cuda.OutOfMemoryError:
        raise
    except Exception:
        ms = None
    finally:
        inst.paused = False
        for layer, own in saved:
            if own is None:
                del layer.forward
            else:
                layer.forward = own
        _zero(params)
    return ms


# A measured recompute factor outside these bounds is noise, not a property of the model.
RECOMPUTE_FACTOR_RANGE = (0.25, 2.0)
# The pairs must agree: every pair's factor within this fraction of the median, else 1.0.
RECOMPUTE_FACTOR_SPREAD = 0.25


def recompute_factor(pairs: list[tuple[float, float]], chain_fwd_ms: float) -> float:
    """What recomputing the chain costs per millisecond of its measured forward windows: the
    median over pairs of (checkpointed step - plain step) / chain forward, clamped to
    RECOMPUTE_FACTOR_RANGE. 1.0 (recompute = forward window) without two pairs, or when the
    pairs disagree (shared cores: one noisy difference of two steps must not set every cost)."""
    if len(pairs) < 2 or chain_fwd_ms <= 0:
        return 1.0
    each = [(ck - plain) / chain_fwd_ms for plain, ck in pairs]
    f = statistics.median(each)
    if f <= 0 or any(abs(x - f) > RECOMPUTE_FACTOR_SPREAD * f for x in each):
        return 1.0
    lo, hi = RECOMPUTE_FACTOR_RANGE
    return min(hi, max(lo, f))


def timed_recompute_ms(kinds: list[str], flops: list[int], fwd_ms: list[float],
                       samples: dict[int, list[float]]) -> list[float] | None:
    """Each chain layer's recompute: the median of its recomputes timed in the checkpointed passes
    (the forward as the backward really redoes it, early stop and cold caches included), shared
    within a layer type by FLOPs as forward times are, each within RECOMPUTE_FACTOR_RANGE of its
    forward window. None unless every layer was timed (then the step-pair factor applies)."""
    n = len(fwd_ms)
    if n == 0 or any(not samples.get(i) for i in range(n)):
        return None
    med = smoothed_chain_ms(kinds, flops, [statistics.median(samples[i]) for i in range(n)])
    lo, hi = RECOMPUTE_FACTOR_RANGE
    return [min(hi * f, max(lo * f, m)) for m, f in zip(med, fwd_ms)]


def smoothed_chain_ms(kinds: list[str], flops: list[int], medians: list[float]) -> list[float]:
    """Chain-layer times with the timing noise between layers taken out: within each layer type
    whose layers all have FLOPs, the type's measured total shared in proportion to FLOPs (equal
    layers get bit-equal costs, so the DP's choice among them does not follow noise); layers of
    a type with a FLOP-free layer keep their own median. Per type, the total is unchanged."""
    out = list(medians)
    for kind in dict.fromkeys(kinds):
        idx = [i for i, k in enumerate(kinds) if k == kind]
        total_flops = sum(flops[i] for i in idx)
        if any(flops[i] <= 0 for i in idx) or total_flops <= 0:
            continue
        total_ms = sum(medians[i] for i in idx)
        for i in idx:
            out[i] = total_ms * flops[i] / total_flops
    return out


def _stage_rows(layers: list[nn.Module], chain_path: str, params: list[nn.Parameter],
                measured: _MeasuredPass, times: _Times,
                meta: bool) -> tuple[StageRecord, ...]:
    """pre, one row per chain layer, post: sizes from the measured pass, times from the timed ones."""
    n = len(layers)
    # Parameters: chain layers own theirs; the rest go to pre or post by where their grad appeared.
    owner: dict[int, int] = {}
    for i, layer in enumerate(layers):
        for p in layer.parameters():
            owner.setdefault(id(p), i)
    param_bytes = {s: 0 for s in range(-1, n + 1)}
    grad_bytes = {s: 0 for s in range(-1, n + 1)}
    grad_window = measured.grad_window
    for p in params:
        stage = owner.get(id(p))
        if stage is None:
            stage = n if grad_window.get(id(p)) == n else -1
        param_bytes[stage] += unique_storage_bytes(p)
        if id(p) in grad_window:
            grad_bytes[grad_window[id(p)]] += p.numel() * p.element_size()

    fwd_med: dict[int, float] = {}
    bwd_med: dict[int, float] = {}
    for s in range(-1, n + 1):
        fw, bw = measured.windows[("F", s)], measured.windows.get(("B", s))
        if meta:
            fwd_med[s] = fw["flops"] / ASSUMED_FLOPS_PER_S * 1e3
            bwd_med[s] = (bw["flops"] if bw else 0) / ASSUMED_FLOPS_PER_S * 1e3
        else:
            fwd_med[s] = statistics.median(times.windows[("F", s)])
            bwd_med[s] = statistics.median(times.windows[("B", s)]) if ("B", s) in times.windows else 0.0
    recompute: dict[int, float | None] = {s: None for s in range(n)}
    if not meta:
        kinds = [type(layer).__name__ for layer in layers]
        chain = range(n)
        for med, phase in ((fwd_med, "F"), (bwd_med, "B")):
            smooth = smoothed_chain_ms(kinds, [measured.windows[(phase, s)]["flops"]
                                               if (phase, s) in measured.windows else 0 for s in chain],
                                       [med[s] for s in chain])
            med.update(zip(chain, smooth))
        recompute = dict(zip(chain, timed_recompute_ms(kinds, [measured.windows[("F", s)]["flops"] for s in chain],
                                                       [fwd_med[s] for s in chain], times.recompute)
                             or [fwd_med[s] * recompute_factor(times.pairs, sum(fwd_med[s] for s in chain))
                                 for s in chain]))

    rows = []
    for s in range(-1, n + 1):
        fw, bw = measured.windows[("F", s)], measured.windows.get(("B", s))
        fwd_flops, bwd_flops = fw["flops"], (bw["flops"] if bw else 0)
        fwd_ms, bwd_ms = fwd_med[s], bwd_med[s]
        role = PRE if s == -1 else POST if s == n else CHAIN
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
            fwd_ms=float(fwd_ms), bwd_ms=float(bwd_ms),
            fwd_flops=int(fwd_flops), bwd_flops=int(bwd_flops),
            fwd_tmp_bytes=max(0, fw["peak"] - fw["live_end"]),
            bwd_tmp_bytes=max(0, bw["peak"] - bw["live_start"]) if bw else 0,
            fwd_peak_bytes=fw["peak"],
            bwd_peak_bytes=bw["peak"] if bw else 0,
            cast_bytes=measured.cast_bytes.get(s, 0),
            recompute_ms=recompute.get(s),
            output_kept=measured.kept.get(s) if role != POST else None,
            output_in_place=s in measured.in_place,
            # (with several tensors handed on, the flag is the first's: taken as saved after,
            # so a checkpoint ending there frees none of them early, on the safe side)
            output_saved_after=(measured.saved_after.get(s) if role == CHAIN and not measured.carried.get(s)
                                else None),
            # a layer that saves nothing does not run in a recompute that ends with it
            early_peak_bytes=measured.early_peak.get(s, fw["live_start"]) if role == CHAIN and measured.early else None,
            early_kept_bytes=measured.early_kept.get(s, 0) if role == CHAIN and measured.early else None,
            backward_lead_bytes=measured.lead.get(s, 0) if role == CHAIN and measured.early else None,
        ))
    return tuple(rows)


# ---- selective options (ckplan.sac) -------------------------------------------------------------
#
# Per option, every chain layer runs under ``ckplan.sac.run_with_option`` (one non-reentrant
# checkpoint with the option's SAC policy), exactly as ckplan.execute installs a top-level
# ``Store(i, option)``, and the step is measured again. The checkpoint's own saved-tensor hooks hide
# what the layer keeps from the instrument's pack hook, so a layer's kept bytes are the storages its
# forward window made that are still alive when the forward ends (the SAC cache and the output).
# The recompute is the second call of the layer's forward (the first is the forward itself), timed
# by the same clock; on meta its time is its FLOPs (backward FLOPs with the option minus without) at
# the assumed rate, as every meta time is.


class _OptionForward:
    """A chain layer's forward under one option, its recompute (the second call) timed."""

    def __init__(self, fwd, name: str, index: int, clock: Clock, recompute_ms: dict[int, list[float]],
                 step: _Step):
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
def _layers_under_option(layers: list[nn.Module], name: str, clock: Clock, step: _Step):
    """Every chain layer's forward under option ``name``; yields layer -> recompute times (ms)."""
    recompute_ms: dict[int, list[float]] = {}
    had = [("forward" in layer.__dict__, layer.__dict__.get("forward")) for layer in layers]
    for i, layer in enumerate(layers):
        fwd = layer.__dict__["forward"] if "forward" in layer.__dict__ else \
            functools.partial(type(layer).forward, layer)
        layer.forward = _OptionForward(fwd, name, i, clock, recompute_ms, step)
    try:
        yield recompute_ms
    finally:
        for layer, (own, fwd) in zip(layers, had):
            if own:
                layer.forward = fwd
            else:
                layer.__dict__.pop("forward", None)


@dataclass(frozen=True)
class _OptionPass:
    name: str
    measured: _MeasuredPass
    times: dict[tuple[str, int], list[float]]  # window -> milliseconds of the timed passes
    recompute_ms: dict[int, list[float]]  # chain layer -> its recompute's milliseconds, per timed pass
    # recompute_ms is already all the option adds to the layer's forward+backward (compiled);
    # else that is the recompute plus what SAC's dispatch mode adds around it (_option_cost_ms)
    whole: bool = False
    # CUDA: what the option adds to a whole forward+backward run as training runs it, the device
    # waited for only at the step's ends (_option_step_extra_ms); None elsewhere
    step_extra_ms: float | None = None


# Devices whose option costs come from whole steps (_option_step_extra_ms): where kernels run
# asynchronously to the CPU. On CPU the windows are the time itself.
WHOLE_STEP_OPTION_COSTS = ("cuda",)


class _NoWait:
    """Marks that do not wait for the device: a whole step is timed around them."""

    @staticmethod
    def now_ms() -> float:
        return time.perf_counter() * 1e3


def _whole_step_ms(inst: _Instrument, step: _Step, params: list[nn.Parameter]) -> float:
    """One forward+backward timed as a training step runs: the device is waited for at its two
    ends only, so the CPU queues kernels ahead of the GPU as it does in training."""
    clock, inst.clock = inst.clock, _NoWait()
    try:
        t0 = clock.now_ms()
        step.run(inst)
        return clock.now_ms() - t0
    finally:
        inst.clock = clock
        _zero(params)


def _option_step_extra_ms(inst: _Instrument, step: _Step, params: list[nn.Parameter], name: str,
                          rounds: int) -> float:
    """What option ``name`` on every chain layer adds to a step on CUDA: pairs of whole steps,
    plain then under the option, back to back; the difference of the medians (at least 0).
    The per-window times wait for the GPU at every layer, which exposes the CPU time of SAC's
    dispatch modes; in training it runs while the GPU works (gpt2-small, 8 x 512 on an H200:
    windows said 1.96 ms per layer for sac-compute, the steps 0.1 ms)."""
    plain: list[float] = []
    under: list[float] = []
    for _ in range(rounds):
        plain.append(_whole_step_ms(inst, step, params))
        with _layers_under_option(inst.layers, name, _NoWait(), step):  # type: ignore[arg-type]
            under.append(_whole_step_ms(inst, step, params))
    return max(0.0, statistics.median(under) - statistics.median(plain))


def _option_pass(inst: _Instrument, step: _Step, params: list[nn.Parameter], model: nn.Module,
                 name: str, repeats: int, accum: int) -> _OptionPass:
    """The measured pass (and ``repeats`` timed ones) with every chain layer under option ``name``."""
    policy_fn(name)  # an unknown option fails before anything runs
    with _layers_under_option(inst.layers, name, inst.clock, step) as recompute_ms:
        if accum > 1:
            step.run(inst)  # the measured micro-batch finds the gradients there, as in measure_step
        measured = _measured_pass(inst, step, params, model)
        _zero(params)
        recompute_ms.clear()
        times: dict[tuple[str, int], list[float]] = {}
        for _ in range(repeats):
            step.run(inst)
            _zero(params)
            for key, w in inst.windows().items():
                times.setdefault(key, []).append(w["ms"])
    extra = _option_step_extra_ms(inst, step, params, name, max(3, repeats)) \
        if step.device.type in WHOLE_STEP_OPTION_COSTS and repeats else None
    return _OptionPass(name, measured, times, {i: list(v) for i, v in recompute_ms.items()},
                       step_extra_ms=extra)


# ---- selective options on compiled layers (ckplan.compiled) -----------------------------------
#
# A compiled layer stored with option P runs P's SAC compiled in (CompiledForward.with_option), so
# what it keeps is what its compiled forward saves: attributed per layer as packed, as for the
# compiled layers without options (_compiled_pass). Its recompute runs inside the compiled backward
# and cannot be timed apart: it is the layer's forward+backward time with P minus without, paired
# per round with a plain compiled pass run just before (the CPU's step time drifts over a process),
# the median over rounds of each layer type's total shared by FLOPs as the layers' own times are
# (smoothed_chain_ms), within [0, the layer's forward]. FLOPs stay eager's: ``recompute_flops`` is 0.


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


def _compiled_option_passes(inst: _Instrument, step: _Step, params: list[nn.Parameter], model: nn.Module,
                            plain: _MeasuredPass, options: tuple[str, ...], repeats: int,
                            accum: int) -> list[_OptionPass]:
    """Per option: a warm-up pass (it compiles), the measured pass; then ``max(3, repeats)``
    rounds of a plain compiled pass followed by one pass per option, every chain layer under it."""
    if not options:
        return []
    measured: dict[str, _MeasuredPass] = {}
    for name in options:
        with _compiled_under_option(inst.layers, name):
            for _ in range(1 + (accum > 1)):
                step.run(inst)  # compiles the option's graph; with accum, gradients are there
            m = _compiled_pass(inst, step, params, model, plain)
        measured[name] = replace(m, live_at_end={i: m.saved.get(i, 0) for i in range(inst.n)})
        _zero(params)
    # Paired rounds: per round, the plain pass and one pass per option back to back, so a slow
    # stretch of the machine shifts both sides of each difference alike.
    times: dict[str | None, dict[tuple[str, int], list[float]]] = {None: {}, **{n: {} for n in options}}
    rounds: list[dict[str | None, list[float]]] = []
    for _ in range(max(3, repeats)):
        fb: dict[str | None, list[float]] = {}
        for name in (None, *options):
            with _compiled_under_option(inst.layers, name):
                step.run(inst)
                _zero(params)
            windows = inst.windows()
            for key, w in windows.items():
                times[name].setdefault(key, []).append(w["ms"])
            fb[name] = [windows[("F", i)]["ms"] + windows.get(("B", i), {}).get("ms", 0.0) for i in range(inst.n)]
        rounds.append(fb)
    kinds = [type(layer).__name__ for layer in inst.layers]
    flops = [plain.windows[("F", i)]["flops"] + plain.windows.get(("B", i), {}).get("flops", 0)
             for i in range(inst.n)]
    fwd = smoothed_chain_ms(kinds, flops, [statistics.median(times[None][("F", i)]) for i in range(inst.n)])
    out = []
    for name in options:
        # Per layer type: the median over rounds of the type's summed difference, shared by FLOPs
        # (a type with a FLOP-free layer: each layer's own median difference).
        extra = [statistics.median(r[name][i] - r[None][i] for r in rounds) for i in range(inst.n)]
        for kind in dict.fromkeys(kinds):
            idx = [i for i, k in enumerate(kinds) if k == kind]
            total_flops = sum(flops[i] for i in idx)
            if total_flops > 0 and all(flops[i] > 0 for i in idx):
                total = statistics.median(sum(r[name][i] - r[None][i] for i in idx) for r in rounds)
                for i in idx:
                    extra[i] = total * flops[i] / total_flops
        recompute = {i: [min(max(0.0, extra[i]), fwd[i])] for i in range(inst.n)}
        out.append(_OptionPass(name, measured[name], times[name], recompute, whole=True))
    return out


def _option_cost_ms(p: _OptionPass, rows: tuple[StageRecord, ...]) -> dict[int, float]:
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


def _with_options(rows: tuple[StageRecord, ...], plain: _MeasuredPass, passes: list[_OptionPass],
                  meta: bool) -> tuple[StageRecord, ...]:
    """The chain rows with one OptionRecord per measured option."""
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
            if meta:
                recompute_ms = flops / ASSUMED_FLOPS_PER_S * 1e3
                bwd_ms = bwd_flops / ASSUMED_FLOPS_PER_S * 1e3
            else:
                recompute_ms = costs[p.name][i]
                if p.whole:  # compiled: clamped to the forward of its own rounds; the row's is the bound
                    recompute_ms = min(recompute_ms, r.fwd_ms)
                bwd_ms = statistics.median(p.times[("B", i)]) if p.times.get(("B", i)) else r.bwd_ms
            opts.append(OptionRecord(
                name=p.name, saved_bytes=p.measured.live_at_end.get(i, 0),
                recompute_ms=float(recompute_ms), recompute_flops=int(flops), bwd_ms=float(bwd_ms),
                fwd_peak_bytes=fw["peak"], bwd_peak_bytes=bw["peak"] if bw else 0))
        out.append(replace(r, options=tuple(opts)))
    return tuple(out)
