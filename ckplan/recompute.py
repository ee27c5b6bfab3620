"""What a recompute must leave as the first forward left it (shared by ckplan.execute and ckplan.sac).

A layer's forward may change its buffers: BatchNorm's and InstanceNorm's running statistics, a
module that calls ``F.batch_norm`` on its own buffers, an exponential moving average or a counter
updated in forward. Under checkpointing a recomputed layer runs its forward again (twice in a
nested checkpoint), and those updates would be made again with the same batch, so the model
would drift from the one trained without checkpoints (its gradients do not change when the
update does not feed the output). Here every recompute leaves the buffers as the first forward
left them:

* BatchNorm (``_BatchNorm`` modules) recomputes with momentum 0 and its count taken back, in
  place: no tensor is allocated (:func:`running_stats_kept`).
* Any other buffer the layer's forward changes, in place or by rebinding the attribute, is copied
  before the recompute and put back after it (:func:`buffers_kept`). Which buffers change is
  learnt from the layer's first forwards (:func:`buffer_changes_noted`): by comparing values
  the first time a layer runs (an op such as ``F.batch_norm`` changes its running statistics
  without bumping their version counter), then by version counters and identity, which cost
  nothing. Only those buffers are copied, so the copy is a few KiB (running statistics) that
  lives during one layer's recompute; a buffer that the recompute changes in place although
  no first forward did is refused (:class:`ckplan.errors.ModelRunError`): it cannot be put back.

Known limits: the recompute itself sees the buffers as the first forward left them (updated
once). A layer whose *output* depends on a buffer it updates (a counter that selects a branch)
therefore computes something else in its recompute; ``ckplan bench``'s gradient check reports
such a plan as ``wrong-gradients``. A buffer changed without a version bump (``F.batch_norm``'s
statistics) is found only if the layer's first forward under a plan changes it.
"""
from __future__ import annotations

import contextlib
import weakref

import torch
import torch.nn as nn
from torch.utils import checkpoint as _checkpoint
from torch.utils._python_dispatch import _disable_current_modes

from .errors import ModelRunError

# Buffers some forward of a chain layer changed: owning module -> buffer names. Weak keys: a model
# freed (or copied: the copy learns anew) takes its entries with it.
_CHANGED: weakref.WeakKeyDictionary[nn.Module, set[str]] = weakref.WeakKeyDictionary()
_VALUES_COMPARED: weakref.WeakSet[nn.Module] = weakref.WeakSet()  # layers learnt by value once


def _compiled(module: nn.Module) -> bool:
    """A module whose forward ckplan.compiled replaced (it has ``with_option``, the test
    ckplan.execute uses), or that torch.compile wraps."""
    return getattr(module.__dict__.get("forward"), "with_option", None) is not None or hasattr(module, "_orig_mod")


@contextlib.contextmanager
def running_stats_kept(layer: nn.Module):
    """A recompute leaves BatchNorm's running statistics as the first forward left them.

    In training mode BatchNorm updates ``running_mean``/``running_var`` and counts
    ``num_batches_tracked`` on every forward, so under ``torch.utils.checkpoint`` a recomputed
    layer updates them a second time with the same batch, and the model drifts from the one
    trained without checkpoints (its gradients do not: training mode normalizes with the batch's
    own statistics). Here the recompute runs with momentum 0 (the update keeps the running values:
    ``(1 - 0) * running + 0 * batch``) and its count is taken back, in place: no tensor is
    allocated, so the plan's memory is unchanged. A compiled layer (Dynamo guards on momentum) is
    left as PyTorch runs it."""
    norms = [] if _compiled(layer) else [
        m for m in layer.modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training and m.track_running_stats
        and m.running_mean is not None]
    if not norms:
        yield
        return
    calls: dict[int, int] = {}

    def count(module, args) -> None:
        calls[id(module)] = calls.get(id(module), 0) + 1

    saved = [(m, m.momentum, m.register_forward_pre_hook(count)) for m in norms]
    for m in norms:
        m.momentum = 0.0
    try:
        yield
    finally:
        # Outside any dispatch mode: selective checkpointing's recompute mode would take the
        # bookkeeping op for one of the layer's own.
        with torch.no_grad(), _disable_current_modes():
            for m, momentum, handle in saved:
                handle.remove()
                m.momentum = momentum
                n = calls.get(id(m), 0)
                if n and m.num_batches_tracked is not None:
                    m.num_batches_tracked.sub_(n)


def _batchnorm(m: nn.Module) -> bool:
    return isinstance(m, nn.modules.batchnorm._BatchNorm)


def _own_buffers(layer: nn.Module):
    """``(module, name, tensor)`` of every buffer of ``layer`` and its submodules, BatchNorm's
    left out (:func:`running_stats_kept` keeps those without a copy)."""
    for m in layer.modules():
        if _batchnorm(m):
            continue
        for name, b in m._buffers.items():
            if b is not None:
                yield m, name, b


def _no_modes():
    # Outside any dispatch mode (selective checkpointing's recompute mode would take a copy for
    # one of the layer's own ops) and outside autograd.
    stack = contextlib.ExitStack()
    stack.enter_context(torch.no_grad())
    stack.enter_context(_disable_current_modes())
    return stack


@contextlib.contextmanager
def buffer_changes_noted(layer: nn.Module):
    """Around a first forward of a layer that will be recomputed: note which of its buffers the
    forward changes (by value the first time this layer runs, then by version and identity)."""
    entries = list(_own_buffers(layer))
    if not entries:
        yield
        return
    by_value = layer not in _VALUES_COMPARED and not any(b.is_meta for _, _, b in entries)
    with _no_modes():
        before = [(m, name, b, b._version, b.clone() if by_value else None) for m, name, b in entries]
    try:
        yield
    finally:
        with _no_modes():
            for m, name, b, version, copy in before:
                now = m._buffers.get(name)
                if (now is not b or b._version != version
                        or (copy is not None and not torch.equal(b, copy))):
                    _CHANGED.setdefault(m, set()).add(name)
        if by_value:
            _VALUES_COMPARED.add(layer)


@contextlib.contextmanager
def buffers_kept(layer: nn.Module):
    """Around a recompute: the buffers the layer's forward changes are as before it afterwards
    (see the module docstring); BatchNorm's are :func:`running_stats_kept`'s."""
    entries = list(_own_buffers(layer))
    if not entries:
        yield
        return
    with _no_modes():
        saved = [(m, name, b, b._version, b.clone() if name in _CHANGED.get(m, ()) else None)
                 for m, name, b in entries]
    stop = getattr(_checkpoint, "_StopRecomputationError", ())
    lost: list[str] = []
    failed = False
    try:
        yield
    except stop:
        raise  # torch's early stop: the recompute ends here on purpose
    except BaseException:
        failed = True
        raise
    finally:
        with _no_modes():
            for m, name, b, version, copy in saved:
                if m._buffers.get(name) is not b:  # rebound: the first forward's tensor goes back
                    m._buffers[name] = b
                    _CHANGED.setdefault(m, set()).add(name)
                if copy is not None:
                    # Through .data: the values go back without a version bump, so a tensor the
                    # recompute saved for backward keeps the version autograd recorded.
                    b.data.copy_(copy)
                elif b._version != version:
                    _CHANGED.setdefault(m, set()).add(name)
                    lost.append(_buffer_name(layer, m, name))
        if lost and not failed:
            raise ModelRunError(
                f"the recompute of {type(layer).__name__} changed its buffer {lost[0]} in place, which its "
                "first forward did not: ckplan cannot put it back, and training would drift from training "
                "without checkpoints",
                tip="keep that layer out of checkpoints (store it), or update the buffer outside forward")


def _buffer_name(layer: nn.Module, owner: nn.Module, name: str) -> str:
    for prefix, m in layer.named_modules():
        if m is owner:
            return f"{prefix}.{name}" if prefix else name
    return name


@contextlib.contextmanager
def recompute_state_kept(layer: nn.Module):
    """Around a recompute of ``layer``: its BatchNorm statistics and every other buffer its forward
    changes are left as the first forward left them (the module docstring)."""
    with running_stats_kept(layer), buffers_kept(layer):
        yield


def recompute_keeping_stats(fn):
    """``fn`` (a layer's bound forward) for a checkpoint: its first call with its buffer changes
    noted, the recompute's under :func:`recompute_state_kept` (plain functions are returned as
    they are)."""
    module = getattr(fn, "__self__", None)
    if not isinstance(module, nn.Module):
        return fn
    calls = [0]

    def run(*args, **kwargs):
        calls[0] += 1
        if calls[0] == 1:
            with buffer_changes_noted(module):
                return fn(*args, **kwargs)
        with recompute_state_kept(module):
            return fn(*args, **kwargs)
    return run
