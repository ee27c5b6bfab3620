"""What the device is and how much memory it has: NVML, else CUDA, else the host.

NVML (``pynvml``, from the ``gpu`` extra: nvidia-ml-py) is imported lazily, and only where a GPU
is asked about: without it CUDA's own numbers serve.
"""
from __future__ import annotations

import os
import platform
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DeviceInfo:
    name: str
    total_bytes: int | None
    free_bytes: int | None
    source: str  # "nvml", "cuda", "cpu", "meta"


def device_info(device: torch.device) -> DeviceInfo:
    """Name and memory of the device. NVML when importable and working, else CUDA, else the CPU."""
    if device.type == "meta":
        return DeviceInfo("meta (fake tensors, nothing allocated)", None, None, "meta")
    if device.type == "cuda":
        idx = device.index if device.index is not None else torch.cuda.current_device()
        nv = nvml_memory(idx)
        if nv is not None:
            return nv
        free, total = torch.cuda.mem_get_info(idx)
        return DeviceInfo(torch.cuda.get_device_name(idx), int(total), int(free), "cuda")
    return DeviceInfo(_cpu_name(), _host_total_bytes(), None, "cpu")


def nvml_memory(index: int = 0) -> DeviceInfo | None:
    """NVML's view of GPU ``index`` or None without NVML (no GPU, no driver, no nvidia-ml-py)."""
    try:
        import pynvml  # from the `gpu` extra: nvidia-ml-py
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        try:
            h = pynvml.nvmlDeviceGetHandleByIndex(index)
            mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            name = pynvml.nvmlDeviceGetName(h)
            name = name.decode() if isinstance(name, bytes) else name
            return DeviceInfo(name, int(mem.total), int(mem.free), "nvml")
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # pynvml.NVMLError and friends: no usable GPU; carry on without it
        return None


def nvml_used_bytes(index: int = 0) -> int | None:
    info = nvml_memory(index)
    if info is None or info.total_bytes is None or info.free_bytes is None:
        return None
    return info.total_bytes - info.free_bytes


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return "CPU: " + line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "CPU: " + (platform.processor() or platform.machine())


def _host_total_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None
