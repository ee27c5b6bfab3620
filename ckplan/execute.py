"""Apply any Plan (nested checkpoints included) to a model's chain with torch.utils.checkpoint.

How: each chain layer's ``forward`` is replaced by an instance attribute (state_dict keys, hooks
and the module tree stay as they are; ``remove()`` restores the originals).

* ``Store(i)`` layers run as before.
* The first layer of a top-level ``Checkpoint(s, t)`` runs layers s..t-1 itself inside one
  non-reentrant ``torch.utils.checkpoint.checkpoint`` (RNG state preserved, so dropout masks are
  the same when recomputed); inner checkpoints nest the same way. The model then calls layers
  s+1..t-1 as usual; they hand back the segment's output without running again.
* Every layer of a segment gets the same extra arguments as its first layer (attention masks,
  position embeddings), and the next layer's hidden state is the first tensor of the previous
  layer's output, which is what Hugging Face's and ckplan's models do. A model that changes the
  hidden state between layers is detected and refused for multi-layer segments.
"""
from __future__ import annotations

import threading
from typing import Any

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from .chainfind import first_tensor, resolve_chain
from .errors import ModelRunError, SpecError
from .planner.plan import Checkpoint, Plan, Store

_ATTR = "_ckplan_executor"



def _split_hidden(args: tuple, kwargs: dict) -> tuple[torch.Tensor, Any]:
    """The hidden state and a function that puts a new one in its place."""
    if args and isinstance(args[0], torch.Tensor):
        return args[0], lambda h: ((h, *args[1:]), kwargs)
    if isinstance(kwargs.get("hidden_states"), torch.Tensor):
        return kwargs["hidden_states"], lambda h: (args, {**kwargs, "hidden_states": h})
    raise ModelRunError("a chain layer was called without a tensor as its first argument or "
                        "`hidden_states=`; ckplan cannot tell which argument is the hidden state")


class PlanExecutor:
    """The installed plan; ``remove()`` (or leaving the ``with`` block) restores the layers."""

    def __init__(self, model: nn.Module, layers: list[nn.Module], plan: Plan, chain_path: str):
        if plan.n_layers != len(layers):
            raise SpecError(f"the plan is for {plan.n_layers} layers but chain {chain_path!r} has {len(layers)}",
                            tip="make the plan for this model (same spec, same chain)")
        self.model, self.layers, self.plan, self.chain_path = model, layers, plan, chain_path
        self._tls = threading.local()
        self._had_forward = [("forward" in layer.__dict__, layer.__dict__.get("forward")) for layer in layers]
        self._orig = [layer.forward for layer in layers]
        self._role: dict[int, Any] = {}
        for item in plan.items:
            if isinstance(item, Store):
                self._role[item.layer] = "store"
            else:
                self._role[item.start] = item
                for i in range(item.start + 1, item.stop):
                    self._role[i] = ("pass", item)
        for i, layer in enumerate(layers):
            layer.forward = self._make_forward(i)
        setattr(model, _ATTR, self)

    @property
    def _depth(self) -> int:
        return getattr(self._tls, "depth", 0)

    def _make_forward(self, i: int):
        def forward(*args, **kwargs):
            role = self._role[i]
            if self._depth > 0 or role == "store":
                return self._orig[i](*args, **kwargs)
            if isinstance(role, Checkpoint):
                out = checkpoint(self._run_items, role.inner, *args, use_reentrant=False,
                                 preserve_rng_state=True, **kwargs)
                if role.stop - role.start > 1:  # the layers after it hand this back
                    self._tls.last = (role, out, first_tensor(out))
                return out
            _, seg = role
            last = getattr(self._tls, "last", None)
            hidden, _ = _split_hidden(args, kwargs)
            if last is None or last[0] is not seg or hidden is not last[2]:
                raise ModelRunError(
                    f"layer {i} of {self.chain_path!r} did not receive the output of layer {i - 1} "
                    "unchanged, so a multi-layer checkpoint cannot span it",
                    tip="use a plan whose checkpoints hold one layer each (--strategy every-k --k 1)")
            if i == seg.stop - 1:
                # Drop our reference: holding the segment's output would keep it alive (and
                # counted) through the whole backward.
                self._tls.last = None
            return last[1]
        return forward

    def _run_items(self, items, *args, **kwargs):
        self._tls.depth = self._depth + 1
        try:
            out = None
            for item in items:
                if isinstance(item, Store):
                    out = self.layers[item.layer](*args, **kwargs)
                else:
                    out = checkpoint(self._run_items, item.inner, *args, use_reentrant=False,
                                     preserve_rng_state=True, **kwargs)
                _, put = _split_hidden(args, kwargs)
                args, kwargs = put(first_tensor(out))
            return out
        finally:
            self._tls.depth -= 1

    def remove(self) -> None:
        self._tls.last = None
        for layer, (had, fwd) in zip(self.layers, self._had_forward):
            if had:
                layer.forward = fwd
            else:
                layer.__dict__.pop("forward", None)
        if getattr(self.model, _ATTR, None) is self:
            delattr(self.model, _ATTR)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.remove()


def apply_plan(model: nn.Module, plan: Plan | dict | str, *, chain: str | None = None) -> PlanExecutor:
    """Checkpoint ``model``'s chain as ``plan`` says (a Plan, its dict, or a plan.json path).

    Returns the executor; call ``.remove()`` (or use it as a context manager) to undo. Applying a
    new plan replaces the previous one.
    """
    plan = _as_plan(plan)
    old = getattr(model, _ATTR, None)
    if old is not None:
        old.remove()
    path, container, _ = resolve_chain(model, chain)
    return PlanExecutor(model, list(container), plan, path)


def remove_plan(model: nn.Module) -> None:
    old = getattr(model, _ATTR, None)
    if old is not None:
        old.remove()


def _as_plan(plan) -> Plan:
    if isinstance(plan, Plan):
        return plan
    if isinstance(plan, dict):
        return Plan.from_dict(plan.get("plan", plan))
    return load_plan(plan)


def load_plan(path) -> Plan:
    """Read a plan written by ``ckplan plan -o plan.json`` (or a bare Plan.to_dict())."""
    import json
    from pathlib import Path
    p = Path(path)
    if not p.is_file():
        raise SpecError(f"plan file {str(p)!r} does not exist",
                        tip="write one with: ckplan plan SPEC --budget 12GB -o plan.json")
    try:
        doc = json.loads(p.read_text())
    except ValueError as e:
        raise SpecError(f"{p}: not JSON ({e})") from None
    return Plan.from_dict(doc.get("plan", doc) if isinstance(doc, dict) else doc)
