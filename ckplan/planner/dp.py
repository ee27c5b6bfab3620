"""The optimal plan's entry points under their long-standing names (``plan_dp``, ``min_peak``,
``min_peak_plan``, ``DPSolver``, ...): the solvers live in ``solve/``, their tuning constants in
``limits.py`` (``dp.NAME`` reads and sets ``limits.NAME``)."""
from __future__ import annotations

from . import limits
from .floor import infeasible_error
from .solve import (
    OPTIONS_IGNORED,
    Banded,
    Coarse,
    DPResult,
    DPSolver,
    LayerTables,
    Prebuilt,
    banded_applies,
    banded_plan,
    cast_frontier,
    choose_slot,
    improve,
    layer_tables,
    min_peak,
    min_peak_plan,
    near_min_plan,
    plan_dp,
    plan_from,
    plans_banded,
    tail_trim,
)
from .solve.band import _band_note
from .solve.coarse import _coarse_beside_inner, _coarse_plan
from .solve.solver import _slot_bound, _slot_plan
from .tables import base_bytes, fixed_peak

__all__ = ["OPTIONS_IGNORED", "Banded", "Coarse", "DPResult", "DPSolver", "LayerTables", "Prebuilt",
           "_band_note", "_coarse_beside_inner", "_coarse_plan", "_slot_bound", "_slot_plan",
           "banded_applies", "banded_plan", "base_bytes", "cast_frontier", "choose_slot", "fixed_peak",
           "improve", "infeasible_error", "layer_tables", "min_peak", "min_peak_plan", "near_min_plan",
           "plan_dp", "plan_from", "plans_banded", "tail_trim"]

limits.forward_constants(__name__)  # ``dp.BAND_MAX_TOTAL = x`` (older scripts) sets limits'
