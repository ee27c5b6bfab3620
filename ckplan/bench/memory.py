"""Step 2, the memory step: the allocator's peak on CUDA; on CPU the live-tensor tracker, or the
PyTorch profiler's allocator events for compiled code, plus the resident high-water mark."""
from __future__ import annotations

import gc
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..measure import (
    AllocatorTimeline,
    LiveTensorTracker,
    ResidentPeak,
    TrackerLimitExceeded,
    cuda_peak,
    cuda_reset,
    nvml_used_bytes,
)
from ..units import format_bytes
from .entry import Entry
from .steps import Run, resident_bytes, runs_compiled_layers

RSS_NOTE = ("growth tensors / RSS: live-tensor bytes above those resident when the memory step began, and the "
            "process's resident-set growth over it (Linux VmHWM); glibc's malloc keeps freed memory mapped, so "
            "RSS need not follow the plans (RSS growth near 0 means the step ran in memory kept from earlier "
            "steps; measured_rss_peak_bytes in the JSON is the high-water mark itself); with "
            "MALLOC_MMAP_THRESHOLD_=131072 in the environment large tensors are returned at once and RSS "
            "follows the tensor peaks")


def memory_step(run: Run, e: Entry) -> None:
    """Step 2: one step measured, the allocator's peak on CUDA or the live-tensor tracker on CPU."""
    resident = resident_bytes(run.model, run.opt, run.batch)
    fb: dict[str, int] = {}
    if run.device.type == "cuda":
        device = run.device
        cuda_reset(device)
        # held for backward: what the forward added, the runtime's own blocks (cuBLAS workspaces
        # made by the first matmul on the backward's thread) left out, as in the prediction
        runtime = run.profile.totals.runtime_bytes
        run.step(e, after_backward=lambda: fb.setdefault("peak", cuda_peak(device).peak_allocated_bytes),
                 after_forward=lambda: fb.setdefault("act", torch.cuda.memory_allocated(device) - resident
                                                     - runtime))
        m = cuda_peak(device)
        e.mem = dict(measured=m.peak_allocated_bytes, fwd_bwd=fb["peak"], act=fb["act"],
                     reserved=m.peak_reserved_bytes, retries=m.alloc_retries,
                     nvml=nvml_used_bytes(device.index or 0))
        return
    limit = None if run.memory_limit_bytes is None else run.memory_limit_bytes - resident
    gc.collect()  # garbage from earlier steps must not count in this step's resident peak
    if e.compiled is not None or (run.layers is not None and runs_compiled_layers(e)):
        _profiled_memory_step(run, e, resident, limit)
        return
    try:
        with ResidentPeak() as rss, LiveTensorTracker(limit_bytes=limit) as tr:
            run.step(e, after_backward=lambda: fb.setdefault("peak", resident + tr.peak),
                     after_forward=lambda: fb.setdefault("act", tr.live))
    except TrackerLimitExceeded:
        raise _over_limit(run, resident, tr.live) from None
    e.mem = dict(measured=resident + tr.peak, fwd_bwd=fb["peak"], act=fb["act"], growth=tr.peak)
    if rss.peak_bytes is not None:
        e.mem.update(rss_peak=rss.peak_bytes, rss_growth=rss.growth_bytes)


def _profiled_memory_step(run: Run, e: Entry, resident: int, limit: int | None) -> None:
    """A CPU memory step read from the PyTorch profiler instead of the live-tensor tracker (the
    compiled peers: compiled code allocates its buffers without Python dispatch). The peak is known
    only after the step, so a ``memory_limit_bytes`` over it makes the row OOM afterwards."""
    with ResidentPeak() as rss:
        m = profiled_step_memory(lambda fwd, bwd: run.step(e, after_forward=fwd, after_backward=bwd))
    if limit is not None and m.peak > limit:
        raise _over_limit(run, resident, m.peak)
    e.mem = dict(measured=resident + m.peak, fwd_bwd=resident + m.fwd_bwd_peak, act=m.after_forward,
                 growth=m.peak)
    e.mem_source = "profiler"
    if rss.peak_bytes is not None:
        e.mem.update(rss_peak=rss.peak_bytes, rss_growth=rss.growth_bytes)


@dataclass(frozen=True)
class ProfiledMemory:
    """Bytes above what was allocated when profiling began: the peak, the live bytes after the
    first forward, and the peak up to the end of the backward."""

    peak: int
    after_forward: int
    fwd_bwd_peak: int


def profiled_step_memory(step: Callable[[Callable[[], None], Callable[[], None]], object]) -> ProfiledMemory:
    """Run ``step(after_forward, after_backward)`` under the PyTorch profiler with memory events
    (:class:`ckplan.measure.AllocatorTimeline`): unlike the live-tensor tracker this sees every
    allocation of the CPU allocator (compiled kernels' buffers too); the two callbacks mark the
    moments whose live bytes are reported."""
    tl = AllocatorTimeline()
    with tl:
        step(tl.mark, tl.mark)
    at = tl.replay()
    peak = tl.peak
    if len(at) < 2:  # a step that never reached its marks: the whole step counts
        return ProfiledMemory(peak=peak, after_forward=at[0][0] if at else 0, fwd_bwd_peak=peak)
    (after_forward, fwd_peak), (_, bwd_peak) = at[0], at[1]
    return ProfiledMemory(peak=peak, after_forward=after_forward, fwd_bwd_peak=max(fwd_peak, bwd_peak))


def _over_limit(run: Run, resident: int, made: int) -> TrackerLimitExceeded:
    """The CPU 'out of memory' of ``--memory-limit``, in the limit's own terms."""
    total = run.memory_limit_bytes or 0
    return TrackerLimitExceeded(
        f"the step reached {format_bytes(resident + made)} ({resident + made} bytes), over --memory-limit "
        f"{format_bytes(total)} ({total} bytes): {resident} bytes resident before the step (parameters, "
        f"gradients, optimizer state, the batch) and {made} made by it")
