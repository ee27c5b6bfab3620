"""Start rank processes, own them, end them: the process side of ``bench --nproc N``.

Two parts, like :mod:`ckplan.preflight`:

- :func:`check_ranks` and :func:`check_rank_memory` (:mod:`ckplan.launch_checks`, re-exported
  here) are arithmetic on numbers: can this machine hold ``nproc`` ranks?
- :func:`run_ranks` starts the ranks and guarantees that none outlives it, whatever ends it:
  success, a rank that fails (the others are ended at once), its deadline, an exception in this
  process, SIGINT or SIGTERM (also while ranks are still being started), or this process being
  killed. It does not use torch's elastic launcher, whose agent starts ranks inside a loop that
  an interrupt leaves half done (the ranks started so far are then known to nobody) and whose
  shutdown waits on a rendezvous.

How every rank is owned:

1. it is started with ``multiprocessing`` (``fork`` or ``spawn``) and its ``Process`` is kept
   before it starts; SIGINT/SIGTERM only set a flag while ranks run (:func:`caught_signals`), so
   no signal can land between a start and its bookkeeping;
2. it moves into a process group of its own (``setpgid``, by the rank and by this process, to
   win the race either way): ending the group also ends anything the rank started, and a Ctrl-C
   in the terminal reaches this process only, which then ends the ranks in order;
3. the kernel kills it if this process dies (``PR_SET_PDEATHSIG``, Linux), even by SIGKILL;
4. ending: SIGTERM to every group, up to ``GRACE_S`` to exit (a second signal skips the wait),
   SIGKILL to every group, then every rank is reaped. A rank that exited is not reaped before
   that (``waitid(WNOWAIT)``), so its process group id cannot have been reused when it is killed.

After a signal, :class:`ckplan.errors.Interrupted` is raised once everything is ended (exit
130 for SIGINT, 143 for SIGTERM).

Known limitations: a rank's child that leaves the rank's process group (``setsid``) and outlives
it is not found; signal handlers can only be installed from the main thread (from another thread
the ranks are still ended when the launch ends, but a signal does not end the launch early).
"""
from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .errors import Interrupted
from .launch_checks import (  # noqa: F401  (re-exported: the checks are part of launching)
    FD_BASE,
    FD_PER_PEER,
    MAX_RANKS_PER_CPU,
    Machine,
    check_rank_memory,
    check_ranks,
    cpu_count,
    fds_per_rank,
    machine,
    open_files_limit,
)

GRACE_S = 5.0  # how long ranks get to exit after SIGTERM before SIGKILL
SIGNALS = (signal.SIGINT, signal.SIGTERM)


# ---- signals --------------------------------------------------------------------------------
@dataclass
class Stop:
    """The signals that arrived while :func:`caught_signals` was active."""

    signals: list[int] = field(default_factory=list)

    @property
    def signum(self) -> int | None:
        return self.signals[0] if self.signals else None

    @property
    def hurry(self) -> bool:
        """A second signal: end the ranks without waiting for them."""
        return len(self.signals) > 1

    def interrupted(self, what: str) -> Interrupted:
        name = signal.Signals(self.signum).name
        return Interrupted(f"{what} stopped by {name}; every rank ckplan started was ended and its "
                           "temporary files removed, no report was written", signum=self.signum)


_active: Stop | None = None


@contextlib.contextmanager
def caught_signals(what: str = "the run"):
    """SIGINT and SIGTERM set a flag instead of raising, for the ranks' sake; the handlers that
    were there are put back at the end, and :class:`Interrupted` is raised then if a signal
    came. Nested uses share the outermost one. Off the main thread nothing is installed."""
    global _active
    if _active is not None:
        yield _active
        return
    stop = Stop()
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return
    saved = {sig: signal.getsignal(sig) for sig in SIGNALS}

    def handler(signum, frame):
        stop.signals.append(signum)

    _active = stop
    try:
        for sig in SIGNALS:
            signal.signal(sig, handler)
        yield stop
    finally:
        _active = None
        for sig, old in saved.items():
            signal.signal(sig, old if old is not None else signal.SIG_DFL)
    if stop.signum is not None:
        raise stop.interrupted(what)


# ---- ranks ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Outcome:
    """How the ranks ended. Exit codes as ``multiprocessing``: negative for a signal."""

    exitcodes: tuple[int | None, ...]  # None: never started
    failed: tuple[int, ...]  # ranks that failed on their own (before the others were ended), by rank
    timed_out: bool = False

    @property
    def ok(self) -> bool:
        return not self.failed and not self.timed_out and all(c == 0 for c in self.exitcodes)


def describe_exit(code: int | None) -> str:
    if code is None:
        return "was never started"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        why = " (the kernel's out-of-memory killer sends it)" if -code == signal.SIGKILL else ""
        return f"was killed by {name}{why}"
    return f"exited with code {code}"


def run_ranks(fn: Callable[[Any], None], arg: Any, nproc: int, *, start_method: str = "fork",
              env: dict[str, str] | None = None, log_dir: str | None = None,
              deadline_s: float | None = None, what: str = "the run") -> Outcome:
    """Run ``fn(arg)`` in ``nproc`` processes with ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE`` and
    ``env`` set; return when every one has exited, or when one fails, or past ``deadline_s``,
    with every process it started ended (see the module doc). Raises :class:`Interrupted` on
    SIGINT/SIGTERM, after ending them. ``log_dir``: each rank's stdout and stderr go to
    ``rank<N>.log`` there (else they stay this process's)."""
    import multiprocessing as mp
    from multiprocessing.connection import wait

    ctx = mp.get_context(start_method)
    procs: list = []
    failed: list[int] = []
    timed_out = False
    for stream in (sys.stdout, sys.stderr):  # a forked rank must not write this process's buffers again
        with contextlib.suppress(Exception):
            stream.flush()
    with caught_signals(what) as stop:
        try:
            for rank in range(nproc):
                if stop.signum is not None:
                    break
                rank_env = {**(env or {}), "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc),
                            "LOCAL_WORLD_SIZE": str(nproc), "GROUP_RANK": "0"}
                log = os.path.join(log_dir, f"rank{rank}.log") if log_dir else None
                p = ctx.Process(target=_rank_entry, args=(fn, arg, rank_env, os.getpid(), log),
                                name=f"ckplan-rank{rank}")
                procs.append(p)  # kept before it starts: whatever happens next, it is ended
                _start_rank(p)
            end = None if deadline_s is None else time.monotonic() + deadline_s
            while stop.signum is None and len(procs) == nproc:
                codes = [_peek_exit(p) for p in procs]
                failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
                if failed or all(c == 0 for c in codes):
                    break
                if end is not None and time.monotonic() > end:
                    timed_out = True
                    break
                wait([p.sentinel for p, c in zip(procs, codes) if c is None], timeout=0.2)
        finally:
            codes = _end(procs, stop)
        if stop.signum is not None:
            raise stop.interrupted(what)
    codes = tuple(codes) + (None,) * (nproc - len(codes))
    return Outcome(exitcodes=codes, failed=tuple(failed), timed_out=timed_out)


def _start_rank(p) -> None:
    import multiprocessing.process
    p.start()
    # multiprocessing reaps the children it knows of whenever another process starts; this
    # launcher reaps its ranks itself, last, so that a rank's pid (its group's id) stays its own
    # until its group has been killed.
    multiprocessing.process._children.discard(p)
    with contextlib.suppress(OSError):  # the rank does it too; spawn's exec makes this one fail
        os.setpgid(p.pid, p.pid)


def _peek_exit(p) -> int | None:
    """The rank's exit code if it has exited, without reaping it (its pid stays reserved)."""
    try:
        st = os.waitid(os.P_PID, p.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:  # reaped elsewhere (a SIGCHLD handler, os.wait)
        return p.exitcode
    if st is None or st.si_pid == 0:
        return None
    return st.si_status if st.si_code == os.CLD_EXITED else -st.si_status


def _end(procs: list, stop: Stop) -> list[int | None]:
    """SIGTERM, a bounded wait, SIGKILL to every rank's process group; reap every rank."""
    started = [p for p in procs if p.pid is not None]
    for p in started:
        if _peek_exit(p) is None:
            _signal_rank(p, signal.SIGTERM)
    end = time.monotonic() + GRACE_S
    from multiprocessing.connection import wait
    while not stop.hurry and time.monotonic() < end:
        alive = [p for p in started if _peek_exit(p) is None]
        if not alive:
            break
        wait([p.sentinel for p in alive], timeout=0.1)
    for p in started:
        _signal_rank(p, signal.SIGKILL)  # also the rank's own children, after it has exited
    codes = []
    for p in procs:
        if p.pid is None:
            codes.append(None)
            continue
        p.join()
        codes.append(p.exitcode)
        with contextlib.suppress(ValueError):
            p.close()
    return codes


def _signal_rank(p, sig: int) -> None:
    if getattr(p, "_popen", None) is not None and p._popen.returncode is not None:
        return  # reaped before us: its pid (and group id) may belong to someone else now
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(p.pid, sig)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(p.pid, sig)  # not yet in its own group; an unreaped pid cannot have been reused


def _rank_entry(fn, arg, env: dict[str, str], parent: int, log: str | None) -> None:
    """First code of every rank: own group, die with the parent, default signals, logs."""
    for sig in SIGNALS:  # a forked rank inherits the launcher's flag-setting handlers
        signal.signal(sig, signal.SIG_DFL)
    with contextlib.suppress(OSError):
        os.setpgid(0, 0)
    _die_with(parent)
    if log is not None:
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        # Also Python's streams, which a caller may have pointed elsewhere (pytest's capture).
        sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 (for the life of the rank)
        sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115 (for the life of the rank)
    os.environ.update(env)
    fn(arg)


def _die_with(parent: int) -> None:
    """The kernel sends SIGKILL to this process when its parent dies (Linux); exit now if it
    already has."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:
        os._exit(1)
