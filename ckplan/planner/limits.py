"""Every tuning constant of the planner's solvers and tables, one place to read and to patch.

Code reads them as ``limits.NAME`` when it runs, so a test (or a benchmark) that sets
``ckplan.planner.limits.NAME`` changes every solver at once. Measurements quoted are from
``scripts/bench_planner.py`` on a 2-core CPU; docs/planner.md explains the design.
"""
from __future__ import annotations

import os

# ---- Compiled kernels (tables/compiled.py) -------------------------------------------------
USE_NUMBA = os.environ.get("CKPLAN_NUMBA", "1") != "0"  # CKPLAN_NUMBA=0 forces the numpy path
NUMBA_MIN_UNITS = 40  # below this, numpy until numba is loaded: loading it costs ~0.5 s a process
# The frontier kernel gallops over envelope segments it cannot beat: 1.3x, identical tables
# (compiled in as constants: read once, at import, by tables/frontier_kernel.py).
GALLOP_BLOCK, GALLOP_AFTER = 16, 16
SMALL_UNITS = 64  # slot tables up to this many units use float64 (float32 above: half the memory)

# ---- Slot tables (solve/tables.py) --------------------------------------------------------
CELL_BUDGET = 30_000_000  # U * U * slots float32 cells: ~120 MB, under 1 s at 100 layers
FLAT_CELL_BUDGET = 500_000_000  # U * max_len * slots cells visited by the depth-1 DP: ~1.5 s
MIN_SLOTS, MAX_SLOTS = 500, 8192  # rotor uses 500; more slots past 8192 buy nothing measurable
EXACT_MAX_LAYERS = 120  # auto mode: above this, group layers (U^2 M memory, U^3 M time)
DEFAULT_GROUPS = 100  # grouped tables: units of consecutive layers, at most this many
UB_MIN_LAYERS, UB_SLOTS = 40, 256  # exact DP: a slot table (in UB_SLOTS) bounds the optimum first
PARETO_MAX_POINTS = 50_000  # breakpoints per sub-chain before the exact DP gives way to slots
CAST_READS = 8  # mixed precision: table reads at lowered budgets before the guaranteed one
SCAN_READS, CAST_SCAN_READS = 64, 4  # slot-plan reads per table read (copies make most overshoot)

# ---- Near the smallest peak on long chains (solve/near_min.py) ----------------------------
NEAR_MIN_GROUPS, NEAR_MIN_UNITS = 40, 130  # regular cuts added to the plan's own; most units (~10 s)
NEAR_MIN_SLOTS, NEAR_MIN_MIN_SLOTS = 500, 200  # slots of the single-layer DP up to the budget
NEAR_MIN_CELLS = 30_000_000  # U * U * slots float32 cells (120 MB), ~1-4 s
NEAR_MIN_SIMS = 1000  # simulations of the local improvement (fewer on long chains)

# ---- The banded DP (solve/band.py) --------------------------------------------------------
# Band L starts at BAND_START and doubles while the plan uses a checkpoint of L layers (or none
# fits), until the next band would build over BAND_WORK breakpoints (each builds 3-4x the last);
# plan_dp takes it from BAND_MIN_LAYERS + 1 to BAND_MAX_LAYERS layers.
BAND_START, BAND_MIN_LAYERS, BAND_MAX_LAYERS, BAND_WORK = 16, 64, 400, 6_000_000
BAND_MAX_POINTS = 250_000  # one frontier's breakpoints (6 MB): past it, retried pruned by the slot plan
BAND_MAX_TOTAL = 60_000_000  # a table's breakpoints (24 B each, ~1.4 GB): past it, other tables plan
BAND_OPTIONS_MAX_LAYERS = 1200  # options keep the band past 400 layers (2000 outgrew BAND_MAX_TOTAL)
BAND_TOP = 64  # over 400 layers, long top-level checkpoints span at most this (x4 while needed)
EXACT_PROOF_LAYERS = 400  # the band's note suggests --exact up to here (3-4 s at 300; 24 GB at 1000)
# Nesting in the band (up to NEST_MAX_LAYERS): a long top-level checkpoint may nest the band's
# checkpoints where it merges up to NEST_MERGE top-level ones of a plan found (5: at 2-4, 1-3%
# misses remained at 65-100 layers), NEST_ROUNDS more tables at most; L also doubles up to
# NEST_WIDEN while the plan nests one of L + 1 to 2L layers (wider found nothing, cost up to 10x).
NEST_MAX_LAYERS, NEST_ROUNDS, NEST_MERGE = BAND_MAX_LAYERS, 4, 5
NEST_WIDEN = 2 * BAND_START
# The coarse bound (from COARSE_MIN_LAYERS layers, COARSE_MIN_FRAC up from the smallest peak):
# band COARSE_BAND, top-level checkpoints up to COARSE_TOP, sizes in avail / COARSE_SLOTS units,
# at most COARSE_READS reads lower until it fits (400 option-heavy layers half-way up: 13 s -> 2 s).
COARSE_MIN_LAYERS, COARSE_MIN_FRAC, COARSE_SLOTS = BAND_MIN_LAYERS + 1, 0.05, 2000
COARSE_BAND, COARSE_TOP, COARSE_READS = 4, 64, 6
# Thinned tails over TRIM_MIN_LAYERS: within exp(TAIL_TRIM_ERROR) - 1 = 4.6% of the band's
# optimum (measured 0.00-0.05%; 1000 layers with options at the smallest peak: 2.6 s -> 1.0 s).
TAIL_TRIM_ERROR, TRIM_MIN_LAYERS = 0.045, 200
TRIM_EVERY = 8  # over 400 layers every 8th tail, thinned 8x as much (4 and 16 were slower)
TAIL_TRIM_ABS = 0.04  # with a bound plan: absolute thinning, this share of its recompute (within 4.2%)

# ---- Held layers, autocast copies, unkept boundaries (held.py, casts.py, solve/) ------------
HELD_MAX_LAYERS = 200  # held.py plans held chains up to here exactly (per-rank chains of real models are)
HELD_PARETO_MAX_POINTS = 50_000  # breakpoints per inner sub-chain before held.py's exact DP gives up
CAST_MAX_STATES = 32  # mixed precision: top-level states kept per unit (casts.py's beam, cheapest first)
UNKEPT_STEPS = 8  # budgets read above the asked one on the bound that keeps every boundary
# Up to UNKEPT_DIRECT_LAYERS the exact DP on the chain itself plans it (solve/unkept_dp.py; its
# frontiers once per chain: 15 ms at 8 layers, 50 ms at 12, 0.15 s at 16, 0.4 s at 20)
UNKEPT_DIRECT_LAYERS = 16
# chains that DP does not model: up to here every plan is tried (8,558 at 7 layers: about 0.7 s once per chain)
UNKEPT_EXHAUSTIVE_LAYERS = 7
UNKEPT_IMPROVED = 8  # the cheapest plans that fit, each improved by moving checkpoint ends (solve/improve.py)
UNKEPT_IMPROVE_WORK = 20_000  # simulations x layers spent on those improvements per plan (0.1 s at 100 layers)
HELD_FALLBACK_READS = 12  # held chains held.py does not take: reads lowered by each overshoot


# offload: a copy back may start up to this many layers' backward before the default (the next
# layer's), tried by dp for at most this many replays (solve/offload.py)
OFFLOAD_LOOKAHEAD = 4
OFFLOAD_FETCH_TRIALS = 256
# offload DP states kept per unit (cheapest first, after exact dominance): its work is about
# units^2 x states, held to OFFLOAD_STATE_WORK (400 layers: 32 states, 24 layers: 256). With 32 on
# every chain, BERT-large's meta chains (8 x 512, H100) planned 0.7-1.3 points slower on average
# than with no cap over 19 budgets and gpt2-small's found no plan at 3 of them; with 256, 0.00-0.07.
OFFLOAD_MIN_STATES, OFFLOAD_MAX_STATES, OFFLOAD_STATE_WORK = 32, 256, 5_000_000
# up to this many layers dp also plans with copies back priced as started up to OFFLOAD_LOOKAHEAD
# layers early, and keeps the faster plan (solve/offload.py)
OFFLOAD_WIDE_MAX_LAYERS = 64
# Chains with side inputs up to this many layers are also planned at the budget plus the side
# inputs' bytes, which the tables count for the whole step (solve/portfolio.py: plan_unheld)
SIDE_RELAX_MAX_LAYERS = 64
SIDE_RELAX_READS = 4  # reads of those tables, each lower by the last plan's overshoot
