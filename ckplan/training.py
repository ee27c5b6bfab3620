"""The pieces of one training step that profile, bench and the API share.

Keeping them in one place is what makes predictions comparable with measurements: the profile
measures exactly the step that the bench later runs.
"""
from __future__ import annotations

import contextlib

import torch

from .errors import SpecError
from .measure import LiveTensorTracker


def make_optimizer(params, name: str, lr: float, device_type: str):
    """AdamW / SGD with momentum / SGD, with PyTorch's default implementation for the device.

    ``foreach`` is what PyTorch itself would pick on ``device_type`` (multi-tensor on CUDA,
    per-tensor on CPU); stating it lets a meta-tensor stand-in reproduce the same temporaries.
    """
    foreach = device_type == "cuda"
    params = list(params)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, foreach=foreach)
    if name == "sgd-momentum":
        return torch.optim.SGD(params, lr=lr, momentum=0.9, foreach=foreach)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, foreach=foreach)
    raise SpecError(f"optimizer {name!r} is not one of adamw, sgd-momentum, sgd")


def autocast_ctx(precision: str, device_type: str):
    """autocast for bf16/fp16 on cpu/cuda; a no-op for fp32 (and on meta, where autocast has no kernels)."""
    if precision == "fp32" or device_type == "meta":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device_type=device_type, dtype=dtype)


def forward_loss(model, args, kwargs, loss_fn, precision: str, device_type: str):
    """Forward and loss; the model's output object is dropped before returning, as a tidy loop does."""
    with autocast_ctx(precision, device_type):
        out = model(*args, **kwargs)
        loss = loss_fn(out)
    del out
    return loss


def optimizer_memory(params, name: str, lr: float, device_type: str) -> tuple[int, int]:
    """(state bytes, transient bytes of step()) for ``params``, measured on meta-tensor stand-ins.

    The user's parameters and optimizer are never touched: shadows with the same shapes and
    dtypes live on the meta device, get meta gradients, and a real ``torch.optim`` step runs on
    them under the live-tensor tracker (the first step creates the state, the second shows the
    temporaries).
    """
    shadows = []
    for p in params:
        s = torch.empty_like(p, device="meta").requires_grad_(True)
        s.grad = torch.empty_like(s)
        shadows.append(s)
    if not shadows:
        return 0, 0
    opt = make_optimizer(shadows, name, lr, device_type)
    with LiveTensorTracker() as tr:
        opt.step()
        state = tr.live
        tr.reset_peak()
        opt.step()
        tmp = tr.peak - tr.live
    # Scalar `step` counters live on the CPU (a few bytes each) and are counted too.
    return int(state), int(max(tmp, 0))
