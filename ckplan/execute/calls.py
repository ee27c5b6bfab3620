"""The records of one checkpointed segment in the first forward: each layer call (its
arguments without the hidden state, RNG and autocast state), the open frames, and where the
previous layer's output went in the next call (found by identity).
"""
from __future__ import annotations

import contextlib
import copy
import weakref
from collections.abc import MutableMapping, MutableSequence
from typing import Any

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..chainfind import tensor_leaves
from ..errors import ModelRunError, PlanRunError
from ..planner.plan import Checkpoint
from .frames import _get_autocast_kwargs, _get_device_module, _infer_device_type, _tc


def _flat(args: tuple, kwargs: dict) -> tuple[list, Any]:
    """The leaves of a call's arguments (tensors inside tuples, lists and dicts included, as
    ``torch.utils._pytree`` flattens them) and how to rebuild them: a slot is a leaf index."""
    return tree_flatten((tuple(args), dict(kwargs)))


def _rebuild(leaves: list, spec) -> tuple[tuple, dict]:
    a, k = tree_unflatten(leaves, spec)
    return tuple(a), dict(k)


class _Call:
    """One layer call inside a checkpointed segment, as the first forward made it.

    ``slots`` (leaf indices of the flattened arguments, :func:`_flat`) held the tensors carried
    from the previous layer; they are blanked here so the record never keeps an intermediate
    activation alive. ``leaves`` says which tensor of the previous layer's output went into each
    slot.
    """

    __slots__ = ("autocast", "cpu_rng", "device_rng", "device_type", "devices", "flat", "leaves",
                 "sac", "slots", "spec")

    def __init__(self, args: tuple, kwargs: dict, links: list[tuple[int, int]]):
        flat, self.spec = _flat(args, kwargs)
        for slot, _ in links:
            flat[slot] = None
        # A container the layers write into (Gemma 4's shared_kv_states): the record keeps what it
        # held at this call, and each recompute writes into a copy of that, so the model's own
        # container (with what later layers put in it) and a recompute's tensors, graph and all,
        # are not kept alive by the record until the checkpoint's backward is over.
        self.flat = [_snapshot(v) for v in flat]
        self.slots = tuple(s for s, _ in links)
        self.leaves = tuple(li for _, li in links)
        # RNG and autocast as torch.utils.checkpoint stashes them, but per layer call.
        self.device_type = _infer_device_type(args, kwargs)
        self.cpu_rng = torch.get_rng_state()
        if getattr(_get_device_module(self.device_type), "_initialized", False):
            self.devices, self.device_rng = _tc.get_device_states(args, kwargs)
        else:
            self.devices, self.device_rng = [], []
        self.autocast = _get_autocast_kwargs(self.device_type)
        self.sac = None  # a selective option's recompute context, filled by its parent's recompute

    def replay(self, forward, inputs: list[torch.Tensor]):
        flat = [_snapshot(v) for v in self.flat]
        for slot, value in zip(self.slots, inputs):
            flat[slot] = value
        a, k = _rebuild(flat, self.spec)
        torch.set_rng_state(self.cpu_rng)
        if self.devices:
            _tc.set_device_states(self.devices, self.device_rng, device_type=self.device_type)
        dev_kw, cpu_kw = self.autocast
        dev_ctx = (torch.amp.autocast(device_type=self.device_type, **dev_kw)
                   if dev_kw is not None else contextlib.nullcontext())
        with dev_ctx, torch.amp.autocast("cpu", **cpu_kw):
            return forward(*a, **k)


def _snapshot(value):
    """A shallow copy of a mutable container that is not a pytree node (a UserDict, a list
    subclass), or the value itself."""
    if isinstance(value, (MutableMapping, MutableSequence)) and not isinstance(value, torch.Tensor):
        return copy.copy(value)
    return value


class _Frame:
    """An open checkpoint of the first forward: torch's frame and its saved-tensor hook."""

    __slots__ = ("frame", "hook", "item")

    def __init__(self, item: Checkpoint, frame, hook):
        self.item, self.frame, self.hook = item, frame, hook


class _Segment:
    """The state of one top-level checkpoint while the model's forward runs through it."""

    def __init__(self, top: Checkpoint):
        self.top = top
        self.calls: dict[int, _Call] = {}
        self.open: list[_Frame] = []  # the frames enclosing the current layer, outermost first
        self.last = -1  # the last layer called
        self.prev: list[tuple[weakref.ref, int]] = []  # the last output's tensors (weak) and versions

    def link(self, args: tuple, kwargs: dict) -> tuple[list[tuple[int, int]], list[torch.Tensor]] | None:
        """Where the previous layer's output went in this call (leaf indices of :func:`_flat`);
        None if it is not there unchanged."""
        links, inputs = [], []
        prev = [(ref(), ver) for ref, ver in self.prev]
        for slot, value in enumerate(_flat(args, kwargs)[0]):
            if not isinstance(value, torch.Tensor):
                continue
            for li, (t, ver) in enumerate(prev):
                if t is value or _alias(t, value):
                    if t._version != ver:  # changed in place between the two layers
                        return None
                    links.append((slot, li))
                    inputs.append(value)
                    break
        return (links, inputs) if links else None

    def close(self) -> None:
        for f in self.open:
            f.frame.forward_completed = True
        self.open.clear()


def _drop(t: torch.Tensor) -> None:
    return None


def _dropped(_: None) -> None:  # pragma: no cover - the filled graph is never backwarded
    raise RuntimeError("ckplan: a selective option's cache-filling pass was backwarded")


def _alias(t: torch.Tensor | None, value: torch.Tensor) -> bool:
    """``value`` is a view of ``t`` over exactly the same elements: what a module's pre-forward
    hook hands on when it passes inputs through an autograd function (FSDP2 does)."""
    return (t is not None and value.data_ptr() == t.data_ptr() and value.shape == t.shape
            and value.stride() == t.stride() and value.dtype == t.dtype and value._base is not None
            and value.untyped_storage().data_ptr() == t.untyped_storage().data_ptr())


def _entry_links(args: tuple, kwargs: dict) -> tuple[list[tuple[int, int]], list[torch.Tensor]]:
    """The hidden state of a segment's first layer (a leaf index of :func:`_flat`): args[0],
    else ``hidden_states=``, else the first tensor in the arguments (inside a tuple or dict too).
    (Any choice gives the same math; it decides what the frame saves.)"""
    flat = _flat(args, kwargs)[0]
    hidden = kwargs.get("hidden_states")
    want = (args[0] if args and isinstance(args[0], torch.Tensor) else
            hidden if isinstance(hidden, torch.Tensor) else None)
    for slot, value in enumerate(flat):
        if isinstance(value, torch.Tensor) and (want is None or value is want):
            return [(slot, 0)], [value]
    return [], []


def in_place_layer(layer: nn.Module) -> bool:
    """A layer built to change its input in place (``nn.ReLU(inplace=True)`` and the like)."""
    return getattr(layer, "inplace", False) is True


def input_versions(args: tuple, kwargs: dict) -> list[tuple[torch.Tensor, int]]:
    """The tensor arguments of a call and their versions, for :func:`refuse_changed_input`."""
    return [(t, t._version) for t in tensor_leaves((args, kwargs))]


def refuse_changed_input(i: int, before: list[tuple[torch.Tensor, int]]) -> None:
    """A checkpoint starting at layer ``i`` saves its input and recomputes from it: a layer whose
    forward changed that input in place would be recomputed from the changed tensor (wrong
    gradients when it needs none, PyTorch's refusal in the backward when it does)."""
    if any(t._version != v for t, v in before):
        raise PlanRunError(
            f"chain layer {i} changes its input in place (an in-place op on an argument: x.mul_(...), "
            "x += ...), and a checkpoint starts at it: the checkpoint saves that input and would "
            "recompute from the changed tensor",
            tip="plan from a profile of this model (its plans give such layers a copy of the hidden state: "
                "params copy_inputs), or make that op out of place (x = x * 0.5)")


def _with_copies(args: tuple, kwargs: dict, links: list[tuple[int, int]]) -> tuple[tuple, dict]:
    """``args``/``kwargs`` with the hidden-state tensors (``links``' slots) copied: inside a
    checkpoint, a layer that changes its input in place would change the tensor the checkpoint
    saved (its input, or an enclosing one's), which PyTorch then refuses to recompute from. The
    copy is what the layer changes and returns, a new output as the planner models one."""
    flat, spec = _flat(args, kwargs)
    for slot, _ in links:
        flat[slot] = flat[slot].clone()
    return _rebuild(flat, spec)


def _compiled(forward) -> bool:
    """Whether ``forward`` is a compiled chain layer's (ckplan.compiled), its options compiled in."""
    return getattr(forward, "with_option", None) is not None


def _refuse_kv_cache(i: int, args: tuple, kwargs: dict) -> None:
    """A Hugging Face key/value cache would be appended to again by the recompute (a wrong-size
    error deep inside attention at best), so say what to change before anything runs."""
    for value in [*args, *kwargs.values()]:
        if any(c.__name__ == "Cache" and c.__module__.startswith("transformers")
               for c in type(value).__mro__):
            raise ModelRunError(
                f"chain layer {i} got a key/value cache ({type(value).__name__}); a checkpointed layer "
                "runs twice and would append to it twice",
                tip="turn the cache off for training: `use_cache: false` in the spec's hf: fields, "
                    "or model.config.use_cache = False")

