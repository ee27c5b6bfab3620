"""One function per command; the CLI and Python users call these.

Each returns frozen records (ckplan.records, ckplan.planner, ckplan.bench); nothing here prints.
"""
from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

from .errors import DependencyError, InfeasibleBudgetError, SpecError, UsageError
from .options import DEVICES, OPTIMIZER_ALIASES, OPTIMIZERS, PRECISIONS, STRATEGIES, Device, Strategy
from .records import CHAIN, POST, PRE, OptionRecord, Profile, StageRecord, Totals
from .spec import Spec, batch_bytes, build_model, check_overrides, load_spec, make_batch, to_loss

Progress = Callable[[str], None]  # told what a long step is doing now (a spinner, a bar)
Note = Callable[[str], None]  # told something the user should read (a line on stderr)


def resolve_device(device: str | Device | None):
    import torch
    device = "auto" if device is None else str(getattr(device, "value", device))
    if device not in DEVICES:
        raise UsageError(f"device={device!r} is not one of {', '.join(DEVICES)}")
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise UsageError("device 'cuda' was asked for, but PyTorch sees no CUDA GPU on this machine",
                         tip="use device cpu, or meta to profile without allocating")
    return torch.device(device)


def load(spec_or_path: Spec | str | Path, **overrides) -> Spec:
    """A spec from a YAML file (or a Spec), with overrides: batch_size, seq_len, precision, optimizer, accum."""
    unknown = sorted(set(overrides) - {"batch_size", "seq_len", "precision", "optimizer", "accum"})
    if unknown:
        raise UsageError(f"load() got unknown override {unknown[0]!r}",
                         tip="overrides are batch_size, seq_len, precision, optimizer, accum")
    overrides = {k: v for k, v in overrides.items() if v is not None}
    check_overrides(**overrides)  # before reading the file: the argument is named, not the spec field
    spec = spec_or_path if isinstance(spec_or_path, Spec) else load_spec(spec_or_path)
    return spec.with_overrides(**overrides) if overrides else spec


def _note(note: Note | None, message: str) -> None:
    if note is not None:
        note(message)
    else:
        warnings.warn(message, stacklevel=3)


def _tick(progress: Progress | None, message: str) -> None:
    if progress is not None:
        progress(message)


def preflight(spec: Spec, device: str | Device | None = "auto", *, force: bool = False,
              progress: Progress | None = None, note: Note | None = None, hold: list[str] | None = None):
    """Predict the step's peak with a meta pass and refuse a real-device run that cannot fit.

    Returns the :class:`ckplan.preflight.Verdict`, or None when nothing was checked (meta device;
    a model the meta pass cannot run, e.g. one that reads tensor values). Raises
    :class:`UsageError` naming the predicted peak, the available memory and the fixes, unless
    ``force``. ``hold``: the "preflight skipped" note goes there instead of to ``note``, for the
    caller to show only when the real run works (when it fails too, its error says it once).
    """
    from .preflight import available_memory, decide
    dev = resolve_device(device)
    if dev.type not in ("cpu", "cuda"):
        return None
    _tick(progress, f"preflight: predicting the peak on the meta device ({spec.name})")
    try:
        model = build_model(spec, "meta")
        args, kwargs = make_batch(spec, "meta")
        # The meta pass follows the attention kernels of the device the run will use.
        meta = profile_model(model, args, kwargs, name=spec.name or type(model).__name__,
                             chain=spec.chain, device="meta", optimizer=spec.train.optimizer,
                             precision=spec.train.precision, accum=spec.train.accum, lr=spec.train.lr,
                             repeats=1, warmup=0, meta_target=dev.type)
    except (SpecError, UsageError, DependencyError):
        raise  # the same mistake would stop the real run: say it now
    except Exception as e:  # the model cannot run on fake tensors; the real run may still work
        text = str(getattr(e, "message", e)).strip()
        first = text.splitlines()[0] if text else ""
        first = first if len(first) <= 240 else first[:240] + "..."
        skipped = (f"preflight skipped: the meta pass failed ({type(e).__name__}: {first}), so "
                   f"ckplan cannot tell beforehand whether one step fits on {dev.type}")
        if hold is not None:
            hold.append(skipped)
        else:
            _note(note, skipped)
        return None
    verdict = decide(meta.totals.predicted_peak_bytes, available_memory(dev), dev.type)
    if not verdict.fits:
        if not force:
            raise UsageError(verdict.message(), tip=verdict.tip())
        _note(note, f"running anyway (force): {verdict.message()}")
    return verdict


def profile(spec: Spec, *, device: str | Device | None = "auto", repeats: int = 3, warmup: int = 1,
            force: bool = False, progress: Progress | None = None, note: Note | None = None,
            options: bool | Sequence[str] = False, compile: bool = False,
            meta_target: str | None = None) -> Profile:
    """Build the spec's model and batch on ``device`` and profile one training step.

    On cpu/cuda a meta pass first checks that the step fits (:func:`preflight`); ``force=True``
    runs anyway. ``options``: also measure selective options; ``compile``: measure the chain
    layers compiled (see :func:`profile_model`). ``meta_target`` (``device="meta"`` only): the
    device the fake-tensor profile stands for, 'cpu' or 'cuda' (default: cuda when this machine
    has a GPU, else cpu).
    """
    check_positive("repeats", repeats)
    check_positive("warmup", warmup, minimum=0)
    dev = resolve_device(device)
    meta_target = check_meta_target(meta_target, dev.type)
    held: list[str] = []  # a skipped preflight is said only if the real run works (else its error says it)
    preflight(spec, dev.type, force=force, progress=progress, note=note, hold=held)
    _tick(progress, f"building {spec.name} on {dev.type}")
    model = build_model(spec, str(dev))
    args, kwargs = make_batch(spec, str(dev))
    names = compile_options(option_names(options, compile=compile), compile, dev.type)
    _tick(progress, f"profiling one training step of {spec.name} on {dev.type}"
                    + ("" if dev.type == "meta" else f" ({warmup} warm-up, {repeats} timed)")
                    + (f", then {len(names)} selective options" if names else "")
                    + (", then with the chain layers compiled" if compile else ""))
    prof = profile_model(model, args, kwargs, name=spec.name or type(model).__name__, chain=spec.chain,
                         device=dev, optimizer=spec.train.optimizer, precision=spec.train.precision,
                         accum=spec.train.accum, lr=spec.train.lr, repeats=repeats, warmup=warmup,
                         spec=spec.model_dump(mode="json"), options=names, compile=compile,
                         meta_target=meta_target)
    for text in held:
        _note(note, text)
    return prof


def check_meta_target(meta_target, device_type: str) -> str | None:
    """``meta_target`` as 'cpu' or 'cuda' (None: the default), refused off meta."""
    if meta_target is None:
        return None
    target = str(getattr(meta_target, "value", meta_target))
    if target not in ("cpu", "cuda"):
        raise UsageError(f"target {target!r} is not one of cpu, cuda",
                         tip="--target names the device a --device meta profile stands for: cpu or cuda")
    if device_type != "meta":
        raise UsageError(f"--target {target} is for --device meta (this profile runs on {device_type})",
                         tip="drop --target, or add --device meta to plan for a machine you do not have")
    return target


def compile_options(names: tuple[str, ...], compile: bool, device_type: str) -> tuple[str, ...]:
    """The options to measure (with ``compile``: compiled in, :mod:`ckplan.compiled`); compiling
    on meta, or where TorchInductor cannot compile, is refused."""
    if not compile:
        return names
    if device_type == "meta":
        raise UsageError("--compile measures compiled layers on cpu or cuda, not on meta",
                         tip="drop --compile for a meta plan, or profile on --device cpu/cuda")
    from .compiled import compile_unavailable
    why = compile_unavailable(device_type)
    if why:
        raise UsageError(f"--compile cannot compile the chain layers here: {why}", tip="drop --compile")
    return names


def option_names(options: bool | Sequence[str] | None, *, compile: bool = False) -> tuple[str, ...]:
    """The selective options to measure: True for all of ckplan.sac.POLICIES (and, with
    ``compile``, the min-cut options ``ckplan.sac.MINCUT``), False/None for none, or the names
    themselves (checked; min-cut ones only with ``compile``)."""
    if options is None or options is False:
        return ()
    from .sac import MINCUT, OPTIONS, POLICIES
    if options is True:
        return POLICIES + (tuple(MINCUT) if compile else ())
    if isinstance(options, str):
        options = [options]
    names = tuple(dict.fromkeys(str(o) for o in options))
    unknown = [o for o in names if o not in OPTIONS]
    if unknown:
        raise UsageError(f"unknown selective option {unknown[0]!r}", tip=f"use some of: {', '.join(OPTIONS)}")
    eager = [o for o in names if o in MINCUT and not compile]
    if eager:
        raise UsageError(f"selective option {eager[0]!r} needs compiled chain layers",
                         tip="add --compile (compile=True), or choose from: " + ", ".join(POLICIES))
    return names


def check_positive(name: str, value, *, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise UsageError(f"{name}={value!r} must be a whole number of at least {minimum}")


def check_train_args(*, optimizer: str, precision: str, accum: int) -> None:
    """The training settings a Python caller passes, named as the caller wrote them."""
    if str(precision) not in PRECISIONS:
        raise UsageError(f"precision={precision!r} is not one of {', '.join(PRECISIONS)}")
    if OPTIMIZER_ALIASES.get(str(optimizer), str(optimizer)) not in OPTIMIZERS:
        raise UsageError(f"optimizer={optimizer!r} is not one of {', '.join(OPTIMIZERS)}")
    check_positive("accum", accum)


def profile_model(model, args, kwargs, *, name: str, chain: str | None, device, optimizer: str = "adamw",
                  precision: str = "fp32", accum: int = 1, lr: float = 1e-4, repeats: int = 3,
                  warmup: int = 1, spec: dict | None = None, loss_fn=to_loss,
                  meta_target: str | None = None, options: bool | Sequence[str] = False,
                  compile: bool = False) -> Profile:
    """Profile any model on a sample batch; the model is not changed.

    On ``device="meta"``, ``meta_target`` ('cpu' or 'cuda'; default: cuda when this machine has
    one, else cpu) is the device whose attention kernels the fake pass follows.
    ``options``: also measure the chain layers' selective options (:mod:`ckplan.sac`; True: all
    of ``POLICIES``, or a list of names), one more measured step (and ``repeats`` timed ones) each.
    ``compile``: measure the chain layers compiled with ``torch.compile`` (:mod:`ckplan.compiled`;
    not on meta), their options compiled in: the plans are then for compiled layers, to be run
    inside ``ckplan.compiled_layers(model)``.
    """
    import torch

    from .chainfind import tensor_leaves
    from .measure import cuda_runtime_bytes, device_info
    from .profiler import measure_step
    from .sdpa import default_target
    from .training import optimizer_memory, optimizer_step_ms

    check_train_args(optimizer=optimizer, precision=precision, accum=accum)
    optimizer = OPTIMIZER_ALIASES.get(str(optimizer), str(optimizer))
    precision = str(precision)
    dev = torch.device(str(device)) if not isinstance(device, torch.device) else device
    m = measure_step(model, args, kwargs, loss_fn, chain=chain, device=dev, precision=precision,
                     repeats=repeats, warmup=warmup, accum=accum, meta_target=meta_target,
                     options=option_names(options, compile=compile), compile=compile)
    params = list(dict.fromkeys(model.parameters()))
    trainable = [p for p in params if p.requires_grad]
    # On meta the optimizer is the one the target device runs (foreach on CUDA, counters on the host).
    opt_dev = dev.type if dev.type != "meta" else (meta_target or default_target())
    opt_state, opt_tmp, opt_scalars = optimizer_memory(trainable, optimizer, lr, opt_dev)
    info = device_info(dev)
    runtime = cuda_runtime_bytes(dev, [*params, *(p.grad for p in params), *model.buffers(),
                                      *tensor_leaves((args, kwargs))]) if dev.type == "cuda" else 0
    param_bytes = sum(p.untyped_storage().nbytes() for p in params)
    buffer_bytes = sum(b.untyped_storage().nbytes() for b in dict.fromkeys(model.buffers()))
    inputs = batch_bytes(args, kwargs)
    notes = list(m.notes)
    if dev.type == "meta":
        notes.append("meta device: sizes and FLOPs are exact; times are estimated from FLOPs "
                     "at an assumed 100 TFLOP/s, not measured")
        if precision != "fp32":
            notes.append(f"meta device: autocast ({precision}) is not modelled; sizes are for fp32")
        if (meta_target or default_target()) == "cuda":
            notes.append(meta_cuda_note(any("memory-efficient" in n for n in m.notes)))
    totals = Totals(
        param_bytes=param_bytes, buffer_bytes=buffer_bytes,
        trainable_bytes=sum(p.numel() * p.element_size() for p in trainable),
        grad_bytes=m.grad_bytes, optimizer_bytes=opt_state, optimizer_tmp_bytes=opt_tmp,
        input_bytes=inputs, activation_bytes=sum(r.saved_bytes for r in m.rows),
        predicted_peak_bytes=0,
        measured_peak_bytes=None if dev.type == "meta" else
        param_bytes + buffer_bytes + inputs + opt_state + runtime + m.measured_peak_rel,
        optimizer_ms=optimizer_step_ms(trainable, optimizer, lr, dev),
        optimizer_scalar_bytes=opt_scalars, runtime_bytes=runtime,
    )
    prof = Profile(
        model=name, device=dev.type, device_name=info.name, chain=m.chain_path,
        chain_detected=m.chain_detected, batch_size=_batch_size(args, kwargs), precision=precision,
        optimizer=optimizer, accum=accum, input_requires_grad=m.input_requires_grad,
        times_estimated=dev.type == "meta", layers=m.rows, totals=totals,
        device_total_bytes=info.total_bytes, device_free_bytes=info.free_bytes,
        notes=tuple(notes), spec=spec or {}, compiled=compile, side_inputs=m.side_inputs,
        chain_breaks=m.chain_breaks, flops_estimated=m.flops_estimated,
    )
    return replace(prof, totals=replace(totals, predicted_peak_bytes=predicted_peak_none(prof)))


def meta_cuda_note(efficient_attention: bool) -> str:
    """What a meta profile for a CUDA target leaves out, as measured on an H200 (session 15)."""
    text = ("meta device for a CUDA target: not included are the CUDA runtime's own allocator blocks "
            "(cuBLAS workspaces, one per thread: 66.8 MiB on an H200 with torch 2.11)")
    if efficient_attention:
        text += (" and the memory-efficient attention backward's workspace (fp32 on an H200: two "
                 "query-sized buffers, 24 MiB per layer backward for gpt2-small at 8 x 512)")
    return text + "; leave that much room in the budget, or profile on the GPU"


def predicted_peak_none(prof: Profile) -> int:
    """Peak of one step without checkpointing, by the planner's memory model (README)."""
    from .planner import predicted_peak_none as _pp
    return _pp(prof)


def _batch_size(args, kwargs) -> int:
    import torch
    for t in list(args) + list(kwargs.values()):
        if isinstance(t, torch.Tensor) and t.dim() > 0:
            return int(t.shape[0])
    return 1


# ---- saved files: profiles and plans ---------------------------------------------------------

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
    import json
    _check_input_file(p, f"{what} file", tip)
    try:
        return json.loads(p.read_bytes().decode("utf-8"))
    except UnicodeDecodeError:
        raise SpecError(f"{p}: not a UTF-8 text file, so not a {what} JSON", tip=tip) from None
    except ValueError as e:
        raise SpecError(f"{p}: not JSON ({e})", tip=tip) from None
    except OSError as e:
        raise SpecError(f"{what} file {str(p)!r} cannot be read ({e.strerror})", tip=tip) from None


def read_plan(path: str | Path):
    """The plan in a file written by ``ckplan plan -o plan.json`` (or a bare ``Plan.to_dict()``),
    and the document around it (``{}`` for a bare plan): ``(Plan, doc)``.

    Raises :class:`SpecError` naming the file for anything else: a folder, not UTF-8 JSON, another
    ckplan document (a profile, a per-rank table), or a broken plan.
    """
    from .planner import Plan
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
        plan = Plan.from_dict(body)
    except SpecError as e:
        raise SpecError(f"{p}: {e.message}", tip=e.tip or f"the file is not a valid plan; {PLAN_TIP}") from None
    return plan, (data if body is not data else {})


def check_plan_chain(doc: dict, chain: str | None, where: str, *, tip: str | None = None) -> None:
    """Refuse a plan document whose recorded chain is not ``chain`` (the model's chain path):
    its layer indices would checkpoint another model's layers."""
    recorded = doc.get("chain")
    if chain is None or not isinstance(recorded, str) or recorded == chain:
        return
    model = doc.get("model")
    made_for = f" for model {model!r}" if isinstance(model, str) else ""
    raise SpecError(f"{where}: the plan was made{made_for} with chain {recorded!r}, but this model's chain is "
                    f"{chain!r}", tip=tip or "make the plan for this model (the same spec, the same chain): "
                                             "`ckplan plan SPEC --budget ... -o plan.json`")


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


# The planner adds and compares profile integers as int64; 2**62 (4 EiB, 4.6e18 FLOPs) leaves it
# room for sums. A larger value is no machine's memory (it would overflow, exit 1, if accepted).
MAX_PROFILE_INT = 2**62


def _too_large(where: str, value: int) -> str:
    text = str(value) if len(str(value)) <= 24 else f"about 1e{len(str(value)) - 1}"
    what = "larger than any machine's memory" if "bytes" in where else "too large to plan with"
    return f"{where} is {text}, above the limit 2**62 = {MAX_PROFILE_INT} ({what})"


def _number_problem(where: str, value: Any, kind: str, *, optional: bool = False) -> str | None:
    if value is None and optional:
        return None
    if kind == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            return f"{where} is {value!r}, not a whole number"
        if value > MAX_PROFILE_INT:
            return _too_large(where, value)
    elif isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return f"{where} is {value!r}, not a finite number"
    if value < 0:
        return f"{where} is {value!r}, a negative {'size' if 'bytes' in where else 'value'}"
    return None


def _options_problem(where: str, options: Any) -> str | None:
    """What is wrong with a row's measured selective options, or None."""
    if not isinstance(options, list):
        return f"{where} is not a list"
    kinds = {f.name: str(f.type) for f in fields(OptionRecord)}
    for j, o in enumerate(options):
        if not isinstance(o, dict):
            return f"{where}[{j}] is not an object"
        missing = [k for k in kinds if k not in o]
        if missing:
            return f"{where}[{j}].{missing[0]} is missing"
        if not isinstance(o["name"], str) or not o["name"] or o["name"] in ("store", "full"):
            return f"{where}[{j}].name is {o['name']!r}, not the name of a selective option"
        for key, kind in kinds.items():
            if kind in ("int", "float"):
                problem = _number_problem(f"{where}[{j}].{key}", o[key], kind)
                if problem:
                    return problem
    return None


def profile_problem(data: Any) -> str | None:
    """What is wrong with a profile document (one field named), or None when the planner can trust it.

    Rows must be pre (index -1), chain layers 0..n-1 in order, post (index n); sizes, FLOPs and
    times finite and not negative.
    """
    if not isinstance(data, dict):
        return f"expected a JSON object, got {type(data).__name__}"
    for key in ("layers", "totals"):
        if key not in data:
            return f"field {key!r} is missing"
    layers, totals = data["layers"], data["totals"]
    if not isinstance(layers, list) or len(layers) < 3:
        return "layers must list the pre row, at least one chain layer and the post row"
    kinds = {f.name: str(f.type) for f in fields(StageRecord)}
    n = len(layers) - 2
    for i, row in enumerate(layers):
        if not isinstance(row, dict):
            return f"layers[{i}] is not an object"
        # Older profiles have no options and no recompute_ms.
        missing = [k for k in kinds if k not in row
                   and k not in ("options", "recompute_ms", "output_kept", "output_in_place", "output_saved_after",
                                 "early_peak_bytes", "early_kept_bytes", "backward_lead_bytes",
                                 "nosave_peak_bytes", "unsaved_kept_bytes", "kept_after_backward_bytes")]
        if missing:
            return f"layers[{i}].{missing[0]} is missing"
        want_index = i - 1
        want_role = PRE if i == 0 else POST if i == n + 1 else CHAIN
        if row["index"] != want_index or isinstance(row["index"], bool):
            return (f"layers[{i}].index is {row['index']!r}, expected {want_index} (rows must be pre -1, "
                    f"chain layers 0..{n - 1} in order, post {n}: duplicated or missing rows?)")
        if row["role"] != want_role:
            return f"layers[{i}].role is {row['role']!r}, expected {want_role!r}"
        for key, kind in kinds.items():
            if kind in ("int", "float") and key != "index":
                problem = _number_problem(f"layers[{i}].{key}", row[key], kind)
                if problem:
                    return problem
        problem = (_number_problem(f"layers[{i}].recompute_ms", row.get("recompute_ms"), "float",
                                   optional=True)
                   or _options_problem(f"layers[{i}].options", row.get("options", [])))
        if problem:
            return problem
        if row.get("output_in_place", False) not in (True, False):
            return f"layers[{i}].output_in_place must be true or false, got {row['output_in_place']!r}"
        for k in ("early_peak_bytes", "early_kept_bytes", "backward_lead_bytes", "nosave_peak_bytes",
                  "unsaved_kept_bytes", "kept_after_backward_bytes"):
            v = row.get(k)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
                return f"layers[{i}].{k} must be a non-negative integer or null, got {v!r}"
            if v is not None and v > MAX_PROFILE_INT:
                return _too_large(f"layers[{i}].{k}", v)
        for key in ("output_kept", "output_saved_after"):
            if row.get(key) not in (None, True, False):
                return f"layers[{i}].{key} must be true, false or null, got {row[key]!r}"
    if not isinstance(totals, dict):
        return "totals is not an object"
    for f in fields(Totals):
        if f.name == "optimizer_ms":  # added later: optional, a number of milliseconds
            problem = _number_problem("totals.optimizer_ms", totals.get(f.name), "float", optional=True)
            if problem:
                return problem
            continue
        if f.name == "runtime_bytes":  # added later: optional
            problem = _number_problem(f"totals.{f.name}", totals.get(f.name, 0), "int")
            if problem:
                return problem
            continue
        if f.name == "optimizer_scalar_bytes":  # added later: optional, within optimizer_bytes
            value = totals.get(f.name, 0)
            problem = _number_problem(f"totals.{f.name}", value, "int")
            if problem:
                return problem
            if isinstance(totals.get("optimizer_bytes"), int) and value > totals["optimizer_bytes"]:
                return (f"totals.{f.name} is {value}, more than totals.optimizer_bytes "
                        f"({totals['optimizer_bytes']}) that it is part of")
            continue
        if f.name not in totals:
            return f"totals.{f.name} is missing"
        problem = _number_problem(f"totals.{f.name}", totals[f.name], "int", optional="None" in str(f.type))
        if problem:
            return problem
    for key in ("batch_size", "accum"):
        if key in data and (_number_problem(key, data[key], "int") or data[key] < 1):
            return f"{key} is {data[key]!r}, not a whole number of at least 1"
    if data.get("precision", "fp32") not in PRECISIONS:
        return f"precision is {data.get('precision')!r}, not one of {', '.join(PRECISIONS)}"
    if data.get("optimizer", "adamw") not in OPTIMIZERS:
        return f"optimizer is {data.get('optimizer')!r}, not one of {', '.join(OPTIMIZERS)}"
    if not isinstance(data.get("compiled", False), bool):
        return f"compiled is {data.get('compiled')!r}, not true or false"
    side = data.get("side_inputs", [])  # added later: optional
    if not isinstance(side, list):
        return "side_inputs is not a list"
    for j, si in enumerate(side):
        if not isinstance(si, dict) or "bytes" not in si or "layers" not in si:
            return f"side_inputs[{j}] is not an object with bytes and layers"
        problem = (_number_problem(f"side_inputs[{j}].bytes", si["bytes"], "int")
                   or _number_problem(f"side_inputs[{j}].grad_bytes", si.get("grad_bytes", 0), "int"))
        if problem:
            return problem
        ls = si["layers"]
        if (not isinstance(ls, list) or not ls
                or any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < n for i in ls)):
            return f"side_inputs[{j}].layers is {ls!r}, not a list of chain layer indices 0..{n - 1}"
        by = si.get("made_by", -1)  # added later: optional
        if isinstance(by, bool) or not isinstance(by, int) or not -1 <= by < min(ls):
            return (f"side_inputs[{j}].made_by is {by!r}, not -1 (before the chain) or a chain layer "
                    f"before every layer that receives them ({min(ls)})")
    breaks = data.get("chain_breaks", [])  # added in session 13: optional
    if (not isinstance(breaks, list)
            or any(isinstance(b, bool) or not isinstance(b, int) or not 0 < b < n for b in breaks)):
        return f"chain_breaks is {breaks!r}, not a list of chain layer indices 1..{n - 1}"
    ops = data.get("flops_estimated", [])  # optional
    if not isinstance(ops, list) or not all(isinstance(op, str) for op in ops):
        return f"flops_estimated is {ops!r}, not a list of op names"
    return _bytes_total_problem(data)


def _bytes_total_problem(data: dict) -> str | None:
    """Each size is at most 2**62, but the planner adds them up: so must their sum be."""
    sizes: list[tuple[int, str]] = []

    def add(where: str, obj: dict) -> None:
        sizes.extend((v, f"{where}.{k}") for k, v in obj.items()
                     if k.endswith("_bytes") and isinstance(v, int) and not isinstance(v, bool))

    for i, row in enumerate(data["layers"]):
        add(f"layers[{i}]", row)
        for j, o in enumerate(row.get("options", [])):
            add(f"layers[{i}].options[{j}]", o)
    add("totals", data["totals"])
    for j, si in enumerate(data.get("side_inputs", [])):
        sizes += [(si["bytes"], f"side_inputs[{j}].bytes"), (si.get("grad_bytes", 0), f"side_inputs[{j}].grad_bytes")]
    total = sum(v for v, _ in sizes)
    if total <= MAX_PROFILE_INT:
        return None
    value, where = max(sizes)
    return (f"{where} ({value}) and the other sizes add up to about {total:.3g} bytes, above the limit "
            f"2**62 = {MAX_PROFILE_INT} (larger than any machine's memory)")


def bench(spec: Spec, *, strategies: list[str], budget: str | int | None = None, k: int = 2,
          steps: int = 5, warmup: int = 1, device: str | Device | None = "auto",
          plan_path: str | Path | None = None, memory_limit: str | int | None = None, progress=None,
          force: bool = False, note: Note | None = None, options: bool | Sequence[str] = False,
          compile: bool = False):
    """Profile the spec's model, plan every strategy, and run measured training steps.

    ``options``: the profile also measures selective options (see :func:`profile_model`).
    ``compile``: the chain layers are profiled compiled and every ckplan row (``none`` too) runs
    with them compiled, its plan applied around them (:mod:`ckplan.compiled`); peers run as always.

    Every argument is checked before anything runs; on cpu/cuda a meta pass first checks that the
    step fits (:func:`preflight`; ``force=True`` runs anyway).
    """
    from .bench import run_bench
    from .options import PEERS

    strategies = [s if s in PEERS else str(Strategy.parse(s, what="strategy")) for s in strategies]
    limit, dev, plan_read = _check_bench(spec, k=k, steps=steps, warmup=warmup, budget=budget,
                                         memory_limit=memory_limit, device=device, plan_path=plan_path)
    names = compile_options(option_names(options, compile=compile), compile, dev.type)
    extra = {}
    plan_doc: dict = {}
    where = f"--plan {plan_path}"
    if plan_read is not None:
        p, plan_doc = plan_read
        extra[f"plan:{p.strategy}"] = p
    held: list[str] = []  # a skipped preflight is said only if the real run works (else its error says it)
    preflight(spec, dev.type, force=force, note=note, hold=held)  # no progress ticks: the bar counts steps
    model = build_model(spec, str(dev))
    batch = make_batch(spec, str(dev))
    prof = profile_model(model, *batch, name=spec.name or type(model).__name__, chain=spec.chain,
                         device=dev, optimizer=spec.train.optimizer, precision=spec.train.precision,
                         accum=spec.train.accum, lr=spec.train.lr, spec=spec.model_dump(mode="json"),
                         options=names, compile=compile)
    for text in held:
        _note(note, text)
    if plan_path is not None:  # the chain found in the model (the spec may not name one)
        check_plan_chain(plan_doc, prof.chain, where)
        n = len(prof.chain_layers)
        if p.n_layers != n:
            raise SpecError(f"{where}: the plan is for {p.n_layers} layers but chain {prof.chain!r} has {n}",
                            tip="make the plan for this model (the same spec, the same chain): "
                                "`ckplan plan SPEC --budget ... -o plan.json`")
        made_for = plan_doc.get("model")
        if isinstance(made_for, str) and made_for != prof.model:
            _note(note, f"{where} was made for model {made_for!r}, this spec is {prof.model!r}: it is applied "
                        "because its chain and layer count match; check that it is the same model")
    budget_bytes = resolve_budget(budget, prof).bytes if budget is not None else None
    return run_bench(model, batch, to_loss, prof, strategies=strategies, budget_bytes=budget_bytes,
                     k=k, steps=steps, warmup=warmup, device=dev, lr=spec.train.lr,
                     extra_plans=extra, memory_limit_bytes=limit, progress=progress)


def check_bench_args(spec: Spec, *, k: int = 2, steps: int = 5, warmup: int = 1, budget: str | int | None = None,
                     memory_limit: str | int | None = None, device: str | Device | None = "auto",
                     plan_path: str | Path | None = None) -> None:
    """Raise now what :func:`bench` would raise for its arguments and its plan file, before it starts."""
    _check_bench(spec, k=k, steps=steps, warmup=warmup, budget=budget, memory_limit=memory_limit,
                 device=device, plan_path=plan_path)


def _check_bench(spec: Spec, *, k, steps, warmup, budget, memory_limit, device, plan_path):
    """(memory limit in bytes or None, device, (plan, plan document) or None), every argument checked."""
    limit, dev = _bench_args(k, steps, warmup, budget, memory_limit, device)
    plan_read = None
    if plan_path is not None:  # a bad plan file fails before the (long) profile, not after
        plan_read = read_plan(plan_path)
        check_plan_chain(plan_read[1], spec.chain, f"--plan {plan_path}")
    return limit, dev, plan_read


def check_budget(budget: str | int | None) -> None:
    """Raise :class:`UsageError` now for a budget that could never be resolved (``12 parsecs``,
    ``1e400``, ``0%``), before any profile runs."""
    if budget is not None:
        from .planner import check_budget_text
        check_budget_text(budget, what="budget")


def resolve_budget(budget: str | int, prof: Profile):
    """The :class:`ckplan.planner.Budget` for ``budget`` (``12GB``, ``12GiB``, bytes, ``40%`` of
    the no-checkpoint peak, ``50%act``: persistent memory plus half the activations)."""
    from .planner import chain_from_profile, parse_budget
    return parse_budget(budget, chain_from_profile(prof), what="budget")


def plan(spec: Spec | str | Path | None = None, *, profile_path: str | Path | None = None,
         budget: str | int | None = None, strategy: str = "dp", k: int = 2,
         device: str | Device | None = None, overrides: dict | None = None, force: bool = False,
         progress: Progress | None = None, note: Note | None = None, world_size: int = 1,
         parallel: str = "fsdp", options: bool | Sequence[str] = False, compile: bool = False,
         dp_mode: str = "auto", meta_target: str | None = None):
    """Profile (or load a saved profile), then plan one strategy or all of them at one budget.

    ``spec``: a Spec or a spec file (``overrides`` applied); or ``profile_path``, a saved profile,
    which fixes the model and batch (giving both, or overrides with it, is an error).
    ``world_size`` > 1 plans for one rank of ``parallel`` (``fsdp``: FSDP2 with every chain layer
    one unit; ``ddp``) with :func:`ckplan.planner.parallel.per_rank_chain_from_profile`: the budget
    and every peak are per rank. ``options``: profiling the spec also measures selective options
    (:func:`profile_model`); a saved profile has the ones it was made with. ``dp_mode``:
    ``"auto"`` (exact DP up to 64 layers, banded DP to 400, grouped tables above) or ``"exact"``
    (the proven optimum at any length; slow on long chains). ``meta_target``: with
    ``device="meta"``, the device the profile stands for (:func:`profile`).
    """
    from .plan_report import PlanReport
    from .planner import compare, infeasible_budget, no_gain_reason, plan_chain

    strategy = "all" if str(strategy) == "all" else str(Strategy.parse(strategy, what="strategy"))
    check_positive("k", k)
    check_budget(budget)
    prof = _profile_for_plan(spec, profile_path, device, overrides, force, progress, note, options, compile,
                             meta_target)
    _tick(progress, f"planning {strategy} for {prof.model}")
    chain = _chain_for(prof, world_size, parallel)
    budget_bytes, source = _budget_for_plan(budget, prof, chain)
    infeasible = infeasible_tip = None
    if strategy == "all":
        # compare() never raises for an infeasible budget: every row says fits=False, and the
        # caller shows the table before exiting 3 (InfeasibleBudgetError, see report_infeasible).
        results = compare(chain, list(STRATEGIES), budget_bytes, k, mode=dp_mode)
        chosen = next(r for r in results if r.strategy == "dp")
        infeasible = infeasible_budget(results)
        if infeasible is not None:
            try:  # the same error plan_chain raises for one strategy, for its tip
                plan_chain(chain, "dp", budget_bytes, k)
            except InfeasibleBudgetError as err:
                infeasible_tip = err.tip
    else:
        try:
            chosen = plan_chain(chain, strategy, budget_bytes, k, mode=dp_mode)
        except InfeasibleBudgetError as err:
            err.budget_source = source  # how the budget was resolved (50%act: from what), for the CLI
            raise
        results = (chosen,)
    none = plan_chain(chain, "none")
    compiled = ("planned for the compiled chain layers (profiled with --compile): apply the plan inside "
                "`with ckplan.compiled_layers(model):`, entered before `ckplan.apply_plan`") if prof.compiled else None
    notes = tuple(n for n in (_parallel_note(world_size, parallel), no_gain_reason(chain), compiled) if n)
    return PlanReport(profile=prof, budget_bytes=budget_bytes, budget_source=source, strategy=strategy,
                      k=k, results=tuple(results), chosen=chosen, none_peak_bytes=none.score.peak_bytes,
                      none_step_ms=none.score.step_ms, infeasible=infeasible, infeasible_tip=infeasible_tip,
                      notes=notes)


def sweep(spec: Spec | str | Path | None = None, *, profile_path: str | Path | None = None,
          device: str | Device | None = None, points: int = 20, strategies: tuple[str, ...] | None = None,
          overrides: dict | None = None, force: bool = False, progress: Progress | None = None,
          note: Note | None = None, options: bool | Sequence[str] = False, compile: bool = False,
          meta_target: str | None = None):
    """Every strategy's memory/recompute frontier: (profile, frontier points)."""
    from .planner import chain_from_profile, no_gain_reason
    from .planner import sweep as _sweep
    check_positive("points", points, minimum=2)
    names = [str(Strategy.parse(s, what="strategy")) for s in (strategies or STRATEGIES)]
    prof = _profile_for_plan(spec, profile_path, device, overrides, force, progress, note, options, compile,
                             meta_target)
    _tick(progress, f"sweeping {points} budgets for {prof.model}")
    chain = chain_from_profile(prof)
    reason = no_gain_reason(chain)
    if reason:
        _note(note, reason)
    return prof, _sweep(chain, names, points)


def _chain_for(prof: Profile, world_size: int, parallel: str):
    """The planner's chain: one process, or one rank of ``parallel`` on ``world_size`` ranks."""
    from .planner import chain_from_profile
    check_positive("world_size", world_size)
    if world_size == 1:
        return chain_from_profile(prof)
    from .planner.parallel import KINDS, per_rank_chain_from_profile
    if str(parallel) not in KINDS:
        raise UsageError(f"parallel={str(parallel)!r} is not one of {', '.join(KINDS)}")
    return per_rank_chain_from_profile(prof, world_size, str(parallel))


def _bench_args(k, steps, warmup, budget, memory_limit, device):
    """Check a bench's arguments before anything runs: (memory limit in bytes or None, device)."""
    check_positive("k", k)
    check_positive("steps", steps)
    check_positive("warmup", warmup, minimum=0)
    check_budget(budget)
    limit = None
    if memory_limit is not None:
        from .units import parse_size
        limit = parse_size(memory_limit, what="memory_limit")
    dev = resolve_device(device)
    if dev.type == "meta":
        raise UsageError("bench runs real training steps; device 'meta' cannot run them",
                         tip="use device cpu or cuda (meta is for profile and plan)")
    return limit, dev


def _parallel_note(world_size: int, parallel: str) -> str | None:
    if world_size == 1:
        return None
    if str(parallel) == "fsdp":
        return (f"per rank of FSDP2 on {world_size} ranks: parameters, gradients and optimizer state "
                "sharded; every chain layer is one FSDP unit (its all-gathered parameters and "
                "reduce-scatter buffers are transients), the rest is the root unit; budget and peaks "
                "are per rank")
    return (f"per rank of DDP on {world_size} ranks: parameters, gradients and optimizer state "
            "replicated, plus DDP's gradient buckets; budget and peaks are per rank")


def world_sizes(spec: Spec | str | Path | None = None, *, world_sizes: list[int], parallel: str = "fsdp",
                profile_path: str | Path | None = None, budget: str | int | None = None,
                strategy: str = "dp", k: int = 2, device: str | Device | None = None,
                overrides: dict | None = None, force: bool = False, progress: Progress | None = None,
                note: Note | None = None, meta_target: str | None = None):
    """Per-rank peaks with and without the plan at each world size: (profile, rows)."""
    from .planner import parse_budget
    from .planner.parallel import KINDS, per_rank_chain_from_profile, world_size_table
    strategy = str(Strategy.parse(strategy, what="strategy"))
    for w in world_sizes:
        check_positive("world_size", w)
    if str(parallel) not in KINDS:
        raise UsageError(f"parallel={str(parallel)!r} is not one of {', '.join(KINDS)}")
    check_budget(budget)
    prof = _profile_for_plan(spec, profile_path, device, overrides, force, progress, note,
                             meta_target=meta_target)
    _tick(progress, f"planning {len(world_sizes)} world sizes for {prof.model}")
    rows = []
    for w in world_sizes:
        b = None
        if budget is not None:  # shares are of that world size's per-rank peaks
            b = parse_budget(budget, per_rank_chain_from_profile(prof, w, str(parallel)), what="budget").bytes
        rows += world_size_table(prof, [w], str(parallel), strategy, b, k)
    return prof, tuple(rows)


def bench_distributed(spec: Spec, *, nproc: int, parallel: str = "fsdp", strategies: list[str],
                      budget: str | int | None = None, k: int = 2, steps: int = 3, warmup: int = 1,
                      device: str | Device | None = "auto", memory_limit: str | int | None = None,
                      timeout_s: float = 600.0, note: Note | None = None,
                      options: bool | Sequence[str] = False, force: bool = False):
    """Run ``nproc`` ranks of ``parallel`` (gloo on CPU, NCCL on CUDA; ckplan's launcher, which
    ends every rank however the run ends) and gather per-rank predicted and measured peaks
    (:func:`ckplan.distributed.bench_distributed`). ``nproc`` is checked against the machine
    first (GPUs, cores, open files, memory); ``force`` lets a few ranks more per core, or past
    the memory estimate, run anyway. ``options``: the profile also measures selective options
    (as :func:`profile`), which the per-rank plans may then use (each option with its FSDP
    unit's buffers)."""
    from .distributed import bench_distributed as _bench
    from .distributed import rank_chain
    from .planner import parse_budget
    strategies = [str(Strategy.parse(s, what="strategy")) for s in strategies]
    check_positive("nproc", nproc)
    limit, dev = _bench_args(k, steps, warmup, budget, memory_limit, device)
    check_nproc(nproc, dev.type, force=force)  # before a profile that would be thrown away
    prof, budget_bytes = None, None
    if budget is not None or options:
        prof = profile(spec, device=dev.type, note=note, options=options, force=force)
    if budget is not None:  # per rank: a share is of one rank's peak
        budget_bytes = parse_budget(budget, rank_chain(prof, spec, nproc, str(parallel)), what="budget").bytes
    return _bench(spec, nproc=nproc, kind=str(parallel), strategies=strategies, budget_bytes=budget_bytes,
                  k=k, steps=steps, warmup=warmup, device=dev.type, timeout_s=timeout_s,
                  memory_limit_bytes=limit, profile=prof, force=force)


def check_nproc(nproc: int, device: str | Device | None = "auto", *, force: bool = False) -> list[str]:
    """Refuse ``nproc`` ranks that this machine cannot run on ``device`` (NCCL: a GPU each; gloo
    on the CPU: a core each, or up to ``ckplan.launch.MAX_RANKS_PER_CPU`` with ``force``, and the
    open-file limit), before anything is built; returns notes for what ``force`` let through.
    :func:`bench_distributed` checks the same, and the ranks' memory once it has profiled."""
    from .distributed import check_world
    check_positive("nproc", nproc)
    dev = resolve_device(device)
    return check_world(nproc, dev.type, force=force) if dev.type in ("cpu", "cuda") else []


def export(rep, target: str):
    """The snippet that applies ``rep``'s chosen plan in ``target`` (hf, torchtitan, lightning,
    fsdp), or the closest plan it can express (:func:`ckplan.export.export_plan`)."""
    from .export import export_plan
    from .planner import chain_from_profile, simulate
    prof = rep.profile
    layer_class = prof.chain_layers[0].type if prof.chain_layers else None
    ex = export_plan(rep.chosen.plan, str(target), chain_path=prof.chain, layer_class=layer_class,
                     model_name=prof.model)
    closest_peak = simulate(chain_from_profile(prof), ex.closest_plan).peak_bytes
    return ex, closest_peak


def _profile_for_plan(spec, profile_path, device, overrides, force, progress, note,
                      options: bool | Sequence[str] = False, compile: bool = False,
                      meta_target: str | None = None) -> Profile:
    given = {k: v for k, v in (overrides or {}).items() if v is not None}
    if profile_path is not None:
        ignored = (["SPEC (spec)"] if spec is not None else []) + \
                  [f"{k}={getattr(v, 'value', v)!r}" for k, v in given.items()] + \
                  ([f"device={getattr(device, 'value', device)!r}"] if device is not None else []) + \
                  ([f"target={getattr(meta_target, 'value', meta_target)!r}"] if meta_target is not None else [])
        if ignored:
            raise UsageError(f"a saved profile ({profile_path}) fixes the model, batch and device; "
                             f"{', '.join(ignored)} would be ignored",
                             tip="drop --profile to profile the spec with these settings, or drop them "
                                 "to plan from the saved profile")
        return load_profile(profile_path)
    if spec is None:
        raise UsageError("plan needs a SPEC or --profile saved.json",
                         tip="e.g. ckplan plan configs/gpt2-small.yaml --budget 4GB")
    spec = load(spec, **given)
    return profile(spec, device=device, force=force, progress=progress, note=note, options=options,
                   compile=compile, meta_target=meta_target)


def _budget_for_plan(budget, prof: Profile, chain) -> tuple[int | None, str]:
    """The budget bytes and where they came from: the user's text, else the one default rule."""
    from .planner import default_budget, parse_budget
    if budget is not None:
        b = parse_budget(budget, chain, what="budget")
        return b.bytes, f"--budget: {b.description}"
    free = None
    if prof.device == "cuda":
        from .measure import nvml_memory
        info = nvml_memory(0)
        free = info.free_bytes if info is not None else None
    b = default_budget(chain, mode="plan", free_device_bytes=free)
    if b is None:
        return None, "none given: planned for the smallest feasible peak"
    return b.bytes, f"none given: {b.description} (NVML)"


# ---- output files, checked before the run ----------------------------------------------------

def check_output_file(path: str | Path, *, csv: bool = True) -> None:
    """Refuse, before a long run, an output file ckplan could not write (or must not replace);
    ``csv=False``: a command that writes only JSON refuses a ``.csv`` name too."""
    from .report import check_output_file as _check
    if not csv and Path(path).suffix.lower() == ".csv":
        raise UsageError(f"-o {path}: this command writes JSON, not CSV", tip="use a .json file name")
    _check(path, "-o")


def check_output_dir(path: str | Path) -> None:
    """Refuse, before a long run, an output folder ckplan could not create or write into."""
    from .report import check_output_dir as _check
    _check(path, "--out-dir")

