"""The no-save pass and the selective options on meta, measured on three chain layers instead of all.

A meta profile measures each option with one more fake step of the whole model, every chain layer
under the option (``option_passes``); on an 80-layer model that step costs as much as the profile
itself. When the chain's middle layers are the same layer (same class, parameters and buffers, and
in the plain measured pass the same windows: op for op, byte for byte; and the tensors made before
the chain for its layers, such as attention masks, given to every middle layer or to none), the
option passes run on the model with its chain cut to three layers: the first, one middle layer
and the last. Every
window of the cut model is checked against the full pass's first, middle and last layers before
anything is used; where one differs, ``sampled_passes`` returns None and the caller measures
every layer as before.

What a layer's window shows under an option does not depend on how many layers came before, only
the live bytes it starts from do: the option passes' windows are moved onto the full pass's live
bytes, less what the option saved in the layers before (the first layer's saving, then the middle
layer's once per middle layer; in backward, every layer not yet backwarded). Tests check the
result against measuring every layer, to the byte.
"""
from __future__ import annotations

from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import replace

import torch.nn as nn

from ..measure import Clock
from .instrument import Instrument
from .option_passes import OptionPass, eager_option_passes
from .passes import MeasuredPass, measured_pass, nosave_pass
from .step import Step, hooks_installed, model_errors, state_restored, zero_grads

MIN_LAYERS = 5  # below this the cut model saves little


def _signature(m: nn.Module) -> tuple:
    return (type(m).__qualname__,
            tuple((n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in m.named_parameters()),
            tuple((n, tuple(b.shape), b.dtype) for n, b in m.named_buffers()))


def _shape(m: MeasuredPass, phase: str, i: int) -> tuple | None:
    """Layer ``i``'s window in ``phase`` with the live bytes it starts from taken out."""
    w = m.windows.get((phase, i))
    if w is None:
        return None
    a, b = w["ops"]
    return (w["live_end"] - w["live_start"], w["peak"] - w["live_start"], w["flops"], tuple(m.ops[a:b]))


def _same_layer(full: MeasuredPass, i: int, cut: MeasuredPass, k: int) -> bool:
    return (all(_shape(full, ph, i) == _shape(cut, ph, k) for ph in ("F", "B"))
            and full.live_at_end.get(i) == cut.live_at_end.get(k) and full.saved.get(i) == cut.saved.get(k))


@contextmanager
def _chain_cut(container: nn.Module, keep: list[int]):
    """The container holds only the layers ``keep`` until the block ends."""
    modules = container._modules
    items = list(modules.values())
    container._modules = OrderedDict((str(k), items[j]) for k, j in enumerate(keep))
    try:
        yield [items[j] for j in keep]
    finally:
        container._modules = modules


def _moved(cut: MeasuredPass, plain_cut: MeasuredPass, full: MeasuredPass, n: int) -> MeasuredPass:
    """The cut model's option pass as the full model's: layer 0 from cut layer 0, the middle layers
    from cut layer 1, the last from cut layer 2, each window moved onto the full pass's live bytes
    less what the option saved in the layers before it."""
    def saved(phase: str, k: int) -> int:  # what the option saved before cut layer k's window
        return plain_cut.windows[(phase, k)]["live_start"] - cut.windows[(phase, k)]["live_start"]

    f0, f1, f2 = saved("F", 0), saved("F", 1), saved("F", 2)
    b0, b1, b2 = saved("B", 0), saved("B", 1), saved("B", 2)
    windows: dict = {}
    live_at_end, unkept = {}, {}
    for i in range(n):
        k = 0 if i == 0 else 2 if i == n - 1 else 1
        # forward: layer 0 and the i - 1 middle layers before layer i; backward: every layer not
        # yet backwarded (0..i): layer 0, the middle ones up to i, and the last when i is the last
        middle_f, middle_b = f2 - f1, b1 - b0
        before = {"F": f0 if i == 0 else f1 + (i - 1) * middle_f,
                  "B": b0 if i == 0 else b0 + i * middle_b if k == 1 else b0 + (n - 2) * middle_b + (b2 - b1)}
        for phase in ("F", "B"):
            w = cut.windows.get((phase, k))
            if w is None:
                continue
            start = full.windows[(phase, i)]["live_start"] - before[phase]
            windows[(phase, i)] = dict(w, live_start=start, live_end=start + w["live_end"] - w["live_start"],
                                       peak=start + w["peak"] - w["live_start"])
        if k in cut.live_at_end:
            live_at_end[i] = cut.live_at_end[k]
        if k in cut.casts_unkept:
            unkept[i] = cut.casts_unkept[k]
    return replace(cut, windows=windows, live_at_end=live_at_end, casts_unkept=unkept)


def sampled_passes(layers: list[nn.Module], container: nn.Module, step: Step, params: list[nn.Parameter],
                   model: nn.Module, full: MeasuredPass, options: tuple[str, ...], accum: int
                   ) -> tuple[tuple[dict[int, int], dict[int, int]], list[OptionPass], list[str]] | None:
    """The no-save pass and the option passes of a meta profile measured on the first, one middle
    and the last chain layer: ``(nosave, option passes, notes)``, or None when the middle layers are
    not all the same layer (then measure every layer). The no-save pass's readings are a window's
    peak above its start and what it made that outlives the forward, the same for equal layers."""
    n = len(layers)
    if n < MIN_LAYERS or not isinstance(container, (nn.ModuleList, nn.Sequential)):
        return None
    sig = _signature(layers[1])
    if any(_signature(m) != sig for m in layers[2:n - 1]):
        return None
    if any(not _same_layer(full, i, full, 1) for i in range(2, n - 1)):
        return None
    middle = set(range(1, n - 1))
    if any(middle & set(s.layers) not in (middle, set()) for s in full.side_inputs):
        return None  # an argument some middle layers share and others do not (alternating masks)
    keep = [0, 1, n - 1]
    try:
        with _chain_cut(container, keep) as cut_layers:
            inst = Instrument(cut_layers, Clock(step.device))
            with model_errors(True), state_restored(model, params, step.device), hooks_installed(inst):
                zero_grads(params)
                plain = measured_pass(inst, step, params, model)
                zero_grads(params)
                if not all(_same_layer(full, i, plain, k) for k, i in enumerate(keep)):
                    return None
                peaks, kept = nosave_pass(inst, step)
                passes, notes = (eager_option_passes(inst, step, params, model, options, 0, accum) if options
                                 else ([], []))
    except Exception:  # a model that cannot run cut (it counts its layers itself): every layer, then
        return None
    sample = [0] + [1] * (n - 2) + [2]  # the cut layer that stands for each layer
    nosave = ({i: peaks[k] for i, k in enumerate(sample) if k in peaks},
              {i: kept[k] for i, k in enumerate(sample) if k in kept})
    return nosave, [replace(p, measured=_moved(p.measured, plain, full, n)) for p in passes], notes
