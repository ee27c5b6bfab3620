"""What a layer's backward holds before it first needs a saved tensor, and dead branches.

A checkpoint recomputes when the backward first unpacks one of its saved tensors. The backward
of the last layer's final ops that saved nothing runs before that: a residual add passes its
gradient on by reference, but a sum over top-k copies (GPT-OSS's experts) expands the gradient,
and the view before it needs it contiguous, a copy twice the hidden state, which stays live
through the recompute. The profile measures it (``backward_lead_bytes``) and the simulator holds
it beside the recompute of a checkpoint ending at the layer; before, every checkpointed plan of
GPT-OSS measured 65,536 B above its prediction.

The profiler packs saved tensors detached: returned as itself, an op's output that the op saved
held its own autograd node (a cycle only the garbage collector frees), so a branch the loss does
not use (BigBird's pooler under a masked-LM head) stayed alive in the profiled step and was
billed as held for backward (512 B there).

Oracles: the analytic size of the copy, the live-tensor tracker over every plan of a small chain
(prediction equal to the byte; without the lead some plans are predicted below the
measurement, so the oracle reaches the case), the plain step's own held bytes, and brute force
for the DP, which is on the safe side with leads (never over budget, never below the optimum).
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn as nn
from brute_plans import all_plans
from early_nets import B, D, K, Net, _measured

from ckplan import api
from ckplan.execute import apply_plan
from ckplan.measure import LiveTensorTracker
from ckplan.planner import Plan, chain_from_profile, plan_chain, simulate, trace
from ckplan.planner.simulate import peak_of
from ckplan.planner.synthetic import random_chain
from ckplan.spec import to_loss


class TopK(nn.Module):
    """Ends with a sum over two copies (a top-2 mixture's combine): in backward the sum expands
    the gradient and the view before it copies it, before tanh's saved output is first needed.
    A router-like statistic (a large temporary, nothing saved) makes the forward, and so the
    recompute, the place where plans peak."""

    def __init__(self):
        super().__init__()
        self.up = nn.Linear(D, 2 * D)
        self.register_buffer("w", torch.randn(D, K))
        self.stat = 0.0

    def forward(self, x):
        with torch.no_grad():
            self.stat = float((x.unsqueeze(-1) * self.w).abs().amax())
        h = torch.tanh(self.up(x))
        return x + h.view(x.shape[0], 2, D).sum(1)


@pytest.fixture(scope="module")
def profiled():
    torch.manual_seed(0)
    model = Net(block=TopK)
    x = torch.randn(B, D)
    prof = api.profile_model(model, (x,), {}, name="lead", chain="layers", device="cpu",
                             optimizer="sgd", repeats=1, warmup=0)
    return model, x, prof


def test_profile_measures_the_gradient_copy(profiled):
    _, _, prof = profiled
    for r in prof.chain_layers:
        assert r.backward_lead_bytes == B * 2 * D * 4  # the contiguous (B, 2, D) gradient
    assert prof.pre.backward_lead_bytes is None and prof.post.backward_lead_bytes is None


def test_every_plan_is_predicted_to_the_byte(profiled):
    model, x, prof = profiled
    chain = chain_from_profile(prof)
    no_lead = replace(chain, layers=tuple(replace(ly, lead_bytes=0) for ly in chain.layers))
    under = 0
    for items in all_plans(chain.n_layers):
        plan = Plan("test", chain.n_layers, items)
        predicted = simulate(chain, plan).peak_bytes - chain.persistent_bytes
        assert _measured(model, x, plan) == predicted, plan.describe()
        under += simulate(no_lead, plan).peak_bytes - chain.persistent_bytes < predicted
    assert under >= 3  # without the lead these are predicted below their measurement


def test_old_profiles_have_no_lead(profiled):
    _, _, prof = profiled
    d = prof.to_dict()
    for row in d["layers"]:
        row.pop("backward_lead_bytes")
    assert api.profile_problem(d) is None
    old = chain_from_profile(type(prof).from_dict(d))
    assert all(ly.lead_bytes == 0 for ly in old.layers)
    d["layers"][1]["backward_lead_bytes"] = -1
    assert "backward_lead_bytes" in api.profile_problem(d)


@pytest.mark.parametrize("seed", range(6))
def test_dp_with_leads_fits_and_is_never_below_the_optimum(seed):
    base = random_chain(5, seed, max_size=1000)
    rng = torch.Generator().manual_seed(seed)
    leads = torch.randint(0, 400, (5,), generator=rng).tolist()
    chain = replace(base, layers=tuple(replace(ly, lead_bytes=int(v)) for ly, v in zip(base.layers, leads)))
    scores = [peak_of(chain, items) for items in all_plans(chain.n_layers)]
    lowest = min(p for p, _ in scores)
    for b in sorted({p for p, _ in scores}):
        try:
            res = plan_chain(chain, "dp", b)
        except Exception as e:  # the tables' smallest peak counts the lead throughout
            assert type(e).__name__ == "InfeasibleBudgetError" and b < lowest + sum(leads)
            continue
        assert res.score.peak_bytes <= b
        best = min(r for p, r in scores if p <= b)
        assert res.score.recompute_ms >= best - 1e-9


class Pooled(nn.Module):
    """A masked-LM-like model that also returns a pooled summary the loss never reads: its tanh
    saves its own output."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(D, D) for _ in range(2))
        self.pool = nn.Linear(D, D)

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return {"loss": x.pow(2).mean(), "pooled": torch.tanh(self.pool(x))}


def test_a_branch_the_loss_does_not_use_is_not_held():
    torch.manual_seed(0)
    model = Pooled()
    x = torch.randn(B, D)
    prof = api.profile_model(model, (x,), {}, name="pooled", chain="layers", device="cpu",
                             optimizer="sgd", repeats=1, warmup=0)
    with LiveTensorTracker() as tr:
        out = model(x)
        loss = to_loss(out)
        del out
        held = tr.live
    del loss
    # two ReLU outputs (B x D floats); the loss is not an activation; the pooled tanh output
    # (B x D floats more) is freed with the output object
    assert prof.totals.activation_bytes == held - 4 == 2 * B * D * 4


class Branches(nn.Module):
    """Three tanh branches summed at the end: while the third is computed the first two are held
    by the layer's own locals, saved for backward or not (rotor's model of a forward that saves
    nothing counts only the output and the plain forward's transient above what it saved)."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = (nn.Linear(D, 4 * D) for _ in range(3))
        self.out = nn.Linear(4 * D, D)

    def forward(self, x):
        h1, h2, h3 = torch.tanh(self.a(x)), torch.tanh(self.b(x)), torch.tanh(self.c(x))
        return x + self.out(h1 + h2 + h3)


def test_a_forward_that_saves_nothing_is_measured():
    torch.manual_seed(0)
    model = Net(block=Branches)
    x = torch.randn(B, D)
    prof = api.profile_model(model, (x,), {}, name="branches", chain="layers", device="cpu",
                             optimizer="sgd", repeats=1, warmup=0)
    w = B * 4 * D * 4  # one branch's (B, 4D) floats
    for r in prof.chain_layers:
        # h1, h2, the third Linear's output and its tanh, then h1 + h2 beside them (freed after
        # the sum, which the output projection reads): at least four branch tensors at once
        assert r.nosave_peak_bytes >= 4 * w
    chain = chain_from_profile(prof)
    rotor = replace(chain, layers=tuple(replace(ly, nosave_peak_bytes=None) for ly in chain.layers))
    for k in (1, 2, 3):
        plan = plan_chain(chain, "every-k", None, k).plan
        model.zero_grad(set_to_none=True)
        with apply_plan(model, plan), LiveTensorTracker() as tr:
            loss = model(x)
            forward_peak = tr.peak  # the first forwards, nothing saved inside the checkpoints
            loss.backward()
        events = [e for e in trace(chain, plan)]
        upto = next(i for i, e in enumerate(events) if e.label.startswith("post forward"))
        predicted = max(e.peak_bytes for e in events[:upto]) - chain.persistent_bytes
        assert forward_peak == predicted, plan.describe()
        old = max(e.peak_bytes for e in trace(rotor, plan)[:upto]) - chain.persistent_bytes
        assert old < forward_peak  # rotor's estimate is short here: the oracle reaches the case


class _CtxKeep(torch.autograd.Function):
    """tanh whose backward reads its output from a ctx attribute, not save_for_backward (as some
    custom kernels' wrappers do): invisible to saved-tensor hooks, so no checkpoint drops it."""

    @staticmethod
    def forward(ctx, x):
        y = torch.tanh(x)
        ctx.y = y.detach()
        return y

    @staticmethod
    def backward(ctx, g):
        return g * (1 - ctx.y * ctx.y)


class CtxLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x):
        return _CtxKeep.apply(self.lin(x)) + x


def test_tensors_no_op_saved_are_named_and_measured():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D, D), nn.Sequential(CtxLayer(), CtxLayer()))
    x = torch.randn(B, D)

    def loss_fn(out):
        return out.pow(2).mean()

    prof = api.profile_model(model, (x,), {}, name="ctx", chain="1", device="cpu", optimizer="sgd",
                             repeats=1, warmup=0, loss_fn=loss_fn)
    note = next(n for n in prof.notes if "tensors a checkpoint cannot drop" in n)
    assert "layer 0 (2 KiB)" in note and "layer 1 (2 KiB)" in note  # B x D floats = 2048 B
    assert [r.unsaved_kept_bytes for r in prof.chain_layers] == [B * D * 4] * 2
