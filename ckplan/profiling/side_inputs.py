"""Side inputs (:class:`ckplan.records.SideInput`): storages the chain layers receive besides the
hidden state, made before the chain or by an earlier layer's forward, seen in the measured pass,
and which of those layers' own ops save them.

A side input made by a chain layer counts when it skips a layer (given to layers after the next
one, as T5's position bias is to every later block); a second tensor a layer hands to the next
layer only is part of the boundary (``carried``), not a side input.
"""
from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass, field

import torch

from ..chainfind import first_tensor, tensor_leaves
from ..measure import storages_of, unique_storage_bytes
from ..records import SideInput
from .side_grads import PartialGrads

# (ref, bytes, layers that received it, the chain layer that made it or -1 for before the chain,
# the layers after the one after its maker that received it other than in the previous layer's output)
_Seen = tuple[weakref.ref, int, set[int], int, set[int]]


@dataclass
class SideInputTracker:
    """Notes what each chain layer receives besides the hidden state, and what it returns."""

    seen: dict[int, _Seen] = field(default_factory=dict)  # storage id -> what received it
    gone: list = field(default_factory=list)  # seen's records whose storage died and whose id was reused
    # chain layer -> bytes of the tensors besides the first it hands to the next layer only
    carried: dict[int, int] = field(default_factory=dict)
    # storage -> bytes of the gradient its tensors received in the backward (a side input that
    # requires grad: T5's position bias, from a parameter), from a hook on each such tensor
    grad: dict[int, int] = field(default_factory=dict)
    # at the end of the forward: (layers, made by, bytes, storage id, layers saving it, unrelayed)
    kept: list[tuple[tuple[int, ...], int, int, int, tuple[int, ...], tuple[int, ...]]] = \
        field(default_factory=list)
    chain_made: dict[int, int] = field(default_factory=dict)  # storage -> the chain layer it left
    returners: dict[int, set[int]] = field(default_factory=dict)  # storage -> the chain layers returning it
    partials: PartialGrads = field(default_factory=PartialGrads)  # their gradients as the engine holds them

    def clear(self) -> None:
        """Before a step: forget the previous step's side inputs."""
        self.seen.clear()
        self.gone.clear()
        self.carried.clear()
        self.grad.clear()
        self.chain_made.clear()
        self.returners.clear()
        self.partials.clear()

    def returned(self, i: int, out) -> None:
        """Chain layer ``i`` returned ``out``: its storages left that layer."""
        for st in storages_of(out):
            self.chain_made.setdefault(id(st), i)
            self.returners.setdefault(id(st), set()).add(i)

    def freed(self, key: int) -> None:
        """A storage died: its id may be reused, so forget which chain layer returned it."""
        self.chain_made.pop(key, None)
        self.returners.pop(key, None)

    def note(self, i: int, args, kwargs, alloc_window: dict[int, tuple[str, int]], excluded: set[int]) -> None:
        """Chain layer ``i`` is called with ``args``/``kwargs``: note the storages besides the
        hidden state's that were made before the chain or by an earlier layer."""
        x = first_tensor((args, kwargs))
        hidden = {id(st) for st in storages_of(x)} if x is not None else set()
        for st in storages_of((args, kwargs)):
            k = id(st)
            if k in hidden or k in excluded:
                continue
            made = alloc_window.get(k)
            if k in self.chain_made:
                by = self.chain_made[k]  # another output of an earlier layer (T5's position bias)
            elif made is None or made == ("F", -1):
                by = -1
            elif made[0] == "F" and 0 <= made[1] < i:
                by = made[1]
            else:
                continue  # made between two layers, outside any layer: not modelled
            seen = self.seen.get(k)
            if seen is None or seen[0]() is not st:
                if seen is not None:  # a dead one whose id this storage reuses: keep its record
                    self.gone.append((k, seen))
                self.seen[k] = seen = (weakref.ref(st), st.nbytes(), {i}, by, set())
                for t in tensor_leaves((args, kwargs)):
                    if t.requires_grad and storages_of(t) and id(storages_of(t)[0]) == k:
                        t.register_hook(functools.partial(self._grad, k))
                        self.partials.watch(k, t)
            else:
                seen[2].add(i)
            if 0 <= seen[3] < i - 1 and i - 1 not in self.returners.get(k, ()):
                seen[4].add(i)  # kept by the record of this call in a checkpoint over its maker

    def _grad(self, key: int, g: torch.Tensor) -> None:
        """A side input's gradient, complete (summed over the layers that read it): the engine
        held it from the backward of the last of them to here, the backward of what made it."""
        self.grad[key] = self.grad.get(key, 0) + unique_storage_bytes(g)

    def forward_ended(self, packed_by: dict[int, set[int]], alloc_window: dict) -> set[int]:
        """At the end of the forward: the side inputs, as (layers, made by, bytes, storage id,
        layers saving it). Bytes for those no longer alive (nothing saved them), and for those
        only the own ops of some layers receiving them saved (``packed_by``: rotary ``(cos, sin)``
        that only a hybrid model's attention layers multiply in), made in this forward by their
        maker (``alloc_window``): the plain step frees these after the backward of the first such
        layer. Returns those storages' ids, which leave their maker's saved bytes. The other living
        ones are in the saved bytes of whoever saved them, and listed for their gradients only
        (``summary``)."""
        self.kept = []
        moved: set[int] = set()
        for k, (ref, nbytes, layers, by, unrelayed) in [*self.gone, *self.seen.items()]:
            if nbytes and (by < 0 or max(layers) > by + 1):
                savers = packed_by.get(k, set()) if ref() is not None else set()
                own = bool(savers) and savers <= layers and alloc_window.get(k) == ("F", by)
                if own:
                    moved.add(k)
                self.kept.append((tuple(sorted(layers)), by, nbytes if ref() is None or own else 0, k,
                                  tuple(sorted(savers)) if own else (), tuple(sorted(unrelayed))))
            elif nbytes and by >= 0:  # a second tensor handed to the next layer: the boundary
                self.carried[by] = self.carried.get(by, 0) + nbytes
        self.seen.clear()
        self.gone.clear()
        return moved

    def summary(self) -> tuple[SideInput, ...]:
        """After the backward: the side inputs, bytes and gradient bytes summed per set of layers
        and maker."""
        by_layers: dict[tuple, tuple[int, int, int]] = {}
        for layers, by, nbytes, k, savers, unrelayed in self.kept:
            g = self.grad.get(k, 0)
            extra, span = self.partials.partial(k, g) or (0, ())
            first = self.partials.first(k) if g else -1
            first = first if first in layers and first != max(layers) else -1  # -1: the last reader's
            if nbytes or g:
                key = (layers, by, savers, unrelayed, span, first)
                b0, g0, e0 = by_layers.get(key, (0, 0, 0))
                by_layers[key] = (b0 + nbytes, g0 + g, e0 + extra)
        self.kept = []
        self.grad.clear()
        self.partials.clear()
        return tuple(SideInput(b, ls, by, g, sv, un, e, span, first)
                     for (ls, by, sv, un, span, first), (b, g, e) in sorted(by_layers.items()))
