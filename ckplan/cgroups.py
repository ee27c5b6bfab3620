"""Where this process's cgroup lives (v2, else v1), for the limits the preflight and the rank
launcher read (memory, CPU quota)."""
from __future__ import annotations

from pathlib import Path


def cgroup_paths(self_cgroup: Path, controller: str) -> tuple[str, str]:
    """(the v2 group's path, the v1 ``controller`` group's path) from ``/proc/self/cgroup``, each
    relative to the cgroup root ("" when absent or unreadable)."""
    rel, rel_v1 = "", ""
    try:
        for line in self_cgroup.read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            if controllers == "":
                rel = path.strip().lstrip("/")
            elif controller in controllers.split(","):
                rel_v1 = path.strip().lstrip("/")
    except (OSError, ValueError):
        pass
    return rel, rel_v1
