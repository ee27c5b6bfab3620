"""Machine-readable outputs: JSON envelopes, DataFrames, CSV/PNG files written atomically."""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any, Callable

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
