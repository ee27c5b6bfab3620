"""CPU steps with freed memory kept in the process (glibc ``mallopt``), as CUDA's allocator keeps it."""
from __future__ import annotations

import ctypes
import os
import platform

import torch

# glibc's mallopt parameters (malloc.h) and their defaults, restored on exit.
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4
_DEFAULT_TRIM_THRESHOLD, _DEFAULT_MMAP_MAX = 128 * 1024, 65536
# CKPLAN_CPU_MALLOC=system leaves the C allocator as the process found it.
CPU_MALLOC_ENV = "CKPLAN_CPU_MALLOC"
_kept_depth = 0


def _glibc():
    """The C library when it is glibc with ``mallopt`` and ``malloc_trim``, else None."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        libc = ctypes.CDLL(None)
        libc.mallopt.argtypes, libc.mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
        libc.malloc_trim.argtypes, libc.malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
    except (OSError, AttributeError):
        return None
    return libc


class KeptFreedMemory:
    """CPU steps with freed memory kept in the process, as PyTorch's CUDA caching allocator keeps it.

    glibc's malloc returns large blocks to the kernel on ``free`` (mmapped blocks at once, the
    heap's top when it passes the trim threshold), so the next step faults every page in again and
    the kernel zeroes it. On a 2-core VM that was 40% of a BERT-large step (1 x 512: forward and
    backward 9.1 s with the default, 5.5 s with memory kept), and it grows with the bytes a plan
    frees and allocates, which is not compute: the time model (recompute = the layers' forward
    times) then misses by up to 10 points, and a checkpointed step can even run faster than one
    without checkpoints. Inside this block ``mallopt(M_MMAP_MAX, 0)`` serves every block from the
    heap and ``mallopt(M_TRIM_THRESHOLD, -1)`` never trims it: a steady step reuses the pages of
    the last one, as on a GPU. On exit the defaults are set back (fixed thresholds) and
    ``malloc_trim(0)`` returns what is free. Tensor bytes (what ckplan measures and predicts) do
    not change; the resident set stays at its high-water mark inside the block.

    A no-op (``active`` False) off glibc, on other devices, or with ``CKPLAN_CPU_MALLOC=system``
    in the environment. Nested blocks restore only when the outermost one exits."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        dev = torch.device(device)
        want = dev.type == "cpu" and os.environ.get(CPU_MALLOC_ENV, "").lower() != "system"
        self._libc = _glibc() if want else None
        self.active = self._libc is not None

    def __enter__(self) -> KeptFreedMemory:
        global _kept_depth
        if self._libc is not None:
            if _kept_depth == 0:
                self._libc.mallopt(_M_MMAP_MAX, 0)
                self._libc.mallopt(_M_TRIM_THRESHOLD, -1)  # as size_t: never
            _kept_depth += 1
        return self

    def __exit__(self, *exc) -> None:
        global _kept_depth
        if self._libc is not None:
            _kept_depth -= 1
            if _kept_depth == 0:
                self._libc.mallopt(_M_MMAP_MAX, _DEFAULT_MMAP_MAX)
                self._libc.mallopt(_M_TRIM_THRESHOLD, _DEFAULT_TRIM_THRESHOLD)
                self._libc.malloc_trim(0)


KEPT_MEMORY_NOTE = ("cpu times: measured with freed memory kept in the process (glibc mallopt M_MMAP_MAX=0, "
                    "M_TRIM_THRESHOLD=-1, as the CUDA caching allocator keeps it), so a step does not fault "
                    "in and zero the pages the last one returned; CKPLAN_CPU_MALLOC=system times with "
                    "glibc's default instead (the time model then misses by up to 10 points on large "
                    "activations)")
