"""The tables' shared pieces: sentinels, the memory no plan changes, slot arithmetic."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ..chain import Chain

INF = np.inf


BIG = np.int64(2**62)  # bytes nothing satisfies


TOP = np.int64(2**63 - 1)  # above BIG plus any size


# A reconstruction step: (j, m for the rest, m for the inner plan, option). ``j`` is None for
# ``Store(s)`` (with option column ``option``, 0 = ``store``), else the checkpoint is ``[s, j)``
# (option 0); an inner plan of None means "store all".
Step = tuple["int | None", int, "int | None", int]


Chooser = Callable[[int, int, int], Step]


Spans = tuple[tuple[int, int], ...]  # ``(lo, e)`` pairs: ``nest`` of the banded tables


def fixed_peak(chain: Chain) -> int:
    """The part of the peak no plan changes: pre forward/backward and the optimizer step (side
    inputs counted as live throughout, as in ``base_bytes``)."""
    p, pre = chain.persistent_bytes + chain.side_bytes + chain.side_grad_bytes + chain.unsaved_bytes, chain.pre
    grads = sum(ly.grad_bytes for ly in chain.layers) + chain.post.grad_bytes
    pre_b = p + pre.retained_bytes + chain.delta_in_bytes + grads + chain.post.backward_hold_bytes
    pre_after = pre_b + pre.grad_bytes - pre.retained_bytes - chain.delta_in_bytes
    return max(p + pre.retained_bytes + pre.cast_bytes + pre.fwd_tmp_bytes, pre_b + pre.bwd_tmp_bytes, pre_after,
               chain.opt_step_peak_bytes)


def base_bytes(chain: Chain) -> int:
    """Memory at the start of the chain's forward: persistent + what pre keeps + the side inputs
    (``Chain.side_inputs``). The tables take the side inputs as live until the step ends: the
    simulator frees them earlier (when the chain's forward ends, or after the backward of the
    first item holding their layers), so every plan peaks no higher than the tables say and a
    plan they fit fits; near the smallest peak the tables may give up at most ``side_bytes``.
    The side inputs' gradients (``SideInput.grad_bytes``) and what checkpointed layers keep
    outside saved tensors (``Layer.unsaved_kept_bytes``, all layers') are counted the same way."""
    return (chain.persistent_bytes + chain.pre.retained_bytes + chain.side_bytes + chain.side_grad_bytes
            + chain.unsaved_bytes)


def ceil_div(a: Any, q: int) -> Any:
    return -((-a) // q)


def near_div(a: Any, q: int) -> Any:
    """Nearest slot count, but never 0 for a positive size (a free boundary or a free layer
    would bias every estimate the same way)."""
    n = (a + q // 2) // q
    return np.where((a > 0) & (n < 1), 1, n)


def shift(a: np.ndarray, d: int, M: int, dtype: Any, add: np.ndarray | None = None) -> np.ndarray:
    """``out[..., m] = a[..., min(m - d, M)] (+ add[m])`` along the last axis: infeasible
    (INF) where ``m - d < 0``; a negative ``d`` reads the top slot ``M`` past the end."""
    out = np.empty(a.shape, dtype=dtype)

    def put(dst: np.ndarray, src: np.ndarray, extra: np.ndarray | None) -> None:
        if extra is None:
            dst[...] = src
        else:
            np.add(src, extra, out=dst)

    if d >= 0:
        d = min(d, M + 1)
        out[..., :d] = INF
        put(out[..., d:], a[..., :M + 1 - d], None if add is None else add[d:])
    else:
        d = max(d, -(M + 1))
        k = M + 1 + d
        put(out[..., :k], a[..., -d:], None if add is None else add[:k])
        put(out[..., k:], a[..., M:M + 1], None if add is None else add[k:])
    return out
