"""The result of ``ckplan plan``: plain data plus its JSON document and tables (no rich here)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .planner import PlanResult
from .records import Profile
from .report import envelope


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

    def summary_rows(self) -> list[dict[str, Any]]:
        rows = []
        for r in self.results:
            rows.append(dict(
                strategy=r.strategy, predicted_peak_bytes=r.score.peak_bytes,
                saved_bytes=self.none_peak_bytes - r.score.peak_bytes,
                saved_fraction=(self.none_peak_bytes - r.score.peak_bytes) / self.none_peak_bytes,
                predicted_recompute_ms=r.score.recompute_ms, predicted_overhead=r.score.overhead,
                fits=r.fits, n_checkpoints=r.plan.n_checkpoints, peak_at=r.score.peak_at,
                plan=r.plan.describe()))
        return rows

    def to_frame(self):
        """One row per strategy (the CSV of ``ckplan plan``)."""
        import pandas as pd
        return pd.DataFrame(self.summary_rows())

    def to_doc(self) -> dict[str, Any]:
        c = self.chosen
        prof = self.profile
        return envelope("plan", {
            "model": prof.model, "device": prof.device, "chain": prof.chain,
            "n_layers": len(prof.chain_layers), "batch_size": prof.batch_size,
            "precision": prof.precision, "optimizer": prof.optimizer, "accum": prof.accum,
            "strategy": c.strategy, "budget_bytes": self.budget_bytes, "budget_source": self.budget_source,
            "fits": c.fits, "predicted_peak_bytes": c.score.peak_bytes,
            "predicted_recompute_ms": c.score.recompute_ms, "predicted_overhead": c.score.overhead,
            "predicted_step_ms": c.score.step_ms, "peak_at": c.score.peak_at,
            "persistent_bytes": c.score.persistent_bytes, "no_checkpoint_peak_bytes": self.none_peak_bytes,
            "slot_bytes": c.slot_bytes, "exact": c.exact, "notes": list(self.notes) + list(c.notes),
            "infeasible": self.infeasible,
            "layers": [dict(index=d.layer, name=prof.chain_layers[d.layer].name, stored=d.stored,
                            checkpoint_depth=d.depth, forward_runs=d.forwards)
                       for d in c.plan.per_layer()],
            "plan": c.plan.to_dict(),
            "strategies": self.summary_rows(),
        })


def sweep_doc(prof: Profile, points, files) -> dict[str, Any]:
    """The JSON document of ``ckplan plan --sweep``."""
    return envelope("plan-sweep", {"model": prof.model, "device": prof.device,
                                   "files": [str(f) for f in files],
                                   "points": [p.to_dict() for p in points]})
