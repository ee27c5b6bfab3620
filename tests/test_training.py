"""ckplan.training: the optimizer's memory from stand-ins, against a real optimizer step on real
parameters under the live-tensor tracker."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from ckplan.measure import LiveTensorTracker
from ckplan.training import make_optimizer, optimizer_memory


def _model() -> nn.Module:
    """Repeated blocks of mixed shapes, with a head and tail of other shapes."""
    blocks = [nn.Sequential(nn.Linear(24, 40), nn.LayerNorm(40), nn.Linear(40, 24)) for _ in range(5)]
    return nn.Sequential(nn.Embedding(50, 24), *blocks, nn.LayerNorm(24), nn.Linear(24, 50, bias=False))


def _real_step_memory(model: nn.Module, name: str) -> tuple[int, int]:
    """(state bytes, transient of the second step) of a real per-tensor step on real tensors."""
    params = list(model.parameters())
    for p in params:
        p.grad = torch.randn_like(p)
    opt = make_optimizer(params, name, 1e-3, "cpu")
    with LiveTensorTracker() as tr:
        opt.step()
        state = tr.live
        tr.reset_peak()
        opt.step()
        return state, tr.peak - tr.live


@pytest.mark.parametrize("name", ["adamw", "sgd-momentum", "sgd"])
def test_per_tensor_optimizer_memory_equals_a_real_step(name):
    model = _model()
    state, tmp, scalars = optimizer_memory(list(model.parameters()), name, 1e-3, "cpu")
    real_state, real_tmp = _real_step_memory(model, name)
    assert (state, tmp) == (real_state, real_tmp)
    n = len(list(model.parameters()))
    assert scalars == (n * 4 if name == "adamw" else 0)  # one fp32 step counter per parameter


def test_shape_order_matters_for_the_transient():
    """The transient of a per-tensor AdamW step holds what the previous parameter left bound: a
    large parameter after another large one peaks higher than after a small one."""
    big, small = nn.Parameter(torch.zeros(256, 256)), nn.Parameter(torch.zeros(4))
    lone = optimizer_memory([big], "adamw", 1e-3, "cpu")[1]
    pair = optimizer_memory([big, big.detach().clone().requires_grad_()], "adamw", 1e-3, "cpu")[1]
    assert pair > lone
    assert lone < optimizer_memory([small, big], "adamw", 1e-3, "cpu")[1] < pair  # a small one left bound
