"""The PNG figures: the plan sweep's frontier, the bench's predicted vs measured bars and its
memory-vs-slowdown frontier (matplotlib, imported when a figure is drawn)."""
from __future__ import annotations

from pathlib import Path


def plot_sweep(frame, model: str, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    marks = {"chen": ("s", 6), "every-k": ("^", 7), "sqrtn": ("D", 8), "none": ("*", 12)}
    unit, scale = ("GiB", 2**30) if len(frame) and frame["peak_bytes"].max() >= 2**30 else ("MiB", 2**20)
    for strategy, g in frame.groupby("strategy", sort=False):
        g = g.sort_values("peak_bytes")
        x, y = g["peak_bytes"] / scale, g["overhead"] * 100
        if strategy == "dp":
            # dp's frontier is a step function: a budget between two points gets the left one's plan.
            ax.step(x, y, where="post", color="tab:purple", lw=1.5, label="dp (optimal)", zorder=1)
            ax.plot(x, y, "o", color="tab:purple", markersize=2.5, zorder=1)
        else:
            m, size = marks.get(strategy, ("o", 5))
            ax.plot(x, y, m, markersize=size, markerfacecolor="none", markeredgewidth=1.3,
                    label=strategy, zorder=2)
    ax.set_xlabel(f"predicted peak memory ({unit})")
    ax.set_ylabel("predicted recompute overhead (% of a step)")
    ax.set_title(f"{model}: memory vs recompute, every strategy")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=110)
    plt.close(fig)


def plot_frontier(result, path: Path) -> None:
    """Memory vs slowdown: the planner's predicted dp frontier (a step curve; dp-layer's too
    when the profile has selective options), each row's predicted point (hollow) and measured
    point (filled), peers measured only."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    rows = [r for r in result.rows if r.measured_peak_bytes and r.slowdown]
    peaks = [r.measured_peak_bytes for r in rows] + [p.peak_bytes for p in result.frontier]
    unit, scale = ("GiB", 2**30) if peaks and max(peaks) >= 2**30 else ("MiB", 2**20)
    has_options = any(p.strategy == "dp-layer" for p in result.frontier)
    styles = {"dp": ("tab:purple", "-", "dp: predicted frontier" + (" (options included)" if has_options
                                                                    else (" (compiled layers)" if getattr(
                                                                        result, "compiled", False) else ""))),
              "dp-layer": ("tab:gray", "--", "dp-layer: predicted frontier (whole layers only)")}
    for name, (color, ls, label) in styles.items():
        pts = sorted((p.peak_bytes, p.slowdown) for p in result.frontier if p.strategy == name)
        if pts:
            ax.step([b / scale for b, _ in pts], [t for _, t in pts], where="post", color=color,
                    ls=ls, lw=1.4, label=label, zorder=1)
    cmap = plt.get_cmap("tab10")
    for i, r in enumerate(rows):
        color = cmap(i % 10)
        marker = "X" if r.kind == "peer" else "o"
        ax.plot(r.measured_peak_bytes / scale, r.slowdown, marker, color=color, markersize=8,
                label=f"{r.strategy} (measured)", zorder=3)
        if r.predicted_peak_bytes and r.predicted_overhead is not None:
            ax.plot(r.predicted_peak_bytes / scale, 1 + r.predicted_overhead, marker, color=color,
                    markerfacecolor="none", markersize=11, markeredgewidth=1.4, zorder=2)
    if result.budget_bytes:
        ax.axvline(result.budget_bytes / scale, color="k", ls=":", lw=1, label="budget")
    ax.set_xlabel(f"peak memory of a training step ({unit})")
    ax.set_ylabel("step time / step time without checkpointing")
    ax.set_title(f"{result.model} on {result.device_name}: filled = measured, hollow = predicted",
                 fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=110)
    plt.close(fig)


def plot_bench(result, path: Path) -> None:
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
