"""The probe behind ``spans_layers()``: two tiny layers in one checkpointed segment, whose
gradients must equal the plain ones and whose layers must run three times (forward, and the
recompute of each)."""
from __future__ import annotations

import torch
import torch.nn as nn

from ..planner.plan import Checkpoint, Plan, Store


class _ProbeLayer(nn.Module):
    def __init__(self, g: torch.Generator) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 4, generator=g))
        self.calls = 0

    def forward(self, h):
        self.calls += 1
        return torch.tanh(h @ self.weight)


class _Probe(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)  # leaves the global RNG alone
        self.layers = nn.ModuleList(_ProbeLayer(g) for _ in range(2))
        self.x = torch.randn(3, 4, generator=g)

    def forward(self):
        h = self.x
        for layer in self.layers:
            h = layer(h)
        return h.square().sum()




def probe(executor_type) -> bool:
    """Whether ``executor_type`` (PlanExecutor) runs a two-layer checkpoint with the plain gradients."""
    model = _Probe()
    with torch.enable_grad():
        model().backward()
        plain = [p.grad.clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        plan = Plan("probe", 2, (Checkpoint(0, 2, (Store(0), Store(1))),))
        executor = executor_type(model, list(model.layers), plan, "layers")
        try:
            model().backward()
        finally:
            executor.remove()
    return all(layer.calls == 3 for layer in model.layers) and all(p.grad is not None and torch.equal(p.grad, g)
                                    for p, g in zip(model.parameters(), plain))
