"""One rank of a distributed bench (:mod:`ckplan.distributed` starts them): it builds the model,
wraps it (FSDP2 or DDP), checks its gradients against one process, measures one memory step per
plan under a live-tensor tracker, times the steps, and hands its rows to rank 0. Also the
torch-side helpers the parent shares: :func:`fsdp_unit_bytes` and :class:`RankTracker`.
"""
from __future__ import annotations

import contextlib
import gc
import json
import os
import threading
import time
import traceback
import weakref
from datetime import timedelta
from functools import wraps
from pathlib import Path

import torch
import torch.distributed as dist

from .chainfind import resolve_chain
from .dist_grads import grad_diff, local_part, own_diff, reference_grads
from .dist_records import OK, OWN_RUN, Job, grad_tolerance
from .errors import ModelRunError
from .execute import apply_plan
from .measure import Clock, LiveTensorTracker, TrackerLimitExceeded
from .param_dtype import DTYPES
from .planner import Plan
from .spec import Spec, build_model, make_batch, to_loss, validate
from .training import forward_loss, make_optimizer


# ---- torch-side helpers shared by the parent and the ranks --------------------------------
def fsdp_unit_bytes(model: torch.nn.Module, chain_path: str | None, world_size: int) -> tuple[tuple[int, ...], int]:
    """(padded unsharded parameter bytes of every chain layer, of the root) under ``fully_shard``.

    FSDP2 shards every parameter on dim 0 into ``world_size`` chunks; chunk 0 is the largest,
    and every rank pads its shard to it (``torch.distributed.fsdp._fully_shard._fsdp_param``),
    so a parameter costs ``world_size * ceil(d0 / world_size) * (numel / d0)`` elements
    unsharded (all-gather output) and ``1 / world_size`` of that per rank. Works on meta.
    """
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


# ---- one rank -----------------------------------------------------------------------------
def _rank_main(job: Job) -> None:
    """Entry point of every rank (runs in a process started by the launcher)."""
    rank = int(os.environ["RANK"])
    watchdog = threading.Timer(job.timeout_s, _time_out, args=(job, rank))
    watchdog.daemon = True
    watchdog.start()
    ok = False
    try:
        _rank_run(job, rank)
        ok = True
    except BaseException as err:
        text = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"[:300]
        Path(job.out_dir, f"error{rank}.txt").write_text(text + "\n\n" + traceback.format_exc()[-4000:])
        raise
    finally:
        watchdog.cancel()
        if dist.is_initialized():
            _tear_down(ok)


# Seconds a rank may spend destroying its process group once its results are written.
TEARDOWN_S = 10.0


def _tear_down(ok: bool) -> None:
    """Destroy the process group: after a barrier when the run went well (every rank's
    collectives done), and never for more than ``TEARDOWN_S``: gloo's destructor joins worker
    threads that can wait on a peer that has gone (pytorch/pytorch#75097; one run in two of a
    DDP bench on torch 2.6), and this rank's results are on disk by then, so the process ends."""
    stuck = threading.Timer(TEARDOWN_S, os._exit, args=(0 if ok else 1,))
    stuck.daemon = True
    stuck.start()
    try:
        if ok:
            dist.barrier()
        dist.destroy_process_group()
    finally:
        stuck.cancel()


def _time_out(job: Job, rank: int) -> None:
    """The rank ran past ``timeout_s``: say so and exit; the launcher stops the other ranks."""
    Path(job.out_dir, f"error{rank}.txt").write_text(
        f"TimeoutError: rank {rank} ran past timeout_s={job.timeout_s:g} s and was stopped\n")
    os._exit(1)

def _rank_device(job: Job, rank: int) -> torch.device:
    """This rank's device, its process group up (NCCL on CUDA, gloo on the CPU)."""
    torch.set_num_threads(job.threads)
    if job.device == "cuda":
        local = int(os.environ.get("LOCAL_RANK", rank))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if job.device == "cuda" else "gloo", timeout=timedelta(seconds=job.timeout_s))
    return device


class _Rank:
    """One rank's model, batch and results while it runs the job's plans."""

    def __init__(self, job: Job, rank: int, world: int, device: torch.device, spec: Spec, fault: str | None):
        self.job, self.rank, self.world, self.device, self.spec, self.fault = job, rank, world, device, spec, fault
        self.cuda = device.type == "cuda"
        self.model = build_model(spec, str(device))
        self.wrapped = self.model
        self.args, self.kwargs = (), {}
        self.results: dict[str, dict] = {}
        self.unreproduced = 0.0  # this rank's gradients without checkpointing minus one process's
        self.runnable = []
        for p in job.plans:
            if p.plan is not None:
                self.runnable.append((p.strategy, Plan.from_dict(p.plan)))
                self.results[p.strategy] = {"status": OK}

    def wrap(self, mesh) -> None:
        """FSDP2 on ``mesh``, or DDP when there is none; then this rank's micro-batch."""
        if mesh is not None:
            _fully_shard(self.model, self.spec.chain, mesh, self.spec.parallel.param_dtype,
                         self.spec.parallel.reduce_dtype)
        else:
            ids = [self.device.index] if self.cuda else None
            self.wrapped = torch.nn.parallel.DistributedDataParallel(self.model, device_ids=ids)
        self.args, self.kwargs = make_batch(self.spec, str(self.device), seed=self.spec.seed + self.rank)

    def save(self) -> None:
        Path(self.job.out_dir, f"rank{self.rank}.json").write_text(json.dumps(self.results))

    def step(self, plan: Plan, opt, after_backward=None) -> float:
        # The same step as ckplan.bench: the loss is dropped before the optimizer step.
        with apply_plan(self.model, plan, chain=self.spec.chain):
            loss = forward_loss(self.wrapped, self.args, self.kwargs, to_loss, self.spec.train.precision,
                                self.device.type)
            loss.backward()
            value = float(loss.detach())
            del loss
            if after_backward is not None:
                after_backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return value

    def check_gradients(self, ref) -> None:
        """1. gradients from the initial weights, every plan from the same RNG state (dropout's
        masks), against one process on the global batch; or, where this rank's run without
        checkpointing already differs from that on some rank (dropout or batch statistics draw on
        the batch as a whole, so one process cannot redo the micro-batches), against that run."""
        model, spec = self.model, self.spec
        rtol, atol = grad_tolerance(spec.parallel.param_dtype or spec.train.precision)
        own = None  # this rank's gradients without checkpointing, when they are the reference
        if self.job.check_grads:  # collectives: every rank takes part
            self._backward(None)
            diff, scale = grad_diff(model, ref, self.device)
            worst = torch.tensor([diff / (rtol * scale + atol)], device=self.device)
            dist.all_reduce(worst, op=dist.ReduceOp.MAX)
            if float(worst) > 1.0:
                own = {n: local_part(p.grad).detach().clone() for n, p in model.named_parameters()
                       if p.grad is not None}
                top = torch.tensor([max((float(g.abs().max()) for g in own.values() if g.numel()), default=0.0)],
                                   device=self.device)
                dist.all_reduce(top, op=dist.ReduceOp.MAX)
                own_scale, self.unreproduced = float(top), diff
            model.zero_grad(set_to_none=True)
        for name, plan in self.runnable:
            self.results[name]["loss"] = self._backward(plan)
            if self.fault == "grads":
                local_part(next(p.grad for p in model.parameters() if p.grad is not None)).add_(1.0)
            if self.job.check_grads:
                if own is None:
                    diff, scale = grad_diff(model, ref, self.device)
                else:
                    diff, scale = own_diff(model, own), own_scale
                    self.results[name]["grad_reference"] = OWN_RUN
                    self.results[name]["unreproduced"] = self.unreproduced
                tol = rtol * scale + atol
                self.results[name].update(grad_diff=diff, grad_tol=tol, grad_ok=diff <= tol)
            model.zero_grad(set_to_none=True)

    def _backward(self, plan: Plan | None) -> float:
        """One forward and backward of ``plan`` (None: no checkpointing) from this rank's seed."""
        torch.manual_seed(self.spec.seed + self.rank)
        with contextlib.nullcontext() if plan is None else apply_plan(self.model, plan, chain=self.spec.chain):
            loss = forward_loss(self.wrapped, self.args, self.kwargs, to_loss, self.spec.train.precision,
                                self.device.type)
            loss.backward()
        return float(loss.detach())

    def measure(self, opt, tracker: RankTracker | None) -> None:
        """2. one memory step per strategy (after the warm-up)."""
        for name, plan in self.runnable:
            if self.job.fail_rank == self.rank:
                raise ModelRunError(f"rank {self.rank} was told to fail (fail_rank={self.rank})",
                                    tip="fail_rank is a fault injection for tests: leave it None")
            fb: dict[str, int] = {}

            def mark(fb=fb):  # the forward+backward peak, before the optimizer step
                fb.setdefault("peak", int(torch.cuda.max_memory_allocated(self.device)) if self.cuda
                              else tracker.peak)

            if self.cuda:
                torch.cuda.synchronize(self.device)
                torch.cuda.reset_peak_memory_stats(self.device)
                self.step(plan, opt, mark)
                self.results[name]["measured"] = int(torch.cuda.max_memory_allocated(self.device))
            else:
                tracker.reset_peak()
                if self.job.kind == "fsdp" and self.job.cross_check:
                    self.results[name]["torch_tracker"] = self._torch_tracker_step(plan, opt, mark)
                else:
                    self.step(plan, opt, mark)
                self.results[name]["measured"] = tracker.peak
            self.results[name]["fwd_bwd"] = fb["peak"]
            self.save()

    def _torch_tracker_step(self, plan: Plan, opt, mark) -> int:
        """PyTorch's own FSDP2 tracker on the same step, nested in ours: both see every op and
        every storage resize; its peak."""
        from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker  # private, newer torch only
        fmt = FSDPMemTracker(self.model, opt)
        fmt.track_inputs(tuple(self.args) + tuple(self.kwargs.values()))
        with fmt:
            self.step(plan, opt, mark)
        snap = fmt.get_tracker_snapshot("peak")
        return int(sum(d.get("Total", 0) for d in snap.values()))

    def time_steps(self, opt) -> None:
        """3. timed steps, strategies interleaved."""
        clock = Clock(self.device)
        for _ in range(self.job.steps):
            for name, plan in self.runnable:
                dist.barrier()
                t0 = clock.now_ms()
                self.step(plan, opt)
                self.results[name].setdefault("times", []).append(clock.now_ms() - t0)


def _rank_run(job: Job, rank: int) -> None:
    world = int(os.environ["WORLD_SIZE"])
    device = _rank_device(job, rank)
    fault = _test_fault(rank)
    if fault == "hold":
        Path(job.out_dir, f"held{rank}").touch()
        time.sleep(3600)
    elif fault == "exit":
        os._exit(9)
    spec = validate(job.spec)
    ref = reference_grads(spec, world, device) if job.check_grads and rank == 0 else None
    dist.barrier()
    mesh = None
    if job.kind == "fsdp":
        # Made before the tracker starts: the mesh's rank tensor is infrastructure, not model.
        from torch.distributed.device_mesh import init_device_mesh  # torch builds without distributed lack it
        mesh = init_device_mesh(device.type, (world,))
    tracker = None
    if device.type != "cuda":
        tracker = RankTracker(limit_bytes=job.memory_limit_bytes)
        tracker.__enter__()
    try:
        me = _Rank(job, rank, world, device, spec, fault)
        me.wrap(mesh)
        me.check_gradients(ref)
        ref = None
        gc.collect()
        me.save()
        opt = make_optimizer(me.model.parameters(), spec.train.optimizer, spec.train.lr, device.type)
        for _ in range(max(job.warmup, 1)):
            for _name, plan in me.runnable:
                me.step(plan, opt)
        me.measure(opt, tracker)
        if tracker is not None:
            tracker.__exit__(None, None, None)
            tracker = None
        me.time_steps(opt)
        me.save()
        gathered = [None] * world if rank == 0 else None
        dist.gather_object(me.results, gathered, dst=0)
        if rank == 0:
            Path(job.out_dir, "gathered.json").write_text(json.dumps(gathered))
    finally:
        if tracker is not None:
            tracker.__exit__(None, None, None)


def _fully_shard(model, chain_path: str | None, mesh, param_dtype: str | None = None,
                 reduce_dtype: str | None = None) -> None:
    """FSDP2: ``fully_shard`` every chain layer (one unit each), then the root; with
    ``param_dtype``, under that MixedPrecisionPolicy (reducing in ``reduce_dtype``, default fp32)."""
    from torch.distributed.fsdp import fully_shard  # torch builds without distributed lack it
    _, container, _ = resolve_chain(model, chain_path)
    layers = list(container)
    kw = {}
    if param_dtype is not None:  # parallel.param_dtype: torchtitan's policy, fp32 reduce-scatter by default
        from torch.distributed.fsdp import MixedPrecisionPolicy
        reduce = torch.float32 if reduce_dtype in (None, "fp32") else DTYPES[reduce_dtype]
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=DTYPES[param_dtype], reduce_dtype=reduce)
    for layer in layers:
        fully_shard(layer, mesh=mesh, **kw)
    fully_shard(model, mesh=mesh, **kw)
    # FSDP2's default backward prefetch (the unit that ran before, by the order of forward
    # calls) is made explicit: a checkpointed layer is called twice in forward (by the model,
    # then inside the checkpoint), which would make the default prefetch pick the layer itself.
    for prev, layer in zip(layers, layers[1:]):
        layer.set_modules_to_backward_prefetch([prev])


def _test_fault(rank: int) -> str | None:
    """This rank's fault from ``CKPLAN_TEST_FAULT`` (module doc), or None."""
    what, _, who = os.environ.get("CKPLAN_TEST_FAULT", "").partition(":")
    if what == "hold" or (what in ("exit", "grads") and who.strip() == str(rank)):
        return what
    return None

