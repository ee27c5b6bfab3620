"""One plan type for every strategy: a nested sequence of ``Store`` and ``Checkpoint`` items.

A plan covers the chain's layers ``[0, n)`` in order. Each item is either

* ``Store(i)``: layer ``i`` runs forward keeping everything it saves for backward; or
* ``Checkpoint(start, stop, inner)``: layers ``start..stop-1`` run forward keeping only their
  input (owned by whatever comes before) and their last output (the segment's *boundary*);
  during backward the segment is recomputed following ``inner``, itself a sequence of items
  covering ``[start, stop)`` that may contain nested checkpoints.

This is exactly what nested non-reentrant ``torch.utils.checkpoint`` executes, and it is the
schedule family of rotor (Beaumont et al., "Optimal checkpointing for heterogeneous chains",
2019/2021), so every strategy, baselines included, returns this type and one simulator scores
them all. An inner sequence may not be a single checkpoint of its whole range (it would run the
segment forward once more for nothing).

Every layer is stored exactly once, at the innermost depth where it appears, so each layer has
one *option* (``Store.option``): ``store`` keeps all it saves; a selective option keeps less and
recomputes part of the layer in its backward (torch's selective activation checkpointing);
``offload``, for a layer stored at the top level only, moves what it saves (its output aside) to
pinned host memory after its forward and brings it back before its backward.

JSON (``to_dict``) lists the checkpointed ranges flat, outermost first, because a plan is fully
determined by that laminar set of ranges and a flat list never nests deeper than JSON parsers like:
``{"strategy": "every-k", "n_layers": 6, "params": {"k": 2}, "checkpoints": [[0, 2], [2, 4], [4, 6]]}``.
Plans that use selective options add ``"options"``: one name per layer (``"store"`` for the
rest). ``from_dict`` also accepts a nested ``"items"`` list:
``[{"store": 0}, {"checkpoint": [1, 4], "inner": [{"store": 1, "option": "sac-compute"}, ...]}]``.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from ..errors import SpecError
from .plan_items import (
    FETCH,
    OFFLOAD,
    PLAIN,
    RELEASE,
    STORE,
    Checkpoint,
    Item,
    Store,
    _validate,
    is_offloaded,
    items_from_ranges,
    kept_option,
    offload_fetches,
    offload_releases,
)
from .plan_json import (
    MAX_PLAN_LAYERS,
    PLAN_FORMAT,
    PLAN_KEYS,
    check_plan_header,
    items_from_json,
    ranges_from_json,
)

__all__ = ["FETCH", "MAX_PLAN_LAYERS", "OFFLOAD", "PLAIN", "PLAN_FORMAT", "PLAN_KEYS", "RELEASE", "STORE",
           "Checkpoint", "Item", "LayerDecision", "Plan", "RecomputedRange", "Store", "check_plan_header",
           "is_offloaded", "items_from_ranges", "kept_option"]

# A plan's params key: the activation budget of the whole-model torch.compile it is written for
# (ckplan.compiled_model); eager execution cannot honour it.
PARTITIONER_BUDGET = "partitioner_budget"










@dataclass(frozen=True)
class LayerDecision:
    """What a plan does to one layer."""

    layer: int
    stored: bool  # kept whole in the first forward (a top-level Store)
    depth: int  # number of checkpoints enclosing the layer
    forwards: int  # forward runs in one training step: 1 + depth


@dataclass(frozen=True)
class RecomputedRange:
    """One checkpoint at any depth: layers ``[start, stop)`` recomputed once during backward."""

    start: int
    stop: int
    depth: int  # 1 for a top-level checkpoint


@dataclass(frozen=True)
class Plan:
    """A checkpointing plan for a chain of ``n_layers`` layers (validated on construction)."""

    strategy: str
    n_layers: int
    items: tuple[Item, ...]
    params: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "items", tuple(self.items))
        _validate(self.items, self.n_layers)

    # ---- views -------------------------------------------------------------------------
    def walk(self) -> Iterator[tuple[Item, int]]:
        """Every item at every depth in pre-order, with its depth (0 = top level)."""
        stack: list[tuple[Item, int]] = [(it, 0) for it in reversed(self.items)]
        while stack:
            item, depth = stack.pop()
            yield item, depth
            if isinstance(item, Checkpoint):
                stack.extend((it, depth + 1) for it in reversed(item.inner))

    def recomputed_ranges(self) -> tuple[RecomputedRange, ...]:
        """Every checkpoint at any depth, outermost first (pre-order)."""
        return tuple(RecomputedRange(it.start, it.stop, d + 1) for it, d in self.walk()
                     if isinstance(it, Checkpoint))

    def boundaries(self) -> tuple[int, ...]:
        """Layers whose output a top-level checkpoint keeps (the last layer of each segment)."""
        return tuple(it.stop - 1 for it in self.items if isinstance(it, Checkpoint))

    def segments(self) -> tuple[tuple[int, int, bool], ...]:
        """Top-level items as ``(start, stop, checkpointed)``."""
        return tuple((it.layer, it.layer + 1, False) if isinstance(it, Store) else
                     (it.start, it.stop, True) for it in self.items)

    def per_layer(self) -> tuple[LayerDecision, ...]:
        depth = [0] * self.n_layers
        for r in self.recomputed_ranges():
            for i in range(r.start, r.stop):
                depth[i] += 1
        return tuple(LayerDecision(i, depth[i] == 0, depth[i], 1 + depth[i])
                     for i in range(self.n_layers))

    def options(self) -> tuple[str, ...]:
        """Each layer's option (``store`` unless a selective one was chosen)."""
        out = [STORE] * self.n_layers
        for it, _ in self.walk():
            if isinstance(it, Store):
                out[it.layer] = it.option
        return tuple(out)

    def releases(self) -> dict[int, int]:
        """Each offloaded layer's release point (``plan_items.offload_releases``)."""
        return offload_releases(self.n_layers, self.items, self.params)

    def fetches(self) -> dict[int, int]:
        """Each offloaded layer's fetch point (``plan_items.offload_fetches``)."""
        return offload_fetches(self.n_layers, self.items, self.params)

    @property
    def uses_options(self) -> bool:
        return any(o != STORE for o in self.options())

    def with_options(self, options: dict[int, str] | list[str] | tuple[str, ...]) -> Plan:
        """The same checkpoints with each layer's option set (a per-layer list, or a dict of
        the layers that are not ``store``)."""
        if isinstance(options, dict):
            per = [STORE] * self.n_layers
            for i, o in options.items():
                if not isinstance(i, int) or not 0 <= i < self.n_layers:
                    raise SpecError(f"plan option for layer {i!r} is outside the chain [0, {self.n_layers})")
                per[i] = o
        else:
            per = list(options)
            if len(per) != self.n_layers:
                raise SpecError(f"plan options list {len(per)} layers but the plan has {self.n_layers}")
        for i, o in enumerate(per):
            if not isinstance(o, str) or not o:
                raise SpecError(f"plan option of layer {i} must be a name such as 'store', got {o!r}")

        def redo(items: tuple[Item, ...]) -> tuple[Item, ...]:
            return tuple(Store(it.layer, per[it.layer]) if isinstance(it, Store)
                         else Checkpoint(it.start, it.stop, redo(it.inner)) for it in items)
        return Plan(self.strategy, self.n_layers, redo(self.items), dict(self.params))

    @property
    def n_checkpoints(self) -> int:
        return sum(isinstance(it, Checkpoint) for it, _ in self.walk())

    def describe(self, *, runs: bool = False) -> str:
        """A compact one-line form: ``S0 S1 C[2,6){S2 C[3,5){S3 S4} S5}``. ``runs``: four or more
        consecutive layers stored with one option as one ``S4..S9`` (for display: long chains)."""
        out: list[str] = []
        stack: list[Any] = list(reversed(self.items))
        while stack:
            it = stack.pop()
            if isinstance(it, str):
                out.append(it)
            elif isinstance(it, Store):
                out.append(f"S{it.layer}" if it.option == STORE else f"S{it.layer}:{it.option}")
            else:
                out.append(f"C[{it.start},{it.stop}){{")
                stack.append("}")
                stack.extend(reversed(it.inner))
        if runs:
            out = _store_runs(out)
        if PARTITIONER_BUDGET in self.params:
            out.append(f"(partitioner budget {self.params[PARTITIONER_BUDGET]})")
        return " ".join(out).replace("{ ", "{").replace(" }", "}")

    # ---- JSON --------------------------------------------------------------------------
    def copying_inputs(self, layers: list[int]) -> Plan:
        """This plan with ``params["copy_inputs"]``: the layers that change their input in place
        (``Layer.copies_input``), to which ``apply_plan`` gives a copy where a checkpoint starts."""
        if not layers or self.params.get("copy_inputs") == layers:
            return self
        return Plan(self.strategy, self.n_layers, self.items, {**self.params, "copy_inputs": list(layers)})

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "format": PLAN_FORMAT,
            "strategy": self.strategy,
            "n_layers": self.n_layers,
            "params": dict(self.params),
            "checkpoints": [[r.start, r.stop] for r in self.recomputed_ranges()],
        }
        if self.uses_options:
            d["options"] = list(self.options())
        return d

    @classmethod
    def from_dict(cls, d: Any, *, chain_layers: int | None = None,
                  known_options: tuple[str, ...] | None = None) -> Plan:
        """The plan of a JSON object (:meth:`to_dict`, or the nested ``items`` form).

        Everything that costs nothing is checked before any layer is built
        (:func:`check_plan_header`): the object's keys, its ``format``, ``n_layers`` (at most
        :data:`MAX_PLAN_LAYERS`, and equal to ``chain_layers``, the length of the chain it is for,
        when given) and the option names (among ``known_options`` when given).
        """
        check_plan_header(d, chain_layers=chain_layers, known_options=known_options)
        n = d["n_layers"]
        strategy = d.get("strategy", "custom")
        params = d.get("params") or {}
        if "checkpoints" in d:
            items = items_from_ranges(n, ranges_from_json(d["checkpoints"]))
        else:
            items = items_from_json(d["items"], "items")
        plan = cls(strategy, n, items, dict(params))
        if d.get("options") is not None:
            opts = d["options"]
            if isinstance(opts, dict):
                opts = {int(k): v for k, v in opts.items()}
            plan = plan.with_options(opts)
        return plan


def _store_runs(tokens: list[str], least: int = 4) -> list[str]:
    """``describe``'s tokens with each run of at least ``least`` consecutive stores with the same
    option (``S4 S5 S6 S7``, ``S0:offload S1:offload ...``) as one ``S4..S7`` (``S0..S3:offload``),
    and each run of as many one-layer checkpoints as one ``C[4,5){S4}..C[7,8){S7}``."""

    def parse(tok: str) -> tuple[int, str] | None:
        head, _, option = tok.partition(":")
        return (int(head[1:]), option) if head[:1] == "S" and head[1:].isdigit() else None

    def single(k: int) -> tuple[int, str] | None:
        """The layer and option of a one-layer checkpoint ``C[i,i+1){Si}`` starting at token k."""
        if k + 2 >= len(tokens) or tokens[k + 2] != "}":
            return None
        s = parse(tokens[k + 1])
        return s if s is not None and tokens[k] == f"C[{s[0]},{s[0] + 1}){{" else None

    out: list[str] = []
    i = 0
    while i < len(tokens):
        first = single(i)
        if first is not None:
            n = 1
            while single(i + 3 * n) == (first[0] + n, first[1]):
                n += 1
            if n >= least:
                out += tokens[i:i + 3]
                out[-1] += ".." + "".join(tokens[i + 3 * (n - 1):i + 3 * n])
                i += 3 * n
                continue
        j = i
        first = parse(tokens[i])
        while first is not None and j + 1 < len(tokens):
            nxt = parse(tokens[j + 1])
            if nxt is None or nxt != (first[0] + j + 1 - i, first[1]):
                break
            j += 1
        if j - i + 1 >= least and first is not None:
            out.append(f"S{first[0]}..S{first[0] + j - i}" + (f":{first[1]}" if first[1] else ""))
            i = j + 1
        else:
            out.append(tokens[i])
            i += 1
    return out
