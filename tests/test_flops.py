"""FLOP counting (ckplan.profiling.flops): ckplan's attention formula against torch's where torch's works,
grouped-query attention counted as its broadcast to the query's heads, and a formula that raises
never aborts a count."""
import pytest
import torch
import torch.nn.functional as F
from torch.utils import flop_counter as fc

from ckplan import api
from ckplan.profiling.flops import FlopCounter, attention_flops, estimated_note, own_formula

SHAPES = [((2, 4, 16, 8), (2, 4, 16, 8), (2, 4, 16, 8)),
          ((1, 8, 33, 16), (1, 8, 20, 16), (1, 8, 20, 12)),  # cross-attention, d_v != d_qk
          ((3, 2, 7, 64), (3, 2, 7, 64), (3, 2, 7, 64))]


@pytest.mark.parametrize("q,k,v", SHAPES)
def test_attention_formula_equals_torchs_for_equal_heads(q, k, v):
    assert attention_flops(q, k, v, backward=False) == fc.sdpa_flop_count(q, k, v)
    g = (*q[:3], v[-1])
    assert attention_flops(q, k, v, backward=True) == fc.sdpa_backward_flop_count(g, q, k, v)


def test_attention_formula_by_hand():
    # b=1, h=2, s_q=3, s_k=5, d=4: Q K^T is 2 * 1*2 * 3*5*4 = 240 FLOPs, P V the same
    assert attention_flops((1, 2, 3, 4), (1, 1, 5, 4), (1, 1, 5, 4), backward=False) == 480
    # backward: recompute Q K^T, then dP, dV, dQ, dK: five products of 120 multiply-adds
    assert attention_flops((1, 2, 3, 4), (1, 1, 5, 4), (1, 1, 5, 4), backward=True) == 1200


def _count(fn, *tensors) -> tuple[int, FlopCounter]:
    counter = FlopCounter()
    with counter:
        fn(*tensors).sum().backward()
    return counter.get_total_flops(), counter


@pytest.mark.skipif("enable_gqa" not in (F.scaled_dot_product_attention.__doc__ or ""),
                    reason="this torch has no enable_gqa")
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("backend", ["MATH", "FLASH_ATTENTION"])
def test_gqa_counts_as_its_broadcast(causal, backend):
    """The oracle: the same attention with key/value repeated to the query's heads (plain
    multi-head attention, which torch's formula counts on every version), on the same kernel."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    torch.manual_seed(0)
    q = torch.randn(2, 8, 24, 16, requires_grad=True)
    k = torch.randn(2, 2, 24, 16, requires_grad=True)
    v = torch.randn(2, 2, 24, 16, requires_grad=True)
    with sdpa_kernel(getattr(SDPBackend, backend)):
        try:
            gqa, counter = _count(lambda q, k, v: F.scaled_dot_product_attention(
                q, k, v, is_causal=causal, enable_gqa=True), q, k, v)
        except RuntimeError as e:  # this torch has no such kernel for grouped-query attention
            pytest.skip(f"{backend}: {str(e).splitlines()[0]}")
        mha, _ = _count(lambda q, k, v: F.scaled_dot_product_attention(
            q, k.repeat_interleave(4, dim=1), v.repeat_interleave(4, dim=1), is_causal=causal), q, k, v)
    assert gqa == mha > 0
    # where torch's own counter takes grouped-query attention, nothing is marked estimated
    for op, how in counter.estimated.items():
        assert "scaled_dot_product" in op and how.startswith("ckplan's formula")


def test_a_formula_that_raises_is_not_fatal_and_is_named():
    counter = FlopCounter()
    mm = torch.ops.aten.mm

    def broken(*args, **kwargs):
        raise AssertionError("shapes are incompatible")

    counter.flop_registry[mm] = counter._guarded(mm, broken)
    a, b = torch.randn(4, 5), torch.randn(5, 6)
    with counter:
        out = a @ b
        torch.randn(3, 4) @ torch.randn(4, 2)  # also counted 0, recorded once
    assert torch.equal(out, torch.mm(a, b))  # the op itself still ran
    assert counter.get_total_flops() == 0
    assert list(counter.estimated) == ["mm"]
    assert counter.estimated["mm"].startswith("not counted")
    assert "AssertionError: shapes are incompatible" in counter.estimated["mm"]
    note = estimated_note(counter.estimated)
    assert "not counted" in note and "mm" in note
    assert estimated_note({}) is None


def test_own_formula_reads_both_layouts():
    q = torch.empty(2, 4, 10, 8, device="meta")  # (b, h, s, d)
    kv = torch.empty(2, 2, 10, 8, device="meta")
    want = attention_flops((2, 4, 10, 8), (2, 2, 10, 8), (2, 2, 10, 8), backward=False)
    assert own_formula(torch.ops.aten._scaled_dot_product_efficient_attention, (q, kv, kv)) == want
    # the raw kernels take (b, s, h, d)
    qt, kvt = q.transpose(1, 2), kv.transpose(1, 2)
    assert own_formula(torch.ops.aten._efficient_attention_forward, (qt, kvt, kvt)) == want
    g = torch.empty(2, 4, 10, 8, device="meta")
    back = attention_flops((2, 4, 10, 8), (2, 2, 10, 8), (2, 2, 10, 8), backward=True)
    assert own_formula(torch.ops.aten._scaled_dot_product_efficient_attention_backward, (g, q, kv, kv)) == back
    assert own_formula(torch.ops.aten.mm, (q, kv)) is None


def _llama(attn: str, kv_heads: int):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=kv_heads,
                                   max_position_embeddings=64, use_cache=False)
    cfg._attn_implementation = attn
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


def test_gqa_llama_profiles_with_attention_counted():
    """A Hugging Face Llama with grouped-query attention (4 heads, 2 key/value heads) profiles on
    the CPU; its attention FLOPs are those of the eager implementation, which repeats key/value
    to the query's heads and multiplies with matmuls torch counts (the backward of SDPA also
    recomputes Q K^T: 2 b h s^2 d more, where it runs a fused kernel; the math kernel's backward
    is the eager one's)."""
    ids = torch.randint(0, 128, (2, 32))
    b, h, s, d = 2, 4, 32, 16
    profiles = {}
    for attn in ("sdpa", "eager"):
        model = _llama(attn, kv_heads=2)
        profiles[attn] = api.profile_model(model, (), {"input_ids": ids, "labels": ids}, name=attn,
                                           chain="model.layers", device="cpu", repeats=1, warmup=0,
                                           loss_fn=lambda out: out.loss)
    for a, e in zip(profiles["sdpa"].chain_layers, profiles["eager"].chain_layers):
        assert a.fwd_flops == e.fwd_flops > 0
        assert a.bwd_flops - e.bwd_flops in (0, 2 * b * h * s * s * d)
    assert all("scaled_dot_product" in op for op in profiles["sdpa"].flops_estimated)
    if profiles["sdpa"].flops_estimated:  # torch's counter refused grouped-query attention
        assert any("ckplan's formula" in n for n in profiles["sdpa"].notes)


def test_a_formula_that_raises_without_a_message_is_an_estimate_not_a_crash():
    # torch 2.9's SDPA formula asserts with no message on grouped-query attention
    from ckplan.profiling.flops import FlopCounter

    def silent(*args, out_val=None, **kwargs):
        raise AssertionError()

    counter = FlopCounter()
    count = counter._guarded(torch.ops.aten.mm, silent)
    assert count(torch.empty(2, 3), torch.empty(3, 4), out_val=None) == 0
    assert counter.estimated["mm"].startswith("not counted; torch's counter raised AssertionError")


def _step_counts(counter_cls):
    """Total FLOPs and per-op counts of a small model's forward+backward (conv, linear, SDPA,
    layer norm, GELU, a loss) under one counter."""
    torch.manual_seed(0)
    conv = torch.nn.Conv1d(8, 16, 3, padding=1)
    lin = torch.nn.Linear(16, 16)
    norm = torch.nn.LayerNorm(16)
    x = torch.randn(2, 8, 12)
    c = counter_cls(display=False) if counter_cls is fc.FlopCounterMode else counter_cls()
    with c:
        h = conv(x).transpose(1, 2)
        h = norm(F.gelu(lin(h)))
        q = h.view(2, 12, 2, 8).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, q, q, is_causal=True)
        loss = F.cross_entropy(out.reshape(-1, 8), torch.arange(48) % 8)
        loss.backward()
    return c.get_total_flops(), {str(k): v for k, v in c.get_flop_counts()["Global"].items()}


def test_the_fast_dispatch_counts_what_torchs_counter_counts():
    # ckplan's counter skips torch's decomposition attempt for ops that have nothing to
    # decompose into: the totals and the per-op counts must be torch's own
    assert _step_counts(FlopCounter) == _step_counts(fc.FlopCounterMode)
    assert _step_counts(FlopCounter)[0] > 0


def test_a_composite_op_that_reaches_the_counter_is_still_decomposed():
    # an op with a CompositeImplicitAutograd kernel seen at the dispatch level (here called
    # straight below autograd) goes to torch's path: its matmul is counted
    a, b = torch.randn(4, 5), torch.randn(5, 3)
    for cls in (FlopCounter, fc.FlopCounterMode):
        c = cls() if cls is FlopCounter else cls(display=False)
        with c, torch._C._AutoDispatchBelowAutograd():
            torch.ops.aten.matmul.default(a, b)
        assert c.get_total_flops() == 2 * 4 * 5 * 3, cls


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_experts_are_counted_whichever_way_transformers_runs_them(device):
    """A Hugging Face Mixtral's experts run as torch._grouped_mm or, where that has no kernel (a
    CPU with torch <= 2.8), as a loop of mm inside a custom op the counter sees whole: either way
    each layer's forward FLOPs are those of its shapes (2 T x the weights a token meets, two of
    four experts, plus SDPA's 4 b s^2 h), on the CPU and on meta."""
    transformers = pytest.importorskip("transformers")
    if int(transformers.__version__.split(".")[0]) < 5:
        pytest.skip("transformers 4's experts pick their tokens with nonzero(): no value on meta")
    cfg = transformers.MixtralConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                     num_experts_per_tok=2, use_cache=False)
    cfg._attn_implementation = "sdpa"
    with torch.device(device):
        model = transformers.MixtralForCausalLM(cfg)
    ids = torch.randint(0, 128, (2, 32), device=device)
    prof = api.profile_model(model, (), {"input_ids": ids, "labels": ids}, name="moe", chain="model.layers",
                             device=device, repeats=1, warmup=0, loss_fn=lambda out: out.loss,
                             meta_target="cpu" if device == "meta" else None)
    b, s, h, kv, ffn = 2, 32, 64, 32, 96
    per_token = 2 * h * h + 2 * h * kv + 4 * h + 2 * 3 * h * ffn  # q, o; k, v; router; 2 experts
    for layer in prof.chain_layers:
        assert layer.fwd_flops == 2 * b * s * per_token + 4 * b * s * s * h, layer.name
