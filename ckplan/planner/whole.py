"""The chain of a whole-model compiled step, each chain layer a checkpoint region
(:mod:`ckplan.whole_compile`), from the compiled layers' profile and measured whole-model steps.

A ``--compile`` profile measures each chain layer compiled on its own, with the embeddings and the
loss head eager. Compiled whole, the graph fuses the head as well (the cross-entropy keeps no
log-softmax), the end of the backward runs as one graph with the embeddings', and a layer
recomputed whole in a region of its own saves what the partitioner chooses, not only its input
(gpt2-small on CPU: its input and one more hidden-state-sized tensor). Whole-model steps are
measured (:class:`WholeStep`) per choice a layer has: every layer stored (``none``), every layer
recomputed whole (``full-region``), every layer with one selective option; what each partitioned
graph saves is read per layer (:class:`ckplan.measure.compiled_graph.SavedForBackward`).
:func:`whole_model_chain` then gives

* each layer's stored bytes (``xbar``) as the ``none`` graph saves them (where the graph's nodes
  name no chain layer, the profile's bytes, and the difference lands on the head below);
* each option's bytes as its graph saves them, its recompute time what its step took beyond the
  ``none`` step shared by the layers' forward times, its transients the profiled ones shifted by
  the change in what it keeps; and a selective option named ``full-region`` (the layer recomputed
  whole), with the stored layer's transients shifted likewise. A plan stores a layer so
  (``Store(i, "full-region")``) where an eager plan has ``Checkpoint(i, i + 1)``;
* the *post* stage (the loss head) fitted to the ``none`` step: its saved bytes so the step holds
  what was measured after its forward, its forward and backward transients so the simulator's
  ``none`` plan peaks where the step did;
* every stage's forward and backward time scaled by one factor so that the ``none`` plan takes
  what the ``none`` step took (the compiled layers, profiled one by one under hooks, add up to more
  or less than the whole graph);
* the *pre* stage's backward transient (the embeddings' backward, the end of the step's backward)
  raised, where needed, so the simulator's every-layer-``full-region`` plan peaks no lower than
  that step; then each option's bytes moved by one share per layer so that the plan storing every
  layer with it holds what its step held, and its backward transient (its forward's, where that
  step peaked in its forward) moved in every layer so that the plan peaks at its layers where its
  step peaked.

Every other plan's peak and time are predictions; a plan that mixes choices is checked by its own
measured step before dp takes it (:func:`ckplan.whole_choice.checked_plan`).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

from ..errors import InfeasibleBudgetError, PlannerBugError
from ..options import SAC_POLICIES
from ..units import format_bytes
from .baselines import plan_none
from .budget import held_for_backward_bytes
from .chain import Chain
from .layer import Option
from .plan import STORE, Checkpoint, Plan, Store
from .regions import RegionsResult, scored_frontier
from .simulate import simulate, trace

FULL = "full-region"  # a layer recomputed whole in a region of its own (not a Checkpoint item)
# What a layer's region can be besides stored: the SAC policies and full-region (no mincut-*, whose
# budget is the whole graph's, and no offload)
WHOLE_OPTIONS: tuple[str, ...] = (*SAC_POLICIES, FULL)


@dataclass(frozen=True)
class WholeStep:
    """One whole-model compiled forward+backward, in bytes above what was live when it began (the
    persistent bytes): held after the forward (the loss included), the peak up to the end of the
    forward and from there to the end of the backward; ``layer_saved``: per chain layer, the bytes
    its ops made that the partitioned forward graph saves for the backward (empty: not read)."""

    held_bytes: int
    fwd_peak_bytes: int
    bwd_peak_bytes: int
    fwd_bwd_ms: float = 0.0  # its forward+backward time (no optimizer step); 0: not timed
    layer_saved: tuple[int, ...] = ()


def option_plan(options, strategy: str = "regions") -> Plan:
    """The plan storing layer ``i`` with ``options[i]`` (``store``, ``sac-*`` or ``full-region``),
    as a whole-model compiled chain scores it."""
    return Plan(strategy, len(options), tuple(Store(i, o) for i, o in enumerate(options)))


def plain_plan(plan: Plan) -> Plan:
    """``plan`` with each ``full-region`` layer as ``Checkpoint(i, i + 1)``: the plan a plan file,
    ``ckplan.compiled_model`` and ``ckplan.apply_plan`` take."""
    items = tuple(Checkpoint(it.layer, it.layer + 1, (Store(it.layer),))
                  if isinstance(it, Store) and it.option == FULL else it for it in plan.items)
    return Plan(plan.strategy, plan.n_layers, items, dict(plan.params))


def _share(chain: Chain, extra_ms: float) -> list[float]:
    """``extra_ms`` shared by the layers' forward times."""
    fwd = [ly.fwd_ms for ly in chain.layers]
    total = sum(fwd)
    return [max(0.0, extra_ms) * f / total if total > 0 else 0.0 for f in fwd]


def _with_option(ly, name: str, saved: int, recompute_ms: float):
    """``ly`` with option ``name`` as the whole-model step ran it: ``saved`` bytes kept, its
    transients the measured option's (or, for ``full-region``, the stored layer's) shifted by what
    it keeps less."""
    old = next((o for o in ly.options if o.name == name), None)
    saved = max(saved, ly.x_bytes)  # the chain counts a layer's output with it (Chain checks xbar >= x)
    if old is None:
        drop = max(0, ly.xbar_bytes - saved)
        new = Option(name, saved, recompute_ms, ly.fwd_tmp_bytes + drop, ly.bwd_tmp_bytes + drop)
    else:
        shift = old.xbar_bytes - saved
        new = replace(old, xbar_bytes=saved, recompute_ms=recompute_ms,
                      fwd_tmp_bytes=max(0, old.fwd_tmp_bytes + shift), bwd_tmp_bytes=max(0, old.bwd_tmp_bytes + shift))
    return replace(ly, options=(*(o for o in ly.options if o.name != name), new))


def _scaled_to(chain: Chain, fwd_bwd_ms: float) -> Chain:
    """The stages' forward and backward times scaled by one factor so that a step without
    checkpointing takes ``fwd_bwd_ms`` (0: unchanged); the options' recompute times, measured on
    whole-model steps, stay."""
    total = chain.pre.fwd_ms + chain.pre.bwd_ms + chain.post.fwd_ms + chain.post.bwd_ms + sum(
        ly.fwd_ms + ly.bwd_ms for ly in chain.layers)
    if fwd_bwd_ms <= 0 or total <= 0:
        return chain
    f = fwd_bwd_ms / total
    return replace(chain, pre=replace(chain.pre, fwd_ms=chain.pre.fwd_ms * f, bwd_ms=chain.pre.bwd_ms * f),
                   post=replace(chain.post, fwd_ms=chain.post.fwd_ms * f, bwd_ms=chain.post.bwd_ms * f),
                   layers=tuple(replace(ly, fwd_ms=ly.fwd_ms * f, bwd_ms=ly.bwd_ms * f, tail_ms=ly.tail_ms * f)
                                for ly in chain.layers))


def _stage_live(chain: Chain, plan: Plan, stage: int, op: str) -> int:
    for ev in trace(chain, plan):
        if ev.stage == stage and ev.op == op:
            return ev.live_bytes
    raise PlannerBugError(f"no {op} event of stage {stage}")


def _readable(step: WholeStep, n: int) -> bool:
    """Whether the step's graph gave every chain layer its saved bytes (a model whose layers Dynamo
    reaches under another module path than the chain's leaves them all to ``other``)."""
    return len(step.layer_saved) == n and all(s > 0 for s in step.layer_saved)


def _profiled_bytes(ly, name: str) -> int:
    """What the compiled layers' profile says option ``name`` keeps (``full-region``: the input a
    checkpoint keeps, counted as the layer's output)."""
    return next((o.xbar_bytes for o in ly.options if o.name == name), ly.x_bytes)


def whole_model_chain(chain: Chain, steps: dict[str, WholeStep]) -> Chain:
    """``chain`` as a whole-model compiled step runs it (the module docstring): ``steps`` maps
    ``store`` (required), ``full-region`` and selective options to the step with every layer so."""
    n = chain.n_layers
    none = steps["store"]
    if _readable(none, n):
        chain = replace(chain, layers=tuple(replace(ly, xbar_bytes=max(s, ly.x_bytes if ly.x_kept else 0))
                                            for ly, s in zip(chain.layers, none.layer_saved)))
    for name, step in steps.items():
        if name == "store":
            continue
        timed = none.fwd_bwd_ms > 0 and step.fwd_bwd_ms > 0
        redo = _share(chain, step.fwd_bwd_ms - none.fwd_bwd_ms) if timed else [
            max(0.0, ly.fwd_ms - ly.tail_ms) for ly in chain.layers]
        saved = step.layer_saved if _readable(step, n) else [_profiled_bytes(ly, name) for ly in chain.layers]
        chain = replace(chain, layers=tuple(_with_option(ly, name, s, r)
                                            for ly, s, r in zip(chain.layers, saved, redo)))
    p = chain.persistent_bytes
    stored = plan_none(n)
    held = held_for_backward_bytes(chain, stored)
    xbar = max(0, chain.post.xbar_bytes + none.held_bytes - held)
    base = replace(chain, post=replace(chain.post, xbar_bytes=xbar, fwd_tmp_bytes=0, bwd_tmp_bytes=0))
    post = replace(base.post, fwd_tmp_bytes=max(0, p + none.fwd_peak_bytes - _stage_live(base, stored, n, "F")),
                   bwd_tmp_bytes=max(0, p + none.bwd_peak_bytes - _stage_live(base, stored, n, "B")))
    out = _scaled_to(replace(base, post=post), none.fwd_bwd_ms)
    full = steps.get(FULL)
    if full is not None:
        every_full = option_plan([FULL] * n)
        want = p + max(full.fwd_peak_bytes, full.bwd_peak_bytes)
        if simulate(out, every_full).peak_bytes < want:
            need = want - _stage_live(out, every_full, -1, "B")
            if need > out.pre.bwd_tmp_bytes:
                out = replace(out, pre=replace(out.pre, bwd_tmp_bytes=need))
    for name, step in steps.items():  # each uniform step holds what it held, and peaks where it did
        if name != "store":
            out = _fit_held(out, name, step.held_bytes)
            top = p + max(step.fwd_peak_bytes, step.bwd_peak_bytes)
            backward = step.bwd_peak_bytes >= step.fwd_peak_bytes
            # the step's peak phase: its layers peak where it did; the other phase: no higher than
            # it did (a recomputed layer's forward is never priced above the measured peak)
            out = _fit_option(out, name, top, backward=backward)
            out = _fit_option(out, name, p + (step.fwd_peak_bytes if backward else step.bwd_peak_bytes),
                              backward=not backward, lower_only=True)
    return out


def _fit_held(chain: Chain, name: str, held: int) -> Chain:
    """Option ``name``'s bytes in every layer moved by one share of what the plan storing every
    layer with it holds after its forward less than ``held`` (measured): bytes its graph saves that
    name no chain layer (gpt at 3 x 64: 116 KiB per ``sac-attn`` region), and what the per-layer
    reading misses, so that the plan holds what its step held."""
    n = chain.n_layers
    diff = held - held_for_backward_bytes(chain, option_plan([name] * n))
    if diff == 0:
        return chain
    shares = [diff // n + (1 if i < diff % n else 0) for i in range(n)]

    def moved(ly, share: int):
        return replace(ly, options=tuple(replace(o, xbar_bytes=max(ly.x_bytes, o.xbar_bytes + share))
                                         if o.name == name else o for o in ly.options))
    return replace(chain, layers=tuple(moved(ly, s) for ly, s in zip(chain.layers, shares)))


def _fit_option(chain: Chain, name: str, want: int, backward: bool, lower_only: bool = False) -> Chain:
    """Move option ``name``'s backward (or forward) transient in every layer by what the plan
    storing every layer with it misses ``want`` (the measured peak, persistent included) by at its
    layers' highest backward (forward) op, so that the plan peaks at ``want`` there: up where the
    step peaked higher, down (to no transient at least) where it peaked lower (a compiled region's
    recompute and backward fuse); ``lower_only``: only down."""
    ops = ("B",) if backward else ("F", "Fn")
    top = max(ev.peak_bytes for ev in trace(chain, option_plan([name] * chain.n_layers))
              if ev.op in ops and ev.stage is not None and 0 <= ev.stage < chain.n_layers and not ev.recompute)
    short = want - top
    if short == 0 or (lower_only and short > 0):
        return chain

    def moved(o: Option) -> Option:
        if o.name != name:
            return o
        return replace(o, bwd_tmp_bytes=max(0, o.bwd_tmp_bytes + short)) if backward else \
            replace(o, fwd_tmp_bytes=max(0, o.fwd_tmp_bytes + short))
    return replace(chain, layers=tuple(replace(ly, options=tuple(moved(o) for o in ly.options)) for ly in chain.layers))


def whole_peak(chain: Chain, plan: Plan, checked: Mapping[tuple[str, ...], int] | None = None) -> int:
    """``plan``'s peak: the simulator's, or for a plan in ``checked`` (its layers' options -> its
    own whole-model step's measured forward+backward peak, persistent included) that measured peak,
    with the simulator's optimizer step."""
    opts = plan.options()
    if not checked or opts not in checked:
        return simulate(chain, plan).peak_bytes
    opt_step = max((ev.peak_bytes for ev in trace(chain, plan) if ev.op == "opt"), default=0)
    return max(checked[opts], opt_step)


def plan_whole(chain: Chain, budget_bytes: int | None, checked: Mapping[tuple[str, ...], int] | None = None,
               *, only_measured: bool = False, margin: int = 0, region_margin: int = 0) -> RegionsResult:
    """dp for a whole-model compiled chain: the plan of one region per layer (options
    ``WHOLE_OPTIONS``) with the least recompute at ``budget_bytes`` (None: the smallest peak), each
    candidate's peak :func:`whole_peak`'s; ``only_measured``: among the plans whose peak was
    measured (one choice on every layer, or in ``checked``); ``margin``: bytes added to the peak of
    every plan that mixes choices with a stored layer and was not measured (``region_margin``: one
    that mixes regions only). InfeasibleBudgetError, with that
    smallest peak, when none fits. ``exact`` (optimal in the space): the frontier was not merged and
    no check moved a candidate's peak."""
    points, exact = scored_frontier(chain, WHOLE_OPTIONS, checkpoints=False)
    scored = []
    for peak, t, opts in points:
        if checked and opts in checked:
            true = whole_peak(chain, option_plan(opts), checked)
            exact = exact and true == peak
            peak = true
        elif len(set(opts)) > 1:
            peak += margin if STORE in opts else region_margin
        if not only_measured or len(set(opts)) == 1 or (checked and opts in checked):
            scored.append((peak, t, opts))
    lowest = min(p[0] for p in scored)
    target = lowest if budget_bytes is None else budget_bytes
    fits = [p for p in scored if p[0] <= target]
    if not fits:
        raise InfeasibleBudgetError(
            f"no plan of one checkpoint region per chain layer peaks at {format_bytes(target)} or less: the "
            f"least such a plan reaches is {format_bytes(lowest)}", budget_bytes=target, min_peak_bytes=lowest,
            persistent_bytes=chain.persistent_bytes,
            tip=f"raise --budget to {format_bytes(lowest)} or more, or use --compile-scope layers (nested "
                "checkpoints reach lower)")
    peak, _, opts = min(fits, key=lambda p: (p[1], p[0]))
    return RegionsResult(option_plan(opts, "dp"), peak, exact)
