"""What a valid profile document is: a ``ckplan profile -f json`` file checked against the records
it becomes (:mod:`ckplan.records`), with one field named when something is wrong.

The fields, their types and which of them may be null or absent come from the dataclasses
(``StageRecord`` for the rows, ``Totals``, ``OptionRecord``); what only the document knows is here:
the row order (pre -1, chain layers 0..n-1, post n), the row fields a document must carry although
the record has a default, and the limits the planner needs (numbers finite and not negative,
sizes at most 2**62 each and in sum). Text fields (names, types) are not checked: nothing is
computed with them.
"""
from __future__ import annotations

import math
from dataclasses import MISSING, Field, fields
from typing import Any

from .options import OPTIMIZERS, PRECISIONS
from .records import CHAIN, POST, PRE, OptionRecord, StageRecord, Totals

# The planner adds and compares profile integers as int64; 2**62 (4 EiB, 4.6e18 FLOPs) leaves it
# room for sums. A larger value is no machine's memory (it would overflow, exit 1, if accepted).
MAX_PROFILE_INT = 2**62

# Row fields with a default in StageRecord that a document must still carry: a row without
# them is refused, not read with the default.
ROW_FIELDS_REQUIRED = ("cast_bytes", "recompute_kept_bytes", "recompute_chain_kept_bytes")
# Row fields checked by position or as a list, not by their type.
_ROW_FIELDS_OWN_CHECK = ("index", "role", "options")
# The order row fields are checked in, by kind (each kind in field order): the first problem
# found is the one named.
_ROW_KIND_ORDER = (("int", "float"), ("float | None",), ("options",), ("bool",), ("int | None",), ("bool | None",))


def _has_default(f: Field) -> bool:
    return f.default is not MISSING or f.default_factory is not MISSING


def _too_large(where: str, value: int) -> str:
    text = str(value) if len(str(value)) <= 24 else f"about 1e{len(str(value)) - 1}"
    what = "larger than any machine's memory" if "bytes" in where else "too large to plan with"
    return f"{where} is {text}, above the limit 2**62 = {MAX_PROFILE_INT} ({what})"


def _number_problem(where: str, value: Any, kind: str, *, optional: bool = False) -> str | None:
    """What is wrong with a whole number (``kind`` "int") or a number ("float"), or None."""
    if value is None and optional:
        return None
    if kind == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            return f"{where} is {value!r}, not a whole number"
        if value > MAX_PROFILE_INT:
            return _too_large(where, value)
    elif isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return f"{where} is {value!r}, not a finite number"
    if value < 0:
        return f"{where} is {value!r}, a negative {'size' if 'bytes' in where else 'value'}"
    return None


def _field_problem(where: str, value: Any, f: Field) -> str | None:
    """What is wrong with ``value`` as record field ``f`` (by its annotation), or None."""
    kind = str(f.type)
    if kind in ("int", "float"):
        return _number_problem(where, value, kind)
    if kind == "int | None" and _has_default(f):  # a measurement a document may lack: null when not made
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
            return f"{where} must be a non-negative integer or null, got {value!r}"
        return _too_large(where, value) if value is not None and value > MAX_PROFILE_INT else None
    if kind in ("int | None", "float | None"):
        return _number_problem(where, value, kind.split(" ")[0], optional=True)
    if kind == "bool" and value not in (True, False):
        return f"{where} must be true or false, got {value!r}"
    if kind == "bool | None" and value not in (None, True, False):
        return f"{where} must be true, false or null, got {value!r}"
    return None


def _options_problem(where: str, options: Any) -> str | None:
    """What is wrong with a row's measured selective options, or None."""
    if not isinstance(options, list):
        return f"{where} is not a list"
    record = fields(OptionRecord)
    for j, o in enumerate(options):
        if not isinstance(o, dict):
            return f"{where}[{j}] is not an object"
        # a field with a default may be absent: it reads as that default
        missing = [f.name for f in record if f.name not in o and not _has_default(f)]
        if missing:
            return f"{where}[{j}].{missing[0]} is missing"
        if not isinstance(o["name"], str) or not o["name"] or o["name"] in ("store", "full"):
            return f"{where}[{j}].name is {o['name']!r}, not the name of a selective option"
        for f in record:
            if f.name not in o:
                continue
            problem = _field_problem(f"{where}[{j}].{f.name}", o[f.name], f)
            if problem:
                return problem
    return None


def _row_problem(i: int, row: Any, n: int) -> str | None:
    """What is wrong with row ``i`` of ``n`` chain layers (plus pre and post), or None."""
    if not isinstance(row, dict):
        return f"layers[{i}] is not an object"
    record = fields(StageRecord)
    missing = [f.name for f in record if f.name not in row
               and (not _has_default(f) or f.name in ROW_FIELDS_REQUIRED)]
    if missing:
        return f"layers[{i}].{missing[0]} is missing"
    want_index = i - 1
    want_role = PRE if i == 0 else POST if i == n + 1 else CHAIN
    if row["index"] != want_index or isinstance(row["index"], bool):
        return (f"layers[{i}].index is {row['index']!r}, expected {want_index} (rows must be pre -1, "
                f"chain layers 0..{n - 1} in order, post {n}: duplicated or missing rows?)")
    if row["role"] != want_role:
        return f"layers[{i}].role is {row['role']!r}, expected {want_role!r}"
    for kinds in _ROW_KIND_ORDER:
        if kinds == ("options",):
            problem = _options_problem(f"layers[{i}].options", row.get("options", []))
            if problem:
                return problem
            continue
        for f in record:
            if str(f.type) in kinds and f.name not in _ROW_FIELDS_OWN_CHECK:
                value = row.get(f.name, f.default if f.default is not MISSING else None)
                problem = _field_problem(f"layers[{i}].{f.name}", value, f)
                if problem:
                    return problem
    return None


def _totals_problem(totals: Any) -> str | None:
    if not isinstance(totals, dict):
        return "totals is not an object"
    for f in fields(Totals):
        if f.name not in totals and not _has_default(f):
            return f"totals.{f.name} is missing"
        problem = _field_problem(f"totals.{f.name}", totals.get(f.name, f.default), f)
        if problem:
            return problem
        if f.name == "optimizer_scalar_bytes":  # part of optimizer_bytes (not sharded with it)
            value = totals.get(f.name, f.default)
            if isinstance(totals.get("optimizer_bytes"), int) and value > totals["optimizer_bytes"]:
                return (f"totals.{f.name} is {value}, more than totals.optimizer_bytes "
                        f"({totals['optimizer_bytes']}) that it is part of")
    return None


def _settings_problem(data: dict) -> str | None:
    """The step's settings: batch size, accumulation, precision, optimizer, compiled."""
    for key in ("batch_size", "accum"):
        if key in data and (_number_problem(key, data[key], "int") or data[key] < 1):
            return f"{key} is {data[key]!r}, not a whole number of at least 1"
    if data.get("precision", "fp32") not in PRECISIONS:
        return f"precision is {data.get('precision')!r}, not one of {', '.join(PRECISIONS)}"
    if data.get("optimizer", "adamw") not in OPTIMIZERS:
        return f"optimizer is {data.get('optimizer')!r}, not one of {', '.join(OPTIMIZERS)}"
    if not isinstance(data.get("compiled", False), bool):
        return f"compiled is {data.get('compiled')!r}, not true or false"
    return None


def _side_inputs_problem(side: Any, n: int) -> str | None:
    if not isinstance(side, list):
        return "side_inputs is not a list"
    for j, si in enumerate(side):
        if not isinstance(si, dict) or "bytes" not in si or "layers" not in si:
            return f"side_inputs[{j}] is not an object with bytes and layers"
        problem = (_number_problem(f"side_inputs[{j}].bytes", si["bytes"], "int")
                   or _number_problem(f"side_inputs[{j}].grad_bytes", si.get("grad_bytes", 0), "int"))
        if problem:
            return problem
        ls = si["layers"]
        if (not isinstance(ls, list) or not ls
                or any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < n for i in ls)):
            return f"side_inputs[{j}].layers is {ls!r}, not a list of chain layer indices 0..{n - 1}"
        by = si.get("made_by", -1)
        if isinstance(by, bool) or not isinstance(by, int) or not -1 <= by < min(ls):
            return (f"side_inputs[{j}].made_by is {by!r}, not -1 (before the chain) or a chain layer "
                    f"before every layer that receives them ({min(ls)})")
        problem = _number_problem(f"side_inputs[{j}].partial_bytes", si.get("partial_bytes", 0), "int")
        span, frm = si.get("partial_span", []), si.get("grad_from", -1)
        if problem:
            return problem
        if (not isinstance(span, list) or len(span) not in (0, 2)
                or any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < n for i in span)):
            return f"side_inputs[{j}].partial_span is {span!r}, not [] or two chain layer indices 0..{n - 1}"
        if isinstance(frm, bool) or not isinstance(frm, int) or not (frm == -1 or frm in ls):
            return f"side_inputs[{j}].grad_from is {frm!r}, not -1 or one of its layers {ls}"
        for key in ("saved_by", "unrelayed"):
            some = si.get(key, [])
            if (not isinstance(some, list)
                    or any(isinstance(i, bool) or not isinstance(i, int) or i not in ls for i in some)):
                return f"side_inputs[{j}].{key} is {some!r}, not a list of layers among its layers {ls}"
    return None


def _lists_problem(data: dict, n: int) -> str | None:
    """The chain breaks and the ops whose FLOPs were estimated."""
    breaks = data.get("chain_breaks", [])
    if (not isinstance(breaks, list)
            or any(isinstance(b, bool) or not isinstance(b, int) or not 0 < b < n for b in breaks)):
        return f"chain_breaks is {breaks!r}, not a list of chain layer indices 1..{n - 1}"
    ops = data.get("flops_estimated", [])
    if not isinstance(ops, list) or not all(isinstance(op, str) for op in ops):
        return f"flops_estimated is {ops!r}, not a list of op names"
    bw = data.get("host_bw", [0.0, 0.0])
    if (not isinstance(bw, (list, tuple)) or len(bw) != 2
            or any(isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < math.inf for v in bw)):
        return f"host_bw is {bw!r}, not two bandwidths in bytes/s (device to host, host to device; 0: no link)"
    return None


def profile_problem(data: Any) -> str | None:
    """What is wrong with a profile document (one field named), or None when the planner can trust it.

    Rows must be pre (index -1), chain layers 0..n-1 in order, post (index n); sizes, FLOPs and
    times finite and not negative.
    """
    if not isinstance(data, dict):
        return f"expected a JSON object, got {type(data).__name__}"
    for key in ("layers", "totals"):
        if key not in data:
            return f"field {key!r} is missing"
    layers = data["layers"]
    if not isinstance(layers, list) or len(layers) < 3:
        return "layers must list the pre row, at least one chain layer and the post row"
    n = len(layers) - 2
    for i, row in enumerate(layers):
        problem = _row_problem(i, row, n)
        if problem:
            return problem
    return (_totals_problem(data["totals"]) or _settings_problem(data)
            or _side_inputs_problem(data.get("side_inputs", []), n) or _lists_problem(data, n)
            or _bytes_total_problem(data))


def _bytes_total_problem(data: dict) -> str | None:
    """Each size is at most 2**62, but the planner adds them up: so must their sum be."""
    sizes: list[tuple[int, str]] = []

    def add(where: str, obj: dict) -> None:
        sizes.extend((v, f"{where}.{k}") for k, v in obj.items()
                     if k.endswith("_bytes") and isinstance(v, int) and not isinstance(v, bool))

    for i, row in enumerate(data["layers"]):
        add(f"layers[{i}]", row)
        for j, o in enumerate(row.get("options", [])):
            add(f"layers[{i}].options[{j}]", o)
    add("totals", data["totals"])
    for j, si in enumerate(data.get("side_inputs", [])):
        sizes += [(si["bytes"], f"side_inputs[{j}].bytes"), (si.get("grad_bytes", 0), f"side_inputs[{j}].grad_bytes")]
    total = sum(v for v, _ in sizes)
    if total <= MAX_PROFILE_INT:
        return None
    value, where = max(sizes)
    return (f"{where} ({value}) and the other sizes add up to about {total:.3g} bytes, above the limit "
            f"2**62 = {MAX_PROFILE_INT} (larger than any machine's memory)")
