"""The file sets each command writes to its --out-dir (CSV, JSON and PNG), each all or nothing."""
from __future__ import annotations

from pathlib import Path

from .documents import bench_doc, dist_bench_doc, profile_doc, to_json
from .files import write_files
from .frames import bench_frame, sweep_frame
from .names import bench_basename, frontier_basename, profile_basename, sweep_basename
from .plots import plot_bench, plot_frontier, plot_sweep


def profile_device_tag(prof) -> str:
    """The device part of a saved profile's name: cpu, cuda or meta (``-compiled`` when it was)."""
    return f"{prof.device}-compiled" if prof.compiled else prof.device


def profile_path(out_dir: str | Path, prof) -> Path:
    return Path(out_dir) / f"{profile_basename(prof.model, profile_device_tag(prof))}.json"


def write_profile(out_dir: str | Path, prof) -> Path:
    """profile-<model>-<device>.json: the document ``ckplan profile -f json`` prints, which ``ckplan
    plan`` (and ``ckplan bench``) read when they are given no SPEC."""
    text = to_json(profile_doc(prof))
    return write_files([(profile_path(out_dir, prof), lambda p: p.write_text(text))], "--out-dir")[0]


def write_sweep(out_dir: str | Path, model: str, points) -> list[Path]:
    """CSV and PNG of every strategy's memory-vs-overhead frontier."""
    frame = sweep_frame(points)
    base = sweep_basename(model)
    # Names are built by appending: Path.with_suffix would cut "llama-3.1-8b" at its dot.
    return write_files([(Path(out_dir) / f"{base}.csv", lambda p: frame.to_csv(p, index=False)),
                        (Path(out_dir) / f"{base}.png", lambda p: plot_sweep(frame, model, p))], "--out-dir")


def write_bench(out_dir: str | Path, result) -> list[Path]:
    """bench-<model>-<device>.{csv,json,png}: the whole set or none of it (see :func:`write_files`)."""
    base = Path(out_dir) / bench_basename(result.model, result.device_tag)
    frame = bench_frame(result)
    text = to_json(bench_doc(result))
    return write_files([(Path(f"{base}.csv"), lambda p: frame.to_csv(p, index=False)),
                        (Path(f"{base}.json"), lambda p: p.write_text(text)),
                        (Path(f"{base}.png"), lambda p: plot_bench(result, p)),
                        (Path(out_dir) / f"{frontier_basename(result.model, result.device_tag)}.png",
                         lambda p: plot_frontier(result, p))], "--out-dir")


def write_dist_bench(out_dir: str | Path, result) -> list[Path]:
    """bench-<model>-<device>-<kind><N>.{csv,json}, as one set (see :func:`write_files`)."""
    base = Path(out_dir) / f"{bench_basename(result.model, result.device)}-{result.kind}{result.world_size}"
    frame = result.to_frame()
    text = to_json(dist_bench_doc(result))
    return write_files([(Path(f"{base}.csv"), lambda p: frame.to_csv(p, index=False)),
                        (Path(f"{base}.json"), lambda p: p.write_text(text))], "--out-dir")
