"""Measured training steps per strategy: the numbers the planner predicted, checked for real.

For each strategy: the plan from the model's own profile, then

1. a correctness step from the same initial weights and RNG seed: loss and every gradient,
   compared with ``none`` (checkpointing must not change the math);
2. warm-up steps (optimizer state exists from then on), then one memory step per strategy:
   CUDA allocator peak (``max_memory_allocated`` after a reset, plus reserved peak, retries and
   NVML's device usage) or, on CPU, the live-tensor tracker over the whole step, plus what was
   resident when the step began (parameters, buffers, optimizer state, the batch);
3. timed steps, strategies interleaved round by round, so drift hits them all alike.

All strategies share one model and optimizer in steps 2-3: a plan changes memory and time,
not the math, so this is one training run seen through different plans.

The gradient check judges, it does not only report. With ``g`` this plan's gradients and
``g0`` those of the first plan without checkpoints (``none``), over all parameters::

    max |g - g0|  <=  rtol * max |g0| + atol        (and the same for the loss)

=========  =========  =========  ===================================================
precision  rtol       atol       why
=========  =========  =========  ===================================================
fp32       1e-5       1e-8       recompute runs the same kernels on the same inputs:
                                 equal in practice; 1e-5 leaves room for kernels
                                 whose reduction order depends on memory layout
bf16       1.6e-2     1e-6       two units in the last place of bf16 (eps 7.8e-3)
fp16       2e-3       1e-6       two units in the last place of fp16 (eps 9.8e-4)
=========  =========  =========  ===================================================

A row outside the bound is ``wrong-gradients`` (a parameter with a gradient in one run and
none in the other too); a NaN or inf loss or gradient is ``non-finite``. Such rows are not
measured further, and ``BenchResult.failed_rows`` makes the CLI exit 4 after the table.

A row predicted to fit an explicit ``--budget`` whose measured peak is above it is
``over-budget`` (the CLI exits 3 after the table and the reports, as for a budget no plan
meets); a row never predicted to fit (``none`` below its peak) is not. The error column is
``|measured - predicted| / predicted``: "predicted 1.0 GB, measured 12.6% more".

Timing noise: the timed rounds are interleaved, so round ``i`` of a row and of ``none`` ran
under the same load. Per round ``r_i = t_i / t_none_i``; when ``min r <= 1 <= max r`` (some rounds
faster than none, some slower) the slowdown is inside the noise: ``slowdown_within_noise`` in
JSON/CSV, ``~`` before the slowdown in the table, with a note (:func:`within_noise`).

Peers (:mod:`ckplan.peers`, rows of kind ``peer``) run in the same steps: ``hf``, ``sac-policy``,
and ``torch-compile``/``torch-compile-nobudget``: a compiled copy of the model sharing its
parameters (:class:`ckplan.peers.CompiledPeer`). They compile in the gradient check (their first
step: its time is reported in the row's message, never in the step time), then warm up with the
others. On CPU the live-tensor tracker does not see a compiled step (it runs eagerly under a
dispatch mode), so their memory step is read from the PyTorch profiler's allocator events instead
(:func:`profiled_step_memory`: every allocation and free of the CPU allocator, the compiled
kernels' buffers included); when compiled rows run, ``none`` is read both ways and a note gives
both figures. Where TorchInductor cannot run the rows are ``unavailable`` with the reason.

On CPU the memory step also reads the process's resident high-water mark
(:class:`ckplan.measure.ResidentPeak`): live-tensor bytes are exact, but under glibc's malloc
the resident set does not follow them (freed blocks stay mapped); see the bench note.

The package, one step of that per module: :mod:`~ckplan.bench.plans` and
:mod:`~ckplan.bench.peer_rows` (the rows to bench), :mod:`~ckplan.bench.steps` (one training step
under a row's plan), :mod:`~ckplan.bench.gradients` (step 1), :mod:`~ckplan.bench.memory` (step 2),
:mod:`~ckplan.bench.compiled_rows` (torch-compile rows and --compile), :mod:`~ckplan.bench.status`
(a row whose step fails), :mod:`~ckplan.bench.result` (rows and the result) and
:mod:`~ckplan.bench.runner` (the steps in order).
"""
from ..bench_records import GRAD_TOLERANCES
from .memory import RSS_NOTE, ProfiledMemory, profiled_step_memory
from .peer_rows import PEERS_NOTE
from .result import FEW_STEPS, FRONTIER_POINTS, few_steps_note, frontier_of, within_noise
from .runner import run_bench
from .status import INPLACE_TIP

__all__ = ["FEW_STEPS", "FRONTIER_POINTS", "GRAD_TOLERANCES", "INPLACE_TIP", "PEERS_NOTE", "RSS_NOTE",
           "ProfiledMemory", "few_steps_note", "frontier_of", "profiled_step_memory", "run_bench", "within_noise"]
