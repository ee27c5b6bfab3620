"""Live tensor bytes, op by op: the tracker behind ckplan's CPU measurement and its meta accountant.

``LiveTensorTracker`` is a ``TorchDispatchMode`` that sees every op (forward, backward and the
optimizer) and counts the bytes of every *new* storage an op returns, until that storage is freed
(a ``weakref.finalize`` on the storage object; PyTorch preserves one Python object per live
storage, so the finalizer fires exactly when the last tensor or view is gone). It works on CPU,
on CUDA and on meta tensors, where nothing is allocated but ``nbytes`` is exact. It is ckplan's
CPU measurement and its meta accountant; on CUDA the allocator's own statistics are the truth
(:mod:`ckplan.measure.cuda`).

Known limitations: transient workspace inside one kernel is invisible (only op outputs are
seen); storages resized in place after creation are counted at their first size.
"""
from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


def tensors_in(obj, out: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """The tensors in ``obj``, a tensor or a nest of lists, tuples (named ones and torch's return
    types too) and dicts, in order: what an op's arguments and outputs are made of. Faster than
    pytree's flatten, which the tracker would call twice per op; anything else pytree knows is
    flattened by it."""
    if out is None:
        out = []
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            if isinstance(o, torch.Tensor):
                out.append(o)
            elif isinstance(o, (list, tuple, dict)):
                tensors_in(o, out)
            elif not isinstance(o, (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout,
                                    torch.memory_format)):
                out.extend(t for t in tree_flatten(o)[0] if isinstance(t, torch.Tensor))
    elif isinstance(obj, dict):
        tensors_in(list(obj.values()), out)
    elif obj is not None:
        out.extend(t for t in tree_flatten(obj)[0] if isinstance(t, torch.Tensor))
    return out


def storages_of(obj) -> list[torch.UntypedStorage]:
    out = []
    for t in tensors_in(obj):
        try:
            out.append(t.untyped_storage())
        except (RuntimeError, NotImplementedError):  # tensors without storage (sparse, nested)
            pass
    return out


def unique_storage_bytes(tensors) -> int:
    """Bytes of the storages behind ``tensors`` (a tensor or any nest of them), each storage once.

    Views and tied tensors share a storage, so summing ``nbytes`` per tensor would count it twice.
    """
    seen: dict[int, torch.UntypedStorage] = {}  # the storages stay referenced, so ids stay unique
    for st in storages_of(tensors):
        seen.setdefault(id(st), st)
    return sum(st.nbytes() for st in seen.values())


class TrackerLimitExceeded(RuntimeError):
    """Raised inside the step when live bytes pass the tracker's ``limit_bytes`` (a CPU 'OOM')."""


_LIFT_FRESH = torch.ops.aten.lift_fresh.default


class LiveTensorTracker(TorchDispatchMode):
    """Counts live bytes of storages created while active; keeps the peak.

    ``live`` and ``peak`` are relative to what existed before the tracker saw it: storages made
    earlier (parameters, the batch) are never counted, even when an in-place op returns them.
    ``on_alloc(storage_id, nbytes)`` lets the profiler attribute each new storage to a stage;
    ``on_op(func, input_storage_ids, new_storages, args, kwargs)`` sees every op after it ran, with the
    ``(storage_id, nbytes)`` of each storage it created (the profiler finds parameter uses and
    autocast's weight copies with it). ``on_free(storage_id)`` is called when a counted storage
    dies: its id may then be reused by another Python object.
    """

    def __init__(self, limit_bytes: int | None = None,
                 on_alloc: Callable[[int, int], None] | None = None,
                 on_op: Callable[[object, set[int], list[tuple[int, int]], tuple, dict], None] | None = None,
                 on_free: Callable[[int], None] | None = None):
        super().__init__()
        self.on_op = on_op
        self.on_free = on_free
        self.live = 0
        self.peak = 0
        self.limit_bytes = limit_bytes
        self.on_alloc = on_alloc
        self._known: dict[int, int] = {}  # id(storage object) -> nbytes, for storages we count

    def reset_peak(self) -> None:
        self.peak = self.live

    def live_storages(self) -> dict[int, int]:
        """``id(storage) -> nbytes`` of every counted storage still alive."""
        return dict(self._known)

    def _free(self, key: int, nbytes: int) -> None:
        if self._known.pop(key, None) is not None:
            self.live -= nbytes
            if self.on_free is not None:
                self.on_free(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # ``torch.tensor(...)`` makes its storage outside dispatch and shows it here only as
        # ``lift_fresh``'s input and output: new all the same (Adam's step counters, say).
        inputs = set() if func is _LIFT_FRESH else {id(s) for s in storages_of((args, kwargs))}
        new: list[tuple[int, int]] = []
        for st in storages_of(out):
            key = id(st)
            # An output sharing an input's storage is a view or an in-place result: not new.
            if key in inputs or key in self._known:
                continue
            nbytes = st.nbytes()
            self._known[key] = nbytes
            weakref.finalize(st, self._free, key, nbytes)
            self.live += nbytes
            new.append((key, nbytes))
            if self.on_alloc is not None:
                self.on_alloc(key, nbytes)
            if self.live > self.peak:
                self.peak = self.live
                if self.limit_bytes is not None and self.live > self.limit_bytes:
                    raise TrackerLimitExceeded(
                        f"live tensors reached {self.live} bytes, over the limit of {self.limit_bytes}")
        if self.on_op is not None:
            self.on_op(func, inputs, new, args, kwargs or {})
        return out
