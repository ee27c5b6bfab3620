"""The model a spec names, built on a device: a zoo model, a Hugging Face config, or a target.

A ``target`` is any importable callable, run with ``args:`` before ckplan sees its result (the
package docstring: a spec is code).
"""
from __future__ import annotations

import contextlib
import difflib
import importlib
import sys

import torch
from torch.overrides import TorchFunctionMode

from ..errors import CkplanError, ModelRunError, SpecError, first_line
from ..zoo import ZOO, build_builtin
from .hf import build_hf
from .labels import attach_label_loss, takes_labels
from .limits import check_builtin_length, check_builtin_vocab, check_position_table
from .schema import Spec


def build_model(spec: Spec, device: str = "cpu"):
    """Instantiate the model on ``device`` (``meta``: no memory is allocated) in train mode."""
    torch.manual_seed(spec.seed)
    if spec.model.builtin is not None:
        check_builtin_vocab(spec)
        check_builtin_length(spec)
    if str(device) == "meta":
        # Modules a model imports lazily (transformers' GenerationMixin pulls in torch._dynamo)
        # run tensor code at import; under the meta device that code fails (torch 2.6: .item()
        # on a meta tensor). Import dynamo first, outside the device.
        importlib.import_module("torch._dynamo")
    with torch.device(device), (_NoInitOnMeta() if str(device) == "meta" else contextlib.nullcontext()), \
            _meta_build_errors(str(device) == "meta"):
        if spec.model.builtin is not None:
            model = _build_builtin(spec.model.builtin, spec.model.args)
        elif spec.model.hf is not None:
            model = build_hf(spec.model.hf, spec.model.task, inp=spec.input)
        else:
            model = _build_target(spec.model.target, spec.model.args)
    if spec.model.hf is not None:
        check_position_table(model, spec.input)
    if not isinstance(model, torch.nn.Module):
        where = f"model.target {spec.model.target!r}" if spec.model.target else "model.builtin"
        raise SpecError(f"{where} returned {type(model).__name__}, not a torch.nn.Module",
                        tip="a target is any importable callable and ckplan has already run it: "
                            "run only specs you trust" if spec.model.target else None)
    if spec.input.labels != "none" and not takes_labels(model):
        attach_label_loss(model)  # a plain classifier: the loss from its logits and the labels
    return model.train()


@contextlib.contextmanager
def _meta_build_errors(meta: bool):
    """A constructor that reads a tensor's value (a learned activation's scalar, transformers 4's
    xIELU) cannot run on fake tensors: said so, with the fix."""
    try:
        yield
    except CkplanError:
        raise
    except Exception as e:
        if not (meta and "meta" in str(e)):
            raise
        raise ModelRunError(f"the model's constructor reads tensor values ({first_line(str(e))}), which fake "
                            "(meta) tensors cannot provide",
                            tip="profile it on --device cpu or cuda (with a smaller --batch-size / --seq-len "
                                "or fewer layers if needed)") from e


# In-place ops that only write values: on meta there are none to write, and running their meta
# kernels (torch's Python references) is most of a large model's build time.
_VALUE_INITS = frozenset(getattr(torch.Tensor, name) for name in (
    "normal_", "uniform_", "zero_", "fill_", "random_", "bernoulli_", "exponential_", "log_normal_",
    "cauchy_", "geometric_"))


class _NoInitOnMeta(TorchFunctionMode):
    """Skips value initialisation of meta tensors while a model is built (shapes, dtypes and
    strides are untouched): the in-place methods above and every ``torch.nn.init`` function (a
    mode does not see the calls its own handler makes, so ``nn.init.normal_`` must be caught
    itself, not the ``Tensor.normal_`` inside it)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _VALUE_INITS or getattr(func, "__module__", None) == "torch.nn.init":
            target = args[0] if args else kwargs.get("tensor")
            if isinstance(target, torch.Tensor) and target.is_meta:
                return target
        return func(*args, **kwargs)


def _build_builtin(name: str, args: dict):
    if name not in ZOO:
        raise SpecError(f"model.builtin: unknown model {name!r}",
                        tip=f"choose one of {', '.join(sorted(ZOO))}, or use `hf:` / `target:`")
    try:
        return build_builtin(name, dict(args))
    except TypeError as e:
        raise SpecError(f"model.args for builtin {name!r}: {e}") from None


def _build_target(target: str, args: dict):
    mod_name, _, fn_name = target.partition(":")
    if "" not in sys.path and "." not in sys.path:
        sys.path.insert(0, "")  # the current directory, as `python -m` would
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as e:
        raise SpecError(f"model.target: cannot import module {mod_name!r}: {e}",
                        tip="run ckplan from the directory that holds it, or add it to PYTHONPATH") from None
    except Exception as e:  # the module's own code failed while it was imported
        raise SpecError(f"model.target {target!r}: importing module {mod_name!r} raised {type(e).__name__}: "
                        f"{first_line(str(e))}",
                        tip=f"fix the module (python -c 'import {mod_name}' shows the traceback)") from e
    fn = mod
    for part in fn_name.split("."):
        owner, fn = fn, getattr(fn, part, None)
        if fn is None:
            names = [n for n in dir(owner) if not n.startswith("_")]
            close = difflib.get_close_matches(part, names, n=1, cutoff=0.6)
            raise SpecError(f"model.target: module {mod_name!r} has no attribute {fn_name!r}",
                            tip=f"did you mean {close[0]!r}?" if close else
                            f"name a class or function {mod_name!r} defines")
    try:
        return fn(**args)
    except TypeError as e:
        raise SpecError(f"model.target {target!r} rejected args {args}: {e}") from None
    except Exception as e:
        if "meta" in str(e) and torch.empty(()).device.type == "meta":  # built under the meta device
            raise  # _meta_build_errors says what it is
        raise ModelRunError(f"model.target {target!r} raised {type(e).__name__}: {e}",
                            tip=f"fix the constructor: {mod_name}.{fn_name}(**model.args) called in Python "
                                "shows its own traceback") from e
