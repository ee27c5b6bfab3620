"""The ``sac-policy`` peer: PyTorch's selective activation checkpointing on every chain layer, with
torch's documented policy as a user writes it (ckplan's ``sac-compute`` option, :mod:`ckplan.sac`).
"""
from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

from ..chainfind import resolve_chain
from ..forwards import forwards_replaced
from ..sac import SAC_KWARGS, policy_fn


def _sac_context():
    # torch's documented policy as a user writes it: without ckplan's KeepLaterRandom
    return create_selective_checkpoint_contexts(policy_fn("sac-compute", rng_safe=False))


class _SacForward:
    """A chain layer's forward run under one selective checkpoint (no-op outside grad mode)."""

    def __init__(self, fwd):
        self.fwd = fwd

    def __call__(self, *args, **kwargs):
        if not torch.is_grad_enabled():
            return self.fwd(*args, **kwargs)
        return checkpoint(self.fwd, *args, use_reentrant=False, context_fn=_sac_context, **SAC_KWARGS, **kwargs)


def sac_policy(model: nn.Module, chain: str | None = None):
    """Wrap every chain layer's forward in a selective checkpoint until the block ends."""
    _, container, _ = resolve_chain(model, chain)
    return forwards_replaced(list(container), lambda _i, fwd: _SacForward(fwd))
