"""The compiled bench: torch-compile peer rows (a compiled copy of the model each) and --compile
(ckplan's rows over compiled chain layers), with the cross-checks that keep their numbers honest."""
from __future__ import annotations

import gc

import torch

from ..bench_records import OK
from ..peers import COMPILE_PEERS, UNAVAILABLE, CompiledPeer, budget_fraction, compile_unavailable
from ..planner import plan_chain, simulate
from .entry import Entry
from .gradients import loss_and_grads
from .memory import profiled_step_memory
from .status import guarded, one_line
from .steps import Run, resident_bytes


def compile_entries(entries: list[Entry], model, chain, budget_bytes: int | None, device: torch.device,
                    fresh_cache: bool = True) -> None:
    """The torch-compile peers: the activation-memory fraction ckplan's budget maps to, and a
    compiled copy of the model for each (:class:`CompiledPeer`), made before any plan touches the
    model; where TorchInductor cannot run, the rows are ``unavailable`` with the reason.
    ``fresh_cache=False`` keeps Dynamo's cache (copies compiled earlier in this bench keep their graphs)."""
    compile_rows = [e for e in entries if e.name in COMPILE_PEERS]
    if not compile_rows:
        return
    why = compile_unavailable(device.type)
    none_peak = simulate(chain, plan_chain(chain, "none", None, 1).plan).peak_bytes
    if not why and fresh_cache:
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
            e.message = f"{e.message}; torch.compile could not wrap a copy of the model ({one_line(err)})"


def compile_notes(run: Run, entries: list[Entry], notes: list[str]) -> None:
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


def eager_cross_check(run: Run, entries: list[Entry], tick, notes: list[str]) -> None:
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
        loss, grads = loss_and_grads(run, ref, init)
    finally:
        run.eager = False
        run.model.load_state_dict(init)
    diff = max(((g - grads[n]).abs().max().item() for n, g in compiled_grads.items()
                if g is not None and grads.get(n) is not None and g.numel()), default=0.0)
    notes.append(f"--compile: none with compiled layers against none eager: max |grad difference| {diff:.3g} "
                 f"(loss {ref.loss:.6g} vs {loss:.6g}); the gradient check compares the rows with the compiled none")


def profiler_cross_check(run: Run, entries: list[Entry], tick) -> None:
    """When compiled rows were measured with the profiler on CPU, ``none`` is measured that way too
    (one more step), so the note can show that the two measurements agree on an eager step."""
    if run.device.type != "cpu" or not any(e.mem_source == "profiler" and e.status == OK for e in entries):
        return
    ref = next((e for e in entries if e.name == "none" and e.compiled is None and e.status == OK), None)
    if ref is None:
        return
    tick("memory: none (profiler)")

    def measure(run: Run, e: Entry) -> None:
        resident = resident_bytes(run.model, run.opt, run.batch)
        gc.collect()
        m = profiled_step_memory(lambda fwd, bwd: run.step(e, after_forward=fwd, after_backward=bwd))
        e.mem["profiler_check"] = resident + m.peak

    guarded(run, ref, measure)
