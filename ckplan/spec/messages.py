"""pydantic's validation errors for a spec as one SpecError: where, what was given, and the fix."""
from __future__ import annotations

import difflib
from typing import Any

from pydantic import BaseModel, ValidationError

from ..errors import SpecError


def _loc(err: dict) -> str:
    return ".".join(str(p) for p in err["loc"] if not str(p).startswith("function-after")) or "(top level)"


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _fields_at(root: type[BaseModel], loc: tuple) -> list[str] | None:
    """The keys ``root`` (the spec) takes in the mapping that holds ``loc``'s last key, or None."""
    model: Any = root
    for part in loc[:-1]:
        field = getattr(model, "model_fields", {}).get(str(part))
        if field is None:
            return None
        ann = field.annotation
        model = next((a for a in (ann, *getattr(ann, "__args__", ())) if isinstance(a, type)
                      and issubclass(a, BaseModel)), None)
        if model is None:
            return None
    return list(getattr(model, "model_fields", {}))


def _explain(err: dict, root: type[BaseModel]) -> tuple[str, str | None]:
    """One validation error as ``where: what (got value)`` and its fix, or None for no fix."""
    loc = tuple(p for p in err["loc"] if not str(p).startswith("function-after"))
    where = _loc(err)
    parent = ".".join(map(str, loc[:-1]))
    if err["type"] == "extra_forbidden":
        keys = _fields_at(root, loc) or []
        close = difflib.get_close_matches(str(loc[-1]), keys, n=1)
        tip = (f"did you mean {close[0]!r}?" if close else
               f"the keys of `{parent or 'the spec'}` are {', '.join(keys)}" if keys else None)
        return f"{where}: unknown key", tip
    if err["type"] == "missing":
        return f"{where}: required key is missing", f"add `{loc[-1]}:` under `{parent}:`" if parent else None
    msg = err["msg"].removeprefix("Value error, ")
    if err["type"] != "value_error":  # pydantic's own messages do not show the value given
        msg += f" (got {_shown(err.get('input'))})"
    return f"{where}: {msg}", None


def spec_error(error: ValidationError, root: type[BaseModel], source: str) -> SpecError:
    """Every problem pydantic found in a spec (``root`` is its model) as one SpecError, the fixes as its tip."""
    found = [_explain(err, root) for err in error.errors()]
    tips = list(dict.fromkeys(t for _, t in found if t))
    return SpecError(f"{source}: " + "; ".join(m for m, _ in found), tip="; ".join(tips) or None)
