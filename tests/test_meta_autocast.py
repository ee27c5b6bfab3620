"""Autocast on meta (ckplan.meta_autocast): the casts torch's autocast documents per device, the
weight copies cached once per region, and a meta profile under bf16 equal to the CPU's measured one."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from ckplan import api
from ckplan.meta_autocast import AutocastOnMeta, rule

BF16, F32 = torch.bfloat16, torch.float32


def _t(*shape, dtype=F32, grad=False):
    return torch.empty(*shape, device="meta", dtype=dtype, requires_grad=grad)


# torch.amp's "Autocast Op Reference": CUDA runs matmuls and attention in the low precision, and
# softmax, layer_norm, pow, the losses (and sum, through its output dtype) in fp32; CPU has the
# same low-precision list but keeps softmax, layer_norm, pow and sum as they come (its fp32 list
# holds the losses). Ops on no list (embedding, gelu) cast nothing.
CASES = {
    "linear": (F.linear, lambda: (_t(4, 8), _t(16, 8, grad=True)), {"cuda": ((0, BF16), (1, BF16)),
                                                                      "cpu": ((0, BF16), (1, BF16))}),
    "matmul": (torch.matmul, lambda: (_t(4, 8), _t(8, 2)), {"cuda": ((0, BF16), (1, BF16)),
                                                             "cpu": ((0, BF16), (1, BF16))}),
    # CUDA casts einsum's operands; the CPU casts them at the bmm einsum becomes, after permutes
    "einsum": (torch.einsum, lambda: ("bij,bjk->bik", _t(2, 8, 16), _t(2, 16, 4)),
               {"cuda": ((1, BF16), (2, BF16)), "cpu": ((1, BF16), (2, BF16))}),
    "sdpa fp32": (F.scaled_dot_product_attention, lambda: (_t(1, 2, 8, 4), _t(1, 2, 8, 4), _t(1, 2, 8, 4)),
                  {"cuda": ((0, BF16), (1, BF16), (2, BF16)), "cpu": ((0, BF16), (1, BF16), (2, BF16))}),
    # already low precision: nothing to cast (SDPA's own math-path upcast is not autocast's)
    "sdpa bf16": (F.scaled_dot_product_attention,
                  lambda: (_t(1, 2, 8, 4, dtype=BF16), _t(1, 2, 8, 4, dtype=BF16), _t(1, 2, 8, 4, dtype=BF16)),
                  {"cuda": (), "cpu": ()}),
    "softmax": (F.softmax, lambda: (_t(4, 8, dtype=BF16), -1), {"cuda": ((0, F32),), "cpu": ()}),
    "layer_norm": (F.layer_norm, lambda: (_t(4, 8, dtype=BF16), (8,)), {"cuda": ((0, F32),), "cpu": ()}),
    "pow": (torch.pow, lambda: (_t(4, 8, dtype=BF16), 3.0), {"cuda": ((0, F32),), "cpu": ()}),
    "nll_loss": (F.nll_loss, lambda: (_t(4, 8, dtype=BF16), _t(4, dtype=torch.long)),
                 {"cuda": ((0, F32),), "cpu": ((0, F32),)}),
    "embedding": (F.embedding, lambda: (_t(4, dtype=torch.long), _t(16, 8, grad=True)), {"cuda": (), "cpu": ()}),
    "gelu": (F.gelu, lambda: (_t(4, 8, dtype=BF16),), {"cuda": (), "cpu": ()}),
}


@pytest.mark.parametrize("kind", ["cuda", "cpu"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_casts_are_the_devices_documented_policy(case, kind):
    func, args, want = CASES[case]
    got = rule(func, args(), {}, kind, BF16)[0]
    # (torch 2.6 cannot run SDPA's kernel choice on a fake CUDA tensor: nothing to cast, and unasked)
    assert got.asked or not want[kind]
    assert got.casts == want[kind]
    assert got.outs == ()


def test_sum_gets_an_fp32_result_on_cuda_only():
    # fp32_set_opt_dtype: CUDA's autocast gives sum an fp32 output dtype; nothing is cast before it.
    x = _t(4, 8, dtype=BF16)
    cuda, cpu = (rule(torch.sum, (x,), {}, kind, BF16)[0] for kind in ("cuda", "cpu"))
    assert (cuda.casts, cuda.outs) == ((), (F32,))
    assert (cpu.casts, cpu.outs) == ((), ())
    with AutocastOnMeta("cuda", "bf16"):
        assert torch.sum(x).dtype == F32 and (x @ x.t()).dtype == BF16
    with AutocastOnMeta("cpu", "bf16"):
        assert torch.sum(x).dtype == BF16


class _Casts(TorchDispatchMode):
    """Counts the casts of fp32 tensors of ``shape`` to bf16."""

    def __init__(self, shape):
        super().__init__()
        self.shape, self.n = tuple(shape), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if (func is torch.ops.aten._to_copy.default and tuple(args[0].shape) == self.shape
                and args[0].dtype == F32 and kwargs.get("dtype") == BF16):
            self.n += 1
        return func(*args, **kwargs)


def test_a_weight_is_cast_once_per_region():
    lin = nn.Linear(8, 8, device="meta")
    x = _t(2, 8)
    with _Casts(lin.weight.shape) as seen:
        with AutocastOnMeta("cuda", "bf16"):
            y = lin(lin(x).float())  # the weight used twice: one copy, from autocast's cache
            assert y.dtype == BF16
        assert seen.n == 1
        with AutocastOnMeta("cuda", "bf16"):  # a new region (a recompute's): cast again
            lin(x)
        assert seen.n == 2
        with AutocastOnMeta("cuda", "bf16"):
            # neither a view nor a tensor that does not require grad is cached
            w = _t(8, 8)
            F.linear(x, w), F.linear(x, w)
        assert seen.n == 4


def _memory(layer, bwd: bool = True):
    return (layer.saved_bytes, layer.output_bytes, layer.cast_bytes, layer.fwd_peak_bytes,
            *((layer.bwd_peak_bytes,) if bwd else ()),
            tuple((o.name, o.saved_bytes, o.cast_bytes, o.fwd_peak_bytes, *((o.bwd_peak_bytes,) if bwd else ()))
                  for o in layer.options))


def test_meta_under_bf16_equals_the_cpu_measurement(tiny_gpt_spec, tmp_path):
    # The zoo GPT (LayerNorm, GELU, SDPA, tied head) under CPU autocast, measured on real tensors,
    # and on fake ones with the CPU's rules: every layer's bytes to the byte, options included.
    # (A CPU bf16 backward kernel of the block makes a transient meta's does not: 3.5 KB of 670 KB.)
    spec = api.load(tiny_gpt_spec(tmp_path, n_embd=64, n_head=4), precision="bf16")
    cpu = api.profile(spec, device="cpu", repeats=1, warmup=0, options=True)
    meta = api.profile(spec, device="meta", meta_target="cpu", options=True)
    assert [_memory(r, bwd=False) for r in meta.layers] == [_memory(r, bwd=False) for r in cpu.layers]
    for m, c in zip(meta.layers, cpu.layers):
        assert abs(m.bwd_peak_bytes - c.bwd_peak_bytes) <= 0.01 * c.bwd_peak_bytes
    assert all(r.options for r in meta.chain_layers)
    assert any(o.cast_bytes for r in meta.chain_layers for o in r.options)  # copies an option does not keep
    assert sum(r.cast_bytes for r in meta.layers) > 0
    assert meta.totals.predicted_peak_bytes == cpu.totals.predicted_peak_bytes
    assert any("autocast (bf16) replayed as cpu's" in n for n in meta.notes)


@pytest.mark.slow
@pytest.mark.parametrize("config", ["hf-llama-gqa.yaml", "hf-gpt2.yaml", "hf-bert.yaml"])
def test_meta_under_bf16_equals_the_cpu_measurement_on_hf_models(configs, config):
    pytest.importorskip("transformers")
    spec = api.load(configs / config, batch_size=1, precision="bf16")
    cpu = api.profile(spec, device="cpu", repeats=1, warmup=0, options=True)
    meta = api.profile(spec, device="meta", meta_target="cpu", options=True)
    assert [_memory(r) for r in meta.layers] == [_memory(r) for r in cpu.layers]
    assert meta.totals.predicted_peak_bytes == cpu.totals.predicted_peak_bytes


def test_cross_entropy_as_each_device_runs_it():
    # CUDA has no policy for cross_entropy_loss: its log_softmax keeps bf16 and nll_loss (fp32)
    # keeps an fp32 copy of the log-probabilities for the backward (2 + 4 bytes an element); the CPU
    # casts the logits to fp32 first (cross_entropy_loss is on its fp32 list): one fp32 tensor.
    logits, target = _t(64, 100, grad=True), _t(64, dtype=torch.long)
    kept = {}
    for kind in ("cuda", "cpu"):
        saved = {}

        def pack(t, saved=saved):
            saved[id(t.untyped_storage())] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), AutocastOnMeta(kind, "bf16"):
            loss = F.cross_entropy(logits.to(BF16), target)
        assert loss.dtype == F32
        kept[kind] = sum(saved.values()) - 64 * 8 - 4  # less the target and the total weight
    assert kept == {"cuda": 64 * 100 * (2 + 4), "cpu": 64 * 100 * 4}


def test_cuda_rules_keep_softmax_in_fp32():
    # Eager attention's softmax without a dtype: fp32 under CUDA's autocast (it keeps its output
    # for the backward: twice the bytes), the matmul's bf16 under the CPU's.
    def attention(q):
        return torch.softmax(q @ q.transpose(-1, -2), -1) @ q

    q = _t(2, 16, 8, grad=True)
    kept = {}
    for kind in ("cuda", "cpu"):
        sizes = []

        def pack(t, sizes=sizes):
            sizes.append(t.dtype)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), AutocastOnMeta(kind, "bf16"):
            attention(q)
        kept[kind] = sizes
    assert F32 in kept["cuda"] and F32 not in kept["cpu"]


def test_profiles_saved_before_option_copies_were_measured_still_load(tiny_gpt_spec, tmp_path):
    # OptionRecord.cast_bytes is newer than the profile format: a saved option without it reads as
    # 0 (no unkept copies); a field every version writes is still required.
    from ckplan.api import profile_problem
    from ckplan.records import Profile

    prof = api.profile(api.load(tiny_gpt_spec(tmp_path)), device="meta", meta_target="cpu", options=True)
    d = prof.to_dict()
    for row in d["layers"]:
        for o in row.get("options", ()):
            del o["cast_bytes"]
    assert profile_problem(d) is None
    assert all(o.cast_bytes == 0 for r in Profile.from_dict(d).chain_layers for o in r.options)
    del d["layers"][1]["options"][0]["saved_bytes"]
    assert "options[0].saved_bytes is missing" in profile_problem(d)


class _Fp32Island(nn.Module):
    """A block that turns autocast off on its input's device for part of its forward (as
    transformers 4's rotary embeddings do): there the matmul runs, and saves, in fp32."""

    def __init__(self, d: int = 32):
        super().__init__()
        self.a, self.mix, self.b = nn.Linear(d, 4 * d), nn.Linear(4 * d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        h = self.a(x)
        with torch.autocast(device_type=x.device.type, enabled=False):
            h = torch.tanh(self.mix(h.float()))
        return x + self.b(h)


def test_a_model_turning_autocast_off_on_meta_profiles_as_on_the_cpu():
    # torch.autocast("meta") raises on meta; while a meta step runs ckplan lets it through and, as
    # the device does, stops casting inside an enabled=False block: the block's fp32 matmul saves
    # fp32 tensors, byte for byte as the CPU measures them (without the pause they would be bf16).
    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(_Fp32Island() for _ in range(3))

        def forward(self, x):
            for blk in self.blocks:
                x = blk(x)
            return x.float().pow(2).mean()

    def prof(device):
        with torch.device(device):
            model, x = Net(), torch.randn(4, 16, 32)
        return api.profile_model(model, (x,), {}, name="island", chain="blocks", device=device, optimizer="sgd",
                                 precision="bf16", repeats=1, warmup=0, meta_target="cpu" if device == "meta" else None)
    cpu, meta = prof("cpu"), prof("meta")
    assert [_memory(r, bwd=False) for r in meta.layers] == [_memory(r, bwd=False) for r in cpu.layers]
    assert meta.chain_layers[0].saved_bytes > 0
    assert torch.autocast.__name__ == "autocast" and torch.autocast.__module__ == "torch.amp.autocast_mode"
