"""The planner's cost model: a chain of layers between a fixed *pre* and a fixed *post* stage.

Per layer we keep rotor's quantities (Beaumont et al. 2019/2021, "Optimal checkpointing for
heterogeneous chains"): forward/backward time, the output size ``x``, the bytes kept when the layer
is stored ``xbar`` (it includes ``x``), transient peaks during forward and backward, plus the
parameter-gradient bytes that appear at the end of the layer's backward. Everything before the
chain (embeddings, stem) is the *pre* stage and everything after (head, loss) the *post* stage;
both are always stored. ``persistent_bytes`` (parameters, buffers, the batch, optimizer state) is
live for the whole step.

Types only: building a chain from a profile is :mod:`ckplan.planner.calibrate`. A chain whose
values are out of range (a negative size, ``xbar < x``, a side input naming a layer it lacks)
raises :class:`ckplan.errors.ChainError`, a ValueError.

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
One that some layers' own ops save (``SideInput.saved_by``: rotary ``(cos, sin)`` that only the
attention layers of a hybrid model multiply in) is kept, without checkpoints, until the backward of
the first of those layers; a layer stored with ``store`` among them holds it like a checkpoint.
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

from ..errors import ChainError
from ..records import SideInput
from .layer import STORE, Layer, Option

__all__ = ["STORE", "Chain", "Layer", "Option", "Post", "Pre"]


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
    cast_bytes: int = 0  # autocast copies its forward makes that no op saves: live to the forward's end


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
    # (stage, bytes) of sums of gradient shares (made in the last user's backward, in its
    # ``grad_bytes``: StageRecord.shared_grad_bytes) that go on after this stage's backward.
    shared_grads_done: tuple[tuple[int, int], ...] = ()
    opt_ms: float = 0.0  # the optimizer step's time per micro-batch (its step / accum); 0 when unknown
    side_inputs: tuple[SideInput, ...] = ()  # kept by checkpoints until their backward (above)
    # Layers b that do not receive layer b-1's output as an argument (the model changes it between
    # the calls): no checkpoint can span layers b-1 and b (Profile.chain_breaks).
    breaks: tuple[int, ...] = ()
    # The host link for activation offload (``offload``, a top-level Store option): bytes per ms
    # of a pinned copy device -> host and back. 0: no offload (a CPU, or not measured).
    d2h_bytes_per_ms: float = 0.0
    h2d_bytes_per_ms: float = 0.0
    # Whether a layer with a SAC option may also offload what the option keeps ("sac-compute+offload",
    # plan_items.OFFLOADED): the torch that runs the plan routes SAC's cache through saved-tensor
    # hooks (2.14 on); set by ckplan.api_plan.
    offload_options: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", tuple(self.layers))
        if not self.layers:
            raise ChainError("a chain needs at least one layer")
        for i, ly in enumerate(self.layers):
            sizes = (ly.x_bytes, ly.xbar_bytes, ly.fwd_tmp_bytes, ly.bwd_tmp_bytes, ly.grad_bytes,
                     ly.cast_bytes, ly.unsaved_kept_bytes, ly.kept_after_bytes, ly.recompute_kept_bytes,
                     ly.recompute_chain_kept_bytes, ly.held_bytes, ly.gather_bytes, ly.retained_bytes,
                     *(v for v in (ly.held_fwd_tmp_bytes, ly.held_bwd_tmp_bytes) if v is not None))
            if any(not isinstance(v, int) or v < 0 for v in sizes):
                raise ChainError(f"layer {i} ({ly.name}): sizes must be non-negative ints, got {sizes}")
            if ly.x_kept and not ly.in_place and ly.xbar_bytes < ly.x_bytes:
                raise ChainError(f"layer {i} ({ly.name}): xbar {ly.xbar_bytes} < x {ly.x_bytes} (a stored "
                                 "layer keeps its output unless x_kept is False or it is in_place)")
            if (ly.early_xbar_bytes is None) != (ly.early_fwd_tmp_bytes is None):
                raise ChainError(f"layer {i} ({ly.name}): early_xbar_bytes and early_fwd_tmp_bytes "
                                 "are given together or not at all")
            if ly.early_xbar_bytes is not None and ly.in_place:
                raise ChainError(f"layer {i} ({ly.name}): an in-place layer has no early-stop sizes "
                                 "(a recompute starting at it runs on a copy)")
            if ly.early_xbar_bytes is not None:
                ex, et = ly.early_xbar_bytes, ly.early_fwd_tmp_bytes
                if (not isinstance(ex, int) or not isinstance(et, int) or ex < 0 or et < 0
                        or ex > ly.xbar_bytes or ex + et > ly.xbar_bytes + ly.fwd_tmp_bytes):
                    raise ChainError(f"layer {i} ({ly.name}): early sizes ({ex}, {et}) must be "
                                     "non-negative ints with early_xbar <= xbar and a peak no "
                                     "higher than the whole forward's")
            if ly.fwd_ms < 0 or ly.bwd_ms < 0:
                raise ChainError(f"layer {i} ({ly.name}): negative time")
            if not 0 <= ly.tail_ms <= ly.fwd_ms:
                raise ChainError(f"layer {i} ({ly.name}): tail_ms {ly.tail_ms} not within [0, fwd_ms "
                                 f"{ly.fwd_ms}]")
            object.__setattr__(ly, "options", tuple(ly.options))
            names = [o.name for o in ly.options]
            if len(set(names)) != len(names) or STORE in names or "full" in names:
                raise ChainError(f"layer {i} ({ly.name}): option names must be unique and not "
                                 f"'store' or 'full', got {names}")
            for o in ly.options:
                osz = (o.xbar_bytes, o.fwd_tmp_bytes, o.bwd_tmp_bytes,
                       *(v for v in (o.held_fwd_tmp_bytes, o.held_bwd_tmp_bytes) if v is not None))
                if any(not isinstance(v, int) or v < 0 for v in osz) or o.xbar_bytes < ly.x_bytes:
                    raise ChainError(f"layer {i} ({ly.name}) option {o.name}: sizes must be "
                                     f"non-negative ints with xbar >= x, got {osz}")
                if o.recompute_ms < 0:
                    raise ChainError(f"layer {i} ({ly.name}) option {o.name}: negative time")
        fixed = (self.pre.retained_bytes, self.pre.fwd_tmp_bytes, self.pre.bwd_tmp_bytes,
                 self.pre.grad_bytes, self.post.xbar_bytes, self.post.fwd_tmp_bytes,
                 self.post.bwd_tmp_bytes, self.post.grad_bytes, self.post.loss_bytes, self.x_in_bytes,
                 self.delta_in_bytes, self.persistent_bytes, self.opt_step_peak_bytes)
        if any(not isinstance(v, int) or v < 0 for v in fixed):
            raise ChainError(f"pre/post/fixed sizes must be non-negative ints, got {fixed}")
        if not (self.d2h_bytes_per_ms >= 0 and self.h2d_bytes_per_ms >= 0):
            raise ChainError(f"host link bandwidths must be >= 0, got {self.d2h_bytes_per_ms}, "
                             f"{self.h2d_bytes_per_ms}")
        object.__setattr__(self, "side_inputs", tuple(self.side_inputs))
        object.__setattr__(self, "breaks", tuple(sorted(set(self.breaks))))
        if any(not isinstance(b, int) or not 0 < b < len(self.layers) for b in self.breaks):
            raise ChainError(f"chain breaks {self.breaks} must be layer indices 1..{len(self.layers) - 1}")
        for si in self.side_inputs:
            if (not isinstance(si.bytes, int) or si.bytes < 0 or not isinstance(si.grad_bytes, int)
                    or si.grad_bytes < 0 or not si.layers
                    or any(not 0 <= i < len(self.layers) for i in si.layers)
                    or not -1 <= si.made_by < min(si.layers)
                    or not set(si.saved_by) <= set(si.layers) or not set(si.unrelayed) <= set(si.layers)
                    or not _partial_ok(si, len(self.layers)) or not (si.grad_from == -1 or si.grad_from in si.layers)):
                raise ChainError(f"side input {si}: bytes must be a non-negative int, layers "
                                 f"indices of the {len(self.layers)} chain layers, made_by -1 or a "
                                 "layer before them, saved_by and unrelayed some of its layers, "
                                 "partial_span (from, to) with to <= from < the last layer, grad_from -1 "
                                 "or one of its layers")

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    @property
    def has_casts(self) -> bool:
        """Whether any layer has autocast copies (the DP does not model them; see solve/)."""
        return bool(self.pre.cast_bytes) or any(ly.cast_bytes for ly in self.layers)

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
    def can_offload(self) -> bool:
        """Whether plans may offload layers: a host link both ways."""
        return self.d2h_bytes_per_ms > 0 and self.h2d_bytes_per_ms > 0

    def offload_bytes(self, i: int, option: str = STORE) -> int:
        """What offloading layer ``i`` stored with ``option`` moves to the host: what storing it
        keeps, less its output when some op keeps that (the next layer reads it from the device)."""
        ly = self.layers[i].option(option)
        return ly.xbar_bytes - (ly.x_bytes if ly.x_kept and not ly.in_place else 0)

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
        """The side inputs' gradients (``SideInput.grad_bytes``, ``partial_bytes``), all of them."""
        return sum(si.grad_bytes + si.partial_bytes for si in self.side_inputs)

    def side_grads_at(self) -> tuple[dict[int, int], dict[int, int]]:
        """Where the side inputs' gradients appear and go, per stage backward: (after B(i) they
        appear: the last layer reading them; after B(i) they go: their maker, -1 for pre)."""
        made: dict[int, int] = {}
        gone: dict[int, int] = {}
        for si in self.side_inputs:
            if si.grad_bytes:
                last = si.grad_from if si.grad_from >= 0 else max(si.layers)
                made[last] = made.get(last, 0) + si.grad_bytes
                gone[si.made_by] = gone.get(si.made_by, 0) + si.grad_bytes
            if si.partial_bytes:  # held before B(frm), after B(frm + 1); summed in B(to)
                frm, to = si.partial_span
                made[frm + 1] = made.get(frm + 1, 0) + si.partial_bytes
                gone[to] = gone.get(to, 0) + si.partial_bytes
        for stage, nbytes in self.shared_grads_done:  # accumulated into .grad, the sum is freed
            gone[stage] = gone.get(stage, 0) + nbytes
        return made, gone

    @property
    def all_kept(self) -> bool:
        """Whether every boundary tensor (the chain input and each layer's output) is kept by the
        plain forward: the DP tables' model (rotor's: a stored layer keeps its output)."""
        return self.pre.x_kept and all(ly.x_kept and ly.x_kept_next and not ly.in_place
                                       and not ly.copies_input for ly in self.layers)

    def copy_bytes(self, k: int) -> int:
        """The copy of layer ``k``'s input a checkpoint starting at it gives it (ckplan.execute)."""
        ly = self.layers[k]
        return ly.x_bytes if ly.in_place else self.layers[k - 1].x_bytes if k > 0 else self.x_in_bytes

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
        fits here too. What the DP plans on when :attr:`all_kept` is False (``solve.plan_dp``)."""
        if self.all_kept:
            return self
        pre = self.pre if self.pre.x_kept else replace(
            self.pre, retained_bytes=self.pre.retained_bytes + self.x_in_bytes, x_kept=True)
        layers = tuple(
            ly if ly.x_kept and ly.x_kept_next and not ly.in_place else
            replace(ly, x_kept_next=True) if ly.x_kept and not ly.in_place else
            replace(ly, xbar_bytes=ly.xbar_bytes + ly.x_bytes, x_kept=True, in_place=False,
                    x_kept_next=True)
            for ly in self.layers)
        # a layer given a copy of its input where a checkpoint starts at it: the copy counted
        # wherever it runs, through its forward and kept with what it saves
        return replace(self, pre=pre, layers=tuple(_copy_counted(ly, self.copy_bytes(k)) if ly.copies_input else ly
                                                   for k, ly in enumerate(layers)))

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


def _copy_counted(ly: Layer, copy: int) -> Layer:
    """``ly`` (``copies_input``) with its input's copy counted wherever it runs (``Chain.conservative``)."""
    return replace(ly, copies_input=False, xbar_bytes=ly.xbar_bytes + copy, fwd_tmp_bytes=ly.fwd_tmp_bytes + copy,
                   nosave_peak_bytes=None if ly.nosave_peak_bytes is None else ly.nosave_peak_bytes + copy)


def _partial_ok(si: SideInput, n: int) -> bool:
    """``partial_bytes`` >= 0, with a span (from, to), 0 <= to <= from < n - 1, when not 0."""
    if not si.partial_bytes:
        return si.partial_bytes == 0
    return len(si.partial_span) == 2 and 0 <= si.partial_span[1] <= si.partial_span[0] < n - 1
