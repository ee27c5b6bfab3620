"""Chain layers compiled with ``torch.compile``, for ckplan's plans to run around (``--compile``).

Each chain layer's ``forward`` is replaced by ``torch.compile`` of it (TorchInductor, through a
backend that leaves random ops to eager's generator, so dropout draws the masks eager draws and a
checkpoint's recompute the same ones again). The module call, its hooks and ckplan's executor stay
outside the compiled code: :func:`ckplan.apply_plan` applied *after* the layers are compiled wraps
the compiled forwards in its checkpoints, so a layer's compiled forward runs again in the backward
of the checkpoint that holds it, and what a stored layer keeps for backward is what the compiled
graph saves (AOTAutograd's partitioner may recompute cheap ops inside a layer by itself).

Layers of one class share one compiled graph (Dynamo treats their parameters as inputs), so a
24-layer GPT compiles one block's forward and backward once.

In your own loop::

    with ckplan.compiled_layers(model):          # or compiled_layers(model, chain="model.layers")
        with ckplan.apply_plan(model, plan):      # compiled first, then the plan around them
            train(model)

Selective options (SAC, ckplan.sac) are not combined with compiled layers: SAC runs the layer
under a TorchDispatchMode, and ``torch.compile`` runs a frame under such a mode eagerly.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from .errors import UsageError


def compile_unavailable(device_type: str) -> str:
    """Why TorchInductor cannot compile for ``device_type`` here ("" when it can)."""
    from .peers import compile_unavailable as why
    return why(device_type)


class _Backend:
    """TorchInductor's ``compile_fx`` with ``fallback_random`` on and random ops never recomputed
    inside the layer (:func:`ckplan.peers.save_random_ops`); counts the graphs compiled."""

    def __init__(self) -> None:
        self.graphs = 0

    def __call__(self, gm, example_inputs):
        from torch._inductor.compile_fx import compile_fx

        from .peers import eager_random_ops
        self.graphs += 1
        with eager_random_ops():
            return compile_fx(gm, example_inputs)


class CompiledLayers:
    """The chain layers' forwards compiled: made once, installed by :meth:`installed` (or by
    entering it) and removed again on exit, leaving each layer as it was."""

    def __init__(self, layers: list[nn.Module]):
        self.layers = list(layers)
        self.backend = _Backend()
        self._compiled = [torch.compile(layer.forward, backend=self.backend) for layer in self.layers]
        self._saved: list[tuple[nn.Module, Any]] | None = None

    @property
    def graphs(self) -> int:
        """Graphs compiled so far (forward graphs; one per layer class and input shape)."""
        return self.backend.graphs

    @property
    def active(self) -> bool:
        return self._saved is not None

    def __enter__(self) -> CompiledLayers:
        if self._saved is not None:
            raise RuntimeError("compiled layers are already installed")
        self._saved = []
        for layer, fwd in zip(self.layers, self._compiled):
            self._saved.append((layer, layer.__dict__.get("forward")))
            layer.forward = fwd
        return self

    def __exit__(self, *exc) -> None:
        saved, self._saved = self._saved or [], None
        for layer, own in saved:
            if own is None:
                layer.__dict__.pop("forward", None)
            else:
                layer.forward = own


def compiled_layers(model: nn.Module, *, chain: str | None = None) -> CompiledLayers:
    """Compile the forward of every layer of ``model``'s chain (``chain``: its dotted path; None:
    found as the profiler finds it). Use it as a context, entered before :func:`ckplan.apply_plan`."""
    from .chainfind import resolve_chain
    why = compile_unavailable(_device_type(model))
    if why:
        raise UsageError(f"cannot compile the chain layers: {why}",
                         tip="run without --compile, or install what is missing")
    _, container, _ = resolve_chain(model, chain)
    return CompiledLayers(list(container))


def _device_type(model: nn.Module) -> str:
    p = next(model.parameters(), None)
    return p.device.type if p is not None else "cpu"
