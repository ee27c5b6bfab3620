"""Launching ranks safely (ckplan.launch): what the machine can hold, checked with numbers and
refused by the CLI before anything starts; and no process ckplan started outlives it, whatever
ends it: success, a rank that fails, a deadline, SIGINT or SIGTERM (also while ranks are still
being started), counted in /proc after each."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from ckplan import launch
from ckplan.errors import Interrupted, UsageError
from ckplan.launch import Machine, check_rank_memory, check_ranks
from ckplan.preflight import Available

GIB = 2**30
ROOT = Path(__file__).resolve().parents[1]


def machine(cpus=8, gpus=0, open_files=1024):
    return Machine(cpus=cpus, cpus_source="test", gpus=gpus, open_files=open_files)


# ---- what the machine can hold (numbers) ----------------------------------------------------
def test_a_rank_per_core_runs_more_needs_force_and_a_few_per_core_at_most():
    assert check_ranks(8, "cpu", machine(cpus=8)) == []
    with pytest.raises(UsageError) as e:
        check_ranks(9, "cpu", machine(cpus=8))
    assert "9 ranks are more than the 8 CPU core(s)" in str(e.value) and "--force" in str(e.value)
    notes = check_ranks(9, "cpu", machine(cpus=8), force=True)
    assert len(notes) == 1 and "9 ranks on 8 CPU core(s) (--force)" in notes[0]
    assert check_ranks(16, "cpu", machine(cpus=8), force=True)  # MAX_RANKS_PER_CPU = 2
    with pytest.raises(UsageError) as e:  # what the report saw: --nproc 1000 on 2 cores
        check_ranks(1000, "cpu", machine(cpus=2), force=True)
    assert "1000 ranks are more than 2 per core" in str(e.value) and "--nproc" in str(e.value)


def test_nccl_needs_a_gpu_per_rank_even_with_force():
    assert check_ranks(2, "cuda", machine(cpus=1, gpus=2)) == []  # cores do not bound NCCL ranks
    with pytest.raises(UsageError) as e:
        check_ranks(3, "cuda", machine(gpus=2), force=True)
    assert "3 ranks on NCCL need a GPU each, and 2 GPU(s) are visible" in str(e.value)
    assert "--device cpu" in str(e.value)


def test_open_file_limit_bounds_the_ranks_even_with_force():
    # parallel.world_size: 100000 in a spec failed after 33 s with "Too many open files"
    with pytest.raises(UsageError) as e:
        check_ranks(100_000, "cpu", machine(cpus=100_000, open_files=20_000), force=True)
    assert "RLIMIT_NOFILE" in str(e.value) and "20000" in str(e.value) and "ulimit -n" in str(e.value)
    most = (1024 - launch.FD_BASE) // launch.FD_PER_PEER + 1
    assert check_ranks(most, "cpu", machine(cpus=most)) == []
    with pytest.raises(UsageError):
        check_ranks(most + 1, "cpu", machine(cpus=most + 1))


def test_rank_memory_adds_up_with_the_preflights_margin():
    from ckplan.preflight import MARGINS
    factor, fixed = MARGINS["cpu"]
    ranks = [GIB, GIB // 2, GIB // 2]
    need = sum(int(b * factor) + fixed for b in ranks)
    assert check_rank_memory(ranks, Available(need, "test")) == []
    with pytest.raises(UsageError) as e:
        check_rank_memory(ranks, Available(need - 1, "test"))
    assert "3 ranks are predicted to need" in str(e.value) and "--force" in str(e.value)
    assert "running anyway (--force)" in check_rank_memory(ranks, Available(need - 1, "test"), force=True)[0]
    assert check_rank_memory(ranks, Available(1, "test"), device="cuda") == []  # a GPU each
    assert check_rank_memory(ranks, Available(None, "unknown")) == []


def test_cgroup_cpu_quota_lowers_the_core_count(tmp_path):
    (tmp_path / "job").mkdir()
    (tmp_path / "job" / "cpu.max").write_text("100000 100000\n")  # docker --cpus 1
    (tmp_path / "self").write_text("0::/job\n")
    assert launch.cpu_count(str(tmp_path), str(tmp_path / "self"))[0] == 1


# ---- run_ranks: every process it started is ended -------------------------------------------
def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def _left(pids, within_s: float = 10.0) -> list[int]:
    """The pids still alive after up to ``within_s``: a rank's own children get SIGKILL, which
    the kernel carries out in its own time (the ranks themselves are reaped before run_ranks
    returns)."""
    end = time.monotonic() + within_s
    while [p for p in pids if _alive(p)] and time.monotonic() < end:
        time.sleep(0.05)
    return [p for p in pids if _alive(p)]


def _recording_starts(monkeypatch, after=None) -> list[int]:
    """Record the pid of every rank run_ranks starts; ``after(rank)`` runs after each start."""
    pids: list[int] = []
    real = launch._start_rank

    def start(p):
        real(p)
        pids.append(p.pid)
        if after is not None:
            after(len(pids) - 1)
    monkeypatch.setattr(launch, "_start_rank", start)
    return pids


def _sleep_or_fail(arg):
    """A rank: each first starts a child of its own (``sleep``), whose pid it writes to
    ``$CKPLAN_TEST_DIR/child<rank>``; then rank ``arg`` exits with code 7 once every rank has
    (so that all are running), and the others sleep."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    folder = Path(os.environ["CKPLAN_TEST_DIR"])
    child = subprocess.Popen(["sleep", "600"])
    (folder / f"child{rank}.tmp").write_text(str(child.pid))
    (folder / f"child{rank}.tmp").rename(folder / f"child{rank}")
    if rank == arg:
        while len(list(folder.glob("child?"))) < world:
            time.sleep(0.01)
        os._exit(7)
    time.sleep(600)


def _children(tmp_path, n) -> list[int]:
    end = time.monotonic() + 60
    while len(list(tmp_path.glob("child?"))) < n and time.monotonic() < end:
        time.sleep(0.05)
    return [int(p.read_text()) for p in tmp_path.glob("child?")]


def test_a_rank_that_fails_ends_the_others_and_every_child_at_once(tmp_path, monkeypatch):
    monkeypatch.setenv("CKPLAN_TEST_DIR", str(tmp_path))
    pids = _recording_starts(monkeypatch)
    out = launch.run_ranks(_sleep_or_fail, 1, 3, start_method="fork")
    assert out.failed == (1,) and out.exitcodes[1] == 7 and not out.ok
    assert out.exitcodes[0] == out.exitcodes[2] == -signal.SIGTERM  # ended by ckplan, not left sleeping
    children = _children(tmp_path, 3)
    assert len(pids) == 3 and len(children) == 3
    assert not [p for p in pids if _alive(p)] and not _left(children)


def test_the_ranks_own_children_are_ended_after_a_clean_run(tmp_path, monkeypatch):
    monkeypatch.setenv("CKPLAN_TEST_DIR", str(tmp_path))

    def rank(arg):
        child = subprocess.Popen(["sleep", "600"])  # left behind by a rank that returns
        Path(os.environ["CKPLAN_TEST_DIR"], f"child{os.environ['RANK']}.tmp").write_text(str(child.pid))
        Path(os.environ["CKPLAN_TEST_DIR"], f"child{os.environ['RANK']}.tmp").rename(
            Path(os.environ["CKPLAN_TEST_DIR"], f"child{os.environ['RANK']}"))

    out = launch.run_ranks(rank, None, 2, start_method="fork")
    assert out.ok
    children = _children(tmp_path, 2)
    assert len(children) == 2 and not _left(children)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_while_ranks_are_being_started_ends_the_started_ones(sig, monkeypatch):
    before = {s: signal.getsignal(s) for s in launch.SIGNALS}

    def signal_after_rank_1(rank):
        if rank == 1:
            os.kill(os.getpid(), sig)  # as Ctrl-C half-way through starting 1000 ranks

    pids = _recording_starts(monkeypatch, after=signal_after_rank_1)
    with pytest.raises(Interrupted) as e:
        launch.run_ranks(time.sleep, 600, 4, start_method="fork")
    assert e.value.exit_code == 128 + sig and e.value.signum == sig
    assert len(pids) == 2  # no rank is started after the signal
    assert not [p for p in pids if _alive(p)]
    assert {s: signal.getsignal(s) for s in launch.SIGNALS} == before  # the caller's handlers are back


def test_spawned_ranks_still_starting_are_ended(monkeypatch):
    pids = _recording_starts(monkeypatch, after=lambda rank: rank == 2 and os.kill(os.getpid(), signal.SIGTERM))
    t0 = time.monotonic()
    with pytest.raises(Interrupted) as e:  # the spawned interpreters are still starting up
        launch.run_ranks(time.sleep, 600, 3, start_method="spawn")
    assert e.value.exit_code == 143
    assert time.monotonic() - t0 < 30
    assert len(pids) == 3 and not [p for p in pids if _alive(p)]


def test_ranks_past_the_deadline_are_ended(monkeypatch):
    pids = _recording_starts(monkeypatch)
    out = launch.run_ranks(time.sleep, 600, 2, start_method="fork", deadline_s=0.5)
    assert out.timed_out and not out.ok and not out.failed
    assert not [p for p in pids if _alive(p)]


def test_ranks_die_with_a_launcher_that_is_killed(processes_with):
    # SIGKILL cannot be caught: the kernel ends the ranks (PR_SET_PDEATHSIG)
    token = uuid.uuid4().hex
    p = subprocess.Popen([sys.executable, "-c", "import time; from ckplan import launch; "
                          "launch.run_ranks(time.sleep, 600, 2, start_method='fork')"],
                         cwd=ROOT, env={**os.environ, "CKPLAN_TEST_RUN": token})
    try:
        end = time.monotonic() + 60
        while len(processes_with(token)) < 3 and time.monotonic() < end:
            time.sleep(0.05)
        assert len(processes_with(token)) == 3  # the launcher and its 2 ranks
    finally:
        p.kill()
        p.wait()
    end = time.monotonic() + 10
    while processes_with(token) and time.monotonic() < end:
        time.sleep(0.05)
    left = processes_with(token)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left


def test_signal_handlers_are_put_back_and_a_late_signal_still_interrupts():
    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(Interrupted) as e:
        with launch.caught_signals("the test"):
            os.kill(os.getpid(), signal.SIGTERM)  # caught: the block goes on
            with launch.caught_signals() as inner:  # nested: the same flag
                assert inner.signum == signal.SIGTERM
    assert e.value.exit_code == 143 and "the test stopped by SIGTERM" in str(e.value)
    assert signal.getsignal(signal.SIGINT) is before


# ---- the CLI: refusals before anything starts, and signals while ranks run ------------------
def _cli(tmp_path, *args, env=None, one_cpu=False, **kw):
    cpu = min(os.sched_getaffinity(0))
    return subprocess.Popen(
        [sys.executable, "-m", "ckplan", "bench", *map(str, args), "--device", "cpu", "--compare", "none",
         "--steps", "1", "--out-dir", str(tmp_path / "out"), "-f", "json"],
        cwd=ROOT, env={**os.environ, "TMPDIR": str(tmp_path), **(env or {})}, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        preexec_fn=(lambda: os.sched_setaffinity(0, {cpu})) if one_cpu else None, **kw)


def _refused(tmp_path, *args, one_cpu=False) -> str:
    p = _cli(tmp_path, *args, one_cpu=one_cpu)
    _, err = p.communicate(timeout=300)
    assert p.returncode == 2, err
    assert "profiling" not in err and not list(tmp_path.glob("ckplan-dist-*"))  # refused before the profile
    lines = [x for x in err.splitlines() if x.strip()]
    assert lines[0].startswith("Error: ") and "Traceback" not in err, err
    return " ".join(lines)


def test_cli_refuses_more_ranks_than_cores_without_force(configs, tmp_path):
    err = _refused(tmp_path, configs / "gpt-tiny-dist.yaml", "--nproc", 2, one_cpu=True)
    assert "2 ranks are more than the 1 CPU core(s)" in err and "--force" in err


def test_cli_refuses_a_spec_world_size_past_what_force_allows(configs, tmp_path, write_spec):
    spec = write_spec(tmp_path, (configs / "gpt-tiny-dist.yaml").read_text() + "parallel: {world_size: 3}\n")
    err = _refused(tmp_path, spec, "--force", one_cpu=True)
    assert "3 ranks are more than 2 per core" in err and "parallel.world_size" in err


def test_cli_refuses_one_rank_with_parallel_as_plan_does(configs, tmp_path):
    err = _refused(tmp_path, configs / "gpt-tiny-dist.yaml", "--nproc", 1, "--parallel", "fsdp")
    assert "--parallel fsdp needs several ranks: without --nproc N (N > 1)" in err


def _signal_held_run(tmp_path, processes_with, sig, *args, one_cpu=False):
    """Start the CLI on 2 ranks that hold once their process group is up, signal it there;
    return (exit code, stderr) once nothing the run started is left."""
    token = uuid.uuid4().hex
    p = _cli(tmp_path, ROOT / "configs" / "gpt-tiny-dist.yaml", "--nproc", 2, *args, one_cpu=one_cpu,
             env={"CKPLAN_TEST_FAULT": "hold", "CKPLAN_TEST_RUN": token})
    try:
        end = time.monotonic() + 300
        while len(list(tmp_path.glob("ckplan-dist-*/held*"))) < 2:
            assert p.poll() is None, f"the run ended before its ranks held: {p.communicate()[1]}"
            assert time.monotonic() < end, "the ranks never held"
            time.sleep(0.1)
        assert len(processes_with(token)) == 3  # the CLI and its 2 ranks
        p.send_signal(sig)
        _, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    left = processes_with(token)
    for pid in left:  # do not leave them to the next test
        os.kill(pid, signal.SIGKILL)
    assert not left, f"processes of the run left: {left}"
    # nothing of ckplan's (nor torch's elastic launcher's error files) is left in TMPDIR
    assert [q.name for q in tmp_path.iterdir() if not q.name.startswith("torchinductor")] == [], err
    return p.returncode, err


@pytest.mark.slow  # SIGINT's path is SIGTERM's (tested below) with another code; the fast tier has it in run_ranks
def test_cli_sigint_while_ranks_run_exits_130_and_leaves_nothing(tmp_path, processes_with):
    code, err = _signal_held_run(tmp_path, processes_with, signal.SIGINT)
    assert code == 130, err
    lines = [x for x in err.splitlines() if x.strip() and not x.startswith("running ")]
    assert lines == [lines[0]] and lines[0].startswith("Error: bench on 2 ranks stopped by SIGINT"), err


def test_cli_sigterm_with_force_on_one_core_exits_143_and_leaves_nothing(tmp_path, processes_with):
    from ckplan.distributed import fsdp_runs_on_cpu
    if not fsdp_runs_on_cpu():
        pytest.skip("FSDP2 on CPU ranks needs torch 2.9 (ckplan refuses it)")
    # --force lets 2 ranks share the one core this run may use; SIGTERM while they run
    code, err = _signal_held_run(tmp_path, processes_with, signal.SIGTERM, "--force", one_cpu=True)
    assert code == 143, err
    assert "Error: bench on 2 ranks stopped by SIGTERM" in err and "Traceback" not in err
