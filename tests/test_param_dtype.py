"""FSDP2's MixedPrecisionPolicy on one process (ckplan.param_dtype): parameters in the param dtype,
buffers left as they are, floating inputs of every chain layer and of the model cast before their
forward; its profile on meta equal to the CPU one where the model's norms compute in fp32."""
from __future__ import annotations

import pytest
import torch

from ckplan.api import load, profile
from ckplan.distributed import rank_chain
from ckplan.param_dtype import cast_like_fsdp
from ckplan.planner import min_peak, plan_chain
from ckplan.spec import build_model


class Block(torch.nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.lin = torch.nn.Linear(d, d)
        self.register_buffer("scale", torch.ones(d))
        self.seen: list[torch.dtype] = []

    def forward(self, x, extra=None):
        self.seen.append(x.dtype if extra is None else extra.dtype)
        return self.lin(x) * self.scale.to(x.dtype)


class Net(torch.nn.Module):
    def __init__(self, d: int = 8, n: int = 3):
        super().__init__()
        self.layers = torch.nn.ModuleList(Block(d) for _ in range(n))

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x.float(), extra=x.float()) if i == 1 else layer(x.float())
        return x


def test_parameters_cast_buffers_kept_inputs_cast_per_unit():
    net = cast_like_fsdp(Net(), "layers", "bf16")
    assert {p.dtype for p in net.parameters()} == {torch.bfloat16}
    assert {b.dtype for b in net.buffers()} == {torch.float32}  # FSDP2 leaves buffers alone
    out = net(torch.randn(2, 8))
    # each layer got its input (and a keyword input) in bf16, though the model passed fp32
    assert [layer.seen for layer in net.layers] == [[torch.bfloat16]] * 3
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()
    assert {p.grad.dtype for p in net.parameters()} == {torch.bfloat16}


def test_fp16_too_and_a_bad_dtype_is_a_key_error():
    assert {p.dtype for p in cast_like_fsdp(Net(), "layers", "fp16").parameters()} == {torch.float16}
    with pytest.raises(KeyError):
        cast_like_fsdp(Net(), "layers", "int8")


def test_hf_llama_under_the_policy_profiles_on_meta_as_on_cpu(tmp_path):
    """Hugging Face's Llama (RMSNorm in fp32, rotary tables cast to the activations' dtype): the
    meta profile's per-rank peaks equal the CPU's, at every world size."""
    pytest.importorskip("transformers")
    p = tmp_path / "llama-mp.yaml"
    p.write_text("model:\n  hf: {model_type: llama, vocab_size: 256, hidden_size: 64, intermediate_size: 128,\n"
                 "       num_hidden_layers: 3, num_attention_heads: 4, num_key_value_heads: 2, use_cache: false}\n"
                 "  task: causal-lm\n"
                 "input: {batch_size: 2, shape: [32], dtype: int64, high: 256, name: input_ids, labels: copy}\n"
                 "train: {optimizer: adamw}\nparallel: {kind: fsdp, param_dtype: bf16}\n")
    sp = load(p)
    cpu, meta = profile(sp, device="cpu", repeats=1, warmup=0), profile(sp, device="meta")
    assert cpu.param_dtype == meta.param_dtype == "bf16"
    assert {p.dtype for p in build_model(sp, "meta").parameters()} == {torch.float32}  # the masters
    for w in (1, 2, 8):
        a, b = rank_chain(cpu, sp, w, "fsdp"), rank_chain(meta, sp, w, "fsdp")
        assert plan_chain(a, "none").score.peak_bytes == plan_chain(b, "none").score.peak_bytes
        assert min_peak(a) == min_peak(b)
