"""What a plan holds beyond rotor's chain, for the replay (``replay.py``): inputs and boundaries
no op of the plain forward keeps, and side inputs.

The model (the replay implements all of it; these helpers decide the first two):

* boundaries no op keeps (``Layer.x_kept`` / ``Pre.x_kept`` False: a Linear's output that only a
  ReLU reads, which saves its own output instead): ``xbar`` leaves the output out, so a stored
  layer frees it once the next stage has run (inside the next forward's measured transient). A
  checkpoint starting right after such a stored layer (or at layer 0 after such a pre), or a layer
  stored there with a selective option (its own SAC checkpoint), keeps it as its input: ``hold``
  adds it before that item's forward, ``unhold`` frees it after its backward. The measured forward
  transient of such a layer, and of the layer after it, holds that output (``xbar`` leaves it
  out): a forward that saves nothing (``Fn``) and the first layer of a recompute, where it is
  live already, take the transient without it. A checkpoint nested inside a recompute gets such
  an input (or the boundary of a checkpoint before it that nothing after saves) from the
  enclosing recompute, which hands it over once: it is freed when the nested checkpoint's own
  recompute is over (``unhold`` there), not after its backward. A checkpoint's own
  boundary ``x[t-1]`` of that kind is freed once read (``release``) when a layer stored with
  ``store`` (or post) comes next; so is one that only layer ``t-1``'s own ops save
  (``Layer.x_kept_next`` False: nothing inside a checkpoint saves), after that next stage's
  forward (which was measured with it live).
* side inputs (``chain.side_inputs``: masks and the like that pre makes for the layers, or a
  chain layer for layers after the next one): live from pre's forward; freed when the chain's
  forward ends, or, when a top-level item holds one of their layers (a checkpoint over it, the
  layer stored with a selective option, or stored with ``store`` when its own ops save them:
  ``SideInput.saved_by``) and does not contain the layer that made them (unless it records a
  later layer's call that got them other than from the previous layer: ``SideInput.unrelayed``),
  after the backward of the first such item.
* side-input gradients (``SideInput.grad_bytes``: T5's position bias comes from a parameter):
  the autograd engine sums what the layers reading them send back, so they appear after the
  backward of the last such layer and go after the backward of their maker (a chain layer or
  pre); every recompute in between runs beside them. A recompute over the layer that makes a
  side input makes it again; the recompute's frame holds it until the recompute is over (from
  the maker's forward on: the first forward's measured transients count it as live there),
  or, when a later item of that recompute keeps it (``_remade_holders``), until that item's
  backward.
* tensors a layer keeps that no saved-tensor hook sees (``Layer.unsaved_kept_bytes``: a custom
  autograd Function's ``ctx`` attributes, a module cache): a checkpoint's first forward keeps
  them beside its output, until the backward is over (the graph's nodes hold them). A stored
  layer's are in its measured transients (calibration); a recompute's die with it (not counted).
* held layers (``Layer.held_bytes``; FSDP2 per rank keeps a unit forwarded during backward
  unsharded until its own backward, ``planner.parallel``): when the backward of a top-level
  checkpoint [s, t) starts (its boundary dropped), ``mem += held[s..t-1]``, and each goes after
  its layer's backward. There the layers' ops take their held transients (``Layer.held``): a
  forward in the recompute of a checkpoint [a, b) runs beside layer b's ``retained_bytes`` (what
  its backward left; a checkpoint's first forward inside a recompute beside the next layer's)
  and, unless it is layer b - 1, adds its ``gather_bytes``; the ops of layer s once its backward
  has begun (its backward; its recompute too when it is the checkpoint's only layer) add the
  ``gather_bytes`` of layer s - 1 (FSDP2's backward prefetch of the unit before).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .chain import Chain
from .plan import PLAIN, Checkpoint, Item, Store


def _input_hold(chain: Chain, seq: tuple[Item, ...], idx: int, ctx: tuple[int, int] | None) -> int:
    """What checkpoint ``seq[idx]`` keeps beyond the plain forward: its input, when no op of the
    plain forward saves it (``Layer.x_kept`` False) and the item before it stores the layer that
    made it with ``store`` (pre at the top level). A checkpoint before it keeps its boundary
    anyway; a selective option's ``xbar`` includes the output; the first item of an inner plan
    gets its input from the checkpoint around it, which keeps it. A layer stored with a selective
    option runs in a checkpoint of its own (SAC), which keeps its input the same way."""
    it = seq[idx]
    if isinstance(it, Store) and it.option in PLAIN:
        return 0
    start = it.layer if isinstance(it, Store) else it.start
    if idx == 0:
        return chain.input_hold(0) if ctx is None and start == 0 else 0
    prev = seq[idx - 1]
    if isinstance(prev, Store) and prev.option in PLAIN:
        return chain.input_hold(start)
    return 0


def _boundary_released(chain: Chain, seq: tuple[Item, ...], idx: int,
                       ctx: tuple[int, int] | None) -> bool:
    """Whether checkpoint ``seq[idx]``'s boundary ``x[t-1]`` is freed once the next stage has
    read it: no op after layer ``t-1`` saves it (``Layer.x_kept`` False, or only the layer's own
    ops do: ``Layer.x_kept_next`` False; inside the checkpoint they save nothing) and that stage
    is a layer stored with ``store`` (or post, at the top level); a checkpoint or a selective
    option after it keeps it as its input."""
    it = seq[idx]
    if isinstance(it, Store):
        return False
    ly = chain.layers[it.stop - 1]
    if ly.x_kept and ly.x_kept_next:
        return False
    if idx + 1 < len(seq):
        nxt = seq[idx + 1]
        return isinstance(nxt, Store) and nxt.option in PLAIN
    return ctx is None  # the last item of the whole chain: post reads it


def _span(it: Item) -> tuple[int, int]:
    return (it.layer, it.layer + 1) if isinstance(it, Store) else (it.start, it.stop)


def _side_releases(chain: Chain, items: tuple[Item, ...]) -> tuple[int, dict[int, int]]:
    """Side-input bytes freed when the chain's forward ends, and per top-level item index the
    bytes freed after that item's backward (the first item holding one of their layers)."""
    if not chain.side_inputs:
        return 0, {}
    holder: dict[int, int] = {}  # layer -> index of the top-level item that holds it
    stored: dict[int, int] = {}  # layer -> index of its item, stored with store
    for idx, it in enumerate(items):
        if isinstance(it, Store):
            (stored if it.option in PLAIN else holder)[it.layer] = idx
        else:
            for k in range(it.start, it.stop):
                holder[k] = idx
    free = 0
    held: dict[int, int] = {}
    for si in chain.side_inputs:
        maker = holder.get(si.made_by) if si.made_by >= 0 else None  # makes them again: keeps none
        idxs = [holder[i] for i in si.layers if i in holder and holder[i] != maker]
        idxs += [stored[i] for i in si.saved_by if i in stored]  # their saved tensors keep them
        if maker is not None and any(holder.get(i) == maker for i in si.unrelayed):
            idxs.append(maker)  # its record of a later call keeps the first forward's tensors
        if idxs:
            first = min(idxs)
            held[first] = held.get(first, 0) + si.bytes
        else:
            free += si.bytes
    return free, held


def _side_made(chain: Chain) -> dict[int, int]:
    """Chain layer -> bytes of the side inputs it makes."""
    made: dict[int, int] = {}
    for si in chain.side_inputs:
        if si.made_by >= 0:
            made[si.made_by] = made.get(si.made_by, 0) + si.bytes
    return made


def _remade_holders(chain: Chain, seq: tuple[Item, ...], mi: int,
                    k: int) -> tuple[dict[int, int], dict[int, int]]:
    """In a recompute running ``seq``: the side inputs layer ``k`` (in ``seq[mi]``) makes again
    that an item after it keeps past the recompute's end (the first such): ({index in ``seq``:
    bytes freed after that item's backward}, {id(checkpoint): bytes freed once its own
    recompute is over}).

    A later item gets them when its first layer got them from the layer before in the first
    forward (the maker's output, or relayed through each layer's: ``SideInput.unrelayed``; the
    others get the first forward's, recorded). A stored layer keeps them when it saves them
    (``SideInput.saved_by``), a checkpoint (or selective option) as its input: a nested
    checkpoint whose first layer does not save them has them handed over, read by the recompute
    of the innermost checkpoint starting there."""
    to_bwd: dict[int, int] = {}
    handed: dict[int, int] = {}
    for si in chain.side_inputs:
        if si.made_by != k:
            continue
        for idx in range(mi + 1, len(seq)):
            it = seq[idx]
            f = _span(it)[0]
            if not (f in si.layers and (f == k + 1 or f not in si.unrelayed)):
                continue
            if isinstance(it, Checkpoint) and f not in si.saved_by:
                while isinstance(it.inner[0], Checkpoint):
                    it = it.inner[0]
                handed[id(it)] = handed.get(id(it), 0) + si.bytes
                break
            if f in si.saved_by or not (isinstance(it, Store) and it.option in PLAIN):
                to_bwd[idx] = to_bwd.get(idx, 0) + si.bytes
                break
    return to_bwd, handed


class SideHolds:
    """The replay's side-input steps (a mixin of ``replay._Replayer``, whose state it changes)."""

    s: Any  # replay._State
    chain: Chain
    op: Callable[..., None]
    side_made: dict[int, int]

    def remake(self, seq: tuple[Item, ...], idx: int, k: int, ctx: tuple[int, int] | None) -> int:
        """Layer ``k`` (in ``seq[idx]``) of a recompute makes its side inputs again; returns the
        bytes the recompute's frame frees at its end (the rest: ``_remade_holders``)."""
        s = self.s
        to_bwd, handed = _remade_holders(self.chain, seq, idx, k)
        mine = s.remade_kept.setdefault(id(seq), {})
        for h, nbytes in to_bwd.items():
            mine[h] = mine.get(h, 0) + nbytes
        for key, nbytes in handed.items():
            s.handed_over[key] = s.handed_over.get(key, 0) + nbytes
        made = self.side_made[k]
        s.mem += made
        self.op("remade", k, ctx, True, s.mem, 0, s.mem)
        return made - sum(to_bwd.values()) - sum(handed.values())

    def side(self, nbytes: int) -> None:
        """Side inputs freed: the forward is over, or their last holder's backward."""
        s = self.s
        s.mem -= nbytes
        self.op("side", None, None, False, s.mem, 0, s.mem)
