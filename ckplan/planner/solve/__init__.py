"""The optimal plan: least recompute time whose simulated peak fits a budget, nested checkpoints
allowed (rotor's dynamic program, written against our simulator; docs/planner.md explains it).

Modules (each imports only those above it): ``common`` (result type, layer-level tables, slot
choice), ``lowest`` (the smallest peak of a fully kept chain), ``solver`` (``DPSolver``: the
exact, slot and grouped tables), ``improve`` (local improvement), ``near_min`` (long chains
just above the smallest peak), ``band`` (the banded DP), ``coarse`` (its fast bound),
``unkept_dp`` (the exact DP on chains with unkept boundaries), ``unkept`` (chains with unkept
boundaries), ``portfolio`` (``plan_dp`` without held layers),
``held_fallback`` (held layers), ``entry`` (``plan_dp``, ``min_peak``, ``min_peak_plan``).
Tuning constants: ``limits.py``.
"""
from __future__ import annotations

from .band import Banded, Prebuilt, banded_applies, banded_plan, plans_banded, tail_trim
from .coarse import Coarse
from .common import OPTIONS_IGNORED, DPResult, LayerTables, cast_frontier, choose_slot, layer_tables, plan_from
from .entry import min_peak, min_peak_plan, plan_dp
from .improve import improve
from .near_min import near_min_plan
from .solver import DPSolver

__all__ = ["OPTIONS_IGNORED", "Banded", "Coarse", "DPResult", "DPSolver", "LayerTables", "Prebuilt",
           "banded_applies", "banded_plan", "cast_frontier", "choose_slot", "improve", "layer_tables",
           "min_peak", "min_peak_plan", "near_min_plan", "plan_dp", "plan_from", "plans_banded", "tail_trim"]
