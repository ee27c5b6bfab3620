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

Selective options (ckplan.sac) run compiled too. A ``mincut-*`` option runs the layer's forward
compiled on its own (one function per option) under ``torch._functorch.config.activation_memory_budget``
set to the option's budget, so AOTAutograd's min-cut partitioner chooses what the layer saves and
recomputes, as ``torch.compile`` with a budget does for a whole model. A layer stored with SAC
option P runs ``torch.compile`` of ``checkpoint(forward, context_fn=P's SAC contexts)``, which Dynamo traces as
one region whose ops carry P's save/recompute tags; AOTAutograd's partitioner then saves the ops P
keeps and recomputes the others inside the compiled backward. (Eager SAC around a compiled forward
would not do: SAC runs the layer under a TorchDispatchMode, and ``torch.compile`` runs a frame
under such a mode eagerly.) One compiled function per option, shared by the layers: a graph per
layer class and option, compiled on first use.
"""
from __future__ import annotations

import logging
import types
from typing import Any

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from .chainfind import resolve_chain
from .errors import UsageError
from .peers import compile_unavailable as _peers_compile_unavailable
from .peers import eager_random_ops
from .sac import MINCUT, check_option, context_fn


def compile_unavailable(device_type: str) -> str:
    """Why TorchInductor cannot compile for ``device_type`` here ("" when it can)."""
    return _peers_compile_unavailable(device_type)


class _Backend:
    """TorchInductor's ``compile_fx`` with ``fallback_random`` on and random ops never recomputed
    inside the layer (:func:`ckplan.peers.save_random_ops`); counts the graphs compiled."""

    def __init__(self) -> None:
        self.graphs = 0

    def __call__(self, gm, example_inputs):
        from torch._inductor.compile_fx import compile_fx  # seconds to import: on the first graph only
        self.graphs += 1
        with eager_random_ops():
            return compile_fx(gm, example_inputs)


def _with_option(forward, *args, **kwargs):
    # Compiled once per option (its own code object: Dynamo's cache is per code object) with
    # CONTEXT_FN, that option's SAC contexts, bound in the function's globals.
    return checkpoint(forward, *args, use_reentrant=False, context_fn=CONTEXT_FN, **kwargs)  # noqa: F821


def _option_function(name: str):
    """``_with_option`` with option ``name``'s SAC contexts, as a function of its own."""
    code = _with_option.__code__.replace(co_name=f"ckplan_{name.replace('-', '_')}")
    return types.FunctionType(code, {**_with_option.__globals__, "CONTEXT_FN": context_fn(name)},
                              f"ckplan_{name}")


def _with_budget(forward, *args, **kwargs):
    # Compiled once per min-cut option (its own code object), called under that option's
    # activation_memory_budget (CompiledLayers.option_runner): the partitioner reads it when the
    # first call compiles the forward and backward.
    return forward(*args, **kwargs)


def _budget_function(name: str):
    """``_with_budget`` as a function of its own for min-cut option ``name``."""
    code = _with_budget.__code__.replace(co_name=f"ckplan_{name.replace('-', '_')}")
    return types.FunctionType(code, _with_budget.__globals__, f"ckplan_{name}")


def _budget_runner(compiled, budget: float):
    """Run ``compiled`` with the min-cut partitioner's activation memory budget at ``budget``."""
    import torch._functorch.config as functorch_config

    def run(*args, **kwargs):
        with functorch_config.patch(activation_memory_budget=budget):
            return compiled(*args, **kwargs)
    return run


def _quiet_context_fn_warning() -> None:
    """Drop torch's one-time warning that a ``context_fn`` reached ``checkpoint`` under compile
    (its advice, no in-place ops in the region, is what functionalization and the gradient checks
    of ckplan's tests cover); other warnings of that logger stay."""
    logger = logging.getLogger("torch._higher_order_ops.wrap")
    if not any(isinstance(f, _DropContextFnWarning) for f in logger.filters):
        logger.addFilter(_DropContextFnWarning())


class _DropContextFnWarning:
    def filter(self, record) -> bool:
        return "context_fn is passed to torch.utils.checkpoint" not in str(record.msg)


class CompiledForward:
    """A chain layer's compiled forward (what :class:`CompiledLayers` installs): called, it runs
    the compiled forward; :meth:`with_option` gives the layer's compiled forward stored with a
    selective option (what :func:`ckplan.sac.run_with_option` runs for a compiled layer)."""

    def __init__(self, owner: CompiledLayers, eager_forward):
        self.owner, self.eager = owner, eager_forward
        self.compiled = torch.compile(eager_forward, backend=owner.backend)

    def __call__(self, *args, **kwargs):
        return self.compiled(*args, **kwargs)

    def with_option(self, name: str):
        run = self.owner.option_runner(name)
        eager = self.eager
        return lambda *args, **kwargs: run(eager, *args, **kwargs)


class CompiledLayers:
    """The chain layers' forwards compiled: made once, installed by :meth:`installed` (or by
    entering it) and removed again on exit, leaving each layer as it was."""

    def __init__(self, layers: list[nn.Module]):
        self.layers = list(layers)
        self.backend = _Backend()
        self._compiled = [CompiledForward(self, layer.forward) for layer in self.layers]
        self._runners: dict[str, Any] = {}
        self._saved: list[tuple[nn.Module, Any]] | None = None

    def option_runner(self, name: str):
        """The compiled ``checkpoint(forward, *args)`` of option ``name``, shared by the layers."""
        run = self._runners.get(name)
        if run is None:
            check_option(name)
            if name in MINCUT:
                fn = torch.compile(_budget_function(name), backend=self.backend)
                run = self._runners[name] = _budget_runner(fn, MINCUT[name])
            else:
                _quiet_context_fn_warning()
                run = self._runners[name] = torch.compile(_option_function(name), backend=self.backend)
        return run

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
    why = compile_unavailable(_device_type(model))
    if why:
        raise UsageError(f"cannot compile the chain layers: {why}",
                         tip="run without --compile, or install what is missing")
    _, container, _ = resolve_chain(model, chain)
    return CompiledLayers(list(container))


def _device_type(model: nn.Module) -> str:
    p = next(model.parameters(), None)
    return p.device.type if p is not None else "cpu"
