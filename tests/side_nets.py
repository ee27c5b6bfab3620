"""Small models and measurements shared by the side-input tests and the tests built on them."""
from __future__ import annotations

import torch

from ckplan import api
from ckplan.execute import apply_plan
from ckplan.measure import LiveTensorTracker

B, D, N = 64, 32, 6


def profiled(make, name: str):
    """``make(D, N)`` seeded, a (B, D) batch, and their CPU profile (SGD, one pass)."""
    torch.manual_seed(0)
    model = make(D, N)
    x = torch.randn(B, D)
    prof = api.profile_model(model, (x,), {}, name=name, chain=None, device="cpu", optimizer="sgd",
                             repeats=1, warmup=0)
    return model, x, prof


def cpu_and_meta(model: torch.nn.Module, name: str):
    """``model``'s profiles on a (B, D) batch, on the CPU and on fake tensors (SGD, one pass)."""
    torch.manual_seed(0)
    x = torch.randn(B, D)
    kw = dict(name=name, chain=None, optimizer="sgd", repeats=1, warmup=0)
    return (api.profile_model(model, (x,), {}, device="cpu", **kw),
            api.profile_model(model, (x,), {}, device="meta", **kw))


def measured_peak(model, x, plan) -> int:
    """Peak live bytes of one forward+backward above the step start (tracker), with ``plan``."""
    model.zero_grad(set_to_none=True)
    with apply_plan(model, plan), LiveTensorTracker() as tr:
        model(x).backward()
    return tr.peak


class CountedLayers(torch.nn.Module):
    """Five equal blocks called by index up to a count fixed at build time (as models that loop
    over ``range(config.num_hidden_layers)`` do): the model cannot run with its chain cut."""

    def __init__(self, width: int = 32, depth: int = 5):
        super().__init__()
        self.depth = depth
        self.layers = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.GELU())
                                          for _ in range(depth))

    def forward(self, x):
        for i in range(self.depth):
            x = self.layers[i](x)
        return x


class RotaryBlock(torch.nn.Module):
    """A block that multiplies a side input in (saving it for backward) only when ``uses`` it, as
    the attention layers of a hybrid model do with the rotary ``(cos, sin)`` every layer receives."""

    def __init__(self, d: int, uses: bool):
        super().__init__()
        self.uses = uses
        self.up = torch.nn.Linear(d, 4 * d)
        self.down = torch.nn.Linear(4 * d, d)

    def forward(self, h, pe=None):
        z = self.up(h)
        if self.uses:
            z = z * pe  # saves pe
        return h + self.down(torch.tanh(z))


class RotaryChain(torch.nn.Module):
    """A (B, 4d) tensor without grad made before the chain (``maker=-1``) or returned by layer
    ``maker`` beside its output, passed to every later layer; only layers in ``uses`` save it."""

    def __init__(self, d: int = D, n_layers: int = N, uses: tuple[int, ...] = (3, 5), maker: int = -1):
        super().__init__()
        self.maker = maker
        self.inp = torch.nn.Linear(d, d)
        self.layers = torch.nn.ModuleList(RotaryMaker(d) if i == maker else RotaryBlock(d, i in uses)
                                          for i in range(n_layers))
        self.head = torch.nn.Linear(d, 1)
        self.register_buffer("freq", torch.randn(4 * d))

    def forward(self, x):
        h = self.inp(x)
        pe = torch.cos(self.freq * x.sum(-1, keepdim=True)) if self.maker < 0 else None
        for i, layer in enumerate(self.layers):
            if i == self.maker:
                h, pe = layer(h)
            else:
                h = layer(h, pe=pe) if pe is not None else layer(h)
        return self.head(h).pow(2).mean()


class RotaryMaker(torch.nn.Module):
    """A block that returns a rotary-like tensor beside its output, for the layers after it."""

    def __init__(self, d: int):
        super().__init__()
        self.lin = torch.nn.Linear(d, d)
        self.register_buffer("freq", torch.randn(4 * d))

    def forward(self, h):
        out = h + torch.tanh(self.lin(h))
        with torch.no_grad():
            pe = torch.cos(self.freq * h.sum(-1, keepdim=True))
        return out, pe


class ConcatBlock(torch.nn.Module):
    """A block that concatenates a side input to its hidden state when it ``uses`` it (Zamba2's
    hybrid layers take the embeddings' copy so), with a forward-only transient that makes the
    recompute's forward the peak of a checkpoint's backward."""

    def __init__(self, d: int, uses: bool):
        super().__init__()
        self.uses = uses
        self.up = torch.nn.Linear(2 * d if uses else d, 4 * d)
        self.down = torch.nn.Linear(4 * d, d)

    def forward(self, h, orig=None):
        z = torch.cat([h, orig], -1) if self.uses else h
        with torch.no_grad():
            k = (h.detach().unsqueeze(-1) * torch.ones(256)).sum(-1).mean()
        return h + self.down(torch.tanh(self.up(z))) * k


class ConcatChain(torch.nn.Module):
    """A copy of the chain input, which requires grad, given to every layer; layers ``uses``
    concatenate it (its gradient from each is a slice of the concatenation's)."""

    def __init__(self, d: int = D, n_layers: int = 4, uses: tuple[int, ...] = (1, 3)):
        super().__init__()
        self.inp = torch.nn.Linear(d, d)
        self.layers = torch.nn.ModuleList(ConcatBlock(d, i in uses) for i in range(n_layers))
        self.head = torch.nn.Linear(d, 1)

    def forward(self, x):
        h = self.inp(x)
        orig = h.clone()
        for layer in self.layers:
            h = layer(h, orig=orig)
        return self.head(h).pow(2).mean()
