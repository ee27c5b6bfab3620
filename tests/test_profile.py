"""Profile oracles: analytic saved bytes, rows add up, MemTracker agreement, meta == cpu."""
import textwrap

import pytest
import torch
import torch.nn as nn
from conftest import CONFIGS, tiny_gpt_spec, write_spec

from ckplan import api
from ckplan.spec import to_loss


class Chain(nn.Module):
    def __init__(self, widths, act):
        super().__init__()
        self.layers = nn.Sequential(*[nn.Sequential(nn.Linear(a, b), act()) for a, b in zip(widths, widths[1:])])

    def forward(self, x):
        return self.layers(x)


@pytest.mark.parametrize("act,factor", [(nn.ReLU, 1), (nn.GELU, 2), (nn.Tanh, 1)])
def test_saved_bytes_linear_chains_are_analytic(act, factor):
    # ReLU/Tanh keep their output (which the next Linear also saves; the pre-activation is freed):
    # B*d_out*4. GELU keeps its input and the next Linear keeps its output: 2*B*d_out*4.
    B, widths = 8, [16, 48, 32, 64, 24]
    model = Chain(widths, act)
    prof = api.profile_model(model, (torch.randn(B, widths[0]),), {}, name="chain", chain=None,
                             device="cpu", repeats=1, warmup=0)
    layers = prof.chain_layers
    assert [r.saved_bytes for r in layers] == [factor * B * d * 4 for d in widths[1:]]
    assert [r.output_bytes for r in layers] == [B * d * 4 for d in widths[1:]]
    assert [r.param_bytes for r in layers] == [(a * b + b) * 4 for a, b in zip(widths, widths[1:])]
    assert prof.chain == "layers" and prof.chain_detected
    assert prof.pre.saved_bytes == 0 and not prof.input_requires_grad  # the batch is not an activation
    assert sum(r.saved_bytes for r in prof.layers) == prof.totals.activation_bytes
    assert sum(r.param_bytes for r in prof.layers) == prof.totals.param_bytes
    assert sum(r.grad_bytes for r in prof.layers) == prof.totals.grad_bytes == prof.totals.param_bytes
    # Adam keeps two moments per parameter (plus a scalar step per tensor).
    assert 2 * prof.totals.param_bytes <= prof.totals.optimizer_bytes <= 2 * prof.totals.param_bytes + 64 * 8


def test_profile_leaves_model_unchanged():
    model = Chain([8, 8, 8], nn.ReLU).eval()
    g = torch.ones(8, 8)
    model.layers[0][0].weight.grad = g
    before = {k: v.clone() for k, v in model.state_dict().items()}
    api.profile_model(model, (torch.randn(4, 8),), {}, name="m", chain="layers", device="cpu",
                      repeats=1, warmup=1)
    assert not model.training
    assert model.layers[0][0].weight.grad is g
    assert model.layers[1][0].weight.grad is None
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])
    for m in model.modules():
        assert not m._forward_hooks and not m._forward_pre_hooks


def test_resnet_buffers_restored_and_sizes_shrink(tmp_path):
    spec = api.load(CONFIGS / "resnet.yaml", batch_size=2)
    prof = api.profile(spec, device="cpu", repeats=1, warmup=0)
    outs = [r.output_bytes for r in prof.chain_layers]
    assert outs[0] > outs[-1]  # spatial size halves each stage, channels double
    assert prof.totals.activation_bytes == sum(r.saved_bytes for r in prof.layers)


def test_gpt2_small_activation_matches_memtracker():
    from torch.distributed._tools.mem_tracker import MemTracker

    from ckplan.spec import build_model, make_batch
    from ckplan.training import forward_loss

    spec = api.load(CONFIGS / "gpt2-small.yaml", batch_size=1, seq_len=64)
    prof = api.profile(spec, device="cpu", repeats=1, warmup=0)
    model = build_model(spec)
    args, kwargs = make_batch(spec)
    mt = MemTracker()
    mt.track_external(model, *args, *kwargs.values())
    with mt:
        loss = forward_loss(model, args, kwargs, to_loss, "fp32", "cpu")
        snap = mt.get_tracker_snapshot("current")[torch.device("cpu")]
        loss.backward()
    act = next(v for k, v in snap.items() if str(getattr(k, "value", k)) == "Activation")
    assert abs(prof.totals.activation_bytes - act) / act < 0.02
    # The tied embedding's gradient first exists where the LM head uses it: in post.
    assert prof.post.grad_bytes >= 50257 * 768 * 4


def test_meta_and_cpu_agree_on_sizes(tmp_path):
    spec = api.load(tiny_gpt_spec(tmp_path))
    cpu = api.profile(spec, device="cpu", repeats=1, warmup=0)
    meta = api.profile(spec, device="meta")
    for a, b in zip(cpu.layers, meta.layers):
        assert (a.saved_bytes, a.output_bytes, a.param_bytes, a.grad_bytes) == \
               (b.saved_bytes, b.output_bytes, b.param_bytes, b.grad_bytes)
        assert a.fwd_flops == b.fwd_flops and a.bwd_flops == b.bwd_flops
    assert meta.times_estimated and not cpu.times_estimated
    assert cpu.totals.optimizer_bytes == meta.totals.optimizer_bytes


def test_unseen_target_model(tmp_path, monkeypatch):
    # A model no other test has seen: Conv1d blocks in a ModuleList, found without `chain:`.
    (tmp_path / "unseen_net.py").write_text(textwrap.dedent("""
        import torch.nn as nn

        class Block(nn.Module):
            def __init__(self, c):
                super().__init__()
                self.conv = nn.Conv1d(c, c, 3, padding=1)
                self.act = nn.ReLU()
            def forward(self, x):
                return self.act(self.conv(x))

        class Net(nn.Module):
            def __init__(self, c, depth):
                super().__init__()
                self.stem = nn.Conv1d(1, c, 1)
                self.body = nn.ModuleList(Block(c) for _ in range(depth))
                self.head = nn.Linear(c, 1)
            def forward(self, x):
                x = self.stem(x)
                for b in self.body:
                    x = b(x)
                return self.head(x.mean(-1))

        def build(c=8, depth=5):
            return Net(c, depth)
    """))
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    spec_path = write_spec(tmp_path, """
model: {target: "unseen_net:build", args: {c: 8, depth: 5}}
input: {batch_size: 4, shape: [1, 50], dtype: float32}
""")
    prof = api.profile(api.load(spec_path), device="cpu", repeats=1, warmup=0)
    assert prof.chain == "body" and prof.chain_detected
    B, C, L = 4, 8, 50
    # Each block's ReLU output is kept (by ReLU and by the next conv): B*C*L*4 bytes.
    assert [r.saved_bytes for r in prof.chain_layers] == [B * C * L * 4] * 5
    # The stem's output is saved by the first block's conv and counted under pre.
    assert prof.pre.saved_bytes == B * C * L * 4 and prof.input_requires_grad
