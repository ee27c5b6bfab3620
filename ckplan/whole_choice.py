"""dp's plan under a whole-model compile, checked by measurement: each mixed plan dp picks is
compiled and measured before it is taken (:func:`checked_plan`), and weighed against
torch.compile's own min-cut over every stored layer at a budget searched to fit
(:func:`mincut_search`, :func:`dp_choice`). The planner proposes (:mod:`ckplan.planner.whole`);
the measurements (``measure(plan)``, :mod:`ckplan.profiling.whole_steps`) decide.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from .errors import InfeasibleBudgetError
from .peers import budget_fraction
from .planner import Plan, plan_none, simulate
from .planner.plan import STORE
from .planner.regions import RegionsResult
from .planner.whole import WholeStep, option_plan, plan_whole, whole_peak
from .whole_compile import PARTITIONER_BUDGET, CompiledModel

CHECKS = 4  # plans of mixed choices compiled and measured before dp settles on one of the measured plans


def checked_plan(chain, budget_bytes: int | None, measure, tick) -> tuple[RegionsResult, dict, dict, list[str]]:
    """dp's whole-model plan (:func:`ckplan.planner.whole.plan_whole`), each plan it picks that mixes
    choices compiled and measured (``measure(plan) -> (CompiledModel, WholeStep)``) before it is
    taken: in one graph the partitioner decides a region's neighbourhood too (what crosses a layer
    boundary, what no layer is named on), so a mixed plan's peak may differ from the sum of the
    uniform steps' terms (gpt at 3 x 64: -4% to +3%). The misses come from stored layers, whose
    ops the partitioner places over the whole graph; a region's ops carry tags it honours (the same
    toy: a mix of SAC regions alone missed by 0.06%). A plan is re-chosen with the measured peaks
    known and the largest miss so far added to every unmeasured mixed plan's peak (the misses of
    plans with a stored layer to those, of plans of regions only to those), up to :data:`CHECKS`
    times; then among the measured plans only. Returns the result, the checked peaks
    (options -> bytes, persistent included), their compiled copies (options -> copy) and a line per
    check (the plan, its predicted and measured peak)."""
    checked: dict[tuple[str, ...], int] = {}
    made: dict[tuple[str, ...], CompiledModel] = {}
    lines: list[str] = []
    margin = region_margin = 0
    for _ in range(CHECKS):
        res = plan_whole(chain, budget_bytes, checked, margin=margin, region_margin=region_margin)
        opts = res.plan.options()
        if len(set(opts)) == 1 or opts in checked:
            return res, checked, made, lines
        tick(f"checking dp's plan: the whole model compiled with {runs_text(opts)}")
        made[opts], step = measure(res.plan)
        checked[opts] = chain.persistent_bytes + max(step.fwd_peak_bytes, step.bwd_peak_bytes)
        predicted = whole_peak(chain, res.plan)
        if STORE in opts:
            margin = max(margin, checked[opts] - predicted)
        else:
            region_margin = max(region_margin, checked[opts] - predicted)
        lines.append(f"{runs_text(opts)}: predicted {predicted:,} B, measured {checked[opts]:,} B"
                     + (" (over the budget)" if budget_bytes is not None and checked[opts] > budget_bytes else ""))
    return plan_whole(chain, budget_bytes, checked, only_measured=True), checked, made, lines


def runs_text(options) -> str:
    """Layers' options as runs: ``0-11 store, 12-23 sac-compute``."""
    out, start = [], 0
    for i in range(1, len(options) + 1):
        if i == len(options) or options[i] != options[start]:
            out.append(f"{start}{'' if i - 1 == start else f'-{i - 1}'} {options[start]}")
            start = i
    return ", ".join(out)


@dataclass(frozen=True)
class Mincut:
    """The partitioner's own min-cut over every stored layer, at the budget that fitted: the plan
    (``params["partitioner_budget"]``), its measured peak (persistent and the optimizer step
    included), its step (its forward+backward time paired with the stored step's) and its
    compiled copy."""

    plan: Plan
    peak_bytes: int
    step: WholeStep
    overhead: float  # its time beyond the stored step's, as a share of the no-checkpoint plan's step
    copy: CompiledModel = field(compare=False)


TRIES = 3  # partitioner budgets compiled and measured in search of one that fits


def mincut_search(chain, budget_bytes: int | None, store: WholeStep, measure, timed,
                  tick) -> tuple[Mincut | None, list[str]]:
    """Every layer stored, the whole graph left to the partitioner's min-cut at
    ``activation_memory_budget`` b: b starts at the share of the stored step's activations the
    budget leaves (what the ``torch-compile`` peer runs), is measured, and where the step peaks
    over the budget is lowered by the share it missed by, up to :data:`TRIES` budgets (fewer where a
    lower budget took the peak less than a quarter of the way to the budget).
    ``measure(plan) -> (CompiledModel, WholeStep)``; ``timed(copy) -> ms`` (paired with the stored
    step). The result is None where the stored step fits already, with no budget, or when no budget
    tried fits; the lines say what each budget tried measured."""
    if budget_bytes is None:
        return None, []
    p = chain.persistent_bytes
    stored = whole_peak(chain, option_plan([STORE] * chain.n_layers),
                        {(STORE,) * chain.n_layers: p + max(store.fwd_peak_bytes, store.bwd_peak_bytes)})
    if stored <= budget_bytes:
        return None, []
    b = budget_fraction(budget_bytes, p, stored)
    lines: list[str] = []
    last = stored
    for _ in range(TRIES):
        if b <= 0.0:
            break
        b = math.floor(b * 1000 + 1e-6) / 1000  # down: a budget shown with three digits is the one run
        plan = Plan("dp", chain.n_layers, option_plan([STORE] * chain.n_layers).items, {PARTITIONER_BUDGET: b})
        tick(f"compiling the whole model: every layer stored, the partitioner at budget {b:.3f}")
        cm, step = measure(plan)
        peak = whole_peak(chain, plan, {plan.options(): p + max(step.fwd_peak_bytes, step.bwd_peak_bytes)})
        fits = peak <= budget_bytes
        lines.append(f"partitioner budget {b:.3f}: measured {peak:,} B" + ("" if fits else " (over the budget)"))
        if fits:
            ms = timed(cm)
            overhead = (ms - store.fwd_bwd_ms) / simulate(chain, plan_none(chain.n_layers)).step_ms
            lines.append(f"its step {ms:.1f} ms against the stored step's {store.fwd_bwd_ms:.1f} ms")
            return Mincut(plan, peak, replace(step, fwd_bwd_ms=ms), overhead, cm), lines
        if last - peak < (last - budget_bytes) / 4:  # the partitioner barely moves: more tries will not fit
            break
        last = peak
        b *= (budget_bytes - p) / max(1, peak - p)
    return None, lines


def dp_choice(chain, budget_bytes: int | None, measure, tick, mincut=None):
    """dp under a whole-model compile: the checked plan of regions (:func:`checked_plan`) and,
    with ``mincut`` (``() -> (Mincut | None, lines)``, :func:`mincut_search` bound), the
    partitioner's min-cut, taken where it fits and its measured overhead is below the region plan's
    predicted one (or no region plan fits). Returns ``(result, checked, copies, lines, mincut)``:
    ``result`` None when the min-cut was taken for want of a region plan; ``mincut`` None when it
    was not taken. Raises the region plan's InfeasibleBudgetError when neither fits."""
    try:
        res, checked, copies, lines = checked_plan(chain, budget_bytes, measure, tick)
    except InfeasibleBudgetError as err:
        mc, mc_lines = mincut() if mincut is not None else (None, [])
        if mc is None:
            if mc_lines:
                err.message = f"{err.message}; torch.compile's own min-cut did not fit either ({'; '.join(mc_lines)})"
                err.args = (f"{err.message}. Tip: {err.tip}" if err.tip else err.message,)
            raise err from None
        return None, {}, {}, mc_lines, mc
    if mincut is None:
        return res, checked, copies, lines, None
    mc, mc_lines = mincut()
    region = simulate(chain, res.plan).overhead
    taken = mc is not None and mc.overhead < region
    if mc is not None:
        mc_lines.append(f"{'taken' if taken else 'not taken'}: {mc.overhead:+.1%} against the region plan's "
                        f"{region:+.1%} predicted")
    return res, checked, copies, lines + mc_lines, mc if taken else None
