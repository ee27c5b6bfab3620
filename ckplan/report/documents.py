"""The JSON documents ckplan prints and writes: an envelope (schema version, command) around each
command's body."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..records import SCHEMA_VERSION, Profile


def envelope(command: str, body: dict[str, Any]) -> dict[str, Any]:
    """Every JSON document ckplan prints: schema_version and command first, then the body."""
    return {"schema_version": SCHEMA_VERSION, "command": command, **body}


def to_json(doc: dict[str, Any]) -> str:
    return json.dumps(doc, indent=2, sort_keys=False, default=_default) + "\n"


def _default(o):
    if hasattr(o, "to_dict"):
        return o.to_dict()
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"{type(o).__name__} is not JSON-serialisable")


def profile_doc(prof: Profile) -> dict[str, Any]:
    return envelope("profile", prof.to_dict())


def plan_doc(rep) -> dict[str, Any]:
    """The JSON document of ``ckplan plan`` (a ckplan.plan_report.PlanReport)."""
    c = rep.chosen
    prof = rep.profile
    return envelope("plan", {
        "model": prof.model, "device": prof.device, "chain": prof.chain,
        "n_layers": len(prof.chain_layers), "batch_size": prof.batch_size,
        "precision": prof.precision, "param_dtype": prof.param_dtype,
        "reduce_dtype": prof.reduce_dtype, "optimizer": prof.optimizer,
        "accum": prof.accum, "world_size": rep.world_size, "parallel": rep.parallel,
        "strategy": c.strategy, "budget_bytes": rep.budget_bytes,
        "budget_source": rep.budget_source,
        "fits": c.fits, "predicted_peak_bytes": c.score.peak_bytes,
        "predicted_recompute_ms": c.score.recompute_ms, "predicted_transfer_ms": c.score.transfer_ms,
        "predicted_overhead": c.score.overhead, "predicted_step_ms": c.score.step_ms, "peak_at": c.score.peak_at,
        "persistent_bytes": c.score.persistent_bytes, "no_checkpoint_peak_bytes": rep.none_peak_bytes,
        "slot_bytes": c.slot_bytes, "exact": c.exact, "notes": list(rep.notes) + list(c.notes),
        "infeasible": rep.infeasible,
        "layers": [dict(index=d.layer, name=prof.chain_layers[d.layer].name, stored=d.stored,
                        checkpoint_depth=d.depth, forward_runs=d.forwards, option=o)
                   for d, o in zip(c.plan.per_layer(), c.plan.options())],
        "plan": c.plan.to_dict(),
        "strategies": rep.summary_rows(),
    })


def sweep_doc(prof: Profile, points, files) -> dict[str, Any]:
    """The JSON document of ``ckplan plan --sweep``."""
    return envelope("plan-sweep", {"model": prof.model, "device": prof.device,
                                   "files": [str(f) for f in files],
                                   "points": [p.to_dict() for p in points]})


def world_size_doc(prof: Profile, rows) -> dict[str, Any]:
    """The JSON document of ``ckplan plan --world-size 8,16,...``: one row per world size, per rank."""
    return envelope("plan-world-sizes", {"model": prof.model, "device": prof.device,
                                         "batch_size": prof.batch_size, "optimizer": prof.optimizer,
                                         "rows": [r.to_dict() for r in rows]})


def dist_bench_doc(result) -> dict[str, Any]:
    """The JSON document of ``ckplan bench --nproc N``: one row per strategy and rank."""
    return envelope("bench-distributed", result.to_dict())


def bench_doc(result) -> dict[str, Any]:
    return envelope("bench", result.to_dict())
