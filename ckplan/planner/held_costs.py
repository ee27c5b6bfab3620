"""Costs of a held chain's sub-chains (FSDP2 per rank, ``held.py``): inner sub-chains on the held
layers' costs (``inner_costs``), the top level on the chain's own (``top_costs``); and which
chains the exact held DP takes (``held_applies``; ``without_holds`` for the others)."""
from __future__ import annotations

from dataclasses import replace
from functools import lru_cache

import numpy as np

from . import limits
from .chain import STORE, Chain
from .groups import Units, make_units
from .tables import PairCosts, PeakTable


def held_applies(chain: Chain) -> bool:
    """Whether the exact held DP plans ``chain`` (else ``solve/held_fallback.py``; ``held.py``'s docstring)."""
    return (chain.has_holds and chain.all_kept and not chain.has_casts
            and chain.n_layers <= limits.HELD_MAX_LAYERS)


def without_holds(chain: Chain) -> Chain:
    """The chain with nothing held (the fallback's tables plan on it)."""
    def free(ly):
        return replace(ly, held_bytes=0, held_fwd_tmp_bytes=None, held_bwd_tmp_bytes=None,
                       gather_bytes=0, retained_bytes=0,
                       options=tuple(replace(o, held_fwd_tmp_bytes=None, held_bwd_tmp_bytes=None)
                                     for o in ly.options))
    return replace(chain, layers=tuple(free(ly) for ly in chain.layers))


def _beside(chain: Chain, e: int) -> int:
    """What the backward of layer ``e`` left, beside a held forward of a recompute of [., e)."""
    return chain.layers[e].retained_bytes if e < chain.n_layers else 0


def inner_costs(chain: Chain) -> tuple[Units, PairCosts]:
    """Units and pair costs of the inner sub-chains ``[s, e)``, ``e <= n`` (``held.py``'s docstring); their
    columns ``e = U`` (the top level) are not used."""
    L = chain.layers
    n = len(L)
    U = n + 1
    # a checkpoint's first forward inside a recompute: unsharding, beside the next layer's
    fn_view = replace(chain, layers=tuple(ly.held(True, _beside(chain, k + 1)) for k, ly in enumerate(L)))
    u = make_units(fn_view)
    n_opt = u.n_options
    grad = np.array([ly.grad_bytes - ly.held_bytes for ly in L] + [int(u.grad[-1])], dtype=np.int64)
    bwd = u.opt_bwd_req.copy()
    fwd = np.full((U, n_opt), 0, dtype=np.int64)  # xbar + held forward transient, no additions
    for s, ly in enumerate(L):
        d = L[s - 1].x_bytes if s > 0 else chain.delta_in_bytes
        for o, name in enumerate(u.opt_names[s]):
            v = ly.held(False)
            v = v if name == STORE else v.option(name)
            bwd[s, o] = v.xbar_bytes + v.x_bytes + max(v.bwd_tmp_bytes,
                                                       d + int(grad[s]) - v.xbar_bytes - v.x_bytes)
            fwd[s, o] = v.xbar_bytes + v.fwd_tmp_bytes
    ua = replace(u, grad=grad, bwd_req=bwd[:, 0].copy(), opt_bwd_req=bwd)
    pc = PairCosts(ua)
    # Store(s)'s forward in a recompute of a checkpoint ending at e (<= n): beside what e's
    # backward left, with the all-gather buffer unless s is that checkpoint's last layer
    gp = np.concatenate([[0], np.cumsum(grad)])
    xe = np.concatenate([[0], u.x_out]).astype(np.int64)
    beside = np.array([_beside(chain, e) for e in range(U + 1)], dtype=np.int64)
    gather = np.array([ly.gather_bytes for ly in L], dtype=np.int64)
    for s in range(n):
        es = np.arange(s + 1, n + 1)
        later = gp[es] - gp[s + 1] - xe[es]  # gradients of s+1..e-1, less x[e-1]'s
        for o, name in enumerate(u.opt_names[s]):
            f = fwd[s, o] + beside[es] + np.where(es > s + 1, gather[s], 0)
            if name == STORE and L[s].early_xbar_bytes is not None:  # early stop, last stored
                v = L[s].held(False, int(beside[s + 1]))
                f[0] = v.stop_xbar_bytes + v.stop_fwd_tmp_bytes
            pc.opt_store_req[o, s, s + 1:n + 1] = np.maximum(f, bwd[s, o] + later)
    return ua, pc


@lru_cache(maxsize=16)
def top_costs(chain: Chain) -> tuple[Units, PairCosts]:
    """The chain's own units and pair costs (the top level's; ``solve.layer_tables`` builds the same)."""
    u = make_units(chain)
    return u, PairCosts(u)


@lru_cache(maxsize=16)
def inner_tables(chain: Chain) -> tuple[Units, PairCosts, np.ndarray, np.ndarray]:
    """``inner_costs`` and their min-peak table ``(R, K)``, once per chain."""
    ua, pa = inner_costs(chain)
    peaks = PeakTable(ua, pa)
    return ua, pa, peaks.R, peaks.K
