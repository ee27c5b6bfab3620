"""The ranks' gradient check (:mod:`ckplan.dist_rank` runs it): one process's gradients on the
global batch, and what a rank holds of its own gradients against them or against its own run.
"""
from __future__ import annotations

import gc

import torch
import torch.distributed as dist

from .param_dtype import cast_like_fsdp
from .spec import Spec, build_model, make_batch, to_loss
from .training import forward_loss


def reference_grads(spec: Spec, world: int, device: torch.device) -> dict[str, torch.Tensor]:
    """One process, the same initial weights, the ranks' micro-batches concatenated (under
    ``parallel.param_dtype``, computing in that dtype as the ranks do)."""
    model = build_model(spec, str(device))
    if spec.parallel.param_dtype is not None:
        cast_like_fsdp(model, spec.chain, spec.parallel.param_dtype)
    parts = [make_batch(spec, str(device), seed=spec.seed + r) for r in range(world)]
    args = tuple(torch.cat([p[0][i] for p in parts]) for i in range(len(parts[0][0])))
    kwargs = {key: torch.cat([p[1][key] for p in parts]) for key in parts[0][1]}
    loss = forward_loss(model, args, kwargs, to_loss, spec.train.precision, device.type)
    loss.backward()
    grads = {n: p.grad.detach().float().cpu().clone() for n, p in model.named_parameters() if p.grad is not None}
    del model, loss
    gc.collect()
    return grads


def grad_diff(model, ref: dict[str, torch.Tensor] | None, device: torch.device) -> tuple[float, float]:
    """(max |this rank's gradient - one process's|, max |one process's gradient|), on every rank.

    ``ref`` (rank 0 only; None elsewhere) holds one process's full gradients. Each is sent from
    rank 0 one parameter at a time, as the rank holds it: scattered like the FSDP2 shard
    (``distribute_tensor`` with the gradient's own placements), whole (broadcast) under DDP. Every
    rank then compares its own part, so a rank whose gradients are wrong says so itself.
    """
    from torch.distributed.tensor import DTensor, distribute_tensor

    scale = torch.zeros((), dtype=torch.float32, device=device)
    if ref is not None:
        scale.fill_(max((float(g.abs().max()) for g in ref.values() if g.numel()), default=0.0))
    dist.broadcast(scale, 0)
    worst = 0.0
    for name, p in model.named_parameters():
        g = p.grad
        if g is None:
            continue
        key = name.replace("_orig_mod.", "").replace("module.", "")
        full = (ref[key].to(g.device) if ref is not None
                else torch.empty(g.shape, dtype=torch.float32, device=g.device))
        if isinstance(g, DTensor):
            want = distribute_tensor(full, g.device_mesh, g.placements, src_data_rank=0).to_local()
        else:
            dist.broadcast(full, 0)
            want = full
        have = local_part(g).detach().float()
        if have.numel():
            worst = max(worst, float((have - want).abs().max()))
        del full, want, have
    return worst, float(scale)


def own_diff(model, own: dict[str, torch.Tensor]) -> float:
    """max |this rank's gradient - its own run's without checkpointing| over what the rank holds
    (inf for a gradient in one run and none in the other)."""
    worst = 0.0
    for name, p in model.named_parameters():
        mine, theirs = None if p.grad is None else local_part(p.grad).detach(), own.get(name)
        if (mine is None) != (theirs is None):
            return float("inf")
        if mine is not None and theirs is not None and mine.numel():
            worst = max(worst, float((mine.float() - theirs.float()).abs().max()))
    return worst


def local_part(t: torch.Tensor) -> torch.Tensor:
    """What this rank holds of ``t``: the local shard of a DTensor, else ``t``."""
    from torch.distributed.tensor import DTensor
    return t.to_local() if isinstance(t, DTensor) else t
