"""Times of a profile: the timed passes and how their medians become per-layer costs.

Times (cpu/cuda): each window is the median of ``repeats`` timed passes. Chain layers of one type
whose layers all have FLOPs then share that type's measured total in proportion to their FLOPs,
so equal layers (transformer blocks) get bit-equal costs and the DP's plan does not follow timing
noise from one profile to the next. Each timed pass is paired with one where every chain layer
runs in its own checkpoint; the median of (checkpointed - plain) / chain forward is the
*recompute factor* (recomputing in backward need not cost what the first forward's window
measured), and ``recompute_ms`` = factor * ``fwd_ms`` per chain layer, unless every layer's
recompute was timed itself (``timed_recompute_ms``).

On meta, times are FLOPs divided by an assumed rate (``ASSUMED_FLOPS_PER_S``).
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from ..calibrate import checkpoint_host_ms
from ..measure import Clock, now_ms
from .instrument import Instrument
from .readouts import Window
from .step import Step, zero_grads

ASSUMED_FLOPS_PER_S = 100e12  # meta-device time estimates: an accelerator at 100 TFLOP/s sustained

# Before the timed passes, plain passes run until the step time stops falling (CPU: the first
# steps of a process fault in fresh pages; BERT-large 1x512 took 15, 11, 7.4, 6.9 ... 6.3 s).
SETTLE_MAX_PASSES = 8
SETTLE_TOLERANCE = 0.05

# A measured recompute factor outside these bounds is noise, not a property of the model.
RECOMPUTE_FACTOR_RANGE = (0.25, 2.0)
# The pairs must agree: every pair's factor within this fraction of the median, else 1.0.
RECOMPUTE_FACTOR_SPREAD = 0.25


def meta_ms(flops: int) -> float:
    """Milliseconds of ``flops`` at the assumed rate: every time on meta."""
    return flops / ASSUMED_FLOPS_PER_S * 1e3


@dataclass(frozen=True)
class Times:
    """The timed passes: window -> milliseconds per pass, and per pair of passes the step time
    without checkpoints and with every chain layer checkpointed (same load: run back to back)."""

    windows: dict[Window, list[float]]
    pairs: list[tuple[float, float]]
    # chain layer -> its recompute in the checkpointed passes, timed around the call (ms)
    recompute: dict[int, list[float]] = field(default_factory=dict)
    # CPU: what a checkpoint costs the host beyond the recompute those timings see (ms): one call of
    # its saved-tensor hooks, and the rest of one checkpoint (calibrate.checkpoint_host_ms)
    ckpt_host_ms: tuple[float, float] = (0.0, 0.0)


class NoWait:
    """Marks that do not wait for the device: a whole step is timed around them."""

    now_ms = staticmethod(now_ms)


def whole_step_ms(inst: Instrument, step: Step, params: list[nn.Parameter]) -> float:
    """One forward+backward timed as a training step runs: the device is waited for at its two
    ends only, so the CPU queues kernels ahead of the GPU as it does in training."""
    clock, inst.clock = inst.clock, NoWait()
    try:
        t0 = clock.now_ms()
        step.run(inst)
        return clock.now_ms() - t0
    finally:
        inst.clock = clock
        zero_grads(params)


def settle(inst: Instrument, step: Step, params: list[nn.Parameter]) -> int:
    """Plain passes until one is not faster than the best so far by more than SETTLE_TOLERANCE
    (at most SETTLE_MAX_PASSES); returns how many ran."""
    best = float("inf")
    for k in range(1, SETTLE_MAX_PASSES + 1):
        t0 = inst.clock.now_ms()
        step.run(inst)
        zero_grads(params)
        ms = inst.clock.now_ms() - t0
        if ms > best * (1 - SETTLE_TOLERANCE):
            return k
        best = min(best, ms)
    return SETTLE_MAX_PASSES


def timing_passes(inst: Instrument, step: Step, params: list[nn.Parameter], repeats: int) -> Times:
    """With hooks only (no tracker, no FLOP counter): ``repeats`` passes with every chain layer in a
    checkpoint (each layer's recompute timed), then plain passes until the step time settles
    (``settle``), then ``repeats`` plain passes whose windows are the layers' times. The plain
    passes come last and back to back, as steady training steps run (a plain pass right after a
    checkpointed one ran up to 40% slower on BERT-large, the allocator faulting in fresh pages)."""
    times: dict[Window, list[float]] = {}
    recompute: dict[int, list[float]] = {}
    cks: list[float] = []
    # on a CPU nothing hides the host's work: a checkpoint's hooks and frame add to the step
    host = checkpoint_host_ms(step.device) if step.device.type == "cpu" else (0.0, 0.0)
    for _ in range(repeats):
        ck = checkpointed_pass(inst, step, params, recompute)
        if ck is None:  # a model that cannot run checkpointed: recompute at fwd_ms
            cks, recompute = [], {}
            break
        cks.append(ck)
    settle(inst, step, params)
    plains: list[float] = []
    for _ in range(repeats):
        step.run(inst)
        zero_grads(params)
        plains.append(inst.marks[-1].t_ms - inst.marks[0].t_ms)
        for key, w in inst.windows().items():
            times.setdefault(key, []).append(w["ms"])
    return Times(times, list(zip(plains, cks)), recompute, host if recompute else (0.0, 0.0))


def _checkpointed_forward(orig, i: int, clock: Clock, got: dict[int, list[float]]):
    """``orig`` in a non-reentrant checkpoint, its second call (the recompute) timed into ``got[i]``."""
    def fwd(*args, **kwargs):
        if not torch.is_grad_enabled():
            return orig(*args, **kwargs)
        calls = 0

        def timed(*a, **k):
            nonlocal calls
            calls += 1
            if calls == 1:
                return orig(*a, **k)
            t0 = clock.now_ms()
            try:  # the non-reentrant recompute stops early by raising once it has what it needs
                return orig(*a, **k)
            finally:
                got.setdefault(i, []).append(clock.now_ms() - t0)

        return checkpoint(timed, *args, use_reentrant=False, preserve_rng_state=True, **kwargs)

    return fwd


def checkpointed_pass(inst: Instrument, step: Step, params: list[nn.Parameter],
                      recompute: dict[int, list[float]] | None = None) -> float | None:
    """Milliseconds of one forward+backward with every chain layer in its own non-reentrant
    checkpoint (every-k k=1, as the executor runs it): what recomputing every layer really adds.
    Each layer's recompute (the second call of its forward, in the backward) is timed into
    ``recompute``. None when the model fails that way (the profile does not: its times stay the
    windows')."""
    saved = []
    got: dict[int, list[float]] = {}
    for i, layer in enumerate(inst.layers):
        saved.append((layer, layer.__dict__.get("forward")))
        layer.forward = _checkpointed_forward(layer.forward, i, inst.clock, got)
    inst.paused = True
    try:
        t0 = inst.clock.now_ms()
        step.run(inst)
        ms: float | None = inst.clock.now_ms() - t0
        if recompute is not None:
            for i, v in got.items():
                recompute.setdefault(i, []).extend(v)
    except torch.cuda.OutOfMemoryError:
        raise
    except Exception:
        ms = None
    finally:
        inst.paused = False
        for layer, own in saved:
            if own is None:
                del layer.forward
            else:
                layer.forward = own
        zero_grads(params)
    return ms


def recompute_factor(pairs: list[tuple[float, float]], chain_fwd_ms: float) -> float:
    """What recomputing the chain costs per millisecond of its measured forward windows: the
    median over pairs of (checkpointed step - plain step) / chain forward, clamped to
    RECOMPUTE_FACTOR_RANGE. 1.0 (recompute = forward window) without two pairs, or when the
    pairs disagree (shared cores: one noisy difference of two steps must not set every cost)."""
    if len(pairs) < 2 or chain_fwd_ms <= 0:
        return 1.0
    each = [(ck - plain) / chain_fwd_ms for plain, ck in pairs]
    f = statistics.median(each)
    if f <= 0 or any(abs(x - f) > RECOMPUTE_FACTOR_SPREAD * f for x in each):
        return 1.0
    lo, hi = RECOMPUTE_FACTOR_RANGE
    return min(hi, max(lo, f))


def timed_recompute_ms(kinds: list[str], flops: list[int], fwd_ms: list[float],
                       samples: dict[int, list[float]]) -> list[float] | None:
    """Each chain layer's recompute: the median of its recomputes timed in the checkpointed passes
    (the forward as the backward really redoes it, early stop and cold caches included), shared
    within a layer type by FLOPs as forward times are, each within RECOMPUTE_FACTOR_RANGE of its
    forward window. None unless every layer was timed (then the step-pair factor applies)."""
    n = len(fwd_ms)
    if n == 0 or any(not samples.get(i) for i in range(n)):
        return None
    med = smoothed_chain_ms(kinds, flops, [statistics.median(samples[i]) for i in range(n)])
    lo, hi = RECOMPUTE_FACTOR_RANGE
    return [min(hi * f, max(lo * f, m)) for m, f in zip(med, fwd_ms)]


def smoothed_chain_ms(kinds: list[str], flops: list[int], medians: list[float]) -> list[float]:
    """Chain-layer times with the timing noise between layers taken out: within each layer type
    whose layers all have FLOPs, the type's measured total shared in proportion to FLOPs (equal
    layers get bit-equal costs, so the DP's choice among them does not follow noise); layers of
    a type with a FLOP-free layer keep their own median. Per type, the total is unchanged."""
    out = list(medians)
    for kind in dict.fromkeys(kinds):
        idx = [i for i, k in enumerate(kinds) if k == kind]
        total_flops = sum(flops[i] for i in idx)
        if any(flops[i] <= 0 for i in idx) or total_flops <= 0:
            continue
        total_ms = sum(medians[i] for i in idx)
        for i in idx:
            out[i] = total_ms * flops[i] / total_flops
    return out
