"""Test models whose layers get different arguments per layer (for the executor's tests).

Importable as a spec ``target:`` (``target: ckmodels:ScaledChain``) because tests/ is on sys.path.
"""
from __future__ import annotations

import torch
import torch.nn as nn


class ScaledBlock(nn.Module):
    """A residual MLP block whose output depends on a per-call ``scale`` (float) and ``gain`` (tensor)."""

    def __init__(self, d: int, dropout: float):
        super().__init__()
        self.up, self.down = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)
        self.drop = nn.Dropout(dropout)

    def forward(self, hidden_states, scale: float = 1.0, gain=None):
        y = torch.tanh(self.up(hidden_states.to(self.up.weight.dtype)) * scale)  # (B, 2d)
        if gain is not None:
            y = y * gain
        return hidden_states + self.down(self.drop(y))


class ScaledChain(nn.Module):
    """Layer i is called with ``scale=i+1`` and ``gain=self.gains[i]`` (a slice of a parameter);
    even layers get the hidden state positionally, odd ones as ``hidden_states=``.

    ``probe``: the model's own code between two layer calls saves tensors for backward (it adds
    ``(h * probe).sum()`` to the loss) without changing the hidden state.
    """

    def __init__(self, d: int = 32, n_layers: int = 6, dropout: float = 0.0, probe: bool = False):
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.layers = nn.ModuleList(ScaledBlock(d, dropout) for _ in range(n_layers))
        self.gains = nn.Parameter(torch.linspace(0.5, 1.5, n_layers))
        self.probe = nn.Parameter(torch.randn(d) * 0.1) if probe else None
        self.head = nn.Linear(d, 1)

    def forward(self, x):
        h = self.inp(x)
        aux = None
        for i, layer in enumerate(self.layers):
            if i % 2 == 0:
                h = layer(h, scale=float(i + 1), gain=self.gains[i])
            else:
                h = layer(hidden_states=h, scale=float(i + 1), gain=self.gains[i])
            if self.probe is not None:
                p = (h * self.probe).sum()  # saves h and probe, outside the layers
                aux = p if aux is None else aux + p
        loss = self.head(h).pow(2).mean()
        return loss if aux is None else loss + 1e-3 * aux


class TwoStreamBlock(nn.Module):
    """Takes and returns two tensors (hidden state and a residual stream), like parallel-residual models."""

    def __init__(self, d: int):
        super().__init__()
        self.a, self.b = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, h, r, scale: float = 1.0):
        r = r + torch.tanh(self.a(h)) * scale
        return h + self.b(torch.relu(r)), r


class TwoStream(nn.Module):
    def __init__(self, d: int = 16, n_layers: int = 5):
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.layers = nn.ModuleList(TwoStreamBlock(d) for _ in range(n_layers))

    def forward(self, x):
        h = self.inp(x)
        r = torch.zeros_like(h)
        for i, layer in enumerate(self.layers):
            h, r = layer(h, r, scale=1.0 / (i + 1))
        return (h * r).mean()


class CouplingBlock(nn.Module):
    """A reversible-network coupling (RevNet): two equal streams, each updated from the other."""

    def __init__(self, d: int):
        super().__init__()
        self.f = nn.Sequential(nn.Linear(d, 2 * d), nn.Tanh(), nn.Linear(2 * d, d))
        self.g = nn.Sequential(nn.Linear(d, 3 * d), nn.GELU(), nn.Linear(3 * d, d))

    def forward(self, x, y):
        x = x + self.f(y)
        return x, y + self.g(x)


class Coupling(nn.Module):
    """A chain of couplings: every layer hands the next two tensors of the same size."""

    def __init__(self, d: int = 32, n_layers: int = 6):
        super().__init__()
        self.d = d
        self.inp = nn.Linear(d, 2 * d)
        self.layers = nn.ModuleList(CouplingBlock(d) for _ in range(n_layers))

    def forward(self, x):
        h = self.inp(x)
        a, b = h[:, :self.d], h[:, self.d:]
        for layer in self.layers:
            a, b = layer(a, b)
        return (a * b).pow(2).mean()


class UNet(nn.Module):
    """Encoder blocks whose outputs the decoder blocks read (skip connections), one flat chain."""
    def __init__(self, c=8, depth=3):
        super().__init__()
        self.stem = nn.Conv2d(3, c, 3, padding=1)
        chans = [c * 2 ** i for i in range(depth + 1)]
        downs = [nn.Sequential(nn.Conv2d(chans[i], chans[i + 1], 3, stride=2, padding=1), nn.GELU())
                 for i in range(depth)]
        ups = [nn.Sequential(nn.ConvTranspose2d(chans[i + 1], chans[i], 2, stride=2), nn.GELU())
               for i in reversed(range(depth))]
        self.blocks = nn.ModuleList(downs + ups)
        self.depth = depth
        self.head = nn.Conv2d(c, 1, 1)
    def forward(self, x):
        h = self.stem(x)
        skips = []
        for i, blk in enumerate(self.blocks):
            if i < self.depth:
                skips.append(h)
                h = blk(h)
            else:
                h = blk(h) + skips.pop()
        return self.head(h).pow(2).mean()

class DictBlock(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.ff = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.SiLU(), nn.Linear(4 * d, d))
    def forward(self, state):
        return {"h": state["h"] + self.ff(state["h"]), "step": state["step"] + 1}

class DictChain(nn.Module):
    def __init__(self, d=64, n=6):
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.blocks = nn.ModuleList(DictBlock(d) for _ in range(n))
    def forward(self, x):
        state = {"h": self.inp(x), "step": 0}
        for b in self.blocks:
            state = b(state)
        return state["h"].pow(2).mean()

class PreNormResidualMLP(nn.Module):
    """Residual added outside the layer (in the container loop)."""
    def __init__(self, d=128, n=8):
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)) for _ in range(n))
        self.inp = nn.Linear(d, d)
    def forward(self, x):
        h = self.inp(x)
        for layer in self.layers:
            h = h + layer(h)
        return h.pow(2).mean()


class NormInLoop(nn.Module):
    """The container applies a LayerNorm (saving its input) between two chain layers."""

    def __init__(self, d: int = 32, n: int = 5):
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
                                    for _ in range(n))
        self.norms = nn.ModuleList(nn.LayerNorm(d) for _ in range(n))

    def forward(self, x):
        for layer, norm in zip(self.layers, self.norms):
            x = norm(layer(x))
        return x.pow(2).mean()


class CacheBlock(nn.Module):
    """Attention that keeps its probabilities on the module, graph and all (research code's
    ``self.last_attn = attn``)."""

    def __init__(self, d: int):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.ff = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
        self.last_attn: torch.Tensor | None = None

    def forward(self, x):
        a = (self.q(x) @ self.k(x).transpose(-1, -2) / 8).softmax(-1)
        self.last_attn = a
        h = x + a @ self.v(x)
        return h + self.ff(h)


class CachingChain(nn.Module):
    def __init__(self, d: int = 32, n: int = 6):
        super().__init__()
        self.layers = nn.ModuleList(CacheBlock(d) for _ in range(n))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x.pow(2).mean()


def hf_alternating(model_type: str, n_layers: int = 4, *, dropout: float = 0.0, seed: int = 0, full: bool = False):
    """A tiny Hugging Face causal LM with alternating full / sliding-window attention layers (``full``:
    the same weights, every layer full attention)."""
    import transformers
    fields = dict(vocab_size=101, hidden_size=64, intermediate_size=128, num_hidden_layers=n_layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                  layer_types=(["full_attention"] * n_layers if full else
                               ["full_attention", "sliding_attention"] * (n_layers // 2)),
                  sliding_window=4, attention_dropout=dropout, use_cache=False)
    if model_type == "qwen2":
        fields.update(use_sliding_window=True, max_window_layers=0)
    else:  # gemma2 / gemma3_text
        fields.update(head_dim=16, query_pre_attn_scalar=16)
    torch.manual_seed(seed)
    config = transformers.AutoConfig.for_model(model_type, **fields)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").train()


class MixedPrecisionChain(ScaledChain):
    """Runs layer 1 with autocast turned off inside the caller's autocast region (per-layer state)."""

    def forward(self, x):
        h = self.inp(x)
        for i, layer in enumerate(self.layers):
            with torch.autocast("cpu", enabled=i != 1):
                h = layer(h, scale=float(i + 1), gain=self.gains[i])
        return self.head(h).float().pow(2).mean()


def step_with_plan(model, args, kwargs, plan, seed: int = 123):
    """Loss and parameter gradients of one step with ``plan`` applied (None: no plan), from the
    same RNG seed (same dropout masks in every run): the oracle the executor tests compare."""
    from ckplan.execute import apply_plan
    torch.manual_seed(seed)
    model.zero_grad(set_to_none=True)
    ex = apply_plan(model, plan) if plan is not None else None
    try:
        out = model(*args, **kwargs)
        loss = out if isinstance(out, torch.Tensor) else out.loss
        loss.backward()
    finally:
        if ex is not None:
            ex.remove()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


class MaskedBlock(nn.Module):
    """``tanh(up(h) + bias)``: the bias is added, and addition saves neither input, so nothing
    keeps it for backward (like an additive attention mask)."""

    def __init__(self, d: int):
        super().__init__()
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, h, bias, position_ids=None):
        return h + self.down(torch.tanh(self.up(h) + bias))


class _CtxMul(torch.autograd.Function):
    """``a * w`` keeping ``a`` as a ctx attribute (not ``save_for_backward``): no saved-tensor
    hook sees it, so a checkpoint cannot drop it; its node holds it until the graph is freed."""

    @staticmethod
    def forward(ctx, a, w):
        ctx.a = a
        ctx.save_for_backward(w)
        return a * w

    @staticmethod
    def backward(ctx, g):
        (w,) = ctx.saved_tensors
        return g * w, (g * ctx.a).sum(0)


class CtxBlock(nn.Module):
    """``h + down(tanh(up(h)) * w)`` with the product in :class:`_CtxMul` (tanh saves its output
    too: the ctx attribute is the same tensor)."""

    def __init__(self, d: int):
        super().__init__()
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.w = nn.Parameter(torch.randn(4 * d))

    def forward(self, h):
        return h + self.down(_CtxMul.apply(torch.tanh(self.up(h)), self.w))


class CtxChain(nn.Module):
    def __init__(self, d: int = 32, n_layers: int = 6):
        super().__init__()
        self.layers = nn.ModuleList(CtxBlock(d) for _ in range(n_layers))
        self.head = nn.Linear(d, 1)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x).pow(2).mean()


class BiasBlock(nn.Module):
    """A block of :class:`BiasedChain`: the first makes a (B, 4d) bias from its own parameter and
    hands it on with the hidden state; every block adds it (addition saves neither input)."""

    def __init__(self, d: int, first: bool):
        super().__init__()
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.rel = nn.Parameter(torch.randn(4 * d) * 0.1) if first else None

    def forward(self, h, bias=None):
        if bias is None:
            assert self.rel is not None
            bias = self.rel.expand(h.shape[0], -1).clone()  # requires grad; nothing saves it
        return h + self.down(torch.tanh(self.up(h) + bias)), bias


class BiasedChain(nn.Module):
    """T5's position bias in small: the first block makes a learned bias and every later block
    gets it, so its gradient (the sum of what blocks 1..n-1 send back) lives from the last
    block's backward to the first's, recomputes included."""

    def __init__(self, d: int = 32, n_layers: int = 6):
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.layers = nn.ModuleList(BiasBlock(d, i == 0) for i in range(n_layers))
        self.head = nn.Linear(d, 1)

    def forward(self, x):
        h, bias = self.inp(x), None
        for layer in self.layers:
            h, bias = layer(h, bias)
        return self.head(h).pow(2).mean()


class MaskedChain(nn.Module):
    """Side inputs: even layers get one (B, 4d) bias and odd layers another, both made before the
    chain from the input (as Hugging Face models build masks), with ``position_ids`` for all.
    Without checkpoints they die when the forward ends; a checkpoint keeps them until its backward."""

    def __init__(self, d: int = 32, n_layers: int = 6):
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.layers = nn.ModuleList(MaskedBlock(d) for _ in range(n_layers))
        self.head = nn.Linear(d, 1)

    def forward(self, x):
        h = self.inp(x)
        with torch.no_grad():
            even = x.repeat(1, 4) * 0.1
            odd = -even.flip(1)
            pos = torch.arange(x.shape[0]).unsqueeze(1)
        for i, layer in enumerate(self.layers):
            h = layer(h, even if i % 2 == 0 else odd, position_ids=pos)
        return self.head(h).pow(2).mean()


class PlainClassifier(nn.Module):
    """A classifier as timm and torchvision build them: ``forward(x)`` returns logits and takes no
    labels (the training loop computes the loss)."""

    def __init__(self, d: int = 32, n_layers: int = 4, classes: int = 10):
        super().__init__()
        self.stem = nn.Linear(d, d)
        self.blocks = nn.Sequential(*(nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
                                      for _ in range(n_layers)))
        self.head = nn.Linear(d, classes)

    def forward(self, x):
        return self.head(self.blocks(self.stem(x)))


class PlainTokenModel(nn.Module):
    """A token model whose ``forward(ids)`` returns (B, T, V) logits and takes no labels."""

    def __init__(self, vocab: int = 64, d: int = 32, n_layers: int = 3):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(d, 2 * d), nn.Tanh(), nn.Linear(2 * d, d))
                                    for _ in range(n_layers))
        self.out = nn.Linear(d, vocab)

    def forward(self, ids):
        h = self.emb(ids)
        for layer in self.layers:
            h = h + layer(h)
        return self.out(h)
