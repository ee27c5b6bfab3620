"""Machine-readable outputs: JSON envelopes, DataFrames, CSV/PNG files written atomically."""
from __future__ import annotations

import contextlib
import errno
import json
import os
import secrets
import signal
import stat
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .errors import UsageError, WriteError
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


def plan_doc(rep) -> dict[str, Any]:
    """The JSON document of ``ckplan plan`` (a ckplan.plan_report.PlanReport)."""
    c = rep.chosen
    prof = rep.profile
    return envelope("plan", {
        "model": prof.model, "device": prof.device, "chain": prof.chain,
        "n_layers": len(prof.chain_layers), "batch_size": prof.batch_size,
        "precision": prof.precision, "optimizer": prof.optimizer, "accum": prof.accum,
        "strategy": c.strategy, "budget_bytes": rep.budget_bytes, "budget_source": rep.budget_source,
        "fits": c.fits, "predicted_peak_bytes": c.score.peak_bytes,
        "predicted_recompute_ms": c.score.recompute_ms, "predicted_overhead": c.score.overhead,
        "predicted_step_ms": c.score.step_ms, "peak_at": c.score.peak_at,
        "persistent_bytes": c.score.persistent_bytes, "no_checkpoint_peak_bytes": rep.none_peak_bytes,
        "slot_bytes": c.slot_bytes, "exact": c.exact, "notes": list(rep.notes) + list(c.notes),
        "infeasible": rep.infeasible,
        "layers": [dict(index=d.layer, name=prof.chain_layers[d.layer].name, stored=d.stored,
                        checkpoint_depth=d.depth, forward_runs=d.forwards)
                   for d in c.plan.per_layer()],
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


def records_frame(rows):
    import pandas as pd
    return pd.DataFrame([r.to_dict() for r in rows])


def write_dist_bench(out_dir: str | Path, result) -> list[Path]:
    """bench-<model>-<device>-<kind><N>.{csv,json}, as one set (see :func:`write_files`)."""
    base = Path(out_dir) / f"{bench_basename(result.model, result.device)}-{result.kind}{result.world_size}"
    frame = result.to_frame()
    text = to_json(dist_bench_doc(result))
    return write_files([(Path(f"{base}.csv"), lambda p: frame.to_csv(p, index=False)),
                        (Path(f"{base}.json"), lambda p: p.write_text(text))], "--out-dir")


def profile_frame(prof: Profile):
    """One row per stage; each measured selective option adds columns ``<option>_<field>``."""
    import pandas as pd
    names = prof.option_names
    rows = []
    for r in prof.layers:
        d = r.to_dict()
        d.pop("options")
        for n in names:
            o = r.option(n)
            for k, v in (o.to_dict() if o is not None else {}).items():
                if k != "name":
                    d[f"{n}_{k}"] = v
        rows.append(d)
    frame = pd.DataFrame(rows)
    # Columns blank on some rows (options and early-stop sizes: not for pre and post) would turn
    # to floats: keep byte and FLOP counts whole numbers beside the blanks, as in the JSON.
    for col in frame.columns:
        if (col.endswith("_bytes") or col.endswith("_flops")) and frame[col].dtype.kind == "f":
            frame[col] = frame[col].astype("Int64")
    return frame


# ---- writing files -----------------------------------------------------------------------------
#
# ckplan writes only regular files, and only where the target is absent or already a regular file:
# renaming a temporary file over a symlink, a FIFO or a device node would replace something that is
# not ours (as root, ``-o /dev/full`` replaced the device). New files get 0666 less the user's umask,
# as ``open()`` would give them (``mkstemp`` makes 0600); a file written again keeps its mode.


class ReportsInterrupted(KeyboardInterrupt):
    """Ctrl-C while a set of reports was written; ``kept`` says which whole set is on disk."""

    def __init__(self, kept: str, paths: list[Path]):
        self.kept = kept  # "previous": nothing new was written; "new": every new file is in place
        self.paths = paths
        names = ", ".join(str(p) for p in paths)
        if kept == "new":
            text = f"interrupted after the reports were written; the new set is complete: {names}"
        else:
            text = ("interrupted while writing reports; nothing was replaced, the previous set (if any) "
                    f"is intact: {names}")
        super().__init__(text)


def _kind(path: Path) -> str | None:
    """What is at ``path`` if it is not a regular file ('' when absent or regular)."""
    try:
        st = os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):  # absent (creating its folder will say why)
        return ""
    except OSError as e:
        return f"not accessible ({e.strerror})"
    mode = st.st_mode
    if stat.S_ISREG(mode):
        return ""
    if stat.S_ISLNK(mode):
        return f"a symbolic link to {os.readlink(path)!r}"
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe)"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


def _refuse_non_regular(path: Path, what: str = "--output") -> None:
    kind = _kind(path)
    if kind:
        raise UsageError(f"{what} {str(path)!r} is {kind}; ckplan writes only regular files and will not "
                         "replace it", tip="name a new or regular file (to see the result on stdout, "
                         "use --format json or csv)")


def _umask() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    old = os.umask(0o022)  # no /proc: read it by setting it, then put it back at once
    os.umask(old)
    return old


def _new_mode(path: Path) -> int:
    """The mode the file should get: the old file's, or 0666 less the umask for a new one."""
    try:
        return stat.S_IMODE(os.stat(path).st_mode)
    except OSError:
        return 0o666 & ~_umask()


def _make_folder(folder: Path, what: str) -> None:
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise UsageError(f"{what}: {str(folder)!r} exists and is not a folder",
                         tip="choose another folder") from None
    except OSError as e:
        raise UsageError(f"{what}: cannot create folder {str(folder)!r}: {e.strerror}",
                         tip="choose a folder you can write to") from None


def _probe_folder(folder: Path, what: str) -> None:
    """Create and remove a temporary file in ``folder``: the one sure test that it can be written."""
    try:
        fd, tmp = tempfile.mkstemp(prefix=".ckplan-probe.", dir=folder)
        os.close(fd)
        os.unlink(tmp)
    except OSError as e:
        raise UsageError(f"{what}: cannot write in folder {str(folder)!r}: {e.strerror}",
                         tip="choose a folder you can write to") from None


def check_output_file(path: str | Path, what: str = "--output") -> Path:
    """Before a run: ``path`` can be written (its folder exists or is created, is writable, and the
    target is absent or a regular file). Raises UsageError (exit 2) naming the path and the fix."""
    path = Path(path)
    _refuse_non_regular(path, what)
    _make_folder(path.parent, what)
    _probe_folder(path.parent, what)
    if path.exists() and not os.access(path, os.W_OK):
        raise UsageError(f"{what} {str(path)!r} is not writable", tip="choose another file name")
    return path


def check_output_dir(path: str | Path, what: str = "--out-dir", names: tuple[str, ...] = ()) -> Path:
    """Before a run: folder ``path`` exists or is created and can be written; each of ``names`` in
    it is absent or a regular file. Raises UsageError (exit 2) naming the path and the fix."""
    path = Path(path)
    kind = _kind(path)
    if kind and kind != "a folder" and not (kind.startswith("a symbolic link") and path.is_dir()):
        raise UsageError(f"{what} {str(path)!r} is {kind}, not a folder", tip="choose a folder")
    _make_folder(path, what)
    _probe_folder(path, what)
    for name in names:
        _refuse_non_regular(path / name, what)
    return path


def atomic_write(path: str | Path, write: Callable[[Path], None]) -> Path:
    """Write via a temporary file in the same folder and rename: complete files or none.

    Only where ``path`` is absent or a regular file (UsageError otherwise, before anything is
    written); the file gets the old file's mode, or 0666 less the umask.
    """
    return write_files([(Path(path), write)])[0]


def write_files(items: list[tuple[Path, Callable[[Path], None]]], what: str = "--output") -> list[Path]:
    """Write a set of files all or nothing: after this returns or raises, either every file is the
    new one or every file is as it was.

    1. every target is checked (absent or a regular file) and every temporary file written;
       an error or Ctrl-C here removes the temporary files: the previous set is untouched;
    2. the renames run with SIGINT deferred (in the main thread), and old files are kept as hard
       links until all renames succeed, so a failing rename puts the previous set back.

    A Ctrl-C raises :class:`ReportsInterrupted`, whose ``kept`` says which set is on disk.
    """
    items = [(Path(p), w) for p, w in items]
    paths = [p for p, _ in items]
    for p in paths:
        _refuse_non_regular(p, what)
    for folder in {p.parent for p in paths}:
        _make_folder(folder, what)
    temps: list[Path] = []
    current = paths[0] if paths else Path(".")
    try:
        for p, write in items:
            current = p
            fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=p.parent)
            os.close(fd)
            temps.append(Path(tmp))
            write(Path(tmp))
            os.chmod(tmp, _new_mode(p))
    except KeyboardInterrupt:
        _unlink_all(temps)
        raise ReportsInterrupted("previous", paths) from None
    except OSError as e:  # a full disk, a folder gone read-only: said with the file's name
        _unlink_all(temps)
        raise _write_error(e, current, paths, what) from None
    except BaseException:
        _unlink_all(temps)
        raise
    try:
        with _sigint_deferred() as interrupted:
            _rename_all(temps, paths, what)
    except KeyboardInterrupt:  # in the instant before or after the deferral: look at what is on disk
        renamed = not any(t.exists() for t in temps)
        _unlink_all(temps)
        raise ReportsInterrupted("new" if renamed else "previous", paths) from None
    if interrupted():
        raise ReportsInterrupted("new", paths)
    return paths


def _write_error(e: OSError, path: Path, paths: list[Path], what: str) -> WriteError:
    why = e.strerror or str(e)
    files = "the file is" if len(paths) == 1 else f"its {len(paths)} files are"
    return WriteError(f"{what}: cannot write {str(path)!r}: {why} ({files} as before the run)",
                      tip="free space on that disk, or choose another folder" if e.errno == errno.ENOSPC else
                      "choose a folder you can write to")


def _unlink_all(paths: list[Path]) -> None:
    for p in paths:
        with contextlib.suppress(OSError):
            p.unlink()


def _rename_all(temps: list[Path], paths: list[Path], what: str) -> None:
    """Rename each temporary file over its target; on failure put the old files back."""
    backups: list[tuple[Path, Path]] = []  # (hard link to the old file, target)
    done: list[Path] = []
    current = paths[0] if paths else Path(".")
    try:
        for tmp, p in zip(temps, paths):
            current = p
            _refuse_non_regular(p, what)  # again: something may have appeared since the check
            if p.exists():
                bak = p.parent / f".{p.name}.{secrets.token_hex(6)}.old"
                try:
                    os.link(p, bak)  # fails rather than overwrite, should the name exist
                    backups.append((bak, p))
                except OSError:  # no hard links here (FAT, some network file systems): no way back
                    pass
            os.replace(tmp, p)
            done.append(p)
    except BaseException as exc:
        old = dict((p, bak) for bak, p in backups)
        for p in done:  # put back what was replaced; remove what was new
            if p in old:
                with contextlib.suppress(OSError):
                    os.replace(old[p], p)
            else:
                _unlink_all([p])
        _unlink_all([bak for bak, _ in backups] + temps)
        if isinstance(exc, OSError):
            raise _write_error(exc, current, paths, what) from None
        raise
    _unlink_all([bak for bak, _ in backups])


@contextlib.contextmanager
def _sigint_deferred():
    """Hold Ctrl-C until the block ends (main thread only; elsewhere signals cannot be handled)."""
    got: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield lambda: False
        return
    old = signal.signal(signal.SIGINT, lambda signum, frame: got.append(signum))
    try:
        yield lambda: bool(got)
    finally:
        signal.signal(signal.SIGINT, old)


def write_text(path: str | Path, text: str) -> Path:
    return atomic_write(path, lambda p: p.write_text(text))


def write_csv(path: str | Path, frame) -> Path:
    return atomic_write(path, lambda p: frame.to_csv(p, index=False))


# ---- plan sweep and bench files --------------------------------------------------------------

SLUG_MAX = 100  # file names are at most 255 bytes; a model name goes in with a prefix and suffixes


def _slug(text: str) -> str:
    """``text`` as a file-name part: other characters than letters, digits, ``_.-`` become ``-``;
    a long name is cut to :data:`SLUG_MAX` characters, its end a hash of the whole name (two
    long names that share their first 91 characters still get two sets of files)."""
    import hashlib
    import re
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "-", text).strip("-") or "model"
    if len(slug) <= SLUG_MAX:
        return slug
    digest = hashlib.sha1(text.encode("utf-8", "surrogatepass")).hexdigest()[:8]
    return f"{slug[:SLUG_MAX - 9].rstrip('-.')}-{digest}"


def sweep_frame(points):
    import pandas as pd
    return pd.DataFrame([p.to_dict() for p in points])


def write_sweep(out_dir: str | Path, model: str, points) -> list[Path]:
    """CSV and PNG of every strategy's memory-vs-overhead frontier."""
    frame = sweep_frame(points)
    base = sweep_basename(model)
    # Names are built by appending: Path.with_suffix would cut "llama-3.1-8b" at its dot.
    return write_files([(Path(out_dir) / f"{base}.csv", lambda p: frame.to_csv(p, index=False)),
                        (Path(out_dir) / f"{base}.png", lambda p: _plot_sweep(frame, model, p))], "--out-dir")


def sweep_basename(model: str) -> str:
    return f"sweep-{_slug(model)}"


def bench_basename(model: str, device: str) -> str:
    return f"bench-{_slug(model)}-{_slug(device)}"


def frontier_basename(model: str, device: str) -> str:
    return f"frontier-{_slug(model)}-{_slug(device)}"


def replaced_note(paths: list[Path] | tuple[Path, ...], since: float) -> str | None:
    """What writing ``paths`` replaces, to say so: files of an earlier run, or (modified at or
    after ``since``, this run's start, a ``time.time()``) of another run that wrote them while
    this one ran. None when none of them exists."""
    import time
    found = []
    for p in paths:
        try:
            found.append((Path(p), os.stat(p).st_mtime))
        except OSError:
            continue
    if not found:
        return None
    newest = max(m for _, m in found)
    names = ", ".join(p.name for p, _ in found)
    folder = found[0][0].parent
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(newest))
    if newest >= since:
        return (f"note: another run wrote {names} in {folder} while this one ran (at {when}); its results "
                "are replaced by these: give each run its own --out-dir")
    return f"note: replaced {names} in {folder}, written by an earlier run at {when}"


def bench_filenames(model: str, device: str) -> tuple[str, ...]:
    """The files :func:`write_bench` writes, for :func:`check_output_dir` before the run."""
    base = bench_basename(model, device)
    return (*(f"{base}.{ext}" for ext in ("csv", "json", "png")),
            f"{frontier_basename(model, device)}.png")


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
    """bench-<model>-<device>.{csv,json,png}: the whole set or none of it (see :func:`write_files`)."""
    base = Path(out_dir) / bench_basename(result.model, result.device_tag)
    frame = bench_frame(result)
    text = to_json(bench_doc(result))
    return write_files([(Path(f"{base}.csv"), lambda p: frame.to_csv(p, index=False)),
                        (Path(f"{base}.json"), lambda p: p.write_text(text)),
                        (Path(f"{base}.png"), lambda p: _plot_bench(result, p)),
                        (Path(out_dir) / f"{frontier_basename(result.model, result.device_tag)}.png",
                         lambda p: _plot_frontier(result, p))], "--out-dir")


def _plot_frontier(result, path: Path) -> None:
    """Memory vs slowdown: the planner's predicted dp frontier (a step curve; dp-layer's too
    when the profile has selective options), each row's predicted point (hollow) and measured
    point (filled), peers measured only."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    rows = [r for r in result.rows if r.measured_peak_bytes and r.slowdown]
    peaks = [r.measured_peak_bytes for r in rows] + [b for _, b, _ in result.frontier]
    unit, scale = ("GiB", 2**30) if peaks and max(peaks) >= 2**30 else ("MiB", 2**20)
    has_options = any(s == "dp-layer" for s, _, _ in result.frontier)
    styles = {"dp": ("tab:purple", "-", "dp: predicted frontier" + (" (options included)" if has_options
                                                                    else (" (compiled layers)" if getattr(
                                                                        result, "compiled", False) else ""))),
              "dp-layer": ("tab:gray", "--", "dp-layer: predicted frontier (whole layers only)")}
    for name, (color, ls, label) in styles.items():
        pts = sorted((b, t) for s, b, t in result.frontier if s == name)
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
