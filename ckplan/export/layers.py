"""What a plan does, in the terms the targets speak: which layers are checkpointed one by one,
every-N patterns, and the closest one-layer-at-a-time plan with what it changes."""
from __future__ import annotations

from typing import Any

from ..planner.plan import Checkpoint, Plan, Store
from .base import FALLBACK, Ctx


def recomputed_layers(plan: Plan) -> tuple[int, ...]:
    """Layers inside at least one checkpoint (recomputed during backward)."""
    return tuple(d.layer for d in plan.per_layer() if d.depth > 0)


def per_layer_set(plan: Plan) -> tuple[int, ...] | None:
    """The checkpointed layers when every checkpoint holds exactly one layer, else None."""
    out = []
    for it in plan.items:
        if isinstance(it, Checkpoint):
            if it.stop - it.start != 1:
                return None
            out.append(it.start)
    return tuple(out)


def per_layer_plan(n_layers: int, layers: tuple[int, ...] | list[int], *, strategy: str = "per-layer",
                   **params: Any) -> Plan:
    """Layers in ``layers`` checkpointed one by one, the rest stored."""
    chosen = set(layers)
    items = tuple(Checkpoint(i, i + 1, (Store(i),)) if i in chosen else Store(i) for i in range(n_layers))
    return Plan(strategy, n_layers, items, {"layers": sorted(chosen), **params})


def hf_every_n(n_layers: int, n: int) -> tuple[int, ...]:
    """Layers transformers' ``every_n_layers=n`` checkpoints: 0, n, 2n, ..."""
    return tuple(range(0, n_layers, n))


def torchtitan_every_n(n_layers: int, n: int) -> tuple[int, ...]:
    """Layers torchtitan's ``selective_ac_option=n`` checkpoints: n-1, 2n-1, ... (1-based count % n == 0)."""
    return tuple(range(n - 1, n_layers, n))


def find_every_n(layers: tuple[int, ...], n_layers: int, pattern) -> int | None:
    """The smallest N whose pattern is exactly ``layers`` (None when no N gives it)."""
    for n in range(1, n_layers + 1):
        if pattern(n_layers, n) == layers:
            return n
    return None


def span_text(layers: tuple[int, ...] | list[int]) -> str:
    """``(1, 2, 3, 7)`` -> ``"1-3, 7"``."""
    if not layers:
        return "none"
    parts, start, prev = [], layers[0], layers[0]
    for i in list(layers[1:]) + [None]:
        if i is not None and i == prev + 1:
            prev = i
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if i is not None:
            start = prev = i
    return ", ".join(parts)


def why_not_per_layer(plan: Plan) -> str:
    """What the plan does that a one-module wrapper cannot: multi-layer segments, nesting."""
    multi = [f"[{it.start},{it.stop})" for it in plan.items if isinstance(it, Checkpoint) and it.stop - it.start > 1]
    nested = [f"[{it.start},{it.stop})" for it in plan.items
              if isinstance(it, Checkpoint) and any(isinstance(x, Checkpoint) for x in it.inner)]
    bits = []
    if multi:
        bits.append(f"checkpoints multi-layer segments {' '.join(multi)} (each keeps only its input and last output)")
    if nested:
        bits.append(f"nests checkpoints inside {' '.join(nested)}")
    return " and ".join(bits)


def per_layer_difference(plan: Plan) -> str:
    """How checkpointing the recomputed layers one by one differs from ``plan``."""
    extra = [i for it in plan.items if isinstance(it, Checkpoint) for i in range(it.start + 1, it.stop)]
    multi = [d.layer for d in plan.per_layer() if d.depth > 1]
    n = len(recomputed_layers(plan))
    out = f"the same {n} layer{'s' if n != 1 else ''} recomputed"
    if multi:
        out += f", each once where the plan recomputes {_layers(multi)} more than once"
    if extra:
        out += (f", but the inputs of {_layers(extra)} are kept too, so more is held for backward and the "
                "peak can go either way: compare the predicted peaks")
    return out


def _layers(indices: tuple[int, ...] | list[int]) -> str:
    return f"layer{'s' if len(indices) != 1 else ''} {span_text(indices)}"


def header(plan: Plan, ctx: Ctx) -> list[str]:
    name = f" for {ctx.model_name}" if ctx.model_name else ""
    what = plan.describe()
    if len(what) > 160:  # long chains: the summary, not every item
        what = f"{plan.n_checkpoints} checkpoints, recomputing layers {span_text(recomputed_layers(plan))}"
    return [f"# ckplan {plan.strategy} plan{name}, {plan.n_layers} layers of `{ctx.chain_path}`: {what}"]


def closest_per_layer(plan: Plan, target: str) -> tuple[Plan, bool, str, str]:
    """(closest plan, exact, comment line for the text, message) for the any-subset targets."""
    layers = per_layer_set(plan)
    if layers is not None:
        msg = (f"{target} applies this plan exactly: checkpoint {_layers(layers)} one by one. "
               + FALLBACK)
        return plan, True, "", msg
    layers = recomputed_layers(plan)
    closest = per_layer_plan(plan.n_layers, layers, source=plan.strategy, target=target)
    line = (f"# Not exact: {target} wraps one layer at a time; this applies the closest plan, "
            f"{_layers(layers)} checkpointed one by one.")
    msg = (f"{target} wraps one module per checkpoint, so it cannot express this {plan.strategy} plan: it "
           f"{why_not_per_layer(plan)}. Closest {target} can express: {_layers(layers)} checkpointed "
           f"one by one ({per_layer_difference(plan)}). " + FALLBACK)
    return closest, False, line, msg
