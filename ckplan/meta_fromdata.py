"""Tensors made from Python data during a meta step, made where ckplan's trackers see them.

On a real device, ``torch.tensor(data, device=d)``, ``torch.as_tensor``, ``x.new_tensor`` and an index
list (``qkv[:, :, [-2]]``) make their tensor and hand it to the dispatcher through ``lift_fresh``,
which the live-tensor tracker counts. On meta torch takes a shortcut: the tensor is made below every
mode and no op announces it, so a tensor autograd saves from it (Falcon's fused-QKV split saves two
index tensors per layer) was missed. During a meta step (:class:`ckplan.sdpa.SdpaOnMeta` calls
:func:`made_on_meta`) these calls build the data on the CPU outside every mode and copy it to meta
through the dispatcher, where the trackers see one new storage of the same bytes, as on the device.
"""
from __future__ import annotations

import numbers

import torch
from torch.utils._python_dispatch import _disable_current_modes

_INDEXING = (torch.Tensor.__getitem__, torch.Tensor.__setitem__)
NOT_DONE = object()


def _integer(o) -> bool:
    # booleans make a mask, whose selection needs its values: left to torch (which refuses on meta)
    return isinstance(o, numbers.Integral) and not isinstance(o, (bool, torch.Tensor))


def _plain(obj) -> bool:
    """A non-empty list of Python integers, or of such lists: what torch turns into an index tensor."""
    return isinstance(obj, list) and bool(obj) and all(
        _plain(o) if isinstance(o, list) else _integer(o) for o in obj)


def _flat(obj) -> bool:
    return isinstance(obj, list) and bool(obj) and all(_integer(o) for o in obj)


def _on_meta(data, dtype: torch.dtype | None = None) -> torch.Tensor:
    with _disable_current_modes(), torch._C.DisableTorchFunction():
        cpu = torch.tensor(data, dtype=dtype, device="cpu")
    return cpu.to("meta")


def _index(index):
    """``index`` with its index lists as meta tensors, or None when it has none (a list holding
    lists at the top is a tuple to torch below 32 items: left as it is)."""
    if _flat(index):
        return _on_meta(index)
    if isinstance(index, tuple) and any(_plain(i) for i in index):
        return tuple(_on_meta(i) if _plain(i) else i for i in index)
    return None


def _wanted_device(func, args, kwargs) -> torch.device | None:
    if func is torch.Tensor.new_tensor:
        device = kwargs.get("device", args[0].device)
    elif func is torch.as_tensor:
        device = kwargs.get("device", args[2] if len(args) > 2 else None)
    else:
        device = kwargs.get("device")
    return None if device is None else torch.device(device)


def made_on_meta(func, args: tuple, kwargs: dict):
    """``func(*args, **kwargs)`` with its Python data made as a tracked meta tensor, or
    ``NOT_DONE`` where the call makes none on meta (the caller then runs it as it is)."""
    if func in _INDEXING:
        if len(args) < 2 or not isinstance(args[0], torch.Tensor) or not args[0].is_meta:
            return NOT_DONE
        index = _index(args[1])
        return NOT_DONE if index is None else func(args[0], index, *args[2:], **kwargs)
    if func not in (torch.tensor, torch.as_tensor, torch.Tensor.new_tensor):
        return NOT_DONE
    data = args[1] if func is torch.Tensor.new_tensor else args[0] if args else kwargs.get("data")
    device = _wanted_device(func, args, kwargs)
    if isinstance(data, torch.Tensor) or device is None or device.type != "meta":
        return NOT_DONE
    dtype = kwargs.get("dtype", args[1] if func is torch.as_tensor and len(args) > 1 else None)
    if dtype is None and func is torch.Tensor.new_tensor:
        dtype = args[0].dtype
    try:
        out = _on_meta(data, dtype)
    except (TypeError, ValueError, RuntimeError):
        return NOT_DONE  # data torch.tensor refuses: let the call say so itself
    return out.requires_grad_() if kwargs.get("requires_grad") else out

