"""The one simulator: replay any plan op by op and report its peak memory and recompute time.

Modelled on rotor's ``simulate_sequence`` (Beaumont et al. 2019/2021, "Optimal checkpointing for
heterogeneous chains"). ``mem`` is the live bytes; every op has *live* bytes (``mem`` plus what the
op allocates for good) and a *transient* on top; the op's peak is
``max(live + transient, mem after the op)``, and the plan's peak is the largest op peak.

The replay and its memory model are ``replay.py``; this module scores plans (``simulate``,
``peak_of``), labels the ops (``trace``) and checks a plan fits its chain.

Known limitations: a boundary is one size (rotor's model has one tensor; a layer handing the next
several gets their sum, with the first one's flags); allocator fragmentation, caching and
the CUDA context are outside the model; ``xbar >= x`` assumes a stored layer keeps its output.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import asdict, dataclass
from typing import Any

from ..errors import SpecError
from .chain import Chain
from .plan import RELEASE, STORE, Plan
from .plan_items import is_offloaded, kept_option
from .replay import PRE, Item, _replay
from .transfers import AUTO


@dataclass(frozen=True)
class Score:
    """What a plan costs under the simulator. Bytes are absolute (persistent memory included)."""

    peak_bytes: int
    peak_at: str  # the op that reaches the peak, e.g. "B(layer 7) during recompute of [4,8)"
    recompute_ms: float  # forward time spent again during backward
    step_ms: float  # predicted step time: one forward and backward of everything + recompute + transfer
    overhead: float  # (recompute_ms + transfer_ms) / step time of the plan without checkpointing
    persistent_bytes: int  # the part of the peak no plan can remove
    transfer_ms: float = 0.0  # offloaded layers' host copies not hidden behind compute (transfers.py)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class TraceEvent:
    """One op of the replay."""

    label: str
    op: str  # "F" forward keeping all, "Fn" forward keeping the output only, "B", "drop", "opt"
    stage: int | None  # -1 pre, 0..n-1 chain layers, n post, None for the optimizer step
    recompute: bool  # a forward run again inside a checkpoint's backward
    live_bytes: int  # mem during the op without its transient
    transient_bytes: int
    peak_bytes: int  # max(live + transient, mem after)
    mem_bytes: int  # mem after the op


def _label(op: str, stage: int | None, ctx: tuple[int, int] | None, n: int) -> str:
    if op == "opt":
        return "optimizer step"
    if op == "remade" and ctx is not None:
        return (f"side inputs made again by layer {stage} in the recompute of [{ctx[0]},{ctx[1]})"
                if stage is not None else f"recompute of [{ctx[0]},{ctx[1]}) over: its side inputs freed")
    if op == "offloaded":
        return f"layer {stage}'s copy to the host done: its saved tensors leave the device"
    if op == "fetch":
        return f"layer {stage}'s saved tensors copied back from the host"
    if op == "side":
        return "side inputs (masks, position ids) freed"
    if op == "unsaved":
        return "backward over: tensors checkpointed layers kept outside saved tensors freed"
    if op == "left" and ctx is not None:
        return (f"recompute of layer {stage} in [{ctx[0]},{ctx[1]}): what it leaves on the module, "
                "kept to the step's end")
    if op == "held" and ctx is not None:
        return f"backward of [{ctx[0]},{ctx[1]}) starts: its layers are held until their backward"
    if op == "uncast":
        return "end of forward: autocast copies of checkpointed layers freed"
    if op == "lead" and ctx is not None:
        return f"B(layer {stage}) up to its first saved tensor: recompute of [{ctx[0]},{ctx[1]}) starts"
    if op == "release" and ctx is not None:
        return f"boundary x[{stage}] of [{ctx[0]},{ctx[1]}) freed (nothing after it saves it)"
    if op in ("hold", "unhold") and ctx is not None:
        what = "x_in" if stage == PRE else f"x[{stage}]"
        return (f"[{ctx[0]},{ctx[1]}) keeps its input {what}" if op == "hold"
                else f"input {what} of [{ctx[0]},{ctx[1]}) freed")
    if stage == PRE:
        return "pre forward" if op == "F" else "pre backward"
    if stage == n:
        return "post forward (loss)" if op == "F" else "post backward"
    if op == "drop" and ctx is not None:
        return f"free boundary x[{stage}] of [{ctx[0]},{ctx[1]})"
    name = {"F": "F", "Fn": "F", "B": "B"}[op]
    text = f"{name}(layer {stage})"
    if op == "Fn":
        text += " output only"
    if ctx is not None:
        text += f" during recompute of [{ctx[0]},{ctx[1]})"
    return text


# The last few scores, by the identity of (chain, plan): both are frozen, and the planner scores
# the same plan object two or three times on its way out (1000 layers: ~20 ms each).
_RECENT: OrderedDict[tuple[int, int], tuple[Chain, Plan, Score]] = OrderedDict()
RECENT_SCORES = 16


def simulate(chain: Chain, plan: Plan) -> Score:
    """Peak memory and recompute time of ``plan`` on ``chain``."""
    key = (id(chain), id(plan))
    hit = _RECENT.get(key)
    if hit is not None and hit[0] is chain and hit[1] is plan:
        _RECENT.move_to_end(key)
        return hit[2]
    _check(chain, plan)
    score = simulate_items(chain, plan.items, plan.releases(), plan.fetches())
    _RECENT[key] = (chain, plan, score)  # holding both: their ids stay theirs
    if len(_RECENT) > RECENT_SCORES:
        _RECENT.popitem(last=False)
    return score


def simulate_items(chain: Chain, items: tuple[Item, ...], releases: dict[int, int] | str = AUTO,
                   fetches: dict[int, int] | None = None) -> Score:
    """``simulate`` for items already known to be a valid plan (brute force uses this); offloaded
    layers released where ``releases`` says, or where their copies are done (``AUTO``), and
    fetched where ``fetches`` says (default: at the next layer's backward)."""
    r = _replay(chain, items, releases=releases, fetches=fetches)
    base = chain.base_step_ms
    return Score(
        peak_bytes=r.peak_bytes,
        peak_at=_label(*r.peak_where, chain.n_layers),
        recompute_ms=r.recompute_ms,
        step_ms=base + r.recompute_ms + r.transfer_ms,
        overhead=(r.recompute_ms + r.transfer_ms) / base if base > 0 else 0.0,
        persistent_bytes=chain.persistent_bytes,
        transfer_ms=r.transfer_ms,
    )


def peak_of(chain: Chain, items: tuple[Item, ...]) -> tuple[int, float]:
    """(peak bytes, time added: recompute and host copies not hidden, ms) with no labels: the fast
    path for enumerations (offloaded layers released as ``AUTO``)."""
    r = _replay(chain, items)
    return r.peak_bytes, r.recompute_ms + r.transfer_ms


def with_releases(chain: Chain, plan: Plan) -> Plan:
    """``plan`` with its offloaded layers' release points written out as ``AUTO`` places them on
    ``chain`` (``transfers.py``): the points a device runs it with."""
    if not chain.can_offload or not any(is_offloaded(o) for o in plan.options()):
        return plan
    chosen = _replay(chain, plan.items, fetches=plan.fetches()).releases
    return Plan(plan.strategy, plan.n_layers, plan.items, {**plan.params, RELEASE: dict(sorted(chosen.items()))})


def trace(chain: Chain, plan: Plan) -> tuple[TraceEvent, ...]:
    """Every op of the replay with its live bytes and peak, for README examples and debugging."""
    _check(chain, plan)
    events: list[TraceEvent] = []
    n = chain.n_layers

    def on_op(op: str, stage: int | None, ctx: tuple[int, int] | None, again: bool, live: int,
              transient: int, after: int) -> None:
        events.append(TraceEvent(_label(op, stage, ctx, n), op, stage, again, live, transient,
                                 max(live + transient, after), after))

    _replay(chain, plan.items, on_op, plan.releases(), plan.fetches())
    return tuple(events)


def forward_backward_peak(chain: Chain, plan: Plan) -> int:
    """The simulated peak of forward and backward alone (the optimizer step left out): what one
    micro-batch's step reaches, as a profile measures it."""
    return max(ev.peak_bytes for ev in trace(chain, plan) if ev.op != "opt")


def _check(chain: Chain, plan: Plan) -> None:
    if plan.n_layers != chain.n_layers:
        raise SpecError(f"the plan is for {plan.n_layers} layers but the chain has {chain.n_layers}",
                        tip="re-plan for this model, or pass the profile the plan was made from")
    if chain.breaks:
        for r in plan.recomputed_ranges():
            cut = next((b for b in chain.breaks if r.start < b < r.stop), None)
            if cut is not None:
                raise SpecError(
                    f"the plan checkpoints layers {r.start}..{r.stop - 1} in one checkpoint, but layer "
                    f"{cut} does not receive layer {cut - 1}'s output (the model changes it between "
                    "the calls), so no checkpoint can span them",
                    tip=f"re-plan with ckplan (its plans are cut at layers {', '.join(map(str, chain.breaks))})")
    for i, name in enumerate(plan.options()):
        if is_offloaded(name) and not chain.can_offload:
            raise SpecError(f"the plan offloads layer {i} to host memory, but this profile has no "
                            "host link (profiled on a CPU, or on meta without a GPU target)",
                            tip="profile on the GPU that trains (or on meta with --target), or re-plan")
        name = kept_option(name)
        if name != STORE and all(o.name != name for o in chain.layers[i].options):
            known = ", ".join([STORE, *(o.name for o in chain.layers[i].options)])
            raise SpecError(f"the plan stores layer {i} with option {name!r}, which its profile does "
                            f"not have for that layer (it has: {known}; the profile's notes say why an "
                            "option is missing: one that cannot run on the layer, or none profiled)",
                            tip="use an option the profile has for the layer, or re-plan")
