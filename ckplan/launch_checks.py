"""Can this machine hold ``nproc`` ranks: arithmetic on numbers (tested with numbers), and the
numbers read from the machine. NCCL needs a GPU per rank; gloo ranks on the CPU want a core each
(up to ``MAX_RANKS_PER_CPU`` per core with ``--force``), their predicted memory, and file
descriptors for their connections. :mod:`ckplan.launch` starts the ranks.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from .cgroups import cgroup_paths
from .errors import UsageError
from .preflight import MARGINS
from .units import format_bytes

MAX_RANKS_PER_CPU = 2  # gloo ranks per core that --force allows; beyond it collectives time out
# File descriptors a gloo rank holds: the interpreter, torch's libraries and the logs
# (FD_BASE), plus, per peer, gloo's connection and its share of the store's (FD_PER_PEER).
# Measured on 2 to 4 CPU ranks (FSDP2, torch 2.13): rank 0 (which also hosts the TCP store)
# held 24 and 27 at most with 2 and 4 ranks, the others fewer.
FD_BASE = 64
FD_PER_PEER = 2


@dataclass(frozen=True)
class Machine:
    """What bounds the number of ranks on this machine."""

    cpus: int
    cpus_source: str
    gpus: int  # visible CUDA devices
    open_files: int | None  # soft RLIMIT_NOFILE of this process (the ranks inherit it); None: unknown


def machine(gpus: int = 0) -> Machine:
    n, source = cpu_count()
    return Machine(cpus=n, cpus_source=source, gpus=gpus, open_files=open_files_limit())


def cpu_count(root: str = "/sys/fs/cgroup", self_cgroup: str = "/proc/self/cgroup") -> tuple[int, str]:
    """Cores this process may run on: its affinity mask, lowered by a cgroup CPU quota (v2
    ``cpu.max``, v1 ``cpu.cfs_quota_us``) as container runtimes set for ``--cpus``."""
    try:
        n, source = len(os.sched_getaffinity(0)), "sched_getaffinity"
    except (AttributeError, OSError):
        n, source = os.cpu_count() or 1, "os.cpu_count"
    quota = _cgroup_cpu_quota(Path(root), Path(self_cgroup))
    if quota is not None and quota[0] < n:
        n, source = quota
    return n, source


def _cgroup_cpu_quota(root: Path, self_cgroup: Path) -> tuple[int, str] | None:
    rel, rel_v1 = cgroup_paths(self_cgroup, "cpu")
    for d in dict.fromkeys([root / rel, root]):
        try:
            quota, period = (d / "cpu.max").read_text().split()[:2]
            if quota != "max" and int(period) > 0:
                return max(1, -(-int(quota) // int(period))), f"cgroup CPU quota {quota}/{period} in {d / 'cpu.max'}"
        except (OSError, ValueError):
            continue
    for d in dict.fromkeys([root / "cpu" / rel_v1, root / "cpu", root / "cpu,cpuacct" / rel_v1]):
        try:
            quota = int((d / "cpu.cfs_quota_us").read_text())
            period = int((d / "cpu.cfs_period_us").read_text())
        except (OSError, ValueError):
            continue
        if quota > 0 and period > 0:
            return max(1, -(-quota // period)), f"cgroup CPU quota {quota}/{period} (v1)"
    return None


def open_files_limit() -> int | None:
    try:
        import resource
        soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (ImportError, OSError, ValueError):
        return None
    return None if soft == resource.RLIM_INFINITY else int(soft)


def fds_per_rank(nproc: int) -> int:
    """File descriptors the busiest rank (rank 0) needs among ``nproc`` ranks."""
    return FD_BASE + FD_PER_PEER * (nproc - 1)


def check_ranks(nproc: int, device: str, m: Machine, *, force: bool = False) -> list[str]:
    """Refuse ``nproc`` ranks that ``m`` cannot run (UsageError, exit 2), before anything starts.

    Returns notes for what ``force`` let through. NCCL: one GPU per rank. gloo on the CPU: a
    core per rank (up to ``MAX_RANKS_PER_CPU`` per core with ``force``), and file descriptors
    for every rank's connections to its peers (never forced: past the limit the ranks fail).
    """
    notes = []
    fix = "--nproc (or parallel.world_size in the spec)"
    if device == "cuda":
        if nproc > m.gpus:
            raise UsageError(f"{nproc} ranks on NCCL need a GPU each, and {m.gpus} GPU(s) are visible "
                             f"(torch.cuda.device_count(); CUDA_VISIBLE_DEVICES="
                             f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')})",
                             tip=f"set {fix} to {max(m.gpus, 1)} or fewer, or use --device cpu for gloo ranks")
    elif nproc > m.cpus:
        cores = f"the {m.cpus} CPU core(s) this process may use ({m.cpus_source})"
        most = MAX_RANKS_PER_CPU * m.cpus
        if nproc > most:
            raise UsageError(f"{nproc} ranks are more than {MAX_RANKS_PER_CPU} per core on {cores}",
                             tip=f"set {fix} to {m.cpus} or fewer ({most} at most with --force)")
        if not force:
            raise UsageError(f"{nproc} ranks are more than {cores}: gloo ranks would share cores, and their "
                             "step times with them",
                             tip=f"set {fix} to {m.cpus} or fewer, or add --force to run up to {most} "
                                 f"({MAX_RANKS_PER_CPU} per core)")
        notes.append(f"{nproc} ranks on {m.cpus} CPU core(s) (--force): ranks share cores, so step times "
                     "are slower than with a core each")
    need = fds_per_rank(nproc)
    if m.open_files is not None and need > m.open_files:
        raise UsageError(f"{nproc} ranks need about {need} open files in rank 0 (its connections to "
                         f"{nproc - 1} peers), over this process's limit of {m.open_files} (RLIMIT_NOFILE)",
                         tip=f"set {fix} to {max((m.open_files - FD_BASE) // FD_PER_PEER + 1, 1)} or fewer, "
                             f"or raise the limit (ulimit -n {need})")
    return notes


def check_rank_memory(rank_bytes: list[int], available, *, device: str = "cpu",
                      force: bool = False) -> list[str]:
    """Refuse ranks whose predicted peaks (one per rank, each with the preflight's allocator
    margin) add up to more than ``available`` (a :class:`ckplan.preflight.Available`) on the CPU.

    Returns notes for what ``force`` let through. On CUDA every rank has a GPU of its own (its
    out-of-memory becomes a row), so nothing is summed.
    """
    if device != "cpu" or available.bytes is None or not rank_bytes:
        return []
    factor, fixed = MARGINS["cpu"]
    need = sum(int(b * factor) + fixed for b in rank_bytes)
    if need <= available.bytes:
        return []
    n = len(rank_bytes)
    message = (f"{n} ranks are predicted to need {format_bytes(need)} together (up to "
               f"{format_bytes(max(rank_bytes))} of tensors each, plus the CPU allocator's margin of "
               f"{factor - 1:.0%} and {format_bytes(fixed)} per process), but this machine has "
               f"{format_bytes(available.bytes)} available ({available.source})")
    if not force:
        raise UsageError(message, tip="use a smaller --nproc or --batch-size; --force runs anyway")
    return [f"running anyway (--force): {message}"]
