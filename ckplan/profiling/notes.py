"""The notes a profile carries (``Profile.notes``): what it assumed, and where the model does
something the memory model handles only on the safe side. Each names up to 8 layers (12 breaks)."""
from __future__ import annotations

import torch

from ..execute import spans_layers
from ..measure import KEPT_MEMORY_NOTE
from ..records import CHAIN, StageRecord
from ..units import format_bytes
from .flops import estimated_note
from .passes import MeasuredPass

SPAN_NOTE = ("torch {version}'s checkpoint frames cannot span several layers here (ckplan.execute."
             "spans_layers): every checkpoint is one layer, in the plans and their predicted peaks")
LEFT_NOTE = ("layers whose recompute leaves tensors alive after the backward (a tensor of the forward "
             "kept on the module, as `self.last_attn = attn` does, holds the recompute's graph until "
             "the layer's next forward): planned as kept to the end of the step with the layer's input, "
             "on the safe side (README: known limits)")
OUTSIDE_NOTE = ("tensors the model's own code saves between two chain layers (outside every layer: "
                "a checkpoint does not drop them; planned as kept until the backward ends, and "
                "checkpointing the layer before saves less; README: known limits)")
BREAKS_NOTE = ("layers that do not receive the previous layer's output as an argument (the model "
               "changes it between the two calls: a residual added in the loop, a skip connection): "
               "no checkpoint spans such a boundary, and every plan is cut there; layers")
CARRIED_NOTE = ("layers that hand the next layer more than one tensor (counted together as the "
                "boundary a checkpoint keeps; rotor's model has one tensor per boundary): on such "
                "chains ckplan's tests predict checkpointed plans exactly or within one boundary "
                "tensor, high or low (docs/memory-model.md: one boundary size per layer); bytes besides the first")
UNKEPT_NOTE = ("outputs no op saves (freed once the next stage has run; a checkpoint starting there "
               "keeps them)")
LOOSE_NOTE = ("tensors a checkpoint cannot drop (kept with nothing saved: a custom autograd "
              "Function's ctx attributes, or a cache)")
CHANGES_INPUT_NOTE = ("layers that change their input in place (an in-place op on an argument: "
                      "x.mul_(...), x += ...): a checkpoint starting at one gives it a copy of the hidden "
                      "state (ckplan's plans name them, params copy_inputs, and count the copy); a plan "
                      "made without that stops with an error there; layers")
CONTAINER_NOTE = ("layers that write tensors into a container argument (Gemma 4's shared_kv_states): a "
                  "checkpointed call keeps what the container held at the call (later layers' recompute "
                  "reads it) until the checkpoint's backward, which the memory model does not count: "
                  "checkpointed plans may peak up to those tensors' bytes above the prediction; layers")
OWN_NOTE = ("outputs saved only by their own layer's ops (nothing after them saves them, so a "
            "checkpoint ending there frees them once the next stage has run)")


def _layer_bytes(by_layer: dict[int, int]) -> str:
    """'layer 3 (1.0 MiB), ...' for the first 8, then ' and more'."""
    names = ", ".join(f"layer {i} ({format_bytes(b)})" for i, b in list(by_layer.items())[:8])
    return f"{names}{' and more' if len(by_layer) > 8 else ''}"


def step_notes(rows: tuple[StageRecord, ...], measured: MeasuredPass, *, sdpa_note: str,
               option_notes: list[str], flops_estimated: dict[str, str], unsaved_kept: dict[int, int],
               kept_memory: bool, compiled_graphs: int | None) -> tuple[str, ...]:
    """The profile's notes, in a fixed order. ``unsaved_kept``: the no-save pass's bytes alive per
    chain layer; ``kept_memory``: the allocator kept freed memory (KEPT_MEMORY_NOTE);
    ``compiled_graphs``: the compiled layers' graph count, None for eager layers."""
    eager = compiled_graphs is None
    notes: list[str] = [sdpa_note] if sdpa_note else []
    notes += option_notes
    flop_note = estimated_note(flops_estimated)
    if flop_note:
        notes.append(flop_note)
    unkept = [r for r in rows if r.output_kept is False]
    if unkept:
        names = ", ".join("the chain input" if r.index < 0 else f"layer {r.index}" for r in unkept[:8])
        more = f" and {len(unkept) - 8} more" if len(unkept) > 8 else ""
        notes.append(f"{UNKEPT_NOTE}: {names}{more}; their saved bytes leave them out (README: memory model)")
    # Alive when a forward that saves nothing ends (a custom autograd Function keeping a tensor as
    # a ctx attribute, a cache on the module): the saved-tensor hooks do not see it, so a
    # checkpoint does not drop it (StageRecord.unsaved_kept_bytes, modelled).
    loose = {i: b for i, b in unsaved_kept.items() if b > 0}
    if eager and loose:
        notes.append(f"{LOOSE_NOTE}: {_layer_bytes(loose)}; planned as kept until the backward ends, and "
                     "checkpointing those layers saves less (README: memory model)")
    if measured.carried:
        # A layer that hands the next one several tensors (two streams, (hidden, residual) pairs):
        # they are one boundary, and its backward starts at the first of their gradients.
        notes.append(f"{CARRIED_NOTE}: {_layer_bytes(dict(sorted(measured.carried.items())))}")
    own = [r.index for r in rows if r.output_saved_after is False]
    if own:
        names = ", ".join(f"layer {i}" for i in own[:8]) + (f" and {len(own) - 8} more" if len(own) > 8 else "")
        notes.append(f"{OWN_NOTE}: {names} (README: memory model)")
    for text, layers in ((CHANGES_INPUT_NOTE, measured.changes_input), (CONTAINER_NOTE, measured.writes_container)):
        if layers:
            ordered = sorted(layers)
            notes.append(f"{text} " + ", ".join(str(i) for i in ordered[:8])
                         + (f" and {len(ordered) - 8} more" if len(ordered) > 8 else ""))
    if kept_memory:
        notes.append(KEPT_MEMORY_NOTE)
    if not eager:
        notes.append(f"chain layers compiled (torch.compile, TorchInductor; {compiled_graphs} graph(s)): "
                     "their saved bytes, memory and times are the compiled layers'; FLOPs are eager's")
    left = {r.index: r.recompute_kept_bytes for r in rows if r.role == CHAIN and r.recompute_kept_bytes}
    if left:
        notes.append(f"{LEFT_NOTE}: {_layer_bytes(left)}")
    outside = {i: b for i, b in sorted(measured.outside_saved.items()) if b > 0}
    if outside and eager:
        notes.append(f"{OUTSIDE_NOTE}: {_layer_bytes(outside)}")
    return tuple(notes)


def chain_breaks(breaks: frozenset[int], n: int) -> tuple[tuple[int, ...], str | None]:
    """The boundaries no checkpoint spans (``Profile.chain_breaks``) and the note that says why:
    where this torch's checkpoints cannot span layers, every boundary (plans made here must be
    what the executor runs here: one-layer checkpoints)."""
    if not spans_layers() and n > 1:
        return tuple(range(1, n)), SPAN_NOTE.format(version=torch.__version__)
    ordered = tuple(sorted(breaks))
    if not ordered:
        return ordered, None
    names = ", ".join(str(b) for b in ordered[:12]) + (" ..." if len(ordered) > 12 else "")
    return ordered, f"{BREAKS_NOTE}: {names}"
