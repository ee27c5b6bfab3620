"""Plan activation checkpointing for a chain of layers: pure Python + numpy, no torch.

Pipeline: ``chain_from_profile(profile) -> Chain``; a strategy gives a ``Plan``; ``simulate``
scores any plan. ``plan_chain`` / ``compare`` / ``sweep`` are the entry points the CLI uses.
"""
from .chain import Chain, Layer, Post, Pre, chain_from_profile, predicted_peak_none
from .dp import DPResult, DPSolver, min_peak, min_peak_plan, plan_dp
from .plan import Checkpoint, LayerDecision, Plan, RecomputedRange, Store
from .simulate import Score, TraceEvent, simulate, trace
from .strategies import (
                         STRATEGIES,
                         FrontierPoint,
                         PlanResult,
                         compare,
                         plan_chain,
                         plan_chen,
                         plan_every_k,
                         plan_none,
                         plan_sqrtn,
                         sweep,
)

__all__ = [
                         "STRATEGIES",
                         "Chain",
                         "Checkpoint",
                         "DPResult",
                         "DPSolver",
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
                         "chain_from_profile",
                         "compare",
                         "min_peak",
                         "min_peak_plan",
                         "plan_chain",
                         "plan_chen",
                         "plan_dp",
                         "plan_every_k",
                         "plan_none",
                         "plan_sqrtn",
                         "predicted_peak_none",
                         "simulate",
                         "sweep",
                         "trace",
]
