"""FLOP counting for the profile: torch's ``FlopCounterMode``, totals only, never fatal.

FLOPs are an estimate: ckplan uses them to price time on ``--device meta`` and to spread measured
times over layers of one kind. torch's counter can fail on a call its formula does not expect
(torch 2.11's SDPA formula asserts when key/value have fewer heads than the query, as in
grouped-query attention), and an estimate must never abort a profile. ``FlopCounter`` wraps every
formula: when torch's raises, the call is counted by ckplan's own formula where it has one (the
attention kernels below), else counted as 0, and the op is recorded in ``estimated`` so that the
profile says which numbers are ckplan's.

Attention (Vaswani et al.; the count torch uses for SDPA): the forward is two batched matmuls,
``Q K^T`` and ``P V``, each ``2 b h s_q s_k d`` FLOPs with ``h`` the *query* heads (grouped-query
attention broadcasts each key/value head to ``h / h_kv`` query heads, so it does the same
arithmetic); the backward recomputes ``Q K^T`` and does four more: ``2 b h s_q s_k (3 d_qk + 2 d_v)``.
"""
from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils import flop_counter as fc
from torch.utils.flop_counter import FlopCounterMode

from ..errors import first_line

# Attention kernels whose tensors are (batch, heads, seq, dim), and those that take
# (batch, seq, heads, dim). Backward ops take the output's gradient first.
_BHSD_FORWARD = ("_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention",
                 "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
                 "_scaled_dot_product_fused_attention_overrideable")
_BSHD_FORWARD = ("_efficient_attention_forward", "_flash_attention_forward")


def attention_flops(q: Sequence[int], k: Sequence[int], v: Sequence[int], backward: bool) -> int:
    """FLOPs of one attention call on (batch, heads, seq, dim) shapes, key/value heads broadcast
    to the query's (module doc)."""
    b, h, s_q, d_qk = q
    s_k, d_v = k[-2], v[-1]
    if backward:
        return 2 * b * h * s_q * s_k * (3 * d_qk + 2 * d_v)
    return 2 * b * h * s_q * s_k * (d_qk + d_v)


def _op_name(op: Any) -> str:
    return str(getattr(op, "__name__", op)).split(".")[-1]


def own_formula(op: Any, args: tuple) -> int | None:
    """ckplan's count of one call of ``op``, or None when it has no formula for it."""
    name = _op_name(op)
    backward = name.endswith("_backward")
    base = name[: -len("_backward")] if backward else name
    tensors = list(args[1:4] if backward else args[0:3])
    if len(tensors) < 3 or not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in tensors):
        return None
    q, k, v = (tuple(t.shape) for t in tensors)
    if base in _BSHD_FORWARD:
        q, k, v = ((s[0], s[2], s[1], s[3]) for s in (q, k, v))
    elif base not in _BHSD_FORWARD:
        return None
    return attention_flops(q, k, v, backward)


class _GlobalOnly:
    """FlopCounterMode's module tracker, replaced: every FLOP counts under "Global" only.

    The real one hooks every module call, recomputes in the backward included, and what those
    hooks keep holds recomputed tensors alive (torch 2.13: a selective checkpoint's backward peak
    grew by ~100 KB per layer of a tiny GPT); the profile needs totals only.
    """

    parents = frozenset({"Global"})

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        return None


def _plain(func: Any, registry: dict) -> bool:
    """Whether torch's counter would run ``func`` as it is and count it: an op with a formula, or
    one with no CompositeImplicitAutograd kernel to decompose into (most of a step's ops)."""
    if not isinstance(func, torch._ops.OpOverload) or func in _METADATA_OPS:
        return False
    if func in registry:
        return True
    key = torch._C.DispatchKey.CompositeImplicitAutograd
    return key not in func.py_kernels and not torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), key)


def _metadata_ops() -> frozenset:
    """The ops torch's counter hands back unhandled (sizes, strides: nested tensors' policy)."""
    names = ("sym_is_contiguous.default", "is_contiguous.default", "is_contiguous.memory_format",
             "is_strides_like_format.default", "is_non_overlapping_and_dense.default", "size.default",
             "sym_size.default", "stride.default", "sym_stride.default", "storage_offset.default",
             "sym_storage_offset.default", "numel.default", "sym_numel.default", "dim.default")
    ops = [getattr(getattr(torch.ops.aten, n.split(".")[0], None), n.split(".")[1], None) for n in names]
    return frozenset([op for op in ops if op is not None] + [torch.ops.prim.layout.default,
                                                             torch.ops.prim.device.default])


_METADATA_OPS = _metadata_ops()
_TorchMode = getattr(fc, "_FlopCounterMode", None)


if _TorchMode is not None and hasattr(_TorchMode, "__torch_dispatch__"):
    class _FastMode(_TorchMode):  # type: ignore[misc, valid-type]
        """torch's counting mode with the common case first: an op that would be counted as it is
        runs without the decomposition attempt (a mode re-entry and a dispatcher query per op, a
        third of a meta profile's counting time). Everything else goes to torch's own path."""

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            plain = self.counter._plain_ops.get(func)
            if plain is None:
                plain = self.counter._plain_ops[func] = _plain(func, self.counter.flop_registry)
            if not plain:
                return super().__torch_dispatch__(func, types, args, kwargs)
            out = func(*args, **(kwargs or {}))
            return self.counter._count_flops(func._overloadpacket, out, args, kwargs)
else:  # a torch whose counter is laid out otherwise: its own path
    _FastMode = None  # type: ignore[assignment, misc]


class FlopCounter(FlopCounterMode):
    """Total FLOPs of what runs inside it; ``estimated`` maps each op that torch's formula could
    not count to what counted it instead ("ckplan's formula" or "not counted")."""

    def __init__(self) -> None:
        _register_experts_loop_flops()  # before the counter copies the registry
        super().__init__(display=False)
        if hasattr(self, "mod_tracker"):
            self.mod_tracker = _GlobalOnly()
        self.estimated: dict[str, str] = {}
        self._plain_ops: dict[Any, bool] = {}
        self.flop_registry = {op: self._guarded(op, f) for op, f in self.flop_registry.items()}

    def __enter__(self):
        entered = super().__enter__()
        if _FastMode is not None and type(getattr(self, "mode", None)) is _TorchMode:
            self.mode.__class__ = _FastMode  # same object, same state: only the dispatch differs
        return entered

    def _guarded(self, op: Any, formula: Callable[..., int]) -> Callable[..., int]:
        def count(*args, out_val=None, **kwargs) -> int:
            try:
                return formula(*args, out_val=out_val, **kwargs)
            except Exception as e:  # torch's formula rejects this call: an estimate, not an error
                flops = own_formula(op, args)
                how = "ckplan's formula" if flops is not None else "not counted"
                self.estimated.setdefault(_op_name(op), f"{how}; torch's counter raised "
                                                        f"{type(e).__name__}: {first_line(str(e))[:120]}")
                return flops or 0
        return count


def estimated_note(estimated: dict[str, str]) -> str | None:
    """The profile's note naming the ops whose FLOPs are not torch's count, or None."""
    if not estimated:
        return None
    ours = sorted(op for op, how in estimated.items() if how.startswith("ckplan's"))
    none = sorted(op for op in estimated if op not in ours)
    parts = []
    if ours:
        parts.append("counted by ckplan's formula (attention with key/value heads broadcast to the "
                     f"query's): {', '.join(ours)}")
    if none:
        parts.append(f"not counted (0 FLOPs, so free on meta): {', '.join(none)}")
    return ("FLOPs that torch's FLOP counter could not count (an estimate only: measured sizes and "
            "times are unaffected): " + "; ".join(parts))


def _register_cpu_flash_flops() -> None:
    """torch counts no FLOPs for the CPU flash-attention kernels (torch 2.13 registers the CUDA
    ones only), so attention would be free in CPU and meta profiles; count them as SDPA's formula does."""
    aten = torch.ops.aten
    fwd = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    bwd = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
    if fwd is None or bwd is None or fwd in fc.flop_registry or not hasattr(fc, "register_flop_formula"):
        return

    @fc.register_flop_formula(fwd, get_raw=True)
    def _fwd(query, key, value, *args, out_val=None, **kwargs) -> int:
        return fc.sdpa_flop_count(query.shape, key.shape, value.shape)

    @fc.register_flop_formula(bwd, get_raw=True)
    def _bwd(grad_out, query, key, value, *args, out_val=None, **kwargs) -> int:
        return fc.sdpa_backward_flop_count(grad_out.shape, query.shape, key.shape, value.shape)


def _register_grouped_mm_flops() -> None:
    """torch counts no FLOPs for ``torch._grouped_mm`` (mixture-of-experts layers: each token's
    rows times its expert's weights), so on meta the experts' matmuls were free. Every row of the
    first operand meets one (K, N) slice: 2 M K N, times the groups when both are batched."""
    op = getattr(torch.ops.aten, "_grouped_mm", None)
    if op is None or op in fc.flop_registry or not hasattr(fc, "register_flop_formula"):
        return

    @fc.register_flop_formula(op, get_raw=True)
    def _flops(mat_a, mat_b, *args, out_val=None, **kwargs) -> int:
        m, k, n = mat_a.shape[-2], mat_a.shape[-1], mat_b.shape[-1]
        groups = mat_a.shape[0] if mat_a.dim() == 3 and mat_b.dim() == 3 else 1
        return 2 * groups * m * k * n


def _register_experts_loop_flops() -> None:
    """transformers 5's experts fall back to a loop of ``mm`` inside a custom op where
    ``torch._grouped_mm`` cannot run (a CPU with torch <= 2.8): the counter sees the op, not its
    matmuls. Count them as ``_grouped_mm``'s: 2 S K N forward, twice that backward (the input's and
    the weights' gradients). Registered once that module is loaded."""
    if "transformers.integrations.moe" not in sys.modules or not hasattr(fc, "register_flop_formula"):
        return
    try:
        fwd = torch.ops.transformers.grouped_mm_fallback
        bwd = torch.ops.transformers.grouped_mm_fallback_backward
    except (AttributeError, RuntimeError):  # a transformers without the loop
        return
    if fwd in fc.flop_registry:
        return

    @fc.register_flop_formula(fwd, get_raw=True)
    def _fwd(inp, weight, *args, out_val=None, **kwargs) -> int:
        return 2 * inp.shape[0] * inp.shape[1] * weight.shape[-1]

    @fc.register_flop_formula(bwd, get_raw=True)
    def _bwd(inp, weight, *args, out_val=None, **kwargs) -> int:
        return 4 * inp.shape[0] * inp.shape[1] * weight.shape[-1]


_register_cpu_flash_flops()
_register_grouped_mm_flops()
