"""Memory and time measurement on CPU, CUDA and meta.

``LiveTensorTracker`` is a ``TorchDispatchMode`` that sees every op (forward, backward and the
optimizer) and counts the bytes of every *new* storage an op returns, until that storage is freed
(a ``weakref.finalize`` on the storage object; PyTorch preserves one Python object per live
storage, so the finalizer fires exactly when the last tensor or view is gone). It works on CPU,
on CUDA and on meta tensors, where nothing is allocated but ``nbytes`` is exact. It is ckplan's
CPU measurement and its meta accountant; on CUDA the allocator's own statistics are the truth
(``cuda_peak``).

Known limitations: transient workspace inside one kernel is invisible (only op outputs are
seen); storages resized in place after creation are counted at their first size.
"""
from __future__ import annotations

import contextlib
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


def storages_of(obj) -> list[torch.UntypedStorage]:
    leaves, _ = tree_flatten(obj)
    out = []
    for t in leaves:
        if isinstance(t, torch.Tensor):
            try:
                out.append(t.untyped_storage())
            except (RuntimeError, NotImplementedError):  # tensors without storage (sparse, nested)
                pass
    return out


def unique_storage_bytes(tensors) -> int:
    """Bytes of the storages behind ``tensors`` (a tensor or any nest of them), each storage once.

    Views and tied tensors share a storage, so summing ``nbytes`` per tensor would count it twice.
    """
    seen: dict[int, torch.UntypedStorage] = {}  # the storages stay referenced, so ids stay unique
    for st in storages_of(tensors):
        seen.setdefault(id(st), st)
    return sum(st.nbytes() for st in seen.values())


class TrackerLimitExceeded(RuntimeError):
    """Raised inside the step when live bytes pass the tracker's ``limit_bytes`` (a CPU 'OOM')."""


_LIFT_FRESH = torch.ops.aten.lift_fresh.default


class LiveTensorTracker(TorchDispatchMode):
    """Counts live bytes of storages created while active; keeps the peak.

    ``live`` and ``peak`` are relative to what existed before the tracker saw it: storages made
    earlier (parameters, the batch) are never counted, even when an in-place op returns them.
    ``on_alloc(storage_id, nbytes)`` lets the profiler attribute each new storage to a stage;
    ``on_op(func, input_storage_ids, new_storages)`` sees every op after it ran, with the
    ``(storage_id, nbytes)`` of each storage it created (the profiler finds parameter uses and
    autocast's weight copies with it). ``on_free(storage_id)`` is called when a counted storage
    dies: its id may then be reused by another Python object.
    """

    def __init__(self, limit_bytes: int | None = None,
                 on_alloc: Callable[[int, int], None] | None = None,
                 on_op: Callable[[object, set[int], list[tuple[int, int]]], None] | None = None,
                 on_free: Callable[[int], None] | None = None):
        super().__init__()
        self.on_op = on_op
        self.on_free = on_free
        self.live = 0
        self.peak = 0
        self.limit_bytes = limit_bytes
        self.on_alloc = on_alloc
        self._known: dict[int, int] = {}  # id(storage object) -> nbytes, for storages we count

    def reset_peak(self) -> None:
        self.peak = self.live

    def live_storages(self) -> dict[int, int]:
        """``id(storage) -> nbytes`` of every counted storage still alive."""
        return dict(self._known)

    def _free(self, key: int, nbytes: int) -> None:
        if self._known.pop(key, None) is not None:
            self.live -= nbytes
            if self.on_free is not None:
                self.on_free(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # ``torch.tensor(...)`` makes its storage outside dispatch and shows it here only as
        # ``lift_fresh``'s input and output: new all the same (Adam's step counters, say).
        inputs = set() if func is _LIFT_FRESH else {id(s) for s in storages_of((args, kwargs))}
        new: list[tuple[int, int]] = []
        for st in storages_of(out):
            key = id(st)
            # An output sharing an input's storage is a view or an in-place result: not new.
            if key in inputs or key in self._known:
                continue
            nbytes = st.nbytes()
            self._known[key] = nbytes
            weakref.finalize(st, self._free, key, nbytes)
            self.live += nbytes
            new.append((key, nbytes))
            if self.on_alloc is not None:
                self.on_alloc(key, nbytes)
            if self.live > self.peak:
                self.peak = self.live
                if self.limit_bytes is not None and self.live > self.limit_bytes:
                    raise TrackerLimitExceeded(
                        f"live tensors reached {self.live} bytes, over the limit of {self.limit_bytes}")
        if self.on_op is not None:
            self.on_op(func, inputs, new)
        return out


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
    import gc
    gc.collect()
    torch.cuda.synchronize(device)
    allocated = int(torch.cuda.memory_allocated(device))
    storages: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.device.type == "cuda":
            st = t.untyped_storage()
            storages[st.data_ptr()] = st.nbytes()
    return max(0, allocated - sum(storages.values()))


class Clock:
    """Wall-clock milliseconds that wait for the device first (CUDA kernels are asynchronous)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.device = device

    def now_ms(self) -> float:
        if self.cuda:
            torch.cuda.synchronize(self.device)
        return time.perf_counter() * 1e3


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
    import platform
    return "CPU: " + (platform.processor() or platform.machine())


def _host_total_bytes() -> int | None:
    try:
        import os
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


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


# glibc's mallopt parameters (malloc.h) and their defaults, restored on exit.
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4
_DEFAULT_TRIM_THRESHOLD, _DEFAULT_MMAP_MAX = 128 * 1024, 65536
# CKPLAN_CPU_MALLOC=system leaves the C allocator as the process found it.
CPU_MALLOC_ENV = "CKPLAN_CPU_MALLOC"
_kept_depth = 0


def _glibc():
    """The C library when it is glibc with ``mallopt`` and ``malloc_trim``, else None."""
    import ctypes
    import platform
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
        import os
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


@contextlib.contextmanager
def _without_kineto_log():
    """Kineto writes ``USDT:... profiler_start/stop`` lines to the process's stderr (file descriptor
    2, past Python); they are dropped, and anything else written there meanwhile is passed on."""
    import os
    import sys
    import tempfile
    try:
        fd = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # no real stderr (captured): nothing to filter
        yield
        return
    sys.stderr.flush()
    saved = os.dup(fd)
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        os.dup2(tmp.fileno(), fd)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, fd)
            os.close(saved)
            tmp.seek(0)
            kept = [ln for ln in tmp.read().decode(errors="replace").splitlines(keepends=True)
                    if not ln.startswith("USDT:")]
            if kept:
                sys.stderr.write("".join(kept))


_MARK = "ckplan::mark"


class AllocatorTimeline:
    """The CPU allocator's allocations and frees while active (the PyTorch profiler's memory
    events), replayed in time order afterwards. Unlike :class:`LiveTensorTracker` it sees buffers
    that compiled code (TorchInductor's C++ kernels) allocates without Python dispatch; a
    TorchDispatchMode would instead make ``torch.compile`` fall back to eager. Bytes are relative
    to the start: frees of storages made before it are not reported by the profiler.

    ``mark()`` notes a moment; after exit, :meth:`replay` gives, per mark in order, the live bytes
    at it and the peak since the previous mark (or the start); ``peak`` is the whole run's peak.
    """

    def __init__(self) -> None:
        self._stack = contextlib.ExitStack()
        self._prof = None
        self._n = 0
        self._at: list[tuple[int, int]] = []
        self.peak = 0

    def __enter__(self) -> AllocatorTimeline:
        from torch.profiler import ProfilerActivity, profile
        self._stack.enter_context(_without_kineto_log())
        self._prof = self._stack.enter_context(profile(activities=[ProfilerActivity.CPU], profile_memory=True))
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()
        if exc[0] is None:
            self._replay()

    def mark(self) -> None:
        from torch.profiler import record_function
        with record_function(f"{_MARK}:{self._n}"):
            self._n += 1

    def replay(self) -> list[tuple[int, int]]:
        return list(self._at)

    def _replay(self) -> None:
        events = self._prof.profiler.kineto_results.events()
        marks: dict[int, int] = {}
        for ev in events:
            name = ev.name()
            if name.startswith(_MARK + ":"):
                marks.setdefault(int(name.rsplit(":", 1)[1]), ev.start_ns())
        cpu = torch._C._autograd.DeviceType.CPU
        mem = sorted((ev.start_ns(), ev.nbytes()) for ev in events
                     if ev.name() == "[memory]" and ev.device_type() == cpu)
        times = [marks[k] for k in sorted(marks)]
        live = peak = since = 0
        k = 0
        for ns, nbytes in mem:
            while k < len(times) and ns > times[k]:
                self._at.append((live, since))
                since = live
                k += 1
            live += nbytes
            peak = max(peak, live)
            since = max(since, live)
        while k < len(times):
            self._at.append((live, since))
            since = live
            k += 1
        self.peak = peak
