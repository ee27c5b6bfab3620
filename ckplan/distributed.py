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
   magnitude: ``max |g - g_ref| <= GRAD_RTOL * max |g_ref| + GRAD_ATOL``; under autocast (bf16,
   fp16) the one-process bench's tolerance (``dist_records.grad_tolerance``). Every backward
   starts from the rank's seed. Where the rank's run without checkpointing already differs from
   one process's on some rank (dropout draws other masks for the global batch, batch norm other
   statistics), every row is judged against that run instead (``OWN_RUN``, with a note);
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

The rank side is :mod:`ckplan.dist_rank`, the job and the rows :mod:`ckplan.dist_records`.

Known limitations: one node; gloo collectives' internal buffers are not seen by the CPU tracker
(only tensors made by ops are); ``accum`` > 1 is not supported.
"""
from __future__ import annotations

import contextlib
import os
import socket
import sys
import tempfile
from dataclasses import replace

import torch

from . import launch
from .bench_records import above_budget_note
from .dist_rank import RankTracker, _rank_main, fsdp_unit_bytes  # noqa: F401  (RankTracker re-exported)
from .dist_records import (  # noqa: F401  (re-exported)
    ERROR,
    GRAD_ATOL,
    GRAD_RTOL,
    INFEASIBLE,
    OK,
    ONE_PROCESS,
    OOM,
    OWN_RUN,
    DistBenchResult,
    Job,
    RankPlan,
    RankRow,
    mark_over_budget,
)
from .dist_rows import collect_rows as _collect
from .dist_rows import read_error as _read_error
from .errors import InfeasibleBudgetError, UsageError
from .param_dtype import policy_text
from .planner import Plan, chain_from_profile, min_peak, plan_chain, plan_none, simulate
from .planner.parallel import KINDS, param_dtype_ratio, per_rank_chain, per_rank_chain_from_profile, reduce_dtype_ratio
from .planner.simulate import forward_backward_peak
from .preflight import available_memory
from .records import Profile
from .spec import Spec, build_model
from .units import format_bytes


def bench_distributed(spec: Spec, *, profile: Profile, device: str = "cpu", nproc: int = 2, kind: str = "fsdp",
                      strategies: list[str] | None = None, budget_bytes: int | None = None, k: int = 2,
                      steps: int = 3, warmup: int = 1, timeout_s: float = 300.0, check_grads: bool = True,
                      memory_limit_bytes: int | None = None, fail_rank: int | None = None, threads: int = 1,
                      start_method: str | None = None, isolate: bool | None = None,
                      cross_check: bool = False, force: bool = False,
                      machine_notes: list[str] | None = None) -> DistBenchResult:
    """Plan per rank and run ``nproc`` ranks under ``kind`` (``fsdp`` | ``ddp``); see the module doc.

    ``spec``: the loaded spec; ``profile``: its model profiled on one process (one rank's
    micro-batch) on ``device`` ("cpu": gloo, "cuda": NCCL), as :func:`ckplan.api.profile` makes it.
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
    ``machine_notes``: what :func:`check_world` said, when the caller has checked the machine.
    """
    strategies = list(strategies or ["none", "every-k", "dp"])
    check_run(spec, nproc, kind, device)
    if machine_notes is None:
        machine_notes = check_world(nproc, device, force=force)
    if device == "cuda":
        torch.cuda.empty_cache()  # the profile's blocks would stay reserved beside the ranks
    chain = rank_chain(profile, spec, nproc, kind)
    ranks = f"{nproc} rank{'s' if nproc != 1 else ''}"
    notes = [f"{kind} on {ranks}; every chain layer is one FSDP unit, the root holds the rest"
             if kind == "fsdp" else f"ddp on {ranks} (bucket_cap_mb 25, gradient_as_bucket_view off)",
             f"each rank runs its own micro-batch of {profile.batch_size} (global batch "
             f"{profile.batch_size * nproc})", *machine_notes]
    notes += _precision_notes(profile, chain, kind)
    explicit = budget_bytes  # a row predicted to fit it that measures above it is over-budget
    if budget_bytes is None and {"dp", "chen"} & set(strategies):
        lo, hi = min_peak(chain), plan_chain(chain, "none").score.peak_bytes
        budget_bytes = (lo + hi) // 2
        notes.append(f"no budget: dp and chen planned per rank for {format_bytes(budget_bytes)}, halfway "
                     f"between the smallest feasible peak ({format_bytes(lo)}) and the peak without "
                     f"checkpointing ({format_bytes(hi)})")
    plans = _plans(chain, strategies, budget_bytes, k)
    runnable = [p for p in plans if p.plan is not None]
    if runnable and device == "cpu":  # on CUDA every rank has a GPU of its own
        notes += launch.check_rank_memory(
            _rank_bytes(profile, nproc, max(p.predicted_peak_bytes or 0 for p in runnable), check_grads),
            available_memory(torch.device(device)), device=device, force=force)
    if isolate is None:
        isolate = memory_limit_bytes is not None
    job = Job(spec=spec.model_dump(mode="json"), kind=kind, plans=(), steps=steps, warmup=warmup, device=device,
              timeout_s=float(timeout_s), out_dir="", check_grads=check_grads,
              memory_limit_bytes=memory_limit_bytes, fail_rank=fail_rank, threads=threads,
              start_method=start_method or _default_start_method(device), cross_check=cross_check)
    rows = _run_groups(job, nproc, [[p] for p in plans] if isolate else [plans], isolate, notes)
    unreproduced = [r.unreproduced for r in rows if r.grad_reference == OWN_RUN and r.unreproduced is not None]
    if unreproduced:
        notes.append(f"gradients judged against each rank's own run without checkpointing, from the same "
                     f"seed: one process on the global batch cannot redo the micro-batches' (dropout or "
                     f"batch statistics; the ranks' runs without checkpointing differ from it by up to "
                     f"{max(unreproduced):.3g})")
    single = simulate(_single_chain(profile), _none(profile)).peak_bytes
    rows = mark_over_budget(rows, explicit)
    above = above_budget_note(rows, explicit, format_bytes, "the per-rank --budget")
    if above:
        notes.append(above)
    return DistBenchResult(model=profile.model, kind=kind, world_size=nproc,
                           backend="nccl" if device == "cuda" else "gloo", device=device,
                           batch_size=profile.batch_size, optimizer=profile.optimizer, budget_bytes=budget_bytes,
                           k=k, steps=steps, warmup=warmup, rows=tuple(rows),
                           single_process_peak_bytes=single, notes=tuple(notes))


def _precision_notes(profile: Profile, chain, kind: str) -> list[str]:
    """What the ranks' mixed precision is: FSDP2's policy, or autocast and the copies it caches."""
    if profile.param_dtype is not None:
        return [f"FSDP2's {policy_text(profile.param_dtype, profile.reduce_dtype)} on every "
                f"unit; one process's reference gradients computed in {profile.param_dtype} as well"]
    if profile.precision == "fp32":
        return []
    if kind != "fsdp":
        return [f"{profile.precision} autocast on every rank"]
    casts = chain.pre.cast_bytes + sum(ly.cast_bytes for ly in chain.layers)
    return [f"{profile.precision} autocast: each rank keeps autocast's copies of the weights it all-gathers to "
            f"the end of the forward ({format_bytes(casts)} of the chain's), unsharded as on one process; "
            "parallel.param_dtype runs FSDP2's MixedPrecisionPolicy instead"]


def check_run(spec: Spec, nproc: int, kind: str, device: str) -> None:
    """Refuse, before any profile, a distributed bench that cannot run: an unknown ``kind``, no
    ranks, the meta device, gradient accumulation, or a kind this torch cannot run there."""
    if kind not in KINDS:
        raise UsageError(f"--parallel {kind!r} is not one of {', '.join(KINDS)}")
    if not isinstance(nproc, int) or nproc < 1:
        raise UsageError(f"--nproc {nproc!r} must be a positive integer")
    if device == "meta":
        raise UsageError("a distributed bench runs real steps; --device meta cannot run them",
                         tip="use --device cpu (gloo) or cuda (NCCL)")
    if spec.train.accum != 1:
        raise UsageError(f"train.accum {spec.train.accum} is not supported by the distributed bench",
                         tip="set train.accum: 1")
    if spec.parallel.param_dtype is not None and kind != "fsdp":
        raise UsageError(f"parallel.param_dtype {spec.parallel.param_dtype} is FSDP2's MixedPrecisionPolicy, which "
                         f"--parallel {kind} does not have", tip="--parallel fsdp")
    check_kind(kind, device)


def _plans(chain, strategies: list[str], budget_bytes: int | None, k: int) -> list[RankPlan]:
    """Each strategy's per-rank plan, or why it could not be planned."""
    plans = []
    for s in strategies:
        try:
            res = plan_chain(chain, s, budget_bytes, k)
            plans.append(RankPlan(s, res.plan.to_dict(), res.score.peak_bytes, forward_backward_peak(chain, res.plan)))
        except InfeasibleBudgetError as err:
            plans.append(RankPlan(s, None, None, None, err.message))
    return plans


def _run_groups(job: Job, nproc: int, groups: list[list[RankPlan]], isolate: bool, notes: list[str]) -> list[RankRow]:
    """Run each group of plans on ``nproc`` ranks in a temporary folder of its own; their rows."""
    rows: list[RankRow] = []
    # From the first temporary folder to the last one's removal, a signal only sets a flag: the
    # ranks are ended and the folder removed before Interrupted is raised.
    with launch.caught_signals(f"bench on {nproc} ranks"):
        for group in groups:
            with tempfile.TemporaryDirectory(prefix="ckplan-dist-", ignore_cleanup_errors=True) as out_dir:
                run = replace(job, plans=tuple(group), out_dir=out_dir)
                failure = _launch(run, nproc) if any(p.plan is not None for p in group) else ""
                rows.extend(_collect(run, nproc, failure))
            if failure:
                label = f" ({group[0].strategy})" if isolate else ""
                notes.append(f"the group{label} failed and was torn down: {failure}")
    return rows


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
    if kind != "fsdp" or spec is None:
        return per_rank_chain_from_profile(profile, world_size, kind)
    meta = build_model(spec, "meta")  # in its own dtype: the masters FSDP2 shards
    layers, root = fsdp_unit_bytes(meta, profile.chain, world_size)
    return per_rank_chain(_single_chain(profile), world_size=world_size, kind=kind,
                          layer_param_bytes=layers, root_param_bytes=root,
                          param_dtype_ratio=param_dtype_ratio(profile, kind),
                          reduce_dtype_ratio=reduce_dtype_ratio(profile))


def _single_chain(profile: Profile):
    return chain_from_profile(profile)


def _none(profile: Profile) -> Plan:
    return plan_none(len(profile.chain_layers))


def _default_start_method(device_type: str) -> str:
    if device_type == "cpu" and sys.platform.startswith("linux") and not torch.cuda.is_initialized():
        return "fork"
    return "spawn"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(job: Job, nproc: int) -> str:
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
    start the CLI again in every rank): the ranks only need ``ckplan.dist_rank._rank_main``."""
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
