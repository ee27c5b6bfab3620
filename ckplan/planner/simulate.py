"""The one simulator: replay any plan op by op and report its peak memory and recompute time.

Modelled on rotor's ``simulate_sequence`` (Beaumont et al. 2019/2021, "Optimal checkpointing for
heterogeneous chains"). ``mem`` is the live bytes; every op has *live* bytes (``mem`` plus what the
op allocates for good) and a *transient* on top; the op's peak is
``max(live + transient, mem after the op)``, and the plan's peak is the largest op peak.

Memory model, with ``x[i]`` the output of layer i, ``xbar[i]`` what storing it keeps (includes
``x[i]``), ``x[-1]`` the chain input (held by pre) and ``d[i]`` the gradient B(i) produces
(``x[i-1]``, or ``delta_in`` for i = 0):

* start: ``mem = persistent``. Pre forward: live ``mem + pre.retained``, transient ``pre.fwd_tmp``.
* ``Store(i)`` forward: live ``mem + xbar[i]``, transient ``fwd_tmp[i]``.
* ``Checkpoint[s, t)`` forward: its input belongs to the item before. For k = s..t-1: live
  ``mem + x[k]``, transient ``fwd_tmp[k]``; then ``x[k-1]`` is freed when k > s. What stays is the
  boundary ``x[t-1]``.
* mixed precision: a layer inside a *top-level* checkpoint also adds its ``cast[k]`` (autocast's
  weight copies) to ``mem`` in its forward; autocast's cache holds them until the forward ends,
  so they are freed right after the post forward, before any backward. A stored layer's copies
  are saved for backward and already in its ``xbar``; a recompute clears its cache when it ends,
  so there they are part of the layer's transient, as measured.
* post forward: live ``mem + post.xbar + post.loss``, transient ``post.fwd_tmp``; post
  backward: the loss's gradient seed (``post.loss`` bytes, what ``loss.backward()`` makes) is
  added, transient ``post.bwd_tmp``, then ``mem += x[n-1] + post.grad - post.xbar``: the chain
  output's gradient. The loss and its seed stay live until the pre backward has run, so every
  forward redone in the backward runs beside them (its transient was measured without them).
* ``Store(i)`` backward: transient ``bwd_tmp[i]``, then ``mem += d[i] + grad[i] - xbar[i] - x[i]``
  (its input gradient and parameter gradients appear, its saved tensors and incoming gradient go).
* ``Store(i)`` with a selective option (``chain.Option``): the same ops with the option's
  ``xbar``, ``fwd_tmp`` and ``bwd_tmp`` (the tensors it recomputes live inside that backward
  transient), and its ``recompute_ms`` counts as recompute, wherever the layer is stored.
* ``Checkpoint[s, t)`` backward: free the boundary ``x[t-1]``, then run ``inner`` as a sub-chain:
  all its forwards (these count as recompute), then all its backwards in reverse, exactly as at
  the top level except that there is no post: the gradient of ``x[t-1]`` is already live.
  PyTorch stops a recompute once the last tensor saved in the first forward is back (early
  stop): when ``inner`` ends with ``Store(t-1)`` (plain store), that layer's forward runs only up
  to its last saved tensor, live ``mem + early_xbar[t-1]``, transient ``early_fwd_tmp[t-1]``
  (``Layer.stop_*``; the whole forward when not measured); its backward then starts from
  ``mem + xbar[t-1]``, the level its measured transient was calibrated on.
* boundaries no op keeps (``Layer.x_kept`` / ``Pre.x_kept`` False: a Linear's output that only a
  ReLU reads, which saves its own output instead): ``xbar`` leaves the output out, so a stored
  layer frees it once the next stage has run (inside the next forward's measured transient). A
  checkpoint starting right after such a stored layer (or at layer 0 after such a pre), or a layer
  stored there with a selective option (its own SAC checkpoint), keeps it as its input: ``hold``
  adds it before that item's forward, ``unhold`` frees it after its backward. The measured forward
  transient of such a layer, and of the layer after it, holds that output (``xbar`` leaves it
  out): a forward that saves nothing (``Fn``) and the first layer of a recompute, where it is
  live already, take the transient without it. A checkpoint nested inside a recompute gets such
  an input (or the boundary of a checkpoint before it that nothing after saves) from the
  enclosing recompute, which hands it over once: it is freed when the nested checkpoint's own
  recompute is over (``unhold`` there), not after its backward. A checkpoint's own
  boundary ``x[t-1]`` of that kind is freed once read (``release``) when a layer stored with
  ``store`` (or post) comes next; so is one that only layer ``t-1``'s own ops save
  (``Layer.x_kept_next`` False: nothing inside a checkpoint saves), after that next stage's
  forward (which was measured with it live).
* side inputs (``chain.side_inputs``: masks and the like that pre makes for the layers, or a
  chain layer for layers after the next one): live from pre's forward; freed when the chain's
  forward ends, or, when a top-level item holds one of their layers (a checkpoint over it, or the
  layer stored with a selective option) and does not contain the layer that made them, after the
  backward of the first such item.
* side-input gradients (``SideInput.grad_bytes``: T5's position bias comes from a parameter):
  the autograd engine sums what the layers reading them send back, so they appear after the
  backward of the last such layer and go after the backward of their maker (a chain layer or
  pre); every recompute in between runs beside them. A recompute over the layer that makes a
  side input makes it again; the recompute's frame holds it until the recompute is over (from
  the maker's forward on: the first forward's measured transients count it as live there).
* tensors a layer keeps that no saved-tensor hook sees (``Layer.unsaved_kept_bytes``: a custom
  autograd Function's ``ctx`` attributes, a module cache): a checkpoint's first forward keeps
  them beside its output, until the backward is over (the graph's nodes hold them). A stored
  layer's are in its measured transients (calibration); a recompute's die with it (not counted).
* held layers (``Layer.held_bytes``; FSDP2 per rank keeps a unit forwarded during backward
  unsharded until its own backward, ``planner.parallel``): when the backward of a top-level
  checkpoint [s, t) starts (its boundary dropped), ``mem += held[s..t-1]``, and each goes after
  its layer's backward. There the layers' ops take their held transients (``Layer.held``): a
  forward in the recompute of a checkpoint [a, b) runs beside layer b's ``retained_bytes`` (what
  its backward left; a checkpoint's first forward inside a recompute beside the next layer's)
  and, unless it is layer b - 1, adds its ``gather_bytes``; the ops of layer s once its backward
  has begun (its backward; its recompute too when it is the checkpoint's only layer) add the
  ``gather_bytes`` of layer s - 1 (FSDP2's backward prefetch of the unit before).
* pre backward: transient ``pre.bwd_tmp``, then ``mem += pre.grad - pre.retained - delta_in``
  and the loss and its seed are freed;
  finally the optimizer step, whose absolute peak ``opt_step_peak`` is a constant of the chain.

Known limitations: a boundary is one size (rotor's model has one tensor; a layer handing the next
several gets their sum, with the first one's flags); allocator fragmentation, caching and
the CUDA context are outside the model; ``xbar >= x`` assumes a stored layer keeps its output.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any

from ..errors import SpecError
from .chain import Chain
from .plan import STORE, Checkpoint, Item, Plan, Store

PRE, OPT = -1, None


@dataclass(frozen=True)
class Score:
    """What a plan costs under the simulator. Bytes are absolute (persistent memory included)."""

    peak_bytes: int
    peak_at: str  # the op that reaches the peak, e.g. "B(layer 7) during recompute of [4,8)"
    recompute_ms: float  # forward time spent again during backward
    step_ms: float  # predicted step time: one forward and backward of everything + recompute
    overhead: float  # recompute_ms / step time of the plan without checkpointing
    persistent_bytes: int  # the part of the peak no plan can remove

    @property
    def activation_peak_bytes(self) -> int:
        return self.peak_bytes - self.persistent_bytes

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


# op callback: (op, stage, ctx, recompute, live, transient, mem_after)
_OnOp = Callable[[str, "int | None", "tuple[int, int] | None", bool, int, int, int], None]
_Where = tuple[str, "int | None", "tuple[int, int] | None"]  # (op, stage, ctx) for _label


@dataclass(frozen=True)
class _Replay:
    peak_bytes: int
    peak_where: _Where
    recompute_ms: float


def _replay(chain: Chain, items: tuple[Item, ...], on_op: _OnOp | None = None) -> _Replay:
    """Run the plan's ops in order, tracking the largest op peak (and calling ``on_op`` for
    each op when given, for traces)."""
    L = chain.layers
    n = len(L)
    mem = chain.persistent_bytes
    recompute_ms = 0.0
    peak = -1
    where: _Where = ("", None, None)

    def op(name: str, stage: int | None, ctx: tuple[int, int] | None, again: bool, live: int,
           transient: int, after: int) -> None:
        nonlocal peak, where
        p = max(live + transient, after)
        if p > peak:
            peak, where = p, (name, stage, ctx)
        if on_op is not None:
            on_op(name, stage, ctx, again, live, transient, after)

    pre, post = chain.pre, chain.post
    side_free, side_held = _side_releases(chain, items)
    grad_made, grad_gone = chain.side_grads_at()
    side_made: dict[int, int] = {}  # chain layer -> bytes of the side inputs it makes
    for si in chain.side_inputs:
        if si.made_by >= 0:
            side_made[si.made_by] = side_made.get(si.made_by, 0) + si.bytes
    live = mem + pre.retained_bytes + chain.side_bytes
    op("F", PRE, None, False, live, pre.fwd_tmp_bytes, live)
    mem = live
    casts = 0  # autocast copies of the top-level checkpointed layers, live until the forward ends
    unsaved = 0  # what checkpointed first forwards keep that no hook sees: until the backward ends
    late = 0  # what recomputes leave on their modules (Layer.recompute_kept_bytes): to the step's end
    left_by: set[int] = set()  # layers whose recompute has left it
    loose_of: dict[int, int] = {}  # layer -> its first forward's unsaved bytes, while counted
    released: dict[int, bool] = {}  # id(checkpoint) -> its boundary was released (_boundary_released)
    # id(checkpoint inside a recompute) -> bytes of its input freed once its own recompute is over
    handed_over: dict[int, int] = {}
    # a released boundary the next stage's forward still reads: (bytes, layer, span, again)
    pending: tuple[int, int, tuple[int, int], bool] | None = None

    def release_pending(mem: int) -> int:
        nonlocal pending
        assert pending is not None
        nbytes, layer, span, again = pending
        pending = None
        mem -= nbytes
        op("release", layer, span, again, mem, 0, mem)
        return mem
    copied: set[int] = set()  # in-place layers first in a recompute (Layer.in_place)
    # layers whose backward has begun and holds its lead (Layer.lead_bytes) beside a recompute
    leading: set[int] = set()
    # held layers (Layer.held_bytes) of the top-level checkpoint whose backward runs, its first
    # layer, and whether that layer's backward has begun (its prefetch of the layer before)
    held: set[int] = set()
    first: int | None = None
    first_begun = False

    def held_view(k: int, gather: bool, after: int = n):
        """Layer k as held (its held transients) when it is, else as it is; a forward runs
        beside what layer ``after``'s backward left."""
        if k not in held:
            return L[k]
        return L[k].held(gather, L[after].retained_bytes if after < n else 0)

    def prefetch(k: int) -> int:
        """The all-gather buffer of the layer before the top-level checkpoint, beside the ops of
        its first layer once that layer's backward has begun."""
        return L[k - 1].gather_bytes if k == first and first_begun and k > 0 else 0

    # Explicit stack (plans may nest deeper than Python's recursion limit).
    stack: list[tuple] = [("opt",), ("preB",), ("bwd", items, None), ("postB",), ("postF",),
                          ("fwd", items, None)]
    while stack:
        task = stack.pop()
        kind = task[0]
        if kind == "fwd":
            _, seq, ctx = task
            again = ctx is not None
            remade = 0  # side inputs this recompute makes again: its frame holds them to its end
            for idx, it in enumerate(seq):
                if again:
                    for k in range(*_span(it)):
                        if side_made.get(k):
                            remade += side_made[k]
                            mem += side_made[k]
                            op("remade", k, ctx, True, mem, 0, mem)
                        if (L[k].recompute_kept_bytes or L[k].recompute_chain_kept_bytes) and k not in left_by:
                            # What the recompute leaves on the module: the layer's own measure, or
                            # the whole chain's when a later layer of this recompute keeps its
                            # graph (what this one made stays too). A later recompute of it
                            # replaces it (counted once), and it replaces what the first forward
                            # kept on the module; the graph behind it also holds the layer's input,
                            # which its first op saved (counted, on the safe side).
                            end = ctx[1] if ctx is not None else k + 1
                            chained = any(L[j].recompute_kept_bytes for j in range(k + 1, end))
                            own = L[k].recompute_chain_kept_bytes if chained else L[k].recompute_kept_bytes
                            if not own:
                                continue
                            left_by.add(k)
                            gone = min(loose_of.pop(k, 0), own)
                            unsaved -= gone
                            kept = own + (L[k - 1].x_bytes if k > 0 else 0)
                            late += kept
                            mem += kept - gone
                            op("left", k, ctx, True, mem, 0, mem)
                hold = _input_hold(chain, seq, idx, ctx)
                if hold:  # its input, which no op of the plain forward keeps
                    mem += hold
                    op("hold", _span(it)[0] - 1, _span(it), again, mem, 0, mem)
                if isinstance(it, Store):
                    # held: ctx is the checkpoint whose recompute runs (again is True)
                    base = held_view(it.layer, ctx is not None and it.layer != ctx[1] - 1,
                                     ctx[1] if ctx is not None else n)
                    ly = base if it.option == STORE else base.option(it.option)
                    pf = prefetch(it.layer)
                    if again and idx == 0 and it.option == STORE and ly.in_place:
                        copied.add(id(it))  # a copy of the recompute's input: a new output
                        ly = replace(ly, xbar_bytes=ly.xbar_bytes + ly.x_bytes)
                    # first in an inner plan, its input is the checkpoint's, counted in mem: when
                    # no op keeps it, the measured transient (xbar leaves it out) holds it too
                    dup = chain.input_hold(it.layer) if again and idx == 0 and it.option == STORE else 0
                    if (again and idx == len(seq) - 1 and it.option == STORE and id(it) not in copied
                            and ly.early_xbar_bytes is not None):
                        # the recompute stops at the layer's last saved tensor (early stop)
                        live = mem + ly.stop_xbar_bytes
                        op("F", it.layer, ctx, again, live, max(0, ly.stop_fwd_tmp_bytes - dup) + pf, live)
                        # its backward's transient was measured with everything the layer keeps
                        # (its output included) counted as live: the backward starts from there
                        mem += ly.xbar_bytes
                    else:
                        live = mem + ly.xbar_bytes
                        op("F", it.layer, ctx, again, live, max(0, ly.fwd_tmp_bytes - dup) + pf, live)
                        mem = live
                    if pending is not None:
                        mem = release_pending(mem)
                    if again:
                        recompute_ms += ly.fwd_ms
                else:
                    for k in range(it.start, it.stop):
                        ly = held_view(k, ctx is not None and k != ctx[1] - 1, k + 1)
                        cast = 0 if again else ly.cast_bytes
                        casts += cast
                        loose = 0 if again else ly.unsaved_kept_bytes
                        unsaved += loose
                        if loose:
                            loose_of[k] = loose
                        live = mem + ly.x_bytes + cast + loose
                        after = live - L[k - 1].x_bytes if k > it.start else live
                        # outputs no op keeps (its own, the input's): the measured transient
                        # holds them (xbar leaves them out), and here live counts them already
                        own = 0 if ly.x_kept or ly.in_place else ly.x_bytes
                        tmp = ly.fn_tmp(max(0, ly.fwd_tmp_bytes - own - chain.input_hold(k)))
                        op("Fn", k, ctx, again, live, tmp, after)
                        mem = after
                        if again:
                            recompute_ms += ly.fwd_ms
                    if _boundary_released(chain, seq, idx, ctx):
                        if L[it.stop - 1].x_kept:
                            # only the layer's own ops save it in the plain forward, where the
                            # next stage's measured forward ran with it live: freed after that
                            pending = (L[it.stop - 1].x_bytes, it.stop - 1, (it.start, it.stop), again)
                        else:
                            mem -= L[it.stop - 1].x_bytes  # read by the next stage, saved by none
                            op("release", it.stop - 1, (it.start, it.stop), again, mem, 0, mem)
            if remade:
                mem -= remade
                op("remade", None, ctx, True, mem, 0, mem)
            if again and seq and isinstance(seq[-1], Store):
                # the recompute stops once the last saved tensor is back: the last layer's tail
                # is not redone (a sequence ending in a checkpoint does not get this)
                recompute_ms -= L[seq[-1].layer].tail_ms
        elif kind == "bwd":
            _, seq, ctx = task
            for idx, it in enumerate(seq):
                if isinstance(it, Checkpoint):
                    released[id(it)] = _boundary_released(chain, seq, idx, ctx)
                if ctx is None and side_held.get(idx):
                    stack.append(("side", idx))  # after this item's whole backward
                hold = _input_hold(chain, seq, idx, ctx)
                if (hold and ctx is not None and isinstance(it, Checkpoint)
                        and isinstance(it.inner[0], Store) and it.inner[0].option == STORE):
                    # a checkpoint inside a recompute: its input is one of the enclosing
                    # recompute's tensors, handed over once, so it goes as soon as its own
                    # recompute (whose first layer does not save it) is over
                    handed_over[id(it)] = hold
                elif hold:
                    stack.append(("unhold", hold, it))  # after its backward: the input is done
                elif (ctx is not None and idx > 0 and isinstance(it, Checkpoint)
                      and isinstance(seq[idx - 1], Checkpoint) and isinstance(it.inner[0], Store)
                      and it.inner[0].option == STORE
                      and not (L[it.start - 1].x_kept and L[it.start - 1].x_kept_next)):
                    # the same inside a recompute when the input is the boundary of the checkpoint
                    # before, which nothing after it saves: that checkpoint's backward finds it gone
                    handed_over[id(it)] = L[it.start - 1].x_bytes
                    released[id(seq[idx - 1])] = True
                stack.append(("bwd1", it, ctx))
        elif kind == "read":  # a nested checkpoint's recompute is over: its input goes
            _, it = task
            mem -= handed_over.pop(id(it))
            op("unhold", it.start - 1, _span(it), True, mem, 0, mem)
        elif kind == "unhold":
            _, hold, it = task
            mem -= hold
            op("unhold", _span(it)[0] - 1, _span(it), False, mem, 0, mem)
        elif kind == "side":
            mem -= side_held[task[1]]
            op("side", None, None, False, mem, 0, mem)
        elif kind == "bwd1":
            _, it, ctx = task
            if isinstance(it, Store):
                i = it.layer
                if i == first:
                    first_begun = True
                pf = prefetch(i)
                was_held = i in held
                ly = held_view(i, False)
                if i in leading:  # its measured backward transient holds the lead already
                    leading.discard(i)
                    mem -= ly.lead_bytes
                if it.option != STORE:  # a selective option redoes part of its forward first
                    recompute_ms += ly.option_ms(it.option)
                    ly = ly.option(it.option)
                d = L[i - 1].x_bytes if i > 0 else chain.delta_in_bytes
                if id(it) in copied:
                    ly = replace(ly, xbar_bytes=ly.xbar_bytes + ly.x_bytes)
                after = (mem + d + ly.grad_bytes - ly.xbar_bytes - ly.x_bytes
                         + grad_made.get(i, 0) - grad_gone.get(i, 0))
                if ctx is None and L[i].kept_after_bytes:  # a first forward's: kept with the graph
                    after += L[i].kept_after_bytes
                    unsaved += L[i].kept_after_bytes
                if was_held:  # its backward is over: the layer is no longer held
                    held.discard(i)
                    after -= L[i].held_bytes
                op("B", i, ctx, False, mem, ly.bwd_tmp_bytes + pf, after)
                mem = after
            else:
                inner_ctx = (it.start, it.stop)
                if not released.get(id(it)):
                    mem -= L[it.stop - 1].x_bytes
                    op("drop", it.stop - 1, inner_ctx, False, mem, 0, mem)
                last = it.stop - 1
                if ctx is None and chain.has_holds:
                    # a top-level checkpoint's backward: its layers are held from here on, and its
                    # last layer's backward begins (before the recompute it starts)
                    held.update(range(it.start, it.stop))
                    first, first_begun = it.start, it.stop - it.start == 1
                    mem += sum(L[k].held_bytes for k in range(it.start, it.stop))
                    op("held", it.start, inner_ctx, False, mem, 0, mem)
                if L[last].lead_bytes and last not in leading:
                    # the last layer's backward runs up to its first saved tensor, which
                    # starts the recompute: what it made by then stays live through it
                    leading.add(last)
                    mem += L[last].lead_bytes
                    op("lead", last, inner_ctx, False, mem, 0, mem)
                stack.append(("bwd", it.inner, inner_ctx))
                if id(it) in handed_over:
                    stack.append(("read", it))
                stack.append(("fwd", it.inner, inner_ctx))
        elif kind == "postF":
            if side_free:  # the chain's forward is over: nothing keeps them
                mem -= side_free
                op("side", None, None, False, mem, 0, mem)
            live = mem + post.xbar_bytes + post.loss_bytes  # the loss, held until the step ends
            op("F", n, None, False, live, post.fwd_tmp_bytes, live)
            mem = live
            if pending is not None:
                mem = release_pending(mem)
            if casts:  # the autocast region ends with the loss: its cache is cleared
                mem -= casts
                op("uncast", None, None, False, mem, 0, mem)
        elif kind == "postB":
            mem += post.loss_bytes  # the loss's gradient seed, live until the backward ends
            after = mem + L[-1].x_bytes + post.grad_bytes - post.xbar_bytes
            op("B", n, None, False, mem, post.bwd_tmp_bytes, after)
            mem = after
        elif kind == "preB":
            after = (mem + pre.grad_bytes - pre.retained_bytes - chain.delta_in_bytes
                     - grad_gone.get(PRE, 0))
            op("B", PRE, None, False, mem, pre.bwd_tmp_bytes, after)
            mem = after - post.backward_hold_bytes  # the backward is over: loss and seed go
            if unsaved:  # and the graph, with what its nodes kept outside saved tensors
                mem -= unsaved
                op("unsaved", None, None, False, mem, 0, mem)
        else:  # the optimizer step: its peak is absolute, measured by the profiler
            op("opt", OPT, None, False, mem, max(0, chain.opt_step_peak_bytes + late - mem), mem)
    return _Replay(peak, where, recompute_ms)


def _input_hold(chain: Chain, seq: tuple[Item, ...], idx: int, ctx: tuple[int, int] | None) -> int:
    """What checkpoint ``seq[idx]`` keeps beyond the plain forward: its input, when no op of the
    plain forward saves it (``Layer.x_kept`` False) and the item before it stores the layer that
    made it with ``store`` (pre at the top level). A checkpoint before it keeps its boundary
    anyway; a selective option's ``xbar`` includes the output; the first item of an inner plan
    gets its input from the checkpoint around it, which keeps it. A layer stored with a selective
    option runs in a checkpoint of its own (SAC), which keeps its input the same way."""
    it = seq[idx]
    if isinstance(it, Store) and it.option == STORE:
        return 0
    start = it.layer if isinstance(it, Store) else it.start
    if idx == 0:
        return chain.input_hold(0) if ctx is None and start == 0 else 0
    prev = seq[idx - 1]
    if isinstance(prev, Store) and prev.option == STORE:
        return chain.input_hold(start)
    return 0


def _boundary_released(chain: Chain, seq: tuple[Item, ...], idx: int,
                       ctx: tuple[int, int] | None) -> bool:
    """Whether checkpoint ``seq[idx]``'s boundary ``x[t-1]`` is freed once the next stage has
    read it: no op after layer ``t-1`` saves it (``Layer.x_kept`` False, or only the layer's own
    ops do: ``Layer.x_kept_next`` False; inside the checkpoint they save nothing) and that stage
    is a layer stored with ``store`` (or post, at the top level); a checkpoint or a selective
    option after it keeps it as its input."""
    it = seq[idx]
    if isinstance(it, Store):
        return False
    ly = chain.layers[it.stop - 1]
    if ly.x_kept and ly.x_kept_next:
        return False
    if idx + 1 < len(seq):
        nxt = seq[idx + 1]
        return isinstance(nxt, Store) and nxt.option == STORE
    return ctx is None  # the last item of the whole chain: post reads it


def _span(it: Item) -> tuple[int, int]:
    return (it.layer, it.layer + 1) if isinstance(it, Store) else (it.start, it.stop)


def _side_releases(chain: Chain, items: tuple[Item, ...]) -> tuple[int, dict[int, int]]:
    """Side-input bytes freed when the chain's forward ends, and per top-level item index the
    bytes freed after that item's backward (the first item holding one of their layers)."""
    if not chain.side_inputs:
        return 0, {}
    holder: dict[int, int] = {}  # layer -> index of the top-level item that holds it
    for idx, it in enumerate(items):
        if isinstance(it, Store):
            if it.option != STORE:
                holder[it.layer] = idx
        else:
            for k in range(it.start, it.stop):
                holder[k] = idx
    free = 0
    held: dict[int, int] = {}
    for si in chain.side_inputs:
        maker = holder.get(si.made_by) if si.made_by >= 0 else None  # makes them again: keeps none
        idxs = [holder[i] for i in si.layers if i in holder and holder[i] != maker]
        if idxs:
            first = min(idxs)
            held[first] = held.get(first, 0) + si.bytes
        else:
            free += si.bytes
    return free, held


def _label(op: str, stage: int | None, ctx: tuple[int, int] | None, n: int) -> str:
    if op == "opt":
        return "optimizer step"
    if op == "remade" and ctx is not None:
        return (f"side inputs made again by layer {stage} in the recompute of [{ctx[0]},{ctx[1]})"
                if stage is not None else f"recompute of [{ctx[0]},{ctx[1]}) over: its side inputs freed")
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
    score = simulate_items(chain, plan.items)
    _RECENT[key] = (chain, plan, score)  # holding both: their ids stay theirs
    if len(_RECENT) > RECENT_SCORES:
        _RECENT.popitem(last=False)
    return score


def simulate_items(chain: Chain, items: tuple[Item, ...]) -> Score:
    """``simulate`` for items already known to be a valid plan (brute force uses this)."""
    r = _replay(chain, items)
    base = chain.base_step_ms
    return Score(
        peak_bytes=r.peak_bytes,
        peak_at=_label(*r.peak_where, chain.n_layers),
        recompute_ms=r.recompute_ms,
        step_ms=base + r.recompute_ms,
        overhead=r.recompute_ms / base if base > 0 else 0.0,
        persistent_bytes=chain.persistent_bytes,
    )


def peak_of(chain: Chain, items: tuple[Item, ...]) -> tuple[int, float]:
    """(peak bytes, recompute ms) with no labels: the fast path for enumerations."""
    r = _replay(chain, items)
    return r.peak_bytes, r.recompute_ms


def trace(chain: Chain, plan: Plan) -> tuple[TraceEvent, ...]:
    """Every op of the replay with its live bytes and peak, for README examples and debugging."""
    _check(chain, plan)
    events: list[TraceEvent] = []
    n = chain.n_layers

    def on_op(op: str, stage: int | None, ctx: tuple[int, int] | None, again: bool, live: int,
              transient: int, after: int) -> None:
        events.append(TraceEvent(_label(op, stage, ctx, n), op, stage, again, live, transient,
                                 max(live + transient, after), after))

    _replay(chain, plan.items, on_op)
    return tuple(events)


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
        if name != STORE and all(o.name != name for o in chain.layers[i].options):
            known = ", ".join([STORE, *(o.name for o in chain.layers[i].options)])
            raise SpecError(f"the plan stores layer {i} with option {name!r}, which its profile does "
                            f"not have (it has: {known})",
                            tip="profile with options (`ckplan profile --options`) or re-plan")
