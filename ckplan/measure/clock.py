"""Wall-clock time of a step on any device, in milliseconds: every timer in ckplan reads this one."""
from __future__ import annotations

import time
from collections.abc import Callable

import torch


def now_ms() -> float:
    """The monotonic wall clock (``time.perf_counter``) in milliseconds, waiting for no device."""
    return time.perf_counter() * 1e3


class Clock:
    """Wall-clock milliseconds that wait for the device first (CUDA kernels are asynchronous)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.device = device

    def now_ms(self) -> float:
        if self.cuda:
            torch.cuda.synchronize(self.device)
        return now_ms()

    def time_ms(self, fn: Callable[[], object]) -> float:
        """Milliseconds of one call of ``fn``, the device waited for before and after it."""
        t0 = self.now_ms()
        fn()
        return self.now_ms() - t0

    def median_ms(self, fn: Callable[[], object], repeats: int) -> float:
        """The median milliseconds of ``fn`` over ``repeats`` calls after one warm-up call."""
        fn()
        times = sorted(self.time_ms(fn) for _ in range(repeats))
        return times[len(times) // 2]
