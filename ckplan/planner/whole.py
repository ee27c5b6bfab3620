"""The chain of a whole-model compiled step, each chain layer a checkpoint region
(:mod:`ckplan.compiled_model`), from the compiled layers' profile and measured whole-model steps.

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
  that step; then each option's backward transient (its forward's, where that step peaked in its
  forward) raised in every layer, where needed, so that the plan storing every layer with it peaks
  no lower than its step.

Every other plan's peak and time are predictions.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from ..errors import InfeasibleBudgetError
from ..options import SAC_POLICIES
from ..units import format_bytes
from .baselines import plan_none
from .budget import held_for_backward_bytes
from .chain import Chain
from .layer import Option
from .plan import Checkpoint, Plan, Store
from .regions import RegionsResult, plan_regions, scored_frontier
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
    raise AssertionError(f"no {op} event of stage {stage}")


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
    for name, step in steps.items():  # each uniform step peaks no lower than measured
        if name != "store":
            out = _raise_option(out, name, p + max(step.fwd_peak_bytes, step.bwd_peak_bytes),
                                backward=step.bwd_peak_bytes >= step.fwd_peak_bytes)
    return out


def _raise_option(chain: Chain, name: str, want: int, backward: bool) -> Chain:
    """Raise option ``name``'s backward (or forward) transient in every layer by what the plan
    storing every layer with it falls short of ``want`` (the measured peak, persistent included)."""
    short = want - simulate(chain, option_plan([name] * chain.n_layers)).peak_bytes
    if short <= 0:
        return chain

    def up(o: Option) -> Option:
        if o.name != name:
            return o
        return replace(o, bwd_tmp_bytes=o.bwd_tmp_bytes + short) if backward else \
            replace(o, fwd_tmp_bytes=o.fwd_tmp_bytes + short)
    return replace(chain, layers=tuple(replace(ly, options=tuple(up(o) for o in ly.options)) for ly in chain.layers))


def plan_whole(chain: Chain, budget_bytes: int | None) -> RegionsResult:
    """dp for a whole-model compiled chain: the optimal plan of one region per layer (options
    ``WHOLE_OPTIONS``) at ``budget_bytes`` (None: the smallest peak); InfeasibleBudgetError, with
    that smallest peak, when none fits."""
    points, _ = scored_frontier(chain, WHOLE_OPTIONS, checkpoints=False)
    lowest = min(p[0] for p in points)
    target = lowest if budget_bytes is None else budget_bytes
    res = plan_regions(chain, target, allowed=WHOLE_OPTIONS, checkpoints=False, strategy="dp")
    if res is None:
        raise InfeasibleBudgetError(
            f"no plan of one checkpoint region per chain layer peaks at {format_bytes(target)} or less: the "
            f"least such a plan reaches is {format_bytes(lowest)}", budget_bytes=target, min_peak_bytes=lowest,
            persistent_bytes=chain.persistent_bytes,
            tip=f"raise --budget to {format_bytes(lowest)} or more, or use --compile-scope layers (nested "
                "checkpoints reach lower)")
    return res
