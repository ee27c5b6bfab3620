"""CUDA memory as the caching allocator counts it: a step's peaks, and the runtime's own blocks.

On CUDA the allocator's statistics are the truth (the live tensor tracker sees only op outputs).
They do not see the CUDA context or library workspaces outside the allocator.
"""
from __future__ import annotations

import gc
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class CudaMemory:
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    alloc_retries: int


def cuda_reset(device: torch.device) -> None:
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)


def cuda_peak(device: torch.device) -> CudaMemory:
    torch.cuda.synchronize(device)
    s = torch.cuda.memory_stats(device)
    return CudaMemory(
        peak_allocated_bytes=int(s.get("allocated_bytes.all.peak", 0)),
        peak_reserved_bytes=int(s.get("reserved_bytes.all.peak", 0)),
        alloc_retries=int(s.get("num_alloc_retries", 0)),
    )


def cuda_runtime_bytes(device: torch.device, tensors) -> int:
    """Bytes the CUDA caching allocator holds beyond the storages of ``tensors`` (a model's
    parameters, gradients, buffers and batch, between steps): the runtime's own blocks, such as
    the cuBLAS and cuBLASLt workspaces made by the first matmul on each (thread, stream), which
    ``torch.cuda.max_memory_allocated`` counts in every step's peak."""
    gc.collect()
    torch.cuda.synchronize(device)
    allocated = int(torch.cuda.memory_allocated(device))
    storages: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.device.type == "cuda":
            st = t.untyped_storage()
            storages[st.data_ptr()] = st.nbytes()
    return max(0, allocated - sum(storages.values()))
