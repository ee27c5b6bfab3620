"""Meta kernels run once per shape: the speed of a fake pass over a large model.

On the meta device most elementwise kernels are torch's Python references (``torch._refs``):
a tenth of a millisecond or more per op, most of a 70B model's fake step. A model's layers repeat
the same ops on the same shapes, and a meta kernel's output depends only on the metadata of its
inputs, so ``MetaKernelCache`` runs each (op, input metadata) once and afterwards makes the
same output directly: an empty meta tensor with the output's shape, strides and dtype.

Only what cannot change a measurement is cached: ops whose schema returns fresh tensors (no
alias annotation, no in-place or ``out=`` form), called on plain meta tensors and hashable
arguments, whose first run gave outputs that share no storage with an input (``_unsafe_view``
returns a view its schema does not declare) and whose storages are exactly what
``empty_strided`` makes. Anything else runs its kernel every time.

The cache must sit below every mode that observes ops (the live-tensor tracker, the FLOP
counter, selective checkpointing's caching modes): enter it first, so that they see each op
and it only replaces the kernel.

Where a meta kernel lays its output out otherwise than the CPU and CUDA kernels do, the output
takes theirs (``REAL_LAYOUT``): layer norm's backward makes its input's gradient contiguous on
both, while its meta kernel follows the strides of the incoming gradient, so that a transposed
gradient (a pooled head's) cost the layer before it a copy on meta only.
"""
from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_SCALARS = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)
_PLAIN = (torch.Tensor, torch.nn.Parameter)
_Out = tuple[tuple[torch.dtype, tuple[int, ...], tuple[int, ...]], ...]


class _Uncacheable(Exception):
    pass


def fresh_outputs(func: Any) -> bool:
    """Whether ``func``'s schema returns only new tensors: no alias annotation anywhere."""
    schema = func._schema
    if not schema.returns or any(str(r.type) != "Tensor" for r in schema.returns):
        return False
    return all(a.alias_info is None for a in (*schema.arguments, *schema.returns))


def _key(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        if type(x) not in _PLAIN or not x.is_meta:
            raise _Uncacheable
        return (x.dtype, tuple(x.shape), x.stride())
    if isinstance(x, (list, tuple)):
        return tuple(_key(v) for v in x)
    if isinstance(x, _SCALARS):
        return (type(x), x)  # 1, 1.0 and True are equal keys, but not equal dtypes
    raise _Uncacheable


def _storages(tensors) -> set[int]:
    return {t.untyped_storage()._cdata for t in tensors if isinstance(t, torch.Tensor)}


def _flat(args: Any) -> list:
    out: list = []
    for a in args:
        out.extend(_flat(a) if isinstance(a, (list, tuple)) else [a])
    return out


class MetaKernelCache(TorchDispatchMode):
    """Each meta kernel run once per (op, input metadata); later calls make the recorded outputs
    (module doc). ``hits`` counts the kernels it saved."""

    def __init__(self) -> None:
        super().__init__()
        self._fresh: dict[Any, bool] = {}
        self._outs: dict[Any, _Out | None] = {}  # None: this key ran once and cannot be cached
        self.hits = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        fresh = self._fresh.get(func)
        if fresh is None:
            fresh = self._fresh[func] = isinstance(func, torch._ops.OpOverload) and fresh_outputs(func)
        if not fresh:
            return func(*args, **kwargs)
        try:
            # factory ops without a dtype follow the default dtype: part of the key
            key = (func, _key(args), _key(tuple(sorted(kwargs.items()))), torch.get_default_dtype())
        except _Uncacheable:
            return _real_layout(func, func(*args, **kwargs))
        if key in self._outs:
            outs = self._outs[key]
            if outs is None:
                return _real_layout(func, func(*args, **kwargs))
            self.hits += 1
            made = tuple(torch.empty_strided(shape, stride, dtype=dtype, device="meta")
                         for dtype, shape, stride in outs)
            return made if len(func._schema.returns) > 1 else made[0]
        out = _real_layout(func, func(*args, **kwargs))
        self._outs[key] = _record(out, args, kwargs)
        return out


# op -> the outputs the CPU and CUDA kernels make contiguous whatever their inputs' strides
REAL_LAYOUT = {torch.ops.aten.native_layer_norm_backward.default: (0,)}


def _real_layout(func: Any, out: Any) -> Any:
    """``out`` with the layout the real kernels give it (``REAL_LAYOUT``)."""
    which = REAL_LAYOUT.get(func)
    if not which:
        return out
    outs = list(out)
    for i in which:
        o = outs[i]
        if isinstance(o, torch.Tensor) and o.is_meta and not o.is_contiguous():
            outs[i] = torch.empty(o.shape, dtype=o.dtype, device="meta")
    return tuple(outs)


def _record(out: Any, args: tuple, kwargs: dict) -> _Out | None:
    """The outputs' metadata, or None where ``empty_strided`` would not make the same storages."""
    outs = out if isinstance(out, tuple) else (out,)
    if not all(isinstance(o, torch.Tensor) and o.is_meta and o.storage_offset() == 0 for o in outs):
        return None
    if _storages(outs) & _storages(_flat((*args, *kwargs.values()))):
        return None
    rec = []
    for o in outs:
        made = torch.empty_strided(o.shape, o.stride(), dtype=o.dtype, device="meta")
        if made.untyped_storage().nbytes() != o.untyped_storage().nbytes():
            return None
        rec.append((o.dtype, tuple(o.shape), o.stride()))
    if len(_storages(outs)) != len(outs):  # outputs sharing a storage
        return None
    return tuple(rec)
