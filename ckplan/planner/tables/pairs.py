"""Pair costs of a unit chain in exact bytes: what storing, checkpointing and forwarding need."""
from __future__ import annotations

from functools import cached_property

import numpy as np

from ..groups import Units
from .common import BIG
from .compiled import jitted


class PairCosts:
    """Derived pair quantities of a unit chain, in exact bytes (U x (U+1) int64)."""

    def __init__(self, u: Units):
        U = u.size
        gp = np.concatenate([[0], np.cumsum(u.grad)])
        self._gp = gp
        self.fwd_prefix_ms = np.concatenate([[0.0], np.cumsum(u.fwd_ms)])
        # Q: a checkpoint [s, j) recomputes ckpt_end_ms[j] - fwd_prefix_ms[s], its units' forward
        # less the tail of unit j-1 (Layer.tail_ms); Q[0] = 0
        self.ckpt_end_ms = self.fwd_prefix_ms - np.concatenate([[0.0], u.tail_ms])
        xo = u.x_out
        n_opt = u.n_options
        xe = np.concatenate([[0], xo]).astype(np.int64)  # xe[e] = x_out[e - 1]
        lead = np.zeros(U + 1, dtype=np.int64)  # lead[j] = Units.lead[j - 1]
        if u.lead is not None:
            lead[1:] = u.lead[:U]
        # store_req[s, e]: what Store(s) needs (its forward, and its backward once the rest of a
        # sequence ending at e is done); opt_store_req[o] the same with option o (BIG + small
        # where unit s has no option o). inner_extra[j, e] (1 <= j < e): how much more the inner
        # plan of a checkpoint ending at j starts with than the sequence [., e) it belongs to:
        # the rest's gradients and x[j-1]'s gradient are there (and Units.lead), x[e-1]'s
        # gradient is gone. fnone[s, j] (j <= U-1): forward-without-saving peak of units
        # s..j-1, max(fn_first[s], fn_next[s+1..j-1]).
        fr = np.ascontiguousarray(np.column_stack([u.fwd_req] + [u.opt_fwd_req[:, o] for o in range(1, n_opt)]),
                                  dtype=np.int64)
        br = np.ascontiguousarray(np.column_stack([u.bwd_req] + [u.opt_bwd_req[:, o] for o in range(1, n_opt)]),
                                  dtype=np.int64)
        kernel = jitted("_pair_kernel", U)
        args = (U, np.ascontiguousarray(gp, dtype=np.int64), xe, lead, fr, br,
                np.ascontiguousarray(u.fn_first, dtype=np.int64),
                np.ascontiguousarray(u.fn_next, dtype=np.int64))
        self.opt_store_req, self.inner_extra, self.fnone = (kernel or _pair_numpy)(*args)
        self.store_req = self.opt_store_req[0]
        # A sub-chain ending before the post ends a recompute (only inner plans reach it): a unit
        # stored last there runs as PyTorch's early stop leaves it (Units.fwd_req_stop).
        if u.fwd_req_stop is not None and U > 1:
            ends = np.arange(1, U)
            self.store_req[ends - 1, ends] = np.maximum(u.fwd_req_stop[ends - 1],
                                                        u.bwd_req[ends - 1] - xo[ends - 1])
        # The top level's backward (sub-chains [s, U), the post last) runs beside the loss and
        # its seed (Units.bwd_extra): a unit's backward there, and the inner plan of a checkpoint
        # there (whose forwards were measured without them); inner plans inherit it.
        c = int(u.bwd_extra)
        if c:
            for o in range(n_opt):
                self.opt_store_req[o, :U - 1, U] = np.maximum(
                    u.opt_fwd_req[:U - 1, o] if o else u.fwd_req[:U - 1],
                    (u.opt_bwd_req[:U - 1, o] if o else u.bwd_req[:U - 1])
                    + self.grads_to_end[1:U] - xo[U - 1] + c)
            self.inner_extra[1:U, U] += c
        # A checkpoint cannot span a break (Chain.breaks): such ranges need more than any budget.
        for b in u.breaks:
            from_before = np.array([a for a, _ in u.bounds]) < b
            to_after = np.array([c for _, c in u.bounds]) > b
            span = from_before[:U - 1, None] & to_after[None, :U - 1]  # span[s, j - 1]: [s, j) crosses b
            self.fnone[:U - 1, 1:U][span] = BIG
        self.hold = u.hold

    @cached_property
    def grads(self) -> np.ndarray:
        """``grads[j, e]``: the parameter gradients of units j..e-1 ((U+1) x (U+1), on first use)."""
        return self._gp[None, :] - self._gp[:, None]

    @property
    def grads_to_end(self) -> np.ndarray:
        """``grads[j, U]`` for j = 0..U."""
        return self._gp[-1] - self._gp

    @cached_property
    def store_all(self) -> np.ndarray:
        """``store_all[s, e]``: the least bytes above the start of the plan of [s, e) that stores
        every unit (``store``): the recursion's ``Store`` branch all the way. BIG where e <= s.
        The inner plan of the banded DP's long top-level checkpoints."""
        sr = self.store_req
        U = sr.shape[0]
        out = np.full((U + 1, U + 1), BIG, dtype=np.int64)
        for s in range(U - 1, -1, -1):
            out[s, s + 1] = sr[s, s + 1]
            if s + 2 <= U:
                out[s, s + 2:] = np.maximum(sr[s, s + 2:], self.hold[s] + out[s + 1, s + 2:])
        return out


def _pair_numpy(U: int, gp: np.ndarray, xe: np.ndarray, lead: np.ndarray, fr: np.ndarray,
                br: np.ndarray, fn_first: np.ndarray, fn_next: np.ndarray) -> tuple:
    """``PairCosts``' (opt_store_req, inner_extra, fnone), vectorised (``_pair_kernel``'s
    numpy twin: tests compare them)."""
    n_opt = fr.shape[1]
    cols = np.arange(U + 1)
    below = cols[None, :] > np.arange(U)[:, None]  # below[s, e]: s < e
    later = gp[None, :] - gp[1:U + 1, None] - xe[None, :]  # grads of s+1..e-1, less x[e-1]
    osr = np.zeros((n_opt, U, U + 1), dtype=np.int64)
    for o in range(n_opt):
        np.copyto(osr[o], np.maximum(fr[:U, o, None], br[:U, o, None] + later), where=below)
    inner = np.zeros((U + 1, U + 1), dtype=np.int64)
    np.copyto(inner, gp[None, :] - gp[:, None] - xe[None, :] + (xe + lead)[:, None],
              where=(cols[None, :] > cols[:, None]) & (cols[:, None] >= 1))
    fnone = np.full((U, U + 1), BIG, dtype=np.int64)
    if U > 1:
        run = np.where(cols[None, 1:U] - 1 > np.arange(U - 1)[:, None], fn_next[None, :U - 1],
                       np.iinfo(np.int64).min)
        run[np.arange(U - 1), np.arange(U - 1)] = fn_first[:U - 1]
        np.maximum.accumulate(run, axis=1, out=run)
        fnone[:U - 1, 1:U] = np.where(below[:U - 1, 1:U], run, BIG)
    return osr, inner, fnone
