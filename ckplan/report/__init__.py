"""Machine-readable outputs: JSON envelopes, DataFrames, CSV/PNG files written atomically.

:mod:`~ckplan.report.documents` (JSON), :mod:`~ckplan.report.frames` (DataFrames),
:mod:`~ckplan.report.files` (safe writes), :mod:`~ckplan.report.names` (file names),
:mod:`~ckplan.report.plots` (figures) and :mod:`~ckplan.report.sets` (each command's files).
"""
from .documents import bench_doc, dist_bench_doc, envelope, plan_doc, profile_doc, sweep_doc, to_json, world_size_doc
from .files import (
    ReportsInterrupted,
    atomic_write,
    check_output_dir,
    check_output_file,
    write_csv,
    write_files,
    write_text,
)
from .frames import bench_frame, profile_frame, records_frame, sweep_frame
from .names import (
    PROFILE_GLOB,
    SLUG_MAX,
    bench_basename,
    bench_filenames,
    frontier_basename,
    profile_basename,
    replaced_note,
    sweep_basename,
)
from .sets import profile_path, write_bench, write_dist_bench, write_profile, write_sweep

__all__ = ["PROFILE_GLOB", "SLUG_MAX", "ReportsInterrupted", "atomic_write", "bench_basename", "bench_doc",
           "bench_filenames", "bench_frame", "check_output_dir", "check_output_file", "dist_bench_doc", "envelope",
           "frontier_basename", "plan_doc", "profile_basename", "profile_doc", "profile_frame", "profile_path",
           "records_frame", "replaced_note", "sweep_basename", "sweep_doc", "sweep_frame", "to_json", "world_size_doc",
           "write_bench", "write_csv", "write_dist_bench", "write_files", "write_profile", "write_sweep", "write_text"]
