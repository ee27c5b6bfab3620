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
"""
from __future__ import annotations

import gc
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from .errors import InfeasibleBudgetError, ModelRunError
from .execute import apply_plan, remove_plan
from .measure import Clock, LiveTensorTracker, TrackerLimitExceeded, cuda_peak, cuda_reset, nvml_used_bytes
from .planner import Plan, chain_from_profile, min_peak, plan_chain, simulate, trace
from .records import Profile
from .training import forward_loss, make_optimizer

OK, OOM, INFEASIBLE, ERROR = "ok", "OOM", "infeasible", "error"


@dataclass(frozen=True)
class BenchRow:
    strategy: str
    status: str  # ok | OOM | infeasible | error
    plan: str  # Plan.describe()
    n_checkpoints: int
    predicted_peak_bytes: int | None
    measured_peak_bytes: int | None
    peak_error: float | None  # |measured - predicted| / measured
    predicted_fwd_bwd_peak_bytes: int | None  # the same, forward+backward only (no optimizer step)
    measured_fwd_bwd_peak_bytes: int | None
    fwd_bwd_peak_error: float | None
    predicted_activation_bytes: int | None  # held for backward when the forward ends, persistent excluded
    measured_activation_bytes: int | None
    reserved_peak_bytes: int | None  # CUDA only
    alloc_retries: int | None  # CUDA only
    nvml_used_bytes: int | None  # device memory in use after the memory step (NVML), when available
    step_ms: float | None  # median of the timed steps
    step_ms_min: float | None
    step_ms_max: float | None
    slowdown: float | None  # step_ms / step_ms of none, measured in the same run
    predicted_overhead: float | None
    loss: float | None  # correctness step, from the shared seed
    final_loss: float | None  # loss of this strategy's last timed step
    max_grad_diff: float | None  # max |grad - grad(none)| over all parameters
    message: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class BenchResult:
    model: str
    device: str
    device_name: str
    batch_size: int
    precision: str
    optimizer: str
    accum: int
    steps: int
    warmup: int
    budget_bytes: int | None
    k: int
    rows: tuple[BenchRow, ...]
    profile_peak_bytes: int  # predicted peak without checkpointing, from the profile
    notes: tuple[str, ...] = field(default=())

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["rows"] = [r.to_dict() for r in self.rows]
        d["notes"] = list(self.notes)
        return d


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
    mem: dict = field(default_factory=dict)
    times: list[float] = field(default_factory=list)


def _resident_bytes(model, opt, batch) -> int:
    seen: set[int] = set()
    total = 0

    def add(t):
        nonlocal total
        if isinstance(t, torch.Tensor):
            st = t.untyped_storage()
            if id(st) not in seen:
                seen.add(id(st))
                total += st.nbytes()

    for t in list(model.parameters()) + list(model.buffers()):
        add(t)
        add(getattr(t, "grad", None))
    for state in opt.state.values():
        for v in state.values():
            add(v)
    args, kwargs = batch
    for t in list(args) + list(kwargs.values()):
        add(t)
    return total


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


def run_bench(model, batch, loss_fn, profile: Profile, *, strategies: list[str], budget_bytes: int | None,
              k: int, steps: int, warmup: int, device: torch.device, lr: float,
              extra_plans: dict[str, Plan] | None = None, memory_limit_bytes: int | None = None,
              progress: Callable[[str], None] | None = None) -> BenchResult:
    """Bench ``strategies`` (and ``extra_plans``) on ``model``; see the module docstring."""
    tick = progress or (lambda msg: None)
    chain = chain_from_profile(profile)
    notes = list(profile.notes)
    if budget_bytes is None and {"dp", "chen"} & set(strategies):
        # Halfway between the smallest feasible peak and the peak without checkpointing: always
        # feasible, and it leaves the planners a real trade-off to make.
        lo, hi = min_peak(chain), plan_chain(chain, "none").score.peak_bytes
        budget_bytes = (lo + hi) // 2
        if lo >= hi:
            notes.append(f"no checkpointing plan can lower this step's peak ({hi} bytes, reached at "
                         f"{plan_chain(chain, 'none').score.peak_at}): parameters, gradients, optimizer "
                         "state or the loss head set it; checkpointing still frees the bytes held for "
                         "backward (see that column)")
        else:
            notes.append(f"no --budget: dp and chen planned for {budget_bytes} bytes, halfway between the "
                         f"smallest feasible peak ({lo}) and the peak without checkpointing ({hi})")
    entries: list[_Entry] = []
    for s in strategies:
        try:
            res = plan_chain(chain, s, budget_bytes, k)
            e = _Entry(s, res.plan, res.score.peak_bytes, _fwd_bwd_peak(chain, res.plan),
                       _activation_bytes(chain, res.plan), res.score.overhead)
        except InfeasibleBudgetError as err:
            e = _Entry(s, None, status=INFEASIBLE, message=err.message)
        entries.append(e)
    for name, plan in (extra_plans or {}).items():
        sc = simulate(chain, plan)
        entries.append(_Entry(name, plan, sc.peak_bytes, _fwd_bwd_peak(chain, plan),
                              _activation_bytes(chain, plan), sc.overhead))
    runnable = [e for e in entries if e.plan is not None]
    cuda = device.type == "cuda"
    clock = Clock(device)
    stepper = None
    try:
        # 1. correctness: same initial weights, same RNG, one accumulated backward per strategy.
        init = {k_: v.detach().to("cpu", copy=True) for k_, v in model.state_dict().items()}
        ref = None
        for e in runnable:
            tick(f"gradients: {e.name}")
            model.load_state_dict(init)
            torch.manual_seed(0)
            with apply_plan(model, e.plan, chain=profile.chain):
                st = _Stepper(model, None, batch, loss_fn, profile.precision, profile.accum, device)
                st.scaler = None  # gradients compared unscaled
                e.loss = st.backward()
            grads = {n: (p.grad.detach().float().cpu() if p.grad is not None else None)
                     for n, p in model.named_parameters()}
            model.zero_grad(set_to_none=True)
            if ref is None and e.plan.n_checkpoints == 0:
                ref = grads
            if ref is not None:
                e.grad_diff = max(((g - ref[n]).abs().max().item() for n, g in grads.items()
                                   if g is not None and ref.get(n) is not None), default=0.0)
            del grads
        model.load_state_dict(init)
        del init
        # 2. warm-up (at least one step) and one memory step per strategy.
        opt = make_optimizer(model.parameters(), profile.optimizer, lr, device.type)
        stepper = _Stepper(model, opt, batch, loss_fn, profile.precision, profile.accum, device)
        # At least one step first: the optimizer creates its state in its first step, and the
        # prediction is for a steady-state step.
        for _ in range(max(warmup, 1)):
            for e in runnable:
                tick(f"warm-up: {e.name}")
                _guarded(e, lambda: _with_plan(model, e, profile, stepper.step), device, opt)
        for e in runnable:
            if e.status != OK:
                continue
            tick(f"memory: {e.name}")

            def mem_step(e=e):
                resident = _resident_bytes(model, opt, batch)
                fb: dict[str, int] = {}
                if cuda:
                    cuda_reset(device)
                    _with_plan(model, e, profile, lambda: stepper.step(
                        after_backward=lambda: fb.setdefault("peak", cuda_peak(device).peak_allocated_bytes),
                        after_forward=lambda: fb.setdefault(
                            "act", torch.cuda.memory_allocated(device) - resident)))
                    m = cuda_peak(device)
                    e.mem = dict(measured=m.peak_allocated_bytes, fwd_bwd=fb["peak"], act=fb["act"],
                                 reserved=m.peak_reserved_bytes, retries=m.alloc_retries,
                                 nvml=nvml_used_bytes(device.index or 0))
                else:
                    limit = None if memory_limit_bytes is None else memory_limit_bytes - resident
                    with LiveTensorTracker(limit_bytes=limit) as tr:
                        _with_plan(model, e, profile, lambda: stepper.step(
                            after_backward=lambda: fb.setdefault("peak", resident + tr.peak),
                            after_forward=lambda: fb.setdefault("act", tr.live)))
                    e.mem = dict(measured=resident + tr.peak, fwd_bwd=fb["peak"], act=fb["act"])
            _guarded(e, mem_step, device, opt)
        # 3. one untimed round (the tracked step leaves caches cold), then timed steps, interleaved.
        for e in runnable:
            tick(f"settle: {e.name}")
            _guarded(e, lambda: _with_plan(model, e, profile, stepper.step), device, opt)
        for _ in range(steps):
            for e in runnable:
                if e.status != OK:
                    continue
                tick(f"timing: {e.name}")

                def timed(e=e):
                    t0 = clock.now_ms()
                    e.final_loss = _with_plan(model, e, profile, stepper.step)
                    e.times.append(clock.now_ms() - t0)
                _guarded(e, timed, device, opt)
    finally:
        remove_plan(model)
    none_ms = next((statistics.median(e.times) for e in entries
                    if e.name == "none" and e.times), None)
    rows = tuple(_row(e, none_ms) for e in entries)
    return BenchResult(model=profile.model, device=profile.device, device_name=profile.device_name,
                       batch_size=profile.batch_size, precision=profile.precision,
                       optimizer=profile.optimizer, accum=profile.accum, steps=steps, warmup=warmup,
                       budget_bytes=budget_bytes, k=k, rows=rows,
                       profile_peak_bytes=profile.totals.predicted_peak_bytes,
                       notes=tuple(notes))


def _fwd_bwd_peak(chain, plan: Plan) -> int:
    """The simulated peak of forward and backward alone (the optimizer step left out)."""
    return max(ev.peak_bytes for ev in trace(chain, plan) if ev.op != "opt")


def _activation_bytes(chain, plan: Plan) -> int:
    """Simulated bytes held for backward when the forward (loss included) ends, persistent excluded."""
    n = chain.n_layers
    end = next(ev for ev in trace(chain, plan) if ev.op == "F" and ev.stage == n)
    return end.mem_bytes - chain.persistent_bytes


def _with_plan(model, e: _Entry, profile: Profile, fn):
    with apply_plan(model, e.plan, chain=profile.chain):
        return fn()


def _guarded(e: _Entry, fn, device, opt) -> None:
    """Run one step; an out-of-memory marks the strategy OOM and the bench goes on."""
    if e.status != OK:
        return
    try:
        fn()
    except (torch.cuda.OutOfMemoryError, TrackerLimitExceeded) as err:
        e.status, e.message = OOM, str(err).splitlines()[0][:200]
        opt.zero_grad(set_to_none=True)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    except ModelRunError:
        raise
    except RuntimeError as err:
        e.status, e.message = ERROR, f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
        opt.zero_grad(set_to_none=True)


def _row(e: _Entry, none_ms: float | None) -> BenchRow:
    measured = e.mem.get("measured") if e.status == OK else None
    med = statistics.median(e.times) if e.times and e.status == OK else None
    err = (abs(measured - e.predicted_peak) / measured
           if measured and e.predicted_peak is not None else None)
    fb = e.mem.get("fwd_bwd") if e.status == OK else None
    fb_err = (abs(fb - e.predicted_fb_peak) / fb if fb and e.predicted_fb_peak is not None else None)
    return BenchRow(
        strategy=e.name, status=e.status, plan=e.plan.describe() if e.plan else "",
        n_checkpoints=e.plan.n_checkpoints if e.plan else 0,
        predicted_peak_bytes=e.predicted_peak, measured_peak_bytes=measured, peak_error=err,
        predicted_fwd_bwd_peak_bytes=e.predicted_fb_peak, measured_fwd_bwd_peak_bytes=fb,
        fwd_bwd_peak_error=fb_err,
        predicted_activation_bytes=e.predicted_act,
        measured_activation_bytes=e.mem.get("act") if e.status == OK else None,
        reserved_peak_bytes=e.mem.get("reserved"), alloc_retries=e.mem.get("retries"),
        nvml_used_bytes=e.mem.get("nvml"),
        step_ms=med, step_ms_min=min(e.times) if med is not None else None,
        step_ms_max=max(e.times) if med is not None else None,
        slowdown=(med / none_ms) if med is not None and none_ms else None,
        predicted_overhead=e.predicted_overhead, loss=e.loss, final_loss=e.final_loss,
        max_grad_diff=e.grad_diff, message=e.message)
