"""Writing files safely: only regular files, checked before a run, written as a set all or nothing
(temporary files renamed into place, Ctrl-C deferred during the renames).

ckplan writes only regular files, and only where the target is absent or already a regular file:
renaming a temporary file over a symlink, a FIFO or a device node would replace something that is
not ours (as root, ``-o /dev/full`` replaced the device). New files get 0666 less the user's umask,
as ``open()`` would give them (``mkstemp`` makes 0600); a file written again keeps its mode.
"""
from __future__ import annotations

import contextlib
import errno
import os
import secrets
import signal
import stat
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

from ..errors import UsageError, WriteError


class ReportsInterrupted(KeyboardInterrupt):
    """Ctrl-C while a set of reports was written; ``kept`` says which whole set is on disk."""

    def __init__(self, kept: str, paths: list[Path], signum: int = 2):
        self.signum = signum  # what stopped it: 2 SIGINT, 15 SIGTERM
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
    except KeyboardInterrupt as k:
        _unlink_all(temps)
        raise ReportsInterrupted("previous", paths, getattr(k, "signum", 2)) from None
    except OSError as e:  # a full disk, a folder gone read-only: said with the file's name
        _unlink_all(temps)
        raise _write_error(e, current, paths, what) from None
    except BaseException:
        _unlink_all(temps)
        raise
    try:
        with _sigint_deferred() as interrupted:
            _rename_all(temps, paths, what)
    except KeyboardInterrupt as k:  # in the instant before or after the deferral: look at what is on disk
        renamed = not any(t.exists() for t in temps)
        _unlink_all(temps)
        raise ReportsInterrupted("new" if renamed else "previous", paths, getattr(k, "signum", 2)) from None
    if interrupted():
        raise ReportsInterrupted("new", paths, interrupted())
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
    """Hold Ctrl-C and SIGTERM until the block ends (main thread only; elsewhere signals cannot be
    handled); yields what says the first signal held (0: none)."""
    got: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield lambda: 0
        return
    old = {sig: signal.signal(sig, lambda signum, frame: got.append(signum))
           for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield lambda: got[0] if got else 0
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


def write_text(path: str | Path, text: str) -> Path:
    return atomic_write(path, lambda p: p.write_text(text))


def write_csv(path: str | Path, frame) -> Path:
    return atomic_write(path, lambda p: frame.to_csv(p, index=False))
