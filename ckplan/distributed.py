"""Measured training steps per rank under FSDP2 and DDP, on ranks that ckplan starts and ends.

``bench_distributed`` first checks that the machine can hold ``nproc`` ranks
(:func:`ckplan.launch.check_ranks`: a GPU each for NCCL; for gloo on the CPU a core each and
file descriptors; then their predicted memory), profiles the spec's model on one process (one
rank's micro-batch), turns the profile into a per-rank chain (:mod:`ckplan.planner.parallel`),
plans every strategy on it, then starts ``nproc`` ranks with :func:`ckplan.launch.run_ranks`
(the environment ``torchrun`` sets: ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``...; gloo on CPU,
NCCL on CUDA), which ends every one of them however the run ends. Every rank:

1. builds the model from the spec with the spec's seed (identical weights on every rank) and
   its own micro-batch of ``spec.input.batch_size`` samples from seed ``spec.seed + rank``
   (data parallelism: the global batch is ``nproc`` micro-batches);
2. wraps it: FSDP2 ``fully_shard`` on every chain layer, then on the root (the parameters
   outside the chain: embeddings, final norm, head), or ``DistributedDataParallel``;
3. per strategy, applies the plan with :func:`ckplan.execute.apply_plan` on the chain and runs
   one backward from the initial weights; rank 0 runs one process on the concatenated global
   batch from the same seed and sends each parameter's gradient to the ranks, and every rank
   compares what it holds (its shard under FSDP2, the whole all-reduced gradient under DDP)
   with the same part of it, so each rank's row says whether its own gradients are right.
   fp32 tolerance: the ranks average gradients in a different order than one process sums them
   (reduce-scatter / all-reduce of per-rank means), so gradients agree to a few ULPs of their
   magnitude: ``max |g - g_ref| <= GRAD_RTOL * max |g_ref| + GRAD_ATOL``;
4. warm-up steps (optimizer state exists from then on), then one memory step per strategy under
   a live-tensor tracker that has been counting since before the model was built, so its live
   bytes are absolute (sharded parameters, optimizer state, DDP buckets, FSDP buffers included);
   on CUDA, ``torch.cuda.max_memory_allocated`` after a reset;
5. timed steps, strategies interleaved; then the rows go to rank 0 with ``gather_object``.

A rank that raises (or runs past a memory limit) writes its error to a file and exits; a rank
that dies without a word (killed, ``os._exit``) is seen by its exit code. The launcher then ends
the other ranks at once (a collective waiting on a dead peer would only fail after
``timeout_s``), and the failure comes back as rows with status ``error`` / ``OOM``, not as a
hang. SIGINT / SIGTERM end every rank and remove the temporary folder before
:class:`ckplan.errors.Interrupted` (exit 130 / 143) is raised. A row predicted to fit an
explicit per-rank budget that measured above it is ``over-budget`` (:func:`mark_over_budget`;
the CLI exits 3).

Test hooks (tests/test_launch.py), read by every rank from ``CKPLAN_TEST_FAULT``: ``hold``
(every rank writes ``held<rank>`` in its folder once its process group is up, then sleeps: a
run to signal), ``exit:R`` (rank R leaves with ``os._exit(9)`` there), ``grads:R`` (rank R adds
1 to its first gradient before the check).

Known limitations: one node; gloo collectives' internal buffers are not seen by the CPU tracker
(only tensors made by ops are); ``accum`` > 1 is not supported.
"""
from __future__ import annotations

import contextlib
import gc
import json
import os
import socket
import statistics
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import asdict, dataclass, field, replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from . import launch
from .errors import InfeasibleBudgetError, ModelRunError, UsageError
from .measure import Clock, LiveTensorTracker, TrackerLimitExceeded
from .planner import Plan, min_peak, plan_chain, simulate
from .planner.parallel import KINDS, per_rank_chain
from .records import OVER_BUDGET, WRONG_GRADIENTS, Profile, over_budget, peak_error
from .spec import Spec
from .units import format_bytes

OK, OOM, INFEASIBLE, ERROR = "ok", "OOM", "infeasible", "error"
GRAD_RTOL = 1e-5  # of the largest reference gradient; fp32 reduction order, see the module doc
GRAD_ATOL = 1e-7


@dataclass(frozen=True)
class RankRow:
    """One strategy on one rank."""

    strategy: str
    rank: int
    status: str  # ok | OOM | infeasible | error | wrong-gradients (this rank's own) | over-budget
    plan: str
    predicted_peak_bytes: int | None  # per-rank model (planner.parallel), whole step
    measured_peak_bytes: int | None
    peak_error: float | None  # |measured - predicted| / predicted (records.peak_error)
    predicted_fwd_bwd_peak_bytes: int | None  # forward + backward only
    measured_fwd_bwd_peak_bytes: int | None
    step_ms: float | None  # median of the timed steps on this rank
    loss: float | None  # this rank's loss in the correctness step
    max_grad_diff: float | None  # max |this rank's grad (its shard under FSDP) - one process's|
    grad_ok: bool | None  # within GRAD_RTOL / GRAD_ATOL
    message: str = ""
    torch_tracker_peak_bytes: int | None = None  # FSDPMemTracker's peak of the same step (cross_check)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class DistBenchResult:
    model: str
    kind: str  # fsdp | ddp
    world_size: int
    backend: str  # gloo | nccl
    device: str  # cpu | cuda
    batch_size: int  # per rank
    optimizer: str
    budget_bytes: int | None  # per rank
    k: int
    steps: int
    warmup: int
    rows: tuple[RankRow, ...]
    single_process_peak_bytes: int  # predicted peak of one unsharded process, no checkpointing
    notes: tuple[str, ...] = field(default=())

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["rows"] = [r.to_dict() for r in self.rows]
        d["notes"] = list(self.notes)
        return d

    def to_frame(self):
        """One row per (strategy, rank), as a pandas DataFrame."""
        import pandas as pd
        return pd.DataFrame([r.to_dict() for r in self.rows])


# ---- torch-side helpers shared by the parent and the ranks --------------------------------
def fsdp_unit_bytes(model: torch.nn.Module, chain_path: str | None, world_size: int) -> tuple[tuple[int, ...], int]:
    """(padded unsharded parameter bytes of every chain layer, of the root) under ``fully_shard``.

    FSDP2 shards every parameter on dim 0 into ``world_size`` chunks; chunk 0 is the largest,
    and every rank pads its shard to it (``torch.distributed.fsdp._fully_shard._fsdp_param``),
    so a parameter costs ``world_size * ceil(d0 / world_size) * (numel / d0)`` elements
    unsharded (all-gather output) and ``1 / world_size`` of that per rank. Works on meta.
    """
    from .chainfind import resolve_chain

    _, container, _ = resolve_chain(model, chain_path)

    def padded(params) -> int:
        total = 0
        for p in params:
            if p.dim() == 0:
                total += world_size * p.element_size()
                continue
            d0 = p.shape[0]
            rest = p.numel() // d0 if d0 else 0
            total += world_size * -(-d0 // world_size) * rest * p.element_size()
        return total

    seen: set[int] = set()
    layers = []
    for layer in container:
        ps = [p for p in layer.parameters() if id(p) not in seen]
        seen.update(id(p) for p in ps)
        layers.append(padded(ps))
    root = padded(p for p in dict.fromkeys(model.parameters()) if id(p) not in seen)
    return tuple(layers), root


class RankTracker(LiveTensorTracker):
    """``LiveTensorTracker`` that also follows ``UntypedStorage.resize_`` and looks through DTensor.

    FSDP2 frees unsharded parameters by resizing their storage to 0 and re-allocates them by
    resizing back (``_fsdp_param.free_storage`` / ``alloc_storage``), which no dispatched op
    shows; like PyTorch's own ``MemTracker`` we patch ``resize_`` while the tracker is active.
    DTensor ops are handed back (``NotImplemented``) so the local ops they run are counted.
    """

    def __init__(self, limit_bytes: int | None = None):
        super().__init__(limit_bytes=limit_bytes)
        self._orig_resize = None

    def _free(self, key: int, nbytes: int) -> None:
        size = self._known.pop(key, None)
        if size is not None:
            self.live -= size

    def _bump(self) -> None:
        if self.live > self.peak:
            self.peak = self.live
            if self.limit_bytes is not None and self.live > self.limit_bytes:
                raise TrackerLimitExceeded(
                    f"live tensors reached {self.live} bytes, over the limit of {self.limit_bytes}")

    def __enter__(self):
        import weakref
        from functools import wraps

        orig = torch.UntypedStorage.resize_
        self._orig_resize = orig
        tracker = self

        @wraps(orig)
        def resize_(st, size):
            key = id(st)
            old = st.nbytes()
            out = orig(st, size)
            new = st.nbytes()
            if key not in tracker._known:
                tracker._known[key] = old
                weakref.finalize(st, tracker._free, key, 0)
            tracker._known[key] += new - old
            tracker.live += new - old
            tracker._bump()
            return out

        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *exc):
        if self._orig_resize is not None:
            torch.UntypedStorage.resize_ = self._orig_resize
            self._orig_resize = None
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented
        return super().__torch_dispatch__(func, types, args, kwargs)


# ---- the parent: profile, plan, launch, collect --------------------------------------------
@dataclass(frozen=True)
class _Job:
    spec: dict
    kind: str
    plans: tuple[tuple[str, dict | None, int | None, int | None, str], ...]  # name, plan, pred, pred fb, msg
    steps: int
    warmup: int
    device: str
    timeout_s: float
    out_dir: str
    check_grads: bool
    memory_limit_bytes: int | None
    fail_rank: int | None
    threads: int
    start_method: str
    cross_check: bool


def bench_distributed(spec: Spec | str | Path, *, nproc: int = 2, kind: str = "fsdp",
                      strategies: list[str] | None = None, budget_bytes: int | None = None, k: int = 2,
                      steps: int = 3, warmup: int = 1,
                      device: str = "cpu", timeout_s: float = 300.0, check_grads: bool = True,
                      memory_limit_bytes: int | None = None, profile: Profile | None = None,
                      fail_rank: int | None = None, threads: int = 1,
                      start_method: str | None = None, isolate: bool | None = None,
                      cross_check: bool = False, force: bool = False) -> DistBenchResult:
    """Plan per rank and run ``nproc`` ranks under ``kind`` (``fsdp`` | ``ddp``); see the module doc.

    ``budget_bytes`` is per rank (None: halfway between the per-rank chain's smallest feasible
    peak and its peak without checkpointing). ``memory_limit_bytes`` makes a rank fail like an
    out-of-memory when its live bytes pass it (CPU). ``timeout_s`` bounds each rank's whole run
    (and every collective): a rank past it is stopped and the group torn down. ``fail_rank``
    makes that rank raise at its first memory step: a fault injection to check that a failing
    rank comes back as rows.
    ``isolate``: one process group per strategy, so that one strategy's out-of-memory does not
    take the others down (default: on when ``memory_limit_bytes`` is given).
    ``cross_check``: run PyTorch's ``FSDPMemTracker`` on the same memory step (FSDP, CPU) and
    report its peak beside ckplan's (``torch_tracker_peak_bytes``).
    ``start_method``: how the launcher starts the ranks; default ``fork`` on CPU (seconds
    faster: the ranks inherit the imported torch) and ``spawn`` on CUDA (a CUDA context cannot
    be forked).
    ``force``: run ranks that the machine checks refuse where that is only slow or risky
    (CPU oversubscription up to ``launch.MAX_RANKS_PER_CPU`` per core, memory), as the
    preflight's ``force``; never more ranks than GPUs for NCCL or than the open-file limit.
    """
    from . import api

    if not isinstance(spec, Spec):
        spec = api.load(spec)
    strategies = list(strategies or ["none", "every-k", "dp"])
    if kind not in KINDS:
        raise UsageError(f"--parallel {kind!r} is not one of {', '.join(KINDS)}")
    if not isinstance(nproc, int) or nproc < 1:
        raise UsageError(f"--nproc {nproc!r} must be a positive integer")
    dev = api.resolve_device(device)
    if dev.type == "meta":
        raise UsageError("a distributed bench runs real steps; --device meta cannot run them",
                         tip="use --device cpu (gloo) or cuda (NCCL)")
    if spec.train.accum != 1:
        raise UsageError(f"train.accum {spec.train.accum} is not supported by the distributed bench",
                         tip="set train.accum: 1")
    check_kind(kind, dev.type)
    machine_notes = check_world(nproc, dev.type, force=force)
    prof = profile if profile is not None else api.profile(spec, device=dev.type, force=force)
    explicit = budget_bytes  # a row predicted to fit it that measures above it is over-budget
    if dev.type == "cuda":
        torch.cuda.empty_cache()  # the profile's blocks would stay reserved beside the ranks
    chain = rank_chain(prof, spec, nproc, kind)
    notes = [f"{kind} on {nproc} ranks; every chain layer is one FSDP unit, the root holds the rest"
             if kind == "fsdp" else f"ddp on {nproc} ranks (bucket_cap_mb 25, gradient_as_bucket_view off)",
             f"each rank runs its own micro-batch of {prof.batch_size} (global batch {prof.batch_size * nproc})",
             *machine_notes]
    if budget_bytes is None and {"dp", "chen"} & set(strategies):
        lo, hi = min_peak(chain), plan_chain(chain, "none").score.peak_bytes
        budget_bytes = (lo + hi) // 2
        notes.append(f"no budget: dp and chen planned per rank for {format_bytes(budget_bytes)}, halfway "
                     f"between the smallest feasible peak ({format_bytes(lo)}) and the peak without "
                     f"checkpointing ({format_bytes(hi)})")
    plans = []
    for s in strategies:
        try:
            res = plan_chain(chain, s, budget_bytes, k)
            plans.append((s, res.plan.to_dict(), res.score.peak_bytes, _fwd_bwd_peak(chain, res.plan), ""))
        except InfeasibleBudgetError as err:
            plans.append((s, None, None, None, err.message))
    runnable = [p for p in plans if p[1] is not None]
    if runnable and dev.type == "cpu":  # on CUDA every rank has a GPU of its own
        from .preflight import available_memory
        notes += launch.check_rank_memory(
            _rank_bytes(prof, nproc, max(p[2] for p in runnable), check_grads), available_memory(dev),
            device=dev.type, force=force)
    if isolate is None:
        isolate = memory_limit_bytes is not None
    groups = [[p] for p in plans] if isolate else [plans]
    rows: list[RankRow] = []
    # From the first temporary folder to the last one's removal, a signal only sets a flag: the
    # ranks are ended and the folder removed before Interrupted is raised.
    with launch.caught_signals(f"bench on {nproc} ranks"):
        for group in groups:
            with tempfile.TemporaryDirectory(prefix="ckplan-dist-", ignore_cleanup_errors=True) as out_dir:
                job = _Job(spec=spec.model_dump(mode="json"), kind=kind, plans=tuple(group), steps=steps,
                           warmup=warmup, device=dev.type, timeout_s=float(timeout_s), out_dir=out_dir,
                           check_grads=check_grads, memory_limit_bytes=memory_limit_bytes, fail_rank=fail_rank,
                           threads=threads, start_method=start_method or _default_start_method(dev.type),
                           cross_check=cross_check)
                failure = _launch(job, nproc) if any(p[1] is not None for p in group) else ""
                rows.extend(_collect(job, nproc, failure))
            if failure:
                label = f" ({group[0][0]})" if isolate else ""
                notes.append(f"the group{label} failed and was torn down: {failure}")
    rows = mark_over_budget(rows, explicit)
    single = simulate(_single_chain(prof), _none(prof)).peak_bytes
    return DistBenchResult(model=prof.model, kind=kind, world_size=nproc,
                           backend="nccl" if dev.type == "cuda" else "gloo", device=dev.type,
                           batch_size=prof.batch_size, optimizer=prof.optimizer, budget_bytes=budget_bytes,
                           k=k, steps=steps, warmup=warmup, rows=tuple(rows), single_process_peak_bytes=single,
                           notes=tuple(notes))


def mark_over_budget(rows, budget_bytes: int | None) -> list[RankRow]:
    """``rows`` with ``over-budget`` for each one measured above ``budget_bytes`` (an explicit
    per-rank budget) that it was predicted to fit."""
    out = []
    for r in rows:
        if r.status == OK and over_budget(r.predicted_peak_bytes, r.measured_peak_bytes, budget_bytes):
            r = replace(r, status=OVER_BUDGET, message=f"measured above the per-rank budget it was predicted "
                                                      f"to fit ({r.measured_peak_bytes - budget_bytes} bytes over)")
        out.append(r)
    return out


def fsdp_runs_on_cpu() -> bool:
    """Whether this torch's FSDP2 trains correctly on CPU ranks (gloo): it records events on CPU
    streams, which torch has from 2.7, and torch 2.7 and 2.8 sum the gradients over gloo ranks
    instead of averaging them (world_size times one process's; 2.9 averages them)."""
    has_events = hasattr(torch.cpu, "Stream") and hasattr(torch.cpu.Stream, "record_event")
    return has_events and _torch_minor() >= (2, 9)


def _torch_minor() -> tuple[int, int]:
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def check_kind(kind: str, device_type: str) -> None:
    """Refuse a data-parallel kind this torch cannot run on ``device_type``."""
    if kind == "fsdp" and device_type == "cpu" and not fsdp_runs_on_cpu():
        version = torch.__version__.split("+")[0]
        why = ("sums the gradients over gloo ranks instead of averaging them" if _torch_minor() >= (2, 7)
               else "records CPU stream events it does not have")
        raise UsageError(f"--parallel fsdp on CPU ranks needs torch 2.9 or newer (this is torch "
                         f"{version}, whose FSDP2 {why})", tip="use --parallel ddp, --device cuda, or torch>=2.9")


def check_world(nproc: int, device_type: str, *, force: bool = False) -> list[str]:
    """Refuse ``nproc`` ranks this machine cannot run (:func:`ckplan.launch.check_ranks`), before
    any profile; the notes say what ``force`` let through."""
    gpus = torch.cuda.device_count() if device_type == "cuda" else 0
    return launch.check_ranks(nproc, device_type, launch.machine(gpus), force=force)


def _rank_bytes(prof: Profile, nproc: int, rank_peak: int, check_grads: bool) -> list[int]:
    """Predicted tensor bytes of every rank: the largest per-rank plan peak; rank 0 also keeps
    the reference gradients, and before that runs one process on the global batch (the
    parameters and gradients once, the batch's inputs and activations ``nproc`` times)."""
    out = [rank_peak] * nproc
    if check_grads:
        t = prof.totals
        ref = t.param_bytes + t.buffer_bytes + t.grad_bytes + t.runtime_bytes + nproc * (t.input_bytes
                                                                                          + t.activation_bytes)
        out[0] = max(rank_peak + t.grad_bytes, ref)
    return out


def rank_chain(profile: Profile, spec: Spec | None, world_size: int, kind: str):
    """The per-rank chain of ``profile``, with FSDP2's exact padding when the spec is at hand."""
    from .planner.parallel import per_rank_chain_from_profile
    if kind != "fsdp" or spec is None:
        return per_rank_chain_from_profile(profile, world_size, kind)
    from .spec import build_model
    meta = build_model(spec, "meta")
    layers, root = fsdp_unit_bytes(meta, profile.chain, world_size)
    return per_rank_chain(_single_chain(profile), world_size=world_size, kind=kind,
                          layer_param_bytes=layers, root_param_bytes=root)


def _single_chain(profile: Profile):
    from . import planner
    return planner.chain_from_profile(profile)


def _none(profile: Profile) -> Plan:
    from .planner import plan_none
    return plan_none(len(profile.chain_layers))


def _fwd_bwd_peak(chain, plan: Plan) -> int:
    from .planner import trace
    return max(ev.peak_bytes for ev in trace(chain, plan) if ev.op != "opt")


def _default_start_method(device_type: str) -> str:
    if device_type == "cpu" and sys.platform.startswith("linux") and not torch.cuda.is_initialized():
        return "fork"
    return "spawn"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(job: _Job, nproc: int) -> str:
    """Run the ranks (:func:`ckplan.launch.run_ranks`); '' on success, else what failed."""
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
    log_dir = os.path.join(job.out_dir, "logs")
    os.makedirs(log_dir, exist_ok=True)
    with _main_module_hidden():
        # The ranks stop themselves at timeout_s; the launcher's own deadline is for a rank
        # that cannot (stuck before its watchdog starts, or holding the interpreter's lock).
        out = launch.run_ranks(_rank_main, job, nproc, start_method=job.start_method, env=env,
                               log_dir=log_dir, deadline_s=job.timeout_s + 60,
                               what=f"bench on {nproc} ranks")
    if out.ok:
        return ""
    msgs = []
    owns = {rank: _read_error(job.out_dir, rank).split("\n")[0] for rank in out.failed}
    # A rank that died without a word (killed, os._exit) first: its peers' errors are mostly
    # about the connection it broke.
    for rank in sorted(out.failed, key=lambda r: bool(owns[r])):
        msgs.append(f"rank {rank}: {owns[rank] or 'it ' + launch.describe_exit(out.exitcodes[rank])}")
    if out.failed:
        others = [r for r in range(nproc) if r not in out.failed and out.exitcodes[r] != 0]
        if others:
            msgs.append(f"rank(s) {', '.join(map(str, others))} stopped by ckplan after that")
    elif out.timed_out:
        msgs.append(f"the ranks ran past timeout_s={job.timeout_s:g} s (+60 s) and were stopped")
    else:
        msgs.append("; ".join(f"rank {r}: it {launch.describe_exit(c)}" for r, c in enumerate(out.exitcodes)
                              if c != 0))
    return "; ".join(msgs)[:600]


@contextlib.contextmanager
def _main_module_hidden():
    """Keep spawned ranks from re-running the parent's ``__main__`` (``python -m ckplan`` would
    start the CLI again in every rank): the ranks only need ``ckplan.distributed._rank_main``."""
    main = sys.modules.get("__main__")
    saved = {k: getattr(main, k) for k in ("__spec__", "__file__") if main is not None and hasattr(main, k)}
    try:
        for k in saved:
            if k == "__spec__":
                main.__spec__ = None
            else:
                delattr(main, k)
        yield
    finally:
        for k, v in saved.items():
            setattr(main, k, v)


def _read_error(out_dir: str, rank: int) -> str:
    p = Path(out_dir) / f"error{rank}.txt"
    return p.read_text().strip() if p.is_file() else ""


def _collect(job: _Job, nproc: int, failure: str) -> tuple[RankRow, ...]:
    """Rows from rank 0's gathered file, or from each rank's partial file after a failure."""
    gathered = Path(job.out_dir) / "gathered.json"
    per_rank: dict[int, dict[str, dict]] = {}
    if gathered.is_file():
        for r, rows in enumerate(json.loads(gathered.read_text())):
            per_rank[r] = rows
    else:
        for r in range(nproc):
            p = Path(job.out_dir) / f"rank{r}.json"
            per_rank[r] = json.loads(p.read_text()) if p.is_file() else {}
    rows = []
    for name, plan_d, pred, pred_fb, msg in job.plans:
        plan_text = Plan.from_dict(plan_d).describe() if plan_d else ""
        for r in range(nproc):
            got = per_rank.get(r, {}).get(name)
            if plan_d is None:
                rows.append(RankRow(name, r, INFEASIBLE, "", None, None, None, None, None, None, None,
                                    None, None, msg))
                continue
            got = got or {}
            status, message = got.get("status", ERROR), got.get("message", "")
            if failure or "measured" not in got:
                # The group did not finish: what was measured before the failure is kept.
                own = _read_error(job.out_dir, r).split("\n")[0]
                status = OOM if ("TrackerLimitExceeded" in own or "OutOfMemory" in own) else ERROR
                message = (own or failure or "no result from this rank")[:300]
            elif got.get("grad_ok") is False:
                status = WRONG_GRADIENTS
                message = (f"this rank's gradients differ from one process's by {got['grad_diff']:.3g}, "
                           f"over the tolerance {got['grad_tol']:.3g}")
            meas, fb = got.get("measured"), got.get("fwd_bwd")
            times = got.get("times") or []
            rows.append(RankRow(
                name, r, status, plan_text, pred, meas, peak_error(pred, meas),
                pred_fb, fb, statistics.median(times) if times else None, got.get("loss"),
                got.get("grad_diff"), got.get("grad_ok"), message, got.get("torch_tracker")))
    return tuple(rows)


# ---- one rank -----------------------------------------------------------------------------
def _rank_main(job: _Job) -> None:
    """Entry point of every rank (runs in a process started by the launcher)."""
    rank = int(os.environ["RANK"])
    watchdog = threading.Timer(job.timeout_s, _time_out, args=(job, rank))
    watchdog.daemon = True
    watchdog.start()
    try:
        _rank_run(job, rank)
    except BaseException as err:
        text = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"[:300]
        Path(job.out_dir, f"error{rank}.txt").write_text(text + "\n\n" + traceback.format_exc()[-4000:])
        raise
    finally:
        watchdog.cancel()
        import torch.distributed as dist
        if dist.is_initialized():
            dist.destroy_process_group()


def _time_out(job: _Job, rank: int) -> None:
    """The rank ran past ``timeout_s``: say so and exit; the launcher stops the other ranks."""
    Path(job.out_dir, f"error{rank}.txt").write_text(
        f"TimeoutError: rank {rank} ran past timeout_s={job.timeout_s:g} s and was stopped\n")
    os._exit(1)


def _rank_run(job: _Job, rank: int) -> None:
    import torch.distributed as dist

    from .execute import apply_plan
    from .spec import build_model, make_batch, to_loss, validate
    from .training import forward_loss, make_optimizer

    torch.set_num_threads(job.threads)
    world = int(os.environ["WORLD_SIZE"])
    cuda = job.device == "cuda"
    if cuda:
        local = int(os.environ.get("LOCAL_RANK", rank))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=job.timeout_s))
    fault = _test_fault(rank)
    if fault == "hold":
        Path(job.out_dir, f"held{rank}").touch()
        time.sleep(3600)
    elif fault == "exit":
        os._exit(9)
    spec = validate(job.spec)
    precision = spec.train.precision
    ref = None
    if job.check_grads and rank == 0:
        ref = _reference_grads(spec, world, device)
    dist.barrier()
    mesh = None
    if job.kind == "fsdp":
        # Made before the tracker starts: the mesh's rank tensor is infrastructure, not model.
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh(device.type, (world,))
    tracker = None
    if not cuda:
        tracker = RankTracker(limit_bytes=job.memory_limit_bytes)
        tracker.__enter__()
    try:
        model = build_model(spec, str(device))
        if mesh is not None:
            _fully_shard(model, spec.chain, mesh)
            wrapped = model
        else:
            wrapped = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if cuda else None)
        batch = make_batch(spec, str(device), seed=spec.seed + rank)
        args, kwargs = batch
        results: dict[str, dict] = {}
        runnable = []
        for name, plan_d, *_ in job.plans:
            if plan_d is not None:
                runnable.append((name, Plan.from_dict(plan_d)))
                results[name] = {"status": OK}

        def save():
            Path(job.out_dir, f"rank{rank}.json").write_text(json.dumps(results))

        def step(plan: Plan, opt, after_backward=None) -> float:
            # The same step as ckplan.bench: the loss is dropped before the optimizer step.
            with apply_plan(model, plan, chain=spec.chain):
                loss = forward_loss(wrapped, args, kwargs, to_loss, precision, device.type)
                loss.backward()
                value = float(loss.detach())
                del loss
                if after_backward is not None:
                    after_backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            return value

        # 1. gradients from the initial weights, against one process on the global batch.
        for name, plan in runnable:
            with apply_plan(model, plan, chain=spec.chain):
                loss = forward_loss(wrapped, args, kwargs, to_loss, precision, device.type)
                loss.backward()
            results[name]["loss"] = float(loss.detach())
            del loss
            if fault == "grads":
                _local(next(p.grad for p in model.parameters() if p.grad is not None)).add_(1.0)
            if job.check_grads:  # collectives: every rank takes part
                diff, scale = _grad_diff(model, ref, device)
                tol = GRAD_RTOL * scale + GRAD_ATOL
                results[name].update(grad_diff=diff, grad_tol=tol, grad_ok=diff <= tol)
            model.zero_grad(set_to_none=True)
        ref = None
        gc.collect()
        save()
        # 2. warm-up, then one memory step per strategy.
        opt = make_optimizer(model.parameters(), spec.train.optimizer, spec.train.lr, device.type)
        for _ in range(max(job.warmup, 1)):
            for _name, plan in runnable:
                step(plan, opt)
        for name, plan in runnable:
            if job.fail_rank == rank:
                raise ModelRunError(f"rank {rank} was told to fail (fail_rank={rank})")
            fb: dict[str, int] = {}

            def mark(fb=fb):  # the forward+backward peak, before the optimizer step
                fb.setdefault("peak", int(torch.cuda.max_memory_allocated(device)) if cuda else tracker.peak)

            if cuda:
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
                step(plan, opt, mark)
                results[name]["measured"] = int(torch.cuda.max_memory_allocated(device))
            else:
                tracker.reset_peak()
                if job.kind == "fsdp" and job.cross_check:
                    # PyTorch's own FSDP2 tracker on the same step, nested in ours: both see
                    # every op and every storage resize.
                    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
                    fmt = FSDPMemTracker(model, opt)
                    fmt.track_inputs(tuple(args) + tuple(kwargs.values()))
                    with fmt:
                        step(plan, opt, mark)
                    snap = fmt.get_tracker_snapshot("peak")
                    results[name]["torch_tracker"] = int(sum(d.get("Total", 0) for d in snap.values()))
                else:
                    step(plan, opt, mark)
                results[name]["measured"] = tracker.peak
            results[name]["fwd_bwd"] = fb["peak"]
            save()
        if tracker is not None:
            tracker.__exit__(None, None, None)
            tracker = None
        # 3. timed steps, strategies interleaved.
        clock = Clock(device)
        for _ in range(job.steps):
            for name, plan in runnable:
                dist.barrier()
                t0 = clock.now_ms()
                step(plan, opt)
                results[name].setdefault("times", []).append(clock.now_ms() - t0)
        save()
        gathered = [None] * world if rank == 0 else None
        dist.gather_object(results, gathered, dst=0)
        if rank == 0:
            Path(job.out_dir, "gathered.json").write_text(json.dumps(gathered))
    finally:
        if tracker is not None:
            tracker.__exit__(None, None, None)


def _fully_shard(model, chain_path: str | None, mesh) -> None:
    """FSDP2: ``fully_shard`` every chain layer (one unit each), then the root."""
    from torch.distributed.fsdp import fully_shard

    from .chainfind import resolve_chain

    _, container, _ = resolve_chain(model, chain_path)
    layers = list(container)
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    # FSDP2's default backward prefetch (the unit that ran before, by the order of forward
    # calls) is made explicit: a checkpointed layer is called twice in forward (by the model,
    # then inside the checkpoint), which would make the default prefetch pick the layer itself.
    for prev, layer in zip(layers, layers[1:]):
        layer.set_modules_to_backward_prefetch([prev])


def _reference_grads(spec: Spec, world: int, device: torch.device) -> dict[str, torch.Tensor]:
    """One process, the same initial weights, the ranks' micro-batches concatenated."""
    from .spec import build_model, make_batch, to_loss
    from .training import forward_loss

    model = build_model(spec, str(device))
    parts = [make_batch(spec, str(device), seed=spec.seed + r) for r in range(world)]
    args = tuple(torch.cat([p[0][i] for p in parts]) for i in range(len(parts[0][0])))
    kwargs = {key: torch.cat([p[1][key] for p in parts]) for key in parts[0][1]}
    loss = forward_loss(model, args, kwargs, to_loss, spec.train.precision, device.type)
    loss.backward()
    grads = {n: p.grad.detach().float().cpu().clone() for n, p in model.named_parameters() if p.grad is not None}
    del model, loss
    gc.collect()
    return grads


def _grad_diff(model, ref: dict[str, torch.Tensor] | None, device: torch.device) -> tuple[float, float]:
    """(max |this rank's gradient - one process's|, max |one process's gradient|), on every rank.

    ``ref`` (rank 0 only; None elsewhere) holds one process's full gradients. Each is sent from
    rank 0 one parameter at a time, as the rank holds it: scattered like the FSDP2 shard
    (``distribute_tensor`` with the gradient's own placements), whole (broadcast) under DDP. Every
    rank then compares its own part, so a rank whose gradients are wrong says so itself.
    """
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, distribute_tensor

    scale = torch.zeros((), dtype=torch.float32, device=device)
    if ref is not None:
        scale.fill_(max(float(g.abs().max()) for g in ref.values()))
    dist.broadcast(scale, 0)
    worst = 0.0
    for name, p in model.named_parameters():
        g = p.grad
        if g is None:
            continue
        key = name.replace("_orig_mod.", "").replace("module.", "")
        full = (ref[key].to(g.device) if ref is not None
                else torch.empty(g.shape, dtype=torch.float32, device=g.device))
        if isinstance(g, DTensor):
            want = distribute_tensor(full, g.device_mesh, g.placements, src_data_rank=0).to_local()
        else:
            dist.broadcast(full, 0)
            want = full
        have = _local(g).detach().float()
        if have.numel():
            worst = max(worst, float((have - want).abs().max()))
        del full, want, have
    return worst, float(scale)


def _local(t: torch.Tensor) -> torch.Tensor:
    """What this rank holds of ``t``: the local shard of a DTensor, else ``t``."""
    from torch.distributed.tensor import DTensor
    return t.to_local() if isinstance(t, DTensor) else t


def _test_fault(rank: int) -> str | None:
    """This rank's fault from ``CKPLAN_TEST_FAULT`` (module doc), or None."""
    what, _, who = os.environ.get("CKPLAN_TEST_FAULT", "").partition(":")
    if what == "hold" or (what in ("exit", "grads") and who.strip() == str(rank)):
        return what
    return None
