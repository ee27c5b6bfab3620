"""The meta kernel cache (ckplan.measure.meta_kernels): outputs identical to the kernels' own,
nothing cached that aliases an input or differs by a scalar's type, and a meta profile that is the
same to the byte and the FLOP with and without it."""
from __future__ import annotations

import contextlib

import pytest
import torch

import ckplan.profiler as profiler
from ckplan.api_profile import profile
from ckplan.measure.meta_kernels import MetaKernelCache, fresh_outputs
from ckplan.spec.load import load_spec

aten = torch.ops.aten


def _meta(*shape, dtype=torch.float32):
    return torch.empty(*shape, device="meta", dtype=dtype)


def _same(a, b) -> bool:
    return (a.shape, a.stride(), a.dtype, a.untyped_storage().nbytes()) == \
        (b.shape, b.stride(), b.dtype, b.untyped_storage().nbytes())


CALLS = [
    (aten.mul.Tensor, lambda: (_meta(4, 8), _meta(8))),
    (aten.add.Tensor, lambda: (_meta(4, 8).t(), _meta(8, 4))),  # a transposed input: strides follow
    (aten.pow.Tensor_Scalar, lambda: (_meta(3, 5), 2)),
    (aten.mean.dim, lambda: (_meta(2, 3, 4), [-1], True)),
    (aten.native_layer_norm.default, lambda: (_meta(2, 6), [6], _meta(6), _meta(6), 1e-5)),
    (aten._to_copy.default, lambda: (_meta(2, 3),)),
]


@pytest.mark.parametrize("op,make", CALLS, ids=[str(c[0]) for c in CALLS])
def test_a_cached_call_makes_what_the_kernel_makes(op, make):
    args = make()
    kernel = op(*args)
    cache = MetaKernelCache()
    with cache:
        first = op(*args)
        second = op(*args)
    assert cache.hits == 1
    for want, got in ((kernel, first), (kernel, second)):
        want = want if isinstance(want, tuple) else (want,)
        got = got if isinstance(got, tuple) else (got,)
        assert len(want) == len(got)
        assert all(_same(w, g) for w, g in zip(want, got))
    # a new storage each time, never the recorded one
    one = second if isinstance(second, tuple) else (second,)
    assert all(o.untyped_storage()._cdata != a.untyped_storage()._cdata
               for o in one for a in args if isinstance(a, torch.Tensor))


def test_the_kwargs_dtype_is_part_of_the_key():
    x = _meta(2, 3)
    with MetaKernelCache():
        a = aten._to_copy.default(x, dtype=torch.float16)
        b = aten._to_copy.default(x, dtype=torch.bfloat16)
    assert (a.dtype, b.dtype) == (torch.float16, torch.bfloat16)


def test_a_scalars_type_is_part_of_the_key():
    # 1 == 1.0 as dict keys, but an int tensor times 1.0 is a float tensor
    x = _meta(4, dtype=torch.int64)
    with MetaKernelCache():
        as_int = aten.mul.Scalar(x, 1)
        as_float = aten.mul.Scalar(x, 1.0)
    assert as_int.dtype == torch.int64 and as_float.dtype == torch.float32


def test_the_default_dtype_is_part_of_the_key():
    with MetaKernelCache():
        a = aten.full.default([3], 1.0, device="meta")
        old = torch.get_default_dtype()
        torch.set_default_dtype(torch.float64)
        try:
            b = aten.full.default([3], 1.0, device="meta")
        finally:
            torch.set_default_dtype(old)
    assert (a.dtype, b.dtype) == (torch.float32, torch.float64)


def test_an_undeclared_view_is_never_cached():
    # _unsafe_view returns a view of its input although its schema declares no alias
    x = _meta(4, 6)
    cache = MetaKernelCache()
    with cache:
        views = [aten._unsafe_view.default(x, [24]) for _ in range(3)]
    assert cache.hits == 0
    assert all(v.untyped_storage()._cdata == x.untyped_storage()._cdata for v in views)


def test_in_place_and_view_ops_run_their_kernels():
    assert not fresh_outputs(aten.add_.Tensor)
    assert not fresh_outputs(aten.view.default)
    assert not fresh_outputs(aten.transpose.int)
    assert fresh_outputs(aten.mm.default)
    x = _meta(3, 3)
    cache = MetaKernelCache()
    with cache:
        for _ in range(3):
            assert aten.add_.Tensor(x, x) is x
    assert cache.hits == 0


def test_real_tensors_pass_through():
    x = torch.ones(3)
    cache = MetaKernelCache()
    with cache:
        y = aten.mul.Tensor(x, x)
        z = aten.mul.Tensor(x, x)
    assert cache.hits == 0 and torch.equal(y, z) and y.sum().item() == 3


def _profile_without_cache(spec, monkeypatch):
    monkeypatch.setattr(profiler, "MetaKernelCache", contextlib.nullcontext)
    try:
        return profile(spec, device="meta", options=True)
    finally:
        monkeypatch.undo()


@pytest.mark.parametrize("config", ["gpt-tiny-dist", "hf-llama-gqa", "resnet"])  # GQA, convolutions
def test_a_meta_profile_is_the_same_with_and_without_the_cache(config, configs, monkeypatch):
    spec = load_spec(configs / f"{config}.yaml")
    plain = _profile_without_cache(spec, monkeypatch)
    used: list[MetaKernelCache] = []

    class Counted(MetaKernelCache):
        def __enter__(self):
            used.append(self)
            return super().__enter__()

    monkeypatch.setattr(profiler, "MetaKernelCache", Counted)
    cached = profile(spec, device="meta", options=True)
    assert used and sum(c.hits for c in used) > 0  # the cache was in the profile and saved kernels
    assert cached.to_dict() == plain.to_dict()


def test_layer_norm_backward_lays_its_gradient_out_as_the_cpu_kernel_does():
    # A pooled head (Swin, ViT-style mean pooling over a transposed sequence) hands the last layer
    # norm a transposed gradient: the CPU and CUDA kernels still return a contiguous gradient,
    # torch's meta kernel one with the incoming strides (the layer before then copied it on meta).
    def run(device, mode=contextlib.nullcontext):
        x = torch.randn(2, 16, 8, device=device)
        g = torch.randn(2, 8, 16, device=device).transpose(1, 2)  # (2, 16, 8), not contiguous
        mean, rstd = torch.zeros(2, 16, 1, device=device), torch.ones(2, 16, 1, device=device)
        w, b = torch.ones(8, device=device), torch.zeros(8, device=device)
        with mode():
            return [aten.native_layer_norm_backward.default(g, x, [8], mean, rstd, w, b, [True, True, True])
                    for _ in range(2)]  # the second from the cache
    cpu = run("cpu")[0]
    assert not torch.empty(2, 8, 16).transpose(1, 2).is_contiguous() and cpu[0].is_contiguous()
    for meta in run("meta", MetaKernelCache):
        assert [(t.shape, t.stride()) for t in meta] == [(t.shape, t.stride()) for t in cpu]


def test_a_swin_meta_profile_equals_its_cpu_profile(tmp_path):
    pytest.importorskip("transformers")
    path = tmp_path / "swin.yaml"
    path.write_text("""
model:
  hf: {model_type: swin, image_size: 32, patch_size: 4, embed_dim: 16, depths: [1, 1], num_heads: [2, 2],
       window_size: 4, num_labels: 10}
  task: image-classification
input: {batch_size: 2, shape: [3, 32, 32], dtype: float32, name: pixel_values,
        labels: {shape: [], dtype: int64, high: 10}}
train: {optimizer: sgd}
""")
    spec = load_spec(path)
    meta, cpu = profile(spec, device="meta", options=False), profile(spec, device="cpu", options=False, repeats=1)
    for a, b in zip(meta.layers, cpu.layers):
        for key, value in a.to_dict().items():
            if key.endswith("_bytes"):
                assert value == getattr(b, key), (a.name, key)
    assert meta.totals.predicted_peak_bytes == cpu.totals.predicted_peak_bytes
