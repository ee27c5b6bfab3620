"""Plan activation checkpointing for a chain of layers: pure Python + numpy, no torch.

Pipeline: ``chain_from_profile(profile) -> Chain``; a strategy gives a ``Plan``; ``simulate``
scores any plan. ``plan_chain`` / ``compare`` / ``sweep`` are the entry points the CLI uses;
``parse_budget`` / ``default_budget`` / ``no_gain_reason`` hold the budget rules.

Modules, imports flowing one way (each imports only those above it; ``tests/test_planner_layout.py``):

* ``limits``: every tuning constant of the solvers and tables (read as ``limits.NAME``).
* ``layer``, ``chain``: the cost model's types (Option, Layer; Pre, Post, Chain).
* ``plan_items``, ``plan``: the plan's items (Store / Checkpoint), the one plan type and its JSON.
* ``boundaries``, ``replay``, ``simulate``: the one simulator (what a plan keeps beyond the plain
  forward; the op-by-op replay; peak, recompute, trace of any plan).
* ``baselines``: none, every-k, sqrtn, chen.
* ``calibrate``: profile -> Chain, transients calibrated on the measured windows.
* ``groups``: merged costs of runs of layers (the DP's units).
* ``floor``: what the smallest peak is made of; the infeasible-budget error.
* ``tables/``: the DP's tables (pairs, plan reader, min-peak, slot tables, Pareto frontiers,
  compiled kernels).
* ``casts``: mixed precision, the top-level frontiers that make min peak and feasibility exact.
* ``held_costs``, ``held``: held layers (FSDP2 per rank): the DP whose inner plans hold their layers.
* ``solve/``: the solvers (exact, slot and grouped tables, banded DP, coarse bound, near-minimum
  search, unkept boundaries, held fallback) and their entry points (plan_dp, min_peak, min_peak_plan).
* ``strategies``: plan_chain, compare (``selective``: one SAC policy on every layer).
* ``frontier``: sweep, each strategy's memory/time frontier.
* ``budget``: budget parsing, the no-budget defaults, the "no plan can lower the peak" reason.
* ``parallel``: what one rank holds under FSDP2 / DDP (the per-rank chain).
* ``synthetic``: synthetic chains for tests and benchmarks.
"""
from .baselines import plan_chen, plan_every_k, plan_none, plan_sqrtn
from .budget import (
    Budget,
    activation_bytes,
    check_budget_text,
    default_budget,
    held_for_backward_bytes,
    no_gain_reason,
    parse_budget,
)
from .calibrate import calibrate, chain_from_profile, predicted_peak_none
from .chain import Chain, Layer, Post, Pre
from .floor import Floor, floor_of, infeasible_error
from .frontier import FrontierPoint, sweep
from .plan import Checkpoint, LayerDecision, Plan, RecomputedRange, Store
from .simulate import Score, TraceEvent, simulate, trace, with_releases
from .solve import DPResult, DPSolver, min_peak, min_peak_plan, plan_dp
from .strategies import (
    ALL_STRATEGIES,
    STRATEGIES,
    PlanResult,
    compare,
    infeasible_budget,
    plan_chain,
    plan_selective,
)

__all__ = [
    "ALL_STRATEGIES",
    "STRATEGIES",
    "Budget",
    "Chain",
    "Checkpoint",
    "DPResult",
    "DPSolver",
    "Floor",
    "FrontierPoint",
    "Layer",
    "LayerDecision",
    "Plan",
    "PlanResult",
    "Post",
    "Pre",
    "RecomputedRange",
    "Score",
    "Store",
    "TraceEvent",
    "activation_bytes",
    "calibrate",
    "chain_from_profile",
    "check_budget_text",
    "compare",
    "default_budget",
    "floor_of",
    "held_for_backward_bytes",
    "infeasible_budget",
    "infeasible_error",
    "min_peak",
    "min_peak_plan",
    "no_gain_reason",
    "parse_budget",
    "plan_chain",
    "plan_chen",
    "plan_dp",
    "plan_every_k",
    "plan_none",
    "plan_selective",
    "plan_sqrtn",
    "predicted_peak_none",
    "simulate",
    "sweep",
    "trace",
    "with_releases",
]
