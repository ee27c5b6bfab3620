"""Plan activation checkpointing for a chain of layers: pure Python + numpy, no torch.

Pipeline: ``chain_from_profile(profile) -> Chain``; a strategy gives a ``Plan``; ``simulate``
scores any plan. ``plan_chain`` / ``compare`` / ``sweep`` are the entry points the CLI uses;
``parse_budget`` / ``default_budget`` / ``no_gain_reason`` hold the budget rules.

Modules, imports flowing one way (each imports only those above it):

* ``chain``: the cost model's types (Layer, Pre, Post, Chain).
* ``plan``: the one plan type (Store / Checkpoint items) and its JSON.
* ``simulate``: the one simulator (peak, recompute, trace of any plan).
* ``baselines``: none, every-k, sqrtn, chen.
* ``calibrate``: profile -> Chain, transients calibrated on the measured windows.
* ``groups``: merged costs of runs of layers (the DP's units).
* ``floor``: what the smallest peak is made of; the infeasible-budget error.
* ``tables``: the DP's tables and the one plan reader.
* ``casts``: mixed precision, the top-level frontiers that make min peak and feasibility exact.
* ``held``: held layers (FSDP2 per rank): the DP whose inner plans hold their layers.
* ``dp``: the solver and its entry points (plan_dp, min_peak, min_peak_plan).
* ``strategies``: plan_chain, compare, sweep (``selective``: one SAC policy on every layer).
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
from .dp import DPResult, DPSolver, min_peak, min_peak_plan, plan_dp
from .floor import Floor, floor_of, infeasible_error
from .plan import Checkpoint, LayerDecision, Plan, RecomputedRange, Store
from .simulate import Score, TraceEvent, simulate, trace
from .strategies import (
    ALL_STRATEGIES,
    STRATEGIES,
    FrontierPoint,
    PlanResult,
    compare,
    infeasible_budget,
    plan_chain,
    plan_selective,
    sweep,
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
]
