"""Activation offload in the replay (``replay.py``): what a layer stored with ``offload`` holds on
the device, and when, and the copies' time the step waits for.

A layer stored with ``offload`` (top level only) runs its forward as ``store`` does; then what it
saved, its output aside (``Chain.offload_bytes``), is copied to pinned host memory on one side
stream, queued behind the copies before it, while the forward goes on. Its device memory is freed
at its *release point*: after the forward of a later layer ``r`` (the plan's
``params["offload_release"]``, ``plan_items.offload_releases``), where the step first waits for
the copy when it is not done yet; the last layer's is released after its own forward. In the
backward its copy back starts with the backward of the next layer, or of a later one (its *fetch
point*, ``params["offload_fetch"]``), and must be done when the layer's own backward starts (the
last layer's is copied back on demand, at its own backward);
from there the layer's backward is a stored layer's. No forward is redone.

The copies are timed on a clock that runs with the replay's ops (each layer's forward and
backward time, the post's): the step waits ``max(0, copy done - clock)`` at a release point and
at the backward that needs a copy back (``transfer_ms``); copies back queue on the side stream
too. Release points are given, or ``AUTO``: each copy is released after the first forward that
ends once it is done, and every copy still in flight when the last layer's forward ends is waited
for and released there; the replay's ``releases`` then holds the points, which make a plan replay
the same way on a device (``simulate.with_releases``).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .chain import Chain
from .plan_items import Item, Store, is_offloaded, kept_option

AUTO = "auto"  # release points chosen by the replay (module doc)
EPS_MS = 1e-9  # a copy done this close to a forward's end counts as done there


def offloaded_layers(chain: Chain, items: tuple[Item, ...]) -> dict[int, int]:
    """{layer: bytes it moves to the host} for the top-level layers stored with ``offload``."""
    return {it.layer: chain.offload_bytes(it.layer, kept_option(it.option)) for it in items
            if isinstance(it, Store) and is_offloaded(it.option)}


class Transfers:
    """The replayer's offload steps (a mixin of ``replay._Replayer``): ``tick`` with every op,
    ``send`` after an offloaded layer's forward, ``settle`` after each first forward of a layer,
    ``fetch_before`` a layer's backward."""

    s: Any  # replay._State
    chain: Chain
    op: Callable[..., None]

    def init_transfers(self, items: tuple[Item, ...], releases: dict[int, int] | str,
                       fetches: dict[int, int] | None) -> None:
        self.offloaded = offloaded_layers(self.chain, items)
        last = self.chain.n_layers - 1
        self.fetch_at: dict[int, list[int]] = {}  # B(k) -> the layers whose copies back start there
        for i in sorted(self.offloaded, reverse=True):  # the next needed first
            if i < last:
                self.fetch_at.setdefault(i + 1 if fetches is None else fetches[i], []).append(i)
        self.auto = releases == AUTO
        self.given: dict[int, int] = {} if isinstance(releases, str) else releases
        self.clock = 0.0  # the compute stream's time, ms
        self.out_end = self.back_end = 0.0  # when the side stream's last copy out / back is done
        self.pending: list[tuple[float, int, int]] = []  # copies out not released: (done, bytes, layer)
        self.back_done: dict[int, float] = {}  # layer -> when its copy back is done

    def tick(self, name: str, stage: int | None, again: bool) -> None:
        """The clock runs through one op: a layer's or the post's forward or backward."""
        chain = self.chain
        if stage is None or stage < 0 or name not in ("F", "Fn", "B"):
            return
        ly = chain.layers[stage] if stage < chain.n_layers else chain.post
        self.clock += ly.bwd_ms if name == "B" else ly.fwd_ms

    def _wait(self, until: float) -> None:
        if until > self.clock:
            self.s.transfer_ms += until - self.clock
            self.clock = until

    def send(self, layer: int) -> None:
        """Layer ``layer``'s copy out joins the side stream's queue (the last layer's is waited
        for at once)."""
        c = self.chain
        self.out_end = max(self.clock, self.out_end) + self.offloaded[layer] / c.d2h_bytes_per_ms
        self.pending.append((self.out_end, self.offloaded[layer], layer))
        if layer == c.n_layers - 1:
            self.settle(layer)

    def settle(self, stage: int, mem: int | None = None) -> int:
        """Layer ``stage``'s first forward is over: the copies released here leave the device (the
        step waits for those not done). ``mem``: the live bytes when the caller keeps them in a
        local (returned, as ``s.mem``)."""
        s = self.s
        if mem is not None:
            s.mem = mem
        last = self.chain.n_layers - 1
        keep: list[tuple[float, int, int]] = []
        for at, (done, nbytes, layer) in enumerate(self.pending):  # in queue order
            if stage < last and self.auto and done > self.clock + EPS_MS:
                keep.extend(self.pending[at:])  # the later ones are not done either
                break
            if stage < last and not self.auto and self.given[layer] > stage:
                keep.append((done, nbytes, layer))
                continue
            if self.auto:
                s.releases[layer] = min(stage, last)
            self._wait(done)
            s.mem -= nbytes
            self.op("offloaded", layer, None, False, s.mem, 0, s.mem)
        self.pending = keep
        return s.mem

    def fetch_before(self, i: int) -> None:
        """Before ``B(i)``: the copies back that start here join the side stream's queue (by default
        the layer before's), and layer ``i``'s must be done (the last layer's is made now, on
        demand, on the compute stream)."""
        c, s = self.chain, self.s
        on_demand = (i,) if i == c.n_layers - 1 else ()
        for layer in (*self.fetch_at.get(i, ()), *on_demand):
            nbytes = self.offloaded.get(layer)
            if not nbytes:
                continue
            s.mem += nbytes
            self.op("fetch", layer, None, False, s.mem, 0, s.mem)
            if layer == i:
                self.back_done[i] = self.clock + nbytes / c.h2d_bytes_per_ms
            else:
                self.back_end = max(self.clock, self.back_end) + nbytes / c.h2d_bytes_per_ms
                self.back_done[layer] = self.back_end
        if i in self.back_done:
            self._wait(self.back_done[i])
