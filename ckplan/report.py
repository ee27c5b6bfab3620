"""Machine-readable outputs: JSON envelopes, DataFrames, CSV/PNG files written atomically."""
from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .errors import UsageError
from .records import SCHEMA_VERSION, Profile


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


def profile_frame(prof: Profile):
    import pandas as pd
    return pd.DataFrame([r.to_dict() for r in prof.layers])


def atomic_write(path: str | Path, write: Callable[[Path], None]) -> Path:
    """Write via a temporary file in the same folder and rename: complete files or none."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UsageError(f"cannot create folder {str(path.parent)!r}: {e.strerror}") from None
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(Path(tmp))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def write_text(path: str | Path, text: str) -> Path:
    return atomic_write(path, lambda p: p.write_text(text))


def write_csv(path: str | Path, frame) -> Path:
    return atomic_write(path, lambda p: frame.to_csv(p, index=False))


# ---- plan sweep and bench files --------------------------------------------------------------

def _slug(text: str) -> str:
    import re
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", text).strip("-") or "model"


def sweep_frame(points):
    import pandas as pd
    return pd.DataFrame([p.to_dict() for p in points])


def write_sweep(out_dir: str | Path, model: str, points) -> list[Path]:
    """CSV and PNG of every strategy's memory-vs-overhead frontier."""
    frame = sweep_frame(points)
    base = Path(out_dir) / f"sweep-{_slug(model)}"
    return [write_csv(base.with_suffix(".csv"), frame),
            atomic_write(base.with_suffix(".png"), lambda p: _plot_sweep(frame, model, p))]


def _plot_sweep(frame, model: str, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    marks = {"chen": ("s", 6), "every-k": ("^", 7), "sqrtn": ("D", 8), "none": ("*", 12)}
    for strategy, g in frame.groupby("strategy", sort=False):
        g = g.sort_values("peak_bytes")
        x, y = g["peak_bytes"] / 2**30, g["overhead"] * 100
        if strategy == "dp":
            # dp's frontier is a step function: a budget between two points gets the left one's plan.
            ax.step(x, y, where="post", color="tab:purple", lw=1.5, label="dp (optimal)", zorder=1)
            ax.plot(x, y, "o", color="tab:purple", markersize=2.5, zorder=1)
        else:
            m, size = marks.get(strategy, ("o", 5))
            ax.plot(x, y, m, markersize=size, markerfacecolor="none", markeredgewidth=1.3,
                    label=strategy, zorder=2)
    ax.set_xlabel("predicted peak memory (GiB)")
    ax.set_ylabel("predicted recompute overhead (% of a step)")
    ax.set_title(f"{model}: memory vs recompute, every strategy")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=110)
    plt.close(fig)


def bench_doc(result) -> dict[str, Any]:
    return envelope("bench", result.to_dict())


def bench_frame(result):
    import pandas as pd
    return pd.DataFrame([r.to_dict() for r in result.rows])


def write_bench(out_dir: str | Path, result) -> list[Path]:
    """bench-<model>-<device>.{csv,json,png}, each written atomically."""
    base = Path(out_dir) / f"bench-{_slug(result.model)}-{result.device}"
    frame = bench_frame(result)
    return [write_csv(base.with_suffix(".csv"), frame),
            write_text(base.with_suffix(".json"), to_json(bench_doc(result))),
            atomic_write(base.with_suffix(".png"), lambda p: _plot_bench(result, p))]


def _plot_bench(result, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = list(result.rows)
    names = [r.strategy for r in rows]
    x = range(len(rows))
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    w = 0.38
    a.bar([i - w / 2 for i in x], [(r.predicted_peak_bytes or 0) / 2**30 for r in rows], w, label="predicted")
    a.bar([i + w / 2 for i in x], [(r.measured_peak_bytes or 0) / 2**30 for r in rows], w, label="measured")
    if result.budget_bytes:
        a.axhline(result.budget_bytes / 2**30, color="k", ls="--", lw=1, label="budget")
    a.set_xticks(list(x), names, rotation=20)
    a.set_ylabel("peak memory (GiB)")
    a.set_title("peak memory per step")
    a.legend()
    b.bar([i - w / 2 for i in x], [1 + (r.predicted_overhead or 0) for r in rows], w, label="predicted")
    b.bar([i + w / 2 for i in x], [r.slowdown or 0 for r in rows], w, label="measured")
    b.axhline(1.0, color="k", lw=0.8)
    b.set_xticks(list(x), names, rotation=20)
    b.set_ylabel("step time / step time without checkpointing")
    b.set_title("slowdown")
    b.legend()
    fig.suptitle(f"{result.model} on {result.device_name}, batch {result.batch_size}, {result.precision}")
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=110)
    plt.close(fig)
