"""On meta, a layer alone in a checkpoint is priced as PyTorch runs it (profiling/rows.py): the
recompute stops at the op that saves the layer's last tensor (an op saving its inputs packs them
before it runs), and the checkpoint's hooks cost the host three calls per saved tensor. View ops
cost the host their own dispatch; a selective option pays its policy on every op of its forward and
on every op its recompute replays (profiling/option_passes.py).

Oracles: a device model whose every op costs its dispatch (the host is the bottleneck), so a
window's time is its op count, counted by hand; the saved tensors counted by our own
saved-tensor hooks on a CPU run of the same layer."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from ckplan import api
from ckplan.device_model import DeviceModel, save_device
from ckplan.planner import chain_from_profile

DISPATCH = 1.0  # ms per op: far above any roofline time of these tiny ops


class Block(nn.Module):
    """mm, relu, mm: the last mm saves its input (the relu's output) before it runs, so a
    recompute ends after the relu: two of the three ops."""

    def __init__(self, d: int):
        super().__init__()
        self.a = nn.Linear(d, d, bias=False)
        self.b = nn.Linear(d, d, bias=False)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


class Net(nn.Module):
    def __init__(self, d: int = 16, n: int = 3):
        super().__init__()
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def _device(tmp_path, hook_ms: float, view_ms: float = 0.0, sac_ms: float = 0.0) -> str:
    dev = DeviceModel(name="host-bound", kind="cpu", matmul_flops={"float32": 1e15}, vector_flops={"float32": 1e15},
                      memory_bw=1e15, dispatch_ms=DISPATCH, ckpt_hook_ms=hook_ms, view_ms=view_ms,
                      sac_dispatch_ms=sac_ms, source="test")
    path = tmp_path / f"dev-{hook_ms}-{view_ms}-{sac_ms}.json"
    save_device(dev, path)
    return str(path)


def _profile(tmp_path, hook_ms: float, view_ms: float = 0.0, sac_ms: float = 0.0, options: bool = False):
    x = torch.randn(4, 16, requires_grad=True)
    return api.profile_model(Net(), (x,), {}, name="net", chain="blocks", device="meta", optimizer="sgd",
                             meta_target=_device(tmp_path, hook_ms, view_ms, sac_ms), options=options)


def _packs_per_block() -> int:
    """Saved tensors of one block, counted by our own hooks on a CPU run."""
    n = [0]

    def pack(t):
        n[0] += 1
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        Block(16)(torch.randn(4, 16, requires_grad=True))
    return n[0]


def test_recompute_stops_before_the_op_that_saves_the_last_tensor(tmp_path):
    prof = _profile(tmp_path, 0.0)
    for r in prof.chain_layers:
        assert r.fwd_ms == pytest.approx(3 * DISPATCH)  # mm, relu, mm (the weights' t() are views)
        assert r.recompute_ms == pytest.approx(2 * DISPATCH)  # mm, relu: the last mm never runs
    chain = chain_from_profile(prof)
    for ly in chain.layers:  # a checkpoint ending at the layer skips the last mm
        assert ly.tail_ms == pytest.approx(DISPATCH, rel=1e-9)


def test_checkpoint_hooks_cost_three_calls_per_saved_tensor(tmp_path):
    hook = 0.25
    packs = _packs_per_block()
    assert packs >= 3  # the oracle counts something
    plain, hooked = _profile(tmp_path, 0.0), _profile(tmp_path, hook)
    for a, b in zip(plain.chain_layers, hooked.chain_layers):
        assert b.fwd_ms == pytest.approx(a.fwd_ms)  # the first forward of a stored layer: no hooks
        assert b.recompute_ms - a.recompute_ms == pytest.approx(3 * packs * hook)


def test_views_cost_the_host_their_own_dispatch(tmp_path):
    view = 0.125
    prof = _profile(tmp_path, 0.0, view_ms=view)
    for r in prof.chain_layers:
        # by hand: t(a.weight), mm, relu, t(b.weight), mm: three kernels, two views
        assert r.fwd_ms == pytest.approx(3 * DISPATCH + 2 * view)
        # the recompute: t, mm, relu, t; the last mm, which saves its inputs, never runs
        assert r.recompute_ms == pytest.approx(2 * DISPATCH + 2 * view)


def test_a_selective_option_pays_its_policy_on_every_op_it_runs_or_replays(tmp_path):
    view, sac = 0.125, 10.0

    def price(sac_ms: float) -> list[float]:
        prof = _profile(tmp_path, 0.0, view_ms=view, sac_ms=sac_ms, options=True)
        # from the second block on (the first one's input is the step's: some torch versions'
        # backward treats it apart)
        return [{o.name: o for o in r.options}["sac-compute"].recompute_ms for r in prof.chain_layers[1:]]

    free, paid = price(0.0), price(sac)
    for a, b in zip(free, paid):
        # without the policy's own cost: the recompute runs the relu and the two t() again, the
        # matmuls come from the policy's cache; some torch versions' checkpoints also allocate
        # (``empty``) in the forward, a dispatch each
        extra = round((a - DISPATCH - 2 * view) / DISPATCH)
        assert extra >= 0 and a == pytest.approx(DISPATCH + 2 * view + extra * DISPATCH)
        # with it: every op of the forward (t, mm, relu, t, mm and those allocations) runs under
        # the policy, and the recompute replays every one of them through it
        assert b - a == pytest.approx(2 * (5 + extra) * sac)
