"""Wall-clock time of a step on any device."""
from __future__ import annotations

import time

import torch


class Clock:
    """Wall-clock milliseconds that wait for the device first (CUDA kernels are asynchronous)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.device = device

    def now_ms(self) -> float:
        if self.cuda:
            torch.cuda.synchronize(self.device)
        return time.perf_counter() * 1e3
