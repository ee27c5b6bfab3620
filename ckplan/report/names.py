"""The report files' names: model and device as file-name parts, and what writing them replaces."""
from __future__ import annotations

import hashlib
import os
import re
import time
from pathlib import Path

SLUG_MAX = 100  # file names are at most 255 bytes; a model name goes in with a prefix and suffixes


def _slug(text: str) -> str:
    """``text`` as a file-name part: other characters than letters, digits, ``_.-`` become ``-``;
    a long name is cut to :data:`SLUG_MAX` characters, its end a hash of the whole name (two
    long names that share their first 91 characters still get two sets of files)."""
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "-", text).strip("-") or "model"
    if len(slug) <= SLUG_MAX:
        return slug
    digest = hashlib.sha1(text.encode("utf-8", "surrogatepass")).hexdigest()[:8]
    return f"{slug[:SLUG_MAX - 9].rstrip('-.')}-{digest}"


PROFILE_GLOB = "profile-*.json"  # the profiles ``ckplan profile`` saves under its --out-dir


def profile_basename(model: str, device: str) -> str:
    return f"profile-{_slug(model)}-{_slug(device)}"


def sweep_basename(model: str) -> str:
    return f"sweep-{_slug(model)}"


def bench_basename(model: str, device: str) -> str:
    return f"bench-{_slug(model)}-{_slug(device)}"


def frontier_basename(model: str, device: str) -> str:
    return f"frontier-{_slug(model)}-{_slug(device)}"


def bench_filenames(model: str, device: str) -> tuple[str, ...]:
    """The files :func:`write_bench` writes, for :func:`check_output_dir` before the run."""
    base = bench_basename(model, device)
    return (*(f"{base}.{ext}" for ext in ("csv", "json", "png")),
            f"{frontier_basename(model, device)}.png")


def replaced_note(paths: list[Path] | tuple[Path, ...], since: float) -> str | None:
    """What writing ``paths`` replaces, to say so: files of an earlier run, or (modified at or
    after ``since``, this run's start, a ``time.time()``) of another run that wrote them while
    this one ran. None when none of them exists."""
    found = []
    for p in paths:
        try:
            found.append((Path(p), os.stat(p).st_mtime))
        except OSError:
            continue
    if not found:
        return None
    newest = max(m for _, m in found)
    names = ", ".join(p.name for p, _ in found)
    folder = found[0][0].parent
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(newest))
    if newest >= since:
        return (f"note: another run wrote {names} in {folder} while this one ran (at {when}); its results "
                "are replaced by these: give each run its own --out-dir")
    return f"note: replaced {names} in {folder}, written by an earlier run at {when}"
