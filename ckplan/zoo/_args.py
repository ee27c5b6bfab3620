"""Checks for builder arguments, shared by the zoo's config dataclasses.

Arguments usually come from a YAML spec, so a value can be a string where a number was meant
(PyYAML reads ``1e-1`` as a string) or a float where an int was meant. Each check names the
model, the argument, the value and what was expected, and never coerces silently.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class ZooArgumentError(TypeError, ValueError):
    """A builder argument with an invalid value.

    A TypeError so that callers of ``build_builtin`` catch bad names and bad values with one
    ``except TypeError``; a ValueError because that is what a bad value conventionally raises.
    """


def check_int(model: str, name: str, value: Any, *, min_value: int = 1) -> int:
    # bool is an int subclass; `bias: 1` meaning n_layer=True would be a typo, not a layer count.
    if isinstance(value, bool) or not isinstance(value, int):
        raise ZooArgumentError(f"{model}: {name}={value!r} must be an int >= {min_value}")
    if value < min_value:
        raise ZooArgumentError(f"{model}: {name}={value} must be >= {min_value}")
    return value


def check_optional_int(model: str, name: str, value: Any, *, min_value: int = 1) -> int | None:
    return None if value is None else check_int(model, name, value, min_value=min_value)


def check_float(model: str, name: str, value: Any, *, low: float, high: float) -> float:
    """A float in [low, high). Ints are accepted (``dropout: 0``)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ZooArgumentError(f"{model}: {name}={value!r} must be a number in [{low}, {high})")
    if not low <= value < high:
        raise ZooArgumentError(f"{model}: {name}={value} must be in [{low}, {high})")
    return float(value)


def check_bool(model: str, name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ZooArgumentError(f"{model}: {name}={value!r} must be true or false")
    return value


def check_choice(model: str, name: str, value: Any, choices: Sequence[str]) -> str:
    if value not in choices:
        options = ", ".join(repr(c) for c in choices)
        raise ZooArgumentError(f"{model}: {name}={value!r} must be one of {options}")
    return value


def check_int_list(model: str, name: str, value: Any, *, min_value: int = 1,
                   min_len: int = 1) -> list[int]:
    """A list (or tuple) of ints, returned as a fresh list."""
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
        raise ZooArgumentError(f"{model}: {name}={value!r} must be a list of ints")
    if len(value) < min_len:
        raise ZooArgumentError(f"{model}: {name}={list(value)!r} must have at least {min_len} entries")
    return [check_int(model, f"{name}[{i}]", v, min_value=min_value) for i, v in enumerate(value)]
