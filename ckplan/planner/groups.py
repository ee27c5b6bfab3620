"""Exact merged costs of consecutive layers, the units the dynamic program works on.

The DP (``solve/``) never looks at a layer directly: it sees *units*, each a run of consecutive
layers that are stored together or recomputed together, plus the post stage as the last unit.
With one layer per unit it is the exact rotor DP; with larger units it is exact over the plans
that only cut between units (the fast mode for long chains). The quantities below are what the
simulator (``simulate.py``) computes for those layers, folded so that every DP test is one
comparison: a requirement is the live bytes an op needs above the memory at the start of its
(sub)sequence.

``bwd_tmp'`` (``btmp`` below) is ``max(bwd_tmp, d + grad - xbar - x)``: the simulator's op peak
includes the memory *after* a backward, when its gradients exist and its saved tensors are gone.
"""
from __future__ import annotations

from dataclasses import dataclass
from math import gcd

import numpy as np

from .chain import STORE, Chain

BIG = np.int64(2**62)  # a requirement nothing satisfies (the post is never checkpointed)


@dataclass(frozen=True)
class Units:
    """Per-unit costs, arrays of length U (the last unit is the post stage)."""

    bounds: tuple[tuple[int, int], ...]  # layer range [a, b) of each unit; the post is (n, n + 1)
    hold: np.ndarray  # bytes kept after a stored forward: sum of xbar
    fwd_req: np.ndarray  # stored forward peak above the start: max_k(prefix xbar + fwd_tmp[k])
    bwd_req: np.ndarray  # stored backward peak above the start, before the context term
    x_out: np.ndarray  # output of the unit's last layer (0 for the post)
    fn_first: np.ndarray  # forward-without-saving peak, unit first in its checkpoint
    fn_next: np.ndarray  # same when the previous unit's output is still live
    grad: np.ndarray  # sum of parameter-gradient bytes
    fwd_ms: np.ndarray
    # Selective options of single-layer units (U x O; column 0 is ``store``, i.e. the values
    # above; a unit without option o has BIG bytes and inf ms there). n_opt = 1 without options.
    opt_hold: np.ndarray  # hold with option o
    opt_fwd_req: np.ndarray  # fwd_req with option o
    opt_bwd_req: np.ndarray  # bwd_req with option o
    opt_ms: np.ndarray  # forward time option o redoes in the unit's backward (0 for store)
    opt_names: tuple[tuple[str, ...], ...]  # per unit, the names of its valid columns
    tail_ms: np.ndarray  # the last layer's tail_ms: not redone by a checkpoint ending at the unit
    # Held beside every op once the post backward has started (the loss and its gradient seed,
    # ``Post.backward_hold_bytes``): what a unit's backward at the top level and the inner plan
    # of a top-level checkpoint need on top (``PairCosts``); the post's own columns include it.
    bwd_extra: int = 0
    # fwd_req when the unit ends a recompute stored (PyTorch's early stop: its last layer runs up
    # to its last saved tensor, Layer.stop_*); None: fwd_req
    fwd_req_stop: np.ndarray | None = None
    # The last layer's Layer.lead_bytes (0 for the post): live beside the recompute of a
    # checkpoint ending at the unit, until that layer's backward goes on. The tables count it for
    # the checkpoint's whole inner plan (``PairCosts.inner_extra``), on the safe side.
    lead: np.ndarray | None = None
    # Layers b where a checkpoint cannot span layers b-1 and b (Chain.breaks).
    breaks: tuple[int, ...] = ()

    @property
    def size(self) -> int:
        return len(self.bounds)

    @property
    def n_options(self) -> int:
        """O: columns of the option arrays (1 + the most options of a unit)."""
        return int(self.opt_hold.shape[1])

    def option_names(self, chosen: dict[int, int]) -> dict[int, str]:
        """``{unit: option column}`` (as the plan readers return it) as ``{layer: name}``."""
        return {self.bounds[s][0]: self.opt_names[s][o] for s, o in chosen.items() if o}


def effective_bwd_tmp(chain: Chain) -> list[int]:
    """Per layer: the backward transient including the memory after the op (see module doc)."""
    L = chain.layers
    out = []
    for i, ly in enumerate(L):
        d = L[i - 1].x_bytes if i > 0 else chain.delta_in_bytes
        out.append(max(ly.bwd_tmp_bytes, d + ly.grad_bytes - ly.xbar_bytes - ly.x_bytes))
    return out


def make_units(chain: Chain, cuts: list[int] | None = None) -> Units:
    """Units for ``chain``; ``cuts`` are the layer indices where a new unit starts (0 included).

    ``cuts=None`` gives one unit per layer (the exact DP). Single-layer units get the layer's
    selective options (``Layer.options``) as extra columns of the ``opt_*`` arrays, computed as
    for the layer itself with the option's ``xbar``, ``fwd_tmp`` and ``bwd_tmp``; the post never
    has any.
    """
    L = chain.layers
    n = len(L)
    starts = list(range(n)) if cuts is None else sorted(set(cuts) | {0})
    bounds = [(a, b) for a, b in zip(starts, starts[1:] + [n])]
    btmp = effective_bwd_tmp(chain)
    hold, fwd_req, bwd_req, x_out, fn_first, fn_next, grad, fwd_ms = ([] for _ in range(8))
    fwd_stop: list[int] = []
    for a, b in bounds:
        acc, fr = 0, 0
        for k in range(a, b):
            if k == b - 1:
                fwd_stop.append(max(fr, acc + L[k].stop_xbar_bytes + L[k].stop_fwd_tmp_bytes))
            acc += L[k].xbar_bytes
            fr = max(fr, acc + L[k].fwd_tmp_bytes)
        # Backward of a stored run: at B(k) the layers a..k are still held, the gradients of
        # k+1..b-1 exist, and so does the gradient of x[k].
        br, prefix, later = 0, acc, 0
        for k in range(b - 1, a - 1, -1):
            br = max(br, prefix + later + L[k].x_bytes + btmp[k])
            prefix -= L[k].xbar_bytes
            later += L[k].grad_bytes
        pairs = [L[k - 1].x_bytes + L[k].x_bytes + L[k].fn_tmp(L[k].fwd_tmp_bytes)
                 for k in range(max(a, 1), b)]
        first_inside = [p for k, p in zip(range(max(a, 1), b), pairs) if k > a]
        hold.append(acc)
        fwd_req.append(fr)
        bwd_req.append(br)
        x_out.append(L[b - 1].x_bytes)
        own_first = L[a].x_bytes + L[a].fn_tmp(L[a].fwd_tmp_bytes)
        fn_first.append(max([own_first] + first_inside))
        fn_next.append(max(pairs) if a > 0 else max([own_first] + pairs))
        grad.append(sum(L[k].grad_bytes for k in range(a, b)))
        fwd_ms.append(sum(L[k].fwd_ms for k in range(a, b)))
    post = chain.post
    post_btmp = max(post.bwd_tmp_bytes, L[-1].x_bytes + post.grad_bytes - post.xbar_bytes)
    bounds.append((n, n + 1))
    # the loss is held from the post forward on, its seed from the post backward on
    hold.append(post.xbar_bytes + post.loss_bytes)
    fwd_req.append(post.xbar_bytes + post.loss_bytes + post.fwd_tmp_bytes)
    fwd_stop.append(fwd_req[-1])  # the post never ends a recompute
    bwd_req.append(post.xbar_bytes + post.backward_hold_bytes + post_btmp)
    x_out.append(0)
    fn_first.append(int(BIG))
    fn_next.append(int(BIG))
    grad.append(post.grad_bytes)
    fwd_ms.append(post.fwd_ms)
    i64 = lambda v: np.asarray(v, dtype=np.int64)
    opt_hold, opt_fwd, opt_bwd, opt_ms, names = _option_columns(chain, bounds, hold, fwd_req, bwd_req)
    return Units(tuple(bounds), i64(hold), i64(fwd_req), i64(bwd_req), i64(x_out), i64(fn_first),
                 i64(fn_next), i64(grad), np.asarray(fwd_ms, dtype=np.float64),
                 opt_hold, opt_fwd, opt_bwd, opt_ms, tuple(names),
                 np.asarray([L[b - 1].tail_ms for a, b in bounds[:-1]] + [0.0], dtype=np.float64),
                 int(post.backward_hold_bytes), i64(fwd_stop),
                 i64([L[b - 1].lead_bytes for a, b in bounds[:-1]] + [0]), tuple(chain.breaks))


def _option_columns(chain: Chain, bounds: list[tuple[int, int]], hold: list[int], fwd_req: list[int],
                    bwd_req: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray,
                                                  list[tuple[str, ...]]]:
    """``make_units``' ``opt_*`` columns and option names: column 0 ``store`` (the unit's own
    costs), then each selective option of a single-layer unit (the post has none)."""
    L = chain.layers
    U = len(bounds)
    single = [b - a == 1 for a, b in bounds[:-1]] + [False]
    n_opt = 1 + max((len(L[a].options) for (a, _), one in zip(bounds, single) if one), default=0)
    opt_hold = np.full((U, n_opt), BIG, dtype=np.int64)
    opt_fwd = np.full((U, n_opt), BIG, dtype=np.int64)
    opt_bwd = np.full((U, n_opt), BIG, dtype=np.int64)
    opt_ms = np.full((U, n_opt), np.inf)
    opt_hold[:, 0], opt_fwd[:, 0], opt_bwd[:, 0], opt_ms[:, 0] = hold, fwd_req, bwd_req, 0.0
    names: list[tuple[str, ...]] = []
    for s, ((a, _), one) in enumerate(zip(bounds, single)):
        opts = L[a].options if one else ()
        names.append((STORE, *(o.name for o in opts)))
        if opts:
            ly = L[a]
            d = L[a - 1].x_bytes if a > 0 else chain.delta_in_bytes
            for c, o in enumerate(opts, start=1):
                bt = max(o.bwd_tmp_bytes, d + ly.grad_bytes - o.xbar_bytes - ly.x_bytes)
                opt_hold[s, c] = o.xbar_bytes
                opt_fwd[s, c] = o.xbar_bytes + o.fwd_tmp_bytes
                opt_bwd[s, c] = o.xbar_bytes + ly.x_bytes + bt
                opt_ms[s, c] = o.recompute_ms
    return opt_hold, opt_fwd, opt_bwd, opt_ms, names


def size_gcd(chain: Chain) -> int:
    """The gcd of every size the DP adds up: slots of this size make it exact."""
    g = 0
    vals = [chain.delta_in_bytes, chain.post.xbar_bytes, chain.post.fwd_tmp_bytes,
            chain.post.bwd_tmp_bytes, chain.post.grad_bytes, chain.post.loss_bytes]
    for ly in chain.layers:
        vals += [ly.x_bytes, ly.xbar_bytes, ly.fwd_tmp_bytes, ly.bwd_tmp_bytes, ly.grad_bytes]
        for o in ly.options:
            vals += [o.xbar_bytes, o.fwd_tmp_bytes, o.bwd_tmp_bytes]
        if ly.early_xbar_bytes is not None:
            vals += [ly.early_xbar_bytes, ly.stop_fwd_tmp_bytes]
        vals.append(ly.lead_bytes)
        if ly.nosave_peak_bytes is not None:
            vals.append(ly.nosave_peak_bytes)
    for v in vals:
        g = gcd(g, int(v))
    return g or 1


def equal_cuts(n: int, groups: int) -> list[int]:
    """Start indices of ``groups`` runs of (almost) equal length."""
    groups = max(1, min(groups, n))
    return sorted({(k * n) // groups for k in range(groups)})


def cheap_cuts(chain: Chain, groups: int) -> list[int]:
    """Start indices of ``groups`` runs of about equal length, each cut moved (within half a
    run) to the boundary whose output is smallest: the DP can only end checkpoints at cuts,
    and cheap boundaries are where optimal plans put them."""
    n = chain.n_layers
    groups = max(1, min(groups, n))
    if groups >= n:
        return list(range(n))
    size = n / groups
    x = [ly.x_bytes for ly in chain.layers]
    cuts = [0]
    for k in range(1, groups):
        target = round(k * size)
        lo = max(cuts[-1] + 1, round(target - size / 2))
        hi = min(n - (groups - k), round(target + size / 2))  # leave room for the later runs
        best = min(range(lo, max(lo, hi) + 1), key=lambda p: (x[p - 1], abs(p - target)))
        cuts.append(best)
    return cuts
