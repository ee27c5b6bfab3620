"""The simulator against peaks computed by hand (see the numbers in each test)."""
from __future__ import annotations

import pytest

from ckplan.errors import SpecError
from ckplan.planner import Plan, plan_every_k, plan_none, simulate, trace
from ckplan.planner.chain import Chain, Layer, Post, Pre
from ckplan.planner.plan import Checkpoint, Store
from ckplan.planner.synthetic import random_chain, uniform_chain


def small_chain(opt_peak: int = 20) -> Chain:
    #            name  fwd  bwd  x  xbar ftmp btmp grad
    layers = (Layer("a", 1.0, 2.0, 2, 5, 1, 1, 1),
              Layer("b", 2.0, 3.0, 3, 4, 0, 2, 1),
              Layer("c", 4.0, 5.0, 1, 2, 2, 0, 1))
    return Chain(layers, Pre(4, fwd_tmp_bytes=1, bwd_tmp_bytes=1, grad_bytes=2, fwd_ms=0.5, bwd_ms=0.5),
                 Post(2, fwd_tmp_bytes=1, bwd_tmp_bytes=3, grad_bytes=0, fwd_ms=0.25, bwd_ms=0.25),
                 x_in_bytes=3, delta_in_bytes=0, persistent_bytes=10, opt_step_peak_bytes=opt_peak)


def test_none_plan_by_hand():
    ch = small_chain()
    # mem=10; pre F 14 (+1); F0 19 (+1); F1 23; F2 25 (+2 -> 27); post F 27 (+1 -> 28);
    # post B 27 (+3 -> 30) then 27 + x2 - 2 = 26; B2 26 -> 27; B1 27 (+2 -> 29) -> 23;
    # B0 23 (+1) -> 17; pre B 17 (+1) -> 15; optimizer 20.
    ev = trace(ch, plan_none(3))
    assert [e.mem_bytes for e in ev] == [14, 19, 23, 25, 27, 26, 27, 23, 17, 15, 15]
    assert [e.peak_bytes for e in ev] == [15, 20, 23, 27, 28, 30, 27, 29, 24, 18, 20]
    sc = simulate(ch, plan_none(3))
    assert sc.peak_bytes == 30 and sc.peak_at == "post backward"
    assert sc.recompute_ms == 0 and sc.overhead == 0
    assert sc.step_ms == pytest.approx(1 + 2 + 2 + 3 + 4 + 5 + 0.5 + 0.5 + 0.25 + 0.25)


def test_checkpoint_by_hand():
    ch = small_chain()
    plan = Plan("custom", 3, (Checkpoint(0, 2, (Store(0), Store(1))), Store(2)))
    # pre F 14; Fn0 16 (+1 -> 17); Fn1 19 then drop x0 -> 17; F2 19 (+2 -> 21); post F 21 (+1);
    # post B 21 (+3 -> 24) -> 20; B2 20 -> 21; drop x1 -> 18; recompute F0 23 (+1 -> 24);
    # F1 27; B1 27 (+2 -> 29) -> 23; B0 23 (+1 -> 24) -> 17; pre B -> 15; optimizer 20.
    ev = trace(ch, plan)
    assert [e.mem_bytes for e in ev] == [14, 16, 17, 19, 21, 20, 21, 18, 23, 27, 23, 17, 15, 15]
    assert max(e.peak_bytes for e in ev) == 29
    sc = simulate(ch, plan)
    assert sc.peak_bytes == 29
    assert sc.peak_at == "B(layer 1) during recompute of [0,2)"
    assert sc.recompute_ms == 3.0
    assert sc.overhead == pytest.approx(3.0 / ch.base_step_ms)
    assert [e.recompute for e in ev].count(True) == 2


def test_nested_checkpoint_by_hand():
    ch = small_chain(opt_peak=0)
    plan = Plan("custom", 3, (Checkpoint(0, 3, (Checkpoint(0, 2, (Store(0), Store(1))), Store(2))),))
    # pre F 14; Fn0 16; Fn1 19 -> 17; Fn2 18 (+2 -> 20) -> 15; post F 17 (+1 -> 18);
    # post B 17 (+3 -> 20) -> 16; drop x2 -> 15; recompute Fn0 17 (+1 -> 18); Fn1 20 -> 18;
    # F2 20 (+2 -> 22); B2 20 -> 21; drop x1 -> 18; recompute F0 23 (+1 -> 24); F1 27;
    # B1 27 (+2 -> 29) -> 23; B0 -> 17; pre B -> 15.
    ev = trace(ch, plan)
    assert [e.mem_bytes for e in ev] == [14, 16, 17, 15, 17, 16, 15, 17, 18, 20, 21, 18, 23, 27,
                                         23, 17, 15, 15]
    sc = simulate(ch, plan)
    assert sc.peak_bytes == 29
    assert sc.recompute_ms == (1 + 2 + 4) + (1 + 2)  # layers 0, 1 run three times, layer 2 twice
    assert [d.forwards for d in plan.per_layer()] == [3, 3, 2]


def test_peak_includes_memory_after_a_backward():
    """A backward whose gradients outweigh what it frees peaks after it, transient or not."""
    layers = (Layer("a", 1, 1, 1, 1, 0, 0, 50),)
    ch = Chain(layers, Pre(1), Post(0), 1, 0, persistent_bytes=0, opt_step_peak_bytes=0)
    # pre F 1; F0 2; post F 2; post B 2 -> 3 (gradient of x0); B0: 3 -> 3 + 0 + 50 - 1 - 1 = 51
    assert simulate(ch, plan_none(1)).peak_bytes == 51


def test_optimizer_step_can_be_the_peak():
    ch = small_chain(opt_peak=100)
    sc = simulate(ch, plan_none(3))
    assert sc.peak_bytes == 100 and sc.peak_at == "optimizer step"


def test_memory_returns_to_persistent_plus_gradients():
    for seed in range(20):
        ch = random_chain(7, seed)
        grads = sum(ly.grad_bytes for ly in ch.layers) + ch.post.grad_bytes + ch.pre.grad_bytes
        for plan in (plan_none(7), plan_every_k(7, 3), plan_every_k(7, 1)):
            ev = trace(ch, plan)
            assert ev[-1].mem_bytes == ch.persistent_bytes + grads
            assert simulate(ch, plan).peak_bytes == max(e.peak_bytes for e in ev)


def test_article_four_layer_example():
    """Store h0, checkpoint layers 1-2 (h1 is not kept): less memory for two more forwards."""
    ch = uniform_chain(4, x_bytes=1, fwd_ms=1.0, bwd_ms=2.0)
    plan = Plan("custom", 4, (Store(0), Checkpoint(1, 3, (Store(1), Store(2))), Store(3)))
    sc = simulate(ch, plan)
    assert sc.recompute_ms == 2.0  # h1 and h2 once more
    assert sc.peak_bytes < simulate(ch, plan_none(4)).peak_bytes


def test_plan_for_another_chain_is_rejected():
    with pytest.raises(SpecError, match="plan is for 4 layers but the chain has 3"):
        simulate(small_chain(), plan_none(4))


def test_recent_scores_are_remembered_by_identity_only():
    """``simulate`` remembers the last few (chain, plan) objects it scored: the same objects give
    the same score, another chain with the same plan its own, and the memory stays bounded."""
    import importlib
    from dataclasses import replace

    from ckplan.planner.baselines import plan_every_k
    from ckplan.planner.synthetic import random_chain
    S = importlib.import_module("ckplan.planner.simulate")  # the module: the package re-exports the function
    a = random_chain(12, 1, max_size=1000)
    b = replace(a, layers=tuple(replace(ly, xbar_bytes=ly.xbar_bytes * 3) for ly in a.layers))
    p = plan_every_k(12, 3)
    first = S.simulate(a, p)
    assert S.simulate(a, p) is first
    other = S.simulate(b, p)
    assert other.peak_bytes > first.peak_bytes  # not a's score
    assert S.simulate(a, replace(p)) == first  # an equal plan object: scored again, same score
    for k in range(1, 40):
        S.simulate(a, plan_every_k(12, 1 + k % 12))
    assert len(S._RECENT) <= S.RECENT_SCORES
