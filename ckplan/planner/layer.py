"""One layer of the cost model (``Layer``) and its selective options (``Option``); the chain
that strings them together is ``chain.py``, whose docstring explains the quantities."""
from __future__ import annotations

from dataclasses import dataclass, replace

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
    # autocast's weight copies the layer's forward makes and the option does not keep: in autocast's
    # cache until the forward ends (a stored layer's own are in its xbar)
    cast_bytes: int = 0


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
    # of those, the copies no op saves: a stored layer leaves them in autocast's cache to the forward's end
    unsaved_cast_bytes: int = 0
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
    # The layer changes an argument in place without returning it (``x.mul_(0.5)``): a checkpoint
    # starting at it gives it a copy of its input (ckplan.execute, ``Plan.params["copy_inputs"]``),
    # live through its first forward and kept by its recompute: the input's bytes more in both.
    copies_input: bool = False
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

    def fn_tmp(self, rotor: int, counted: int = 0) -> int:
        """The transient of a forward that keeps only the output, above ``live + x_bytes +
        counted``: rotor's estimate ``rotor``, or more where the measured no-save forward peaked
        higher. ``counted``: what else the forward makes that live bytes already count (autocast's
        weight copies, cached to the forward's end, which the no-save peak includes)."""
        if self.nosave_peak_bytes is None:
            return rotor
        return max(rotor, self.nosave_peak_bytes - self.x_bytes - counted)

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
                               held_bwd_tmp_bytes=o.held_bwd_tmp_bytes, cast_bytes=o.cast_bytes)
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
