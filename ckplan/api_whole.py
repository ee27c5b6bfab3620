"""``ckplan plan --compile-scope model``: the optimal plan of one checkpoint region per chain layer
for a whole-model ``torch.compile`` (:mod:`ckplan.whole_compile`), from the spec's compiled
profile and one measured whole-model step per choice a layer has (:mod:`ckplan.profiling.whole_steps`;
dp's choice checked by measurement: :mod:`ckplan.whole_choice`).

The plan is written in the plain form (``Checkpoint(i, i + 1)`` for a layer recomputed whole); run
it with ``ckplan.compiled_model(model, "plan.json")``, or check it with ``ckplan bench
--compile-scope model --plan plan.json``.
"""
from __future__ import annotations

import functools
from dataclasses import replace

import torch

from .api_profile import profile, resolve_device
from .arguments import Note, Progress, tick
from .errors import InfeasibleBudgetError, UsageError
from .plan_report import PlanReport
from .planner import PlanResult, chain_from_profile, parse_budget, plan_none, simulate
from .planner.plan import STORE
from .planner.whole import plain_plan, whole_model_chain
from .profiling.whole_steps import measure_whole, pair_timer, whole_steps
from .sac import POLICIES
from .spec import Spec, build_model, make_batch, to_loss
from .whole_choice import dp_choice, mincut_search
from .whole_compile import PARTITIONER_BUDGET

NOTE = ("planned for a whole-model torch.compile, one checkpoint region per chain layer: run it with "
        "`ckplan.compiled_model(model, plan)` (a compiled copy sharing the model's parameters)")


def plan_spec_whole(spec: Spec, *, budget, strategy: str, device, force: bool, progress: Progress | None,
                    note: Note | None, options) -> PlanReport:
    """Profile ``spec`` compiled, measure its whole-model steps, and plan ``dp`` in that space."""
    if strategy != "dp":
        raise UsageError(f"--compile-scope model plans dp only, not {strategy!r}",
                         tip="drop --strategy, or compare strategies with `ckplan bench --compile-scope model`")
    dev = resolve_device(device)
    if dev.type == "meta":
        raise UsageError("--compile-scope model measures whole-model compiled steps, which meta cannot run",
                         tip="plan on --device cpu or cuda")
    prof = profile(spec, device=dev.type, force=force, progress=progress, note=note,
                   options=[o for o in POLICIES] if options else False, compile=True)
    model = build_model(spec, str(dev))
    batch = make_batch(spec, str(dev))
    chain = chain_from_profile(prof, keep=POLICIES)
    torch._dynamo.reset()
    steps, made = whole_steps(model, batch, to_loss, prof, dev, chain, lambda m: tick(progress, m))
    chain = whole_model_chain(chain, steps)
    none = simulate(chain, plan_none(chain.n_layers))
    if budget is None:
        budget_bytes, source = None, "none given: planned for the smallest peak of one region per layer"
    else:
        b = parse_budget(budget, chain, what="budget")
        budget_bytes, source = b.bytes, f"--budget: {b.description}"
    tick(progress, f"planning dp for {prof.model} (whole-model compile)")
    measure = functools.partial(measure_whole, model, batch, to_loss, prof, dev)
    ticks = functools.partial(tick, progress)
    timed = pair_timer(model, batch, to_loss, prof, dev, made[STORE], steps[STORE].fwd_bwd_ms)
    mincut = functools.partial(mincut_search, chain, budget_bytes, steps[STORE], measure, timed, ticks)
    try:
        res, checked, _, lines, mc = dp_choice(chain, budget_bytes, measure, ticks, mincut)
    except InfeasibleBudgetError as err:
        err.budget_source = source
        raise
    if mc is not None:
        chosen = _mincut_result(chain, mc, budget_bytes, lines)
    else:
        budget_bytes = budget_bytes if budget_bytes is not None else res.peak_bytes
        score = simulate(chain, res.plan)
        if res.plan.options() in checked:  # its peak: its own compiled step's, measured while planning
            score = replace(score, peak_bytes=res.peak_bytes)
        notes = ["one checkpoint region per layer (whole-model compile)"]
        if lines:
            notes.append(f"plans compiled and measured while planning: {'; '.join(lines)}; the chosen plan's peak "
                         + ("is its measured one" if res.plan.options() in checked else "is its uniform step's"))
        chosen = PlanResult("dp", plain_plan(res.plan), score, budget_bytes, res.peak_bytes <= budget_bytes,
                            exact=res.exact, notes=tuple(notes))
    return PlanReport(profile=prof, budget_bytes=budget_bytes, budget_source=source, strategy="dp", k=1,
                      results=(chosen,), chosen=chosen, none_peak_bytes=none.peak_bytes,
                      none_step_ms=none.step_ms, notes=(NOTE,))


def _mincut_result(chain, mc, budget_bytes: int, lines: list[str]) -> PlanResult:
    """dp's result when the partitioner's min-cut over every stored layer was taken: its peak and
    time as measured while planning."""
    base = simulate(chain, plan_none(chain.n_layers))
    score = replace(base, peak_bytes=mc.peak_bytes, overhead=mc.overhead, recompute_ms=base.step_ms * mc.overhead,
                    step_ms=base.step_ms * (1 + mc.overhead), peak_at="its own measured step")
    note = ("every layer stored and left to torch.compile's min-cut at activation_memory_budget "
            f"{mc.plan.params[PARTITIONER_BUDGET]:.3f} (the plan's params; faster than the best plan of regions): "
            + "; ".join(lines))
    return PlanResult("dp", mc.plan, score, budget_bytes, mc.peak_bytes <= budget_bytes, exact=False, notes=(note,))
