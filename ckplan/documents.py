"""The saved files ckplan reads and writes: plan files (the one plan-file reader, :func:`read_plan`),
profile files (:func:`load_profile`, checked by :mod:`ckplan.profile_doc`), and the output files
and folders checked before a long run.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .errors import SpecError, UsageError
from .options import PLAN_OPTIONS
from .planner import Plan
from .planner.plan_json import check_plan_header
from .profile_doc import profile_problem
from .records import Profile
from .report import check_output_dir as _check_output_dir
from .report import check_output_file as _check_output_file

PLAN_TIP = "make one with `ckplan plan SPEC --budget 12GB -o plan.json` (or `--profile profile.json`)"


# What each ckplan JSON document is, by its "command" field (ckplan.report.envelope).
_DOCUMENTS = {
    "profile": "a ckplan profile (command: profile)",
    "plan": "a ckplan plan (command: plan)",
    "plan-world-sizes": "a ckplan per-rank table (command: plan-world-sizes, from `plan --world-size N,M`)",
    "plan-sweep": "a ckplan sweep (command: plan-sweep)",
    "bench": "a ckplan bench report (command: bench)",
    "bench-distributed": "a ckplan bench report (command: bench-distributed)",
}


def _other_document(data: Any, want: str) -> str | None:
    """What ``data`` is when it is a ckplan document of another kind than ``want``, else None."""
    command = data.get("command") if isinstance(data, dict) else None
    if command is None or command == want:
        return None
    return _DOCUMENTS.get(str(command), f"a ckplan {str(command)!r} document (command: {command})")


def _check_input_file(p: Path, what: str, tip: str) -> None:
    """A file to read exists and is a regular file (a folder is said to be one)."""
    if p.is_dir():
        raise SpecError(f"{what} {str(p)!r} is a folder, not a file", tip=tip)
    if not p.exists():
        raise SpecError(f"{what} {str(p)!r} does not exist", tip=tip)
    if not p.is_file():
        raise SpecError(f"{what} {str(p)!r} is not a regular file", tip=tip)


def _read_json(p: Path, what: str, tip: str) -> Any:
    """The JSON document in ``p``, a ckplan ``what`` ("plan", "profile") file, or one
    :class:`SpecError` naming the file and what is wrong with it."""
    _check_input_file(p, f"{what} file", tip)
    try:
        return json.loads(p.read_bytes().decode("utf-8"))
    except UnicodeDecodeError:
        raise SpecError(f"{p}: not a UTF-8 text file, so not a {what} JSON", tip=tip) from None
    except ValueError as e:
        raise SpecError(f"{p}: not JSON ({e})", tip=tip) from None
    except OSError as e:
        raise SpecError(f"{what} file {str(p)!r} cannot be read ({e.strerror})", tip=tip) from None


def read_plan(path: str | Path, *, chain_layers: int | None = None, chain: str | None = None,
              chain_tip: str | None = None, where: str | None = None):
    """The plan in a file written by ``ckplan plan -o plan.json`` (or a bare ``Plan.to_dict()``),
    and the document around it (``{}`` for a bare plan): ``(Plan, doc)``.

    Raises :class:`SpecError` naming the file for anything else: a folder, not UTF-8 JSON, another
    ckplan document (a profile, a per-rank table), or a broken plan. With ``chain`` (the model's
    chain path) and ``chain_layers`` (its length), a plan made for another chain is refused
    (:func:`check_plan_chain`) before any of its layers is built.
    """
    body, doc = read_plan_document(path, where=where)
    check_plan_chain(doc, chain, where or str(path), tip=chain_tip)
    return plan_of(body, where or str(path), chain_layers=chain_layers), doc


def read_plan_document(path: str | Path, *, where: str | None = None) -> tuple[dict, dict]:
    """``(plan object, the document around it or {})`` of a plan file, its header checked
    (keys, format, option names: :func:`ckplan.planner.plan_json.check_plan_header`), no layer built
    yet (:func:`plan_of` checks ``n_layers`` against the chain, then builds it)."""
    p = Path(path)
    data = _read_json(p, "plan", PLAN_TIP)
    other = _other_document(data, "plan")
    if other is not None:
        how = ("make a plan from it with `ckplan plan --profile {p} --budget 12GB -o plan.json`"
               if data.get("command") == "profile" else
               "make a plan for one world size with `ckplan plan SPEC --world-size N -o plan.json`"
               if data.get("command") == "plan-world-sizes" else
               "make a plan with `ckplan plan SPEC --budget 12GB -o plan.json`")
        raise SpecError(f"{p}: this file is {other}, not a plan", tip=how.format(p=p))
    if not isinstance(data, dict):
        raise SpecError(f"{p}: a plan must be a JSON object, not {type(data).__name__}", tip=PLAN_TIP)
    body = data.get("plan", data)
    if not isinstance(body, dict):
        raise SpecError(f"{p}: the plan must be a JSON object, not {type(body).__name__}", tip=PLAN_TIP)
    try:
        check_plan_header(body, chain_layers=None, limit=False, known_options=PLAN_OPTIONS)
    except SpecError as e:
        raise SpecError(f"{where or p}: {e.message}",
                        tip=e.tip or f"the file is not a valid plan; {PLAN_TIP}") from None
    return body, (data if body is not data else {})


def plan_of(body: dict, where: str, *, chain_layers: int | None = None):
    """The :class:`ckplan.planner.Plan` of a plan object read by :func:`read_plan_document`;
    ``chain_layers``: the chain's length, checked before any layer is built."""
    try:
        return Plan.from_dict(body, chain_layers=chain_layers, known_options=PLAN_OPTIONS)
    except SpecError as e:
        raise SpecError(f"{where}: {e.message}", tip=e.tip or f"the file is not a valid plan; {PLAN_TIP}") from None


def check_plan_chain(doc: dict, chain: str | None, where: str, *, tip: str | None = None) -> None:
    """Refuse a plan document whose recorded chain is not ``chain`` (the model's chain path):
    its layer indices would checkpoint another model's layers. ``tip`` may name the recorded
    chain as ``{recorded}``."""
    recorded = doc.get("chain")
    if chain is None or not isinstance(recorded, str) or recorded == chain:
        return
    model = doc.get("model")
    made_for = f" for model {model!r}" if isinstance(model, str) else ""
    default = ("make the plan for this model (the same spec, the same chain): "
               "`ckplan plan SPEC --budget ... -o plan.json`")
    raise SpecError(f"{where}: the plan was made{made_for} with chain {recorded!r}, but this model's chain is "
                    f"{chain!r}", tip=tip.format(recorded=recorded) if tip else default)


def load_profile(path: str | Path) -> Profile:
    p = Path(path)
    tip = "save one with: ckplan profile SPEC --format json -o profile.json"
    data = _read_json(p, "profile", tip)
    other = _other_document(data, "profile")
    if other is not None:
        raise SpecError(f"{p}: this file is {other}, not a profile", tip=tip)
    problem = profile_problem(data)
    if problem is not None:
        raise SpecError(f"{p}: not a valid ckplan profile: {problem}", tip=tip)
    try:
        return Profile.from_dict(data)
    except (ValueError, KeyError, TypeError) as e:
        raise SpecError(f"{p}: not a ckplan profile ({type(e).__name__}: {e})", tip=tip) from None


# ---- output files, checked before the run ----------------------------------------------------

def check_output_file(path: str | Path, *, csv: bool = True, inputs: dict[str, Any] | None = None) -> None:
    """Refuse, before a long run, an output file ckplan could not write (or must not replace);
    ``csv=False``: a command that writes only JSON refuses a ``.csv`` name too. ``inputs``: the
    files the command reads (``{"--profile": path}``), which the output must not be."""
    if not csv and Path(path).suffix.lower() == ".csv":
        raise UsageError(f"-o {path}: this command writes JSON, not CSV", tip="use a .json file name")
    for what, source in (inputs or {}).items():
        if source is not None and _same_file(Path(path), Path(source)):
            raise UsageError(f"-o {path} is the file {what} reads ({source}): writing the result there would "
                             "replace the command's own input", tip="write the result to another file")
    _check_output_file(path, "-o")


def _same_file(a: Path, b: Path) -> bool:
    """Whether ``a`` and ``b`` name one file (the same path, a link to it, or another spelling)."""
    try:
        if a.exists() and b.exists():
            return a.samefile(b)
        return a.resolve() == b.resolve()
    except OSError:
        return False


def check_output_dir(path: str | Path) -> None:
    """Refuse, before a long run, an output folder ckplan could not create or write into."""
    _check_output_dir(path, "--out-dir")

