"""Loading the compiled kernels: numba on first use, the numpy path without it."""
from __future__ import annotations

import importlib
from typing import Any

from .. import limits
from . import frontier_kernel, table_kernels

_JIT: dict[str, Any] = {}
_HELPERS = ((frontier_kernel, ("_grow", "_merge_into", "_first_at_most", "_first_mem", "_gallop_width",
                               "_shifted_candidates", "_trim")),
            (table_kernels, ("_shifted",)))


def jitted(name: str, units: int) -> Any:
    """The compiled kernel ``name`` for a table on ``units`` units, or None for the numpy path
    (numba not installed, ``USE_NUMBA`` off, or fewer than ``NUMBA_MIN_UNITS`` units while no
    kernel is loaded yet). Compiled once per process, cached on disk by numba; they release the
    GIL (``nogil``: ``solve.plan_dp`` builds two tables at once on two threads)."""
    if not limits.USE_NUMBA or (units < limits.NUMBA_MIN_UNITS and not _JIT):
        return None
    if name not in _JIT:
        try:  # imported here, not at the top: loading numba costs every ckplan import ~0.3 s
            numba = importlib.import_module("numba")
        except ImportError:
            _JIT[name] = None
            return None
        # called from the kernels: compiled first, and put in their module's globals, where the
        # kernels (and the numpy path's ``frontier_kernel._trim``) find them
        for mod, helpers in _HELPERS:
            for helper in helpers:
                if helper not in _JIT:
                    _JIT[helper] = jit = numba.njit(cache=True, nogil=True)(getattr(mod, helper))
                    setattr(mod, helper, jit)
        mod = frontier_kernel if name == "_pareto_kernel" else table_kernels
        _JIT[name] = numba.njit(cache=True, nogil=True)(getattr(mod, name))
    return _JIT[name]
