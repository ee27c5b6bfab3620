"""Profile oracles: analytic saved bytes, rows add up, MemTracker agreement, meta == cpu."""
import textwrap

import pytest
import torch
import torch.nn as nn

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
    # AdamW on the CPU keeps two moments per parameter and a 4-byte step counter per tensor.
    n_tensors = 2 * len(layers)
    assert prof.totals.optimizer_bytes == 2 * prof.totals.param_bytes + 4 * n_tensors
    assert prof.totals.optimizer_scalar_bytes == 4 * n_tensors


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


def test_resnet_buffers_restored_and_sizes_shrink(configs, tmp_path):
    spec = api.load(configs / "resnet.yaml", batch_size=2)
    prof = api.profile(spec, device="cpu", repeats=1, warmup=0)
    outs = [r.output_bytes for r in prof.chain_layers]
    assert outs[0] > outs[-1]  # spatial size halves each stage, channels double
    assert prof.totals.activation_bytes == sum(r.saved_bytes for r in prof.layers)


@pytest.mark.slow
def test_gpt2_small_activation_matches_memtracker(configs):
    from torch.distributed._tools.mem_tracker import MemTracker

    from ckplan.spec import build_model, make_batch
    from ckplan.training import forward_loss

    spec = api.load(configs / "gpt2-small.yaml", batch_size=1, seq_len=64)
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


def test_meta_and_cpu_agree_on_sizes(tiny_gpt_spec, tmp_path):
    spec = api.load(tiny_gpt_spec(tmp_path))
    cpu = api.profile(spec, device="cpu", repeats=1, warmup=0)
    meta = api.profile(spec, device="meta")
    for a, b in zip(cpu.layers, meta.layers):
        assert (a.saved_bytes, a.output_bytes, a.param_bytes, a.grad_bytes) == \
               (b.saved_bytes, b.output_bytes, b.param_bytes, b.grad_bytes)
        assert a.fwd_flops == b.fwd_flops and a.bwd_flops == b.bwd_flops
    assert meta.times_estimated and not cpu.times_estimated
    assert cpu.totals.optimizer_bytes == meta.totals.optimizer_bytes


def test_a_meta_profile_for_a_gpu_counts_its_cuda_runtime_blocks(tiny_gpt_spec, tmp_path):
    """Fake tensors make no cuBLAS workspaces, but the GPU a meta profile stands for will: every
    peak carries the device model's runtime bytes, and nothing else changes."""
    from ckplan.device_model import BUILTIN
    spec = api.load(tiny_gpt_spec(tmp_path))
    cpu_kind = api.profile(spec, device="meta", meta_target="cpu")
    for target in ("h200", "a100"):
        gpu = api.profile(spec, device="meta", meta_target=target)
        extra = BUILTIN[target].runtime_bytes
        assert gpu.totals.runtime_bytes == extra > 0 and cpu_kind.totals.runtime_bytes == 0
        assert gpu.totals.param_bytes == cpu_kind.totals.param_bytes
        assert any(f"{extra / 2**20:.1f} MiB" in n for n in gpu.notes)
        # the same sizes as a CUDA-kind profile with no runtime, plus the runtime: the workspaces
        bare = api.profile(spec, device="meta", meta_target=_without_runtime(BUILTIN[target], tmp_path))
        assert bare.totals.runtime_bytes == 0
        assert _none_peak(gpu) - _none_peak(bare) == extra
        assert gpu.totals.predicted_peak_bytes - bare.totals.predicted_peak_bytes == extra


def _none_peak(prof) -> int:
    from ckplan.planner import chain_from_profile, plan_chain
    return plan_chain(chain_from_profile(prof), "none").score.peak_bytes


def _without_runtime(device, tmp_path):
    from dataclasses import replace

    from ckplan.device_model import save_device
    path = tmp_path / f"{device.name}-bare.json"
    save_device(replace(device, runtime_bytes=0), path)
    return str(path)


def test_unseen_target_model(write_spec, tmp_path, monkeypatch):
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


# ----------------------------------------------------------------------------- meta follows the target's attention


class Attend(nn.Module):
    """qkv projection, SDPA with the given keywords, output projection."""

    def __init__(self, c, heads, kv_heads, sdpa_kwargs):
        super().__init__()
        self.heads, self.kv_heads = heads, kv_heads
        self.kw = {k: v for k, v in sdpa_kwargs.items() if k != "attn_mask"}
        mask = sdpa_kwargs.get("attn_mask")
        self.register_buffer("mask", None if mask is None else mask.clone(), persistent=False)
        self.hd = c // heads
        self.qkv = nn.Linear(c, c + 2 * kv_heads * self.hd)
        self.proj = nn.Linear(c, c)

    def forward(self, x):
        B, T, C = x.shape
        kv = self.kv_heads * self.hd
        q, k, v = self.qkv(x).split([C, kv, kv], dim=2)
        q = q.view(B, T, self.heads, self.hd).transpose(1, 2)  # (B, nh, T, hd)
        k = k.view(B, T, self.kv_heads, self.hd).transpose(1, 2)
        v = v.view(B, T, self.kv_heads, self.hd).transpose(1, 2)
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=self.mask, **self.kw)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class AttnChain(nn.Module):
    def __init__(self, depth=2, c=32, heads=4, kv_heads=4, **sdpa_kwargs):
        super().__init__()
        self.layers = nn.ModuleList(Attend(c, heads, kv_heads, sdpa_kwargs) for _ in range(depth))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x.square().mean()


T_ATT = 24
ATTENTION_CASES = {
    "plain": {},
    "causal": dict(is_causal=True),
    "dropout": dict(dropout_p=0.1),  # CPU flash refuses dropout: the math path keeps (B, H, T, T)
    "causal+dropout": dict(is_causal=True, dropout_p=0.1),
    "bool-mask": dict(attn_mask=torch.rand(T_ATT, T_ATT) > 0.2),  # flash, after a float conversion
    "float-mask-4d": dict(attn_mask=torch.randn(2, 1, T_ATT, T_ATT)),
    "gqa": dict(enable_gqa=True, kv_heads=2),
    "gqa+dropout": dict(enable_gqa=True, kv_heads=2, dropout_p=0.2),
}


@pytest.mark.parametrize("case", list(ATTENTION_CASES))
def test_meta_follows_the_cpu_attention_kernel(case):
    kw = dict(ATTENTION_CASES[case])
    torch.manual_seed(0)
    model = AttnChain(**kw)
    x = torch.randn(2, T_ATT, 32)
    cpu = api.profile_model(model, (x,), {}, name="a", chain="layers", device="cpu", repeats=1,
                            warmup=0, loss_fn=lambda out: out)
    meta = api.profile_model(model.to("meta"), (x.to("meta"),), {}, name="a", chain="layers",
                             device="meta", loss_fn=lambda out: out)
    for a, b in zip(cpu.layers, meta.layers):
        assert (a.name, a.saved_bytes, a.fwd_peak_bytes, a.bwd_peak_bytes) == \
               (b.name, b.saved_bytes, b.fwd_peak_bytes, b.bwd_peak_bytes)


def _activation_peak(prof):
    return max(max(r.fwd_peak_bytes, r.bwd_peak_bytes) for r in prof.layers)


SHIPPED = [
    ("gpt2-small.yaml", dict(batch_size=1, seq_len=64)),
    ("hf-bert.yaml", dict(batch_size=1, seq_len=128)),
    ("resnet.yaml", dict(batch_size=2)),
    pytest.param("bert-large.yaml", dict(batch_size=1, seq_len=128), marks=pytest.mark.slow),
]


@pytest.mark.slow
@pytest.mark.parametrize("config,over", SHIPPED)
def test_meta_predicts_the_cpu_measurement_on_shipped_configs(configs, config, over):
    if config.startswith("hf-"):
        pytest.importorskip("transformers")
    spec = api.load(configs / config, **over)
    meta = api.profile(spec, device="meta")
    cpu = api.profile(spec, device="cpu", repeats=1, warmup=0)
    assert abs(meta.totals.activation_bytes / cpu.totals.activation_bytes - 1) < 0.02
    assert abs(meta.totals.predicted_peak_bytes / cpu.totals.measured_peak_bytes - 1) < 0.02
    assert abs(_activation_peak(meta) / _activation_peak(cpu) - 1) < 0.02


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("accum", [1, 3])
def test_the_measured_peak_of_a_step_is_the_predicted_one(tiny_gpt_spec, tmp_path, accum, precision):
    """Two independent numbers: the tracker's peak of the measured micro-batch (with accumulation,
    a later one, which starts with the gradients held) and the simulator's; and bench's `none`
    row, which runs the whole step, measures the same."""
    spec = api.load(tiny_gpt_spec(tmp_path), accum=accum, precision=precision, optimizer="adamw")
    prof = api.profile(spec, device="cpu", repeats=1, warmup=0)
    assert prof.totals.measured_peak_bytes == prof.totals.predicted_peak_bytes
    row = api.bench(spec, strategies=["none"], steps=1, warmup=0, device="cpu").rows[0]
    assert row.measured_peak_bytes == prof.totals.measured_peak_bytes


def test_where_the_optimizer_step_peaks_the_measured_step_is_the_predicted_forward_backward(tmp_path):
    """A small MLP under AdamW: the step's peak is the optimizer's, above forward+backward; the
    profile's measured forward+backward peak equals the simulator's forward+backward peak, and the
    table shows both."""
    import io

    from rich.console import Console

    from ckplan import render
    from ckplan.planner import chain_from_profile, plan_none
    from ckplan.planner.simulate import forward_backward_peak
    spec = tmp_path / "mlp.yaml"
    spec.write_text("model: {builtin: mlp, args: {in_features: 64, depth: 4, width: 256}}\n"
                    "input: {batch_size: 2, shape: [64], dtype: float32}\ntrain: {optimizer: adamw}\n")
    prof = api.profile(api.load(spec), device="cpu", repeats=1, warmup=0)
    chain = chain_from_profile(prof)
    fwd_bwd = forward_backward_peak(chain, plan_none(chain.n_layers))
    assert prof.totals.measured_peak_bytes == fwd_bwd < prof.totals.predicted_peak_bytes
    con = Console(record=True, width=200, file=io.StringIO(), color_system=None)
    render.profile_table(prof, console=con)
    text = con.export_text()
    assert "predicted peak, forward+backward " in text and "measured peak, forward+backward " in text


def test_a_compiled_profile_measures_a_later_micro_batch_too(tiny_gpt_spec, tmp_path):
    """With the chain layers compiled and accum 3, the profile's peak is the whole step's, as
    bench's `none` row measures it (the first micro-batch's was 256 B off on a tiny GPT)."""
    spec = api.load(tiny_gpt_spec(tmp_path), accum=3, optimizer="adamw")
    prof = api.profile(spec, device="cpu", repeats=1, warmup=0, compile=True)
    row = api.bench(spec, strategies=["none"], steps=1, warmup=0, device="cpu", compile=True).rows[0]
    assert row.measured_peak_bytes == prof.totals.measured_peak_bytes == prof.totals.predicted_peak_bytes


def test_meta_target_cuda_takes_the_fused_kernels():
    from torch.nn.attention import SDPBackend

    from ckplan.profiler import measure_step
    from ckplan.sdpa import cuda_choice

    q16 = torch.empty(2, 4, 64, 32, device="meta", dtype=torch.float16)
    q32, q64 = q16.float(), q16.double()
    assert cuda_choice(q16, q16, q16, None, 0.1, True, False) == SDPBackend.FLASH_ATTENTION
    assert cuda_choice(q32, q32, q32, None, 0.1, False, False) == SDPBackend.EFFICIENT_ATTENTION
    mask = torch.empty(64, 64, device="meta")
    assert cuda_choice(q16, q16, q16, mask, 0.0, False, False) == SDPBackend.EFFICIENT_ATTENTION
    assert cuda_choice(q64, q64, q64, None, 0.0, False, False) == SDPBackend.MATH

    # BERT with attention dropout: math on CPU (keeps the attention matrix), fused on CUDA.
    model = AttnChain(**ATTENTION_CASES["dropout"]).to("meta")
    x = torch.randn(2, T_ATT, 32, device="meta")
    run = {t: measure_step(model, (x,), {}, lambda out: out, chain="layers", device=torch.device("meta"),
                           meta_target=t) for t in ("cpu", "cuda")}
    B, H = 2, 4
    matrix = B * H * T_ATT * T_ATT * 4  # fp32 attention probabilities
    cpu_saved, cuda_saved = (run[t].rows[1].saved_bytes for t in ("cpu", "cuda"))
    assert cpu_saved - cuda_saved >= 2 * matrix
    assert "math x2" in run["cpu"].notes[0] and "--target cpu|cuda" in run["cpu"].notes[0]
    assert "memory-efficient x2" in run["cuda"].notes[0]
    from ckplan.errors import SpecError
    with pytest.raises(SpecError, match=r"device 'tpu' is neither a built-in device model .*h100"):
        measure_step(model, (x,), {}, lambda out: out, chain="layers", device=torch.device("meta"),
                     meta_target="tpu")


# ----------------------------------------------------------------------------- autocast's weight copies


def _block_linear_bytes(block, element_size):
    return sum(p.numel() * element_size for m in block.modules() if isinstance(m, nn.Linear)
               for p in m.parameters())


@pytest.mark.parametrize("precision,element_size", [("fp32", 0), ("bf16", 2), ("fp16", 2)])
def test_cast_bytes_are_the_low_precision_weight_copies(tiny_gpt_spec, tmp_path, precision, element_size):
    from ckplan.spec import build_model
    spec = api.load(tiny_gpt_spec(tmp_path), precision=precision)
    prof = api.profile(spec, device="cpu", repeats=1, warmup=0)
    model = build_model(spec)
    # Each block casts its Linear weights and biases once; LayerNorms stay in fp32.
    assert [r.cast_bytes for r in prof.chain_layers] == \
           [_block_linear_bytes(b, element_size) for b in model.blocks]
    assert prof.pre.cast_bytes == 0  # embeddings run in fp32
    assert prof.post.cast_bytes == model.lm_head.weight.numel() * element_size  # the tied head


def test_checkpointed_layers_hold_their_cast_bytes_until_the_forward_ends(tiny_gpt_spec, tmp_path):
    from ckplan.execute import apply_plan
    from ckplan.measure import LiveTensorTracker
    from ckplan.planner.plan import Checkpoint, Plan, Store
    from ckplan.spec import build_model, make_batch
    from ckplan.training import forward_loss

    def live_when_chain_ends(precision):
        spec = api.load(tiny_gpt_spec(tmp_path, n_layer=4), precision=precision)
        model = build_model(spec)
        args, kwargs = make_batch(spec)
        n = len(model.blocks)
        plan = Plan("all", n, tuple(Checkpoint(i, i + 1, (Store(i),)) for i in range(n)))
        seen = []
        tr = LiveTensorTracker()
        model.blocks[-1].register_forward_hook(lambda m, a, o: seen.append(tr.live))
        with apply_plan(model, plan), tr:
            forward_loss(model, args, kwargs, to_loss, precision, "cpu").backward()
        return seen[0], spec

    fp32_live, _ = live_when_chain_ends("fp32")
    bf16_live, spec = live_when_chain_ends("bf16")
    prof = api.profile(spec, device="cpu", repeats=1, warmup=0)
    # Checkpointed layers keep only their input, the same tensor in both precisions; under
    # autocast each also leaves its weight copies in autocast's cache.
    assert bf16_live - fp32_live == sum(r.cast_bytes for r in prof.chain_layers) > 0


def test_old_profiles_without_cast_bytes_load():
    import json

    from ckplan.records import Profile
    d = json.loads(json.dumps(api.profile_model(Chain([4, 4, 4], nn.ReLU), (torch.randn(2, 4),), {},
                                                name="m", chain=None, device="cpu", repeats=1,
                                                warmup=0).to_dict()))
    for row in d["layers"]:
        del row["cast_bytes"]
    assert all(r.cast_bytes == 0 for r in Profile.from_dict(d).layers)


class _Attn(nn.Module):
    def forward(self, x):  # (B, H, T, D) -> same; the CPU flash kernel on a plain causal call
        return torch.nn.functional.scaled_dot_product_attention(x, x, x, is_causal=True)


class _AttnChain(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([_Attn(), _Attn()])
        self.w = nn.Parameter(torch.ones(()))

    def forward(self, x):
        x = x * self.w
        for layer in self.layers:
            x = layer(x)
        return x.sum()


def test_cpu_flash_attention_flops_are_counted():
    """SDPA's forward is 4·B·H·T²·D FLOPs (two matmuls of 2·T²·D per head) and its backward 2.5x
    that (five); torch counts none for the CPU flash kernels, so the profile registers them."""
    B, H, T, D = 2, 4, 64, 16
    prof = api.profile_model(_AttnChain(), (torch.randn(B, H, T, D),), {}, name="attn", chain="layers",
                             device="cpu", optimizer="sgd", repeats=1, warmup=0)
    for r in prof.chain_layers:
        assert r.fwd_flops == 4 * B * H * T * T * D
        assert r.bwd_flops == 10 * B * H * T * T * D


def test_profiles_without_options_or_recompute_times_are_valid_and_bad_ones_are_named():
    import json
    d = json.loads(json.dumps(api.profile_model(Chain([4, 4, 4], nn.ReLU), (torch.randn(2, 4),), {},
                                                name="m", chain=None, device="cpu", repeats=1,
                                                warmup=0).to_dict()))
    for row in d["layers"]:
        row.pop("options", None)
        row.pop("recompute_ms", None)
    assert api.profile_problem(d) is None
    d["layers"][1]["recompute_ms"] = -1.0
    assert "layers[1].recompute_ms" in api.profile_problem(d)
    d["layers"][1]["recompute_ms"] = float("nan")
    assert "not a finite number" in api.profile_problem(d)


class _ScaledByConstant(nn.Module):
    """A Linear whose output is scaled by a plain tensor attribute (neither parameter nor buffer,
    made before the step); a temporary made and freed first. ``mul`` saves only the constant
    (the Linear's output needs no saving: the constant does not require grad)."""

    def __init__(self, d: int):
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.const = torch.randn(64, d)

    def forward(self, x):
        tmp = x * 2.0
        del tmp
        return self.lin(x) * self.const


def test_a_dead_storage_id_reused_by_a_constant_is_not_billed_to_a_layer():
    # Analytic: each layer saves only its output (the next Linear's input, or pow's for the
    # last); the constant existed before the step and the weights are parameters. Python may
    # give the constant's storage object, first made when ``mul`` saves it, the id of the
    # temporary that just died; the profile billed the constant's 8192 bytes to the layer
    # whose window made that temporary (seen on HF ResNet's and BERT's labels: 16 B, now and
    # then). Three profiles in one process, every one analytic.
    torch.manual_seed(0)
    d, b = 32, 64

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(_ScaledByConstant(d) for _ in range(3))

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return x.pow(2).mean()

    model, x = Net(), torch.randn(b, d)
    for _ in range(3):
        prof = api.profile_model(model, (x,), {}, name="const", chain="layers", device="cpu",
                                 optimizer="sgd", repeats=1, warmup=0)
        assert [r.saved_bytes for r in prof.chain_layers] == [b * d * 4] * 3


def test_a_model_that_cannot_run_in_bf16_gets_the_precision_tip():
    """A layer whose own code needs fp32 (as yoso's custom backward, or cuFFT for fnet, do on a
    GPU): under bf16 autocast the profile stops with one message naming the error and the fix."""
    from ckplan.errors import ModelRunError

    class NeedsFloat(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            y = self.lin(x)
            if y.dtype != torch.float32:
                raise RuntimeError(f"expected scalar type Float but found {y.dtype}")
            return y

    model = nn.Sequential(NeedsFloat(), NeedsFloat())
    with pytest.raises(ModelRunError, match=r"expected scalar type.*Tip: the model's code does not run in this "
                                           r"precision here: profile with --precision fp32"):
        api.profile_model(model, (torch.randn(4, 8),), {}, name="m", chain=None, device="cpu", precision="bf16",
                          repeats=1, warmup=0)
    api.profile_model(model, (torch.randn(4, 8),), {}, name="m", chain=None, device="cpu", repeats=1, warmup=0)


def test_layers_called_out_of_order_are_named_in_the_order_seen():
    from ckplan.errors import ModelRunError

    class Reversed(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(4))

        def forward(self, x):
            for layer in reversed(self.layers):
                x = layer(x)
            return x.sum()

    with pytest.raises(ModelRunError, match=r"saw layer calls \[3, 2, 1, 0\] for 4 layers"):
        api.profile_model(Reversed(), (torch.randn(2, 4),), {}, name="r", chain="layers", device="cpu",
                          repeats=1, warmup=0, loss_fn=lambda out: out)


def test_layers_dropped_in_training_are_named_with_the_fix():
    """LayerDrop (NLLB-MoE's encoder_layerdrop 0.05): layers left out at random in training."""
    from ckplan.errors import ModelRunError

    class Dropping(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(4))

        def forward(self, x):
            for i, layer in enumerate(self.layers):
                if not (self.training and i == 2):  # as a random draw that dropped layer 2
                    x = layer(x)
            return x.sum()

    with pytest.raises(ModelRunError, match=r"layers \[2\] were skipped in this training step \(calls "
                                            r"\[0, 1, 3\] for 4 layers\)") as e:
        api.profile_model(Dropping(), (torch.randn(2, 4),), {}, name="d", chain="layers", device="cpu",
                          repeats=1, warmup=0, loss_fn=lambda out: out)
    assert "layerdrop" in e.value.tip


def test_recurrent_layers_on_meta_are_a_lower_bound_and_said_so():
    """oneDNN's LSTM keeps a backward workspace fake tensors cannot size: the meta bytes stay at or
    below the CPU's measured ones, and the profile says which layers are not exact."""
    class Rec(nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = nn.LSTM(16, 16, batch_first=True)

        def forward(self, x):
            return x + self.rnn(x)[0]

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(Rec() for _ in range(3))

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return x.pow(2).mean()

    torch.manual_seed(0)
    model, x = Net(), torch.randn(4, 12, 16)
    kw = dict(name="rnn", chain="layers", loss_fn=lambda out: out)
    cpu = api.profile_model(model, (x,), {}, device="cpu", repeats=1, warmup=0, **kw)
    meta = api.profile_model(model.to("meta"), (x.to("meta"),), {}, device="meta", **kw)
    assert all(m.saved_bytes <= c.saved_bytes for c, m in zip(cpu.chain_layers, meta.chain_layers))
    assert any("exact but for the LSTM layers" in n for n in meta.notes)
    assert any(n.startswith("meta device: LSTM sizes are a lower bound") for n in meta.notes)
