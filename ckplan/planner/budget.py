"""Every budget rule in one place: what a ``--budget`` text means, what to plan for when none is
given, and why no plan can lower a step's peak.

Budget forms (``parse_budget``):

* a size: ``12GB`` (10^9), ``12GiB`` (2^30), ``500MB``, plain bytes ``4096`` (``units.parse_size``);
* ``40%``: that share of the peak without checkpointing (above 0%, up to 1000%);
* ``50%act``: the peak without checkpointing with only that share of its *activation memory*
  (what the plan without checkpointing holds for backward when the forward ends): the peak less
  the other 50% of the activations (above 0%, up to 100%). ``100%act`` is the peak without
  checkpointing itself; the rest of that peak (parameters, buffers, batch, optimizer state, and
  the gradients and temporaries alive at the peak) is kept whole at every share.

Shares are exact: the bytes are ``floor(total * pct / 100)`` computed on the decimal text.

Defaults (``default_budget``): ``plan`` plans for the free device memory when the device reports
it, else for the smallest feasible peak (None); ``bench`` plans halfway between the smallest
feasible peak and the peak without checkpointing, so the planners have a trade-off to make.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from fractions import Fraction

from ..errors import PlannerArgumentError, UsageError
from ..units import ACCEPTED_SIZES, parse_size
from ..units import format_bytes as fb
from .baselines import none_peak, plan_none
from .chain import Chain
from .floor import floor_of
from .plan import Plan
from .simulate import simulate, trace
from .solve import min_peak

ACCEPTED_BUDGETS = (f"{ACCEPTED_SIZES}, a share of the peak without checkpointing like 40%, or "
                    "that peak with a share of its activations like 50%act")
MAX_PEAK_PCT = 1000
MAX_ACT_PCT = 100
_PCT_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*%\s*(act)?\s*$", re.IGNORECASE)


@dataclass(frozen=True)
class Budget:
    """A resolved budget: the bytes, what was written, which rule made it, and a sentence."""

    bytes: int
    text: str  # what the user wrote ("" for a default)
    kind: str  # "size" | "peak-share" | "act-share" | "device-free" | "halfway"
    description: str  # e.g. "the peak without checkpointing 4.20 GiB less 50% of its activations ..."


def held_for_backward_bytes(chain: Chain, plan: Plan) -> int:
    """What ``plan`` holds for backward when the forward (loss included, autocast's weight copies
    of checkpointed layers, a last boundary nothing after it saves and the last offloaded layer's
    copy to the host released) ends, persistent
    memory excluded, from the simulator's trace."""
    n = chain.n_layers
    held = None
    for ev in trace(chain, plan):
        if ev.op == "F" and ev.stage == n:
            held = ev.mem_bytes
        elif held is not None:
            if ev.op not in ("uncast", "release", "offloaded"):
                break
            held = ev.mem_bytes  # a boundary only the last layer's own ops saved, read by post
    assert held is not None  # every trace runs the post forward
    return held - chain.persistent_bytes


def activation_bytes(chain: Chain) -> int:
    """What the plan without checkpointing holds for backward when the forward ends, persistent
    memory excluded: the activation memory that ``50%act`` budgets keep a share of."""
    return held_for_backward_bytes(chain, plan_none(chain.n_layers))


def _whole(text: str | int | float, what: str) -> str | int:
    """A budget as text or whole bytes: a float such as ``12e9`` (what Python users write for
    12 GB) is its whole number of bytes; a float with a fraction, NaN or inf is refused."""
    if isinstance(text, float):
        if not math.isfinite(text) or text != int(text):
            raise UsageError(f"{what} {text!r} is not a whole number of bytes", tip=f"use {ACCEPTED_BUDGETS}")
        return int(text)
    if isinstance(text, bool) or not isinstance(text, (str, int)):
        raise UsageError(f"{what} {text!r} is not a budget", tip=f"use {ACCEPTED_BUDGETS}")
    return text


def check_budget_text(text: str | int | float, *, what: str = "--budget") -> None:
    """Check a budget's syntax and limits before anything runs (no chain needed): the same
    UsageError that :func:`parse_budget` would raise later, raised now."""
    text = _whole(text, what)
    raw = str(text).strip()
    if "%" in raw:
        _share_of(raw, what)
    else:
        _size_of(text if isinstance(text, int) else raw, what)


def _size_of(text: str | int, what: str) -> int:
    try:
        return parse_size(text, what=what)
    except OverflowError:
        raise UsageError(f"{what} {text!r} is too large a number", tip=f"use {ACCEPTED_BUDGETS}") from None
    except UsageError as err:
        raise UsageError(err.message, tip=f"use {ACCEPTED_BUDGETS}") from None


def _share_of(raw: str, what: str) -> tuple[Fraction, bool, str]:
    """(percentage, of the activations?, the number as written) of a share budget, limits checked."""
    m = _PCT_RE.match(raw)
    if not m:
        negative = re.match(r"^\s*-\s*([0-9.]+)\s*%\s*(act)?\s*$", raw, re.IGNORECASE)
        if negative:
            raise UsageError(f"{what} {raw!r}: a share must be above 0%", tip=f"use {ACCEPTED_BUDGETS}")
        raise UsageError(f"{what} {raw!r} is not a percentage", tip=f"use {ACCEPTED_BUDGETS}")
    pct = Fraction(m.group(1))
    of_act = m.group(2) is not None
    limit = MAX_ACT_PCT if of_act else MAX_PEAK_PCT
    if not 0 < pct <= limit:
        share = "of the activations" if of_act else "of the peak without checkpointing"
        raise UsageError(f"{what} {raw!r}: a share {share} must be above 0% and at most {limit}%",
                         tip=f"use {ACCEPTED_BUDGETS}")
    return pct, of_act, m.group(1)


def parse_budget(text: str | int | float, chain: Chain, *, what: str = "--budget") -> Budget:
    """Resolve a budget text (see the module docstring) against ``chain``; a number is bytes
    (a float such as ``12e9`` must be a whole number).

    Raises :class:`ckplan.errors.UsageError` naming the value and the accepted forms for
    anything else: 0%, negative, NaN, overflowing numbers, shares above the limits.
    """
    text = _whole(text, what)
    if isinstance(text, int):
        b = _size_of(text, what)
        return Budget(b, str(text), "size", fb(b))
    raw = text.strip()
    if "%" in raw:
        return _parse_share(raw, chain, what)
    b = _size_of(raw, what)
    return Budget(b, raw, "size", fb(b))


def _parse_share(raw: str, chain: Chain, what: str) -> Budget:
    pct, of_act, number = _share_of(raw, what)
    if of_act:
        # The peak without checkpointing, its activations cut to the share: 100%act is that peak.
        act, top = activation_bytes(chain), none_peak(chain)
        b = top - act + int(act * pct / 100)
        desc = (f"the peak without checkpointing {fb(top)} with {number}% of its activations {fb(act)} "
                f"= {fb(b)}")
        if b <= 0:
            raise UsageError(f"{what} {raw!r} gives {b} bytes", tip=f"use {ACCEPTED_BUDGETS}")
        return Budget(b, raw, "act-share", desc)
    peak = none_peak(chain)
    b = int(peak * pct / 100)
    if b <= 0:
        raise UsageError(f"{what} {raw!r} gives {b} bytes", tip=f"use {ACCEPTED_BUDGETS}")
    return Budget(b, raw, "peak-share",
                  f"{number}% of the peak without checkpointing {fb(peak)} = {fb(b)}")


def default_budget(chain: Chain, *, mode: str, free_device_bytes: int | None) -> Budget | None:
    """The budget when none is given.

    ``mode="plan"``: the free device memory when known (the model's own resident memory is
    already in the plan's peak), else None: plan for the smallest feasible peak.
    ``mode="bench"``: halfway between the smallest feasible peak and the peak without
    checkpointing (always feasible; ``free_device_bytes`` is not used).
    """
    if mode == "plan":
        if free_device_bytes:
            return Budget(free_device_bytes, "", "device-free",
                          f"free device memory {fb(free_device_bytes)}")
        return None
    if mode == "bench":
        lo, hi = min_peak(chain), none_peak(chain)
        b = (lo + hi) // 2
        if fb(lo) == fb(hi):  # the sizes would print alike: say how far apart they are
            gap = "equals" if lo == hi else f"is {hi - lo:,} B below"
            return Budget(b, "", "halfway",
                          f"{fb(b)}: the smallest feasible peak {gap} the peak without checkpointing "
                          f"({fb(hi)}), so checkpoints gain little or nothing here")
        return Budget(b, "", "halfway",
                      f"{fb(b)}, halfway between the smallest feasible peak ({fb(lo)}) and the peak "
                      f"without checkpointing ({fb(hi)})")
    raise PlannerArgumentError(f"default_budget mode must be 'plan' or 'bench', not {mode!r}")


def no_gain_reason(chain: Chain) -> str | None:
    """Why no checkpointing plan can lower this step's peak, or None when one can."""
    lo, hi = min_peak(chain), none_peak(chain)
    if lo < hi:
        return None
    at = simulate(chain, plan_none(chain.n_layers)).peak_at
    parts = floor_of(chain, hi).parts()
    made = ", ".join(f"{k} {fb(v)}" for k, v in parts) if parts else "memory no plan changes"
    return (f"no checkpointing plan can lower this step's peak ({fb(hi)}, reached at {at}; made of "
            f"{made}); checkpointing still frees the bytes held for backward")
