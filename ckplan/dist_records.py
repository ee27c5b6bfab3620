"""What a distributed bench sends to its ranks and gets back: the job every rank runs
(:class:`Job`, one :class:`RankPlan` per strategy), one strategy on one rank (:class:`RankRow`)
and the whole run (:class:`DistBenchResult`), with the statuses and the gradient tolerance.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any

from .bench_records import GRAD_TOLERANCES, OVER_BUDGET, over_budget

OK, OOM, INFEASIBLE, ERROR = "ok", "OOM", "infeasible", "error"
GRAD_RTOL = 1e-5  # of the largest reference gradient; fp32 reduction order, see ckplan.distributed
GRAD_ATOL = 1e-7
ONE_PROCESS, OWN_RUN = "one process", "own run"  # what a rank's gradients are judged against


def grad_tolerance(precision: str) -> tuple[float, float]:
    """(rtol, atol) of a rank's gradient check: fp32's reduction-order bound, or under autocast the
    one-process bench's (two units in the last place of bf16 / fp16)."""
    if precision in ("bf16", "fp16"):
        return GRAD_TOLERANCES[precision]
    return GRAD_RTOL, GRAD_ATOL


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
    grad_ok: bool | None  # within grad_tolerance(precision)
    message: str = ""
    torch_tracker_peak_bytes: int | None = None  # FSDPMemTracker's peak of the same step (cross_check)
    # ONE_PROCESS (the global batch on one process), or OWN_RUN: this rank's run without
    # checkpointing, where one process could not reproduce the ranks' (``unreproduced``: by how much)
    grad_reference: str = ONE_PROCESS
    unreproduced: float | None = None

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
        import pandas as pd  # optional: only for the frame, which the ranks never build
        return pd.DataFrame([r.to_dict() for r in self.rows])


# ---- the parent: profile, plan, launch, collect --------------------------------------------
@dataclass(frozen=True)
class RankPlan:
    """One strategy's per-rank plan as the ranks receive it."""

    strategy: str
    plan: dict | None  # Plan.to_dict(); None where the budget admits no plan (``message`` says why)
    predicted_peak_bytes: int | None  # per-rank model, whole step
    predicted_fwd_bwd_peak_bytes: int | None  # forward + backward only
    message: str = ""


@dataclass(frozen=True)
class Job:
    """What every rank runs: the spec, the plans, and how."""

    spec: dict
    kind: str
    plans: tuple[RankPlan, ...]
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

