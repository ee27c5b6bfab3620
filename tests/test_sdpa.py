"""The kernels a meta profile replays for its target (ckplan.sdpa): dropout as CUDA fuses it."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ckplan.profiler import measure_step
from ckplan.sdpa import SdpaOnMeta

N, D = 64, 32  # tokens, width


class _Block(nn.Module):
    def __init__(self, inplace: bool = False):
        super().__init__()
        self.lin, self.drop = nn.Linear(D, D), nn.Dropout(0.1, inplace=inplace)

    def forward(self, x):
        return self.drop(self.lin(x))


class _Net(nn.Module):
    def __init__(self, inplace: bool = False):
        super().__init__()
        self.layers = nn.ModuleList(_Block(inplace) for _ in range(3))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def _saved(target: str, inplace: bool = False) -> int:
    model = _Net(inplace).to("meta")
    x = torch.randn(N, D, device="meta", requires_grad=True)
    m = measure_step(model, (x,), {}, lambda out: out.sum(), chain="layers", device=torch.device("meta"),
                     meta_target=target)
    return m.rows[2].saved_bytes  # the middle layer


def test_dropout_keeps_a_bool_mask_on_cuda_and_its_noise_on_cpu():
    # Both keep the linear's input (N x D fp32); CUDA's fused native_dropout then keeps a one-byte
    # mask, the CPU's dropout (a meta tensor's too) the fp32 noise it multiplied by.
    linear_input = N * D * 4
    assert _saved("cuda") == linear_input + N * D * 1
    assert _saved("cpu") == linear_input + N * D * 4


def test_dropout_off_or_in_place_as_cuda_runs_it():
    x = torch.randn(N, D, device="meta")
    with SdpaOnMeta("cuda"):
        assert F.dropout(x, 0.1, training=False) is x  # eval: nothing drawn
        y = F.dropout(x, 0.1, inplace=True)
        assert y is x
        assert F.dropout(x, 0.0).shape == x.shape
