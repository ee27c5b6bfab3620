"""One micro-batch of random inputs (and labels) as the spec describes it, and the loss."""
from __future__ import annotations

import torch

from ..errors import ModelRunError, SpecError
from ..measure import unique_storage_bytes
from .schema import LabelSpec, Spec


def torch_dtype(name: str):
    return getattr(torch, name)


def make_batch(spec: Spec, device: str = "cpu", *, seed: int | None = None):
    """Random inputs (and labels) for one micro-batch: returns (args, kwargs) for model(*args, **kwargs)."""
    inp = spec.input
    gen = torch.Generator().manual_seed(spec.seed if seed is None else seed)

    def rand(shape, dtype, high):
        if device == "meta":
            return torch.empty(shape, dtype=torch_dtype(dtype), device="meta")
        if dtype.startswith("int"):
            t = torch.randint(0, high, shape, generator=gen, dtype=torch_dtype(dtype))
        else:
            t = torch.randn(shape, generator=gen, dtype=torch_dtype(dtype))
        return t.to(device)

    x = rand([inp.batch_size, *inp.shape], inp.dtype, inp.high)
    args, kwargs = ((), {inp.name: x}) if inp.name else ((x,), {})
    if inp.labels == "copy":
        kwargs["labels"] = x
    elif isinstance(inp.labels, LabelSpec):
        lab = inp.labels
        if lab.dtype.startswith("int") and lab.high is None:
            raise SpecError("input.labels: integer labels need `high:` (number of classes)")
        kwargs["labels"] = rand([inp.batch_size, *lab.shape], lab.dtype, lab.high)
    return args, kwargs


def batch_bytes(args, kwargs) -> int:
    """Bytes of the batch's tensors, each storage once."""
    return unique_storage_bytes((list(args), list(kwargs.values())))


def to_loss(out):
    """The training loss from a model's output: its loss when it returns one, else mean(out**2)."""
    if isinstance(out, torch.Tensor):
        return out if out.dim() == 0 else out.float().pow(2).mean()
    loss = getattr(out, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    if isinstance(out, dict) and isinstance(out.get("loss"), torch.Tensor):
        return out["loss"]
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return to_loss(out[0])
    first = out[0] if hasattr(out, "__getitem__") else None
    if isinstance(first, torch.Tensor):
        return to_loss(first)
    raise ModelRunError(f"cannot make a loss from the model's output of type {type(out).__name__}",
                        tip="return a tensor or an object with a `.loss`")
