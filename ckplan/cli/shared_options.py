"""The options and arguments ckplan's commands share, declared once: the spec argument,
--device, --format, --output, --target, --force, --compile, --options, --parallel, --wide,
--debug, and the spec overrides (--batch-size, --seq-len, --precision, --optimizer, --accum) that
:func:`with_overrides` adds to a command and :func:`given` hands to the library.
"""
from __future__ import annotations

import inspect
from typing import Optional

import typer

from ..launch import MAX_RANKS_PER_CPU
from ..options import Device, Fmt, Optimizer, Precision

SPEC_ARG = typer.Argument(..., metavar="SPEC", help="Model spec (YAML), e.g. configs/gpt2-small.yaml. A spec is code: "
                          "`target:` imports and calls any callable; run only specs you trust.")


META_CODE = ("; the model's code still runs on meta: a spec's `target:` is imported and called, so run only "
             "specs you trust")


DEVICE_OPT = typer.Option(Device.auto, "--device", help="auto, cpu, cuda or meta (fake tensors: no memory "
                          "allocated" + META_CODE + ").")


BENCH_DEVICE_OPT = typer.Option(Device.auto, "--device", help="auto, cpu or cuda (bench runs real training steps; "
                                "meta cannot run them).")


FORMAT_OPT = typer.Option(Fmt.table, "--format", "-f", help="What goes to stdout: table, json or csv.")


OUT_OPT = typer.Option(None, "--output", "-o", help="Also write the result to FILE (.json or .csv).")


TARGET_OPT = typer.Option(None, "--target", help="With --device meta: the device the fake-tensor profile "
                          "stands for: cpu, cuda (priced as an H100), h100, h200, a100, l4, or a device profile "
                          "from `ckplan calibrate` (its kernels, optimizer and the device model that prices "
                          "its times; default: cuda when this machine has a GPU, else cpu).")


FORCE_OPT = typer.Option(False, "--force", help="Run on cpu/cuda even when the meta-pass preflight predicts "
                         "that one step does not fit in the memory available.")


BENCH_FORCE_OPT = typer.Option(False, "--force", help="Run on cpu/cuda even when the meta-pass preflight predicts "
                               "that one step does not fit in the memory available; with --nproc, also run "
                               f"gloo ranks beyond a core each (up to {MAX_RANKS_PER_CPU} per core) or the "
                               "ranks' memory estimate.")


COMPILE_OPT = typer.Option(False, "--compile", help="Measure (and, in bench, run) each chain layer compiled "
                           "with torch.compile, the plan applied around the compiled layers (selective "
                           "options compiled in, plus mincut-80, mincut-50 and mincut-20: torch.compile's min-cut "
                           "partitioner at that activation memory budget, per layer).")


COMPILE_SCOPE_OPT = typer.Option("layers", "--compile-scope", help="With --compile: layers (each chain layer "
                                  "compiled, the plan around them) or model (implies --compile: the whole model "
                                  "compiled, every chain layer a checkpoint region; dp then plans one region per "
                                  "layer: stored, a selective option, or recomputed whole; the whole model is "
                                  "compiled and measured once per choice first).")


OPTIONS_OPT = typer.Option(True, "--options/--no-options", help="Also measure each chain layer's selective "
                           "recompute options (sac-compute, sac-linear, sac-attn; with --compile also mincut-80, "
                           "mincut-50, mincut-20): one more measured step "
                           "each; --no-options skips them.")


PARALLEL_OPT = typer.Option(None, "--parallel", help="With --world-size / --nproc: fsdp (FSDP2, every chain "
                             "layer one unit) or ddp (default: the spec's parallel.kind, else fsdp).")


WIDE_OPT = typer.Option(False, "--wide", help="Every column of the tables, however wide the terminal.")


DEBUG_OPT = typer.Option(False, "--debug", help="Show tracebacks.")


# The overrides every command that builds a model takes, declared once: `with_overrides` adds them
# to a command's options and hands them over as **overrides (names as in api.load).
BATCH_OPT = typer.Option(None, "--batch-size", "-b", min=1, help="Override input.batch_size.")


SEQ_OPT = typer.Option(None, "--seq-len", min=1, help="Override the first input dimension (sequence length).")


PREC_OPT = typer.Option(None, "--precision", help="Override train.precision.")


OPTIM_OPT = typer.Option(None, "--optimizer", help="Override train.optimizer.")


ACCUM_OPT = typer.Option(None, "--accum", min=1, help="Override train.accum (gradient-accumulation steps).")


OVERRIDES = (("batch_size", Optional[int], BATCH_OPT), ("seq_len", Optional[int], SEQ_OPT),
             ("precision", Optional[Precision], PREC_OPT), ("optimizer", Optional[Optimizer], OPTIM_OPT),
             ("accum", Optional[int], ACCUM_OPT))



def with_overrides(fn):
    """Give a command ``def cmd(..., **overrides)`` the options --batch-size, --seq-len, --precision,
    --optimizer and --accum (typer reads ``__signature__``)."""
    sig = inspect.signature(fn)
    params = [p for p in sig.parameters.values() if p.kind is not p.VAR_KEYWORD]
    params += [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=opt, annotation=ann)
               for name, ann, opt in OVERRIDES]
    fn.__signature__ = sig.replace(parameters=params)
    return fn


def given(overrides: dict) -> dict:
    return {k: (v.value if hasattr(v, "value") else v) for k, v in overrides.items() if v is not None}
