"""Chains whose layers do not keep their own output (Sequential of Linear/ReLU, in-place ReLUs),
and how their peaks and gradients are measured."""
from __future__ import annotations

import torch
import torch.nn as nn

from ckplan import api
from ckplan.execute import apply_plan
from ckplan.measure import LiveTensorTracker
from ckplan.planner.plan import Checkpoint

B, D = 64, 32


class SeqNet(nn.Module):
    """A stem, then Linear / activation modules, each a chain layer, then a head."""

    def __init__(self, acts=("relu", "tanh")):
        super().__init__()
        mods: list[nn.Module] = []
        for a in acts:
            mods += [nn.Linear(D, D), nn.ReLU() if a == "relu" else nn.Tanh()]
        self.stem = nn.Linear(D, D)
        self.body = nn.Sequential(*mods)
        self.head = nn.Linear(D, 3)

    def forward(self, x):
        return self.head(self.body(self.stem(x))).pow(2).mean()


class InPlaceNet(nn.Module):
    """torchvision's style: Linear, BatchNorm, ReLU(inplace=True), each a chain layer."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(D, D)
        self.body = nn.Sequential(nn.Linear(D, D), nn.BatchNorm1d(D), nn.ReLU(inplace=True),
                                  nn.Linear(D, D), nn.ReLU(inplace=True))
        self.head = nn.Linear(D, 3)

    def forward(self, x):
        return self.head(self.body(self.stem(x))).pow(2).mean()


def _profiled(model, chain: str):
    torch.manual_seed(0)
    x = torch.randn(B, D)
    prof = api.profile_model(model, (x,), {}, name="unkept", chain=chain, device="cpu", optimizer="sgd",
                             repeats=1, warmup=0)
    return x, prof


def _measured_peak(model, x, plan) -> int:
    model.zero_grad(set_to_none=True)
    with apply_plan(model, plan), LiveTensorTracker() as tr:
        model(x).backward()
    return tr.peak


def _grads(model, x, plan=None):
    model.zero_grad(set_to_none=True)
    if plan is None:
        model(x).backward()
    else:
        with apply_plan(model, plan):
            model(x).backward()
    return [p.grad.clone() for p in model.parameters()]


def _nested(items) -> bool:
    return any(isinstance(it, Checkpoint) and any(isinstance(j, Checkpoint) for j in it.inner)
               for it in items)
