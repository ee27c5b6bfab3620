"""What a recompute must leave as the first forward left it (shared by ckplan.execute and ckplan.sac)."""
from __future__ import annotations

import contextlib

import torch
import torch.nn as nn


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
        from torch.utils._python_dispatch import _disable_current_modes
        with torch.no_grad(), _disable_current_modes():
            for m, momentum, handle in saved:
                handle.remove()
                m.momentum = momentum
                n = calls.get(id(m), 0)
                if n and m.num_batches_tracked is not None:
                    m.num_batches_tracked.sub_(n)


def recompute_keeping_stats(fn):
    """``fn`` (a layer's bound forward) for a checkpoint: its first call as is, the recompute's
    under :func:`running_stats_kept` (plain functions are returned as they are)."""
    module = getattr(fn, "__self__", None)
    if not isinstance(module, nn.Module):
        return fn
    calls = [0]

    def run(*args, **kwargs):
        calls[0] += 1
        if calls[0] == 1:
            return fn(*args, **kwargs)
        with running_stats_kept(module):
            return fn(*args, **kwargs)
    return run
