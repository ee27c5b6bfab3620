"""Installing a plan on a model: apply_plan(), remove_plan(), and plans read from a dict or a
plan.json file (checked against the chain's length and ckplan's selective options)."""
from __future__ import annotations

import torch.nn as nn

from ..chainfind import resolve_chain
from ..documents import read_plan
from ..errors import UsageError
from ..options import PLAN_OPTIONS
from ..planner.plan import PARTITIONER_BUDGET, Plan
from .executor import _ATTR, PlanExecutor


def apply_plan(model: nn.Module, plan: Plan | dict | str, *, chain: str | None = None) -> PlanExecutor:
    """Checkpoint ``model``'s chain as ``plan`` says (a Plan, its dict, or a plan.json path).

    Returns the executor; call ``.remove()`` (or use it as a context manager) to undo. Applying a
    new plan replaces the previous one. A plan read from a dict or a file is checked against the
    chain's length before any of its layers is built.
    """
    path, container, _ = resolve_chain(model, chain)
    plan = _as_plan(plan, len(container))
    if PARTITIONER_BUDGET in plan.params:
        raise UsageError(f"the plan leaves the model to torch.compile's partitioner ({PARTITIONER_BUDGET} "
                         f"{plan.params[PARTITIONER_BUDGET]!r}), which eager execution cannot honour",
                         tip="run it with ckplan.compiled_model(model, plan), as ckplan plan --compile-scope model "
                             "wrote it")
    old = getattr(model, _ATTR, None)
    if old is not None:
        old.remove()
    return PlanExecutor(model, list(container), plan, path)


def remove_plan(model: nn.Module) -> None:
    old = getattr(model, _ATTR, None)
    if old is not None:
        old.remove()


def _as_plan(plan, chain_layers: int | None = None) -> Plan:
    if isinstance(plan, Plan):
        return plan
    if isinstance(plan, dict):
        return Plan.from_dict(plan.get("plan", plan), chain_layers=chain_layers, known_options=PLAN_OPTIONS)
    return load_plan(plan, chain_layers=chain_layers)


def load_plan(path, *, chain_layers: int | None = None) -> Plan:
    """Read a plan written by ``ckplan plan -o plan.json`` (or a bare Plan.to_dict()); with
    ``chain_layers``, refuse a plan for another number of layers before building it
    (:func:`ckplan.documents.read_plan`, the one plan reader)."""
    return read_plan(path, chain_layers=chain_layers)[0]
