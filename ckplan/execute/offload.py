"""Saved activations offloaded to pinned host memory (CUDA), as torchtune's ``OffloadActivations``
and Transformer Engine's CPU offload do: no recompute, bounded by the host link.

While :class:`OffloadHooks` is active, every tensor an op saves for backward that lives on a GPU
and is not a parameter (nor a view of one) is copied to pinned host memory on a side stream,
which first waits for the work that made it. For the peers the device tensor is marked as used by
that stream (``record_stream``), so the caching allocator hands its memory out again only once the
copy is done, and nothing else holds it. For a plan's offloaded layers (``hold``) the hooks keep
the device tensor until the plan's release point (``plan_items.offload_releases``), where the
step's stream waits for the copy and the memory is freed: the device memory then follows the plan
op by op, as the simulator replays it (``ckplan.planner.transfers``), and the copies queue on the
side stream behind the forward. The backward copies each tensor back when it needs it (after the
copy out's event): on demand for ``offload-all``; for the layers a plan stores with ``offload``
(:class:`PlanOffload`, used by ``PlanExecutor``) from the start of the next layer's backward, on
the side stream. Tensors below ``min_bytes`` and tensors on other devices are
kept as they are (on a CPU there is nothing to offload to); a storage saved by several ops, or as
several views, is copied once and the views are made again on it when they come back. A host copy
is released once its last saved tensor is unpacked, so a second backward through the same graph
(``retain_graph=True``) is refused with ModelRunError.
"""
from __future__ import annotations

import weakref

import torch
from torch import nn

from ..errors import ModelRunError
from ..forwards import forwards_replaced
from ..measure.tracker import tensors_in
from ..planner.plan import STORE
from ..sac import run_with_option

MIN_BYTES = 1024  # smaller saved tensors stay (torchtune's default)
# Device types whose saved tensors are offloaded. A CPU's tensors are already in host memory; the
# tests add "cpu" to run the hooks' logic (plain synchronous copies, no streams) without a GPU.
DEVICE_TYPES: tuple[str, ...] = ("cuda",)
_SIDE: dict[torch.device, torch.cuda.Stream] = {}  # one copy stream per GPU


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    if device not in _SIDE:
        _SIDE[device] = torch.cuda.Stream(device)
    return _SIDE[device]


def _storage(t: torch.Tensor) -> int:
    """Where a tensor's memory is: views of one tensor share it."""
    return t.untyped_storage().data_ptr()


def _is_parameter(t: torch.Tensor) -> bool:
    base = t._base if t._base is not None else t
    return isinstance(base, nn.Parameter)


class _Packed:
    """One saved storage on the host (its bytes): its copy out's event, its copy back once started,
    and how many saved tensors of the graph are views of it (the copy back and the host copy are
    dropped once they are all unpacked: the hooks outlive the step, the memory must not; pinned
    host memory goes back to torch's caching host allocator for the next step)."""

    __slots__ = ("back", "back_done", "device", "done", "held", "host", "uses")

    def __init__(self, host: torch.Tensor, done: torch.cuda.Event | None, device: torch.device):
        self.host: torch.Tensor | None = host
        self.held: torch.Tensor | None = None  # the device bytes, until the release point (hold)
        self.done, self.device = done, device
        self.back: torch.Tensor | None = None
        self.back_done: torch.cuda.Event | None = None
        self.uses = 1


class _View:
    """A saved tensor as a view of a packed storage."""

    __slots__ = ("dtype", "offset", "packed", "size", "stride")

    def __init__(self, packed: _Packed, t: torch.Tensor):
        self.packed, self.dtype = packed, t.dtype
        self.size, self.stride, self.offset = t.size(), t.stride(), t.storage_offset()


def _bytes_of(storage: torch.UntypedStorage, device: torch.device) -> torch.Tensor:
    """A storage as a flat byte tensor (no copy)."""
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage)


class OffloadHooks(torch.autograd.graph.saved_tensors_hooks):
    """Saved-tensor hooks that move what ops save on a GPU to pinned host memory (module doc):
    each storage once, however many views of it are saved. ``keep``: tensors that stay on the
    device, views of them included (a layer's inputs, which the layer before keeps)."""

    def __init__(self, min_bytes: int = MIN_BYTES, keep: tuple[torch.Tensor, ...] = (), hold: bool = False):
        self.min_bytes, self.hold = min_bytes, hold
        self.offloaded_bytes = 0  # bytes copied out: each storage once
        self._keep = {_storage(t) for t in keep}
        self._copied: dict[int, tuple] = {}  # id(storage) -> (weakref, packed)
        self.packed: list[_Packed] = []
        self.prefetched = False  # prefetch() has run
        super().__init__(self.pack, self.unpack)

    def pack(self, t: torch.Tensor):
        if (t.device.type not in DEVICE_TYPES or _is_parameter(t) or t.numel() * t.element_size() < self.min_bytes
                or _storage(t) in self._keep):
            return t
        st = t.untyped_storage()
        seen = self._copied.get(id(st))
        if seen is not None and seen[0]() is st:  # the same live storage (a dead one's id may be reused)
            seen[1].uses += 1
            return _View(seen[1], t)
        flat = _bytes_of(st, t.device)
        host, done = _copy_out(flat, record=not self.hold)
        self.offloaded_bytes += flat.numel()
        packed = _Packed(host, done, t.device)
        if self.hold:
            packed.held = flat
        self._copied[id(st)] = (weakref.ref(st), packed)
        self.packed.append(packed)
        return _View(packed, t)

    def wait_out(self) -> None:
        """The current stream waits until every copy out is done (their device memory is free)."""
        for p in self.packed[-1:]:  # one side stream: the last copy's event covers the others
            if p.done is not None:
                torch.cuda.current_stream(p.device).wait_event(p.done)

    def release(self) -> None:
        """The release point: the current stream waits for the copies out, and the device bytes
        held until then are freed (to that stream's pool: what it runs next comes after the
        wait)."""
        self.wait_out()
        for p in self.packed:
            p.held = None

    def prefetch(self) -> None:
        """Start copying every offloaded storage still to be used back, on the side stream."""
        self.prefetched = True
        for p in self.packed:
            if p.back is None and p.host is not None:
                p.back, p.back_done = _copy_back(p, side=True)

    def drop_unused(self) -> None:
        """The layer's backward is over: the copies of what it saved but never read back (a SAC
        policy's cache entries past the op where its recompute stopped) are dropped, on the host and,
        once prefetched, on the device (else they would stay there to the next step)."""
        for p in self.packed:
            p.back = p.back_done = p.host = p.held = None

    def unpack(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed
        p = packed.packed
        if p.back is None:  # not prefetched: copied back now, on the current stream
            p.back, p.back_done = _copy_back(p, side=False)
        elif p.back_done is not None:  # prefetched on the side stream: done, and used here from now on
            stream = torch.cuda.current_stream(p.device)
            stream.wait_event(p.back_done)
            p.back.record_stream(stream)
        back = p.back
        p.uses -= 1
        if p.uses <= 0:  # every view has it: the graph holds it from here, the host copy goes back
            p.back = p.back_done = p.host = None
        return torch.empty(0, dtype=packed.dtype, device=back.device).set_(
            back.untyped_storage(), packed.offset, packed.size, packed.stride)


def _copy_out(flat: torch.Tensor, record: bool = True) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    """A device storage's bytes copied to pinned host memory on the side stream, after the work
    that made them, and the copy's event; ``record``: the allocator reuses the device memory only
    after the copy (else the caller holds it until it has waited for the event). On a CPU (tests)
    a synchronous copy and no event."""
    if flat.device.type != "cuda":
        return flat.clone(), None
    side = _side_stream(flat.device)
    host = torch.empty(flat.numel(), dtype=torch.uint8, pin_memory=True)
    side.wait_stream(torch.cuda.current_stream(flat.device))
    with torch.cuda.stream(side):
        host.copy_(flat, non_blocking=True)
        if record:
            flat.record_stream(side)  # the allocator reuses this memory only once the copy is done
        done = torch.cuda.Event()
        done.record(side)
    return host, done


def _copy_back(p: _Packed, *, side: bool) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    """A packed storage copied back to its device after its copy out: on the side stream with the
    copy's event (``side``, a prefetch), or on the current stream (no event: it is ordered
    there); on a CPU (tests) a synchronous copy."""
    if p.host is None:
        raise ModelRunError("a tensor saved for backward and offloaded to host memory was unpacked after its "
                            "last use: a second backward through the same graph (retain_graph=True) cannot "
                            "reuse offloaded activations, whose host copies are released once used",
                            tip="store or checkpoint these layers instead (plan --no-offload), or run one "
                                "backward per forward")
    if p.done is None:
        return p.host.clone(), None
    current = torch.cuda.current_stream(p.device)
    if not side:
        current.wait_event(p.done)
        return p.host.to(p.device, non_blocking=True), None
    stream = _side_stream(p.device)
    stream.wait_stream(current)
    with torch.cuda.stream(stream):
        back = p.host.to(p.device, non_blocking=True)
        event = torch.cuda.Event()
        event.record(stream)
    return back, event


class PlanOffload:
    """The layers a plan stores with ``offload`` (top level): each runs under its own
    :class:`OffloadHooks` (its inputs kept on the device, its saved bytes held to its release
    point); after the forward of layer ``r`` the step waits for the copies of the layers released
    there and frees their device bytes; a layer is copied back from the start of the next layer's
    backward (a hook on that layer's output gradient; the last layer: at its own backward, on
    demand), as ``ckplan.planner.transfers`` models it."""

    def __init__(self, releases: dict[int, int], fetches: dict[int, int], n_layers: int,
                 min_bytes: int | None = None):
        self.releases, self.fetches, self.n = releases, fetches, n_layers
        self.min_bytes = MIN_BYTES if min_bytes is None else min_bytes
        self._hooks: dict[int, OffloadHooks] = {}

    def run(self, i: int, fn, args: tuple, kwargs: dict, option: str = STORE):
        """Layer ``i``'s forward under its hooks; with a selective ``option`` (``sac-compute+offload``)
        the layer runs under that SAC policy and what it keeps goes through the hooks (torch 2.14's
        ``respect_saved_tensors_hooks``), its recompute reading it back."""
        keep = tuple(tensors_in((args, kwargs)))  # nested ones too (HF's position_embeddings pair)
        hooks = OffloadHooks(self.min_bytes, keep, hold=True)
        with hooks:
            out = (fn(*args, **kwargs) if option == STORE else
                   run_with_option(fn, option, *args, _ckplan_hooks=True, **kwargs))
        # the gradient of its input: the layer's backward is over, what it never read goes
        t = next((t for t in keep if t.requires_grad), None)
        if t is not None and torch.is_grad_enabled():
            t.register_hook(lambda g: hooks.drop_unused())
        self._hooks[i] = hooks
        return out

    def forward_done(self, k: int, out) -> None:
        """Layer ``k``'s forward is over: the copies released here are waited for and their
        device bytes freed, and the layers whose fetch point is ``k`` (by default ``k - 1``) come
        back, the next needed first, when the gradient of this output arrives."""
        for i, r in self.releases.items():
            hooks = self._hooks.get(i)
            if r == k and hooks is not None:
                hooks.release()
        back = [self._hooks[i] for i in sorted(self.fetches, reverse=True)
                if self.fetches[i] == k and i in self._hooks and self._hooks[i].packed]
        t = next((t for t in (out if isinstance(out, (tuple, list)) else (out,))
                  if isinstance(t, torch.Tensor) and t.requires_grad), None)
        if t is not None and back:
            t.register_hook(lambda g: _prefetch_all(back))


def _prefetch_all(back: list[OffloadHooks]) -> None:
    for hooks in back:
        hooks.prefetch()


def layers_offloaded(layers: list[nn.Module], min_bytes: int | None = None, *, keep_inputs: bool = False,
                     hooks: list[OffloadHooks] | None = None):
    """Every layer's forward run under :class:`OffloadHooks` until the block ends; ``keep_inputs``:
    what it is called with stays on the device; ``hooks``: each call's hooks are appended to it."""
    return forwards_replaced(layers, lambda _i, fwd: _Offloaded(fwd, min_bytes, keep_inputs, hooks))


class _Offloaded:
    """A layer's forward under its own :class:`OffloadHooks` (a no-op outside grad mode)."""

    def __init__(self, fwd, min_bytes: int | None, keep_inputs: bool, seen: list[OffloadHooks] | None):
        self.fwd, self.keep_inputs, self.seen = fwd, keep_inputs, seen
        self.min_bytes = MIN_BYTES if min_bytes is None else min_bytes

    def __call__(self, *args, **kwargs):
        if not torch.is_grad_enabled():
            return self.fwd(*args, **kwargs)
        hooks = OffloadHooks(self.min_bytes, tuple(tensors_in((args, kwargs))) if self.keep_inputs else ())
        if self.seen is not None:
            self.seen.append(hooks)
        with hooks:
            return self.fwd(*args, **kwargs)
