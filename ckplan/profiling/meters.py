"""Where the bytes at each mark come from: the live-tensor tracker (CPU, meta), the CUDA allocator,
or, for compiled layers on CPU, a point in the PyTorch profiler's allocator timeline."""
from __future__ import annotations

import torch

from ..measure import AllocatorTimeline, LiveTensorTracker


class Meter:
    """Live/peak bytes relative to the step start: the tracker on CPU/meta, the allocator on CUDA."""

    def __init__(self, device: torch.device, tracker: LiveTensorTracker | None):
        self.cuda = device.type == "cuda"
        self.device = device
        self.tracker = tracker
        if self.cuda:
            torch.cuda.synchronize(device)
            self.base = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)

    def read_and_reset(self) -> tuple[int, int]:
        if self.cuda:
            torch.cuda.synchronize(self.device)
            live = torch.cuda.memory_allocated(self.device) - self.base
            peak = torch.cuda.max_memory_allocated(self.device) - self.base
            torch.cuda.reset_peak_memory_stats(self.device)
            return live, peak
        if self.tracker is None:
            return 0, 0
        live, peak = self.tracker.live, self.tracker.peak
        self.tracker.reset_peak()
        return live, peak

    def peak_now(self) -> int:
        """The peak since the last ``read_and_reset``, without resetting it."""
        if self.cuda:
            return torch.cuda.max_memory_allocated(self.device) - self.base
        return self.tracker.peak if self.tracker is not None else 0

    def live_now(self) -> int:
        """Live bytes now, on the scale of the marks."""
        if self.cuda:
            return torch.cuda.memory_allocated(self.device) - self.base
        return self.tracker.live if self.tracker is not None else 0


class TimelineMeter:
    """CPU memory of compiled layers: each mark is a point in an :class:`AllocatorTimeline`; the
    live and peak bytes are filled in after the pass (``compiled_passes.compiled_pass``)."""

    tracker = None

    def __init__(self, timeline: AllocatorTimeline):
        self.timeline = timeline

    def read_and_reset(self) -> tuple[int, int]:
        self.timeline.mark()
        return 0, 0
