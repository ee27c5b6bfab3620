"""A plan's JSON document checked and read: the header (keys, format, layer count, option names)
before anything is built per layer, then its flat ``checkpoints`` or nested ``items``
(:meth:`ckplan.planner.plan.Plan.from_dict`)."""
from __future__ import annotations

from difflib import get_close_matches
from typing import Any

from ..errors import SpecError
from .plan_items import STORE, Checkpoint, Item, Store

PLAN_FORMAT = "ckplan.plan/1"

# No model ckplan profiles has a chain this long (the planner's tables are built for thousands of
# layers); a longer plan is a typo, and building it would take one object per layer.
MAX_PLAN_LAYERS = 100_000
PLAN_KEYS = ("format", "strategy", "n_layers", "params", "checkpoints", "items", "options")
_EXAMPLE = '{"n_layers": 4, "checkpoints": [[0, 2], [2, 4]]}'


def check_plan_header(d: Any, *, chain_layers: int | None = None, limit: bool = True,
                      known_options: tuple[str, ...] | None = None) -> None:
    """Raise :class:`SpecError` for what is wrong with a plan object's keys, format, layer count
    (against ``chain_layers`` when given, and :data:`MAX_PLAN_LAYERS` unless ``limit`` is False:
    for a caller that compares it with the chain next) and option names (each one of
    ``known_options`` when given: a plan file is for ckplan's own options, ``SELECTIVE_OPTIONS``;
    the planner's own chains may name others): checks that build nothing per layer."""
    if not isinstance(d, dict):
        raise SpecError(f"a plan must be a JSON object, not {type(d).__name__}",
                        tip="write it with `ckplan plan SPEC --budget 12GB -o plan.json`")
    fmt = d.get("format", PLAN_FORMAT)
    if fmt != PLAN_FORMAT:
        newer = isinstance(fmt, str) and fmt.startswith("ckplan.plan/")
        raise SpecError(f"plan format {str(fmt)[:80]!r} is not {PLAN_FORMAT!r}, the one this ckplan reads",
                        tip="upgrade ckplan to read it, or write the plan again with this one"
                        if newer else f"a plan file says \"format\": \"{PLAN_FORMAT}\" or leaves it out")
    unknown = [k for k in d if k not in PLAN_KEYS]
    if unknown:
        key = str(unknown[0])
        close = get_close_matches(key, PLAN_KEYS, n=1)
        raise SpecError(f"plan key {key[:80]!r} is not one of {', '.join(PLAN_KEYS)}",
                        tip=f"did you mean {close[0]!r}?" if close else f"e.g. {_EXAMPLE}")
    n = d.get("n_layers")
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise SpecError(f"plan n_layers must be a positive integer, got {_short(n)}", tip=f"e.g. {_EXAMPLE}")
    if chain_layers is not None and n != chain_layers:
        raise SpecError(f"the plan is for {_count(n)} layers but the chain has {chain_layers}",
                        tip="make the plan for this model (the same spec, the same chain): "
                            "`ckplan plan SPEC --budget ... -o plan.json`")
    if limit and n > MAX_PLAN_LAYERS:
        raise SpecError(f"plan n_layers {_count(n)} is above the most ckplan plans, {MAX_PLAN_LAYERS} layers",
                        tip="n_layers is the length of the model's chain (the layers `ckplan profile` lists)")
    strategy, params = d.get("strategy", "custom"), d.get("params") or {}
    if not isinstance(strategy, str) or not isinstance(params, dict):
        raise SpecError("plan strategy must be a string and params an object")
    if "checkpoints" in d and "items" in d:
        raise SpecError("a plan gives 'checkpoints' or nested 'items', not both", tip="keep one of them")
    if "checkpoints" not in d and "items" not in d:
        raise SpecError("a plan needs a 'checkpoints' list (or nested 'items')", tip=f"e.g. {_EXAMPLE}")
    opts = d.get("options")
    if opts is None:
        return
    if isinstance(opts, dict):
        names = list(opts.values())
        for k in opts:
            if not (isinstance(k, int) or (isinstance(k, str) and k.strip().lstrip("-").isdigit())):
                raise SpecError(f"plan 'options' keys must be layer indices, got {_short(k)}")
    elif isinstance(opts, list):
        if len(opts) != n:
            raise SpecError(f"plan options list {len(opts)} layers but the plan has {n}",
                            tip="one option name per layer ('store' for a layer kept whole)")
        names = opts
    else:
        raise SpecError("plan 'options' must be a list with one option name per layer")
    for name in names:
        if not isinstance(name, str) or not name:
            raise SpecError(f"plan option {_short(name)} must be a name such as 'store'")
        if known_options is not None and name != STORE and name not in known_options:
            raise SpecError(f"plan option {_short(name)} is not one of {', '.join((STORE, *known_options))}",
                            tip="options are written by `ckplan plan` from a profile that measured them")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _count(n: int) -> str:
    return str(n) if n < 10**9 else f"about 10^{len(str(n)) - 1}"


def ranges_from_json(raw: Any) -> list[tuple[int, int]]:
    if not isinstance(raw, list):
        raise SpecError("plan 'checkpoints' must be a list of [start, stop] pairs")
    out = []
    for r in raw:
        if (not isinstance(r, (list, tuple)) or len(r) != 2
                or not all(isinstance(v, int) and not isinstance(v, bool) for v in r)):
            raise SpecError(f"plan checkpoint {r!r} is not a [start, stop] pair of integers")
        out.append((r[0], r[1]))
    return out


def items_from_json(raw: Any, where: str) -> tuple[Item, ...]:
    if not isinstance(raw, list):
        raise SpecError(f"plan {where} must be a list")
    items: list[Item] = []
    for k, obj in enumerate(raw):
        here = f"{where}[{k}]"
        if (isinstance(obj, dict) and set(obj) in ({"store"}, {"store", "option"})
                and isinstance(obj["store"], int) and isinstance(obj.get("option", STORE), str)):
            items.append(Store(obj["store"], obj.get("option", STORE)))
        elif (isinstance(obj, dict) and set(obj) == {"checkpoint", "inner"}
              and isinstance(obj["checkpoint"], list) and len(obj["checkpoint"]) == 2
              and all(isinstance(v, int) for v in obj["checkpoint"])):
            s, t = obj["checkpoint"]
            items.append(Checkpoint(s, t, items_from_json(obj["inner"], here + ".inner")))
        else:
            raise SpecError(f"plan {here} must be {{\"store\": i}} or "
                            f"{{\"checkpoint\": [start, stop], \"inner\": [...]}}, got {obj!r}")
    return tuple(items)
