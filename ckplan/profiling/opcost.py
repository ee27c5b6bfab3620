"""Per-op costs of a pass, for pricing it with a device model (``ckplan.device_model``).

``OpCounter`` is ckplan's FLOP counter that also records, for every op that launches work, what a
roofline needs: whether it is a matrix product (an op torch's FLOP counter has a formula for:
matmuls, convolutions, attention kernels), its dtype, its FLOPs, and the bytes of its distinct
input and output tensors. View ops (``view``, ``transpose``, ``expand``...) move no data and launch
no kernel, but the host still dispatches them: they are kept as ``VIEW`` ops with no FLOPs and no
bytes. ``detach``, ``alias`` and ``lift_fresh`` are left out: the checkpoint hooks and the
profiler's own bookkeeping call them, not the model. Works on fake tensors, so a meta profile can
price what it runs.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from ..device_model import ATTENTION, MATMUL, VECTOR, VIEW, DeviceModel, OpCost, ops_ms
from ..measure.tracker import tensors_in
from .flops import FlopCounter

_VIEWS: dict[Any, bool] = {}
_BOOKKEEPING = frozenset(("detach", "alias", "lift_fresh"))


def _is_view(packet: Any) -> bool:
    """Whether every overload of ``packet`` only views its input (no kernel, no bytes)."""
    hit = _VIEWS.get(packet)
    if hit is None:
        try:
            overloads = [getattr(packet, name) for name in packet.overloads()]
            hit = bool(overloads) and all(getattr(o, "is_view", False) for o in overloads)
        except (AttributeError, RuntimeError):
            hit = False
        hit = hit or _name(packet) in _BOOKKEEPING or _name(packet) in ("_unsafe_view", "_reshape_alias")
        _VIEWS[packet] = hit
    return hit


def _name(packet: Any) -> str:
    return str(getattr(packet, "__name__", packet)).split(".")[-1]


def _bytes(tensors: Iterable[torch.Tensor]) -> int:
    seen: set[int] = set()
    total = 0
    for t in tensors:
        if id(t) in seen:
            continue
        seen.add(id(t))
        size = t.numel() * t.element_size()
        try:  # a broadcast (expanded) tensor reads its storage, not its numel
            size = min(size, t.untyped_storage().nbytes())
        except (RuntimeError, NotImplementedError):
            pass
        total += size
    return total


def _dtype_name(tensors: list[torch.Tensor]) -> str:
    floats = [t for t in tensors if t.is_floating_point()]
    return str((floats or tensors)[0].dtype).replace("torch.", "") if tensors else "float32"


class OpCounter(FlopCounter):
    """FLOPs as :class:`ckplan.profiling.flops.FlopCounter` counts them, and ``ops``: one
    :class:`OpCost` per op the host dispatches (kernels and views), in order (``mark`` gives the index now)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[OpCost] = []

    def mark(self) -> int:
        return len(self.ops)

    def _count_flops(self, func_packet, out, args, kwargs):
        before = self.get_total_flops()
        result = super()._count_flops(func_packet, out, args, kwargs)
        if _is_view(func_packet):
            if _name(func_packet) not in _BOOKKEEPING:
                self.ops.append(OpCost(VIEW, "", 0, 0))
        else:
            flops = self.get_total_flops() - before
            outs = tensors_in(out)
            ins = tensors_in((args, kwargs))
            kind = VECTOR if func_packet not in self.flop_registry else \
                ATTENTION if "attention" in _name(func_packet) else MATMUL
            if kind == VECTOR:
                flops = sum(t.numel() for t in outs)  # one operation per element written
            self.ops.append(OpCost(kind, _dtype_name(outs or ins), int(flops), _bytes(ins + outs)))
        return result


def price(device: DeviceModel, ops: list[OpCost], start: int = 0, stop: int | None = None,
          *, sac: bool = False) -> float:
    """Milliseconds of ``ops[start:stop]`` on ``device``."""
    return ops_ms(device, ops[start:stop], sac=sac)
