"""The simulator's replay: a plan's ops in order, op by op, with the memory each holds.

Memory model (scored by ``simulate.py``), with ``x[i]`` the output of layer i, ``xbar[i]`` what
storing it keeps (includes ``x[i]``), ``x[-1]`` the chain input (held by pre) and ``d[i]`` the
gradient B(i) produces (``x[i-1]``, or ``delta_in`` for i = 0):

* start: ``mem = persistent``. Pre forward: live ``mem + pre.retained``, transient ``pre.fwd_tmp``.
* ``Store(i)`` forward: live ``mem + xbar[i]``, transient ``fwd_tmp[i]``.
* ``Checkpoint[s, t)`` forward: for k = s..t-1: live ``mem + x[k]``, transient ``fwd_tmp[k]``;
  then ``x[k-1]`` is freed when k > s. The boundary ``x[t-1]`` stays.
* mixed precision: a layer inside a *top-level* checkpoint adds its ``cast[k]`` (autocast's weight
  copies) in its forward, freed after the post forward; a top-level ``Store(i, option)`` the copies
  its policy does not keep, ``Store(i)`` and pre those no op saves (docs/memory-model.md).
* post forward: live ``mem + post.xbar + post.loss``, transient ``post.fwd_tmp``; post backward:
  the loss's gradient seed (``post.loss``) is added, transient ``post.bwd_tmp``, then ``mem +=
  x[n-1] + post.grad - post.xbar``. Loss and seed stay live until the pre backward has run.
* ``Store(i)`` backward: transient ``bwd_tmp[i]``, then ``mem += d[i] + grad[i] - xbar[i] - x[i]``.
* ``Store(i)`` with a selective option (``chain.Option``): the same ops with the option's sizes;
  its ``recompute_ms`` counts as recompute. With ``offload``: ``transfers.py``.
* ``Checkpoint[s, t)`` backward: free the boundary ``x[t-1]``, then run ``inner`` as a sub-chain:
  all its forwards (these count as recompute), then all its backwards in reverse, exactly as at
  the top level except that there is no post: the gradient of ``x[t-1]`` is already live.
  PyTorch stops a recompute once the last tensor saved in the first forward is back (early
  stop): an inner plan ending with a plain ``Store(t-1)`` runs that layer's forward only up to it
  (``Layer.stop_*``); its backward then starts from ``mem + xbar[t-1]``.
* beyond rotor's chain (unkept boundaries, side inputs, held layers...): ``boundaries.py``.
* pre backward: transient ``pre.bwd_tmp``, then ``mem += pre.grad - pre.retained - delta_in``;
  then the optimizer step, whose absolute peak ``opt_step_peak`` is a constant of the chain.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from .boundaries import SideHolds, _boundary_released, _input_hold, _side_made, _side_releases, _span
from .chain import Chain
from .plan import PLAIN, STORE, Checkpoint, Item, Store, kept_option
from .transfers import AUTO, Transfers

PRE, OPT = -1, None

# op callback: (op, stage, ctx, recompute, live, transient, mem_after)
_OnOp = Callable[[str, "int | None", "tuple[int, int] | None", bool, int, int, int], None]
_Where = tuple[str, "int | None", "tuple[int, int] | None"]  # (op, stage, ctx) for _label


@dataclass(eq=False, slots=True)
class _State:
    """What the replay tracks while it runs the ops; at the end, its answer."""
    mem: int  # live bytes
    peak_bytes: int = -1
    peak_where: _Where = ("", None, None)  # the op that reaches it
    recompute_ms: float = 0.0
    casts: int = 0  # autocast copies of top-level checkpointed (and option) layers, live to the forward's end
    unsaved: int = 0  # what checkpointed first forwards keep that no hook sees: until the backward ends
    late: int = 0  # what recomputes leave on their modules (Layer.recompute_kept_bytes): to the step's end
    left_by: set[int] = field(default_factory=set)  # layers whose recompute has left it
    loose_of: dict[int, int] = field(default_factory=dict)  # layer -> its first forward's unsaved bytes
    released: dict[int, bool] = field(default_factory=dict)  # id(checkpoint) -> _boundary_released
    # id(checkpoint inside a recompute) -> bytes of its input freed once its own recompute is over
    handed_over: dict[int, int] = field(default_factory=dict)
    # a released boundary the next stage's forward still reads: (bytes, layer, span, again)
    pending: tuple[int, int, tuple[int, int], bool] | None = None
    copied: dict[int, int] = field(default_factory=dict)  # a recompute's first layer given a copy: its bytes
    remade_kept: dict[int, dict[int, int]] = field(default_factory=dict)  # id(seq) -> _remade_holders
    # layers whose backward has begun and holds its lead (Layer.lead_bytes) beside a recompute
    leading: set[int] = field(default_factory=set)
    # held layers (Layer.held_bytes) of the top-level checkpoint whose backward runs, its first
    # layer, and whether that layer's backward has begun (its prefetch of the layer before)
    held: set[int] = field(default_factory=set)
    first: int | None = None
    first_begun: bool = False
    releases: dict[int, int] = field(default_factory=dict)  # AUTO: offloaded layer -> its release point
    transfer_ms: float = 0.0  # host copies not hidden behind compute (transfers.py)


class _Replayer(Transfers, SideHolds):
    """The plan's ops in order, one method per step; the state in ``_State``, offload's in ``Transfers``."""

    def __init__(self, chain: Chain, items: tuple[Item, ...], on_op: _OnOp | None, releases: dict[int, int] | str,
                 fetches: dict[int, int] | None):
        self.chain, self.items, self.on_op = chain, items, on_op
        self.L, self.n = chain.layers, chain.n_layers
        self.s = _State(chain.persistent_bytes)
        self.init_transfers(items, releases, fetches)
        self.side_free, self.side_held = _side_releases(chain, items)
        self.grad_made, self.grad_gone = chain.side_grads_at()
        self.side_made = _side_made(chain)

    def run(self) -> _State:
        s, chain = self.s, self.chain
        s.casts = chain.pre.cast_bytes  # its copies no op saves: in autocast's cache, as a stored layer's
        live = s.mem + chain.pre.retained_bytes + chain.side_bytes + s.casts
        self.op("F", PRE, None, False, live, chain.pre.fwd_tmp_bytes, live)
        s.mem = live
        # an explicit stack (plans may nest deeper than Python's recursion limit)
        self.stack: list[tuple] = [("opt",), ("preB",), ("bwd", self.items, None), ("postB",), ("postF",),
                                   ("fwd", self.items, None)]
        steps: dict[str, Callable[..., None]] = {
                 "fwd": self.forward, "bwd": self.backward, "read": self.read, "unhold": self.unhold,
                 "side": self.side, "store": self.backward_store, "ckpt": self.backward_checkpoint,
                 "postF": self.post_forward, "postB": self.post_backward, "preB": self.pre_backward,
                 "opt": self.optimizer_step}
        while self.stack:
            task = self.stack.pop()
            steps[task[0]](*task[1:])
        return s

    def op(self, name: str, stage: int | None, ctx: tuple[int, int] | None, again: bool, live: int,
           transient: int, after: int) -> None:
        s = self.s
        p = max(live + transient, after)
        if p > s.peak_bytes:
            s.peak_bytes, s.peak_where = p, (name, stage, ctx)
        if self.offloaded:
            self.tick(name, stage, again)
        if self.on_op is not None:
            self.on_op(name, stage, ctx, again, live, transient, after)

    def release_pending(self) -> None:
        s = self.s
        assert s.pending is not None
        nbytes, layer, span, again = s.pending
        s.pending = None
        s.mem -= nbytes
        self.op("release", layer, span, again, s.mem, 0, s.mem)

    def held_view(self, k: int, gather: bool, after: int | None = None):
        """Layer k as held (its held transients) when it is, else as it is; a forward runs
        beside what layer ``after``'s backward left."""
        L, n = self.L, self.n
        after = n if after is None else after
        if k not in self.s.held:
            return L[k]
        return L[k].held(gather, L[after].retained_bytes if after < n else 0)

    def prefetch(self, k: int) -> int:
        """The all-gather buffer of the layer before the top-level checkpoint, beside the ops of
        its first layer once that layer's backward has begun."""
        s = self.s
        return self.L[k - 1].gather_bytes if k == s.first and s.first_begun and k > 0 else 0

    def forward(self, seq: tuple[Item, ...], ctx: tuple[int, int] | None) -> None:
        """A sequence's forward: the first (``ctx`` None) or a checkpoint's recompute."""
        s, L, chain = self.s, self.L, self.chain
        again = ctx is not None
        remade = 0  # side inputs this recompute makes again: its frame holds them to its end
        for idx, it in enumerate(seq):
            if again:
                for k in range(*_span(it)):
                    if self.side_made.get(k):
                        remade += self.remake(seq, idx, k, ctx)
                    if (L[k].recompute_kept_bytes or L[k].recompute_chain_kept_bytes) and k not in s.left_by:
                        self.left_on_module(k, ctx)
            hold = _input_hold(chain, seq, idx, ctx)
            if hold:  # its input, which no op of the plain forward keeps
                s.mem += hold
                self.op("hold", _span(it)[0] - 1, _span(it), again, s.mem, 0, s.mem)
            if isinstance(it, Store):
                self.forward_store(seq, idx, it, ctx)
            else:
                self.forward_checkpoint(seq, idx, it, ctx)
        if remade:
            s.mem -= remade
            self.op("remade", None, ctx, True, s.mem, 0, s.mem)
        if again and seq and isinstance(seq[-1], Store):
            # the recompute stops once the last saved tensor is back: the last layer's tail
            # is not redone (a sequence ending in a checkpoint does not get this)
            s.recompute_ms -= L[seq[-1].layer].tail_ms

    def left_on_module(self, k: int, ctx: tuple[int, int] | None) -> None:
        """What the recompute of layer ``k`` leaves on the module: the layer's own measure, or
        the whole chain's when a later layer of this recompute keeps its graph (what this one made
        stays too). A later recompute of it replaces it (counted once), and it replaces what the
        first forward kept on the module; the graph behind it also holds the layer's input, which
        its first op saved (counted, on the safe side)."""
        s, L = self.s, self.L
        end = ctx[1] if ctx is not None else k + 1
        chained = any(L[j].recompute_kept_bytes for j in range(k + 1, end))
        own = L[k].recompute_chain_kept_bytes if chained else L[k].recompute_kept_bytes
        if not own:
            return
        s.left_by.add(k)
        gone = min(s.loose_of.pop(k, 0), own)
        s.unsaved -= gone
        kept = own + (L[k - 1].x_bytes if k > 0 else 0)
        s.late += kept
        s.mem += kept - gone
        self.op("left", k, ctx, True, s.mem, 0, s.mem)

    def forward_store(self, seq: tuple[Item, ...], idx: int, it: Store, ctx: tuple[int, int] | None) -> None:
        s, chain = self.s, self.chain
        again = ctx is not None
        # held: ctx is the checkpoint whose recompute runs (again is True)
        base = self.held_view(it.layer, ctx is not None and it.layer != ctx[1] - 1,
                              ctx[1] if ctx is not None else self.n)
        ly = base if it.option in PLAIN else base.option(kept_option(it.option))
        pf = self.prefetch(it.layer)
        if again and idx == 0 and it.option == STORE and (ly.in_place or ly.copies_input):
            s.copied[id(it)] = self.chain.copy_bytes(it.layer)  # its new output, or what it changes and saves
            ly = replace(ly, xbar_bytes=ly.xbar_bytes + s.copied[id(it)])
        # first in an inner plan, its input is the checkpoint's, counted in mem: when
        # no op keeps it, the measured transient (xbar leaves it out) holds it too
        dup = chain.input_hold(it.layer) if again and idx == 0 and it.option == STORE else 0
        if (again and idx == len(seq) - 1 and it.option == STORE and id(it) not in s.copied
                and ly.early_xbar_bytes is not None):
            # the recompute stops at the layer's last saved tensor (early stop)
            live = s.mem + ly.stop_xbar_bytes
            self.op("F", it.layer, ctx, again, live, max(0, ly.stop_fwd_tmp_bytes - dup) + pf, live)
            s.mem += ly.xbar_bytes  # its backward's transient was measured with all it keeps live
        else:
            # autocast's copies this forward leaves unsaved: an option's, or a stored layer's own
            cast = 0 if again else ly.cast_bytes if it.option not in PLAIN else ly.unsaved_cast_bytes
            s.casts += cast
            live = s.mem + ly.xbar_bytes + cast
            self.op("F", it.layer, ctx, again, live, max(0, ly.fwd_tmp_bytes - dup) + pf, live)
            s.mem = live
        if s.pending is not None:
            self.release_pending()
        self.settle(it.layer)
        if it.layer in self.offloaded and ctx is None:
            self.send(it.layer)
        if again:
            s.recompute_ms += ly.fwd_ms

    def forward_checkpoint(self, seq: tuple[Item, ...], idx: int, it: Checkpoint,
                           ctx: tuple[int, int] | None) -> None:
        s, L, chain = self.s, self.L, self.chain
        again = ctx is not None
        mem, op = s.mem, self.op  # locals in the replay's hottest loop (one pass per layer)
        for k in range(it.start, it.stop):
            ly = self.held_view(k, ctx is not None and k != ctx[1] - 1, k + 1)
            cast = 0 if again else ly.cast_bytes
            s.casts += cast
            loose = 0 if again else ly.unsaved_kept_bytes
            s.unsaved += loose
            if loose:
                s.loose_of[k] = loose
            live = mem + ly.x_bytes + cast + loose
            after = live - L[k - 1].x_bytes if k > it.start else live
            # outputs no op keeps (its own, the input's): the measured transient
            # holds them (xbar leaves them out), and here live counts them already
            own = 0 if ly.x_kept or ly.in_place else ly.x_bytes
            tmp = ly.fn_tmp(max(0, ly.fwd_tmp_bytes - own - chain.input_hold(k)), cast)
            tmp += chain.copy_bytes(k) if k == it.start and ly.copies_input and not ly.in_place else 0  # its copy
            op("Fn", k, ctx, again, live, tmp, after)
            mem = after
            if self.pending:
                mem = self.settle(k, mem)
            if again:
                s.recompute_ms += ly.fwd_ms
        s.mem = mem
        if _boundary_released(chain, seq, idx, ctx):
            if L[it.stop - 1].x_kept:
                # only the layer's own ops save it in the plain forward, where the
                # next stage's measured forward ran with it live: freed after that
                s.pending = (L[it.stop - 1].x_bytes, it.stop - 1, (it.start, it.stop), again)
            else:
                s.mem -= L[it.stop - 1].x_bytes  # read by the next stage, saved by none
                self.op("release", it.stop - 1, (it.start, it.stop), again, s.mem, 0, s.mem)

    def backward(self, seq: tuple[Item, ...], ctx: tuple[int, int] | None) -> None:
        """A sequence's backward: its items' backwards pushed last first, with what each frees."""
        s, L, chain = self.s, self.L, self.chain
        remade_kept = s.remade_kept.pop(id(seq), {})
        for idx, it in enumerate(seq):
            if isinstance(it, Checkpoint):
                s.released[id(it)] = _boundary_released(chain, seq, idx, ctx)
            if ctx is None and self.side_held.get(idx):
                self.stack.append(("side", self.side_held[idx]))  # after this item's whole backward
            elif remade_kept.get(idx):  # made again by this recompute, kept by this item
                self.stack.append(("side", remade_kept[idx]))
            hold = _input_hold(chain, seq, idx, ctx)
            if (hold and ctx is not None and isinstance(it, Checkpoint)
                    and isinstance(it.inner[0], Store) and it.inner[0].option == STORE):
                # a checkpoint inside a recompute: its input is one of the enclosing
                # recompute's tensors, handed over once, so it goes as soon as its own
                # recompute (whose first layer does not save it) is over
                s.handed_over[id(it)] = s.handed_over.get(id(it), 0) + hold
            elif hold:
                self.stack.append(("unhold", hold, it))  # after its backward: the input is done
            elif (ctx is not None and idx > 0 and isinstance(it, Checkpoint)
                  and isinstance(seq[idx - 1], Checkpoint) and isinstance(it.inner[0], Store)
                  and it.inner[0].option == STORE
                  and not (L[it.start - 1].x_kept and L[it.start - 1].x_kept_next)):
                # the same inside a recompute when the input is the boundary of the checkpoint
                # before, which nothing after it saves: that checkpoint's backward finds it gone
                s.handed_over[id(it)] = s.handed_over.get(id(it), 0) + L[it.start - 1].x_bytes
                s.released[id(seq[idx - 1])] = True
            self.stack.append(("store" if isinstance(it, Store) else "ckpt", it, ctx))

    def read(self, it: Checkpoint) -> None:
        """A nested checkpoint's recompute is over: its input goes."""
        s = self.s
        s.mem -= s.handed_over.pop(id(it))
        self.op("unhold", it.start - 1, _span(it), True, s.mem, 0, s.mem)

    def unhold(self, hold: int, it: Item) -> None:
        s = self.s
        s.mem -= hold
        self.op("unhold", _span(it)[0] - 1, _span(it), False, s.mem, 0, s.mem)

    def backward_store(self, it: Store, ctx: tuple[int, int] | None) -> None:
        s, L, chain = self.s, self.L, self.chain
        i = it.layer
        if i == s.first:
            s.first_begun = True
        pf = self.prefetch(i)
        was_held = i in s.held
        ly = self.held_view(i, False)
        if i in s.leading:  # its measured backward transient holds the lead already
            s.leading.discard(i)
            s.mem -= ly.lead_bytes
        self.fetch_before(i)
        if it.option not in PLAIN:  # a selective option redoes part of its forward first
            s.recompute_ms += ly.option_ms(kept_option(it.option))
            ly = ly.option(kept_option(it.option))
        d = L[i - 1].x_bytes if i > 0 else chain.delta_in_bytes
        ly = replace(ly, xbar_bytes=ly.xbar_bytes + s.copied[id(it)]) if id(it) in s.copied else ly
        after = (s.mem + d + ly.grad_bytes - ly.xbar_bytes - ly.x_bytes
                 + self.grad_made.get(i, 0) - self.grad_gone.get(i, 0))
        if ctx is None and L[i].kept_after_bytes:  # a first forward's: kept with the graph
            after += L[i].kept_after_bytes
            s.unsaved += L[i].kept_after_bytes
        if was_held:  # its backward is over: the layer is no longer held
            s.held.discard(i)
            after -= L[i].held_bytes
        self.op("B", i, ctx, False, s.mem, ly.bwd_tmp_bytes + pf, after)
        s.mem = after

    def backward_checkpoint(self, it: Checkpoint, ctx: tuple[int, int] | None) -> None:
        s, L, chain = self.s, self.L, self.chain
        inner_ctx = (it.start, it.stop)
        if not s.released.get(id(it)):
            s.mem -= L[it.stop - 1].x_bytes
            self.op("drop", it.stop - 1, inner_ctx, False, s.mem, 0, s.mem)
        last = it.stop - 1
        if ctx is None and chain.has_holds:
            # a top-level checkpoint's backward: its layers are held from here on, and its
            # last layer's backward begins (before the recompute it starts)
            s.held.update(range(it.start, it.stop))
            s.first, s.first_begun = it.start, it.stop - it.start == 1
            s.mem += sum(L[k].held_bytes for k in range(it.start, it.stop))
            self.op("held", it.start, inner_ctx, False, s.mem, 0, s.mem)
        if L[last].lead_bytes and last not in s.leading:
            # the last layer's backward runs up to its first saved tensor, which
            # starts the recompute: what it made by then stays live through it
            s.leading.add(last)
            s.mem += L[last].lead_bytes
            self.op("lead", last, inner_ctx, False, s.mem, 0, s.mem)
        self.stack.append(("bwd", it.inner, inner_ctx))
        if id(it) in s.handed_over:
            self.stack.append(("read", it))
        self.stack.append(("fwd", it.inner, inner_ctx))

    def post_forward(self) -> None:
        s, post = self.s, self.chain.post
        if self.side_free:  # the chain's forward is over: nothing keeps them
            s.mem -= self.side_free
            self.op("side", None, None, False, s.mem, 0, s.mem)
        live = s.mem + post.xbar_bytes + post.loss_bytes  # the loss, held until the step ends
        self.op("F", self.n, None, False, live, post.fwd_tmp_bytes, live)
        s.mem = live
        if s.pending is not None:
            self.release_pending()
        self.settle(self.n)
        if s.casts:  # the autocast region ends with the loss: its cache is cleared
            s.mem -= s.casts
            self.op("uncast", None, None, False, s.mem, 0, s.mem)

    def post_backward(self) -> None:
        s, post = self.s, self.chain.post
        s.mem += post.loss_bytes  # the loss's gradient seed, live until the backward ends
        after = s.mem + self.L[-1].x_bytes + post.grad_bytes - post.xbar_bytes
        self.op("B", self.n, None, False, s.mem, post.bwd_tmp_bytes, after)
        s.mem = after

    def pre_backward(self) -> None:
        s, chain = self.s, self.chain
        pre, post = chain.pre, chain.post
        after = (s.mem + pre.grad_bytes - pre.retained_bytes - chain.delta_in_bytes
                 - self.grad_gone.get(PRE, 0))
        self.op("B", PRE, None, False, s.mem, pre.bwd_tmp_bytes, after)
        s.mem = after - post.backward_hold_bytes  # the backward is over: loss and seed go
        if s.unsaved:  # and the graph, with what its nodes kept outside saved tensors
            s.mem -= s.unsaved
            self.op("unsaved", None, None, False, s.mem, 0, s.mem)

    def optimizer_step(self) -> None:
        """The optimizer step: its peak is absolute, measured by the profiler."""
        s = self.s
        self.op("opt", OPT, None, False, s.mem, max(0, self.chain.opt_step_peak_bytes + s.late - s.mem), s.mem)


def _replay(chain: Chain, items: tuple[Item, ...], on_op: _OnOp | None = None,
            releases: dict[int, int] | str = AUTO, fetches: dict[int, int] | None = None) -> _State:
    """Run the plan's ops in order, tracking the largest op peak (and calling ``on_op`` for each op
    when given); ``releases``, ``fetches``: the offloaded layers' points (``transfers.py``)."""
    return _Replayer(chain, items, on_op, releases, fetches).run()
