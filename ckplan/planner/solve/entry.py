"""The planner's DP entry points: ``plan_dp``, ``min_peak``, ``min_peak_plan``."""
from __future__ import annotations

from functools import lru_cache

from ...errors import InfeasibleBudgetError
from ..baselines import none_peak
from ..chain import Chain
from ..plan import Plan
from .common import (
    DPResult,
)
from .held_fallback import _held_min_peak_plan, _plan_dp_held, min_peak_held
from .offload import with_offload
from .portfolio import min_peak_plan_unheld, min_peak_unheld, none_fits, plan_unheld


def plan_dp(chain: Chain, budget_bytes: int, *, max_slots: int | None = None, mode: str = "auto",
            groups: int | None = None, rounding: str = "nearest") -> DPResult:
    """The least-recompute plan whose simulated peak fits ``budget_bytes``.

    ``mode="auto"``: the exact DP in bytes up to ``BAND_MIN_LAYERS`` layers, the banded DP
    (``banded_plan``) up to ``BAND_MAX_LAYERS``, grouped tables above (the banded DP again just
    above the smallest peak); ``"exact"``: the exact DP at any length (``DPResult.exact``);
    ``"grouped"``: the grouped tables. Raises :class:`ckplan.errors.InfeasibleBudgetError` when
    even ``min_peak`` does not fit.
    """
    if not chain.has_holds:
        if not chain.can_offload:
            return plan_unheld(chain, budget_bytes, max_slots=max_slots, mode=mode, groups=groups,
                               rounding=rounding)
        error: InfeasibleBudgetError | None = None
        try:
            found: DPResult | None = plan_unheld(chain, budget_bytes, max_slots=max_slots, mode=mode,
                                                 groups=groups, rounding=rounding)
        except InfeasibleBudgetError as e:
            error, found = e, None
        peak_none = none_peak(chain)
        result = with_offload(chain, budget_bytes, found, peak_none)
        if result is None:  # no plan fits, offload or not
            assert error is not None
            raise error
        return result
    peak_none = none_peak(chain)
    fits = none_fits(chain, budget_bytes, peak_none)
    return fits if fits is not None else _plan_dp_held(chain, budget_bytes, peak_none)


@lru_cache(maxsize=16)
def min_peak(chain: Chain) -> int:
    """The smallest peak any plan reaches (exact: a min-max DP over bytes, every layer a unit,
    selective options included; with autocast copies, the top-level frontiers of ``casts.py``,
    without options). When some boundary is not kept by the plain forward (``Chain.all_kept``
    False), the lowest peak on ``chain`` of the plans the tables of ``chain.conservative()``
    give near their own smallest peak (``unkept.py``): a peak a plan reaches, which the true
    smallest may undercut (by at most those boundaries). Held layers: ``held_fallback.py``."""
    return min_peak_held(chain) if chain.has_holds else min_peak_unheld(chain)


def min_peak_plan(chain: Chain, budget_bytes: int | None = None) -> Plan:
    """A plan reaching ``min_peak`` (or fitting ``budget_bytes``, which must be at least
    that), storing wherever the slack allows, with selective options where the chain has
    them (not with autocast copies); exact, but not least-recompute."""
    if chain.has_holds:  # FSDP2 per rank: held layers (held.py)
        return _held_min_peak_plan(chain, budget_bytes)
    return min_peak_plan_unheld(chain, budget_bytes)
