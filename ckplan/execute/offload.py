"""Saved activations offloaded to pinned host memory (CUDA), as torchtune's ``OffloadActivations``
and Transformer Engine's CPU offload do: no recompute, bounded by the host link.

While :class:`OffloadHooks` is active, every tensor an op saves for backward that lives on a GPU
and is not a parameter (nor a view of one) is copied to pinned host memory on a side stream,
which first waits for the work that made it; the device tensor is marked as used by that stream
(``record_stream``), so the caching allocator hands its memory out again only once the copy is
done, and nothing else holds it. The backward copies each tensor back on the current stream when
it needs it (after the copy out's event): on demand, without prefetch, so a copy back is not
hidden behind the backward before it. Tensors below ``min_bytes`` and tensors on other devices are
kept as they are (on a CPU there is nothing to offload to); a tensor saved by several ops of one
layer call is copied once.
"""
from __future__ import annotations

import weakref

import torch
from torch import nn

from ..forwards import forwards_replaced

MIN_BYTES = 1024  # smaller saved tensors stay (torchtune's default)
_SIDE: dict[torch.device, torch.cuda.Stream] = {}  # one copy stream per GPU


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    if device not in _SIDE:
        _SIDE[device] = torch.cuda.Stream(device)
    return _SIDE[device]


def _is_parameter(t: torch.Tensor) -> bool:
    base = t._base if t._base is not None else t
    return isinstance(base, nn.Parameter)


class OffloadHooks(torch.autograd.graph.saved_tensors_hooks):
    """Saved-tensor hooks that move what ops save on a GPU to pinned host memory (module doc)."""

    def __init__(self, min_bytes: int = MIN_BYTES):
        self.min_bytes = min_bytes
        self.offloaded_bytes = 0
        self._copied: dict[int, tuple] = {}  # id -> (weakref, packed): one copy of a tensor several ops save
        super().__init__(self.pack, self.unpack)

    def pack(self, t: torch.Tensor):
        if t.device.type != "cuda" or _is_parameter(t) or t.numel() * t.element_size() < self.min_bytes:
            return t
        seen = self._copied.get(id(t))
        if seen is not None and seen[0]() is t:  # the same live tensor (a dead one's id may be reused)
            return seen[1]
        side = _side_stream(t.device)
        host = torch.empty_like(t, device="cpu", pin_memory=True)
        side.wait_stream(torch.cuda.current_stream(t.device))
        with torch.cuda.stream(side):
            host.copy_(t, non_blocking=True)
            t.record_stream(side)
            done = torch.cuda.Event()
            done.record(side)
        self.offloaded_bytes += t.numel() * t.element_size()
        packed = (host, done, t.device)
        self._copied[id(t)] = (weakref.ref(t), packed)
        return packed

    def unpack(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed
        host, done, device = packed
        torch.cuda.current_stream(device).wait_event(done)
        return host.to(device, non_blocking=True)


def layers_offloaded(layers: list[nn.Module], min_bytes: int = MIN_BYTES):
    """Every layer's forward run under :class:`OffloadHooks` until the block ends."""
    return forwards_replaced(layers, lambda _i, fwd: _Offloaded(fwd, min_bytes))


class _Offloaded:
    """A layer's forward under its own :class:`OffloadHooks` (a no-op outside grad mode)."""

    def __init__(self, fwd, min_bytes: int):
        self.fwd, self.min_bytes = fwd, min_bytes

    def __call__(self, *args, **kwargs):
        if not torch.is_grad_enabled():
            return self.fwd(*args, **kwargs)
        with OffloadHooks(self.min_bytes):
            return self.fwd(*args, **kwargs)
