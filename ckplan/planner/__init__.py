"""Plan activation checkpointing for a chain of layers: pure Python + numpy, no torch.

Pipeline: ``chain_from_profile(profile) -> Chain``; a strategy gives a ``Plan``; ``simulate``
scores any plan. ``plan_chain`` / ``compare`` / ``sweep`` are the entry points the CLI uses.
"""
from .chain import Chain, Layer, Post, Pre, chain_from_profile, predicted_peak_none
from .dp import DPResult, DPSolver, min_peak, min_peak_plan, plan_dp
from .plan import Checkpoint, LayerDecision, Plan, RecomputedRange, Store
from .simulate import Score, TraceEvent, simulate, trace
from .strategies import (STRATEGIES, FrontierPoint, PlanResult, compare, plan_chain, plan_chen,
                         plan_every_k, plan_none, plan_sqrtn, sweep)

__all__ = [
    "Chain", "Layer", "Pre", "Post", "chain_from_profile", "predicted_peak_none",
    "Plan", "Store", "Checkpoint", "LayerDecision", "RecomputedRange",
    "Score", "TraceEvent", "simulate", "trace",
    "DPResult", "DPSolver", "plan_dp", "min_peak", "min_peak_plan",
    "STRATEGIES", "PlanResult", "FrontierPoint", "plan_chain", "compare", "sweep",
    "plan_none", "plan_every_k", "plan_sqrtn", "plan_chen",
]
