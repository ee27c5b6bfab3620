"""ckplan's public functions for Python users (re-exported by :mod:`ckplan`): plan a model's
checkpoints on a sample batch, apply a plan, profile a model.

    plan = ckplan.plan_model(model, sample_batch, budget="12GB")   # a PlanResult
    ckplan.apply_plan(model, plan.plan)                              # or a plan.json path
"""
from __future__ import annotations

import os

import torch

from .api import check_budget, check_plan_chain, check_positive, check_train_args, read_plan
from .api import profile_model as _profile
from .api_plan import chain_for
from .chainfind import resolve_chain
from .compiled import compiled_layers as _compiled
from .errors import UsageError
from .execute import apply_plan as _apply
from .execute import remove_plan as _remove
from .measure import KeptFreedMemory
from .options import Strategy
from .planner import chain_from_profile, parse_budget, plan_chain
from .planner.parallel import KINDS
from .whole_compile import compiled_model as _whole

__all__ = ["apply_plan", "compiled_layers", "compiled_model", "kept_freed_memory", "load_plan", "plan_model",
           "profile_model", "remove_plan"]


def plan_model(model, sample_batch, budget=None, *, strategy: str = "dp", chain: str | None = None,
               optimizer: str = "adamw", precision: str = "fp32", accum: int = 1, k: int = 2,
               lr: float = 1e-4, compile: bool = False, world_size: int = 1, parallel: str = "fsdp"):
    """Profile ``model`` on ``sample_batch`` (not changing it) and plan its checkpoints.

    ``compile=True``: the chain layers are profiled compiled with ``torch.compile``, and the plan
    is for them: apply it inside ``with ckplan.compiled_layers(model):`` (see ckplan.compiled).

    ``world_size`` > 1: the plan, the budget and the peaks are for one rank of ``parallel``
    (``"fsdp"``: FSDP2 with every chain layer one unit, ``"ddp"``) on that many ranks, with
    ``sample_batch`` one rank's micro-batch. Profile the model as built, before ``fully_shard``;
    the plan applies to each rank's model before or after it.

    ``sample_batch``: a tensor, a tuple of positional inputs, a dict of keyword inputs, or
    ``(args, kwargs)``; the model's output (a loss, an object with ``.loss``, or a tensor whose
    mean square is used) must be trainable. ``budget``: ``"12GB"``, ``"12GiB"``, bytes, ``"40%"``
    of the no-checkpoint peak, or None for the smallest feasible peak. Returns a
    ``ckplan.planner.PlanResult``; raises ``InfeasibleBudgetError`` when nothing fits.
    """
    # Every argument is checked before the (possibly long) profile.
    strategy = str(Strategy.parse(strategy, what="strategy"))
    check_positive("k", k)
    check_positive("world_size", world_size)
    if world_size > 1 and str(parallel) not in KINDS:
        raise UsageError(f"parallel={str(parallel)!r} is not one of {', '.join(KINDS)}")
    check_budget(budget)
    check_train_args(optimizer=optimizer, precision=precision, accum=accum)
    args, kwargs = _as_batch(sample_batch)
    first = next(iter(model.parameters()), None)
    device = first.device if first is not None else torch.device("cpu")
    prof = _profile(model, args, kwargs, name=type(model).__name__, chain=chain, device=device,
                         optimizer=optimizer, precision=precision, accum=accum, lr=lr, compile=compile)
    planned = chain_from_profile(prof) if world_size == 1 else chain_for(prof, world_size, str(parallel))
    budget_bytes = None if budget is None else parse_budget(budget, planned, what="budget").bytes
    return plan_chain(planned, strategy, budget_bytes, k)


def _as_batch(batch):
    if isinstance(batch, torch.Tensor):
        return (batch,), {}
    if isinstance(batch, dict):
        return (), dict(batch)
    if (isinstance(batch, tuple) and len(batch) == 2 and isinstance(batch[0], (tuple, list))
            and isinstance(batch[1], dict)):
        return tuple(batch[0]), dict(batch[1])
    if isinstance(batch, (tuple, list)):
        return tuple(batch), {}
    raise UsageError(f"sample_batch of type {type(batch).__name__} is not a tensor, tuple, dict or (args, kwargs)")


def apply_plan(model, plan, *, chain: str | None = None):
    """Checkpoint ``model``'s chain by ``plan`` (a Plan, a PlanResult, its dict, or a plan.json path)."""
    plan = getattr(plan, "plan", plan)  # a PlanResult
    where = "the plan"
    if isinstance(plan, (str, os.PathLike)):  # a plan.json: checked as `ckplan bench --plan` checks it
        where = str(plan)
        path, container, _ = resolve_chain(model, chain)
        plan, _doc = read_plan(plan, chain_layers=len(container), chain=path, chain_tip=_CHAIN_TIP)
    elif isinstance(plan, dict) and isinstance(plan.get("plan"), dict):  # a loaded `ckplan plan` document
        check_plan_chain(plan, resolve_chain(model, chain)[0], where, tip=_CHAIN_TIP)
    return _apply(model, plan, chain=chain)


# {recorded}: the chain the plan was made for (filled by check_plan_chain)
_CHAIN_TIP = "make the plan for this model, or pass chain={recorded!r} if that is this model's layer container"


def compiled_layers(model, *, chain: str | None = None):
    """A context that compiles each chain layer's forward with ``torch.compile`` (enter it before
    :func:`apply_plan`, whose checkpoints then wrap the compiled layers); see ckplan.compiled."""
    return _compiled(model, chain=chain)


def compiled_model(model, plan, *, chain: str | None = None):
    """A whole-model ``torch.compile`` of a copy of ``model`` sharing its parameters, running ``plan``
    (one checkpoint region per chain layer: a plan from ``ckplan bench --compile-scope model`` or
    any plan of stored, selective and one-layer checkpoints); see ckplan.whole_compile. Train the
    returned module with an optimizer over ``model.parameters()``."""
    if isinstance(plan, (str, bytes)) or hasattr(plan, "__fspath__"):
        plan = load_plan(plan)
    return _whole(model, plan, chain)


def kept_freed_memory(device="cpu"):
    """A context for CPU training steps timed as ckplan times them: glibc's malloc keeps freed
    memory in the process (as PyTorch's CUDA caching allocator does) instead of returning it
    and faulting it in again every step; a no-op off glibc or off the CPU. See
    ``ckplan.measure.KeptFreedMemory``."""
    return KeptFreedMemory(device)


def remove_plan(model) -> None:
    _remove(model)


def load_plan(path):
    """The plan in a ``ckplan plan -o plan.json`` file (raises ``SpecError`` naming what is wrong)."""
    return read_plan(path)[0]


def profile_model(model, sample_batch, *, chain: str | None = None, optimizer: str = "adamw",
                  precision: str = "fp32", accum: int = 1, device=None):
    """Per-stage profile (``ckplan.records.Profile``) of ``model`` on ``sample_batch``."""
    args, kwargs = _as_batch(sample_batch)
    if device is None:
        first = next(iter(model.parameters()), None)
        device = first.device if first is not None else torch.device("cpu")
    return _profile(model, args, kwargs, name=type(model).__name__, chain=chain, device=device,
                    optimizer=optimizer, precision=precision, accum=accum)
