"""Will one training step fit on the device? Decided before building anything real.

A real-size model on the wrong device (BERT-large at batch 8 x 512 on a laptop CPU) would
otherwise run for minutes and then be killed by the kernel. ckplan first runs the step on the meta
device (fake tensors: seconds, nothing allocated), which predicts the step's peak exactly for fp32
(the planner's memory model), and compares it with what the device has now.

Two parts: :func:`decide` is pure arithmetic on numbers (tested with numbers); :func:`available_memory`
reads the machine (``/proc/meminfo`` and the cgroup limit on CPU, ``torch.cuda.mem_get_info`` on CUDA).

Margins, and why:

- CPU: live tensor bytes are what ckplan predicts, but the kernel kills a process by its resident
  memory, and glibc's malloc keeps freed blocks mapped (a 24-layer MLP measured 1.9x more resident
  growth than tensor growth). 25% plus 256 MiB covers that and the interpreter's own objects;
  ``MALLOC_MMAP_THRESHOLD_=131072`` makes resident memory follow the tensors closely.
- CUDA: the caching allocator rounds blocks and fragments; cuBLAS/cuDNN take workspaces. 10% plus
  256 MiB.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from .cgroups import cgroup_paths
from .units import MiB, format_bytes

MARGINS = {  # device type -> (factor on the predicted peak, fixed bytes)
    "cpu": (1.25, 256 * MiB),
    "cuda": (1.10, 256 * MiB),
}
MALLOC_HINT = ("on CPU, glibc malloc can keep resident memory above the live tensor bytes; "
               "MALLOC_MMAP_THRESHOLD_=131072 in the environment keeps it close to them")


@dataclass(frozen=True)
class Available:
    """Memory the device can give this process now."""

    bytes: int | None  # None: unknown (then nothing is refused)
    source: str  # where the number came from, for the message


@dataclass(frozen=True)
class Verdict:
    device: str  # "cpu" or "cuda"
    predicted_peak_bytes: int  # one training step without checkpointing, from the meta pass
    needed_bytes: int  # the peak with the allocator margin
    available_bytes: int | None
    source: str
    fits: bool

    def message(self) -> str:
        return (f"one training step is predicted to peak at {format_bytes(self.predicted_peak_bytes)} "
                f"({format_bytes(self.needed_bytes)} with the {self.device} allocator's margin), but "
                f"{'this machine' if self.device == 'cpu' else 'the GPU'} has "
                f"{format_bytes(self.available_bytes)} available ({self.source})")

    def tip(self) -> str:
        tip = ("profile and plan with --device meta (device='meta'; nothing is allocated), or use a "
               "smaller --batch-size / --seq-len; --force (force=True) runs anyway")
        return tip + ("; " + MALLOC_HINT if self.device == "cpu" else "")


def decide(predicted_peak_bytes: int, available: Available, device: str) -> Verdict:
    """Does a step that peaks at ``predicted_peak_bytes`` fit in ``available`` on ``device``?"""
    factor, fixed = MARGINS.get(device, (1.0, 0))
    needed = int(predicted_peak_bytes * factor) + fixed
    fits = available.bytes is None or needed <= available.bytes
    return Verdict(device=device, predicted_peak_bytes=predicted_peak_bytes, needed_bytes=needed,
                   available_bytes=available.bytes, source=available.source, fits=fits)


def available_memory(device) -> Available:
    """What ``device`` (a torch.device or its type name) has free now."""
    kind = getattr(device, "type", str(device))
    if kind == "cuda":
        index = getattr(device, "index", None)
        free, _total = torch.cuda.mem_get_info(index if index is not None else torch.cuda.current_device())
        return Available(int(free), "free GPU memory, torch.cuda.mem_get_info")
    if kind == "cpu":
        return cpu_available()
    return Available(None, f"{kind}: not checked")


def cpu_available(proc: Path = Path("/proc"), cgroup: Path = Path("/sys/fs/cgroup")) -> Available:
    """MemAvailable, lowered to the room left under this process's cgroup limit when there is one."""
    found: list[tuple[int, str]] = []
    meminfo = _meminfo(proc / "meminfo")
    if "MemAvailable" in meminfo:
        found.append((meminfo["MemAvailable"], "MemAvailable in /proc/meminfo"))
    room = _cgroup_room(cgroup, proc / "self" / "cgroup")
    if room is not None:
        found.append(room)
    if not found:
        try:
            pages = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
            return Available(int(pages), "free physical pages (sysconf)")
        except (ValueError, OSError, AttributeError):
            return Available(None, "unknown")
    value, source = min(found)
    return Available(value, source)


def _meminfo(path: Path) -> dict[str, int]:
    out = {}
    try:
        for line in path.read_text().splitlines():
            key, _, rest = line.partition(":")
            parts = rest.split()
            if parts and parts[0].isdigit():
                out[key] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    except OSError:
        pass
    return out


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max" (no limit) -> None


def _cgroup_room(root: Path, self_cgroup: Path) -> tuple[int, str] | None:
    """limit - (usage - reclaimable page cache) of this process's cgroup (v2, else v1)."""
    rel, rel_v1 = cgroup_paths(self_cgroup, "memory")
    for d in dict.fromkeys([root / rel, root]):  # v2: own group, else the namespace's root
        limit = _read_int(d / "memory.max")
        if limit is not None:
            usage = _read_int(d / "memory.current") or 0
            cache = _stat(d / "memory.stat").get("inactive_file", 0)
            return max(limit - (usage - cache), 0), f"cgroup limit {format_bytes(limit)} in {d / 'memory.max'}"
    for v1 in dict.fromkeys([root / "memory" / rel_v1, root / "memory"]):
        limit = _read_int(v1 / "memory.limit_in_bytes")
        if limit is not None and limit < 2**60:  # v1 writes a huge number for "no limit"
            usage = _read_int(v1 / "memory.usage_in_bytes") or 0
            cache = _stat(v1 / "memory.stat").get("total_inactive_file", 0)
            return max(limit - (usage - cache), 0), f"cgroup limit {format_bytes(limit)} (v1)"
    return None


def _stat(path: Path) -> dict[str, int]:
    out = {}
    try:
        for line in path.read_text().splitlines():
            key, _, value = line.partition(" ")
            if value.strip().isdigit():
                out[key] = int(value)
    except OSError:
        pass
    return out
