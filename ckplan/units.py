"""Sizes in, sizes out: the only place that knows about units.

Inside ckplan every size is an ``int`` number of bytes and every duration a ``float`` number of
milliseconds. ``parse_size`` reads what users type (``12GB`` = 12 * 10**9, ``12GiB`` = 12 * 2**30,
a bare number = bytes, as ``pydantic.ByteSize`` does); ``format_bytes`` prints IEC units.
"""
from __future__ import annotations

import re
from decimal import Decimal

from .errors import UsageError

_DECIMAL = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "pb": 10**15}
_BINARY = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "pib": 2**50}
_UNITS = {**_DECIMAL, **_BINARY, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE]([+-]?[0-9]+))?\s*([a-zA-Z]*)\s*$")

ACCEPTED_SIZES = "a size like 12GB (10^9 bytes), 12GiB (2^30 bytes), 500MB, 2048 (bytes)"
KiB, MiB, GiB = 2**10, 2**20, 2**30  # binary sizes, for constants written in code
GB, TFLOP = 1e9, 1e12  # decimal, as rates: data-sheet bandwidths (bytes/s) and FLOP/s
MAX_SIZE = 2**63 - 1  # int64 bytes (8 EiB): beyond any machine, and what torch and NVML can count


def parse_size(text: str | int, *, what: str = "size") -> int:
    """Parse ``12GB``, ``1.5GiB``, ``500MB``, ``4096`` into a positive number of bytes."""
    if isinstance(text, bool):
        raise UsageError(f"{what} {text!r} is not a size", tip=f"use {ACCEPTED_SIZES}")
    if isinstance(text, int):
        value = text
    else:
        m = _SIZE_RE.match(str(text))
        unit = m.group(3).lower() if m else None
        if not m or unit not in _UNITS:
            raise UsageError(f"{what} {str(text)!r} is not a size", tip=f"use {ACCEPTED_SIZES}")
        # Exact decimal arithmetic: 1e400 is a (huge) size to reject, not a float overflow.
        exp = int(m.group(2)) if m.group(2) else 0
        if exp > 40:  # beyond MAX_SIZE whatever the unit; checked before building a 10**exp number
            raise UsageError(f"{what} {str(text)!r} is larger than any machine's memory",
                             tip=f"use {ACCEPTED_SIZES}")
        exact = Decimal(m.group(1)).scaleb(exp) * _UNITS[unit]
        if 0 < exact < 1 or (unit in ("", "b") and exact != exact.to_integral_value()):
            # Bytes are whole: 0.5 is not rounded to 0 ("more than 0 bytes" would read oddly), nor 1.5 to 2.
            why = "under one byte" if exact < 1 else "not a whole number of bytes"
            num = m.group(1) + (f"e{m.group(2)}" if m.group(2) else "")
            hint = f" (a number without a unit is bytes: did you mean {num}GB or {num}GiB?)" if not unit else ""
            raise UsageError(f"{what} {str(text)!r} is {why}{hint}", tip=f"use {ACCEPTED_SIZES}")
        value = int(exact.to_integral_value())
    if value > MAX_SIZE:
        raise UsageError(f"{what} {str(text)!r} is larger than any machine's memory (over 8 EiB)",
                         tip=f"use {ACCEPTED_SIZES}")
    if value <= 0:
        raise UsageError(f"{what} {text!r} must be more than 0 bytes", tip=f"use {ACCEPTED_SIZES}")
    return value


def format_bytes(n: int | float | None, *, signed: bool = False) -> str:
    """IEC units with three significant figures: 1536 -> '1.50 KiB'."""
    if n is None:
        return "-"
    sign = "-" if n < 0 else ("+" if signed and n > 0 else "")
    n = abs(n)
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            v = n / scale
            return f"{sign}{v:.3g} {unit}" if v < 100 else f"{sign}{v:.0f} {unit}"
    return f"{sign}{int(n)} B"


def format_ms(ms: float | None) -> str:
    if ms is None:
        return "-"
    if ms >= 1000:
        return f"{ms / 1000:.3g} s"
    if ms >= 1:
        return f"{ms:.3g} ms"
    return f"{ms * 1000:.3g} us"


def format_flops(f: int | float | None) -> str:
    if f is None:
        return "-"
    for unit, scale in (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6), ("KFLOP", 1e3)):
        if f >= scale:
            return f"{f / scale:.3g} {unit}"
    return f"{int(f)} FLOP"
