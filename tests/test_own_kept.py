"""A chain layer's output that only the layer's own ops save (HF ResNet's last stage).

A block ending with a ReLU keeps its output for backward (the ReLU saves it); when what reads it
next saves nothing (a scale by a constant, a sum pooling), a checkpoint ending at the block saves
nothing inside, and PyTorch frees the boundary as soon as the next stage has run. Before, the
prediction held it until the checkpoint's backward: peaks and held-for-backward bytes above what
was measured (HF ResNet's checkpointed plans held 4096 B less for backward than predicted).

Oracles: the live-tensor tracker on real PyTorch steps, for every plan of a small chain (peaks
and the bytes held when the forward ends); the plan without checkpoints for gradients; the
flag itself against what the model's ops are known to save.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from brute_plans import all_plans
from unkept_nets import InPlaceNet, SeqNet, _grads, _measured_peak, _nested, _profiled

from ckplan.execute import apply_plan
from ckplan.measure import LiveTensorTracker
from ckplan.planner import Plan, chain_from_profile, min_peak, plan_chain, simulate
from ckplan.planner.baselines import plan_none
from ckplan.planner.budget import held_for_backward_bytes

B, D = 64, 32


class Block(nn.Module):
    """x * 0.5 (saves nothing), Linear (saves the scaled copy), ReLU (saves its own output)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x):
        return torch.relu(self.lin(x * 0.5))


class OwnNet(nn.Module):
    """Every block's output is saved by its own ReLU only: the next block's scale and the
    head's ``exp(3 h)`` read it without saving it. The head's saved ``exp`` makes its backward
    the peak, where a boundary held too long shows."""

    def __init__(self, n: int = 4):
        super().__init__()
        self.stem = nn.Sequential(nn.Linear(D, D), nn.ReLU())
        self.layers = nn.ModuleList(Block() for _ in range(n))
        self.head = nn.Linear(D, 3)

    def forward(self, x):
        h = self.stem(x)
        for layer in self.layers:
            h = layer(h)
        return _exp_head(self.head, h)


def _exp_head(head: nn.Module, h: torch.Tensor) -> torch.Tensor:
    """``exp(3 h)`` (saves its output, not ``h``), then a Linear and the loss."""
    return head((h * 3.0).exp()).pow(2).mean()


class InPlaceOwnNet(InPlaceNet):
    """``tests/test_unkept.py``'s torchvision-style chain (Linear, BatchNorm, ReLU(inplace=True),
    Linear, ReLU(inplace=True), each a chain layer) with ``OwnNet``'s head: the last in-place
    ReLU's output (the second Linear's storage) is saved by that ReLU only."""

    def forward(self, x):
        return _exp_head(self.head, self.body(self.stem(x)))


def _held(model, x, plan) -> int:
    """Live bytes when the forward (loss included) ends, above those before the step."""
    model.zero_grad(set_to_none=True)
    with apply_plan(model, plan), LiveTensorTracker() as tr:
        loss = model(x)
        held = tr.live
        loss.backward()
    return held


@pytest.fixture(scope="module")
def own():
    torch.manual_seed(0)
    model = OwnNet(4)
    x, prof = _profiled(model, "layers")
    return model, x, prof, chain_from_profile(prof)


@pytest.fixture(scope="module")
def in_place():
    torch.manual_seed(0)
    model = InPlaceOwnNet()
    x, prof = _profiled(model, "body")
    return model, x, prof, chain_from_profile(prof)


def test_profile_flags_outputs_only_their_own_ops_save(own):
    _, _, prof, chain = own
    assert [r.output_kept for r in prof.chain_layers] == [True] * 4
    assert [r.output_saved_after for r in prof.chain_layers] == [False] * 4
    assert not chain.all_kept and [ly.x_kept_next for ly in chain.layers] == [False] * 4
    # Linear, ReLU, Linear, ReLU as chain layers, then a Linear head: each ReLU's output is
    # saved by the ReLU and by the Linear after it; a Linear's output by neither (not kept)
    torch.manual_seed(0)
    _, prof2 = _profiled(SeqNet(("relu", "relu")), "body")
    flags = [(r.output_kept, r.output_saved_after) for r in prof2.chain_layers]
    assert flags == [(False, None), (True, True), (False, None), (True, True)]


def test_an_in_place_output_only_its_layer_saves_is_flagged(in_place):
    _, _, prof, chain = in_place
    assert [r.output_in_place for r in prof.chain_layers] == [False, False, True, False, True]
    # Linear's output: BatchNorm saves it; BatchNorm's and the second Linear's: the in-place
    # ReLU after them saves the storage it returns; the first ReLU's: the Linear after it; the
    # last ReLU's: nothing after it
    assert [r.output_saved_after for r in prof.chain_layers] == [True, True, True, True, False]
    assert [ly.x_kept_next for ly in chain.layers] == [True, True, True, True, False]
    assert chain.conservative().all_kept


@pytest.mark.parametrize("which", ["own", "in_place"])
def test_every_plan_peaks_and_holds_as_measured(which, request):
    model, x, _, chain = request.getfixturevalue(which)
    p = chain.persistent_bytes
    n = chain.n_layers
    boundary = B * D * 4
    exact_nested = released = 0
    ref = _grads(model, x)
    for items in all_plans(n):
        plan = Plan("custom", n, items)
        measured = _measured_peak(model, x, plan)
        predicted = simulate(chain, plan).peak_bytes - p
        if _nested(items):  # README known limits: a bias gradient over; in place, a boundary
            assert measured <= predicted <= measured + (D * 4 if which == "own" else boundary), plan.describe()
            exact_nested += predicted == measured
            continue
        assert predicted == measured, plan.describe()
        assert held_for_backward_bytes(chain, plan) == _held(model, x, plan), plan.describe()
        if which == "in_place":  # BatchNorm's running statistics move: same batch, same grads
            got = _grads(model, x, plan)
            assert all(torch.allclose(a, b, rtol=0, atol=1e-6) for a, b in zip(ref, got)), plan.describe()
        released += held_for_backward_bytes(chain.conservative(), plan) != held_for_backward_bytes(chain, plan)
    assert released > 0  # the oracle can fail: the model keeping every boundary misses these
    assert exact_nested > 0


def test_dp_fits_as_measured_and_keeps_gradients(own):
    model, x, _, chain = own
    ref = _grads(model, x)
    lo = min_peak(chain)
    hi = simulate(chain, plan_none(chain.n_layers)).peak_bytes
    for budget in sorted({lo, lo + (hi - lo) // 3, lo + 2 * (hi - lo) // 3}):
        plan = plan_chain(chain, "dp", budget).plan
        assert _measured_peak(model, x, plan) + chain.persistent_bytes <= budget, plan.describe()
        got = _grads(model, x, plan)
        assert all(torch.equal(a, b) for a, b in zip(ref, got)), plan.describe()


def test_simulator_frees_such_a_boundary_after_the_next_forward():
    # layer 2's output is saved by its own ops only: after the checkpoint [1, 3) it is freed once
    # Store(3)'s forward (measured with it live) has run; a checkpoint ending at the last layer
    # frees its boundary after post's forward; a checkpoint after it keeps it as its input
    from dataclasses import replace

    from ckplan.planner import trace
    from ckplan.planner.plan import items_from_ranges
    from ckplan.planner.synthetic import random_chain
    ch = random_chain(5, 3, max_size=100_000)
    ch = replace(ch, layers=tuple(replace(ly, x_kept_next=i not in (2, 4)) for i, ly in enumerate(ch.layers)))
    x = [ly.x_bytes for ly in ch.layers]
    labels = lambda ev: [e.label for e in ev]
    ev = trace(ch, Plan("c", 5, items_from_ranges(5, [(1, 3), (3, 5)])))
    lab = labels(ev)
    j = lab.index("boundary x[4] of [3,5) freed (nothing after it saves it)")
    assert lab[j - 1] == "post forward (loss)" and ev[j].mem_bytes == ev[j - 1].mem_bytes - x[4]
    assert not any("x[2] of [1,3) freed" in s for s in lab)  # [3, 5) keeps it as its input
    ev = trace(ch, Plan("c", 5, items_from_ranges(5, [(1, 3)])))
    lab = labels(ev)
    j = lab.index("boundary x[2] of [1,3) freed (nothing after it saves it)")
    assert lab[j - 1] == "F(layer 3)" and ev[j].mem_bytes == ev[j - 1].mem_bytes - x[2]
    # and its backward does not free it a second time
    assert "free boundary x[2] of [1,3)" not in lab
    with_kept = replace(ch, layers=tuple(replace(ly, x_kept_next=True) for ly in ch.layers))
    assert (simulate(ch, Plan("c", 5, items_from_ranges(5, [(1, 3)]))).peak_bytes
            <= simulate(with_kept, Plan("c", 5, items_from_ranges(5, [(1, 3)]))).peak_bytes)


@pytest.mark.parametrize("n", [60, 150])
def test_long_chains_with_such_outputs_never_go_over_budget(n):
    # the DP plans on the bound that keeps them (exact tables up to 120 layers, grouped above),
    # then checks its candidates on the chain as it is: every plan fits, min_peak is reached
    from dataclasses import replace

    from brute_plans import check_long_chain_fits

    from ckplan.planner.synthetic import random_chain
    ch = random_chain(n, n, max_size=1_000_003)
    ch = replace(ch, layers=tuple(replace(ly, x_kept_next=(i % 7 != 3 and i != n - 1))
                                  for i, ly in enumerate(ch.layers)))
    assert not ch.all_kept and ch.conservative().all_kept
    check_long_chain_fits(ch)
