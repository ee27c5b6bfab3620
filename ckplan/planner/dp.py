"""The optimal plan: least recompute time whose simulated peak fits a budget, nested checkpoints allowed.

This is rotor's dynamic program (Beaumont, Eyraud-Dubois, Herrmann, Joly, Shilova, "Optimal
checkpointing for heterogeneous chains: how to train deep neural networks with limited memory",
2019/2021; the same family of schedules as Revolve), written against *our* simulator so that
the two agree exactly.

Sub-problem ``C(s, e, m)``: the least recompute time of a sequence of items covering units
``[s, e)`` when ``m`` bytes are available above the memory at its start, and at that start the
gradient of unit ``e-1``'s output and every parameter gradient of units ``>= e`` already exist.
Both the whole plan (units ``[0, U)``, the post stage being the last unit, always stored) and the
inner plan of every checkpoint are such sequences, which is what makes the recursion close:

* ``Store(s)``, then ``C(s+1, e, m - hold[s])``; feasible when the forward and the backward of
  ``s`` fit (its backward runs after the rest: ``bwd_req[s] + grads(s+1..e-1) - x[e-1]``).
* ``Checkpoint[s, j)`` with ``s < j < e`` (a checkpoint never ends a sequence: dropping it is
  never worse), then ``C(j, e, m - x[j-1])`` for the rest, then its inner plan
  ``C(s, j, m - grads(j..e-1) + x[e-1] - x[j-1])`` costing ``fwd(s..j-1) - tail(j-1)`` more
  (``Layer.tail_ms``: PyTorch's early stop skips the last layer's tail); feasible when the
  forward that keeps no activations fits.

**Exact bytes (the default).** Chains that are not grouped and have no autocast copies are
solved by the same recursion with each ``C(s, e, .)`` kept as its exact Pareto frontier of
(bytes, recompute) breakpoints (``tables.ParetoTable``): optimal at every budget whatever the
sizes, ``slot_bytes`` = 1 and ``exact`` = True. The tables are bounded by the budgets asked
(``plan_dp`` builds them up to its budget only; sub-chains no plan can reach are skipped) and
by the recompute of a plan known to fit at the lowest budget (the smallest-peak plan, and on 40
layers or more the plan read in exact bytes from the nested slot table on single layers with 256
slots, ``_slot_bound``, 0.3-7% above the optimum): nothing dearer is part of an optimal plan, and
a tight bound prunes most breakpoints; each sub-chain also gets its own recompute cap (the bound
minus the forward of the checkpoints around it, ``tables.reach``). With numba installed
(``ckplan[fast]``) the frontiers, the min-peak table, the slot table and the depth-1 table's
inner minimum are compiled (``tables.jitted``; identical tables, tests compare them): about
0.1 s at 100 layers (0.15-0.3 s with two selective options per layer, bound by the size of the
exact frontiers) instead of 1-6 s, 0.1-0.9 s at 1000 layers (grouped; the layer-level min-peak
table, O(U^3), is built only where a plan needs it: at the smallest peak).
Measured with scripts/bench_planner.py; passing ``max_slots`` (or ``pareto=False``) asks for the
slot tables below instead.

**Banded (``plan_dp``'s default from ``BAND_MIN_LAYERS`` + 1 to ``BAND_MAX_LAYERS`` layers).**
Proving a plan optimal takes the exact frontiers of every sub-chain, O(U^3) splits; the optimal
plans themselves nest only short checkpoints, plus, on chains whose layers keep little besides
their output, long top-level checkpoints that store every layer inside. ``banded_plan`` runs
the same exact DP over exactly those plans (checkpoints of at most L layers, top-level ones of
any length storing all inside: ``PeakTable``/``ParetoTable``'s ``max_len``/``top_len``),
O(U L^2 + U^2), and widens L (16, 32, ...) while the plan uses a checkpoint of L layers or none
fits. Near the smallest peak the optimum often merges a few short top-level checkpoints into
one long one with short checkpoints inside, which no plan of the band shows (the band's plan
then has no checkpoint of L layers, so widening stopped: up to 9.9% more recompute on 65-150
layer chains whose best checkpoint spans 20-75 layers). Up to ``NEST_MAX_LAYERS`` layers such
checkpoints join the band (``nest``): a top-level checkpoint may nest checkpoints of the band
when it ends where a top-level checkpoint of a plan found so far ends and starts at most
``NEST_MERGE`` top-level checkpoints back (``ParetoTable``'s ``nest``; a few more sub-chains,
1-10% more breakpoints near the smallest peak). Optimal among its plans (brute force in
``tests/test_planner_banded.py``); not proven optimal overall (``exact`` False, a note says so),
but within 0.4% of the exact DP at every budget of ``scripts/bench_planner.py --gap`` up to 200
layers on random, MLP-like, transformer-like, block and long-run chains, options included, and
equal to it on most (``reports/cpu/planner/gap-200-nest.txt``). The exact DP itself is no
option there: with two options per layer it took 0.1-0.4 s at 65 layers, 0.3-1.4 s at 128 and
2.5-5 s at 150 (2-core CPU), against 0.05-0.25 s for the banded DP at 128. ``mode="exact"``
still asks for the proof.

On chains of over ``TRIM_MIN_LAYERS`` layers the tails' frontiers ``F(s, U)``, where long chains
spend their time, are thinned (``tail_trim``): a thinned tail keeps a breakpoint only when it is
at least ``TAIL_TRIM_ERROR / k`` cheaper than the last one kept, k the most top-level items of a
plan that start at a thinned tail: every tail up to ``BAND_MAX_LAYERS`` layers (k = U), every
``TRIM_EVERY``-th above (k = ceil(U / TRIM_EVERY), each thinned 8 times as much: half the
points). Every point left is a real plan's exact (bytes, recompute), so plans fit as before;
each such item costs at most ``1 / (1 - trim)`` more, so the plan is within
``exp(TAIL_TRIM_ERROR)`` = 4.6% of the band's optimum (measured 0.00-0.05% up to 400 layers,
0.0-0.1% at 1000; ``scripts/bench_planner.py --gap``, ``--band-gap``). Chains of over
``BAND_MAX_LAYERS`` layers with selective options take this path at every budget (the grouped
tables below cannot use options: their plans recomputed 7% to 5.5x as much at 1000 layers), up
to ``BAND_OPTIONS_MAX_LAYERS`` layers, and fall back to the grouped tables when the frontiers
outgrow ``BAND_MAX_TOTAL`` points.

**Selective options (``Layer.options``).** Storing a layer may keep less than its ``xbar`` and
redo part of its forward in its backward. In the exact DP, ``Store(s)`` with option ``o`` keeps
``opt_hold[s, o]``, needs ``opt_store_req[o, s, e]`` (``groups.py``/``tables.py``: the same
arithmetic as ``store`` with the option's ``xbar``, ``fwd_tmp`` and ``bwd_tmp``) and costs
``opt_ms[s, o]`` more; the recursion takes the best option of every stored layer (the min-peak
table, the Pareto frontiers and the plan readers alike), so plans are optimal over every nested
plan and every option of every layer, and ``min_peak`` is the smallest peak with options. The
nested slot table on single layers (``CostTable``) takes options the same way (exact with gcd
slots). Grouped long chains (and their depth-1 table) and autocast chains plan without options
(``chain.without_options()``, said in ``DPResult.notes``); where only options reach a budget
(between the smallest peak with and without them) they return the smallest-peak plan, with
options, spending the slack greedily.

**Slots (mixed precision, long chains, explicit ``max_slots``).**
``m`` is counted in slots of ``slot_bytes``, the same for every budget (one table serves a
whole frontier). When every size is a multiple of the slot (``slot_bytes`` = gcd of all sizes,
used whenever that needs few enough slots) the DP is exact; tests check it against brute force
over every plan. Otherwise sizes are rounded to the nearest slot (rotor rounds up, which is safe
but, on a chain of n stored layers, loses up to n slots). Either way a plan is *read* in exact
bytes: the companion min-peak table ``R(s, e)`` (below, exact integers) says whether an option
can be completed within what is left, and the cost table only ranks the options that can. So a
returned plan never exceeds its budget, by construction, and the simulator re-checks it.

Complexity O(U^3 M) for U units and M slots, vectorised over slots with numpy: for each end
``e`` and each split ``j`` one array operation covers every start ``s < j`` and every slot.

Long chains (more than ``EXACT_MAX_LAYERS`` layers in ``mode="auto"``) would need U^2 M memory
and U^3 M time, so the solver keeps two cheaper tables and returns the better plan:

* the nested DP on at most ``groups`` units of consecutive layers (``groups.py``, exact merged
  costs), optimal among plans that cut only between groups: it matters at tight budgets,
  where deep nesting is the only way down;
* the depth-1 DP on single layers (``FlatTable``, O(U L M), segments up to L layers): every
  checkpoint's inner plan stores all, but which layers to checkpoint is chosen layer by layer,
  which is what matters on heterogeneous chains.

Just above the smallest peak (a band of 0.1-0.5% of the range) both tables miss; there the
banded DP plans (trimmed: at 1000 random layers 0.7-1.0 s, 23.6% recompute where the plans below
cost 43%), and where it finds nothing within its work limit ``near_min_plan`` runs the nested DP on
single layers with slots spread over that budget only (up to ~380 layers; 1-4 s), else the
exact DP on groups cut at the smallest-peak plan's own boundaries, and a local improvement pass
checked by the simulator.

``min_peak`` solves the companion min-max program ``R(s, e)`` over exact integer bytes: the
smallest available memory for which a plan of [s, e) exists; ``R(0, U)`` gives the smallest
achievable peak. It is solved by sub-chain length so that each length is one set of array
operations (O(U) Python steps, about 1 s at 1000 layers). The layer-level tables (units, pair
costs, min-peak table) are built once per chain (``layer_tables``, cached) and shared by
``min_peak``, ``min_peak_plan`` and the solver.

The tables live in ``tables.py`` (with a legend of the short names); this module chooses slots,
builds the tables for a chain and reads plans from them.

Mixed precision (``Layer.cast_bytes``): autocast's weight copies of a layer inside a top-level
checkpoint stay live until the forward ends (see ``simulate.py``). The tables above do not model
them (they add memory to the forward only, which the one-budget sub-problems cannot express). On
such chains ``casts.py`` handles the top-level sequence with two budgets (forward, backward):
``min_peak`` and feasibility are exact, and its least-recompute top-level DP uses the cost
table for the inner plans (optimal against brute force with gcd slots). The solver keeps the
cheaper of that plan and of its tables read at lowered budgets until the simulated plan fits
(first at the budget, then lowered by the overshoot, at worst at ``budget - sum(cast_bytes)``,
where every plan of the tables fits). Plans never exceed the budget; ``exact`` is reported False.

Held layers (``Layer.held_bytes``: FSDP2 per rank, whose inner plans hold their layers' units):
``held.py`` (the same recursion, inner sub-chains and the top level on their own costs; exact),
else this module's tables on the chain without its holds, read lower until the plan fits.
"""
from __future__ import annotations

import math
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from functools import cached_property, lru_cache

import numpy as np

from ..errors import SpecError
from . import held
from .baselines import plan_every_k, plan_none
from .casts import CastFrontier
from .chain import Chain
from .floor import infeasible_error
from .groups import Units, cheap_cuts, equal_cuts, make_units, size_gcd
from .plan import Checkpoint, Plan, items_from_ranges
from .simulate import peak_of, simulate
from .tables import (
    INF,
    CostTable,
    FlatTable,
    InnerPart,
    PairCosts,
    ParetoTable,
    PeakTable,
    Spans,
    base_bytes,
    exact_chooser,
    fixed_peak,
    jitted,
    nest_spans,
    reconstruct_options,
)

OPTIONS_IGNORED = ("selective options ignored by these tables: planned with store and full "
                   "checkpoints only")

__all__ = ["DPResult", "DPSolver", "base_bytes", "cast_frontier", "choose_slot", "fixed_peak",
           "infeasible_error", "layer_tables", "min_peak", "min_peak_plan", "plan_dp"]

CELL_BUDGET = 30_000_000  # U * U * slots float32 cells: ~120 MB, under 1 s at 100 layers
FLAT_CELL_BUDGET = 500_000_000  # U * max_len * slots cells visited by the depth-1 DP: ~1.5 s
MIN_SLOTS, MAX_SLOTS = 500, 8192  # rotor uses 500
EXACT_MAX_LAYERS = 120  # auto mode: above this, group layers
UB_MIN_LAYERS, UB_SLOTS = 40, 256  # exact DP: a slot table (in UB_SLOTS) bounds the optimum first
PARETO_MAX_POINTS = 50_000  # breakpoints per sub-chain before the exact DP gives way to slots
NEAR_MIN_GROUPS, NEAR_MIN_UNITS = 40, 130  # near_min_plan: regular cuts, most units (~10 s)
NEAR_MIN_SLOTS, NEAR_MIN_MIN_SLOTS = 500, 200  # near_min_plan: slots of the single-layer DP
NEAR_MIN_CELLS = 30_000_000  # near_min_plan: U * U * slots float32 cells (120 MB), ~1-4 s
NEAR_MIN_SIMS = 1000  # near_min_plan: simulations of the local improvement (fewer on long chains)
DEFAULT_GROUPS = 100
# The banded DP (``banded_plan``): the exact DP in bytes over plans whose checkpoints span at
# most L layers, L = BAND_START, doubled while the best plan found uses a checkpoint as long as
# the band (or no banded plan reaches the budget), up to the whole chain (then exact), or until
# the next band would build more than BAND_WORK breakpoints (a band builds about 3-4 times the
# breakpoints of the one before). ``plan_dp`` uses it on chains of BAND_MIN_LAYERS to
# BAND_MAX_LAYERS layers (the exact DP below, the grouped tables above, where it still serves
# budgets too close to the smallest peak for the grouped tables).
BAND_START, BAND_MIN_LAYERS, BAND_MAX_LAYERS, BAND_WORK = 16, 64, 400, 6_000_000
# One frontier's breakpoints, most (6 MB): past it the band's table stops and is built again pruned by
# the slot table's plan (``_slot_plan``, chains of up to BAND_MAX_LAYERS layers), a tighter bound
# than the smallest-peak plan's at high budgets; past it again, the caller's tables take over.
BAND_MAX_POINTS = 250_000
# Chains of up to NEST_MAX_LAYERS layers: a top-level checkpoint longer than the band may also
# nest checkpoints of the band inside when it ends where a top-level checkpoint of a plan found
# so far ends and starts no earlier than the NEST_MERGE-th top-level checkpoint before that
# (``banded_plan``'s ``nest``; ``_nest_spans``): near the smallest peak the optimum often merges
# a few short top-level checkpoints into one long one, which the band alone cannot express (it
# then recomputed up to 9.9% more on 65-150 layer chains whose best checkpoint spans 20-75
# layers). Up to NEST_ROUNDS more tables while the plan nests and ends top-level checkpoints
# elsewhere. NEST_MERGE 5: at 2-4, 1-3% misses remained on 65-100 layer chains; 5 builds 1-10%
# more breakpoints near the smallest peak (128 layers, two options each), 20-70% more at 10-30%.
NEST_MAX_LAYERS, NEST_ROUNDS, NEST_MERGE = BAND_MAX_LAYERS, 4, 5
# A nested checkpoint ends only where the spans allow; band 2L lets one of at most 2L layers end
# anywhere. So L is also doubled while the plan nests one of L + 1 to 2L layers, up to
# NEST_WIDEN: on 70 identical MLP-like layers 10% up the band of 16 nested one of 22 layers and
# recomputed 0.9% more than band 32; widening on to 64 found nothing more on 65-160 layer
# chains and cost up to 10x (160 long-run layers with options: 3.4 million breakpoints).
NEST_WIDEN = 2 * BAND_START
# All frontiers of one band's table together, most (24 bytes each: ~1.4 GB, ~2 GB while the
# arrays grow): past it, as past BAND_MAX_POINTS.
BAND_MAX_TOTAL = 60_000_000
# Chains with selective options take the banded DP up to this many layers (over BAND_MAX_LAYERS,
# grouped tables without options beyond: 2000 random layers with two options each outgrew
# BAND_MAX_TOTAL after 15 s).
BAND_OPTIONS_MAX_LAYERS = 1200
# Chains of at least COARSE_MIN_LAYERS layers, at budgets at least COARSE_MIN_FRAC of the way up
# from the smallest peak, start the banded DP from the plan of band COARSE_BAND (long top-level
# checkpoints up to COARSE_TOP layers) solved with every size rounded to avail / COARSE_SLOTS
# bytes (``_coarse_plan``): a bound that prunes what the smallest-peak plan cannot (400
# option-heavy layers half-way up: 13 s -> 2 s; 128 layers with two options each, 90% up: the
# table 0.14 s -> 0.01 s for a coarse plan of 0.03 s).
COARSE_MIN_LAYERS, COARSE_MIN_FRAC, COARSE_SLOTS = BAND_MIN_LAYERS + 1, 0.05, 2000
COARSE_BAND, COARSE_TOP, COARSE_READS = 4, 64, 6
# Chains over TRIM_MIN_LAYERS: the banded DP thins its tails' frontiers (``ParetoTable``'s
# ``trim``), so a plan is within exp(TAIL_TRIM_ERROR) - 1 = 4.6% of the band's optimum. Every
# tail by TAIL_TRIM_ERROR / U (measured: 0.00-0.05%): 1000 layers with options at the smallest
# peak, the table 2.6 s -> 1.0 s; 400 option-heavy blocks 10% up: 2.0 s -> 0.8 s.
TAIL_TRIM_ERROR, TRIM_MIN_LAYERS = 0.045, 200
# Over BAND_MAX_LAYERS only every TRIM_EVERY-th tail is thinned, by TRIM_EVERY times as much (the
# same bound): at 1000 layers with options the table 1.07 -> 0.67 s at the smallest peak, 2.8 ->
# 1.1 s half-way up (4 and 16 were slower); measured gaps 0.0-0.1% (at 250-400 layers it would
# be 0.0-0.5% instead of 0.00-0.05%, for no time to speak of: not there).
TRIM_EVERY = 8
# There, with a bound plan (``_coarse_plan``), the thinning is absolute: TAIL_TRIM_ABS of the
# bound's recompute shared out over the thinned items (``banded_plan``'s ``trim_abs``; proven
# within 4.2% when the bound is the optimum, 4.6% when it is 10% above, else relative again).
TAIL_TRIM_ABS = 0.04
# Over BAND_MAX_LAYERS, long top-level checkpoints span at most BAND_TOP layers, 4x more while the
# plan has one of more than half that (``banded_plan``'s ``widen_top``): trying every length cost 10-40% of the
# table's time at 1000 layers for plans no cheaper on random and blocks chains (1-90% of the
# range: equal to 0.005%; 256 instead of 64 was 8% slower); mlp-100's MLP at depth 1000 takes
# 250-layer ones (64 alone made its plans 0.8-1.1% dearer; widened, equal).
BAND_TOP = 64
# The banded DP's note suggests ``--exact`` up to this many layers (3-4 s at 300; at 1000 the
# exact tables outgrow 24 GB).
EXACT_PROOF_LAYERS = 400
CAST_READS = 8  # mixed precision: table reads at lowered budgets before the guaranteed one
SCAN_READS, CAST_SCAN_READS = 64, 4  # slot-plan reads per table read (copies make most overshoot)


@dataclass(frozen=True)
class DPResult:
    plan: Plan
    slot_bytes: int  # memory granularity of the DP
    n_slots: int  # slots between the fixed memory and the peak without checkpointing
    exact: bool  # slots divide every size and units are single layers: optimal
    n_units: int  # units the DP worked on (layers + post when not grouped)
    notes: tuple[str, ...] = field(default=())


class LayerTables:
    """The tables on single layers that every entry point needs, built once per chain; the
    min-peak table only when first asked for (grouped long chains plan without it: O(U^3))."""

    def __init__(self, units: Units, pairs: PairCosts):
        self.units, self.pairs = units, pairs

    @cached_property
    def peaks(self) -> PeakTable:
        return PeakTable(self.units, self.pairs)


@lru_cache(maxsize=16)  # chains are immutable and hashable; plan_chain and sweep ask repeatedly
def layer_tables(chain: Chain) -> LayerTables:
    u = make_units(chain)
    return LayerTables(u, PairCosts(u))


def _units_for(chain: Chain, mode: str, groups: int | None, cuts: str = "cheap") -> Units | None:
    """The solver's units, or None for the single layers of ``layer_tables``."""
    n = chain.n_layers
    if mode not in ("auto", "exact", "grouped"):
        raise ValueError(f"dp mode must be auto, exact or grouped, not {mode!r}")
    g = groups or DEFAULT_GROUPS
    if mode == "exact" or (mode == "auto" and n <= EXACT_MAX_LAYERS) or g >= n:
        return None
    return make_units(chain, cheap_cuts(chain, g) if cuts == "cheap" else equal_cuts(n, g))


def plan_from(chain: Chain, units: Units, ranges: list[tuple[int, int]], chosen: dict[int, int],
              params: dict) -> Plan:
    """A ``dp`` plan from checkpointed ranges and ``{unit: option column}`` (``reconstruct_options``)."""
    n = chain.n_layers
    plan = Plan("dp", n, items_from_ranges(n, ranges), params)
    return plan.with_options(units.option_names(chosen)) if chosen else plan


@lru_cache(maxsize=16)
def cast_frontier(chain: Chain) -> CastFrontier:
    """The top-level frontiers of a chain with autocast copies (``casts.py``), once per chain;
    selective options are ignored (the frontiers plan store and full checkpoints only)."""
    chain = chain.without_options()
    t = layer_tables(chain)
    top = simulate(chain, plan_none(chain.n_layers)).peak_bytes
    return CastFrontier(chain, t.units, t.pairs, t.peaks, top)


@lru_cache(maxsize=16)
def min_peak(chain: Chain) -> int:
    """The smallest peak any plan reaches (exact: a min-max DP over bytes, every layer a unit,
    selective options included; with autocast copies, the top-level frontiers of ``casts.py``,
    without options). When some boundary is not kept by the plain forward (``Chain.all_kept``
    False), the lowest peak on ``chain`` of the plans the tables of ``chain.conservative()``
    give near their own smallest peak (``_unkept_low_plans``): a peak a plan reaches, which the
    true smallest may undercut (by at most those boundaries)."""
    if chain.has_holds:  # FSDP2 per rank: held layers (held.py)
        return held.min_peak(chain) if held.held_applies(chain) else _held_fallback_min_peak(chain)
    if not chain.all_kept:
        return min(simulate(chain, p).peak_bytes for p in _unkept_low_plans(chain))
    if chain.has_casts:
        lowest = cast_frontier(chain).min_peak()
        return simulate(chain, plan_none(chain.n_layers)).peak_bytes if lowest is None else lowest
    t = layer_tables(chain)
    lowest = max(fixed_peak(chain), base_bytes(chain) + int(t.peaks.R[0, t.units.size]))
    if chain.unsaved_bytes:  # the tables' bound can pass the plan without checkpoints
        return min(lowest, simulate(chain, plan_none(chain.n_layers)).peak_bytes)
    return lowest


def min_peak_plan(chain: Chain, budget_bytes: int | None = None) -> Plan:
    """A plan reaching ``min_peak`` (or fitting ``budget_bytes``, which must be at least
    that), storing wherever the slack allows, with selective options where the chain has
    them (not with autocast copies); exact, but not least-recompute."""
    n = chain.n_layers
    if chain.has_holds:  # FSDP2 per rank: held layers (held.py)
        return _held_min_peak_plan(chain, budget_bytes)
    if not chain.all_kept:  # planned with every boundary kept: peaks no lower than here
        cands = list(_unkept_low_plans(chain))
        cons = chain.conservative()
        if budget_bytes is not None and budget_bytes >= min_peak(cons):
            cands.append(min_peak_plan(cons, budget_bytes))
        best = _cheapest_fitting(chain, cands, budget_bytes)
        if best is None:  # no budget (or below every candidate): the lowest peak
            best = min(cands, key=lambda p: peak_of(chain, p.items))
        return replace(best, params={"budget_bytes": budget_bytes, "min_peak": True})
    params = {"budget_bytes": budget_bytes, "min_peak": True}
    if chain.unsaved_bytes and min_peak(chain) == simulate(chain, plan_none(n)).peak_bytes:
        return Plan("dp", n, plan_none(n).items, params)  # the tables' bound is above it
    base = base_bytes(chain)
    if chain.has_casts:
        cf = cast_frontier(chain)
        need = cf.need_bytes()
        ranges = None if need is None else cf.ranges(
            need if budget_bytes is None else max(need, budget_bytes - base))
        items = plan_none(n).items if ranges is None else items_from_ranges(n, ranges)
        return Plan("dp", n, items, params)
    t = layer_tables(chain)
    need = int(t.peaks.R[0, t.units.size])
    avail = need if budget_bytes is None else max(need, budget_bytes - base)
    return plan_from(chain, t.units, *t.peaks.parts(avail), params)


Parts = tuple[list[tuple[int, int]], dict[int, int]]  # checkpointed ranges, {unit: option}


@dataclass(frozen=True)
class _Reader:
    """One DP table seen from the top."""

    name: str
    need_bytes: int  # the least bytes above the chain's start any plan of this table needs
    parts: Callable[[int], Parts]  # checkpointed ranges and options for exact avail bytes
    slot_bytes: int
    top: np.ndarray  # the table's least recompute at each slot
    slot_parts: Callable[[int], Parts]  # the table's own plan at a slot


class DPSolver:
    """DP tables for one chain, reusable for every budget below the unrestricted peak
    (``sweep`` reads a whole frontier from them). Slots do not depend on the budget.

    Each table is read two ways and the better plan kept: top-down in exact bytes (an option
    is taken only if the exact min-peak tables say it can be completed within what is left,
    and the cost table ranks those), which always fits; and the table's own optimal plan at the
    budget's slot, stepping down a slot while the simulator says it overshoots. With gcd-sized
    slots (``exact``) both are the optimum. ``rounding="nearest"`` (default) rounds sizes to the
    nearest slot so rounding errors cancel instead of adding up along the chain;
    ``rounding="up"`` is rotor's conservative rounding, kept for comparison.

    Long chains (``mode="grouped"``, or ``"auto"`` above ``EXACT_MAX_LAYERS`` layers) get two
    tables: the nested DP on groups of layers, and the depth-1 DP on single layers
    (:class:`FlatTable`); ``solve`` returns the better plan of the two.
    """

    def __init__(self, chain: Chain, *, max_slots: int | None = None, mode: str = "auto",
                 groups: int | None = None, rounding: str = "nearest", cuts: str = "cheap",
                 flat: bool | None = None, top_bytes: int | None = None,
                 pareto: bool | None = None, lowest_bytes: int | None = None):
        if rounding not in ("nearest", "up"):
            raise ValueError(f"rounding must be 'nearest' or 'up', not {rounding!r}")
        self.options_ignored = False  # True when the chain has options the tables do not use
        self.chain = chain
        grouped_units = _units_for(chain.without_options(), mode, groups, cuts)
        if grouped_units is None:
            self.units = layer_tables(chain).units
        else:
            self.units = grouped_units
            pairs = PairCosts(grouped_units)
            peaks = PeakTable(grouped_units, pairs)
        self.grouped = self.units.size < chain.n_layers + 1
        self.none_peak = simulate(chain, plan_none(chain.n_layers)).peak_bytes
        top = self.none_peak if top_bytes is None else top_bytes
        self.span = max(0, top - base_bytes(chain))
        self.cast_bytes = sum(ly.cast_bytes for ly in chain.layers)
        self.pareto: ParetoTable | None = None
        if pareto is None:  # explicit slots ask for the slot tables
            pareto = max_slots is None
        if pareto and not self.grouped and not chain.has_casts:
            # Exact bytes: optimal at every budget up to ``top`` (pareto.py).
            self.lowest = min_peak(chain) if lowest_bytes is None else lowest_bytes
            pt = self._pareto_table(top, self.lowest)
            if pt.ok:
                self.pareto = pt
                self.readers: list[_Reader] = []
                self.slot_bytes, self.M, self.exact = 1, self.span, True
                self._estimate = None
                return
        # The cost table on single layers takes options; grouped and autocast tables do not.
        if self.grouped or chain.has_casts:
            self.options_ignored = chain.has_options
            chain = chain.without_options()
        layers = layer_tables(chain)
        if grouped_units is None:
            self.units, pairs, peaks = layers.units, layers.pairs, layers.peaks
        g = size_gcd(chain)
        U = self.units.size
        slots = max_slots or max(MIN_SLOTS, min(MAX_SLOTS, CELL_BUDGET // (U * U)))
        q = choose_slot(self.units, self.span, g, slots)
        M = int(self.span // q)
        self.readers = []
        self._estimate = None
        # A table none of whose plans fits up to ``top`` is not built (grouped tables just
        # above the smallest peak): solve finds nothing there and the caller takes over.
        if not self.grouped or int(peaks.R[0, U]) <= self.span:
            table = CostTable(self.units, pairs, q, M, "up" if q == g else rounding)
            self._estimate = None if self.grouped else table.estimate
            self.readers.append(_Reader("nested", int(peaks.R[0, U]), lambda a: table.parts(a, peaks),
                                        q, table.C[0, U], table.slot_parts))
        if flat if flat is not None else self.grouped:
            lu = layers.units
            N = lu.size
            max_len = min(N, max(64, 8 * math.isqrt(N)))
            slots = max_slots or max(MIN_SLOTS, min(MAX_SLOTS, FLAT_CELL_BUDGET // (N * max_len)))
            fq = choose_slot(lu, self.span, g, slots)
            ft = FlatTable(lu, layers.pairs, fq, int(self.span // fq), "up" if fq == g else rounding,
                           max_len, top_bytes=self.span)
            if ft.built:
                self.readers.append(_Reader("flat", int(ft.R1[0]), lambda a: (ft.ranges(a), {}), fq,
                                            ft.C[0], lambda m: (ft.slot_ranges(m), {})))
        self.slot_bytes = int(q)
        self.M = M
        self.exact = q == g and not self.grouped and not chain.has_casts and not self.options_ignored

    def solve(self, budget_bytes: int) -> Plan | None:
        """The best plan the tables give at this budget, or None when none of them reaches
        it (grouped tables can miss budgets near the smallest peak; the caller decides).

        With autocast copies: the cheaper of the tables read at lowered budgets until a plan
        fits, and the plan of the exact top-level frontiers (``casts.py``), which fits whenever
        any plan does (see the module docstring)."""
        if self.pareto is not None:
            return self._pareto_plan(budget_bytes)
        best, over = self._best_at(budget_bytes, budget_bytes)
        if not self.cast_bytes:
            return best
        if best is None and over is not None:
            lowest_read = budget_bytes - self.cast_bytes  # every table plan read here fits
            read = budget_bytes
            for _ in range(CAST_READS):
                read = max(lowest_read, read - over)
                best, over_here = self._best_at(read, budget_bytes)
                if best is not None or over_here is None or read == lowest_read:
                    break
                over = over_here
        cands = [] if best is None else [best]
        if budget_bytes >= fixed_peak(self.chain):
            n = self.chain.n_layers
            ranges = cast_frontier(self.chain).ranges(budget_bytes - base_bytes(self.chain),
                                                      self._estimate)
            if ranges is not None:
                cands.append(Plan("dp", n, items_from_ranges(n, ranges), {"budget_bytes": budget_bytes}))
        scored = [(simulate(self.chain, p), p) for p in cands]
        fit = [sp for sp in scored if sp[0].peak_bytes <= budget_bytes]
        if len(fit) < len(scored):
            raise RuntimeError(f"dp (mixed precision) plan over budget {budget_bytes}: planner bug")
        return min(fit, key=lambda sp: sp[0].recompute_ms)[1] if fit else None

    def _pareto_table(self, top: int, lowest: int) -> ParetoTable:
        """Exact frontiers for budgets in [lowest, top]. The plan reaching the smallest peak
        and spending the slack at ``lowest`` on storing bounds the optimum at every budget of
        that range from above; the table prunes what costs more (no optimal plan uses it)."""
        t = layer_tables(self.chain)
        ub = None
        if lowest >= min_peak(self.chain):
            ub = simulate(self.chain, min_peak_plan(self.chain, lowest)).recompute_ms
            if self.chain.n_layers >= UB_MIN_LAYERS and lowest < self.none_peak:
                # a near-optimal plan from the slot table on single layers, read in exact
                # bytes (so it fits): a much tighter bound (0.3-7% above the optimum with
                # options, against 5-70% for the exact DP on groups of layers used before),
                # which prunes most of the frontiers away
                ub = min(ub, _slot_bound(self.chain, lowest))
        return ParetoTable(t.units, t.pairs, t.peaks.R, max(0, top - base_bytes(self.chain)),
                           PARETO_MAX_POINTS, ub)

    def _pareto_plan(self, budget_bytes: int) -> Plan | None:
        """The optimal plan from the exact frontiers (None when no plan fits)."""
        pt = self.pareto
        assert pt is not None
        if budget_bytes < fixed_peak(self.chain) or budget_bytes < min_peak(self.chain):
            return None
        if budget_bytes < self.lowest:  # below what the table was pruned for: one for it
            pt = self._pareto_table(budget_bytes, budget_bytes)
        avail = min(budget_bytes - base_bytes(self.chain), pt.top)
        if pt.cost(avail) == INF:
            raise RuntimeError(f"exact dp found no plan at budget {budget_bytes} above the "
                               f"smallest peak {min_peak(self.chain)}: planner bug")
        return self._plan(*pt.parts(avail), budget_bytes, budget_bytes, "exact bytes")

    def _best_at(self, read_bytes: int, budget_bytes: int) -> tuple[Plan | None, int | None]:
        """The least-recompute plan read at ``read_bytes`` that fits ``budget_bytes``, and the
        least overshoot of the plans read that did not fit (None when none overshot)."""
        if read_bytes < fixed_peak(self.chain):
            return None, None
        avail = read_bytes - base_bytes(self.chain)
        best: tuple[float, Plan] | None = None
        overs: list[int] = []
        for r in self.readers:
            if r.need_bytes > avail:
                continue
            for plan in (self._plan(*r.parts(avail), read_bytes, budget_bytes, r.name),
                         self._scan(r, read_bytes, budget_bytes)):
                if plan is not None:
                    sc = simulate(self.chain, plan)
                    if sc.peak_bytes > budget_bytes:  # only with autocast copies
                        overs.append(sc.peak_bytes - budget_bytes)
                    elif best is None or sc.recompute_ms < best[0]:
                        best = (sc.recompute_ms, plan)
        return (None if best is None else best[1]), (min(overs) if overs else None)

    def _plan(self, ranges: list[tuple[int, int]], chosen: dict[int, int], read_bytes: int,
              budget_bytes: int, name: str) -> Plan:
        plan = plan_from(self.chain, self.units, ranges, chosen, {"budget_bytes": budget_bytes})
        peak = simulate(self.chain, plan).peak_bytes
        if peak > read_bytes and not self.cast_bytes:  # exact feasibility forbids this
            raise RuntimeError(f"dp ({name}) plan peaks at {peak} > budget {read_bytes}: planner bug")
        return plan

    def _scan(self, r: _Reader, read_bytes: int, budget_bytes: int) -> Plan | None:
        """The table's own plan at the budget's slot, or at the next lower slots while it
        overshoots (rounding): often better than the exact-bytes read, never needed for
        feasibility."""
        m = min((read_bytes - base_bytes(self.chain)) // r.slot_bytes, len(r.top) - 1)
        for _ in range(CAST_SCAN_READS if self.cast_bytes else SCAN_READS):
            if m < 0 or r.top[m] == INF:
                return None
            plan = plan_from(self.chain, self.units, *r.slot_parts(m), {"budget_bytes": budget_bytes})
            peak = simulate(self.chain, plan).peak_bytes
            if peak <= read_bytes:
                return plan
            m -= 1
        return None


def _slot_bound(chain: Chain, budget_bytes: int) -> float:
    """A bound on the optimum at ``budget_bytes``: the recompute of ``_slot_plan`` (inf if,
    against construction, it does not fit)."""
    plan = _slot_plan(chain, budget_bytes)
    sc = simulate(chain, plan)
    return sc.recompute_ms if sc.peak_bytes <= budget_bytes else INF


def _slot_plan(chain: Chain, budget_bytes: int) -> Plan:
    """A near-optimal plan (0.3-7% above the optimum with options at 100 layers): read in exact
    bytes (``CostTable.parts``, which fits by construction) from the nested slot table on single
    layers with ``UB_SLOTS`` slots up to the budget. O(U^3 UB_SLOTS)."""
    t = layer_tables(chain)
    avail = budget_bytes - base_bytes(chain)
    q = max(1, -(-avail // UB_SLOTS))
    table = CostTable(t.units, t.pairs, q, avail // q, "nearest")
    return plan_from(chain, t.units, *table.parts(avail, t.peaks), {"budget_bytes": budget_bytes})


def near_min_plan(chain: Chain, budget_bytes: int) -> tuple[Plan, str]:
    """A plan for a budget at or just above the smallest peak on a long chain, where the
    grouped tables find none. Candidates: the smallest-peak plan spending the slack on storing,
    improved locally (``improve`` below); and, when ``U^2 x NEAR_MIN_MIN_SLOTS`` cells fit in
    ``NEAR_MIN_CELLS``, the nested DP on single layers with slots spread over this budget
    only (fine where it matters, read in exact bytes so the plan fits); else, when at most
    ``NEAR_MIN_UNITS`` units, the exact DP on groups cut at the smallest-peak plan's boundaries
    (reachable by construction) and at ``NEAR_MIN_GROUPS`` cheap ones. The cheapest; it fits
    (checked by the simulator), and is near-optimal, not optimal. Also returns how it was
    found, for the notes.

    With selective options: the better of the smallest-peak plan with options (slack spent
    greedily) and, when the budget is reachable without options, this search without them."""
    if chain.has_options:
        best = min_peak_plan(chain, budget_bytes)
        how = "returned the smallest-peak plan with selective options"
        plain = chain.without_options()
        if budget_bytes >= min_peak(plain):
            alt, alt_how = near_min_plan(plain, budget_bytes)
            if simulate(chain, alt).recompute_ms < simulate(chain, best).recompute_ms:
                best, how = alt, alt_how + " (without selective options)"
        return best, how
    n = chain.n_layers
    start = min_peak_plan(chain, budget_bytes)
    ranges = [(r.start, r.stop) for r in start.recomputed_ranges()]
    better = improve(chain, ranges, budget_bytes, max_sims=max(20, min(NEAR_MIN_SIMS, 50_000 // n)))
    best = Plan("dp", n, items_from_ranges(n, better), {"budget_bytes": budget_bytes})
    cost = simulate(chain, best).recompute_ms
    how = "returned the smallest-peak plan, improved locally"
    cands: list[tuple[Plan, str]] = []
    U = n + 1
    slots = min(NEAR_MIN_SLOTS, NEAR_MIN_CELLS // (U * U))
    ends = {e for r in ranges for e in r}
    cuts = sorted((set(cheap_cuts(chain, NEAR_MIN_GROUPS)) | ends) - {n})
    if slots >= NEAR_MIN_MIN_SLOTS:
        solver = DPSolver(chain, mode="exact", pareto=False, max_slots=slots, top_bytes=budget_bytes)
        plan = solver.solve(budget_bytes)
        if plan is not None:
            cands.append((plan, f"planned on single layers in {slots} slots up to the budget "
                                "(near-optimal)"))
    elif len(cuts) + 1 <= NEAR_MIN_UNITS:
        u = make_units(chain, cuts)
        pc = PairCosts(u)
        avail = budget_bytes - base_bytes(chain)
        pt = ParetoTable(u, pc, PeakTable(u, pc).R, avail, None, cost)
        if pt.cost(avail) < cost:
            cands.append((Plan("dp", n, items_from_ranges(n, pt.ranges(avail)),
                               {"budget_bytes": budget_bytes}),
                          f"planned exactly on {u.size - 1} groups cut at the smallest-peak plan's "
                          "boundaries (near-optimal)"))
    for plan, text in cands:
        sc = simulate(chain, plan)
        if sc.peak_bytes > budget_bytes:
            raise RuntimeError(f"dp (near the smallest peak) plan peaks at {sc.peak_bytes} > "
                               f"budget {budget_bytes}: planner bug")
        if sc.recompute_ms < cost:
            best, cost, how = plan, sc.recompute_ms, text
    return best, how


@dataclass(frozen=True)
class Banded:
    """``banded_plan``'s answer: the plan, the band it was found in (the most layers a
    checkpoint may span), and whether that band is the whole chain (then optimal)."""

    plan: Plan
    band: int
    exact: bool
    longest: int  # the most layers one checkpoint of the plan spans
    # The tails' frontiers were thinned (``ParetoTable``'s ``trim``/``trim_abs``): the plan is
    # proven within this much (relative) of the band's optimum; 0.0 when not thinned.
    within: float = 0.0
    top: int | None = None  # the most layers a long top-level checkpoint may span (None: any)
    # Top-level checkpoints longer than the band may also nest checkpoints of the band where
    # ``banded_plan``'s ``nest`` allowed it (at the top-level checkpoints of the plans it tried).
    nested: bool = False


def banded_plan(chain: Chain, budget_bytes: int, start: int = BAND_START,
                max_work: int = BAND_WORK, bound: Plan | None = None,
                trim: float = 0.0, trim_every: int = 1, trim_abs: float = 0.0,
                trim_scale: float | None = None, top: int | None = None,
                widen_top: bool = False, prebuilt: Prebuilt | None = None,
                nest: bool = False) -> Banded | None:
    """The least-recompute plan fitting ``budget_bytes`` among the plans of a band L: every
    checkpoint spans at most L layers (nesting allowed inside), except top-level checkpoints,
    which may span any number of layers (at most ``top`` when given) when they store every
    layer inside (one long checkpoint that keeps its layers is what chains whose layers keep
    little besides their output want at budgets well above the smallest peak; consecutive
    ones of at most ``top`` layers recompute less, and hold a few more boundaries). L is
    widened until the plan no longer needs it; with ``widen_top``, ``top`` too (x4 while the
    plan has a long checkpoint of more than half ``top``: the limit can make the best plan
    shorten one that would pay to be longer, as on an MLP-like chain of 60 layers limited to
    12, whose plan then spans 10 and recomputes 1.4% more than with 15).

    ``nest``: top-level checkpoints longer than L may also nest checkpoints of the band inside
    where ``_nest_spans`` of the plans found so far allows (ending where one of their top-level
    checkpoints ends, starting at most ``NEST_MERGE`` of them back): each band's table is built
    with the spans of the best plan so far (the bound, or the smallest-peak plan of the band),
    and again (at most ``NEST_ROUNDS`` times) while its plan nests such a checkpoint and has
    top-level checkpoints the spans did not cover; and L is doubled also while the plan nests one
    of at most 2L layers, up to ``NEST_WIDEN``. ``Banded.nested`` says so.

    The exact DP in bytes (``ParetoTable``) restricted to such plans needs only the tails
    ``[s, U)`` and the sub-chains of at most L layers: O(U L^2 + U^2) splits instead of O(U^3),
    and short frontiers. Start at L = ``start``; double L while no banded plan reaches the
    budget or the best plan has a checkpoint of exactly L layers (a wider band may do better),
    up to the whole chain (exact, ``Banded.exact``) or while the next band's table should stay
    under ``max_work`` breakpoints (4 x this band's). Each band's table is pruned by the best
    plan so far (``bound`` when given, else the first feasible band's smallest-peak plan).
    Optimal among the plans of the last band's last table. None when no band's table was
    built (none reaches the budget within the limit, or the first frontier outgrows
    ``PARETO_MAX_POINTS``); the caller falls back to the slot and grouped tables.

    ``trim``, ``trim_every``: the tails' frontiers thinned (``ParetoTable``): within
    ``(1 - trim) ** -k`` of the band's optimum instead of equal to it, ``k = ceil(U /
    trim_every)`` (long chains: ``tail_trim``). ``trim_abs`` (with ``trim``, and a ``bound`` that
    fits): thin by ``eps = trim_abs x scale / k`` ms instead (``ParetoTable``'s ``trim_abs``;
    ``scale``: the bound's recompute, or ``trim_scale``, an estimate of the optimum, when
    lower), which keeps fewer points where the tails' recompute is small; the answer R is then
    at most the optimum + ``k x eps``, so within ``k eps / (R - k eps)`` of it, checked once R
    is known: past the relative trim's bound (the scale far above the optimum) the table is
    built again with eps from R, and past it again with the relative ``trim``
    (``Banded.within`` says which bound held). ``prebuilt``: the first band's min-peak table and
    inner frontiers, built beforehand (``_coarse_beside_inner``).

    Chains with autocast copies or unkept boundaries are not handled here (``plan_dp``)."""
    t = layer_tables(chain)
    u, pc = t.units, t.pairs
    U, n = u.size, chain.n_layers
    avail = budget_bytes - base_bytes(chain)
    if budget_bytes < fixed_peak(chain) or avail < 0:
        return None
    L = max(1, min(start, n))
    LT = n if top is None else min(top, n)
    work = 0  # breakpoints of the last band's table
    solved = False  # some band's table was built (else the bound alone is no answer)
    slot_tried = False
    best: Banded | None = None
    cost = INF
    params = {"budget_bytes": budget_bytes}
    if bound is not None:  # a plan known to fit: prunes every band
        sc = simulate(chain, bound)
        if sc.peak_bytes <= budget_bytes:
            bound = replace(bound, params=params)
            best, cost = Banded(bound, 0, False, _longest(bound)), sc.recompute_ms
    spans: Spans = ()  # where top-level checkpoints may nest (``nest``; ``ParetoTable``)
    rounds = 0
    k = _thinned_items(U, trim_every)
    rel_within = math.expm1(-math.log1p(-trim) * k) if trim else 0.0
    scale = cost if trim_scale is None else min(cost, trim_scale)
    eps = trim_abs * scale / k if trim and trim_abs > 0 and cost < INF else 0.0
    limit = rel_within  # absolute thinning only where it proves as much as relative would

    def table(L: int, R: np.ndarray, absolute: bool) -> ParetoTable:
        inner = (prebuilt.inner if prebuilt is not None
                 and (prebuilt.band, prebuilt.top) == (L, max(L, LT)) else None)
        return ParetoTable(u, pc, R, avail, BAND_MAX_POINTS, cost, max_len=L, top_len=max(L, LT),
                           trim=0.0 if absolute else trim, trim_abs=eps if absolute else 0.0,
                           max_total=BAND_MAX_TOTAL, trim_every=trim_every, inner=inner,
                           nest=spans)

    def read(pt: ParetoTable, L: int, full: bool) -> None:
        nonlocal best, cost
        assert best is not None
        # no plan of this band is cheaper (the cap), or (thinned) much cheaper
        best = replace(best, band=L)
        if pt.cost(avail) < INF:
            plan = plan_from(chain, u, *pt.parts(avail), params)
            sc = simulate(chain, plan)
            if sc.peak_bytes > budget_bytes:
                raise RuntimeError(f"dp (banded) plan peaks at {sc.peak_bytes} > budget "
                                   f"{budget_bytes}: planner bug")
            if sc.recompute_ms <= cost:
                cost, best = sc.recompute_ms, Banded(plan, L, False, _longest(plan))

    while True:
        full = n <= L
        if nest and not full and best is not None:
            spans = _nest_spans(best.plan, spans)
        ready = (prebuilt is not None and (prebuilt.band, prebuilt.top) == (L, max(L, LT))
                 and not spans)
        peaks = (t.peaks if full else prebuilt.peaks if ready and prebuilt is not None
                 else PeakTable(u, pc, L, max(L, LT), nest=spans))
        if int(peaks.R[0, U]) <= avail:
            if best is None:  # a plan of this band that fits bounds every band's optimum
                first = plan_from(chain, u, *reconstruct_options(
                    u.bounds, U, avail,
                    exact_chooser(u, pc, peaks.R, peaks.K, None, None if full else (L, max(L, LT)))), params)
                cost = simulate(chain, first).recompute_ms
                best = Banded(first, L, False, _longest(first))
                if nest and not full:
                    spans = _nest_spans(first, spans)
                    peaks = PeakTable(u, pc, L, max(L, LT), nest=spans)
            pt = table(L, peaks.R, eps > 0)
            if not pt.ok and not slot_tried and n <= BAND_MAX_LAYERS:
                slot_tried = True  # the bound prunes too little: the slot table's plan
                alt = _slot_plan(chain, budget_bytes)
                sc = simulate(chain, alt)
                if sc.peak_bytes <= budget_bytes and sc.recompute_ms < cost:
                    cost, best = sc.recompute_ms, Banded(alt, 0, False, _longest(alt))
                    pt = table(L, peaks.R, eps > 0)
            if not pt.ok:
                break
            work, solved = pt.total_points, True
            read(pt, L, full)
            within = rel_within
            if eps > 0:  # R <= optimum + k eps: proven within k eps / (R - k eps)
                within = _abs_within(k * eps, cost)
                if within > limit:  # the bound was far above the optimum: eps from R, again
                    eps = trim_abs * cost / k
                    pt = table(L, peaks.R, True)
                    if pt.ok:
                        read(pt, L, full)
                        within = _abs_within(k * eps, cost)
                if within > limit:  # (rarely) relative
                    eps = 0.0
                    pt = table(L, peaks.R, False)
                    if pt.ok:
                        read(pt, L, full)
                        within = rel_within
            assert best is not None
            best = replace(best, exact=full and not within, within=within,
                           top=None if n <= LT else LT, nested=bool(spans) and not full)
            wider = nest and not full and 2 * L <= NEST_WIDEN and _nests_within(best.plan, L)
            if nest and not full and not wider and rounds < NEST_ROUNDS and _nests(best.plan, L):
                more = _nest_spans(best.plan, spans)
                if more != spans:  # it nests, with top-level checkpoints elsewhere: again
                    spans, rounds = more, rounds + 1
                    continue
            if full or (_longest(best.plan, L) < L and not wider):
                if widen_top and n > LT and 2 * best.longest > LT:
                    LT = min(4 * LT, n)  # a long top-level checkpoint near the limit: widen
                    continue
                break
        if full or 4 * work > max_work:
            break
        L = min(2 * L, n)
    return best if solved else None


@dataclass(frozen=True)
class Prebuilt:
    """The banded DP's first band built ahead of its bound: the min-peak table and the inner
    frontiers (``ParetoTable.inner_part``, which need no bound)."""

    band: int
    top: int  # the most layers of a long top-level checkpoint (the band's ``top_len``)
    peaks: PeakTable
    inner: InnerPart | None


def _coarse_beside_inner(chain: Chain, budget_bytes: int,
                         top: int | None) -> tuple[Coarse | None, Prebuilt | None]:
    """``_coarse_plan``, and meanwhile (a second thread, when there is a second CPU and the
    compiled kernels, which release the GIL) the first band's inner frontiers of the exact
    banded table, which need no bound: 1000 layers, ~0.2 s of the ~0.3 s the coarse plan takes.
    Without them: the coarse plan alone (the banded DP then builds its table whole)."""
    t = layer_tables(chain)
    u, pc = t.units, t.pairs
    n = chain.n_layers
    L = min(BAND_START, n)
    LT = max(L, n if top is None else min(top, n))
    if (os.cpu_count() or 1) < 2 or n <= L or jitted("_pareto_kernel", u.size) is None:
        return _coarse_plan(chain, budget_bytes), None
    if LT > L:
        _ = pc.store_all  # a cached property: filled here, not raced for by the two threads
    avail = budget_bytes - base_bytes(chain)

    def inner() -> Prebuilt:
        peaks = PeakTable(u, pc, L, LT)
        return Prebuilt(L, LT, peaks, ParetoTable.inner_part(u, pc, peaks.R, avail, BAND_MAX_POINTS,
                                                         max_len=L, top_len=LT,
                                                         max_total=BAND_MAX_TOTAL))
    with ThreadPoolExecutor(max_workers=1) as pool:
        fut = pool.submit(inner)
        coarse = _coarse_plan(chain, budget_bytes)
        return coarse, fut.result()


def _scale(coarse: Coarse | None) -> float | None:
    """An estimate of the optimum for absolute thinning: the geometric mean of the coarse plan's
    recompute (above the optimum: 1-40% at 1000 layers, most at high budgets) and the rounded
    table's estimate (below it by about as much); measured within 15% of the answer."""
    if coarse is None or coarse.estimate_ms <= 0:
        return None
    return math.sqrt(coarse.recompute_ms * coarse.estimate_ms)


def _abs_within(slack: float, found: float) -> float:
    """How far (relative) a plan of ``found`` ms is at most from an optimum it exceeds by at
    most ``slack`` ms."""
    return slack / (found - slack) if found > slack else INF


@dataclass(frozen=True)
class Coarse:
    """``_coarse_plan``'s answer: a plan that fits, and the rounded table's least recompute at
    the budget itself (an estimate of the optimum, not a bound: ``banded_plan``'s
    ``trim_scale``)."""

    plan: Plan
    recompute_ms: float  # the plan's, simulated
    estimate_ms: float


def _coarse_plan(chain: Chain, budget_bytes: int, band: int = COARSE_BAND,
                 slots: int = COARSE_SLOTS, top: int = COARSE_TOP) -> Coarse | None:
    """A plan that fits ``budget_bytes``, near the banded DP's, fast: the banded DP (band
    ``band``, long top-level checkpoints of up to ``top`` layers) on the chain with every size
    in units of ``avail / slots`` bytes, rounded stochastically (frontiers of at most ``slots``
    points). Rounded sizes do not add up to the exact ones, so the plan read at the budget may
    not fit: the same table is read again lower by the overshoot the simulator found (plus 1,
    2, 4, ... units, at most ``COARSE_READS`` reads) until a plan fits; None when none does.
    Not optimal: a bound (``banded_plan``'s ``bound``) and, with the table's least recompute
    at the budget itself, a scale for absolute thinning (``_scale``).

    Rounding every size up instead always fits but loses ``layers x unit / 2`` bytes: at 1000
    layers half-way up the range its plan recomputed 28% more than the optimum, against 1.5-7%
    this way (0-4% at 10%, 4-40% at 90%: random, MLP-like and block chains, two seeds each); band
    4 and ``top`` 64 build the table in 60% of band 16's time for a bound as good."""
    t = layer_tables(chain)
    u = t.units
    avail = budget_bytes - base_bytes(chain)
    q = max(1, avail // slots)
    rng = np.random.default_rng(0)

    def near(a):
        # stochastic rounding (seeded: plans reproducible): rounding errors of like-sized
        # layers cancel instead of adding up (nearest rounding of 1000 equal layers is off by
        # the same amount 1000 times)
        if a is None:
            return None
        a = np.asarray(a, dtype=np.int64)
        lo, rest = a // q, a % q
        return lo + (rng.random(a.shape) * q < rest)
    ru = replace(u, hold=near(u.hold), fwd_req=near(u.fwd_req), bwd_req=near(u.bwd_req),
                 x_out=near(u.x_out), fn_first=near(u.fn_first), fn_next=near(u.fn_next),
                 grad=near(u.grad), opt_hold=near(u.opt_hold), opt_fwd_req=near(u.opt_fwd_req),
                 opt_bwd_req=near(u.opt_bwd_req), bwd_extra=int(near(u.bwd_extra)),
                 fwd_req_stop=near(u.fwd_req_stop), lead=near(u.lead))
    rpc = PairCosts(ru)
    n, a = chain.n_layers, avail // q
    band, top = min(band, n), min(max(top, band), n)
    peaks = PeakTable(ru, rpc, band, top)
    if int(peaks.R[0, ru.size]) > a:
        return None
    pt = ParetoTable(ru, rpc, peaks.R, a, BAND_MAX_POINTS, None, max_len=band, top_len=top)
    if not pt.ok:
        return None
    at, extra = a, 1
    for _ in range(COARSE_READS):
        if pt.cost(at) == INF:
            return None
        plan = plan_from(chain, u, *pt.parts(at), {"budget_bytes": budget_bytes})
        sc = simulate(chain, plan)
        over = sc.peak_bytes - budget_bytes
        if over <= 0:
            return Coarse(plan, sc.recompute_ms, float(pt.cost(a)))
        # the next read lower by this plan's overshoot (plans near it err alike), and then some
        at, extra = at - (over + q - 1) // q - extra, 2 * extra
    return None


def _nest_spans(plan: Plan, spans: Spans, merge: int = NEST_MERGE) -> Spans:
    """``spans`` and, for each top-level checkpoint of ``plan``, ``(lo, e)``: its end and the
    start of the ``merge``-th top-level checkpoint ending there or before (``banded_plan``'s
    ``nest``: a checkpoint nesting these ``merge`` and the layers stored between them)."""
    tops = [(it.start, it.stop) for it in plan.items if isinstance(it, Checkpoint)]
    new = [(tops[max(0, i - merge + 1)][0], e) for i, (_, e) in enumerate(tops)]
    return nest_spans(spans + tuple(new))


def _nests(plan: Plan, L: int) -> bool:
    """Whether ``plan`` has a top-level checkpoint of over ``L`` layers with checkpoints inside."""
    return any(isinstance(it, Checkpoint) and it.stop - it.start > L
               and any(isinstance(x, Checkpoint) for x in it.inner) for it in plan.items)


def _nests_within(plan: Plan, L: int) -> bool:
    """Whether ``plan`` has a top-level checkpoint of ``L + 1`` to ``2 L`` layers with checkpoints
    inside (``NEST_WIDEN``)."""
    return any(isinstance(it, Checkpoint) and L < it.stop - it.start <= 2 * L
               and any(isinstance(x, Checkpoint) for x in it.inner) for it in plan.items)


def _longest(plan: Plan, most: int | None = None) -> int:
    """The most layers a checkpoint of ``plan`` spans (of those spanning at most ``most``)."""
    return max((r.stop - r.start for r in plan.recomputed_ranges()
                if most is None or r.stop - r.start <= most), default=0)


def choose_slot(units: Units, span: int, g: int, max_slots: int) -> int:
    """Slot size: the gcd of all sizes when that needs at most ``max_slots`` slots (exact);
    otherwise the size in [span / max_slots, 1.25 x that] that divides the units' kept and
    output bytes most evenly, so that repeated layers (transformer blocks) round exactly and
    their rounding errors do not pile up along the chain."""
    if span // g <= max_slots:
        return g
    q0 = -(-span // max_slots)
    vals = np.concatenate([units.hold[:-1], units.x_out[:-1]]).astype(np.float64)
    uniq, counts = np.unique(vals, return_counts=True)
    cands = {q0}
    for v in uniq[np.argsort(-counts)][:8]:
        for k in range(max(1, int(v // (1.25 * q0))), int(v // q0) + 1):
            if q0 <= int(v) // k <= 1.25 * q0:
                cands.add(int(v) // k)

    def err(q: int) -> float:
        r = vals / q
        return float(np.abs(r - np.round(r)).sum())
    return min(sorted(cands), key=err)


def plan_dp(chain: Chain, budget_bytes: int, *, max_slots: int | None = None, mode: str = "auto",
            groups: int | None = None, rounding: str = "nearest") -> DPResult:
    """The least-recompute plan whose simulated peak fits ``budget_bytes``.

    ``mode="auto"``: the exact DP in bytes up to ``BAND_MIN_LAYERS`` layers, the banded DP
    (``banded_plan``) up to ``BAND_MAX_LAYERS``, grouped tables above (the banded DP again just
    above the smallest peak); ``"exact"``: the exact DP at any length (``DPResult.exact``);
    ``"grouped"``: the grouped tables. Raises :class:`ckplan.errors.InfeasibleBudgetError` when
    even ``min_peak`` does not fit.
    """
    notes: list[str] = []
    none_peak = simulate(chain, plan_none(chain.n_layers)).peak_bytes
    if budget_bytes >= none_peak:
        plan = Plan("dp", chain.n_layers, plan_none(chain.n_layers).items,
                    {"budget_bytes": budget_bytes})
        return DPResult(plan, 1, 0, True, chain.n_layers + 1, ("the plan without checkpointing fits",))
    if chain.has_holds:  # FSDP2 per rank: held layers (held.py)
        return _plan_dp_held(chain, budget_bytes, none_peak)
    if not chain.all_kept:
        return _plan_dp_unkept(chain, budget_bytes, max_slots=max_slots, mode=mode, groups=groups,
                               rounding=rounding)
    banded = None
    band_ok = mode == "auto" and max_slots is None and not chain.has_casts
    if plans_banded(chain, max_slots=max_slots, mode=mode):
        coarse, prebuilt = None, None
        long_chain = chain.n_layers > BAND_MAX_LAYERS
        top = BAND_TOP if long_chain else None
        nest = chain.n_layers <= NEST_MAX_LAYERS
        if chain.n_layers >= COARSE_MIN_LAYERS:
            lowest = min_peak(chain)
            if budget_bytes - lowest >= COARSE_MIN_FRAC * (none_peak - lowest):
                if nest:  # the first table nests at the coarse plan's checkpoints: no prebuilt part
                    coarse = _coarse_plan(chain, budget_bytes)
                else:
                    coarse, prebuilt = _coarse_beside_inner(chain, budget_bytes, top)
        trim, every = tail_trim(chain)
        banded = banded_plan(chain, budget_bytes, bound=coarse.plan if coarse else None, trim=trim,
                             trim_every=every, trim_abs=TAIL_TRIM_ABS if long_chain else 0.0,
                             trim_scale=_scale(coarse), top=top, widen_top=True,
                             prebuilt=prebuilt, nest=nest)
    if banded is not None:
        found, exact, solver = banded.plan, banded.exact, None
        if not exact:
            notes.append(_band_note(banded))
    else:
        found, exact, solver = _plan_dp_tables(
            chain, budget_bytes, notes, band_ok and chain.n_layers > BAND_MAX_LAYERS,
            max_slots=max_slots, mode=mode, groups=groups, rounding=rounding)
    if exact and any(ly.lead_bytes for ly in chain.layers):
        exact = False
        notes.append("some layers' backward holds gradients before the recompute it starts "
                     "(lead bytes): the tables count them through the whole recompute, on the "
                     "safe side, so the plan fits but may recompute more than the optimum")
    if exact and chain.unsaved_bytes:
        exact = False
        notes.append("some layers keep tensors no saved-tensor hook sees (ctx attributes, caches) "
                     "until the backward is over: the tables count them as live for the whole step, "
                     "on the safe side, so the plan fits but may recompute more than the optimum")
    if solver is None:
        return DPResult(found, 1, max(0, none_peak - base_bytes(chain)), exact,
                        chain.n_layers + 1, tuple(notes))
    if solver.options_ignored:
        notes.append(OPTIONS_IGNORED)
    if solver.grouped:
        notes.append(f"long chain: best of nested plans on {solver.units.size - 1} groups of "
                     f"layers and single-level plans on all {chain.n_layers} layers (near-optimal)")
    elif chain.has_casts:
        notes.append("mixed precision: autocast weight copies kept until the end of the forward are "
                     "planned at the top level (casts.py); the plan fits exactly")
    elif not solver.exact:
        notes.append(f"recompute estimated in slots of {solver.slot_bytes} bytes: the plan fits "
                     "exactly but may recompute slightly more than the optimum")
    return DPResult(found, solver.slot_bytes, solver.M, exact, solver.units.size, tuple(notes))


def tail_trim(chain: Chain) -> tuple[float, int]:
    """``(trim, trim_every)`` of the banded DP's tails: none up to ``TRIM_MIN_LAYERS`` layers;
    every tail up to ``BAND_MAX_LAYERS`` (planning is fast there, and the plans nearer the
    optimum); every ``TRIM_EVERY``-th above. ``TAIL_TRIM_ERROR`` is shared out over the most
    top-level items of a plan that start at a thinned tail, so the plan is within
    ``exp(TAIL_TRIM_ERROR)`` of the band's optimum."""
    n = chain.n_layers
    if n <= TRIM_MIN_LAYERS:
        return 0.0, 1
    every = TRIM_EVERY if n > BAND_MAX_LAYERS else 1
    return TAIL_TRIM_ERROR / _thinned_items(n + 1, every), every


def _thinned_items(units: int, every: int) -> int:
    """The most top-level items of a plan that start at a thinned tail (starts ``s < units``
    with ``s % every == 0``)."""
    return -(-units // every)


def _band_note(b: Banded) -> str:
    within = f"within {b.within:.1%} of " if b.within else ""
    proof = ("--exact proves the optimum" if b.plan.n_layers <= EXACT_PROOF_LAYERS else
             "--exact would prove the optimum, but its O(U^3) tables are out of reach at this length")
    longer = "longer ones" if b.top is None else f"longer ones, of up to {b.top},"
    how = (f"storing their layers or, around the top-level checkpoints of the plans tried, nesting "
           f"ones of at most {b.band} layers" if b.nested else "storing their layers")
    return (f"near-optimal, not proven: {within}the best plan whose checkpoints span at most "
            f"{b.band} layers ({longer} only at the top level, {how}; this "
            f"plan's longest: {b.longest})" + (" (frontiers thinned to plan a long chain fast)"
                                               if b.within else "") + f"; {proof}")


def _plan_dp_tables(chain: Chain, budget_bytes: int, notes: list[str], band: bool,
                    **dp_options) -> tuple[Plan, bool, DPSolver | None]:
    """``plan_dp`` with the exact, slot or grouped tables (``DPSolver``), and where they
    cannot reach the budget, the banded DP (when ``band``) or ``near_min_plan`` (then no
    solver: its notes do not apply)."""
    none_peak = simulate(chain, plan_none(chain.n_layers)).peak_bytes
    # Tables up to this budget only: finer slots, and the exact DP skips what it cannot reach.
    solver = DPSolver(chain, **dp_options,
                      top_bytes=max(budget_bytes, min(min_peak(chain), none_peak)),
                      lowest_bytes=budget_bytes)
    found = solver.solve(budget_bytes)
    exact = solver.exact
    if found is None:
        lowest = min_peak(chain)
        if budget_bytes < lowest:
            raise infeasible_error(chain, budget_bytes, lowest)
        trim, every = tail_trim(chain)
        banded = banded_plan(chain, budget_bytes, trim=trim, trim_every=every, top=BAND_TOP,
                             widen_top=True) if band else None
        if banded is not None:
            found, exact = banded.plan, banded.exact
            how = _band_note(banded)
        else:
            found, how = near_min_plan(chain, budget_bytes)
            exact = False
        which = "grouped" if solver.grouped else "slot"
        notes.append(f"the {which} tables cannot reach a budget this close to the smallest peak: "
                     + how)
        return found, exact, None  # the tables' own notes do not apply to this plan
    return found, exact, solver


# Budgets above the asked one (and above the bound's smallest peak) at which the tables of a
# chain with unkept boundaries are read (``_plan_dp_unkept``, ``_unkept_low_plans``).
UNKEPT_STEPS = 8


def _unkept_extra(chain: Chain) -> int:
    """The most ``chain.conservative()`` overstates a peak: every boundary no op keeps."""
    return (0 if chain.pre.x_kept else chain.x_in_bytes) + sum(
        ly.x_bytes for ly in chain.layers if not (ly.x_kept and ly.x_kept_next))


def _unkept_plans(chain: Chain, start: int, **dp_options) -> list[Plan]:
    """Plans of the tables on ``chain.conservative()`` at ``UNKEPT_STEPS + 1`` budgets from
    ``start`` (at least the bound's smallest peak) up to ``start`` + the unkept boundaries."""
    cons = chain.conservative()
    n = chain.n_layers
    lo_c, none_c = min_peak(cons), simulate(cons, plan_none(n)).peak_bytes
    extra = _unkept_extra(chain)
    first = max(start, lo_c)
    budgets = sorted({min(none_c - 1, first + extra * j // UNKEPT_STEPS) for j in range(UNKEPT_STEPS + 1)})
    budgets = [b for b in budgets if b >= lo_c]
    plans = [min_peak_plan(cons, b) for b in budgets] if first == lo_c else []
    if first + extra >= none_c:
        plans.append(plan_none(n))
    if budgets and banded_applies(cons, **dp_options) and n > EXACT_MAX_LAYERS:
        # the grouped tables would plan these: the banded DP, budget by budget
        plans += [b.plan for b in (banded_plan(cons, x, nest=n <= NEST_MAX_LAYERS) for x in budgets)
                  if b is not None]
    elif budgets:
        solver = DPSolver(cons, top_bytes=budgets[-1], lowest_bytes=budgets[0], **dp_options)
        plans += [p for p in map(solver.solve, budgets) if p is not None]
    return plans


def banded_applies(chain: Chain, *, max_slots: int | None = None, mode: str = "auto",
                **_: object) -> bool:
    """Whether ``plan_dp`` plans ``chain`` with the banded DP (at every budget)."""
    return (mode == "auto" and max_slots is None and not chain.has_casts
            and BAND_MIN_LAYERS < chain.n_layers <= BAND_MAX_LAYERS)


def plans_banded(chain: Chain, *, max_slots: int | None = None, mode: str = "auto",
                 **_: object) -> bool:
    """Whether ``plan_dp`` tries the banded DP first on ``chain`` (fully kept boundaries): from
    65 to 400 layers (``banded_applies``), and up to ``BAND_OPTIONS_MAX_LAYERS`` with selective
    options, which the grouped tables cannot use (their plans recomputed 7% to 5.5x as much at
    1000 layers)."""
    return banded_applies(chain, max_slots=max_slots, mode=mode) or (
        mode == "auto" and max_slots is None and not chain.has_casts and chain.has_options
        and BAND_MAX_LAYERS < chain.n_layers <= BAND_OPTIONS_MAX_LAYERS)


def _cheapest_fitting(chain: Chain, plans: list[Plan], budget_bytes: int | None) -> Plan | None:
    """The plan of least recompute (then lowest peak) whose simulated peak on ``chain`` fits
    ``budget_bytes``; None when none does or there is no budget."""
    if budget_bytes is None:
        return None
    scored = [(sc.recompute_ms, sc.peak_bytes, i) for i, sc in enumerate(simulate(chain, p) for p in plans)
              if sc.peak_bytes <= budget_bytes]
    return plans[min(scored)[2]] if scored else None


@lru_cache(maxsize=16)
def _unkept_low_plans(chain: Chain) -> tuple[Plan, ...]:
    """Candidates for the smallest peak of a chain with unkept boundaries: the bound's plans
    from its smallest peak up to that plus the boundaries it overstates (``min_peak`` is the
    lowest of their peaks on ``chain``)."""
    return tuple(_unkept_plans(chain, 0))


def _plan_dp_unkept(chain: Chain, budget_bytes: int, **dp_options) -> DPResult:
    """``plan_dp`` on a chain with boundaries the plain forward does not keep (``Layer.x_kept``).

    The tables model rotor's chain, where a stored layer keeps its output. They plan on
    ``chain.conservative()`` (every such output kept), whose plans peak no lower, op by op, than
    on ``chain``, so each fits here too; since the bound overstates by at most the unkept
    boundaries, its tables are read at ``UNKEPT_STEPS + 1`` budgets from the asked one up to that
    much higher (and near its own smallest peak), and the cheapest of those plans whose peak on
    ``chain`` fits is returned. Never over budget; not proven optimal."""
    n = chain.n_layers
    lowest = min_peak(chain)
    if budget_bytes < lowest:
        raise infeasible_error(chain, budget_bytes, lowest)
    cands = list(_unkept_low_plans(chain)) + _unkept_plans(chain, budget_bytes, **dp_options)
    best = _cheapest_fitting(chain, cands, budget_bytes)
    if best is None:  # pragma: no cover - the plan reaching min_peak is among them
        raise RuntimeError(f"dp found no plan at budget {budget_bytes} above the smallest peak "
                           f"{lowest}: planner bug")
    plan = Plan("dp", n, best.items, {"budget_bytes": budget_bytes})
    unkept = sum(not ly.x_kept for ly in chain.layers)
    own = sum(ly.x_kept and not ly.x_kept_next for ly in chain.layers)
    what = [f"{'the chain input and ' if not chain.pre.x_kept else ''}{unkept} layer output(s) are "
            "not kept by the plain forward (no op saves them)"] if unkept or not chain.pre.x_kept else []
    if own:
        what.append(f"{own} layer output(s) are saved only by the layer's own ops (a checkpoint "
                    "ending there frees them once read)")
    note = (f"{'; '.join(what)}: planned on a bound that keeps them, "
            f"the cheapest of {len(cands)} plans that fits the budget as measured")
    return DPResult(plan, 1, 0, False, n + 1, (note,))


# ---- Local improvement near the smallest peak ---------------------------------------------
# Local improvement of a plan under a budget, every step checked by the simulator.
#
# For long chains the DP works on groups of layers (``dp.py``), whose tables cannot reach budgets
# just above the smallest peak; there the solver starts from the smallest-peak plan (exact bytes,
# slack spent greedily on storing) and this pass lowers its recompute: it moves one checkpoint
# boundary by one layer, drops a checkpoint, or splits one in two at its cheapest inner boundary,
# keeps the first move that lowers the recompute and still fits (simulated peak <= budget), and
# repeats until no move helps or ``max_sims`` simulations are spent. Never over budget, never
# worse than the start; not optimal (the exact DP is ``pareto.py``).

Ranges = list[tuple[int, int]]


def _moves(ranges: Ranges, n: int, x: list[int], breaks: tuple[int, ...] = ()) -> list[Ranges]:
    out: list[Ranges] = []
    if breaks:  # no range may span a break (Chain.breaks)
        return [m for m in _moves(ranges, n, x) if not any(a < b < c for a, c in m for b in breaks)]
    for i, (a, b) in enumerate(ranges):
        rest = ranges[:i] + ranges[i + 1:]
        out.append(rest)  # drop: its layers are stored in the enclosing sequence
        for na, nb in ((a + 1, b), (a, b - 1), (a - 1, b), (a, b + 1)):
            if 0 <= na < nb <= n and (na, nb) not in rest:
                out.append(rest + [(na, nb)])
        if b - a >= 2:  # split at the smallest boundary inside
            m = min(range(a + 1, b), key=lambda k: x[k - 1])
            if (a, m) not in rest and (m, b) not in rest:
                out.append(rest + [(a, m), (m, b)])
    return out


def improve(chain: Chain, ranges: Ranges, budget_bytes: int, max_sims: int = 3000) -> Ranges:
    """A plan (its checkpointed ranges) at least as cheap as ``ranges`` that fits the budget
    (``ranges`` itself must fit)."""
    n = chain.n_layers
    x = [ly.x_bytes for ly in chain.layers]
    cur = sorted(ranges)
    peak, cost = peak_of(chain, items_from_ranges(n, cur))
    if peak > budget_bytes:
        raise ValueError(f"the start plan peaks at {peak} > budget {budget_bytes}")
    sims = 0
    while sims < max_sims:
        for cand in _moves(cur, n, x, chain.breaks):
            try:
                items = items_from_ranges(n, cand)
            except SpecError:  # overlapping without nesting
                continue
            sims += 1
            p, c = peak_of(chain, items)
            if p <= budget_bytes and c < cost * (1 - 1e-12):
                cur, cost = sorted(cand), c
                break
            if sims >= max_sims:
                break
        else:
            break
    return cur


# ---- Held layers (FSDP2 per rank) ---------------------------------------------------------
# ``held.py`` plans fully kept chains without autocast copies exactly; the others are planned on
# the chain without its holds (``held.without_holds``), read at budgets lowered by each
# overshoot until the plan simulated with the holds fits.
HELD_FALLBACK_READS = 12


def _held_fallback(chain: Chain, budget_bytes: int | None) -> list[Plan]:
    """Candidates for a held chain ``held.py`` does not take (above), lowest peaks first."""
    free = held.without_holds(chain)
    lo = min_peak(free)
    n = chain.n_layers
    plans = [min_peak_plan(free), plan_every_k(n, 1)]
    if budget_bytes is None:
        return plans
    read = budget_bytes
    for _ in range(HELD_FALLBACK_READS):
        if read < lo:
            break
        plan = plan_dp(free, read).plan
        plans.append(plan)
        over = simulate(chain, plan).peak_bytes - budget_bytes
        if over <= 0:
            break
        read -= over
    return plans


def _held_fallback_min_peak(chain: Chain) -> int:
    """The lowest peak of the fallback's smallest-peak candidates (one a plan reaches; the true
    smallest may be lower)."""
    return min(simulate(chain, p).peak_bytes for p in _held_fallback(chain, None))


def _held_min_peak_plan(chain: Chain, budget_bytes: int | None) -> Plan:
    if held.held_applies(chain):
        return held.min_peak_plan(chain, budget_bytes)
    params = {"budget_bytes": budget_bytes, "min_peak": True}
    plans = _held_fallback(chain, budget_bytes)
    return replace(_cheapest_fitting(chain, plans, budget_bytes)
                   or min(plans, key=lambda p: peak_of(chain, p.items)), params=params)


def _plan_dp_held(chain: Chain, budget_bytes: int, none_peak: int) -> DPResult:
    """``plan_dp`` of a held chain below the peak without checkpoints."""
    n = chain.n_layers
    lowest = min_peak(chain)
    if budget_bytes < lowest:
        raise infeasible_error(chain, budget_bytes, lowest)
    if held.held_applies(chain):
        plan, exact, more = held.plan_held(chain, budget_bytes)
        notes = list(more)
    else:
        found = _cheapest_fitting(chain, _held_fallback(chain, budget_bytes), budget_bytes)
        if found is None:  # pragma: no cover - the plan reaching min_peak is among them
            raise RuntimeError(f"held dp fallback found no plan at budget {budget_bytes}: planner bug")
        plan, exact = Plan("dp", n, found.items, {"budget_bytes": budget_bytes}), False
        notes = ["held layers (FSDP2 per rank) on a chain the exact held DP does not take (autocast "
                 f"copies, unkept boundaries or over {held.HELD_MAX_LAYERS} layers): planned without "
                 "the holds at budgets lowered until the plan fits (not proven optimal)"]
    peak = simulate(chain, plan).peak_bytes
    if peak > budget_bytes:
        raise RuntimeError(f"dp (held layers) plan peaks at {peak} > budget {budget_bytes}: planner bug")
    if exact and any(ly.lead_bytes for ly in chain.layers):
        exact = False
        notes.append("some layers' backward holds gradients before the recompute it starts "
                     "(lead bytes): the tables count them through the whole recompute, on the "
                     "safe side, so the plan fits but may recompute more than the optimum")
    if exact and chain.unsaved_bytes:
        exact = False
        notes.append("some layers keep tensors no saved-tensor hook sees (ctx attributes, caches) "
                     "until the backward is over: the tables count them as live for the whole step, "
                     "on the safe side, so the plan fits but may recompute more than the optimum")
    return DPResult(plan, 1, max(0, none_peak - base_bytes(chain)), exact, n + 1, tuple(notes))
