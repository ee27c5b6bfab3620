"""The result of ``ckplan plan``: plain data plus its JSON document and tables (no rich here)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .planner import PlanResult
from .records import Profile
from .report import plan_doc


@dataclass(frozen=True)
class PlanReport:
    profile: Profile
    budget_bytes: int | None
    budget_source: str
    strategy: str  # as asked: one strategy or "all"
    k: int
    results: tuple[PlanResult, ...]
    chosen: PlanResult
    none_peak_bytes: int
    none_step_ms: float
    infeasible: str | None = None  # --strategy all below the smallest peak: why (the CLI exits 3)
    notes: tuple[str, ...] = ()  # e.g. why no plan can lower the peak
    infeasible_tip: str | None = None
    world_size: int = 1  # > 1: the plan, the budget and every peak are for one rank of ``parallel``
    parallel: str | None = None  # fsdp | ddp when world_size > 1

    def summary_rows(self) -> list[dict[str, Any]]:
        rows = []
        for r in self.results:
            rows.append(dict(
                strategy=r.strategy, predicted_peak_bytes=r.score.peak_bytes,
                saved_bytes=self.none_peak_bytes - r.score.peak_bytes,
                saved_fraction=(self.none_peak_bytes - r.score.peak_bytes) / self.none_peak_bytes,
                predicted_recompute_ms=r.score.recompute_ms, predicted_transfer_ms=r.score.transfer_ms,
                predicted_overhead=r.score.overhead, fits=r.fits, n_checkpoints=r.plan.n_checkpoints,
                peak_at=r.score.peak_at,
                plan=r.plan.describe()))
        return rows

    def to_frame(self):
        """One row per strategy (the CSV of ``ckplan plan``)."""
        import pandas as pd  # optional: only for the CSV output; the plan itself never needs it
        return pd.DataFrame(self.summary_rows())

    def to_doc(self) -> dict[str, Any]:
        """The JSON document of ``ckplan plan`` (built in ckplan.report, with the others)."""
        return plan_doc(self)
