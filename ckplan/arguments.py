"""The arguments every command takes, checked before anything runs: the device, the spec and its
overrides, counts, the training settings, the selective options to measure, the budget's text,
and the callbacks a long step reports to.
"""
from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from .compiled import compile_unavailable
from .device_model import load_device
from .errors import UsageError
from .options import DEVICES, Device
from .planner import check_budget_text
from .sac import MINCUT, OPTIONS, POLICIES
from .spec import Spec, check_optimizer, check_overrides, check_precision, load_spec
from .units import parse_size

Progress = Callable[[str], None]  # told what a long step is doing now (a spinner, a bar)
Note = Callable[[str], None]  # told something the user should read (a line on stderr)


def resolve_device(device: str | Device | None):
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


def note_or_warn(note: Note | None, message: str) -> None:
    if note is not None:
        note(message)
    else:
        warnings.warn(message, stacklevel=3)


def tick(progress: Progress | None, message: str) -> None:
    if progress is not None:
        progress(message)


def check_meta_target(meta_target, device_type: str) -> str | None:
    """``meta_target`` checked: 'cpu', 'cuda', a built-in device model (``h100``, ``h200``,
    ``a100``, ``l4``) or a device profile file from ``ckplan calibrate`` (None: the default);
    refused off meta."""
    if meta_target is None:
        return None
    target = str(getattr(meta_target, "value", meta_target))
    if device_type != "meta":
        raise UsageError(f"--target {target} is for --device meta (this profile runs on {device_type})",
                         tip="drop --target, or add --device meta to plan for a machine you do not have")
    if target != "cpu":
        load_device(target)  # an unknown name or a bad file fails here, naming the field
    return target


def compile_options(names: tuple[str, ...], compile: bool, device_type: str) -> tuple[str, ...]:
    """The options to measure (with ``compile``: compiled in, :mod:`ckplan.compiled`); compiling
    on meta, or where TorchInductor cannot compile, is refused."""
    if not compile:
        return names
    if device_type == "meta":
        raise UsageError("--compile measures compiled layers on cpu or cuda, not on meta",
                         tip="drop --compile for a meta plan, or profile on --device cpu/cuda")
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
    check_precision(precision)
    check_optimizer(optimizer)
    check_positive("accum", accum)


def check_budget(budget: str | int | float | None) -> None:
    """Raise :class:`UsageError` now for a budget that could never be resolved (``12 parsecs``,
    ``1e400``, ``0%``), before any profile runs."""
    if budget is not None:
        check_budget_text(budget, what="budget")


def bench_args(k, steps, warmup, budget, memory_limit, device):
    """Check a bench's arguments before anything runs: (memory limit in bytes or None, device)."""
    check_positive("k", k)
    check_positive("steps", steps)
    check_positive("warmup", warmup, minimum=0)
    check_budget(budget)
    limit = None
    if memory_limit is not None:
        limit = parse_size(memory_limit, what="memory_limit")
    dev = resolve_device(device)
    if dev.type == "meta":
        raise UsageError("bench runs real training steps; device 'meta' cannot run them",
                         tip="use device cpu or cuda (meta is for profile and plan)")
    return limit, dev

