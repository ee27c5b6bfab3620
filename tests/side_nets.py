"""Small models and measurements shared by the side-input tests and the tests built on them."""
from __future__ import annotations

import torch

from ckplan import api
from ckplan.execute import apply_plan
from ckplan.measure import LiveTensorTracker

B, D, N = 64, 32, 6


def profiled(make, name: str):
    """``make(D, N)`` seeded, a (B, D) batch, and their CPU profile (SGD, one pass)."""
    torch.manual_seed(0)
    model = make(D, N)
    x = torch.randn(B, D)
    prof = api.profile_model(model, (x,), {}, name=name, chain=None, device="cpu", optimizer="sgd",
                             repeats=1, warmup=0)
    return model, x, prof


def measured_peak(model, x, plan) -> int:
    """Peak live bytes of one forward+backward above the step start (tracker), with ``plan``."""
    model.zero_grad(set_to_none=True)
    with apply_plan(model, plan), LiveTensorTracker() as tr:
        model(x).backward()
    return tr.peak


class CountedLayers(torch.nn.Module):
    """Five equal blocks called by index up to a count fixed at build time (as models that loop
    over ``range(config.num_hidden_layers)`` do): the model cannot run with its chain cut."""

    def __init__(self, width: int = 32, depth: int = 5):
        super().__init__()
        self.depth = depth
        self.layers = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.GELU())
                                          for _ in range(depth))

    def forward(self, x):
        for i in range(self.depth):
            x = self.layers[i](x)
        return x
