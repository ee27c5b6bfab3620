"""Report files: only regular files replaced, the user's umask, checks before a run, all-or-nothing
sets, names that keep the model's dots. No torch run: records are built by hand."""
import json
import os
import signal
import stat
import sys
from pathlib import Path

import pytest

from ckplan import report
from ckplan.bench_records import BenchResult, BenchRow
from ckplan.errors import UsageError

sys.path.insert(0, str(Path(__file__).parent))
from fake_records import make_bench


@pytest.fixture
def umask():
    """Set the process umask for one test, then put the old one back."""
    old = os.umask(0o022)
    yield os.umask
    os.umask(old)


def _mode(p: Path) -> int:
    return stat.S_IMODE(os.stat(p).st_mode)


# ---- never replace what is not ours ------------------------------------------------------------

def test_symlink_is_refused_and_left_alone(tmp_path):
    target = tmp_path / "real.json"
    target.write_text("mine")
    link = tmp_path / "link.json"
    link.symlink_to(target)
    with pytest.raises(UsageError) as e:
        report.write_text(link, "{}")
    assert e.value.exit_code == 2 and str(link) in str(e.value) and "symbolic link" in str(e.value)
    assert link.is_symlink() and target.read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.json", "real.json"]  # no temp left


def test_fifo_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "out.json"
    os.mkfifo(fifo)
    with pytest.raises(UsageError, match="FIFO"):
        report.write_text(fifo, "{}")
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    with pytest.raises(UsageError, match="FIFO"):
        report.check_output_file(fifo)


def test_device_node_is_refused(tmp_path):
    dev = tmp_path / "null"
    try:  # a /dev/null twin of our own: the test never goes near the real one
        os.mknod(dev, stat.S_IFCHR | 0o666, os.makedev(1, 3))
    except (PermissionError, OSError) as e:
        pytest.skip(f"cannot make a device node here: {e}")
    with pytest.raises(UsageError, match="a device"):
        report.write_text(dev, "{}")
    assert stat.S_ISCHR(os.lstat(dev).st_mode)


def test_folder_as_file_is_refused(tmp_path):
    with pytest.raises(UsageError, match="a folder"):
        report.write_text(tmp_path, "{}")


@pytest.mark.parametrize("mask, expected", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_new_files_follow_the_umask(tmp_path, umask, mask, expected):
    umask(mask)
    p = report.write_text(tmp_path / "a.json", "{}")
    assert _mode(p) == expected
    paths = report.write_bench(tmp_path / "out", make_bench())
    assert {_mode(q) for q in paths} == {expected}


def test_rewritten_file_keeps_its_mode(tmp_path, umask):
    p = tmp_path / "a.json"
    p.write_text("old")
    os.chmod(p, 0o640)
    report.write_text(p, "new")
    assert p.read_text() == "new" and _mode(p) == 0o640


# ---- checked before the run --------------------------------------------------------------------

def test_check_output_dir(tmp_path):
    new = tmp_path / "a" / "b"
    assert report.check_output_dir(new) == new and new.is_dir()
    assert list(new.iterdir()) == []  # the probe file is gone
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(UsageError, match="not a folder"):
        report.check_output_dir(f)
    with pytest.raises(UsageError, match="cannot create folder"):
        report.check_output_dir(f / "sub")
    os.mkfifo(new / "bench-m-cpu.png")
    with pytest.raises(UsageError, match="FIFO"):
        report.check_output_dir(new, names=report.bench_filenames("m", "cpu"))
    (tmp_path / "dirlink").symlink_to(new)  # a link to a folder is fine: we write inside it
    report.check_output_dir(tmp_path / "dirlink")


def test_check_output_file(tmp_path):
    p = tmp_path / "new" / "x.json"
    assert report.check_output_file(p) == p and p.parent.is_dir() and not p.exists()
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(UsageError, match="is not a folder"):
        report.check_output_file(f / "x.json")
    link = tmp_path / "l.json"
    link.symlink_to(f)
    with pytest.raises(UsageError, match="symbolic link"):
        report.check_output_file(link)


# ---- all or nothing -----------------------------------------------------------------------------

def _set(tmp_path, writers):
    return [(tmp_path / f"r.{ext}", w) for ext, w in zip(("csv", "json", "png"), writers)]


def _write(text):
    return lambda p: p.write_text(text)


def _snapshot(folder: Path) -> dict[str, str]:
    return {p.name: p.read_text() for p in folder.iterdir()}


@pytest.mark.parametrize("exc", [KeyboardInterrupt, RuntimeError])
def test_failure_while_writing_the_second_file_keeps_the_previous_set(tmp_path, exc):
    report.write_files(_set(tmp_path, [_write("old csv"), _write("old json"), _write("old png")]))
    before = _snapshot(tmp_path)

    def boom(p):
        p.write_text("half")
        raise exc("stop")
    expected = report.ReportsInterrupted if exc is KeyboardInterrupt else RuntimeError
    with pytest.raises(expected) as e:
        report.write_files(_set(tmp_path, [_write("new csv"), boom, _write("new png")]))
    assert _snapshot(tmp_path) == before  # the whole previous set, no temporary file left
    if exc is KeyboardInterrupt:
        assert e.value.kept == "previous" and "previous set" in str(e.value)


def test_ctrl_c_during_the_renames_completes_the_new_set(tmp_path, monkeypatch):
    # Python's own Ctrl-C handler, as in a terminal (a shell's background job starts with SIGINT
    # ignored, and Python then installs none)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        _ctrl_c_during_the_renames(tmp_path, monkeypatch)
    finally:
        signal.signal(signal.SIGINT, previous)


def _ctrl_c_during_the_renames(tmp_path, monkeypatch):
    report.write_files(_set(tmp_path, [_write("old")] * 3))
    real_replace = os.replace
    calls = []

    def replace_and_interrupt(src, dst):  # a real SIGINT, at the worst moment: between renames
        calls.append(dst)
        if len(calls) == 1:
            os.kill(os.getpid(), signal.SIGINT)
        real_replace(src, dst)
    monkeypatch.setattr(report.files.os, "replace", replace_and_interrupt)
    with pytest.raises(report.ReportsInterrupted) as e:
        report.write_files(_set(tmp_path, [_write("new")] * 3))
    assert e.value.kept == "new" and "new set is complete" in str(e.value)
    assert _snapshot(tmp_path) == {"r.csv": "new", "r.json": "new", "r.png": "new"}
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_failing_rename_puts_the_previous_set_back(tmp_path, monkeypatch):
    report.write_files(_set(tmp_path, [_write("old csv"), _write("old json"), _write("old png")]))
    before = _snapshot(tmp_path)
    real_replace = os.replace
    calls = []

    def replace_fails_second(src, dst):
        calls.append(dst)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        real_replace(src, dst)
    monkeypatch.setattr(report.files.os, "replace", replace_fails_second)
    from ckplan.errors import WriteError
    with pytest.raises(WriteError, match=r"cannot write .*r\.json': No space left on device"):
        report.write_files(_set(tmp_path, [_write("new")] * 3))
    assert _snapshot(tmp_path) == before


def test_bench_set_interrupted_at_the_png_keeps_the_previous_set(tmp_path, monkeypatch):
    res = make_bench()
    out = tmp_path / "reports"
    report.write_bench(out, res)
    good = {p.name: p.read_bytes() for p in out.iterdir()}

    def interrupted(result, path):
        raise KeyboardInterrupt
    monkeypatch.setattr(report.sets, "plot_bench", interrupted)
    changed = BenchResult(**{**res.__dict__, "steps": 99})
    with pytest.raises(report.ReportsInterrupted):
        report.write_bench(out, changed)
    # CSV and JSON were written to temporary files first: none of them replaced the old ones.
    assert {p.name: p.read_bytes() for p in out.iterdir()} == good


# ---- names keep the model's dots ------------------------------------------------------------------

def test_file_names_keep_the_model_name(tmp_path):
    res = BenchResult(**{**make_bench().__dict__, "model": "llama-3.1-8b"})
    paths = report.write_bench(tmp_path, res)
    assert sorted(p.name for p in paths) == ["bench-llama-3.1-8b-cpu.csv", "bench-llama-3.1-8b-cpu.json",
                                             "bench-llama-3.1-8b-cpu.png", "frontier-llama-3.1-8b-cpu.png"]
    assert json.loads((tmp_path / "bench-llama-3.1-8b-cpu.json").read_text())["model"] == "llama-3.1-8b"
    other = BenchResult(**{**res.__dict__, "model": "llama-3.2-1b"})
    report.write_bench(tmp_path, other)
    assert len(list(tmp_path.iterdir())) == 8  # two models, two sets: nothing overwritten


def test_sweep_file_names_keep_the_model_name(tmp_path):
    from fake_records import make_profile

    from ckplan.planner import chain_from_profile, sweep
    pts = sweep(chain_from_profile(make_profile()), ["none", "every-k"], 3)
    paths = report.write_sweep(tmp_path, "qwen2.5-0.5b", pts)
    assert sorted(p.name for p in paths) == ["sweep-qwen2.5-0.5b.csv", "sweep-qwen2.5-0.5b.png"]


def test_the_sweep_csv_keeps_integers_integers(tmp_path):
    import csv

    from fake_records import make_profile

    from ckplan.planner import chain_from_profile, sweep
    pts = sweep(chain_from_profile(make_profile()), ["none", "every-k", "chen", "dp"], 4)
    rows = list(csv.DictReader(report.write_sweep(tmp_path, "m", pts)[0].read_text().splitlines()))
    want = {p.strategy: p for p in pts}
    for col in ("budget_bytes", "k", "threshold_bytes", "peak_bytes"):
        cells = [r[col] for r in rows if r[col]]
        assert cells and all(c.isdigit() for c in cells), (col, cells[:3])
    assert int(next(r for r in rows if r["strategy"] == "none")["peak_bytes"]) == want["none"].peak_bytes


def test_row_status_of_a_hand_built_failed_result():
    res = make_bench()
    assert [r.strategy for r in res.failed_rows] == ["dp"]
    assert isinstance(res.rows[0], BenchRow) and not res.rows[0].failed


def test_cli_output_to_a_link_or_device_exits_2(tiny_gpt_spec, tmp_path):
    from typer.testing import CliRunner

    from ckplan.cli import app
    target = tmp_path / "t.json"
    target.write_text("keep")
    link = tmp_path / "out.json"
    link.symlink_to(target)
    r = CliRunner().invoke(app, ["profile", str(tiny_gpt_spec(tmp_path)), "--device", "meta", "-o", str(link)])
    assert r.exit_code == 2 and "symbolic link" in r.output and "Traceback" not in r.output
    assert target.read_text() == "keep" and link.is_symlink()


def test_a_full_disk_names_the_file_and_keeps_the_previous_set(tmp_path):
    import errno

    from ckplan.errors import WriteError
    report.write_files(_set(tmp_path, [_write("old csv"), _write("old json"), _write("old png")]))
    before = _snapshot(tmp_path)

    def full(p):
        p.write_text("half")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))  # as a write() on a full disk: no file name
    with pytest.raises(WriteError) as e:
        report.write_files(_set(tmp_path, [_write("new csv"), full, _write("new png")]), "--out-dir")
    assert str(e.value).startswith(f"--out-dir: cannot write {str(tmp_path / 'r.json')!r}: No space left on device")
    assert "free space" in e.value.tip and e.value.exit_code == 1
    assert _snapshot(tmp_path) == before


def test_a_long_model_name_makes_file_names_a_folder_takes(tmp_path):
    a, b = "m" * 300 + "-a", "m" * 300 + "-b"
    names = report.bench_filenames(a, "cpu-compiled") + (report.sweep_basename(a) + ".png",)
    assert all(len(n) <= 150 for n in names)  # with the temporary and backup names around them: < 255
    assert report.bench_filenames(a, "cpu") != report.bench_filenames(b, "cpu")  # not cut to one name
    assert report.bench_filenames("llama-3.1-8b", "cpu")[0] == "bench-llama-3.1-8b-cpu.csv"
    report.check_output_dir(tmp_path, names=names)  # the folder check passes: nothing blamed on --out-dir
    report.write_files([(tmp_path / n, _write("x")) for n in names], "--out-dir")


def test_replaced_files_are_named_and_another_runs_are_told_apart(tmp_path):
    import time
    paths = [tmp_path / "bench-m-cpu.csv", tmp_path / "bench-m-cpu.json"]
    assert report.replaced_note(paths, since=time.time()) is None  # nothing there: nothing to say
    for p in paths:
        p.write_text("x")
    earlier = time.time() - 3600
    os.utime(paths[0], (earlier, earlier))
    os.utime(paths[1], (earlier, earlier))
    note = report.replaced_note(paths, since=time.time())
    assert note.startswith("note: replaced bench-m-cpu.csv, bench-m-cpu.json in ") and "earlier run" in note
    note = report.replaced_note(paths, since=earlier - 1)  # written after this run started
    assert "another run wrote bench-m-cpu.csv, bench-m-cpu.json" in note and "own --out-dir" in note
