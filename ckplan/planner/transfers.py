"""Activation offload in the replay (``replay.py``): what a layer stored with ``offload`` holds on
the device, and when.

A layer stored with ``offload`` (top level only) runs its forward as ``store`` does; then what it
saved, its output aside (``Chain.offload_bytes``), is copied to pinned host memory on a side
stream while the next stage's forward runs (layer ``i + 1``, or the post), and its device memory is
freed when that forward ends (the step waits there for a copy not done yet). In the backward the
copy back starts with the backward of the next layer and must be done when the layer's own
backward starts (the last layer's is copied back on demand, at its own backward: nothing hides
it); from there the layer's backward is a stored layer's. The time a copy takes beyond
the stage it runs beside is added to the step (``Chain.offload_ms``); no forward is redone.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .chain import Chain
from .plan_items import OFFLOAD, Item, Store


def offloaded_layers(chain: Chain, items: tuple[Item, ...]) -> dict[int, int]:
    """{layer: bytes it moves to the host} for the top-level layers stored with ``offload``."""
    return {it.layer: chain.offload_bytes(it.layer) for it in items
            if isinstance(it, Store) and it.option == OFFLOAD}


class Transfers:
    """The replayer's offload steps (a mixin of ``replay._Replayer``): ``send`` after an offloaded
    layer's forward, ``settle`` after the next forward op, ``fetch_before`` the backward op that
    precedes the layer's own."""

    s: Any  # replay._State
    chain: Chain
    offloaded: dict[int, int]
    op: Callable[..., None]

    def send(self, layer: int) -> None:
        s = self.s
        s.inflight = (self.offloaded[layer], layer)
        out_ms, back_ms = self.chain.offload_ms(layer)
        s.transfer_ms += out_ms + back_ms

    def settle(self, mem: int | None = None) -> int:
        """The copy out in flight is done: its device memory goes. ``mem``: the live bytes when
        the caller keeps them in a local (returned, as ``s.mem``)."""
        s = self.s
        if mem is not None:
            s.mem = mem
        if s.inflight is not None:
            nbytes, layer = s.inflight
            s.inflight = None
            s.mem -= nbytes
            self.op("offloaded", layer, None, False, s.mem, 0, s.mem)
        return s.mem

    def fetch_before(self, i: int) -> None:
        """Before ``B(i)``: the layer before comes back (when it was offloaded), and so does layer
        ``i`` itself when it is the last (copied back on demand)."""
        for layer in (i - 1, i) if i == self.chain.n_layers - 1 else (i - 1,):
            nbytes = self.offloaded.get(layer)
            if nbytes:
                s = self.s
                s.mem += nbytes
                self.op("fetch", layer, None, False, s.mem, 0, s.mem)
