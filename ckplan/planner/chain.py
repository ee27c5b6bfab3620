"""The planner's cost model: a chain of layers between a fixed *pre* and a fixed *post* stage.

Per layer we keep rotor's quantities (Beaumont et al. 2019/2021, "Optimal checkpointing for
heterogeneous chains"): forward/backward time, the output size ``x``, the bytes kept when the layer
is stored ``xbar`` (it includes ``x``), transient peaks during forward and backward, plus the
parameter-gradient bytes that appear at the end of the layer's backward. Everything before the
chain (embeddings, stem) is the *pre* stage and everything after (head, loss) the *post* stage;
both are always stored. ``persistent_bytes`` (parameters, buffers, the batch, optimizer state) is
live for the whole step.

Types only: building a chain from a profile is :mod:`ckplan.planner.calibrate`.

Mixed precision: ``cast_bytes`` are autocast's low-precision weight copies first made in the
layer's forward. Autocast's cache keeps them until the whole forward (loss included) is over,
whatever the plan: for a stored layer they are also saved for backward, so they are already in
``xbar_bytes``; for a layer inside a top-level checkpoint the simulator adds them from its
forward to the end of the forward (see :mod:`ckplan.planner.simulate`).

Side inputs (``Chain.side_inputs``, :class:`ckplan.records.SideInput`): tensors made by *pre* and
passed to chain layers besides the hidden state (attention masks, ``position_ids``), which no op
saves, so without checkpoints they are freed when the chain's forward ends. A checkpoint keeps the
arguments of its layers until its backward: the simulator keeps them until the backward of the
first top-level item that holds one of their layers. The DP tables count them as live for the
whole step (``tables.base_bytes``): an upper bound on every op, so a plan they fit fits.
Their gradients (``SideInput.grad_bytes``, when they require grad) live from the backward of the
last layer reading them to the backward of their maker, recomputes in between included; the
tables count them as live for the whole step too.

Held layers (``Layer.held_bytes``, FSDP2 per rank, :mod:`ckplan.planner.parallel`): what a layer
keeps through the backward of the top-level checkpoint around it, from that backward's start
until its own backward ends, with its own transients there (``held_*``, ``gather_bytes``,
``retained_bytes``). At the top level a layer holds nothing of the kind, so the same layers cost
differently inside an inner plan; the simulator replays it and :mod:`ckplan.planner.held` plans it.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from ..records import SideInput

STORE = "store"  # the option every layer has: keep everything it saves for backward


@dataclass(frozen=True)
class Option:
    """A way to store a layer that keeps less than ``xbar`` and redoes part of its forward at
    the start of its backward (selective activation checkpointing: some ops' outputs are saved,
    the rest recomputed). Sizes as in :class:`Layer`, measured with the option applied.

    ``store`` (keep everything) is the layer itself and ``full`` (recompute the whole layer) is
    ``Checkpoint(i, i + 1)``; an Option is anything in between."""

    name: str
    xbar_bytes: int  # kept for backward when stored with this option; includes the output
    recompute_ms: float  # forward work redone at the start of the layer's backward
    fwd_tmp_bytes: int  # forward peak above live bytes + xbar
    bwd_tmp_bytes: int  # backward peak above live bytes at its start (recomputed tensors included)
    recompute_flops: int = 0
    # The same two while the layer is held (``Layer.held_bytes``); None: the ones above.
    held_fwd_tmp_bytes: int | None = None
    held_bwd_tmp_bytes: int | None = None


@dataclass(frozen=True)
class Layer:
    """One chain layer (rotor's stage)."""

    name: str
    fwd_ms: float
    bwd_ms: float
    x_bytes: int  # output, what a checkpoint boundary keeps
    # kept when the layer is stored; includes x_bytes, unless no op keeps the output (x_kept) or
    # the output is the input's storage returned in place (ReLU(inplace=True): counted where made)
    xbar_bytes: int
    fwd_tmp_bytes: int  # forward peak above live bytes + xbar
    bwd_tmp_bytes: int  # backward peak above live bytes at its start
    grad_bytes: int  # parameter gradients allocated at the end of its backward
    fwd_flops: int = 0
    bwd_flops: int = 0
    cast_bytes: int = 0  # autocast weight copies made in its forward (inside xbar when stored)
    options: tuple[Option, ...] = ()  # selective ways to store it, besides keeping everything
    # Forward time a checkpoint *ending* at this layer does not redo: PyTorch's non-reentrant
    # checkpoint stops its recompute once the last tensor saved for backward is back, so the
    # last layer's final ops (GPT-2's c_proj matmul: its input is saved before it runs) are
    # skipped. A checkpoint [s, j) recomputes fwd(s..j-1) - tail(j-1); 0 <= tail <= fwd.
    tail_ms: float = 0.0
    # Whether the plain forward keeps the output for backward (this layer or the next one saves
    # it). False: no op saves it (a Linear followed by a ReLU, which saves its own output; Cohere's
    # LayerNorm, which saves x - mean), so ``xbar_bytes`` leaves it out, it is freed once the next
    # stage has run, and only a checkpoint starting right after keeps it (as its input).
    x_kept: bool = True
    # With ``x_kept``: whether an op after the layer saves the output too. False: only the layer's
    # own ops do (a block ending with a ReLU, read next by a pooling that saves nothing: HF
    # ResNet's last stage). Stored, the layer keeps it (in ``xbar``); a checkpoint ending at the
    # layer saves nothing inside, so its boundary is freed once a stored next stage has run.
    x_kept_next: bool = True
    # The layer returns its input's storage changed in place (ReLU(inplace=True)): ``xbar`` does
    # not count the output (its maker's does). A checkpoint starting at it gives it a copy
    # (ckplan.execute), which the recompute keeps as the layer's saved output: ``x`` more there.
    in_place: bool = False
    # The last layer of a recompute that ends with it stored (PyTorch's early stop: the recompute
    # stops once the last tensor saved in the first forward is back) runs only up to its last
    # saved tensor: it then holds ``early_xbar_bytes`` (what its own ops saved; not its output
    # when only the next layer saves that) with ``early_fwd_tmp_bytes`` on top at the peak.
    # None: the whole forward (rotor's model). See :attr:`stop_xbar_bytes`.
    early_xbar_bytes: int | None = None
    early_fwd_tmp_bytes: int | None = None
    # What the layer's backward holds above its start when it first needs a saved tensor (the
    # backward of its last ops, which saved nothing, has run): a recompute of a checkpoint ending
    # at the layer runs beside it, until the layer's own backward (whose measured transient
    # includes it) goes on. See ``StageRecord.backward_lead_bytes``.
    lead_bytes: int = 0
    # The forward's peak above its start when it saves nothing (a checkpoint's first forward),
    # its output included; None: rotor's ``x_bytes + fwd_tmp_bytes``. See :meth:`fn_tmp`.
    nosave_peak_bytes: int | None = None
    # What a checkpoint's first forward of the layer keeps besides its output, that no saved-
    # tensor hook sees (ctx attributes of a custom autograd Function, a module cache): live until
    # the step's backward is over. See ``StageRecord.unsaved_kept_bytes``.
    unsaved_kept_bytes: int = 0
    # What a stored layer's backward leaves of its tensors until the backward is over (the same
    # holders): freed with the graph, not by its backward.
    kept_after_bytes: int = 0
    # What a recompute of the layer leaves alive until the step ends (and on into the next step's
    # forward): see ``StageRecord.recompute_kept_bytes``. The simulator adds it once the layer's
    # forward runs again in a backward.
    recompute_kept_bytes: int = 0
    # ... and what it leaves when a later layer of the same recompute keeps the graph (above)
    recompute_chain_kept_bytes: int = 0
    # Held layers (see the module doc): bytes the layer keeps from the start of the backward of
    # the top-level checkpoint around it until its own backward ends (FSDP2 per rank: the unit's
    # unsharded parameters, ``planner.parallel``), and its forward and backward transients
    # there, above live bytes that count them (None: ``fwd_tmp_bytes`` / ``bwd_tmp_bytes``);
    # the forward's leaves out what the backward that ran last left (``retained_bytes``).
    held_bytes: int = 0
    held_fwd_tmp_bytes: int | None = None
    held_bwd_tmp_bytes: int | None = None
    # What a held forward adds when it is not the last layer of the checkpoint whose recompute
    # runs it (FSDP2: the all-gather buffer of a unit that forward unshards), and what the first
    # layer of a top-level checkpoint adds once its backward has begun (the all-gather buffer
    # of the layer before, ``gather_bytes`` of layer ``s - 1``: FSDP2's backward prefetch).
    gather_bytes: int = 0
    # What the layer's backward leaves until the next backward ends (FSDP2: its reduce-scatter
    # input), which held forwards run beside: those of a recompute of [a, b) beside layer b's,
    # a checkpoint's first forward inside one beside the next layer's (on the safe side).
    retained_bytes: int = 0

    def fn_tmp(self, rotor: int) -> int:
        """The transient of a forward that keeps only the output, above ``live + x_bytes``: rotor's
        estimate ``rotor``, or more where the measured no-save forward peaked higher."""
        if self.nosave_peak_bytes is None:
            return rotor
        return max(rotor, self.nosave_peak_bytes - self.x_bytes)

    @property
    def stop_xbar_bytes(self) -> int:
        """What the layer holds after a recompute that stops at its last saved tensor."""
        return self.xbar_bytes if self.early_xbar_bytes is None else self.early_xbar_bytes

    @property
    def stop_fwd_tmp_bytes(self) -> int:
        """The transient of that truncated forward, above :attr:`stop_xbar_bytes`."""
        return self.fwd_tmp_bytes if self.early_fwd_tmp_bytes is None else self.early_fwd_tmp_bytes

    def option(self, name: str) -> Layer:
        """This layer as the simulator sees it when stored with option ``name``."""
        if name == STORE:
            return self
        for o in self.options:
            if o.name == name:
                return replace(self, xbar_bytes=o.xbar_bytes, fwd_tmp_bytes=o.fwd_tmp_bytes,
                               bwd_tmp_bytes=o.bwd_tmp_bytes, options=(), x_kept=True,
                               early_xbar_bytes=None, early_fwd_tmp_bytes=None,
                               held_fwd_tmp_bytes=o.held_fwd_tmp_bytes,
                               held_bwd_tmp_bytes=o.held_bwd_tmp_bytes)
        known = ", ".join([STORE, *(o.name for o in self.options)])
        raise KeyError(f"layer {self.name!r} has no option {name!r} (it has: {known})")

    def held(self, gather: bool, beside: int = 0) -> Layer:
        """This layer as the simulator sees it while held (``held_bytes`` counted as live): its
        held transients (its options' too), the forward's with ``beside`` (a ``retained_bytes``)
        and, when ``gather``, ``gather_bytes`` on top. The no-save forward and the early stop's
        truncated one keep their measured excess over the whole forward's transient."""
        add = beside + (self.gather_bytes if gather else 0)
        fwd = (self.fwd_tmp_bytes if self.held_fwd_tmp_bytes is None else self.held_fwd_tmp_bytes) + add
        shift = fwd - self.fwd_tmp_bytes
        early = self.early_fwd_tmp_bytes
        options = tuple(replace(o, fwd_tmp_bytes=(o.fwd_tmp_bytes if o.held_fwd_tmp_bytes is None
                                                  else o.held_fwd_tmp_bytes) + add,
                                bwd_tmp_bytes=o.bwd_tmp_bytes if o.held_bwd_tmp_bytes is None
                                else o.held_bwd_tmp_bytes,
                                held_fwd_tmp_bytes=None, held_bwd_tmp_bytes=None)
                        for o in self.options)
        return replace(self, fwd_tmp_bytes=fwd,
                       bwd_tmp_bytes=self.bwd_tmp_bytes if self.held_bwd_tmp_bytes is None
                       else self.held_bwd_tmp_bytes,
                       nosave_peak_bytes=None if self.nosave_peak_bytes is None
                       else max(0, self.nosave_peak_bytes + shift),
                       early_fwd_tmp_bytes=None if early is None else max(0, early + shift),
                       options=options, held_bytes=0, held_fwd_tmp_bytes=None,
                       held_bwd_tmp_bytes=None, gather_bytes=0, retained_bytes=0)

    @property
    def alone_ms(self) -> float:
        """What a checkpoint around this layer alone redoes (``full``): its forward less its tail."""
        return self.fwd_ms - self.tail_ms

    def option_ms(self, name: str) -> float:
        """Forward time option ``name`` redoes in the layer's backward (0 for ``store``)."""
        return 0.0 if name == STORE else next(o.recompute_ms for o in self.options if o.name == name)


@dataclass(frozen=True)
class Pre:
    """Everything before the chain; its ``retained_bytes`` include the chain input when
    ``x_kept`` (it is saved for backward, or it is the batch itself, in ``persistent_bytes``);
    otherwise, as for :attr:`Layer.x_kept`, only a checkpoint starting at layer 0 keeps it."""

    retained_bytes: int
    fwd_tmp_bytes: int = 0
    bwd_tmp_bytes: int = 0
    grad_bytes: int = 0
    fwd_ms: float = 0.0
    bwd_ms: float = 0.0
    x_kept: bool = True


@dataclass(frozen=True)
class Post:
    """Everything after the chain, ending in the scalar loss. ``xbar_bytes`` is what it saves
    for backward; ``loss_bytes`` the loss tensor itself, which the training loop holds from the
    post forward until the backward ends, beside its gradient seed (``loss.backward()`` makes
    ``torch.ones_like(loss)`` and keeps it until the whole backward is done): both live during
    every backward op and every forward redone there, which the forward's measured transients
    do not include."""

    xbar_bytes: int
    fwd_tmp_bytes: int = 0
    bwd_tmp_bytes: int = 0
    grad_bytes: int = 0
    fwd_ms: float = 0.0
    bwd_ms: float = 0.0
    loss_bytes: int = 0

    @property
    def backward_hold_bytes(self) -> int:
        """What the loss and its seed add to every op after the post backward has started."""
        return 2 * self.loss_bytes


@dataclass(frozen=True)
class Chain:
    layers: tuple[Layer, ...]
    pre: Pre
    post: Post
    x_in_bytes: int  # the chain input (held by pre)
    delta_in_bytes: int  # gradient of the chain input, made by B(0); 0 when it needs none
    persistent_bytes: int  # params + buffers + batch + optimizer state (+ all grads when accum > 1)
    opt_step_peak_bytes: int  # absolute peak of optimizer.step()
    name: str = ""
    # Breakdown of the fixed memory, only for messages; 0 when unknown.
    param_bytes: int = 0
    total_grad_bytes: int = 0
    optimizer_bytes: int = 0
    optimizer_scalar_bytes: int = 0  # the part of optimizer_bytes that is not sharded (step counters)
    optimizer: str = ""  # the optimizer's name (adamw, sgd-momentum, sgd); "" when unknown
    grads_in_persistent: bool = False  # gradient accumulation: all gradients are in persistent_bytes
    opt_ms: float = 0.0  # the optimizer step's time per micro-batch (its step / accum); 0 when unknown
    side_inputs: tuple[SideInput, ...] = ()  # kept by checkpoints until their backward (above)
    # Layers b that do not receive layer b-1's output as an argument (the model changes it between
    # the calls): no checkpoint can span layers b-1 and b (Profile.chain_breaks).
    breaks: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", tuple(self.layers))
        if not self.layers:
            raise ValueError("a chain needs at least one layer")
        for i, ly in enumerate(self.layers):
            sizes = (ly.x_bytes, ly.xbar_bytes, ly.fwd_tmp_bytes, ly.bwd_tmp_bytes, ly.grad_bytes,
                     ly.cast_bytes, ly.unsaved_kept_bytes, ly.kept_after_bytes, ly.recompute_kept_bytes,
                     ly.recompute_chain_kept_bytes, ly.held_bytes, ly.gather_bytes, ly.retained_bytes,
                     *(v for v in (ly.held_fwd_tmp_bytes, ly.held_bwd_tmp_bytes) if v is not None))
            if any(not isinstance(v, int) or v < 0 for v in sizes):
                raise ValueError(f"layer {i} ({ly.name}): sizes must be non-negative ints, got {sizes}")
            if ly.x_kept and not ly.in_place and ly.xbar_bytes < ly.x_bytes:
                raise ValueError(f"layer {i} ({ly.name}): xbar {ly.xbar_bytes} < x {ly.x_bytes} (a stored "
                                 "layer keeps its output unless x_kept is False or it is in_place)")
            if (ly.early_xbar_bytes is None) != (ly.early_fwd_tmp_bytes is None):
                raise ValueError(f"layer {i} ({ly.name}): early_xbar_bytes and early_fwd_tmp_bytes "
                                 "are given together or not at all")
            if ly.early_xbar_bytes is not None and ly.in_place:
                raise ValueError(f"layer {i} ({ly.name}): an in-place layer has no early-stop sizes "
                                 "(a recompute starting at it runs on a copy)")
            if ly.early_xbar_bytes is not None:
                ex, et = ly.early_xbar_bytes, ly.early_fwd_tmp_bytes
                if (not isinstance(ex, int) or not isinstance(et, int) or ex < 0 or et < 0
                        or ex > ly.xbar_bytes or ex + et > ly.xbar_bytes + ly.fwd_tmp_bytes):
                    raise ValueError(f"layer {i} ({ly.name}): early sizes ({ex}, {et}) must be "
                                     "non-negative ints with early_xbar <= xbar and a peak no "
                                     "higher than the whole forward's")
            if ly.fwd_ms < 0 or ly.bwd_ms < 0:
                raise ValueError(f"layer {i} ({ly.name}): negative time")
            if not 0 <= ly.tail_ms <= ly.fwd_ms:
                raise ValueError(f"layer {i} ({ly.name}): tail_ms {ly.tail_ms} not within [0, fwd_ms "
                                 f"{ly.fwd_ms}]")
            object.__setattr__(ly, "options", tuple(ly.options))
            names = [o.name for o in ly.options]
            if len(set(names)) != len(names) or STORE in names or "full" in names:
                raise ValueError(f"layer {i} ({ly.name}): option names must be unique and not "
                                 f"'store' or 'full', got {names}")
            for o in ly.options:
                osz = (o.xbar_bytes, o.fwd_tmp_bytes, o.bwd_tmp_bytes,
                       *(v for v in (o.held_fwd_tmp_bytes, o.held_bwd_tmp_bytes) if v is not None))
                if any(not isinstance(v, int) or v < 0 for v in osz) or o.xbar_bytes < ly.x_bytes:
                    raise ValueError(f"layer {i} ({ly.name}) option {o.name}: sizes must be "
                                     f"non-negative ints with xbar >= x, got {osz}")
                if o.recompute_ms < 0:
                    raise ValueError(f"layer {i} ({ly.name}) option {o.name}: negative time")
        fixed = (self.pre.retained_bytes, self.pre.fwd_tmp_bytes, self.pre.bwd_tmp_bytes,
                 self.pre.grad_bytes, self.post.xbar_bytes, self.post.fwd_tmp_bytes,
                 self.post.bwd_tmp_bytes, self.post.grad_bytes, self.post.loss_bytes, self.x_in_bytes,
                 self.delta_in_bytes, self.persistent_bytes, self.opt_step_peak_bytes)
        if any(not isinstance(v, int) or v < 0 for v in fixed):
            raise ValueError(f"pre/post/fixed sizes must be non-negative ints, got {fixed}")
        object.__setattr__(self, "side_inputs", tuple(self.side_inputs))
        object.__setattr__(self, "breaks", tuple(sorted(set(self.breaks))))
        if any(not isinstance(b, int) or not 0 < b < len(self.layers) for b in self.breaks):
            raise ValueError(f"chain breaks {self.breaks} must be layer indices 1..{len(self.layers) - 1}")
        for si in self.side_inputs:
            if (not isinstance(si.bytes, int) or si.bytes < 0 or not isinstance(si.grad_bytes, int)
                    or si.grad_bytes < 0 or not si.layers
                    or any(not 0 <= i < len(self.layers) for i in si.layers)
                    or not -1 <= si.made_by < min(si.layers)):
                raise ValueError(f"side input {si}: bytes must be a non-negative int, layers "
                                 f"indices of the {len(self.layers)} chain layers, made_by -1 or a "
                                 "layer before them")

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    @property
    def has_casts(self) -> bool:
        """Whether any layer has autocast copies (the DP does not model them; see dp.py)."""
        return any(ly.cast_bytes for ly in self.layers)

    @property
    def has_holds(self) -> bool:
        """Whether some layer is held through its checkpoint's backward (``Layer.held_bytes``
        and the held transients; FSDP2 per rank)."""
        return any(ly.held_bytes or ly.gather_bytes or ly.retained_bytes or ly.held_fwd_tmp_bytes is not None
                   or ly.held_bwd_tmp_bytes is not None for ly in self.layers)

    @property
    def has_options(self) -> bool:
        """Whether any layer has selective options besides ``store``."""
        return any(ly.options for ly in self.layers)

    @property
    def side_bytes(self) -> int:
        return sum(si.bytes for si in self.side_inputs)

    @property
    def unsaved_bytes(self) -> int:
        """An upper bound on what the layers' first forwards keep until the backward is over,
        whatever the plan: a checkpointed layer keeps ``Layer.unsaved_kept_bytes`` from its
        forward on, a stored one ``kept_after_bytes`` from its backward on."""
        return sum(max(ly.unsaved_kept_bytes, ly.kept_after_bytes)
                   + max(ly.recompute_kept_bytes, ly.recompute_chain_kept_bytes) for ly in self.layers)

    @property
    def side_grad_bytes(self) -> int:
        """The side inputs' gradients (``SideInput.grad_bytes``), all of them."""
        return sum(si.grad_bytes for si in self.side_inputs)

    def side_grads_at(self) -> tuple[dict[int, int], dict[int, int]]:
        """Where the side inputs' gradients appear and go, per stage backward: (after B(i) they
        appear: the last layer reading them; after B(i) they go: their maker, -1 for pre)."""
        made: dict[int, int] = {}
        gone: dict[int, int] = {}
        for si in self.side_inputs:
            if si.grad_bytes:
                last = max(si.layers)
                made[last] = made.get(last, 0) + si.grad_bytes
                gone[si.made_by] = gone.get(si.made_by, 0) + si.grad_bytes
        return made, gone

    @property
    def all_kept(self) -> bool:
        """Whether every boundary tensor (the chain input and each layer's output) is kept by the
        plain forward: the DP tables' model (rotor's: a stored layer keeps its output)."""
        return self.pre.x_kept and all(ly.x_kept and ly.x_kept_next and not ly.in_place
                                       for ly in self.layers)

    def input_hold(self, s: int) -> int:
        """Bytes a checkpoint starting at layer ``s`` keeps beyond the plain forward when the item
        before it is ``Store(s - 1)`` (pre for ``s = 0``): its input, when no op saves it."""
        if s == 0:
            return 0 if self.pre.x_kept else self.x_in_bytes
        ly = self.layers[s - 1]
        return 0 if ly.x_kept else ly.x_bytes

    def conservative(self) -> Chain:
        """The chain with every boundary kept (``xbar`` plus the output where it was not): its
        plans peak no lower than on this chain, op by op, so a plan the DP fits to a budget on it
        fits here too. What the DP plans on when :attr:`all_kept` is False (``dp.plan_dp``)."""
        if self.all_kept:
            return self
        pre = self.pre if self.pre.x_kept else replace(
            self.pre, retained_bytes=self.pre.retained_bytes + self.x_in_bytes, x_kept=True)
        return replace(self, pre=pre, layers=tuple(
            ly if ly.x_kept and ly.x_kept_next and not ly.in_place else
            replace(ly, x_kept_next=True) if ly.x_kept and not ly.in_place else
            replace(ly, xbar_bytes=ly.xbar_bytes + ly.x_bytes, x_kept=True, in_place=False,
                    x_kept_next=True)
            for ly in self.layers))

    def without_options(self) -> Chain:
        """The same chain with only ``store`` and ``full`` for every layer."""
        if not self.has_options:
            return self
        return replace(self, layers=tuple(replace(ly, options=()) for ly in self.layers))

    @property
    def base_step_ms(self) -> float:
        """One forward and one backward of everything, and the optimizer's share of its step: the
        step time without checkpointing (per micro-batch)."""
        return (self.pre.fwd_ms + self.pre.bwd_ms + self.post.fwd_ms + self.post.bwd_ms
                + sum(ly.fwd_ms + ly.bwd_ms for ly in self.layers) + self.opt_ms)
