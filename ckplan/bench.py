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
JSON/CSV, ``~1.00x (within noise)`` in the table (:func:`within_noise`).

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
"""
from __future__ import annotations

import contextlib
import gc
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from .chainfind import resolve_chain
from .compiled import CompiledLayers
from .errors import CkplanError, InfeasibleBudgetError, ModelRunError, SpecError
from .execute import apply_plan, remove_plan
from .measure import (
    KEPT_MEMORY_NOTE,
    AllocatorTimeline,
    Clock,
    KeptFreedMemory,
    LiveTensorTracker,
    ResidentPeak,
    TrackerLimitExceeded,
    cuda_peak,
    cuda_reset,
    nvml_used_bytes,
    unique_storage_bytes,
)
from .peers import (
    COMPILE_PEERS,
    PEER_NAMES,
    UNAVAILABLE,
    CompiledPeer,
    budget_fraction,
    compile_unavailable,
    hf_checkpointing,
    is_hf_model,
    sac_policy,
)
from .planner import (
    Plan,
    Store,
    chain_from_profile,
    default_budget,
    held_for_backward_bytes,
    no_gain_reason,
    plan_chain,
    simulate,
    sweep,
    trace,
)
from .records import (
    ERROR,
    INFEASIBLE,
    NON_FINITE,
    OK,
    OOM,
    OVER_BUDGET,
    WRONG_GRADIENTS,
    BenchResult,
    BenchRow,
    Profile,
    over_budget,
    peak_error,
)
from .training import forward_loss, make_optimizer

# (rtol, atol) of the gradient check per precision; the module docstring says why.
GRAD_TOLERANCES: dict[str, tuple[float, float]] = {"fp32": (1e-5, 1e-8), "bf16": (1.6e-2, 1e-6),
                                                   "fp16": (2e-3, 1e-6)}

RSS_NOTE = ("growth tensors / RSS: live-tensor bytes above those resident when the memory step began, and the "
            "process's resident-set growth over it (Linux VmHWM); glibc's malloc keeps freed memory mapped, so "
            "RSS need not follow the plans (RSS growth near 0 means the step ran in memory kept from earlier "
            "steps; measured_rss_peak_bytes in the JSON is the high-water mark itself); with "
            "MALLOC_MMAP_THRESHOLD_=131072 in the environment large tensors are returned at once and RSS "
            "follows the tensor peaks")


PEERS_NOTE = ("peers (kind peer): hf = every chain layer in its own non-reentrant checkpoint (ckplan's every-k "
              "k=1, as Hugging Face's gradient_checkpointing_enable does); sac-policy = torch selective "
              "activation checkpointing per chain layer, saving matmul/attention/convolution outputs and "
              "recomputing the rest (no ckplan prediction); torch-compile = the model compiled with "
              "torch.compile (TorchInductor) with torch._functorch.config.activation_memory_budget set from "
              "the bench's budget (the share of none's activation memory it leaves), so the min-cut "
              "partitioner recomputes to meet it; torch-compile-nobudget = the same at budget 1.0 (fusion "
              "and the partitioner's default recomputation only)")


@dataclass
class _Entry:
    name: str
    plan: Plan | None
    predicted_peak: int | None = None
    predicted_fb_peak: int | None = None
    predicted_act: int | None = None
    predicted_overhead: float | None = None
    status: str = OK
    message: str = ""
    loss: float | None = None
    final_loss: float | None = None
    grad_diff: float | None = None
    grad_tol: float | None = None
    mem: dict = field(default_factory=dict)
    times: list[float] = field(default_factory=list)
    kind: str = "ckplan"  # or "peer" (ckplan.peers)
    compiled: CompiledPeer | None = None  # the torch-compile peers
    plan_text: str = ""  # the plan column when there is no ckplan plan
    warm_graphs: int = 0  # graphs the compiled peer had compiled when the warm-up ended
    mem_source: str = ""  # "profiler" when the CPU memory step was read from the PyTorch profiler

    @property
    def runnable(self) -> bool:
        return self.plan is not None or self.compiled is not None

    @property
    def is_reference(self) -> bool:
        """Eager and without checkpoints: what the gradient check may judge the others against."""
        return self.compiled is None and self.plan is not None and self.plan.n_checkpoints == 0


def _resident_bytes(model, opt, batch) -> int:
    """What is resident before a step: parameters, buffers, gradients, optimizer state, the batch."""
    tensors = list(model.parameters()) + list(model.buffers())
    tensors += [t.grad for t in tensors if t.grad is not None]
    tensors += [v for state in opt.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    args, kwargs = batch
    return unique_storage_bytes((tensors, list(args), list(kwargs.values())))


class _Stepper:
    """One full training step: micro-batches forward+backward, optimizer step, zero grad."""

    def __init__(self, model, opt, batch, loss_fn, precision: str, accum: int, device: torch.device):
        self.model, self.opt, self.batch, self.loss_fn = model, opt, batch, loss_fn
        self.precision, self.accum, self.device = precision, accum, device
        self.scaler = torch.amp.GradScaler(device.type) if precision == "fp16" else None

    def backward(self, after_forward=None) -> float:
        args, kwargs = self.batch
        total = 0.0
        for micro in range(self.accum):
            loss = forward_loss(self.model, args, kwargs, self.loss_fn, self.precision, self.device.type)
            if micro == 0 and after_forward is not None:
                after_forward()
            loss = loss / self.accum
            (self.scaler.scale(loss) if self.scaler else loss).backward()
            total += float(loss.detach())
            del loss
        return total

    def step(self, after_backward=None, after_forward=None) -> float:
        loss = self.backward(after_forward)
        if after_backward is not None:
            after_backward()
        if self.scaler:
            self.scaler.step(self.opt)
            self.scaler.update()
        else:
            self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss


@dataclass
class _Run:
    """What every step of one bench shares: the model, its batch, the profile, the device."""

    model: Any
    batch: Any
    loss_fn: Any
    profile: Profile
    device: torch.device
    memory_limit_bytes: int | None = None
    opt: Any = None
    stepper: _Stepper | None = None
    layers: CompiledLayers | None = None  # --compile: ckplan rows run with the chain layers compiled
    eager: bool = False  # compiled layers left out (the eager gradient cross-check)
    ref_grads: dict | None = None  # the gradient check's reference, kept for that cross-check

    def step(self, e: _Entry, **callbacks) -> float:
        """One training step with ``e``'s plan applied (on ``e``'s compiled copy for a compiled peer)."""
        with _applied(self, e):
            self.stepper.model = _model_of(self, e)
            return self.stepper.step(**callbacks)


def _model_of(run: _Run, e: _Entry):
    """The module a row's step calls: the model, or a compiled peer's compiled copy of it."""
    return e.compiled.module if e.compiled is not None else run.model


def _applied(run: _Run, e: _Entry):
    """The context that runs ``e``: ckplan's plan, or a peer's own checkpointing."""
    if e.compiled is not None:
        return contextlib.nullcontext()  # the compiled copy runs as it is; the model has no plan on it
    if e.kind == "peer" and e.name == "sac-policy":
        return sac_policy(run.model, run.profile.chain)
    if e.kind == "peer" and e.name == "hf" and is_hf_model(run.model):
        return hf_checkpointing(run.model)
    if run.layers is not None and not run.eager and _runs_compiled_layers(e):
        stack = contextlib.ExitStack()
        stack.enter_context(run.layers)  # compiled first: the plan's checkpoints wrap the compiled forwards
        stack.enter_context(apply_plan(run.model, e.plan, chain=run.profile.chain))
        return stack
    return apply_plan(run.model, e.plan, chain=run.profile.chain)


def _hf_checkpointed_layers(model, chain_path: str) -> tuple[int, int]:
    """(layers Hugging Face's own checkpointing wraps, how many of them are chain layers)."""
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:
        return 0, 0
    _, container, _ = resolve_chain(model, chain_path)
    chain = {id(m) for m in container.children()}
    own: list = []

    def outermost(m) -> None:  # a checkpointed layer's own checkpointed blocks run inside it
        for child in m.children():
            if isinstance(child, GradientCheckpointingLayer):
                own.append(child)
            else:
                outermost(child)

    outermost(model)
    return len(own), sum(id(m) in chain for m in own)


def _runs_compiled_layers(e: _Entry) -> bool:
    """With --compile: ckplan's rows (the peers run as they are)."""
    return e.compiled is None and e.kind == "ckplan"


def run_bench(model, batch, loss_fn, profile: Profile, *, strategies: list[str], budget_bytes: int | None,
              k: int, steps: int, warmup: int, device: torch.device, lr: float,
              extra_plans: dict[str, Plan] | None = None, memory_limit_bytes: int | None = None,
              progress: Callable[[str], None] | None = None) -> BenchResult:
    """Bench ``strategies`` (and ``extra_plans``) on ``model``; see the module docstring.

    Names in :data:`ckplan.peers.PEER_NAMES` among ``strategies`` are peers, run the same way."""
    tick = progress or _silent
    chain = chain_from_profile(profile)
    notes = list(profile.notes)
    explicit = budget_bytes  # a row predicted to fit it that measures above it is over-budget
    budget_bytes = _default_budget(chain, strategies, budget_bytes, notes)
    entries = _plan_entries(chain, strategies, budget_bytes, k, extra_plans or {})
    _compile_entries(entries, model, chain, budget_bytes, device)
    for e in entries:
        if e.kind == "peer" and e.name == "hf" and is_hf_model(model):
            e.message = ("the model's own activation_checkpointing_enable(use_reentrant=False); predicted: "
                         "every-k k=1")
            own, in_chain = _hf_checkpointed_layers(model, profile.chain)
            if own > in_chain:
                # An encoder-decoder checkpoints its decoder too: the chain plan does not describe it.
                e.predicted_peak = e.predicted_fb_peak = e.predicted_act = e.predicted_overhead = None
                e.message = (f"the model's own activation_checkpointing_enable(use_reentrant=False): it "
                             f"checkpoints {own} layers, {own - in_chain} outside the chain, so no prediction")
        if e.kind == "peer" and profile.compiled and e.compiled is None:
            # Peers run as they are (eagerly), while the profile, and so every prediction, is of
            # the compiled layers: no prediction for them.
            e.predicted_peak = e.predicted_fb_peak = e.predicted_act = e.predicted_overhead = None
            kept = [part for part in e.message.split("; ") if part and not part.startswith("predicted")]
            e.message = "; ".join([*kept, "ran eagerly, so no prediction (the profile is of compiled layers)"])
    if any(e.kind == "peer" for e in entries):
        notes.append(PEERS_NOTE)
    runnable = [e for e in entries if e.runnable]
    run = _Run(model, batch, loss_fn, profile, device, memory_limit_bytes)
    if profile.compiled:
        _, container, _ = resolve_chain(model, profile.chain)
        run.layers = CompiledLayers(list(container))
    try:
        _check_gradients(run, runnable, tick, notes)
        if run.layers is not None:
            _eager_cross_check(run, runnable, tick, notes)
        run.opt = make_optimizer(model.parameters(), profile.optimizer, lr, device.type)
        run.stepper = _Stepper(model, run.opt, batch, loss_fn, profile.precision, profile.accum, device)
        _warm_up(run, runnable, warmup, tick)
        for e in runnable:
            if e.status == OK:
                tick(f"memory: {e.name}")
                _guarded(run, e, _memory_step)
        _profiler_cross_check(run, runnable, tick)
        with KeptFreedMemory(device) as kept:
            _timed_rounds(run, runnable, steps, tick)
        if kept.active and KEPT_MEMORY_NOTE not in notes:
            notes.append(KEPT_MEMORY_NOTE)
        _compile_notes(run, runnable, notes)
        if run.layers is not None:
            notes.append(f"--compile: ckplan's rows ran with each chain layer's forward compiled (torch.compile, "
                         f"TorchInductor; {run.layers.graphs} graph(s) compiled), the plan applied around "
                         "them, predicted from the compiled layers' profile; peers ran as they are")
    finally:
        remove_plan(model)
    if device.type == "cpu" and any("rss_peak" in e.mem for e in runnable):
        notes.append(RSS_NOTE)
    none = next((e for e in entries if e.name == "none" and e.times), None)
    rows = tuple(_row(e, none, explicit) for e in entries)
    few = few_steps_note(steps, rows)
    if few:
        notes.append(few)
    return BenchResult(model=profile.model, device=profile.device, device_name=profile.device_name,
                       batch_size=profile.batch_size, precision=profile.precision,
                       optimizer=profile.optimizer, accum=profile.accum, steps=steps, warmup=warmup,
                       budget_bytes=budget_bytes, k=k, rows=rows,
                       profile_peak_bytes=profile.totals.predicted_peak_bytes, notes=tuple(notes),
                       frontier=frontier_of(chain), compiled=profile.compiled)


# Fewer timed steps than this give a slowdown without a noise estimate worth the name.
FEW_STEPS = 3


def few_steps_note(steps: int, rows) -> str | None:
    """The caveat for slowdowns from fewer than :data:`FEW_STEPS` timed steps: each is one or two
    steps against as many of ``none``, so a cold or disturbed step decides it, and a row faster
    than ``none`` (which does the least work) shows the noise."""
    if steps >= FEW_STEPS:
        return None
    fast = [f"{r.strategy} {r.slowdown:.2f}x" for r in rows
            if r.slowdown is not None and r.slowdown < 1.0 and r.strategy != "none"]
    text = (f"--steps {steps}: each slowdown is {'one step' if steps == 1 else f'{steps} steps'} against "
            f"{'one' if steps == 1 else 'as many'} of none, so the timing noise is unknown and one slow step "
            "decides it")
    if fast:
        text += f" ({', '.join(fast)}: faster than none, which recomputes nothing, so that is noise)"
    return text + f"; use --steps {max(5, FEW_STEPS)} or more (the default is 5) for slowdowns to compare"


FRONTIER_POINTS = 16


def frontier_of(chain) -> tuple[tuple[str, int, float], ...]:
    """dp's predicted frontier (and dp-layer's when the chain has selective options)."""
    names = ["dp", "dp-layer"] if chain.has_options else ["dp"]
    try:
        pts = sweep(chain, names, FRONTIER_POINTS)
    except CkplanError:  # a frontier is a picture; never fail a bench for it
        return ()
    return tuple((p.strategy, p.peak_bytes, 1.0 + p.overhead) for p in pts if p.strategy in names)


def _silent(msg: str) -> None:
    pass


def _default_budget(chain, strategies: list[str], budget_bytes: int | None, notes: list[str]) -> int | None:
    """dp and chen need a budget; without one, the planner's bench rule (halfway between the
    smallest feasible and the no-checkpoint peak: always feasible, and a real trade-off)."""
    if budget_bytes is not None or not {"dp", "chen", "torch-compile"} & set(strategies):
        return budget_bytes
    reason = no_gain_reason(chain)
    b = default_budget(chain, mode="bench", free_device_bytes=None)
    assert b is not None  # the bench rule always gives a budget
    notes.append(reason if reason else f"no --budget: dp and chen planned for {b.description}")
    return b.bytes


def _plan_entries(chain, strategies: list[str], budget_bytes: int | None, k: int,
                  extra_plans: dict[str, Plan]) -> list[_Entry]:
    """Each strategy planned on the profile's chain (or marked infeasible), then the given plans."""
    entries: list[_Entry] = []
    for s in strategies:
        if s in COMPILE_PEERS:
            entries.append(_Entry(s, None, kind="peer"))
            continue
        if s in PEER_NAMES:
            entries.append(_peer_entry(chain, s))
            continue
        try:
            res = plan_chain(chain, s, budget_bytes, k)
        except InfeasibleBudgetError as err:
            entries.append(_Entry(s, None, status=INFEASIBLE, message=err.message))
            continue
        except SpecError as err:  # selective without an option every layer keeps: the other rows go on
            if s != "selective":
                raise
            entries.append(_Entry(s, None, status=ERROR, message=f"{err.message} ({err.tip})"))
            continue
        entries.append(_Entry(s, res.plan, res.score.peak_bytes, _fwd_bwd_peak(chain, res.plan),
                              held_for_backward_bytes(chain, res.plan), res.score.overhead))
    for name, plan in extra_plans.items():
        sc = simulate(chain, plan)
        entries.append(_Entry(name, plan, sc.peak_bytes, _fwd_bwd_peak(chain, plan),
                              held_for_backward_bytes(chain, plan), sc.overhead))
    return entries


def _compile_entries(entries: list[_Entry], model, chain, budget_bytes: int | None, device: torch.device) -> None:
    """The torch-compile peers: the activation-memory fraction ckplan's budget maps to, and a
    compiled copy of the model for each (:class:`CompiledPeer`), made before any plan touches the
    model; where TorchInductor cannot run, the rows are ``unavailable`` with the reason."""
    compile_rows = [e for e in entries if e.name in COMPILE_PEERS]
    if not compile_rows:
        return
    why = compile_unavailable(device.type)
    none_peak = simulate(chain, plan_chain(chain, "none", None, 1).plan).peak_bytes
    if not why:
        torch._dynamo.reset()  # a fresh cache: graphs from earlier benches must not fill its per-code limit
    for e in compile_rows:
        frac = 1.0 if e.name.endswith("nobudget") else budget_fraction(budget_bytes, chain.persistent_bytes,
                                                                        none_peak)
        e.plan_text = f"torch.compile, budget {frac:.2f}"
        e.message = f"activation_memory_budget {frac:.2f}"
        if why:
            e.status, e.message = UNAVAILABLE, f"{e.message}; {why}"
            continue
        try:
            e.compiled = CompiledPeer(model, frac)
        except Exception as err:  # a model that cannot be copied (or compiled) is a row that says why
            e.status = UNAVAILABLE
            e.message = f"{e.message}; torch.compile could not wrap a copy of the model ({_one_line(err)})"


def _one_line(err: BaseException) -> str:
    """``Type: first line`` of an error; a wrapped one (Dynamo's ``BackendCompilerFailed``) by its cause."""
    root = err
    for _ in range(8):  # a chain of causes, bounded
        inner = root.__cause__ or getattr(root, "inner_exception", None)
        if not isinstance(inner, BaseException):
            break
        root = inner
    text = str(root).strip().splitlines()
    where = f"{type(err).__name__} from " if root is not err else ""
    return f"{where}{type(root).__name__}: {text[0][:200] if text else ''}"


def _compile_notes(run: _Run, entries: list[_Entry], notes: list[str]) -> None:
    """What the compiled rows' messages add after the run: graphs compiled, recompilations after
    the warm-up, how their memory was measured."""
    for e in entries:
        c = e.compiled
        if c is None or e.status != OK:
            continue
        if c.graphs > e.warm_graphs:
            e.message += (f"; {c.graphs - e.warm_graphs} graph(s) recompiled after the warm-up (their "
                          "compile time is in the measured steps)")
        if e.mem_source == "profiler":
            e.message += ("; memory: PyTorch profiler allocator events (the live-tensor tracker does not "
                          "see compiled kernels)")
    cross = next((e for e in entries if e.name == "none" and "profiler_check" in e.mem), None)
    if cross is not None:
        notes.append(f"torch-compile rows' memory on CPU is read from the PyTorch profiler's allocator events; "
                     f"none read the same way: {cross.mem['profiler_check']} bytes (live-tensor tracker: "
                     f"{cross.mem['measured']})")


def _peer_entry(chain, name: str) -> _Entry:
    """A peer runs on the every-k k=1 plan's layer split: ``hf`` is that plan (so its prediction
    is that plan's), ``sac-policy`` checkpoints the same layers selectively: predicted as every
    layer stored with ckplan's ``sac-compute`` option when the profile has it on every layer."""
    plan = plan_chain(chain, "every-k", None, 1).plan
    if name == "hf":
        sc = simulate(chain, plan)
        return _Entry(name, plan, sc.peak_bytes, _fwd_bwd_peak(chain, plan), held_for_backward_bytes(chain, plan),
                      sc.overhead, kind="peer",
                      message="ran as every-k k=1: each chain layer in its own non-reentrant checkpoint, "
                              "as Hugging Face's gradient_checkpointing_enable does")
    message = ("torch selective checkpointing per chain layer: saves mm/addmm/bmm/attention/"
               "convolution outputs, recomputes the rest")
    if all(any(o.name == "sac-compute" for o in ly.options) for ly in chain.layers):
        # The same thing as ckplan's sac-compute option on every layer: predicted by that plan.
        n = chain.n_layers
        sac = Plan("sac-policy", n, tuple(Store(i, "sac-compute") for i in range(n)))
        sc = simulate(chain, sac)
        return _Entry(name, sac, sc.peak_bytes, _fwd_bwd_peak(chain, sac),
                      held_for_backward_bytes(chain, sac), sc.overhead, kind="peer",
                      message=message + "; predicted as ckplan's sac-compute option on every layer")
    return _Entry(name, plan, kind="peer", message=message)


def within_noise(times: list[float], ref_times: list[float]) -> tuple[bool, float | None, float | None]:
    """Whether a row's slowdown against ``none`` is inside the timing noise, and the paired ratios'
    min and max.

    The rule: timed steps are interleaved, so round ``i`` of a row and round ``i`` of ``none`` ran
    under the same load; ``r_i = t_i / t_none_i``. When the ratios straddle 1 (``min r <= 1 <= max r``:
    some rounds faster than none, some slower) the difference is inside the noise and the table
    shows ``~1.00x (within noise)``. Fewer than one paired round: not judged (False, None, None).
    """
    ratios = [t / r for t, r in zip(times, ref_times) if r > 0]
    if not ratios:
        return False, None, None
    lo, hi = min(ratios), max(ratios)
    return lo <= 1.0 <= hi, lo, hi


def _check_gradients(run: _Run, entries: list[_Entry], tick, notes: list[str]) -> None:
    """Step 1: same initial weights and RNG, one accumulated backward per plan, judged against none.

    The reference (the first plan without checkpoints) runs first, whatever its place in the list.
    Rows outside the tolerance become ``wrong-gradients``, NaN/inf ``non-finite`` (module docstring).
    """
    init = {name: v.detach().to("cpu", copy=True) for name, v in run.model.state_dict().items()}
    order = sorted(entries, key=lambda e: not e.is_reference)  # stable: the first none first
    rtol, atol = GRAD_TOLERANCES.get(run.profile.precision, GRAD_TOLERANCES["fp32"])
    ref: dict[str, torch.Tensor | None] | None = None
    ref_loss = ref_scale = 0.0
    for e in order:
        tick(f"gradients: {e.name}" + (" (compiling)" if e.compiled is not None else ""))
        if e.compiled is not None:
            got = _compile_first_step(run, e, init)
            if got is None:
                continue
            e.loss, grads = got
        else:
            try:
                e.loss, grads = _loss_and_grads(run, e, init)
            except (torch.cuda.OutOfMemoryError, TrackerLimitExceeded, ModelRunError):
                raise
            except RuntimeError as err:  # the row fails, the bench goes on (e.g. in-place inputs)
                e.status, e.message = ERROR, _row_error(err)
                run.model.zero_grad(set_to_none=True)
                continue
        bad = _non_finite(e.loss, grads)
        if bad:
            e.status, e.message = NON_FINITE, f"{bad}; gradients not compared"
        elif ref is None and e.is_reference:
            ref, ref_loss = grads, e.loss
            if run.layers is not None:
                run.ref_grads = grads
            ref_scale = max((g.abs().max().item() for g in grads.values() if g is not None), default=0.0)
            e.grad_diff, e.grad_tol = 0.0, rtol * ref_scale + atol
        elif ref is not None:
            _judge(e, grads, ref, ref_loss, ref_scale, rtol, atol)
        del grads
    run.model.load_state_dict(init)
    if entries and ref is None:
        notes.append("gradients not checked: no plan without checkpoints gave a finite reference "
                     "(add none to --compare)")


def _eager_cross_check(run: _Run, entries: list[_Entry], tick, notes: list[str]) -> None:
    """With --compile: the reference (none, layers compiled) against the same step eager, once, so
    the gradient check's reference is itself checked against eager PyTorch."""
    ref = next((e for e in entries if e.is_reference and e.status == OK), None)
    compiled_grads, run.ref_grads = run.ref_grads, None
    if ref is None or compiled_grads is None:
        return
    tick("gradients: none (eager)")
    init = {name: v.detach().to("cpu", copy=True) for name, v in run.model.state_dict().items()}
    run.eager = True
    try:
        loss, grads = _loss_and_grads(run, ref, init)
    finally:
        run.eager = False
        run.model.load_state_dict(init)
    diff = max(((g - grads[n]).abs().max().item() for n, g in compiled_grads.items()
                if g is not None and grads.get(n) is not None), default=0.0)
    notes.append(f"--compile: none with compiled layers against none eager: max |grad difference| {diff:.3g} "
                 f"(loss {ref.loss:.6g} vs {loss:.6g}); the gradient check compares the rows with the compiled none")


def _compile_first_step(run: _Run, e: _Entry, init: dict):
    """A compiled peer's first forward+backward, under its partitioner budget: it compiles here, so
    its time goes into the row's message, never into the step time. A compiler that fails makes the
    row ``unavailable`` with the reason (None is returned then)."""
    c = e.compiled
    assert c is not None
    t0 = time.perf_counter()
    try:
        with c.compiling():
            got = _loss_and_grads(run, e, init)
    except ModelRunError:
        raise
    except Exception as err:  # inductor's errors are many kinds; the row says which, the bench goes on
        run.model.zero_grad(set_to_none=True)
        e.status, e.message = UNAVAILABLE, f"{e.message}; torch.compile failed here ({_one_line(err)})"
        return None
    if c.graphs == 0:
        e.status = UNAVAILABLE
        e.message += "; Dynamo compiled no graph for this model (it would run eagerly)"
        return None
    e.message += f"; compiled {c.graphs} graph(s) in {time.perf_counter() - t0:.1f} s (first step, not timed)"
    return got


@contextlib.contextmanager
def _deterministic_kernels(device: torch.device):
    """cuDNN's deterministic algorithms for the correctness steps on CUDA: its default convolution
    backward accumulates with atomics (in TF32), so two identical steps differ; ResNet on an H200
    differed by 6e-4 of the largest gradient, every-k and none alike. The timed steps keep the
    defaults."""
    if device.type != "cuda":
        yield
        return
    cudnn = torch.backends.cudnn
    old = cudnn.deterministic, cudnn.benchmark
    cudnn.deterministic, cudnn.benchmark = True, False
    try:
        yield
    finally:
        cudnn.deterministic, cudnn.benchmark = old


def _loss_and_grads(run: _Run, e: _Entry, init: dict) -> tuple[float, dict[str, torch.Tensor | None]]:
    run.model.load_state_dict(init)
    torch.manual_seed(0)
    with _applied(run, e), _deterministic_kernels(run.device):
        st = _Stepper(_model_of(run, e), None, run.batch, run.loss_fn, run.profile.precision, run.profile.accum,
                      run.device)
        st.scaler = None  # gradients compared unscaled
        loss = st.backward()
    grads = {n: (p.grad.detach().float().cpu() if p.grad is not None else None)
             for n, p in run.model.named_parameters()}
    run.model.zero_grad(set_to_none=True)
    return loss, grads


def _non_finite(loss: float, grads: dict[str, torch.Tensor | None]) -> str:
    """What is NaN or inf ('' when all is finite)."""
    if not math.isfinite(loss):
        return f"the loss is {loss}"
    bad = next((n for n, g in grads.items() if g is not None and not torch.isfinite(g).all()), None)
    return "" if bad is None else f"the gradient of {bad} has NaN or inf"


def _judge(e: _Entry, grads: dict, ref: dict, ref_loss: float, ref_scale: float, rtol: float,
           atol: float) -> None:
    """Compare one plan's loss and gradients with the reference; mark it wrong outside the bound."""
    e.grad_tol = rtol * ref_scale + atol
    missing = sorted(n for n in ref.keys() | grads.keys()
                     if (ref.get(n) is None) != (grads.get(n) is None))
    diffs = {n: (g - ref[n]).abs().max().item() for n, g in grads.items()
             if g is not None and ref.get(n) is not None}
    e.grad_diff = max(diffs.values(), default=0.0)
    loss_tol = rtol * abs(ref_loss) + atol
    if missing:
        e.status = WRONG_GRADIENTS
        e.message = (f"{missing[0]} has a gradient in one run and none in the other "
                     f"({len(missing)} such parameters); this plan changes what is trained")
    elif e.grad_diff > e.grad_tol or abs(e.loss - ref_loss) > loss_tol:
        worst = max(diffs, key=diffs.__getitem__) if diffs else "-"
        e.status = WRONG_GRADIENTS
        e.message = (f"max |grad - grad(none)| = {e.grad_diff:.3g} (at {worst}) and loss {e.loss:.6g} vs "
                     f"{ref_loss:.6g}, over the tolerance {e.grad_tol:.3g} (rtol {rtol:g} x max|grad| "
                     f"{ref_scale:.3g} + atol {atol:g}); this plan changes the math: a layer that behaves "
                     "differently when recomputed (state, counters, RNG outside torch)")
        if e.name == "sac-policy":
            e.message += ("; or torch's SAC policy keeping a kernel that draws random numbers (CUDA's "
                          "fused attention with dropout): the recompute then draws the later dropouts' "
                          "masks from another RNG offset (ckplan's own options keep those too)")


def _warm_up(run: _Run, entries: list[_Entry], warmup: int, tick) -> None:
    """At least one step first: the optimizer creates its state then, and the prediction is for a
    steady-state step."""
    for _ in range(max(warmup, 1)):
        for e in entries:
            tick(f"warm-up: {e.name}")
            _guarded(run, e, _plain_step)
    for e in entries:
        if e.compiled is not None:
            e.warm_graphs = e.compiled.graphs


def _plain_step(run: _Run, e: _Entry) -> None:
    run.step(e)


def _memory_step(run: _Run, e: _Entry) -> None:
    """Step 2: one step measured, the allocator's peak on CUDA or the live-tensor tracker on CPU."""
    resident = _resident_bytes(run.model, run.opt, run.batch)
    fb: dict[str, int] = {}
    if run.device.type == "cuda":
        device = run.device
        cuda_reset(device)
        # held for backward: what the forward added, the runtime's own blocks (cuBLAS workspaces
        # made by the first matmul on the backward's thread) left out, as in the prediction
        runtime = run.profile.totals.runtime_bytes
        run.step(e, after_backward=lambda: fb.setdefault("peak", cuda_peak(device).peak_allocated_bytes),
                 after_forward=lambda: fb.setdefault("act", torch.cuda.memory_allocated(device) - resident
                                                     - runtime))
        m = cuda_peak(device)
        e.mem = dict(measured=m.peak_allocated_bytes, fwd_bwd=fb["peak"], act=fb["act"],
                     reserved=m.peak_reserved_bytes, retries=m.alloc_retries,
                     nvml=nvml_used_bytes(device.index or 0))
        return
    limit = None if run.memory_limit_bytes is None else run.memory_limit_bytes - resident
    gc.collect()  # garbage from earlier steps must not count in this step's resident peak
    if e.compiled is not None or (run.layers is not None and _runs_compiled_layers(e)):
        _profiled_memory_step(run, e, resident, limit)
        return
    with ResidentPeak() as rss, LiveTensorTracker(limit_bytes=limit) as tr:
        run.step(e, after_backward=lambda: fb.setdefault("peak", resident + tr.peak),
                 after_forward=lambda: fb.setdefault("act", tr.live))
    e.mem = dict(measured=resident + tr.peak, fwd_bwd=fb["peak"], act=fb["act"], growth=tr.peak)
    if rss.peak_bytes is not None:
        e.mem.update(rss_peak=rss.peak_bytes, rss_growth=rss.growth_bytes)


def _profiler_cross_check(run: _Run, entries: list[_Entry], tick) -> None:
    """When compiled rows were measured with the profiler on CPU, ``none`` is measured that way too
    (one more step), so the note can show that the two measurements agree on an eager step."""
    if run.device.type != "cpu" or not any(e.mem_source == "profiler" and e.status == OK for e in entries):
        return
    ref = next((e for e in entries if e.name == "none" and e.compiled is None and e.status == OK), None)
    if ref is None:
        return
    tick("memory: none (profiler)")

    def measure(run: _Run, e: _Entry) -> None:
        resident = _resident_bytes(run.model, run.opt, run.batch)
        gc.collect()
        m = profiled_step_memory(lambda fwd, bwd: run.step(e, after_forward=fwd, after_backward=bwd))
        e.mem["profiler_check"] = resident + m.peak

    _guarded(run, ref, measure)


def _profiled_memory_step(run: _Run, e: _Entry, resident: int, limit: int | None) -> None:
    """A CPU memory step read from the PyTorch profiler instead of the live-tensor tracker (the
    compiled peers: compiled code allocates its buffers without Python dispatch). The peak is known
    only after the step, so a ``memory_limit_bytes`` over it makes the row OOM afterwards."""
    with ResidentPeak() as rss:
        m = profiled_step_memory(lambda fwd, bwd: run.step(e, after_forward=fwd, after_backward=bwd))
    if limit is not None and m.peak > limit:
        raise TrackerLimitExceeded(f"live tensors reached {m.peak} bytes (PyTorch profiler), over the limit "
                                   f"of {limit}")
    e.mem = dict(measured=resident + m.peak, fwd_bwd=resident + m.fwd_bwd_peak, act=m.after_forward,
                 growth=m.peak)
    e.mem_source = "profiler"
    if rss.peak_bytes is not None:
        e.mem.update(rss_peak=rss.peak_bytes, rss_growth=rss.growth_bytes)


@dataclass(frozen=True)
class ProfiledMemory:
    """Bytes above what was allocated when profiling began: the peak, the live bytes after the
    first forward, and the peak up to the end of the backward."""

    peak: int
    after_forward: int
    fwd_bwd_peak: int


def profiled_step_memory(step: Callable[[Callable[[], None], Callable[[], None]], object]) -> ProfiledMemory:
    """Run ``step(after_forward, after_backward)`` under the PyTorch profiler with memory events
    (:class:`ckplan.measure.AllocatorTimeline`): unlike the live-tensor tracker this sees every
    allocation of the CPU allocator (compiled kernels' buffers too); the two callbacks mark the
    moments whose live bytes are reported."""
    tl = AllocatorTimeline()
    with tl:
        step(tl.mark, tl.mark)
    at = tl.replay()
    peak = tl.peak
    if len(at) < 2:  # a step that never reached its marks: the whole step counts
        return ProfiledMemory(peak=peak, after_forward=at[0][0] if at else 0, fwd_bwd_peak=peak)
    (after_forward, fwd_peak), (_, bwd_peak) = at[0], at[1]
    return ProfiledMemory(peak=peak, after_forward=after_forward, fwd_bwd_peak=max(fwd_peak, bwd_peak))


def _timed_rounds(run: _Run, entries: list[_Entry], steps: int, tick) -> None:
    """Step 3: one untimed round (the tracked step leaves caches cold), then timed steps,
    strategies interleaved round by round."""
    clock = Clock(run.device)
    for e in entries:
        tick(f"settle: {e.name}")
        _guarded(run, e, _plain_step)
    for _ in range(steps):
        for e in entries:
            if e.status == OK:
                tick(f"timing: {e.name}")
                _guarded(run, e, _timed_step, clock)


def _timed_step(run: _Run, e: _Entry, clock: Clock) -> None:
    t0 = clock.now_ms()
    e.final_loss = run.step(e)
    e.times.append(clock.now_ms() - t0)


def _fwd_bwd_peak(chain, plan: Plan) -> int:
    """The simulated peak of forward and backward alone (the optimizer step left out)."""
    return max(ev.peak_bytes for ev in trace(chain, plan) if ev.op != "opt")


INPLACE_TIP = ("a checkpoint starts at a layer that changes its input in place (ReLU(inplace=True) "
               "and the like: PyTorch's checkpoint saves that input and cannot recompute from it); "
               "build those layers with inplace=False, or bench a plan (--plan) whose checkpoints "
               "start elsewhere")


def _row_error(err: RuntimeError) -> str:
    """One line for a row whose step raised: what PyTorch said, and the fix when it is known."""
    first = str(err).splitlines()[0][:200]
    if "modified by an inplace operation" in str(err):
        return f"{INPLACE_TIP} ({type(err).__name__}: {first})"
    return f"{type(err).__name__}: {first}"


def _guarded(run: _Run, e: _Entry, fn, *args) -> None:
    """Run ``fn(run, e, *args)``; an out-of-memory marks the strategy OOM and the bench goes on."""
    if e.status != OK:
        return
    try:
        fn(run, e, *args)
    except (torch.cuda.OutOfMemoryError, TrackerLimitExceeded) as err:
        e.status, e.message = OOM, str(err).splitlines()[0][:200]
        run.opt.zero_grad(set_to_none=True)
        gc.collect()
        if run.device.type == "cuda":
            torch.cuda.empty_cache()
    except ModelRunError:
        raise
    except RuntimeError as err:
        e.status, e.message = ERROR, _row_error(err)
        run.opt.zero_grad(set_to_none=True)


def _row(e: _Entry, none: _Entry | None, budget_bytes: int | None = None) -> BenchRow:
    """The row of ``e``; ``budget_bytes``: the explicit --budget (a row predicted to fit it that
    measured above it is ``over-budget``)."""
    none_ms = statistics.median(none.times) if none is not None else None
    noisy, rlo, rhi = (within_noise(e.times, none.times) if none is not None and e is not none
                       and e.status == OK else (False, None, None))
    measured = e.mem.get("measured") if e.status == OK else None
    med = statistics.median(e.times) if e.times and e.status == OK else None
    fb = e.mem.get("fwd_bwd") if e.status == OK else None
    status, message = e.status, e.message
    if status == OK and over_budget(e.predicted_peak, measured, budget_bytes):
        status = OVER_BUDGET
        message = "; ".join(m for m in (message, f"measured above the budget it was predicted to fit "
                                                 f"({measured - budget_bytes} bytes over)") if m)
    return BenchRow(
        strategy=e.name, status=status, plan=e.plan.describe() if e.plan else e.plan_text,
        n_checkpoints=e.plan.n_checkpoints if e.plan else 0,
        predicted_peak_bytes=e.predicted_peak, measured_peak_bytes=measured,
        peak_error=peak_error(e.predicted_peak, measured),
        predicted_fwd_bwd_peak_bytes=e.predicted_fb_peak, measured_fwd_bwd_peak_bytes=fb,
        fwd_bwd_peak_error=peak_error(e.predicted_fb_peak, fb),
        predicted_activation_bytes=e.predicted_act,
        measured_activation_bytes=e.mem.get("act") if e.status == OK else None,
        reserved_peak_bytes=e.mem.get("reserved"), alloc_retries=e.mem.get("retries"),
        nvml_used_bytes=e.mem.get("nvml"),
        step_ms=med, step_ms_min=min(e.times) if med is not None else None,
        step_ms_max=max(e.times) if med is not None else None,
        slowdown=(med / none_ms) if med is not None and none_ms else None,
        predicted_overhead=e.predicted_overhead, loss=e.loss, final_loss=e.final_loss,
        max_grad_diff=e.grad_diff, message=message, grad_tolerance=e.grad_tol,
        measured_growth_bytes=e.mem.get("growth") if e.status == OK else None,
        measured_rss_peak_bytes=e.mem.get("rss_peak") if e.status == OK else None,
        measured_rss_growth_bytes=e.mem.get("rss_growth") if e.status == OK else None,
        kind=e.kind, slowdown_within_noise=noisy, slowdown_ratio_min=rlo, slowdown_ratio_max=rhi)
