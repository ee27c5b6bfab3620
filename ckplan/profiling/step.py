"""One profiled training step, and what guards a profile: the model's errors as ckplan's, the model's
state restored, the hooks removed.

On meta, ``F.scaled_dot_product_attention`` runs the kernel the target device would choose
(ckplan.sdpa: fused kernels keep a logsumexp, the math path the attention matrix), and under
bf16/fp16 the forward replays the target's autocast (ckplan.meta_autocast).
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn as nn
from torch.overrides import _get_current_function_mode_stack

from .. import meta_autocast
from ..errors import ModelRunError, first_line
from ..sdpa import SdpaOnMeta
from .instrument import Instrument


class Step:
    """One forward+backward of the model through the instrument; on meta, SDPA as on the target."""

    def __init__(self, model, args, kwargs, loss_fn, precision: str, device: torch.device,
                 meta_target: str | None):
        self.model, self.args, self.kwargs, self.loss_fn = model, args, kwargs, loss_fn
        self.precision, self.device, self.meta_target = precision, device, meta_target
        self.sdpa_note = ""
        self.sdpa: SdpaOnMeta | None = None  # the meta attention mode of the step running now
        self.unasked: set[str] = set()  # meta_autocast.take_unasked(), over the steps run

    def run(self, inst: Instrument) -> None:
        if self.meta_target is None:
            inst.run(self.model, self.args, self.kwargs, self.loss_fn, self.precision, self.device.type)
            return
        sdpa = self.sdpa = SdpaOnMeta(self.meta_target)
        try:
            with sdpa, meta_autocast.targeting(self.meta_target):
                inst.run(self.model, self.args, self.kwargs, self.loss_fn, self.precision, self.device.type)
        finally:
            self.sdpa = None
        self.sdpa_note = sdpa.note()
        self.unasked |= meta_autocast.take_unasked()

    @contextmanager
    def recomputing(self):
        """Around a recompute in the backward: the autograd engine does not carry torch-function
        modes into it, so on meta the attention mode is entered again (else the recompute would
        take another SDPA path than the forward and selective checkpointing's cache would miss),
        and under bf16/fp16 a fresh autocast region, as a checkpoint's recompute enters autocast."""
        sdpa = self.sdpa
        if sdpa is None or sdpa in list(_get_current_function_mode_stack()):
            yield
            return
        with sdpa, meta_autocast.targeting(self.meta_target), meta_autocast.region(self.precision):
            yield


def zero_grads(params: list[nn.Parameter]) -> None:
    for p in params:
        p.grad = None


@contextmanager
def model_errors(meta: bool):
    """The model's own exceptions as ModelRunError, with the likely fix."""
    try:
        yield
    except ModelRunError:
        raise
    except torch.cuda.OutOfMemoryError as e:
        raise ModelRunError(f"out of GPU memory while profiling: {first_line(str(e))}",
                            tip="profile with a smaller --batch-size, or with --device meta") from e
    except Exception as e:
        if meta and "meta" in str(e):
            raise ModelRunError(
                f"the model reads tensor values in its forward or backward ({first_line(str(e))}), "
                "which fake (meta) tensors cannot provide",
                tip="profile it on --device cpu or cuda (with a smaller --batch-size / --seq-len if needed)") from e
        # the model's traceback is this error's __cause__ (the CLI shows it with --debug)
        text = first_line(str(e))
        dtype = any(w in text for w in ("BFloat16", "bfloat16", "Half", "float16", "expected scalar type"))
        raise ModelRunError(f"the model raised {type(e).__name__} during the profiled step: {text}",
                            tip=("the model's code does not run in this precision here: profile with "
                                 "--precision fp32 (or the other 16-bit one); under parallel.param_dtype its "
                                 "parameters are 16-bit and its buffers fp32, as FSDP2's MixedPrecisionPolicy "
                                 "runs it: drop param_dtype, or train with autocast (train.precision)")
                            if dtype else "check that the spec's input (shape, dtype, labels) is what the model's "
                                          "forward takes; one step of the model without ckplan shows its own "
                                          "error") from e


@contextmanager
def state_restored(model: nn.Module, params: list[nn.Parameter], device: torch.device):
    """Gradients, buffers (running stats; not on meta), RNG states and train mode as they were."""
    saved_grads = [p.grad for p in params]
    was_training = model.training
    buffers = [] if device.type == "meta" else [(b, b.detach().clone()) for b in model.buffers()]
    rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if device.type == "cuda" else None
    try:
        yield
    finally:
        for p, g in zip(params, saved_grads):
            p.grad = g
        with torch.no_grad():
            for b, v in buffers:
                b.copy_(v)
        torch.set_rng_state(rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
        model.train(was_training)


@contextmanager
def hooks_installed(inst: Instrument):
    handles = inst.install()
    try:
        yield
    finally:
        for h in handles:
            h.remove()
