"""The rows of a distributed bench: what each rank wrote (rank 0's gathered file, or each rank's
own after a failure) turned into one :class:`RankRow` per strategy and rank."""
from __future__ import annotations

import json
import statistics
from pathlib import Path

from .bench_records import WRONG_GRADIENTS, peak_error
from .dist_records import ERROR, INFEASIBLE, ONE_PROCESS, OOM, Job, RankRow
from .planner import Plan


def read_error(out_dir: str, rank: int) -> str:
    p = Path(out_dir) / f"error{rank}.txt"
    return p.read_text().strip() if p.is_file() else ""


def collect_rows(job: Job, nproc: int, failure: str) -> tuple[RankRow, ...]:
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
    for p in job.plans:
        name, pred, pred_fb = p.strategy, p.predicted_peak_bytes, p.predicted_fwd_bwd_peak_bytes
        plan_text = Plan.from_dict(p.plan).describe() if p.plan else ""
        for r in range(nproc):
            got = per_rank.get(r, {}).get(name)
            if p.plan is None:
                rows.append(RankRow(name, r, INFEASIBLE, "", None, None, None, None, None, None, None,
                                    None, None, p.message))
                continue
            got = got or {}
            status, message = got.get("status", ERROR), got.get("message", "")
            if failure or "measured" not in got:
                # The group did not finish: what was measured before the failure is kept.
                own = read_error(job.out_dir, r).split("\n")[0]
                status = OOM if ("TrackerLimitExceeded" in own or "OutOfMemory" in own) else ERROR
                message = (own or failure or "no result from this rank")[:300]
            elif got.get("grad_ok") is False:
                status = WRONG_GRADIENTS
                whose = ("one process's" if got.get("grad_reference", ONE_PROCESS) == ONE_PROCESS
                         else "its own run's without checkpointing")
                message = (f"this rank's gradients differ from {whose} by {got['grad_diff']:.3g}, "
                           f"over the tolerance {got['grad_tol']:.3g}")
            meas, fb = got.get("measured"), got.get("fwd_bwd")
            times = got.get("times") or []
            rows.append(RankRow(
                name, r, status, plan_text, pred, meas, peak_error(pred, meas),
                pred_fb, fb, statistics.median(times) if times else None, got.get("loss"),
                got.get("grad_diff"), got.get("grad_ok"), message, got.get("torch_tracker"),
                got.get("grad_reference", ONE_PROCESS), got.get("unreproduced")))
    return tuple(rows)

