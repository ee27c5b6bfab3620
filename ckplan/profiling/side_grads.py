"""The partial gradient of a side input that requires grad, as the autograd engine holds it.

The engine sums what the layers reading a side input send back in a buffer. Until the second of
those gradients arrives, the buffer holds the first as the layer's backward made it: where that
was a slice of a larger gradient (Zamba2 concatenates its embeddings' copy to the hidden state, so
the slice keeps the whole concatenation's gradient, twice the side input), the storage stays whole
until the sum. A checkpoint whose recompute runs in between runs beside it.

Seen in the measured pass: a hook on each node of the graph that hands a gradient to a side input
notes the gradient's storage and the backward window it arrived in; at each backward mark, whether
the first one's storage is still alive and not the gradient that starts the window (where it is,
the model counts it as that boundary's gradient).
"""
from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

Window = tuple[str, int]


@dataclass
class PartialGrads:
    """Per side input (storage id): the gradients handed to it, in the order they arrived."""

    # the tensors the layers got, as their graph edges: (id(grad_fn), output_nr), or (id(leaf), -1)
    # (ids only: a reference would keep the side input alive past the forward)
    edges: dict[tuple[int, int], int] = field(default_factory=dict)
    # their grad_fn objects, held until the hooks are in: the graph hands out the same object then
    # (older torch makes a new Python object for a node whose last one died: another id)
    nodes: list = field(default_factory=list)
    arrived: dict[int, list[tuple[weakref.ref, int, int]]] = field(default_factory=dict)  # (storage, bytes, stage)
    start: dict[int, int] = field(default_factory=dict)  # the first backward mark it was held alone at

    def clear(self) -> None:
        self.edges.clear()
        self.nodes.clear()
        self.arrived.clear()
        self.start.clear()

    def watch(self, key: int, t: torch.Tensor) -> None:
        """A chain layer got ``t`` (requires grad), of side input ``key``."""
        fn = t.grad_fn
        if fn is not None:
            self.nodes.append(fn)
        self.edges[(id(fn), t.output_nr) if fn is not None else (id(t), -1)] = key

    def install(self, loss: torch.Tensor, now: Callable[[], Window]) -> None:
        """With the graph alive: hook every node that hands a gradient to a watched tensor."""
        edges = self.edges
        if not edges or loss.grad_fn is None:
            self.nodes.clear()
            return
        seen: dict[int, object] = {}  # the nodes held: older torch's ids of dead node objects are reused
        todo = [loss.grad_fn]
        while todo:
            node = todo.pop()
            if node is None or id(node) in seen:
                continue
            seen[id(node)] = node
            for idx, (nxt, nr) in enumerate(node.next_functions):
                if nxt is None:
                    continue
                var = getattr(nxt, "variable", None)  # AccumulateGrad: a leaf
                key = edges.get((id(var), -1) if var is not None else (id(nxt), nr))
                if key is not None:
                    node.register_hook(functools.partial(self._arrived, key, idx, now))
                todo.append(nxt)
        self.nodes.clear()

    def _arrived(self, key: int, idx: int, now: Callable[[], Window], grad_inputs, _grad_outputs) -> None:
        g = grad_inputs[idx]
        if isinstance(g, torch.Tensor):
            st = g.untyped_storage()
            self.arrived.setdefault(key, []).append((weakref.ref(st), st.nbytes(), now()[1]))

    def at_backward(self, i: int, g: torch.Tensor | None) -> None:
        """Chain layer ``i``'s backward starts with its output's gradient ``g``."""
        for key, got in self.arrived.items():
            if len(got) != 1 or key in self.start:
                continue
            st = got[0][0]()
            if st is not None and not (isinstance(g, torch.Tensor) and g.untyped_storage().data_ptr() == st.data_ptr()):
                self.start[key] = i

    def first(self, key: int) -> int:
        """The chain layer whose backward handed the side input its first gradient (-1: none seen)."""
        got = self.arrived.get(key)
        return got[0][2] if got else -1

    def partial(self, key: int, final_bytes: int) -> tuple[int, tuple[int, int]] | None:
        """(bytes held beyond the summed gradient's ``final_bytes``, (from, to)): from the start of
        chain layer ``from``'s backward to the end of layer ``to``'s, where the second gradient
        arrives; None when nothing is held beyond it."""
        got = self.arrived.get(key, [])
        if len(got) < 2 or key not in self.start:
            return None
        extra, frm, to = got[0][1] - final_bytes, self.start[key], got[1][2]
        return (extra, (frm, to)) if extra > 0 and 0 <= to <= frm else None
