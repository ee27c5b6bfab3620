"""Human-readable output: rich tables on stdout, the only module that imports rich.

Tables fit the terminal: each table names its essential columns (always shown) and ranks the
others; as many of those as fit the width are added, in rank order, and shown in the table's own
column order. ``wide=True`` shows every column. The width is ``COLUMNS`` when set, else the
terminal's; piped output with no ``COLUMNS`` (files, CI logs) gets every column at full width.
JSON and CSV always carry every field.

:mod:`~ckplan.render.consoles` (consoles, safe text, messages, progress),
:mod:`~ckplan.render.tables` (the fitting rule), and one module per command's tables:
:mod:`~ckplan.render.profile`, :mod:`~ckplan.render.plans`, :mod:`~ckplan.render.benches`.
"""
from .benches import bench_table, dist_bench_table
from .consoles import clean, error, escape, info, progress_bar, stderr, stdout
from .devices import device_table
from .plans import export_text, plan_tables, sweep_table, world_size_table
from .profile import options_table, profile_table

__all__ = ["bench_table", "clean", "device_table", "dist_bench_table", "error", "escape", "export_text", "info",
           "options_table", "plan_tables", "profile_table", "progress_bar", "stderr", "stdout", "sweep_table",
           "world_size_table"]
