"""The DP's tables: pair costs, least recompute (nested and depth-1, in slots; nested in exact
bytes) and least peak, and the one routine that reads a plan out of any of them. The solvers
that build and read them are in ``solve/`` (docs/planner.md states the recursion).

Modules (each imports only those above it): ``common`` (sentinels, fixed memory, slot
arithmetic), ``table_kernels`` and ``frontier_kernel`` (the compiled twins, plain Python until
``compiled.jitted`` compiles them), ``compiled``, ``pairs`` (``PairCosts``), ``reader`` (the
plan reader), ``peaks`` (``PeakTable``), ``slots`` (``CostTable``, ``FlatTable``),
``frontiers`` (frontier arithmetic), ``pareto`` (``ParetoTable``).

Legend (the names follow rotor's paper and stay short because the array code is dense):

* ``U``: number of units (groups of layers, ``groups.py``; the post stage is the last unit);
  ``s``/``j``/``e``: unit indices, a sub-sequence is ``[s, e)`` and a checkpoint ``[s, j)``.
* ``M``: the top slot (slots ``m = 0..M``); ``slot``: bytes per slot; ``m``/``mb``: memory
  available above the start of a sub-sequence, in slots / in exact bytes.
* ``fwd_prefix_ms[j]``: forward time of units ``< j`` (rotor's P), and ``ckpt_end_ms[j]`` (Q) the
  same less the tail of unit ``j-1`` (``Layer.tail_ms``: what PyTorch's checkpoint does not redo
  after the last saved tensor), so a checkpoint ``[s, j)`` recomputes ``Q[j] - P[s]``.
* Pair costs (:class:`PairCosts`, exact bytes): ``store_req[s, e]`` what ``Store(s)`` needs in a
  sequence ending at ``e`` (``opt_store_req[o, s, e]`` the same with selective option ``o``,
  ``o = 0`` being ``store``; options are the ``opt_*`` columns of ``Units``);
  ``inner_extra[j, e]`` how much more the inner plan of a checkpoint ending at ``j`` starts with;
  ``fnone[s, j]`` the peak of the forward of ``[s, j)`` keeping no activations; ``grads[j, e]``
  the parameter gradients of units ``j..e-1``.
* ``*_slots``: the same quantities rounded to slots (``hold_slots``, ``x_slots``,
  ``store_slots``, ``inner_slots``, ``fnone_slots``, ``thr_slots``).
* ``C``: least recompute; ``R``: least bytes (min-peak table); ``K``: recompute of the plan
  reaching ``R`` (a tie-break).
* ``ParetoTable`` (``pareto.py``): ``C`` in exact bytes, ``F[(s, e)] = (mem, cost, choice)``
  breakpoints per sub-chain; ``cap[s, e]`` the most bytes a sub-chain can be given, ``ub`` the
  recompute of a plan known to fit.
* The band ``(L, LT)`` (``band``; ``PeakTable``/``ParetoTable``'s ``max_len``/``top_len``,
  ``solve.banded_plan``): plans whose checkpoints span at most ``L`` units, except top-level ones of
  up to ``LT`` units that store every unit inside (``store_all[s, j]``, ``PairCosts``; choice
  ``U + j`` in the frontiers). Only the tails ``[s, U)`` and sub-chains of at most ``L`` units
  are reached. ``nest`` (``Spans``, pairs ``(lo, e)``): a top-level checkpoint ``[s, e)`` with
  ``s >= lo`` may also span up to ``LT`` units with an inner plan of the band (choice ``e``, as
  any checkpoint); the sub-chains ``[s, e)`` down to ``nlo[e]`` (``nest_starts``) are then
  reached too.
"""
from __future__ import annotations

from .common import BIG, INF, TOP, Chooser, Spans, Step, base_bytes, ceil_div, fixed_peak, near_div, shift
from .compiled import jitted
from .frontiers import STORE, Frontier, _envelope, _splits, reach, reach_caps
from .pairs import PairCosts
from .pareto import InnerPart, ParetoTable, _kernel_args
from .peaks import PeakTable, band, nest_spans, nest_starts
from .reader import exact_chooser, reconstruct, reconstruct_options
from .slots import CostTable, FlatTable

__all__ = ["BIG", "INF", "STORE", "TOP", "Chooser", "CostTable", "FlatTable", "Frontier", "InnerPart",
           "PairCosts", "ParetoTable", "PeakTable", "Spans", "Step", "_envelope", "_kernel_args", "_splits",
           "band", "base_bytes", "ceil_div", "exact_chooser", "fixed_peak", "jitted", "near_div",
           "nest_spans", "nest_starts", "reach", "reach_caps", "reconstruct", "reconstruct_options", "shift"]
