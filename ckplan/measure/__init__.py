"""Memory and time measurement on CPU, CUDA and meta, one instrument a module.

tracker     live tensor bytes op by op (CPU and meta; any device): LiveTensorTracker
cuda        the CUDA caching allocator's peaks and the runtime's own blocks
clock       wall-clock milliseconds that wait for the device
device      the device's name and memory (NVML, CUDA, the host)
resident    the process's resident-set peak over a block (Linux)
kept_freed  CPU steps with freed memory kept in the process (glibc), as on a GPU
timeline    the CPU allocator's events from the PyTorch profiler (compiled code)
meta_kernels  each meta kernel run once per shape (fast fake passes)
compiled_graph  what a compiled step saves for backward, from TorchInductor's partitioned graphs
"""
from .clock import Clock, now_ms
from .cuda import CudaMemory, cuda_peak, cuda_reset, cuda_runtime_bytes
from .device import DeviceInfo, device_info, nvml_memory, nvml_used_bytes
from .kept_freed import CPU_MALLOC_ENV, KEPT_MEMORY_NOTE, KeptFreedMemory
from .resident import ResidentPeak, _proc_status_bytes  # noqa: F401  (tests read the process status)
from .timeline import AllocatorTimeline
from .tracker import LiveTensorTracker, TrackerLimitExceeded, storages_of, unique_storage_bytes

__all__ = [
    "CPU_MALLOC_ENV", "KEPT_MEMORY_NOTE", "AllocatorTimeline", "Clock", "CudaMemory", "DeviceInfo", "KeptFreedMemory",
    "LiveTensorTracker", "ResidentPeak", "TrackerLimitExceeded", "cuda_peak", "cuda_reset", "cuda_runtime_bytes",
    "device_info", "now_ms", "nvml_memory", "nvml_used_bytes", "storages_of", "unique_storage_bytes",
]
