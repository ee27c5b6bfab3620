"""Step 1, the gradient check: every row's loss and gradients from the same weights and seed, judged
against ``none`` (the tolerances are in :mod:`ckplan.bench`)."""
from __future__ import annotations

import contextlib
import math

import torch
from torch.utils._pytree import tree_map

from ..bench_records import ERROR, GRAD_TOLERANCES, NON_FINITE, WRONG_GRADIENTS
from ..errors import ModelRunError, PlanRunError
from ..measure import TrackerLimitExceeded, now_ms
from ..peers import UNAVAILABLE
from ..planner import plan_none
from .entry import Entry
from .status import one_line, plan_error, row_error
from .steps import Run, Stepper, applied, model_of


def check_gradients(run: Run, entries: list[Entry], tick, notes: list[str], eager_reference: bool = False) -> None:
    """Step 1: same initial weights and RNG, one accumulated backward per plan, judged against none.

    The reference (the first plan without checkpoints) runs first, whatever its place in the list;
    with ``eager_reference`` it is the model eager without checkpoints, run first and not a row.
    Rows outside the tolerance become ``wrong-gradients``, NaN/inf ``non-finite`` (the tolerances: :mod:`ckplan.bench`).
    """
    init = {name: v.detach().to("cpu", copy=True) for name, v in run.model.state_dict().items()}
    order = sorted(entries, key=lambda e: not e.is_reference)  # stable: the first none first
    if eager_reference:
        order = [Entry("none (eager)", plan_none(len(run.profile.chain_layers))), *order]
    rtol, atol = GRAD_TOLERANCES.get(run.profile.precision, GRAD_TOLERANCES["fp32"])
    ref: dict[str, torch.Tensor | None] | None = None
    ref_loss = ref_scale = 0.0
    ref_entry: Entry | None = None
    for e in order:
        tick(f"gradients: {e.name}" + (" (compiling)" if e.compiled is not None else ""))
        if e.compiled is not None:
            got = compile_first_step(run, e, init)
            if got is None:
                continue
            e.loss, grads = got
        else:
            try:
                e.loss, grads = loss_and_grads(run, e, init)
            except PlanRunError as err:  # this plan cannot run on this model: the row says why
                e.status, e.message = ERROR, plan_error(err)
                run.model.zero_grad(set_to_none=True)
                continue
            except (torch.cuda.OutOfMemoryError, TrackerLimitExceeded, ModelRunError):
                raise
            except RuntimeError as err:  # the row fails, the bench goes on (e.g. in-place inputs)
                e.status, e.message = ERROR, row_error(err)
                run.model.zero_grad(set_to_none=True)
                continue
        bad = _non_finite(e.loss, grads)
        if bad:
            e.status, e.message = NON_FINITE, f"{bad}; gradients not compared"
        elif ref is None and e.is_reference:
            ref, ref_loss, ref_entry = grads, e.loss, e
            if run.layers is not None:
                run.ref_grads = grads
            ref_scale = max((g.abs().max().item() for g in grads.values() if g is not None and g.numel()),
                            default=0.0)
            e.grad_diff, e.grad_tol = 0.0, rtol * ref_scale + atol
        elif ref is not None:
            _judge(e, grads, ref, ref_loss, ref_scale, rtol, atol)
        del grads
    failed = any(e.status == WRONG_GRADIENTS for e in entries)
    if failed and ref is not None and ref_entry is not None and ref_entry.compiled is None:
        _reference_reproduced(run, ref_entry, init, ref, ref_loss, entries)
    run.model.load_state_dict(init)
    if entries and ref is None:
        notes.append("gradients not checked: no plan without checkpoints gave a finite reference "
                     "(add none to --compare)")


def compile_first_step(run: Run, e: Entry, init: dict):
    """A compiled peer's first forward+backward, under its partitioner budget: it compiles here, so
    its time goes into the row's message, never into the step time. A compiler that fails makes the
    row ``unavailable`` with the reason (None is returned then)."""
    c = e.compiled
    assert c is not None
    t0 = now_ms()
    try:
        with c.compiling():
            got = loss_and_grads(run, e, init)
    except ModelRunError:
        raise
    except Exception as err:  # inductor's errors are many kinds; the row says which, the bench goes on
        run.model.zero_grad(set_to_none=True)
        e.status, e.message = UNAVAILABLE, f"{e.message}; torch.compile failed here ({one_line(err)})"
        return None
    if c.graphs == 0:
        e.status = UNAVAILABLE
        e.message += "; Dynamo compiled no graph for this model (it would run eagerly)"
        return None
    e.message += f"; compiled {c.graphs} graph(s) in {(now_ms() - t0) / 1e3:.1f} s (first step, not timed)"
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


def loss_and_grads(run: Run, e: Entry, init: dict) -> tuple[float, dict[str, torch.Tensor | None]]:
    run.model.load_state_dict(init)
    torch.manual_seed(0)
    with applied(run, e), _deterministic_kernels(run.device):
        # a copy of the batch: a model that changes its input in place must not change the next row's
        batch = tree_map(lambda v: v.detach().clone().requires_grad_(v.requires_grad)
                         if isinstance(v, torch.Tensor) else v, run.batch)
        st = Stepper(model_of(run, e), None, batch, run.loss_fn, run.profile.precision, run.profile.accum,
                      run.device)
        st.scaler = None  # gradients compared unscaled
        loss = st.backward()
    grads = {n: (p.grad.detach().float().cpu() if p.grad is not None else None)
             for n, p in run.model.named_parameters()}
    run.model.zero_grad(set_to_none=True)
    return loss, grads


def _reference_reproduced(run: Run, ref_entry: Entry, init: dict, ref: dict, ref_loss: float,
                          entries: list[Entry]) -> None:
    """Rows judged wrong: run the reference once more. A model that draws random numbers outside
    torch's seeded generators (Reformer reseeds its dropout from ``torch.seed()``) differs from
    itself, so its rows cannot be judged: they become errors that say so."""
    loss, grads = loss_and_grads(run, ref_entry, init)
    diff = max(((g - ref[n]).abs().max().item() for n, g in grads.items()
                if g is not None and ref.get(n) is not None and g.numel()), default=0.0)
    if diff == 0.0 and loss == ref_loss:
        return
    for e in entries:
        if e.status == WRONG_GRADIENTS:
            e.status = ERROR
            e.message = (f"gradients not compared: {ref_entry.name} itself gave other gradients in a second run "
                         f"(max |dgrad| {diff:.3g}, loss {loss:.6g} vs {ref_loss:.6g}) from the same weights "
                         "and seed, so no plan can be checked against it: the model keeps state from one run "
                         "to the next (attributes or globals it changes in forward, such as a step counter), "
                         "or draws random numbers outside torch's seeded generators (a reseed from "
                         f"torch.seed() or the clock){_dropout_tip(run.model)}")


def _dropout_tip(model: torch.nn.Module) -> str:
    """The fix for a model whose dropout reseeds itself, when it has dropout at all: a dropout
    module, or a float attribute (of a module or its config) named dropout, above 0."""
    def on(owner) -> bool:
        return any(isinstance(v, float) and v > 0 and "dropout" in k for k, v in vars(owner).items())
    config = getattr(model, "config", None)
    has = (any((isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0) or on(m) for m in model.modules())
           or (config is not None and hasattr(config, "__dict__") and on(config)))
    return "; set its dropout to 0 to check the plans" if has else ""


def _non_finite(loss: float, grads: dict[str, torch.Tensor | None]) -> str:
    """What is NaN or inf ('' when all is finite)."""
    if not math.isfinite(loss):
        return f"the loss is {loss}"
    bad = next((n for n, g in grads.items() if g is not None and not torch.isfinite(g).all()), None)
    return "" if bad is None else f"the gradient of {bad} has NaN or inf"


def _judge(e: Entry, grads: dict, ref: dict, ref_loss: float, ref_scale: float, rtol: float,
           atol: float) -> None:
    """Compare one plan's loss and gradients with the reference; mark it wrong outside the bound."""
    e.grad_tol = rtol * ref_scale + atol
    missing = sorted(n for n in ref.keys() | grads.keys()
                     if (ref.get(n) is None) != (grads.get(n) is None))
    diffs = {n: (g - ref[n]).abs().max().item() for n, g in grads.items()
             if g is not None and ref.get(n) is not None and g.numel()}
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
