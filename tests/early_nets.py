"""A chain whose recompute stops before its last layer (early stop), and its measured peak."""
from __future__ import annotations

import torch
import torch.nn as nn

from ckplan.execute import apply_plan
from ckplan.measure import LiveTensorTracker
from ckplan.planner import (
    Plan,
)

B, D, K = 32, 16, 24


class Logged(nn.Module):
    """A block that logs a statistic of its update after its last saved tensor (under no_grad:
    a large temporary, nothing saved), then adds the residual (saves nothing either)."""

    def __init__(self):
        super().__init__()
        self.lin1, self.lin2 = nn.Linear(D, D), nn.Linear(D, D)
        self.w = nn.Parameter(torch.randn(D, K))
        self.stat = 0.0

    def forward(self, x):
        h = self.lin2(torch.tanh(self.lin1(x)))
        with torch.no_grad():
            self.stat = float((h.unsqueeze(-1) * self.w).abs().amax())
        return x + h


class Net(nn.Module):
    """A stem, ``n`` chain layers of class ``block`` (``layers``), a head and a loss."""

    def __init__(self, n: int = 3, block: type[nn.Module] = Logged):
        super().__init__()
        self.stem = nn.Linear(D, D)
        self.layers = nn.ModuleList(block() for _ in range(n))
        self.head = nn.Linear(D, 4)

    def forward(self, x):
        x = self.stem(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x).pow(2).mean()


def _measured(model, x, plan: Plan) -> int:
    model.zero_grad(set_to_none=True)
    with apply_plan(model, plan), LiveTensorTracker() as tr:
        loss = model(x)
        loss.backward()
    return tr.peak
