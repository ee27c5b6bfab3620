"""The kernels a meta profile replays for its target (ckplan.sdpa): dropout as CUDA fuses it."""
from __future__ import annotations

import pytest
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


def test_experts_matmul_is_chosen_as_on_the_target(monkeypatch):
    """transformers 5 picks its experts' matmul by the weights' device (a loop of mm on a CPU with
    torch <= 2.8, torch._grouped_mm elsewhere): on meta a CPU target is asked with CPU tensors of
    the same shapes and dtypes, a CUDA target as transformers asks of meta; restored on exit."""
    moe = pytest.importorskip("transformers.integrations.moe")
    if not hasattr(moe, "_can_use_grouped_mm"):
        pytest.skip("this transformers picks no experts' matmul")
    asked = []
    monkeypatch.setattr(moe, "_can_use_grouped_mm", lambda *ts: asked.append(
        [(t.device.type, t.dtype, tuple(t.shape)) for t in ts]) or True)
    mine = moe._can_use_grouped_mm
    x, w = torch.empty(6, 4, device="meta"), torch.empty(3, 4, 5, device="meta", dtype=torch.bfloat16)
    offs = torch.empty(3, device="meta", dtype=torch.int32)
    for target, device in (("cpu", "cpu"), ("cuda", "meta")):
        asked.clear()
        with SdpaOnMeta(target):
            assert moe._can_use_grouped_mm(x, w, offs) is True
        assert asked == [[(device, torch.float32, (6, 4)), (device, torch.bfloat16, (3, 4, 5)),
                          (device, torch.int32, (3,))]], target
        assert moe._can_use_grouped_mm is mine
