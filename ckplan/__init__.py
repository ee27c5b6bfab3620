"""ckplan: profile, plan and benchmark activation checkpointing for PyTorch training.

    plan = ckplan.plan_model(model, sample_batch, budget="12GB")   # a PlanResult
    ckplan.apply_plan(model, plan.plan)                              # or a plan.json path

One facade: the public functions (:mod:`ckplan.public`: ``plan_model``, ``apply_plan``,
``load_plan``, ``profile_model``, ``compiled_layers``, ``compiled_model``, ``kept_freed_memory``,
``remove_plan``),
``export_plan``, the errors, and the command functions of :mod:`ckplan.api` (``ckplan.load``,
``ckplan.profile``, ``ckplan.plan``, ``ckplan.sweep``, ``ckplan.world_sizes``,
``ckplan.bench_distributed``, ``ckplan.read_plan``, ``ckplan.load_profile``...). ``api.bench``,
``api.preflight`` and ``api.export`` are named through :mod:`ckplan.api` only: ``ckplan.bench``,
``ckplan.preflight`` and ``ckplan.export`` are modules.
"""
from __future__ import annotations

import importlib

from .errors import CkplanError, InfeasibleBudgetError, ModelRunError, SpecError, UsageError

__version__ = "0.1.0"

# Where each name of the facade lives. They are imported on first use (PEP 562): ckplan's planner
# (ckplan.planner, imported through this package) runs without torch, which these modules import,
# and `import ckplan` alone loads neither numpy nor the planner (ckplan.export brings both).
_PUBLIC = ("apply_plan", "compiled_layers", "compiled_model", "kept_freed_memory", "load_plan", "plan_model",
           "profile_model", "remove_plan")
_API = ("bench_distributed", "check_bench_args", "check_budget", "check_nproc", "check_output_dir",
        "check_output_file", "check_plan_chain", "check_positive", "check_train_args", "load", "load_profile",
        "option_names", "plan", "profile", "profile_problem", "read_plan", "read_plan_document",
        "resolve_budget", "resolve_device", "sweep", "world_sizes")
_LAZY = {**{name: ".public" for name in _PUBLIC}, **{name: ".api" for name in _API},
         **{name: ".export" for name in ("Export", "export_plan")}}

__all__ = ["CkplanError", "Export", "InfeasibleBudgetError", "ModelRunError", "SpecError", "UsageError",
           "export_plan", *_PUBLIC, *_API]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted({*globals(), *_LAZY})
