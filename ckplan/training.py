"""The pieces of one training step that profile, bench and the API share.

Keeping them in one place is what makes predictions comparable with measurements: the profile
measures exactly the step that the bench later runs.
"""
from __future__ import annotations

import contextlib
from collections import Counter

import torch

from . import meta_autocast
from .device_model import DeviceModel, ops_ms
from .errors import SpecError
from .measure import Clock, LiveTensorTracker
from .options import OPTIMIZERS
from .profiling.opcost import OpCounter


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
    raise SpecError(f"optimizer {name!r} is not one of {', '.join(OPTIMIZERS)}")


# The optimizer's step is timed on stand-ins of at most this many parameter bytes, scaled up.
OPT_SAMPLE_BYTES = 256 * 2**20


def optimizer_step_ms(params, name: str, lr: float, device: torch.device, repeats: int = 3,
                      sample_bytes: int = OPT_SAMPLE_BYTES, priced_by: DeviceModel | None = None) -> float | None:
    """Milliseconds of one ``optimizer.step()`` over ``params``, timed on stand-ins (on meta: its
    ops priced by ``priced_by``, :func:`meta_optimizer_step_ms`; None without a device model).

    The step is element-wise and bound by memory traffic, so its time follows the parameter
    count: zero-filled copies of the parameters (in order, up to ``sample_bytes``), with zero
    gradients, get one step (the state is made) and ``repeats`` timed ones; the median is scaled
    by all elements / sampled elements. The user's parameters and optimizer are never touched.
    """
    params = [p for p in params if p.requires_grad]
    if device.type == "meta" and priced_by is not None and params:
        return meta_optimizer_step_ms(params, name, lr, priced_by)
    if device.type == "meta" or not params:
        return None
    total = sum(p.numel() for p in params)
    sample, nbytes = [], 0
    for p in params:
        if sample and nbytes + p.numel() * p.element_size() > sample_bytes:
            break
        s = torch.zeros_like(p, device=device).requires_grad_(True)
        s.grad = torch.zeros_like(s)
        sample.append(s)
        nbytes += p.numel() * p.element_size()
    opt = make_optimizer(sample, name, lr, device.type)
    opt.step()
    clock = Clock(device)
    times = []
    for _ in range(max(1, repeats)):
        t0 = clock.now_ms()
        opt.step()
        times.append(clock.now_ms() - t0)
    times.sort()
    return times[len(times) // 2] * total / sum(s.numel() for s in sample)


def meta_optimizer_step_ms(params, name: str, lr: float, device: DeviceModel) -> float:
    """One steady ``optimizer.step()`` (its state already made) over meta stand-ins of ``params``,
    every op priced by ``device`` (the optimizer as that device runs it: foreach on CUDA)."""
    stand = []
    for p in params:
        s = torch.zeros_like(p, device="meta").requires_grad_(True)
        s.grad = torch.zeros_like(s)
        stand.append(s)
    opt = make_optimizer(stand, name, lr, device.kind)
    opt.step()
    counter = OpCounter()
    with counter:
        opt.step()
    return ops_ms(device, counter.ops)


def autocast_ctx(precision: str, device_type: str):
    """autocast for bf16/fp16 on cpu/cuda; a no-op for fp32. On meta, where autocast casts nothing,
    the target device's autocast replayed (``ckplan.meta_autocast``) inside a profile's step."""
    if precision == "fp32":
        return contextlib.nullcontext()
    if device_type == "meta":
        return meta_autocast.region(precision)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device_type=device_type, dtype=dtype)


def forward_loss(model, args, kwargs, loss_fn, precision: str, device_type: str):
    """Forward and loss; the model's output object is dropped before returning, as a tidy loop does."""
    with autocast_ctx(precision, device_type):
        out = model(*args, **kwargs)
        loss = loss_fn(out)
    del out
    return loss


def optimizer_memory(params, name: str, lr: float, device_type: str) -> tuple[int, int, int]:
    """(state bytes, transient bytes of step(), scalar state bytes) for ``params``, measured on
    meta-tensor stand-ins.

    The user's parameters and optimizer are never touched: shadows with the same shapes and
    dtypes live on the meta device, get meta gradients, and a real ``torch.optim`` step runs on
    them under the live-tensor tracker (the first step creates the state, the second shows the
    temporaries).

    Scalar state (AdamW's ``step`` counter, one 0-dim tensor per parameter) is the third value
    and is part of the first: it does not shrink when FSDP shards the parameters. PyTorch keeps
    the counters on the CPU unless the step is fused or capturable, so they are counted only
    when the step runs on the CPU (on CUDA the allocator never sees them).

    The per-tensor step (``foreach`` off: the CPU's) handles one parameter at a time, and what it
    leaves bound from the one before lasts one more: its state is the sum of each shape's, and its
    transient the largest of one over each pair of shapes that follow each other in ``params``
    (a step over that pair). A model of 80 equal layers runs a dozen small steps, not its 700
    parameters' (the same bytes: ``tests/test_training.py``).
    """
    params = list(params)
    if not params:
        return 0, 0, 0
    if device_type == "cuda":  # multi-tensor: temporaries over the whole group
        return _step_memory(params, name, lr, device_type)
    keys = [(tuple(p.shape), p.dtype) for p in params]
    first: dict[tuple, torch.Tensor] = {}
    for k, p in zip(keys, params):
        first.setdefault(k, p)
    counts = Counter(keys)
    state = tmp = scalars = 0
    for k, p in first.items():
        s, _, sc = _step_memory([p], name, lr, device_type)
        state, scalars = state + counts[k] * s, scalars + counts[k] * sc
    for a, b in dict.fromkeys([(keys[0], None), *zip(keys, keys[1:])]):
        tmp = max(tmp, _step_memory([first[a]] + ([first[b]] if b is not None else []), name, lr, device_type)[1])
    return state, tmp, scalars


def _step_memory(params, name: str, lr: float, device_type: str) -> tuple[int, int, int]:
    """``optimizer_memory`` measured on stand-ins of every parameter in ``params``."""
    shadows = []
    for p in params:
        s = torch.empty_like(p, device="meta").requires_grad_(True)
        s.grad = torch.empty_like(s)
        shadows.append(s)
    opt = make_optimizer(shadows, name, lr, device_type)
    with LiveTensorTracker() as tr:
        opt.step()
        state = tr.live
        tr.reset_peak()
        opt.step()
        tmp = tr.peak - tr.live
    elsewhere = scalars = 0
    for st in opt.state.values():
        for v in st.values():
            if not isinstance(v, torch.Tensor):
                continue
            nbytes = v.untyped_storage().nbytes()
            if v.device.type != "meta" and device_type != "cpu":
                elsewhere += nbytes  # host memory while the step runs on the device
            elif v.dim() == 0:
                scalars += nbytes
    return int(state - elsewhere), int(max(tmp, 0)), int(scalars)
