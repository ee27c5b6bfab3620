"""``--compile-scope model``: ckplan's rows as checkpoint regions inside one whole-model
``torch.compile`` (:mod:`ckplan.whole_compile`), planned on a chain built from the compiled
layers' profile and one measured whole-model step per choice a layer has
(:mod:`ckplan.profiling.whole_steps`, :mod:`ckplan.planner.whole`).

The uniform steps' compiled copies are reused by the rows that run the same plan (``none``: every
layer stored). ``dp`` is :func:`ckplan.planner.regions.plan_regions` over one region per layer
(stored, a SAC option, or recomputed whole: the option ``full-region``), the optimum in that
space; the other strategies plan as they do eagerly and run where their plan has one region per
layer (``every-k`` with ``--k 1``, ``selective``). Rows report plans in the plain form
(``Checkpoint(i, i + 1)`` for a layer recomputed whole), which ``ckplan.compiled_model`` runs.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from ..bench_records import ERROR, INFEASIBLE
from ..errors import InfeasibleBudgetError, SpecError, UsageError
from ..planner import Plan, held_for_backward_bytes, plan_chain, simulate
from ..planner.plan import STORE
from ..planner.simulate import forward_backward_peak
from ..planner.whole import FULL, option_plan, plain_plan, whole_model_chain, whole_peak
from ..profiling.whole_steps import whole_steps
from ..units import format_bytes
from ..whole_choice import dp_choice
from ..whole_compile import CompiledModel, partitioner_budget, region_options
from .entry import Entry
from .plans import peer_row

SCOPE_NOTE = ("--compile-scope model: ckplan's rows ran as one whole-model torch.compile each (TorchInductor), "
              "every chain layer a checkpoint region (stored, a selective option's SAC tags, or recomputed "
              "whole), predicted from the compiled layers' profile and one measured whole-model step per "
              "choice (every layer stored, recomputed, or with one option: their saved bytes per layer, "
              "times, the loss head and the end of the backward); peers ran as they are")


def whole_chain(model, batch, loss_fn, profile, device: torch.device, chain, tick):
    """The whole-model compiled chain, the compiled copies of its uniform steps and the steps, by
    choice. Dynamo's cache starts fresh here (graphs from earlier benches must not fill its per-code
    limit) and is kept after: a copy run by a row must be the graph that was measured, not a recompile."""
    torch._dynamo.reset()
    steps, made = whole_steps(model, batch, loss_fn, profile, device, chain, tick)
    return whole_model_chain(chain, steps), made, steps


def steps_note(steps: dict) -> str:
    """The measured whole-model steps the chain was fitted to, for the bench's notes."""
    parts = [f"{name}: held {format_bytes(st.held_bytes)}, peak "
             f"{format_bytes(max(st.fwd_peak_bytes, st.bwd_peak_bytes))}, {st.fwd_bwd_ms:.0f} ms"
             for name, st in steps.items()]
    return ("whole-model steps the chain was fitted to (every layer stored, recomputed whole or with one option; "
            "forward+backward, bytes above the persistent ones, time from interleaved rounds): " + "; ".join(parts))


def whole_entries(chain, strategies: list[str], budget_bytes: int | None, k: int, model, profile,
                  made: dict, extra_plans: dict[str, Plan], measure, tick, mincut=None) -> list[Entry]:
    """The rows under ``--compile-scope model``: ckplan's strategies and the given plans as
    whole-model compiled copies (``dp``: the one-region-per-layer plan with the least recompute
    that fits, a mixed one measured before it is taken, or the partitioner's min-cut where that
    measured faster: :func:`dp_choice`), peers as usual. ``measure(plan)``: that plan's compiled
    copy and measured step; ``mincut``: :func:`ckplan.whole_choice.mincut_search` bound."""
    entries: list[Entry] = []
    checked: dict[tuple[str, ...], int] = {}
    lines: list[str] = []
    for s in [*strategies, *extra_plans]:
        peer = peer_row(chain, s)
        if peer is not None:
            entries.append(peer)
            continue
        try:
            if s == "dp":
                res, checked, copies, lines, mc = dp_choice(chain, budget_bytes, measure, tick, mincut)
                if mc is not None:
                    entries.append(mincut_entry(chain, mc, lines))
                    continue
                made = {**made, **copies}
                plan = res.plan
            else:
                plan = extra_plans[s] if s in extra_plans else _plan(chain, s, budget_bytes, k)
                if partitioner_budget(plan) < 1.0:
                    entries.append(given_mincut_entry(chain, s, plan, measure))
                    continue
            opts = tuple(FULL if o == "full" else o for o in region_options(plan))
            plan = option_plan(opts, plan.strategy)
        except InfeasibleBudgetError as err:
            entries.append(Entry(s, None, status=INFEASIBLE, message=err.message))
            continue
        except (SpecError, UsageError) as err:
            entries.append(Entry(s, None, status=ERROR, message=f"{err.message} ({err.tip})"))
            continue
        sc = simulate(chain, plan)
        own = checked.get(opts)  # its own step, measured while dp planned
        fwd_bwd = forward_backward_peak(chain, plan) if own is None else own
        e = Entry(s, plain_plan(plan), whole_peak(chain, plan, checked), fwd_bwd, held_for_backward_bytes(chain, plan),
                  sc.overhead)
        uniform = opts[0] if len(set(opts)) == 1 else ""
        e.compiled = made.get(uniform) or made.get(opts) or CompiledModel(model, plan, profile.chain)
        e.message = "whole-model torch.compile, one checkpoint region per layer" + (
            "; its peak predicted from its own compiled step, measured while planning" if own is not None else "")
        if s == "dp" and lines:
            e.message += f"; plans measured before choosing: {'; '.join(lines)}"
        entries.append(e)
    return entries


def mincut_entry(chain, mc, lines: list[str]) -> Entry:
    """dp's row when the partitioner's min-cut was taken: its peak and time as measured while planning."""
    p = chain.persistent_bytes
    e = Entry("dp", mc.plan, mc.peak_bytes, p + max(mc.step.fwd_peak_bytes, mc.step.bwd_peak_bytes),
              mc.step.held_bytes, mc.overhead)
    e.compiled = mc.copy
    b = partitioner_budget(mc.plan)
    e.message = (f"whole-model torch.compile, every layer stored and left to the partitioner's min-cut at "
                 f"activation_memory_budget {b:.3f} (faster than the best plan of regions); its peak and time "
                 f"measured while planning: {'; '.join(lines)}")
    return e


def given_mincut_entry(chain, name: str, plan: Plan, measure) -> Entry:
    """A given plan with a partitioner budget: its peak from its own step, measured here."""
    opts = region_options(plan)
    if any(o != STORE for o in opts):
        raise UsageError(f"plan {name!r} gives the partitioner a budget and has regions too",
                         tip="a plan with partitioner_budget stores every layer (ckplan plan --compile-scope model "
                             "writes it so)")
    cm, step = measure(plan)
    p = chain.persistent_bytes
    peak = whole_peak(chain, plan, {plan.options(): p + max(step.fwd_peak_bytes, step.bwd_peak_bytes)})
    e = Entry(name, plan, peak, p + max(step.fwd_peak_bytes, step.bwd_peak_bytes), step.held_bytes, None)
    e.compiled = cm
    e.message = (f"whole-model torch.compile, every layer left to the partitioner's min-cut at "
                 f"activation_memory_budget {partitioner_budget(plan):.3f}; its peak from its own step, measured here")
    return e


def _plan(chain, strategy: str, budget_bytes: int | None, k: int) -> Plan:
    if strategy == "every-k" and k != 1:
        raise UsageError(f"every-k with k={k} checkpoints {k} layers together; a whole-model torch.compile runs "
                         "one checkpoint region per layer", tip="use --k 1, or --compile-scope layers")
    # the other strategies plan as they do eagerly (selective: one SAC option on every layer)
    eager_like = replace(chain, layers=tuple(replace(ly, options=tuple(o for o in ly.options if o.name != FULL))
                                             for ly in chain.layers))
    return plan_chain(eager_like, strategy, budget_bytes, k).plan
