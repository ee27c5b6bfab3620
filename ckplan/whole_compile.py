"""A plan run inside one whole-model ``torch.compile``: each chain layer a checkpoint region.

``--compile`` (:mod:`ckplan.compiled`) compiles the chain layers one by one and runs the plan
around them; the loss head and the embeddings stay eager. Compiling the whole model instead fuses
the head too (gpt2-small at 2 x 512 on CPU: the cross-entropy no longer keeps its log-softmax,
190 MiB less at the loss), which a per-layer compile cannot reach where the model's layer loop
and its head share one ``forward`` (Dynamo skips a frame whose loop breaks the graph).

Here every chain layer's ``forward`` in a shared-weight copy of the model (:func:`ckplan.peers.shared_copy`)
becomes a region Dynamo traces:

* ``Store(i)``: no region; what the layer saves is the partitioner's default choice.
* ``Store(i, P)`` with a selective option P (``sac-*``): ``checkpoint(forward, use_reentrant=False,
  context_fn=P's SAC contexts)``; the ops carry P's save/recompute tags, which AOTAutograd's
  partitioner honours, so the compiled forward saves P's ops and the compiled backward recomputes
  the rest.
* ``Checkpoint(i, i + 1)``, or ``Store(i, "full-region")`` (how a whole-model compiled chain names it,
  :mod:`ckplan.planner.whole`): ``checkpoint(forward, use_reentrant=False)``; every op of the
  layer is tagged for recompute in the compiled backward.

Stored layers are the partitioner's: with ``plan.params["partitioner_budget"]`` = b < 1 (what
``dp`` writes when the partitioner's own min-cut over every stored layer is the faster way to fit,
:func:`ckplan.whole_choice.mincut_search`) the copy compiles with
``torch._functorch.config.activation_memory_budget = b``, and the min-cut recomputes cheap ops of
the stored layers (and the head) to keep about that share of their saved bytes; regions keep their tags.

The plan must be of that shape: one region per layer (multi-layer and nested checkpoints, the
partitioner-budget options ``mincut-*`` and ``offload`` have no such region and are refused with
a UsageError). :func:`ckplan.planner.regions.plan_regions` plans in that space.

In your own loop::

    compiled = ckplan.compiled_model(model, plan)   # a compiled copy sharing the model's weights
    loss = loss_fn(compiled(batch)); loss.backward(); opt.step()   # opt over model.parameters()
"""
from __future__ import annotations

import functools
from collections.abc import Sequence

import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from .chainfind import resolve_chain
from .errors import UsageError
from .measure.compiled_graph import SavedForBackward
from .peers import CompiledPeer
from .planner.plan import PARTITIONER_BUDGET, STORE, Checkpoint, Plan, Store
from .planner.regions import FULL, regions_plan  # noqa: F401  (re-exported)
from .planner.whole import FULL as FULL_REGION
from .sac import MINCUT, POLICIES, context_fn


def region_options(plan: Plan) -> tuple[str, ...]:
    """Each layer's region: ``store``, a ``sac-*`` option, or ``full`` (recomputed whole).

    Raises UsageError for a plan a whole-model compile cannot run as one region per layer."""
    out: list[str] = []
    for item in plan.items:
        if isinstance(item, Store):
            if item.option == FULL_REGION:
                out.append(FULL)
                continue
            if item.option != STORE and (item.option in MINCUT or item.option not in POLICIES):
                raise UsageError(
                    f"layer {item.layer} is stored with option {item.option!r}, which has no checkpoint region "
                    "inside a whole-model torch.compile",
                    tip=f"use store, full or one of {', '.join(POLICIES)} per layer (ckplan plan --compile-scope "
                        "model plans only those)")
            out.append(item.option)
        elif isinstance(item, Checkpoint):
            if item.stop != item.start + 1 or any(isinstance(x, Store) and x.option != STORE for x in item.inner):
                raise UsageError(
                    f"checkpoint [{item.start}, {item.stop}) spans {item.stop - item.start} layers; a whole-model "
                    "torch.compile runs one checkpoint region per layer",
                    tip="plan with --compile-scope model (one region per layer), or run the plan with "
                        "--compile-scope layers")
            out.append(FULL)
    return tuple(out)


def partitioner_budget(plan: Plan) -> float:
    """The ``activation_memory_budget`` the plan's whole-model compile runs with (1.0: none)."""
    b = plan.params.get(PARTITIONER_BUDGET, 1.0)
    if isinstance(b, bool) or not isinstance(b, (int, float)) or not 0.0 < b <= 1.0:
        raise UsageError(f"the plan's {PARTITIONER_BUDGET} is {b!r}, not a share in (0, 1]",
                         tip="write a number such as 0.7 (torch._functorch.config.activation_memory_budget), "
                             "or leave it out")
    return float(b)


def install_regions(model: nn.Module, chain: str | None, options: Sequence[str]) -> None:
    """Wrap each chain layer's ``forward`` of ``model`` (a copy to compile) in its region."""
    _, layers, _ = resolve_chain(model, chain)
    layers = list(layers)
    if len(layers) != len(options):
        raise UsageError(f"the plan has {len(options)} layers but the model's chain has {len(layers)}",
                         tip="plan on a profile of this model")
    for layer, option in zip(layers, options):
        if option == STORE:
            continue
        ctx = {} if option == FULL else {"context_fn": context_fn(option)}
        layer.forward = functools.partial(checkpoint, layer.forward, use_reentrant=False, **ctx)


def chain_layer_names(model: nn.Module, chain: str | None) -> list[str]:
    path, layers, _ = resolve_chain(model, chain)
    return [f"{path}.{i}" for i in range(len(layers))]


class CompiledModel(CompiledPeer):
    """``module``: ``torch.compile`` of a shared-weight copy of ``model`` with ``plan``'s regions
    (partitioner budget 1.0 unless the plan gives one: :func:`partitioner_budget`); ``saved``
    records what each compiled graph's forward saves for backward, by chain layer, once compiled."""

    def __init__(self, model: nn.Module, plan: Plan, chain: str | None = None):
        self.options = region_options(plan)
        self.saved = SavedForBackward(chain_layer_names(model, chain))
        super().__init__(model, partitioner_budget(plan),
                         prepare=functools.partial(install_regions, chain=chain, options=self.options))

    def _backend(self, gm, example_inputs):
        with self.saved:
            return super()._backend(gm, example_inputs)


def compiled_model(model: nn.Module, plan: Plan, chain: str | None = None) -> nn.Module:
    """A whole-model ``torch.compile`` of a copy of ``model`` (same parameters) running ``plan``
    as one checkpoint region per chain layer; it compiles on its first call."""
    return CompiledModel(model, plan, chain).module
