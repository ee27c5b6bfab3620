"""The CPU allocator's events from the PyTorch profiler: live bytes where no dispatch mode can look."""
from __future__ import annotations

import contextlib
import os
import sys
import tempfile

import torch
from torch.profiler import ProfilerActivity, profile, record_function


@contextlib.contextmanager
def _without_kineto_log():
    """Kineto writes ``USDT:... profiler_start/stop`` lines to the process's stderr (file descriptor
    2, past Python); they are dropped, and anything else written there meanwhile is passed on."""
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
        self._stack.enter_context(_without_kineto_log())
        self._prof = self._stack.enter_context(profile(activities=[ProfilerActivity.CPU], profile_memory=True))
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()
        if exc[0] is None:
            self._replay()

    def mark(self) -> None:
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
