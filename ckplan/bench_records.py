"""Plain, frozen records of a bench run (``ckplan bench``): each strategy's row, its status, and
the run's result. No torch here, as in :mod:`ckplan.records`."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

# A bench row's status. ``wrong-gradients`` and ``non-finite`` are wrong results (the CLI exits 4);
# OOM, infeasible and error are outcomes of the run that the table reports and the bench goes on;
# ``over-budget``: predicted to fit an explicit --budget, measured above it (the CLI exits 3, as
# for a budget no plan meets, once the table and files are written).
OK, OOM, INFEASIBLE, ERROR = "ok", "OOM", "infeasible", "error"
WRONG_GRADIENTS, NON_FINITE = "wrong-gradients", "non-finite"
OVER_BUDGET = "over-budget"
FAILED_STATUSES = (WRONG_GRADIENTS, NON_FINITE)
# (rtol, atol) of the gradient check per precision; the docstring of ckplan.bench says why.
GRAD_TOLERANCES: dict[str, tuple[float, float]] = {"fp32": (1e-5, 1e-8), "bf16": (1.6e-2, 1e-6),
                                                   "fp16": (2e-3, 1e-6)}


def over_budget(predicted: int | None, measured: int | None, budget_bytes: int | None) -> bool:
    """A row predicted to fit ``budget_bytes`` (an explicit budget) that measured above it."""
    return (budget_bytes is not None and predicted is not None and measured is not None
            and predicted <= budget_bytes < measured)


def above_budget_note(rows, budget_bytes: int | None, fmt, what: str = "--budget") -> str | None:
    """The note for rows not planned to an explicit budget (none, every-k, sqrtn, peers) that
    measured above it: said, not failed. ``rows``: bench or per-rank rows (the highest rank's peak
    per strategy); ``fmt``: bytes as text."""
    if budget_bytes is None:
        return None
    worst: dict[str, int] = {}
    for r in rows:
        if r.status == OK and r.measured_peak_bytes is not None and r.measured_peak_bytes > budget_bytes:
            worst[r.strategy] = max(worst.get(r.strategy, 0), r.measured_peak_bytes)
    if not worst:
        return None
    return (f"measured above {what} {fmt(budget_bytes)}: "
            + ", ".join(f"{name} ({fmt(m)}, +{m / budget_bytes - 1:.1%})" for name, m in worst.items())
            + "; they do not fit it")


def peak_error(predicted: int | None, measured: int | None) -> float | None:
    """``|measured - predicted| / predicted``: how far the measurement is from the prediction, as
    a share of the prediction ("predicted 1.0 GB, measured 12.6% more")."""
    return abs(measured - predicted) / predicted if measured is not None and predicted else None


@dataclass(frozen=True)
class BenchRow:
    """One strategy measured: predicted and measured peaks, time, and the gradient check."""

    strategy: str
    status: str  # ok | OOM | infeasible | error | wrong-gradients | non-finite | over-budget
    plan: str  # Plan.describe()
    n_checkpoints: int
    predicted_peak_bytes: int | None
    measured_peak_bytes: int | None
    peak_error: float | None  # |measured - predicted| / predicted (records.peak_error)
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
    grad_tolerance: float | None = None  # the bound max_grad_diff was judged against (see ckplan.bench)
    # CPU only: the memory step's live-tensor peak above the tensors resident when it began, and the
    # process's resident set (Linux VmHWM) over the same step: its high-water mark and its growth.
    measured_growth_bytes: int | None = None
    measured_rss_peak_bytes: int | None = None
    measured_rss_growth_bytes: int | None = None
    kind: str = "ckplan"  # "ckplan" or "peer" (ckplan.peers: hf, sac-policy)
    # Paired per-round ratios step / step(none) (timed rounds are interleaved); when they straddle 1
    # the difference from none is inside the timing noise (ckplan.bench.within_noise).
    slowdown_within_noise: bool = False
    slowdown_ratio_min: float | None = None
    slowdown_ratio_max: float | None = None
    offload_release: str = ""  # offloading plans: each offloaded layer's release and fetch points, "0:3:1 1:5:2"

    @property
    def failed(self) -> bool:
        """A wrong result: the plan changed the math, or the step produced NaN/inf."""
        return self.status in FAILED_STATUSES

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class FrontierPoint:
    """One point of a predicted memory/time frontier plotted beside the measured rows."""

    strategy: str  # dp, or dp-layer (whole layers only) when the chain has selective options
    peak_bytes: int
    slowdown: float  # predicted step time over the step time without checkpointing

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


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
    # dp's points at evenly spaced budgets (and dp-layer's with selective options): the predicted
    # frontier, plotted beside the measured rows.
    frontier: tuple[FrontierPoint, ...] = field(default=())
    compiled: bool = False  # --compile: ckplan's rows ran compiled ("layers": each chain layer; "model": whole)
    compile_scope: str = "layers"

    @property
    def device_tag(self) -> str:
        """The device in file names: ``cpu``, ``cpu-compiled`` or ``cpu-compiled-model``."""
        return f"{self.device}-compiled{'-model' * (self.compile_scope == 'model')}" if self.compiled else self.device

    @property
    def failed_rows(self) -> tuple[BenchRow, ...]:
        """Rows whose results are wrong (``wrong-gradients``, ``non-finite``): the CLI exits 4."""
        return tuple(r for r in self.rows if r.failed)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["rows"] = [r.to_dict() for r in self.rows]
        d["notes"] = list(self.notes)
        d["frontier"] = [p.to_dict() for p in self.frontier]
        return d
