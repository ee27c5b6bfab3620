"""Tensors made from Python data during a meta step (ckplan.meta_fromdata): counted as on the CPU."""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn as nn

from ckplan import api
from ckplan.meta_fromdata import NOT_DONE, made_on_meta
from ckplan.sdpa import SdpaOnMeta

D = 24


class _FromData(nn.Module):
    """A layer whose saved tensors include tensors made from Python data: an index list (as
    Falcon splits its fused QKV), ``torch.tensor(..., device=x.device)`` and ``new_tensor``."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, 3 * D)

    def forward(self, x):
        qkv = self.lin(x).view(*x.shape[:-1], 3, D)
        q, k = qkv[:, :, [0]], qkv[:, :, [1, 2]]  # index lists: saved by autograd
        scale = torch.tensor([0.5] * D, device=x.device)  # saved by the mul
        bias = x.new_tensor([[1.0] * D])
        return (q * k).sum(2) * scale + bias * x


class _Net(nn.Module):
    def __init__(self, n: int = 3):
        super().__init__()
        self.layers = nn.ModuleList(_FromData() for _ in range(n))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


_FIELDS = ("saved_bytes", "output_bytes", "fwd_peak_bytes", "bwd_peak_bytes", "nosave_peak_bytes")


def _bytes(prof):
    return [tuple(getattr(r, f) for f in _FIELDS) for r in prof.layers]


def test_meta_counts_tensors_made_from_python_data_as_the_cpu_does():
    torch.manual_seed(0)
    model, x = _Net(), torch.randn(2, 16, D)
    kw = dict(name="fromdata", chain="layers", loss_fn=lambda out: out.sum())
    cpu = api.profile_model(model, (x,), {}, device="cpu", repeats=1, warmup=0, **kw)
    meta = api.profile_model(model.to("meta"), (x.to("meta"),), {}, device="meta", **kw)
    assert _bytes(meta) == _bytes(cpu)
    assert meta.totals.predicted_peak_bytes == cpu.totals.predicted_peak_bytes
    # a middle layer saves q and k (the gathered rows), the sum, the index tensors (8 + 16 B),
    # scale and bias (its input is the layer before's output, billed there)
    n = 2 * 16 * D * 4
    assert meta.layers[2].name == "layers.1"
    assert meta.layers[2].saved_bytes == n + 2 * n + n + 8 + 16 + D * 4 + D * 4


@pytest.mark.parametrize("index", [
    [1, 0], (slice(None), [2, 0]), (slice(None), [[0, 1], [1, 2]]),
    (0, [1], slice(1, 3)), (Ellipsis, [0, 0, 1]),
])
def test_indexing_with_lists_keeps_its_meaning(index):
    """Shapes and values on meta agree with the CPU's, for reading and for writing."""
    cpu = torch.arange(3 * 4 * 5, dtype=torch.float32).view(3, 4, 5)
    with SdpaOnMeta("cpu"):
        got = cpu.to("meta")[index]
        written = cpu.to("meta").clone()
        written[index] = 1.0
    assert got.shape == cpu[index].shape and got.is_meta and written.is_meta
    assert made_on_meta(torch.Tensor.__getitem__, (cpu, index), {}) is NOT_DONE  # CPU: not ours


def test_only_meta_data_is_made_again():
    t = torch.empty(2, device="meta")
    assert made_on_meta(torch.tensor, ([1, 2],), {}) is NOT_DONE  # default device
    assert made_on_meta(torch.tensor, (torch.ones(2),), {"device": "meta"}) is NOT_DONE  # a tensor
    made = made_on_meta(torch.tensor, ([1.5, 2.0],), {"device": "meta", "requires_grad": True})
    assert made.is_meta and made.dtype == torch.float32 and made.requires_grad
    assert made_on_meta(torch.as_tensor, ([1, 2], torch.int16, "meta"), {}).dtype == torch.int16
    new = made_on_meta(torch.Tensor.new_tensor, (t.half(), [1, 2]), {})
    assert new.is_meta and new.dtype == torch.float16 and new.shape == (2,)
    assert made_on_meta(torch.Tensor.__getitem__, (t, [[0], [1]]), {}) is NOT_DONE  # a tuple to torch
    assert made_on_meta(torch.Tensor.__getitem__, (t, [True, False]), {}) is NOT_DONE  # a mask: values


def test_falcon_meta_equals_cpu(write_spec, tmp_path):
    """Falcon's fused QKV is split with index lists, which autograd saves: 16 B per layer that a
    meta profile missed."""
    pytest.importorskip("transformers")
    spec = api.load(write_spec(tmp_path, """
model:
  hf: {model_type: falcon, vocab_size: 128, hidden_size: 32, num_hidden_layers: 2,
       num_attention_heads: 4, new_decoder_architecture: true, num_kv_heads: 2, use_cache: false}
  task: causal-lm
input: {batch_size: 2, shape: [16], dtype: int64, high: 128, name: input_ids, labels: copy}
train: {optimizer: sgd, precision: fp32}
"""))
    cpu = api.profile(spec, device="cpu", repeats=1, warmup=0)
    meta = api.profile(spec, device="meta", meta_target="cpu")
    for a, b in zip(cpu.layers, meta.layers):
        ints = {k: v for k, v in dataclasses.asdict(a).items() if isinstance(v, int) and k.endswith("bytes")}
        assert ints == {k: getattr(b, k) for k in ints}, a.name
    assert cpu.totals.predicted_peak_bytes == meta.totals.predicted_peak_bytes
