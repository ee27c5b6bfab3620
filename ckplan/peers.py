"""Peers: the checkpointing users would pick instead of ckplan, run inside ckplan's bench.

``hf``          per-layer checkpointing as Hugging Face's ``gradient_checkpointing_enable`` does
                (every chain layer in its own non-reentrant checkpoint); run as ckplan's
                every-k k=1 plan, which is exactly that, so its prediction is every-k k=1's.
``sac-policy``  PyTorch selective activation checkpointing on every chain layer: one
                ``checkpoint(layer, use_reentrant=False, context_fn=...)`` per layer whose policy
                saves the outputs of compute-heavy ops (:data:`SAC_SAVE_OPS`: matmuls,
                attention kernels, convolution; ``MUST_SAVE``) and recomputes the rest
                (``PREFER_RECOMPUTE``). No ckplan prediction.
"""
from __future__ import annotations

import functools
from contextlib import contextmanager

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from .chainfind import resolve_chain

PEER_NAMES: tuple[str, ...] = ("hf", "sac-policy")


def _save_ops() -> frozenset:
    aten = torch.ops.aten
    names = ["mm", "addmm", "bmm", "_scaled_dot_product_flash_attention",
             "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
             "convolution"]
    return frozenset(getattr(aten, n).default for n in names if hasattr(aten, n))


SAC_SAVE_OPS = _save_ops()


def _sac_policy(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in SAC_SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _sac_context():
    return create_selective_checkpoint_contexts(_sac_policy)


class _SacForward:
    """A chain layer's forward run under one selective checkpoint (no-op outside grad mode)."""

    def __init__(self, fwd):
        self.fwd = fwd

    def __call__(self, *args, **kwargs):
        if not torch.is_grad_enabled():
            return self.fwd(*args, **kwargs)
        return checkpoint(self.fwd, *args, use_reentrant=False, context_fn=_sac_context, **kwargs)


@contextmanager
def sac_policy(model: nn.Module, chain: str | None = None):
    """Wrap every chain layer's forward in a selective checkpoint; restored on exit."""
    _, container, _ = resolve_chain(model, chain)
    layers = list(container)
    saved = [layer.__dict__.get("forward") for layer in layers]
    for layer in layers:
        layer.forward = _SacForward(functools.partial(type(layer).forward, layer)
                                    if "forward" not in layer.__dict__ else layer.__dict__["forward"])
    try:
        yield
    finally:
        for layer, fwd in zip(layers, saved):
            if fwd is None:
                layer.__dict__.pop("forward", None)
            else:
                layer.forward = fwd
