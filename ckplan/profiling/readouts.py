"""What the instrument's records say per stage: the windows between marks, and the saved, live and
kept bytes each stage's forward leaves when the forward ends.

Pure functions over the records :class:`~ckplan.profiling.instrument.Instrument` keeps while a step
runs (storage id -> weakref of what autograd saved, storage id -> the window that allocated it, ...):
the instrument reads them out at the end of the forward and after the backward.

Stages: -1 is pre (before the chain), 0..n-1 the chain layers, n post (head and loss). A window is
``(phase, stage)``: phase "F" (forward), "B" (backward), or "in" (compiled layers: a storage that
came into layer i as an argument, see ``Instrument.first_seen``).
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass

from ..errors import ModelRunError
from ..measure import LiveTensorTracker

# packed_by's mark for a tensor saved outside every chain layer (pre, post, the model's own code)
OUTSIDE = -2

Window = tuple[str, int]


@dataclass
class Mark:
    phase: str  # "F", "B" or "end"
    stage: int  # -1 pre, 0..n-1 chain, n post
    t_ms: float
    live: int  # live bytes at the mark (relative to the step start)
    peak: int  # peak live bytes since the previous mark
    flops: int  # cumulative FLOPs at the mark
    ops: int = 0  # ops recorded so far by an OpCounter (0 without one)


def windows(marks: list[Mark], n: int) -> dict[Window, dict]:
    """(phase, stage) -> {ms, live_start, live_end, peak, flops} from consecutive marks."""
    order = [(m.phase, m.stage) for m in marks if m.phase == "F"]
    expected = [("F", s) for s in range(-1, n + 1)]
    if order != expected:
        got = [s for _, s in order if 0 <= s < n]  # (F(-1) and F(n) are the stages around them)
        if not got:  # no layer's hooks fired: called as layer.forward(...), not layer(...)
            raise ModelRunError(
                f"the model never called the {n} chain layers as modules: no forward hook of "
                "theirs fired, so its forward does not use them, or calls them some other way "
                "(`layer.forward(x)` skips PyTorch's module hooks, as SqueezeBERT's encoder does), and "
                "ckplan can neither measure nor checkpoint them there",
                tip="set `chain:` to a container the model calls as `layer(x)`, or change the model's "
                    "loop to call `layer(...)` instead of `layer.forward(...)`")
        skipped = sorted(set(range(n)) - set(got))
        if skipped and got == sorted(set(got)):  # in order, some left out: layers dropped at random
            raise ModelRunError(
                f"the chain's layers {skipped[:12]} were skipped in this training step (calls {got[:12]} for "
                f"{n} layers): the model drops layers at random in training (LayerDrop, stochastic "
                "depth), so no plan over a fixed chain can be measured or applied",
                tip="set the layer-drop probability to 0 for the run (Hugging Face: layerdrop, "
                    "encoder_layerdrop, decoder_layerdrop in model.hf)")
        raise ModelRunError(
            f"the chain's layers were not called once each, in order: saw layer calls {got[:12]}"
            f"{'...' if len(got) > 12 else ''} for {n} layers",
            tip="set `chain:` to a container whose entries the model calls exactly once per step, in "
                "order (one module object at two places in it is seen as both at each call)")
    out = {}
    for a, b in zip(marks, marks[1:]):
        out[(a.phase, a.stage)] = dict(ms=b.t_ms - a.t_ms, live_start=a.live, live_end=b.live,
                                       peak=max(b.peak, a.live, b.live), flops=b.flops - a.flops,
                                       ops=(a.ops, b.ops))
    return out


def saved_by_stage(saved: dict[int, weakref.ref], alloc_window: dict[int, Window]) -> dict[int, int]:
    """Per stage: bytes of the saved storages its forward made that are still alive."""
    out: dict[int, int] = {}
    for k, ref in saved.items():
        st = ref()
        window = alloc_window.get(k)
        if st is None or window is None or window[0] != "F":
            continue  # freed already, or not made during this forward (inputs, buffers)
        out[window[1]] = out.get(window[1], 0) + st.nbytes()
    return out


def early_kept_by_stage(saved: dict[int, weakref.ref], alloc_window: dict[int, Window],
                        packed_by: dict[int, set[int]]) -> dict[int, int]:
    """Per chain layer: bytes of the storages its forward made and its own ops saved, alive
    when the forward ends (what a recompute stopped at its last saved tensor leaves)."""
    out: dict[int, int] = {}
    for k, ref in saved.items():
        st = ref()
        window = alloc_window.get(k)
        if st is None or window is None or window[0] != "F" or window[1] not in packed_by.get(k, ()):
            continue
        out[window[1]] = out.get(window[1], 0) + st.nbytes()
    return out


def outside_saved_by_stage(saved: dict[int, weakref.ref], alloc_window: dict[int, Window],
                           packed_by: dict[int, set[int]], out_storage: dict[int, weakref.ref],
                           n: int) -> dict[int, int]:
    """Per chain layer i but the last: bytes of the storages made in its window (the layer
    or the model's code after it, before the next layer) that only code outside every chain
    layer saved (a norm the container applies between layers; PoolFormer's stages between
    the patch embeddings its chain is made of), besides the boundary. A checkpoint over
    layer i does not drop them: they are kept whatever the plan."""
    out: dict[int, int] = {}
    for k, ref in saved.items():
        st = ref()
        window = alloc_window.get(k)
        if st is None or window is None or window[0] != "F" or not 0 <= window[1] < n - 1:
            continue
        who = packed_by.get(k, ())
        if not who or any(w != OUTSIDE for w in who):
            continue
        boundary = out_storage.get(window[1])
        if boundary is not None and boundary() is st:
            continue
        out[window[1]] = out.get(window[1], 0) + st.nbytes()
    return out


def saved_after(kept: dict[int, bool | None], out_storage: dict[int, weakref.ref],
                packed_by: dict[int, set[int]]) -> dict[int, bool]:
    """Per chain layer whose output is kept: whether some op after the layer saved it too,
    or only the layer's own ops did
    (a block ending with a ReLU, read next by a pooling that saves nothing: HF ResNet's last
    stage). A checkpoint ending at such a layer saves nothing inside, so PyTorch frees the
    output once the next stage has read it."""
    out: dict[int, bool] = {}
    for i, is_kept in kept.items():
        ref = out_storage.get(i)
        st = ref() if ref is not None else None
        if i < 0 or not is_kept or st is None:
            continue
        # made here, or an earlier layer's storage returned in place (the layers before
        # cannot have saved it on the layer's behalf: they ran before it changed it)
        out[i] = any(who == OUTSIDE or who > i for who in packed_by.get(id(st), ()))
    return out


def kept_boundaries(out_storage: dict[int, weakref.ref], alloc_window: dict[int, Window],
                    saved: dict[int, weakref.ref],
                    tracker: LiveTensorTracker | None) -> tuple[dict[int, bool | None], set[int]]:
    """Per boundary (-1: the chain input, i: layer i's output) whether the forward keeps it
    for backward: some op saved its storage and it is alive. None where that does not say
    what a plan keeps (the storage was made outside the stage that returned it: an in-place
    or pass-through layer), or it is alive without being saved (referenced elsewhere). The
    chain input made before the forward (the batch itself) is kept: persistent memory.
    Also returns the layers that return their input's storage (in place)."""
    out: dict[int, bool | None] = {}
    aliased: set[int] = set()
    for i, ref in out_storage.items():
        st = ref()
        if st is None:  # freed already: nothing kept it
            out[i] = False
            continue
        k = id(st)
        made = alloc_window.get(k)
        if i == -1 and made is None:
            out[i] = True  # the batch (or a buffer): alive for the whole step anyway
            continue
        ref_saved = saved.get(k)
        is_saved = ref_saved is not None and ref_saved() is st
        if made != ("F", i):
            # Returned in place (ReLU(inplace=True)) or passed through: the storage is the
            # earlier boundary's, already in that stage's saved bytes when some op saved it.
            prev = out_storage.get(i - 1)
            same = i >= 0 and prev is not None and prev() is st
            out[i] = True if same and is_saved else None
            if same:
                aliased.add(i)
        elif is_saved:
            out[i] = True
        else:
            live = tracker.live_storages() if tracker is not None else {}
            out[i] = None if k in live else False
    return out, aliased


def live_by_stage(alloc_window: dict[int, Window], tracker: LiveTensorTracker | None) -> dict[int, int]:
    """Bytes of the storages each stage's forward window allocated that are still alive."""
    if tracker is None:
        return {}
    out: dict[int, int] = {}
    for k, nbytes in tracker.live_storages().items():
        window = alloc_window.get(k)
        if window is not None and window[0] == "F":
            out[window[1]] = out.get(window[1], 0) + nbytes
    return out
