"""A loss from the spec's labels for a model whose forward takes none (timm, torchvision, most
plain PyTorch classifiers): ckplan keeps the labels out of the call and makes the loss from the
output, as such a model's own training loop would.

Hooks on the model itself, not a wrapper: the chain's paths and every plan stay the user's model's.
"""
from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F

from ..errors import ModelRunError


def takes_labels(model: torch.nn.Module) -> bool:
    """Whether ``model.forward`` accepts a ``labels`` keyword (by name, or through ``**kwargs``)."""
    try:
        params = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):  # a builtin or C forward: assume it takes what it is given
        return True
    return any(p.name == "labels" or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def loss_from_labels(out, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy for integer labels shaped as the output without its last (class) dimension:
    (B, C) logits with (B,) classes, (B, T, V) with (B, T) tokens; mean squared error for float
    labels of the output's own shape."""
    logits = _first_tensor(out)
    if not labels.is_floating_point() and tuple(logits.shape[:-1]) == tuple(labels.shape):
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
    if labels.is_floating_point() and logits.shape == labels.shape:
        return F.mse_loss(logits, labels.to(logits.dtype))
    raise ModelRunError(
        f"the model takes no `labels`, and input.labels of shape {list(labels.shape)} ({labels.dtype}) fit "
        f"neither cross-entropy nor mean squared error against its output of shape {list(logits.shape)}",
        tip=f"give input.labels shape {list(logits.shape[1:-1])} with high: {logits.shape[-1]} (classes), "
            "set input.labels: none (the loss is then mean(output**2)), or return a loss from the model")


def _first_tensor(out) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    logits = getattr(out, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    raise ModelRunError(f"the model takes no `labels` and returned {type(out).__name__}, not logits",
                        tip="return a tensor of logits or a loss, or set input.labels: none")


def attach_label_loss(model: torch.nn.Module) -> None:
    """Hooks that take ``labels`` out of the model's call and return the loss from its output."""
    held: list[torch.Tensor] = []

    def take(module, args, kwargs):
        if "labels" not in kwargs:
            return None
        kwargs = dict(kwargs)
        held[:] = [kwargs.pop("labels")]  # one call at a time: a failed call's labels are replaced
        return args, kwargs

    def loss(module, args, kwargs, out):
        return loss_from_labels(out, held.pop()) if held else None

    model.register_forward_pre_hook(take, with_kwargs=True)
    model.register_forward_hook(loss, with_kwargs=True)
