"""The built-in models: shapes, losses against hand computations, parameter counts against
analytic formulas and published numbers, the chain protocol, meta-device builds, causality."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ckplan.zoo import ZOO, ZooArgumentError, build_builtin, zoo_args
from ckplan.zoo import attention as attention_module
from ckplan.zoo.gpt import GPTConfig, Rotary

LLAMA_7B = dict(vocab_size=32000, block_size=4096, n_layer=32, n_head=32, n_embd=4096, ffn_hidden=11008,
                norm="rmsnorm", mlp="swiglu", pos="rope", bias=False, tie_weights=False)
LLAMA_70B = dict(LLAMA_7B, n_layer=80, n_head=64, n_kv_head=8, n_embd=8192, ffn_hidden=28672)

# Small configurations, one per model, fast on CPU.
SMALL = {
    "gpt": dict(vocab_size=97, block_size=16, n_layer=2, n_head=4, n_embd=32),
    "bert": dict(vocab_size=97, max_position=16, n_layer=2, n_head=4, d_model=32, d_ff=64),
    "mlp": dict(in_features=12, depth=4, widths=[12, 24, 8], out_features=5),
    "resnet": dict(layers=[1, 2], widths=[8, 16], num_classes=7),
}


def n_params(model) -> int:
    return sum(p.numel() for p in model.parameters())  # parameters() counts a tied matrix once


def gpt_param_formula(vocab_size, block_size, n_layer, n_head, n_embd, n_kv_head=None, ffn_hidden=None,
                      bias=True, norm="layernorm", mlp="gelu", pos="learned", tie_weights=True, **_):
    V, T, L, C = vocab_size, block_size, n_layer, n_embd
    kv_dim = (n_kv_head or n_head) * (C // n_head)
    ffn = ffn_hidden or 4 * C
    b = int(bias)
    norm_p = C + b * C if norm == "layernorm" else C  # RMSNorm has no bias
    attn = C * (C + 2 * kv_dim) + b * (C + 2 * kv_dim) + C * C + b * C  # fused qkv, then out proj
    ffn_p = 2 * C * ffn + b * (ffn + C) if mlp == "gelu" else 3 * C * ffn + b * (2 * ffn + C)
    return (V * C + (T * C if pos == "learned" else 0) + L * (2 * norm_p + attn + ffn_p) + norm_p
            + (0 if tie_weights else V * C))


def example(name: str, model, batch: int = 2, seq: int = 8):
    """(input, labels) for a zoo model."""
    if name in ("gpt", "bert"):
        ids = torch.randint(0, model.config.vocab_size, (batch, seq))
        return ids, ids.clone()
    if name == "mlp":
        return torch.randn(batch, model.in_features), torch.randint(0, model.config.out_features, (batch,))
    return torch.randn(batch, 3, 32, 32), torch.randint(0, model.config.num_classes, (batch,))


# ----------------------------------------------------------------------------- arguments


def test_zoo_args_lists_the_documented_defaults():
    assert set(ZOO) == {"gpt", "bert", "mlp", "resnet"}
    assert zoo_args("gpt") == dict(vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_embd=768,
                                   dropout=0.0, bias=True, norm="layernorm", mlp="gelu", ffn_hidden=None,
                                   n_kv_head=None, pos="learned", tie_weights=True)
    assert zoo_args("bert") == dict(vocab_size=30522, max_position=512, n_layer=12, n_head=12, d_model=768,
                                    d_ff=3072, dropout=0.1)
    assert zoo_args("mlp") == dict(in_features=512, depth=12, width=512, widths=None, activation="relu",
                                   bias=True, out_features=None)
    assert zoo_args("resnet") == dict(layers=[2, 2, 2, 2], widths=[64, 128, 256, 512], in_channels=3,
                                      num_classes=1000, block="basic")
    zoo_args("resnet")["layers"].append(9)  # a fresh copy each time
    assert zoo_args("resnet")["layers"] == [2, 2, 2, 2]


def test_unknown_model_raises_key_error():
    with pytest.raises(KeyError):
        build_builtin("gpt5", {})
    with pytest.raises(KeyError):
        zoo_args("gpt5")


def test_unknown_argument_names_the_accepted_ones():
    with pytest.raises(TypeError) as err:
        build_builtin("gpt", {"n_layers": 2})
    msg = str(err.value)
    assert "'n_layers'" in msg and "did you mean 'n_layer'" in msg
    assert all(name in msg for name in zoo_args("gpt"))


@pytest.mark.parametrize("name, args, fragment", [
    ("gpt", {"norm": "batchnorm"}, "norm='batchnorm'"),
    ("gpt", {"n_layer": 2.0}, "n_layer=2.0"),
    ("gpt", {"dropout": "1e-1"}, "dropout='1e-1'"),  # what PyYAML makes of 1e-1
    ("gpt", {"n_embd": 30, "n_head": 4}, "multiple of n_head"),
    ("gpt", {"n_head": 12, "n_kv_head": 5}, "multiple of n_kv_head"),
    ("gpt", {"bias": 1}, "bias=1"),
    ("bert", {"d_model": 30}, "multiple of n_head"),
    ("mlp", {"widths": [256, 1024]}, "set in_features=256"),
    ("mlp", {"depth": 1, "widths": [512, 1, 2]}, "needs 2"),
    ("mlp", {"activation": "swish"}, "activation='swish'"),
    ("resnet", {"layers": [2, 2]}, "one width per stage"),
    ("resnet", {"block": "wide"}, "block='wide'"),
])
def test_invalid_values_raise_type_error(name, args, fragment):
    with pytest.raises(TypeError) as err:
        build_builtin(name, args)
    assert isinstance(err.value, ZooArgumentError) and isinstance(err.value, ValueError)
    assert fragment in str(err.value)
    assert "accepted arguments: " + ", ".join(zoo_args(name)) in str(err.value)


# ----------------------------------------------------------------------------- parameter counts


def test_small_gpt_matches_the_nanogpt_formula():
    V, T, L, C = 97, 16, 2, 32
    model = build_builtin("gpt", dict(vocab_size=V, block_size=T, n_layer=L, n_head=4, n_embd=C))
    # wte + wpe + per layer (2 LayerNorms, qkv, proj, fc, proj) + ln_f; lm_head is wte.
    assert n_params(model) == V * C + T * C + L * (12 * C * C + 13 * C) + 2 * C
    assert model.lm_head.weight is model.wte.weight


def test_untied_llama_variant_matches_the_formula():
    args = dict(vocab_size=97, block_size=16, n_layer=3, n_head=8, n_kv_head=2, n_embd=64, ffn_hidden=96,
                norm="rmsnorm", mlp="swiglu", pos="rope", bias=False, tie_weights=False)
    model = build_builtin("gpt", args)
    assert model.lm_head.weight is not model.wte.weight
    assert model.wpe is None
    assert n_params(model) == gpt_param_formula(**args)
    assert "rotary.cos" not in model.state_dict()  # derived tables are non-persistent buffers


@pytest.mark.parametrize("name, args, expected", [
    ("gpt", {}, 124_439_808),  # GPT-2 small
    ("gpt", LLAMA_7B, 6_738_415_616),  # Llama-2-7B
    ("gpt", LLAMA_70B, 68_976_648_192),  # Llama-2-70B
    ("bert", {}, 109_514_298),  # HF BertForMaskedLM, bert-base-uncased
    ("resnet", {}, 11_689_512),  # torchvision resnet18
    ("resnet", {"layers": [3, 4, 6, 3], "block": "bottleneck"}, 25_557_032),  # torchvision resnet50
])
def test_full_size_models_on_meta_have_the_published_counts(name, args, expected):
    with torch.device("meta"):
        model = build_builtin(name, args)
    assert all(p.is_meta for p in model.parameters())
    assert n_params(model) == expected
    if name == "gpt":
        assert gpt_param_formula(**{**zoo_args("gpt"), **args}) == expected


def test_swiglu_default_hidden_follows_llama():
    assert GPTConfig(n_embd=4096, n_head=32, mlp="swiglu").ffn_dim == 11008
    assert GPTConfig(n_embd=768, mlp="gelu").ffn_dim == 3072
    assert GPTConfig(n_embd=768, mlp="swiglu", ffn_hidden=100).ffn_dim == 100


def test_mlp_widths_and_parameter_count():
    args = dict(in_features=6, depth=5, widths=[6, 10], out_features=3, activation="tanh")
    model = build_builtin("mlp", args)
    w = [6, 10, 6, 10, 6, 10]  # the pattern repeated to depth + 1
    assert [layer[0].in_features for layer in model.layers] + [model.layers[-1][0].out_features] == w
    assert all(isinstance(layer[1], torch.nn.Tanh) for layer in model.layers)
    expected = sum(w[i] * w[i + 1] + w[i + 1] for i in range(5)) + (10 * 3 + 3)
    assert n_params(model) == expected
    plain = build_builtin("mlp", dict(in_features=7, depth=3, width=9, bias=False))
    assert n_params(plain) == 7 * 9 + 9 * 9 + 9 * 9 and plain.head is None


# ----------------------------------------------------------------------------- outputs and losses


def test_gpt_logits_and_shifted_loss():
    torch.manual_seed(0)
    model = build_builtin("gpt", SMALL["gpt"]).eval()
    ids = torch.randint(0, 97, (3, 10))
    logits = model(ids)
    assert logits.shape == (3, 10, 97)
    expected = F.cross_entropy(logits[:, :-1].reshape(-1, 97), ids[:, 1:].reshape(-1))
    torch.testing.assert_close(model(ids, labels=ids.clone()), expected)
    labels = ids.clone()
    labels[:, 5:] = -100
    expected = F.cross_entropy(logits[:, :4].reshape(-1, 97), ids[:, 1:5].reshape(-1))
    torch.testing.assert_close(model(ids, labels=labels), expected)


def test_bert_logits_and_mlm_loss():
    torch.manual_seed(0)
    model = build_builtin("bert", SMALL["bert"]).eval()
    ids = torch.randint(0, 97, (3, 10))
    logits = model(ids)
    assert logits.shape == (3, 10, 97)
    expected = F.cross_entropy(logits.reshape(-1, 97), ids.reshape(-1))
    torch.testing.assert_close(model(ids, labels=ids), expected)
    labels = torch.full_like(ids, -100)
    labels[:, 3] = ids[:, 3]  # only masked positions carry labels
    torch.testing.assert_close(model(ids, labels=labels), F.cross_entropy(logits[:, 3], ids[:, 3]))
    assert model.head.decoder.weight is model.embeddings.word.weight


def test_mlp_outputs_and_losses():
    torch.manual_seed(0)
    model = build_builtin("mlp", SMALL["mlp"])
    x = torch.randn(4, 12)
    y = model(x)
    assert y.shape == (4, 5)
    classes = torch.tensor([0, 4, 2, 1])
    torch.testing.assert_close(model(x, labels=classes), F.cross_entropy(y, classes))
    target = torch.randn(4, 5)
    torch.testing.assert_close(model(x, labels=target), F.mse_loss(y, target))
    headless = build_builtin("mlp", dict(in_features=12, depth=2, width=16))
    assert headless(x).shape == (4, 16)


def test_resnet_logits_and_loss():
    torch.manual_seed(0)
    model = build_builtin("resnet", dict(SMALL["resnet"], in_channels=1)).eval()
    x = torch.randn(2, 1, 32, 32)
    logits = model(x)
    assert logits.shape == (2, 7)
    labels = torch.tensor([3, 6])
    torch.testing.assert_close(model(x, labels=labels), F.cross_entropy(logits, labels))


def test_sequence_longer_than_the_tables_is_refused():
    model = build_builtin("gpt", SMALL["gpt"])
    with pytest.raises(ValueError, match="block_size=16"):
        model(torch.zeros(1, 17, dtype=torch.long))


@pytest.mark.parametrize("name", sorted(SMALL))
def test_gradient_reaches_every_parameter(name):
    torch.manual_seed(0)
    args = dict(SMALL[name], dropout=0.1) if name == "gpt" else SMALL[name]
    model = build_builtin(name, args).train()
    x, labels = example(name, model)
    model(x, labels=labels).backward()
    for pname, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, pname


# ----------------------------------------------------------------------------- the chain


@pytest.mark.parametrize("name, chain", [("gpt", "blocks"), ("bert", "layers"), ("mlp", "layers"),
                                         ("resnet", "blocks")])
def test_chain_entries_are_called_once_in_order_on_the_hidden_state(name, chain):
    torch.manual_seed(0)
    model = build_builtin(name, SMALL[name])
    assert type(model).chain_attr == chain
    entries = list(getattr(model, chain))
    calls, outputs, handles = [], [], []
    for i, entry in enumerate(entries):
        def pre(mod, args, kwargs, i=i):
            calls.append((i, len(args), kwargs, args[0]))
        handles.append(entry.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(entry.register_forward_hook(lambda mod, args, out: outputs.append(out)))
    try:
        x, labels = example(name, model)
        model(x, labels=labels)
    finally:
        for h in handles:
            h.remove()
    assert [c[0] for c in calls] == list(range(len(entries)))
    assert all(n_args == 1 and kwargs == {} for _, n_args, kwargs, _ in calls)
    assert all(isinstance(out, torch.Tensor) for out in outputs)
    # Each entry's input is the previous entry's output: one hidden state threads the chain.
    assert all(calls[i][3] is outputs[i - 1] for i in range(1, len(entries)))


def test_resnet_activations_shrink_down_the_chain():
    model = build_builtin("resnet", dict(layers=[2, 1, 2], widths=[8, 16, 32], block="bottleneck"))
    shapes = []
    handles = [b.register_forward_hook(lambda m, a, out: shapes.append(tuple(out.shape)))
               for b in model.blocks]
    model(torch.randn(2, 3, 64, 64))
    for h in handles:
        h.remove()
    # 64 -> stem 32 -> maxpool 16; each later stage halves; bottlenecks output 4x the width.
    assert shapes == [(2, 32, 16, 16), (2, 32, 16, 16), (2, 64, 8, 8), (2, 128, 4, 4), (2, 128, 4, 4)]


# ----------------------------------------------------------------------------- attention


@pytest.mark.parametrize("pos", ["learned", "rope"])
def test_gpt_is_causal(pos):
    torch.manual_seed(0)
    model = build_builtin("gpt", dict(SMALL["gpt"], pos=pos, n_kv_head=2)).eval()
    ids = torch.randint(0, 97, (2, 12))
    changed = ids.clone()
    changed[:, 8] = (ids[:, 8] + 1) % 97
    a, b = model(ids), model(changed)
    torch.testing.assert_close(a[:, :8], b[:, :8])
    assert not torch.allclose(a[:, 8:], b[:, 8:])


def test_bert_is_bidirectional():
    torch.manual_seed(0)
    model = build_builtin("bert", SMALL["bert"]).eval()
    ids = torch.randint(0, 97, (2, 12))
    changed = ids.clone()
    changed[:, 8] = (ids[:, 8] + 1) % 97
    assert not torch.allclose(model(ids)[:, :8], model(changed)[:, :8])


def test_rotary_scores_depend_only_on_relative_position():
    torch.manual_seed(0)
    rotary = Rotary(head_dim=8, block_size=32)
    q, k = torch.randn(8), torch.randn(8)

    def score(m, n):  # q at position m, k at position n
        qs = torch.zeros(1, 1, 32, 8)
        ks = torch.zeros(1, 1, 32, 8)
        qs[0, 0, m], ks[0, 0, n] = q, k
        return rotary(qs)[0, 0, m] @ rotary(ks)[0, 0, n]

    torch.testing.assert_close(score(5, 2), score(20, 17))
    assert not torch.allclose(score(5, 2), score(5, 4))
    torch.testing.assert_close(score(0, 0), q @ k)  # position 0 is not rotated


def test_rotary_matches_the_complex_rotation():
    # RoFormer eq. 34 in complex form: the pair (x_i, x_{i+d/2}) at position m turns by m * theta_i,
    # theta_i = 10000^(-2i/d) ("rotate half" pairs dimension i with i + d/2).
    torch.manual_seed(0)
    d, T = 8, 16
    x = torch.randn(2, 3, T, d)
    theta = 10000.0 ** (-torch.arange(0, d, 2).double() / d)  # (d/2,)
    angles = torch.arange(T).double()[:, None] * theta  # (T, d/2)
    z = torch.complex(x[..., : d // 2].double(), x[..., d // 2:].double())  # (2, 3, T, d/2)
    z = z * torch.polar(torch.ones_like(angles), angles)
    expected = torch.cat((z.real, z.imag), dim=-1).float()
    torch.testing.assert_close(Rotary(head_dim=d, block_size=T)(x), expected)


def test_gqa_paths_agree(monkeypatch):
    if not attention_module._SDPA_HAS_GQA:
        pytest.skip("this torch has no enable_gqa; only the repeat_interleave path exists")
    torch.manual_seed(0)
    model = build_builtin("gpt", dict(SMALL["gpt"], n_head=8, n_kv_head=2, pos="rope")).eval()
    ids = torch.randint(0, 97, (2, 12))
    fused = model(ids)
    monkeypatch.setattr(attention_module, "_SDPA_HAS_GQA", False)
    torch.testing.assert_close(model(ids), fused)


def _explicit_attention(q, k, v, causal):
    """softmax(q k^T / sqrt(hd)) v written out, over (B, nh, T, hd); k, v already per query head."""
    scores = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5  # (B, nh, T, T)
    if causal:
        T = q.shape[-2]
        scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    return scores.softmax(-1) @ v


@pytest.mark.parametrize("n_kv_head", [None, 2])
def test_gpt_attention_is_the_explicit_formula(n_kv_head):
    torch.manual_seed(0)
    model = build_builtin("gpt", dict(SMALL["gpt"], n_head=4, n_kv_head=n_kv_head)).eval()
    attn, B, T, C = model.blocks[0].attn, 2, 7, 32
    x = torch.randn(B, T, C)
    kv = attn.n_kv_head * 8
    q, k, v = attn.c_attn(x).split([C, kv, kv], dim=2)
    heads = lambda t: t.view(B, T, -1, 8).transpose(1, 2)  # (B, h, T, 8)
    q, k, v = heads(q), heads(k), heads(v)
    k, v = (t.repeat_interleave(4 // attn.n_kv_head, dim=1) for t in (k, v))
    y = _explicit_attention(q, k, v, causal=True).transpose(1, 2).reshape(B, T, C)
    torch.testing.assert_close(attn(x), attn.c_proj(y))
    assert [n for n, _ in attn.named_parameters()] == ["c_attn.weight", "c_attn.bias", "c_proj.weight",
                                                        "c_proj.bias"]


def test_bert_attention_is_the_explicit_formula():
    torch.manual_seed(0)
    model = build_builtin("bert", SMALL["bert"]).eval()
    attn = model.layers[0].attn
    B, T, C, nh = 2, 7, model.config.d_model, model.config.n_head
    x = torch.randn(B, T, C)
    heads = lambda t: t.view(B, T, nh, C // nh).transpose(1, 2)  # (B, nh, T, hd)
    y = _explicit_attention(heads(attn.query(x)), heads(attn.key(x)), heads(attn.value(x)), causal=False)
    torch.testing.assert_close(attn(x), attn.out(y.transpose(1, 2).reshape(B, T, C)))
    assert [n.split(".")[0] for n, _ in attn.named_parameters()][::2] == ["query", "key", "value", "out"]


# ----------------------------------------------------------------------------- meta device


def test_llama_variant_runs_forward_and_backward_on_meta():
    with torch.device("meta"):
        model = build_builtin("gpt", dict(LLAMA_7B, n_layer=2, n_kv_head=8))
        ids = torch.randint(0, 32000, (2, 256))
        loss = model(ids, labels=ids)
        loss.backward()
    assert loss.is_meta and loss.shape == ()
    assert all(p.grad is not None and p.grad.is_meta and p.grad.shape == p.shape for p in model.parameters())


def test_llama_70b_runs_forward_and_backward_on_meta():
    with torch.device("meta"):
        model = build_builtin("gpt", LLAMA_70B)
        ids = torch.randint(0, 32000, (1, 64))
        model(ids, labels=ids).backward()
    assert model.lm_head.weight.grad.shape == (32000, 8192)
    assert model.blocks[0].attn.c_attn.weight.shape == (8192 + 2 * 8 * 128, 8192)


@pytest.mark.parametrize("name", ["bert", "mlp", "resnet"])
def test_other_models_run_on_meta(name):
    with torch.device("meta"):
        model = build_builtin(name, {})
        if name == "bert":
            x = labels = torch.randint(0, 30522, (2, 128))
        elif name == "mlp":
            x, labels = torch.randn(4, 512), torch.randn(4, 512)
        else:
            x, labels = torch.randn(2, 3, 224, 224), torch.randint(0, 1000, (2,))
        model(x, labels=labels).backward()
    assert all(p.grad is not None and p.grad.is_meta for p in model.parameters())


def test_meta_model_materializes_with_init_weights():
    with torch.device("meta"):
        model = build_builtin("gpt", dict(SMALL["gpt"], pos="rope"))
    model.to_empty(device="cpu")
    model.init_weights()
    reference = Rotary(head_dim=8, block_size=16)
    torch.testing.assert_close(model.rotary.cos, reference.cos)
    torch.testing.assert_close(model.ln_f.weight, torch.ones(32))
    assert torch.isfinite(model(torch.randint(0, 97, (1, 8)))).all()
