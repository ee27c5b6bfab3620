"""The process's resident memory over a block (Linux ``/proc``): what the kernel kills by."""
from __future__ import annotations


class ResidentPeak:
    """The process's resident set over a block (Linux): its high-water mark and its growth.

    On entry the kernel's high-water mark (``VmHWM``) is reset by writing ``5`` to
    ``/proc/self/clear_refs`` and the resident size (``VmRSS``) noted; on exit ``peak_bytes`` is
    ``VmHWM`` and ``growth_bytes`` the peak above the size at entry. Where the reset or
    ``/proc`` is unavailable (not Linux, a locked-down /proc) both stay None: ``ru_maxrss`` cannot be
    reset, so it would report the whole process's past peak, not this block's.

    Why it differs from live-tensor bytes: glibc's malloc serves blocks below its mmap threshold
    (128 KiB at first, raised dynamically up to 32 MiB as large blocks are freed) from heaps it
    keeps mapped after ``free``, and fragmentation keeps pages resident; the kernel kills by this
    number, not by tensor bytes. ``MALLOC_MMAP_THRESHOLD_=131072`` in the environment fixes the
    threshold, so large tensors are mmapped and returned at once and RSS follows the plans.
    """

    def __init__(self) -> None:
        self.start_bytes: int | None = None
        self.peak_bytes: int | None = None

    @property
    def growth_bytes(self) -> int | None:
        if self.start_bytes is None or self.peak_bytes is None:
            return None
        return max(self.peak_bytes - self.start_bytes, 0)

    def __enter__(self) -> ResidentPeak:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.start_bytes = _proc_status_bytes("VmRSS")
        except OSError:
            self.start_bytes = None
        return self

    def __exit__(self, *exc) -> None:
        if self.start_bytes is not None:
            self.peak_bytes = _proc_status_bytes("VmHWM")


def _proc_status_bytes(field: str) -> int | None:
    """A ``kB`` line of /proc/self/status in bytes, or None."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None
