"""One training step of a row: the model, optimizer and batch every row shares, and the plan (or the
peer's own checkpointing) a row runs under."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch

from ..compiled import CompiledLayers
from ..execute import apply_plan
from ..measure import unique_storage_bytes
from ..peers import hf_checkpointing, is_hf_model, offload_all, offload_attention, sac_policy
from ..records import Profile
from ..training import forward_loss
from .entry import Entry


def resident_bytes(model, opt, batch) -> int:
    """What is resident before a step: parameters, buffers, gradients, optimizer state, the batch."""
    tensors = list(model.parameters()) + list(model.buffers())
    tensors += [t.grad for t in tensors if t.grad is not None]
    tensors += [v for state in opt.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    args, kwargs = batch
    return unique_storage_bytes((tensors, list(args), list(kwargs.values())))


class Stepper:
    """One full training step: micro-batches forward+backward, optimizer step, zero grad."""

    def __init__(self, model, opt, batch, loss_fn, precision: str, accum: int, device: torch.device):
        self.model, self.opt, self.batch, self.loss_fn = model, opt, batch, loss_fn
        self.precision, self.accum, self.device = precision, accum, device
        self.scaler = torch.amp.GradScaler(device.type) if precision == "fp16" else None

    def backward(self, after_forward=None) -> float:
        args, kwargs = self.batch
        total = 0.0
        for micro in range(self.accum):
            loss = forward_loss(self.model, args, kwargs, self.loss_fn, self.precision, self.device.type)
            if micro == 0 and after_forward is not None:
                after_forward()
            # 1 / accum enters as the gradient of the loss, not by dividing it: the loss tensor
            # lives through backward as in a plain loop (mse_loss on the CPU returns a scalar
            # that keeps its elementwise buffer), which is the step the profile predicts
            scaled = self.scaler.scale(loss) if self.scaler else loss
            scaled.backward(torch.full_like(scaled, 1 / self.accum) if self.accum > 1 else None)
            del scaled
            total += float(loss.detach()) / self.accum
            del loss
        return total

    def step(self, after_backward=None, after_forward=None) -> float:
        loss = self.backward(after_forward)
        if after_backward is not None:
            after_backward()
        if self.scaler:
            self.scaler.step(self.opt)
            self.scaler.update()
        else:
            self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss


@dataclass
class Run:
    """What every step of one bench shares: the model, its batch, the profile, the device."""

    model: Any
    batch: Any
    loss_fn: Any
    profile: Profile
    device: torch.device
    memory_limit_bytes: int | None = None
    opt: Any = None
    stepper: Stepper | None = None
    layers: CompiledLayers | None = None  # --compile: ckplan rows run with the chain layers compiled
    eager: bool = False  # compiled layers left out (the eager gradient cross-check)
    ref_grads: dict | None = None  # the gradient check's reference, kept for that cross-check

    def step(self, e: Entry, **callbacks) -> float:
        """One training step with ``e``'s plan applied (on ``e``'s compiled copy for a compiled peer)."""
        with applied(self, e):
            self.stepper.model = model_of(self, e)
            return self.stepper.step(**callbacks)


def model_of(run: Run, e: Entry):
    """The module a row's step calls: the model, or a compiled peer's compiled copy of it."""
    return e.compiled.module if e.compiled is not None else run.model


def applied(run: Run, e: Entry):
    """The context that runs ``e``: ckplan's plan, or a peer's own checkpointing."""
    if e.compiled is not None:
        return contextlib.nullcontext()  # the compiled copy runs as it is; the model has no plan on it
    if e.kind == "peer" and e.name == "sac-policy":
        return sac_policy(run.model, run.profile.chain)
    if e.kind == "peer" and e.name == "offload-all":
        return offload_all(run.model, run.profile.chain)
    if e.kind == "peer" and e.name == "offload-attn":
        return offload_attention(run.model, run.profile.chain)
    if e.kind == "peer" and e.name == "hf" and is_hf_model(run.model):
        return hf_checkpointing(run.model)
    if run.layers is not None and not run.eager and runs_compiled_layers(e):
        stack = contextlib.ExitStack()
        stack.enter_context(run.layers)  # compiled first: the plan's checkpoints wrap the compiled forwards
        stack.enter_context(apply_plan(run.model, e.plan, chain=run.profile.chain))
        return stack
    return apply_plan(run.model, e.plan, chain=run.profile.chain)


def runs_compiled_layers(e: Entry) -> bool:
    """With --compile: ckplan's rows (the peers run as they are)."""
    return e.compiled is None and e.kind == "ckplan"
