"""The per-rank memory model (FSDP2, DDP) against bytes computed by hand, and the DP on chains
with held layers (FSDP2's recompute holds) against brute force over every plan. No torch."""
from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest

from ckplan.errors import InfeasibleBudgetError, UsageError
from ckplan.planner import (
    Plan,
    held,
    min_peak,
    min_peak_plan,
    plan_dp,
    plan_every_k,
    plan_none,
    simulate,
    trace,
)
from ckplan.planner.chain import Chain, Layer, Post, Pre
from ckplan.planner.parallel import per_rank_chain, per_rank_chain_from_profile, world_size_table
from ckplan.planner.synthetic import random_chain, with_casts, with_holds
from ckplan.planner.tables import base_bytes, fixed_peak
from ckplan.records import CHAIN, POST, PRE, Profile, StageRecord, Totals

# Three identical layers: parameters P = 40 bytes each, root R = 20, world size 4.
P, R, W = 40, 20, 4


def chain3() -> Chain:
    #            name fwd  bwd  x  xbar ftmp btmp grad
    layers = tuple(Layer(f"l{i}", 1.0, 2.0, 2, 6, 1, 3, P) for i in range(3))
    # persistent = params 140 + optimizer 280 + batch 4 = 424; opt peak = 424 + grads 140 + tmp 10
    return Chain(layers, Pre(3, fwd_tmp_bytes=1, bwd_tmp_bytes=2, grad_bytes=8),
                 Post(5, fwd_tmp_bytes=2, bwd_tmp_bytes=4, grad_bytes=12),
                 x_in_bytes=2, delta_in_bytes=0, persistent_bytes=424, opt_step_peak_bytes=574,
                 name="toy", param_bytes=3 * P + R, total_grad_bytes=3 * P + R, optimizer_bytes=2 * (3 * P + R))


def test_fsdp_fixed_memory_is_sharded():
    ch = per_rank_chain(chain3(), world_size=W, kind="fsdp", layer_param_bytes=[P] * 3, root_param_bytes=R)
    shards = 3 * (P // W) + R // W  # 30 + 5
    assert ch.param_bytes == shards == 35
    assert ch.optimizer_bytes == 2 * shards  # Adam's two moments, sharded like the parameters
    assert ch.persistent_bytes == 4 + shards + 2 * shards  # batch + params + optimizer = 109
    assert [ly.grad_bytes for ly in ch.layers] == [P // W] * 3  # reduce-scatter outputs
    # optimizer step: persistent + sharded grads + its temporaries scaled by the shard ratio
    assert ch.opt_step_peak_bytes == 109 + 35 + round(10 * 35 / 140)


def test_fsdp_step_counters_are_not_sharded():
    # AdamW's step counters (4 B per parameter tensor, here 4 tensors) live whole on every rank.
    base = chain3()
    ch = per_rank_chain(replace(base, optimizer_bytes=base.optimizer_bytes + 16, optimizer_scalar_bytes=16,
                                persistent_bytes=base.persistent_bytes + 16,
                                opt_step_peak_bytes=base.opt_step_peak_bytes + 16),
                        world_size=W, kind="fsdp", layer_param_bytes=[P] * 3, root_param_bytes=R)
    shards = 3 * (P // W) + R // W
    assert ch.optimizer_bytes == 2 * shards + 16
    assert ch.persistent_bytes == 4 + shards + 2 * shards + 16


def test_fsdp_transients_by_hand():
    ch = per_rank_chain(chain3(), world_size=W, kind="fsdp", layer_param_bytes=[P] * 3, root_param_bytes=R)
    # first forward: unsharded + flat all-gather buffer (2P); a recompute is a held layer's:
    # its unit is live already, the reduce-scatter input it runs beside is added by the simulator
    assert [ly.fwd_tmp_bytes for ly in ch.layers] == [1 + 2 * P] * 3
    assert [ly.held_fwd_tmp_bytes for ly in ch.layers] == [1] * 3
    assert [ly.gather_bytes for ly in ch.layers] == [ly.held_bytes for ly in ch.layers] == [P] * 3
    assert [ly.retained_bytes for ly in ch.layers] == [P] * 3
    # held backward: the reduce-scatter input of the layer after only (its unit is held, and so
    # is the one before unless it is outside the checkpoint: the simulator adds that prefetch)
    assert [ly.held_bwd_tmp_bytes for ly in ch.layers] == [3 + P, 3 + P, 3]
    # backward: unsharded P + prefetch of the layer before + reduce-scatter input of the one after
    assert [ly.bwd_tmp_bytes for ly in ch.layers] == [3 + 2 * P, 3 + 3 * P, 3 + 2 * P]
    # the root stays unsharded from the pre stage to the end of backward
    assert ch.pre.retained_bytes == 3 + R and ch.pre.fwd_tmp_bytes == 1 + R
    assert ch.pre.bwd_tmp_bytes == max(2 + P, 8 + R) and ch.pre.grad_bytes == 0
    assert ch.post.fwd_tmp_bytes == 2 + P and ch.post.bwd_tmp_bytes == 4 + P


def test_fsdp_one_rank_has_no_flat_buffers():
    ch = per_rank_chain(chain3(), world_size=1, kind="fsdp", layer_param_bytes=[P] * 3, root_param_bytes=R)
    # one rank copies the shard into the unsharded parameters: no all-gather buffer, no prefetch
    assert [ly.fwd_tmp_bytes for ly in ch.layers] == [1 + P] * 3
    assert [ly.gather_bytes for ly in ch.layers] == [0] * 3
    assert [ly.bwd_tmp_bytes for ly in ch.layers] == [3 + 2 * P, 3 + 2 * P, 3 + P]
    assert ch.pre.fwd_tmp_bytes == 1 and ch.post.fwd_tmp_bytes == 2
    assert ch.param_bytes == 3 * P + R and [ly.grad_bytes for ly in ch.layers] == [P] * 3


def test_fsdp_none_peak_by_hand():
    ch = per_rank_chain(chain3(), world_size=W, kind="fsdp", layer_param_bytes=[P] * 3, root_param_bytes=R)
    # mem 109; pre F: live 109 + 23 = 132 (+21 -> 153); F0 138 (+81 -> 219); F1 144 (+81 -> 225);
    # F2 150 (+81 -> 231); post F 155 (+42 -> 197); post B 155 (+44 -> 199), then 155 + 2 + 12 - 5
    # = 164; B2 164 (+83 -> 247) -> 164 + 2 + 10 - 6 - 2 = 168; B1 168 (+123 -> 291) -> 172;
    # B0 172 (+83 -> 255) -> 174; pre B 174 (+42 -> 216) -> 174 - 23 = 151, above the optimizer
    # step's 109 + 35 + 2 = 146.
    ev = trace(ch, plan_none(3))
    assert [e.peak_bytes for e in ev] == [153, 219, 225, 231, 197, 199, 247, 291, 255, 216, 151]
    assert ch.opt_step_peak_bytes == 146
    sc = simulate(ch, plan_none(3))
    assert sc.peak_bytes == 291 and sc.peak_at == "B(layer 1)"


def test_fsdp_mixed_precision_policy_by_hand():
    """MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32): the chain is profiled in bf16
    (parameters, gradients and the optimizer state measured on them at half the bytes); a rank
    keeps fp32 shards and state, all-gathers and computes in bf16 (G = P / 2) and reduce-scatters
    in fp32 (P)."""
    G, Q = P // 2, R // 2
    base = chain3()
    bf16 = replace(base, param_bytes=3 * G + Q, total_grad_bytes=3 * G + Q, optimizer_bytes=2 * (3 * G + Q),
                   layers=tuple(replace(ly, grad_bytes=G) for ly in base.layers),
                   persistent_bytes=4 + 3 * (3 * G + Q), opt_step_peak_bytes=4 + 4 * (3 * G + Q) + 5)
    ch = per_rank_chain(bf16, world_size=W, kind="fsdp", layer_param_bytes=[P] * 3, root_param_bytes=R,
                        param_dtype_ratio=0.5)
    shards = 3 * (P // W) + R // W  # fp32 masters: as without the policy
    assert ch.param_bytes == shards == 35 and ch.optimizer_bytes == 2 * shards
    assert ch.persistent_bytes == 4 + 3 * shards
    assert [ly.grad_bytes for ly in ch.layers] == [P // W] * 3  # fp32 reduce-scatter outputs
    assert [ly.fwd_tmp_bytes for ly in ch.layers] == [1 + 2 * G] * 3  # bf16 unsharded + flat buffer
    assert [ly.gather_bytes for ly in ch.layers] == [ly.held_bytes for ly in ch.layers] == [G] * 3
    assert [ly.retained_bytes for ly in ch.layers] == [P] * 3  # the fp32 reduce-scatter input
    assert [ly.bwd_tmp_bytes for ly in ch.layers] == [3 + G + P, 3 + 2 * G + P, 3 + 2 * G]
    assert [ly.held_bwd_tmp_bytes for ly in ch.layers] == [3 + P, 3 + P, 3]
    assert ch.pre.retained_bytes == 3 + Q and ch.pre.fwd_tmp_bytes == 1 + Q
    assert ch.pre.bwd_tmp_bytes == max(2 + P, 8 + R)
    assert ch.post.fwd_tmp_bytes == 2 + G and ch.post.bwd_tmp_bytes == 4 + G
    # the optimizer step on fp32 shards: its temporaries (5 B in bf16) doubled and sharded
    assert ch.opt_step_peak_bytes == ch.persistent_bytes + shards + round(5 * 2 * shards / (2 * (3 * G + Q)))
    # and the same chain from a profile: the rows' bf16 parameter bytes are the masters' halves
    one = per_rank_chain(bf16, world_size=1, kind="fsdp", layer_param_bytes=[P] * 3, root_param_bytes=R,
                         param_dtype_ratio=0.5)
    assert one.param_bytes == 3 * P + R and one.optimizer_bytes == 2 * (3 * P + R)


def test_fsdp_policy_reducing_in_the_param_dtype_by_hand():
    """MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16): as the fp32-reduce policy
    above but for the reduce-scatter inputs, now bf16 (P / 2 per unit, R / 2 for the root); the
    sharded gradients (the reduce output cast to fp32) and everything else unchanged."""
    G, Q = P // 2, R // 2
    base = chain3()
    bf16 = replace(base, param_bytes=3 * G + Q, total_grad_bytes=3 * G + Q, optimizer_bytes=2 * (3 * G + Q),
                   layers=tuple(replace(ly, grad_bytes=G) for ly in base.layers),
                   persistent_bytes=4 + 3 * (3 * G + Q), opt_step_peak_bytes=4 + 4 * (3 * G + Q) + 5)
    kw = dict(world_size=W, kind="fsdp", layer_param_bytes=[P] * 3, root_param_bytes=R, param_dtype_ratio=0.5)
    fp32 = per_rank_chain(bf16, **kw)
    ch = per_rank_chain(bf16, **kw, reduce_dtype_ratio=0.5)
    assert [ly.retained_bytes for ly in ch.layers] == [G] * 3  # the bf16 reduce-scatter input
    assert [ly.bwd_tmp_bytes for ly in ch.layers] == [3 + G + G, 3 + 2 * G + G, 3 + 2 * G]
    assert [ly.held_bwd_tmp_bytes for ly in ch.layers] == [3 + G, 3 + G, 3]
    assert ch.pre.bwd_tmp_bytes == max(2 + G, 8 + Q)
    assert [ly.grad_bytes for ly in ch.layers] == [P // W] * 3  # fp32 sharded gradients all the same
    same = ("persistent_bytes", "param_bytes", "optimizer_bytes", "total_grad_bytes", "opt_step_peak_bytes")
    assert all(getattr(ch, f) == getattr(fp32, f) for f in same)
    assert [ly.fwd_tmp_bytes for ly in ch.layers] == [ly.fwd_tmp_bytes for ly in fp32.layers]
    # smaller reduce-scatter inputs: no plan peaks higher, and the backward-bound ones lower
    for plan in (plan_none(3), plan_every_k(3, 1)):
        assert simulate(ch, plan).peak_bytes <= simulate(fp32, plan).peak_bytes
    assert simulate(ch, plan_every_k(3, 1)).peak_bytes < simulate(fp32, plan_every_k(3, 1)).peak_bytes


def test_ddp_adds_buckets_only():
    base = chain3()
    ch = per_rank_chain(base, world_size=8, kind="ddp", layer_param_bytes=[P] * 3, root_param_bytes=R)
    buckets = 3 * P + 8 + 12  # every parameter gradient, once more
    assert ch.persistent_bytes == base.persistent_bytes + buckets
    assert ch.opt_step_peak_bytes == base.opt_step_peak_bytes + buckets
    assert ch.layers == base.layers and ch.pre == base.pre and ch.post == base.post
    assert simulate(ch, plan_none(3)).peak_bytes == simulate(base, plan_none(3)).peak_bytes + buckets


def test_bad_arguments():
    with pytest.raises(UsageError, match="zero"):
        per_rank_chain(chain3(), world_size=2, kind="zero", layer_param_bytes=[P] * 3, root_param_bytes=R)
    with pytest.raises(UsageError, match="world-size"):
        per_rank_chain(chain3(), world_size=0, kind="fsdp", layer_param_bytes=[P] * 3, root_param_bytes=R)
    with pytest.raises(ValueError):
        per_rank_chain(chain3(), world_size=2, kind="fsdp", layer_param_bytes=[P] * 2, root_param_bytes=R)


def _row(index, role, param, grad, out, saved, fwd_peak, bwd_peak) -> StageRecord:
    return StageRecord(index, f"s{index}", role, role, param, grad, out, saved, 1.0, 2.0, 0, 0, 0, 0,
                       fwd_peak, bwd_peak)


def toy_profile(n: int = 6, param: int = 4000, act: int = 3000) -> Profile:
    rows = [_row(-1, PRE, 1000, 1000, 100, 100, 100, 1100)]
    rows += [_row(i, CHAIN, param, param, 100, act, 100 + (i + 1) * act, 100 + (n - i) * act + param)
             for i in range(n)]
    rows.append(_row(n, POST, 500, 500, 0, 200, 100 + n * act + 200, 100 + n * act + 500))
    params = n * param + 1500
    totals = Totals(params, 0, params, params, 2 * params, 0, 64, n * act + 300, 0, None)
    return Profile("toy", "meta", "meta", "blocks", False, 2, "fp32", "adamw", 1, False, True,
                   tuple(rows), totals)


def test_world_size_table_shrinks_per_rank_memory():
    prof = toy_profile()
    rows = world_size_table(prof, [1, 2, 4, 8], "fsdp", "dp", None)
    assert [r.world_size for r in rows] == [1, 2, 4, 8]
    per = [r.persistent_bytes for r in rows]
    assert per == sorted(per, reverse=True) and per[0] > 3 * per[-1]
    for r in rows:
        assert r.plan_peak_bytes == r.min_peak_bytes <= r.none_peak_bytes
        assert r.fits is None and r.overhead >= 0
    # one rank: the sharded state is the whole state
    one = per_rank_chain_from_profile(prof, 1, "fsdp")
    assert one.param_bytes == prof.totals.param_bytes
    assert one.optimizer_bytes == prof.totals.optimizer_bytes


def test_world_size_table_budget_and_infeasible():
    prof = toy_profile()
    lo8 = world_size_table(prof, [8], "fsdp", "dp", None)[0].min_peak_bytes
    rows = world_size_table(prof, [2, 8], "fsdp", "dp", lo8)
    assert rows[1].fits and rows[1].plan_peak_bytes <= lo8
    assert rows[0].plan_peak_bytes is None and not rows[0].fits and "budget" in rows[0].message
    ddp = world_size_table(prof, [2, 8], "ddp", "none", None)
    assert ddp[0].none_peak_bytes == ddp[1].none_peak_bytes  # replicated: the world size changes nothing


def test_accum_is_refused():
    from dataclasses import replace
    with pytest.raises(UsageError, match="accum"):
        per_rank_chain_from_profile(replace(toy_profile(), accum=2), 2, "fsdp")


def test_fsdp_options_hold_their_units_buffers():
    """A layer stored with a selective option runs the same FSDP unit: an option that keeps and
    holds what the layer does gets exactly the layer's per-rank transients, so storing every layer
    with it peaks where storing them plainly does; a leaner option gets the same buffers on top of
    its own transients (by hand, the middle layer: 2P in the first forward, 3P in the backward;
    held: its own, and the layer after's reduce-scatter input in the backward)."""
    from ckplan.planner.chain import Option
    from ckplan.planner.plan import Plan, Store
    base = chain3()
    same = Option("same", xbar_bytes=6, recompute_ms=0.0, fwd_tmp_bytes=1, bwd_tmp_bytes=3)
    lean = Option("lean", xbar_bytes=3, recompute_ms=0.5, fwd_tmp_bytes=2, bwd_tmp_bytes=5)
    ch0 = replace(base, layers=tuple(replace(ly, options=(same, lean)) for ly in base.layers))
    for w in (1, W):
        ch = per_rank_chain(ch0, world_size=w, kind="fsdp", layer_param_bytes=[P] * 3, root_param_bytes=R)
        for ly in ch.layers:
            as_same = ly.option("same")
            assert (as_same.fwd_tmp_bytes, as_same.bwd_tmp_bytes) == (ly.fwd_tmp_bytes, ly.bwd_tmp_bytes)
        plan = Plan("dp", 3, tuple(Store(i, "same") for i in range(3)))
        assert simulate(ch, plan).peak_bytes == simulate(ch, plan_none(3)).peak_bytes
    ch = per_rank_chain(ch0, world_size=W, kind="fsdp", layer_param_bytes=[P] * 3, root_param_bytes=R)
    mid = ch.layers[1].option("lean")
    assert (mid.fwd_tmp_bytes, mid.bwd_tmp_bytes) == (2 + 2 * P, 5 + 3 * P)
    assert (mid.held_fwd_tmp_bytes, mid.held_bwd_tmp_bytes) == (2, 5 + P)



# ---- FSDP2 holds the units of a checkpoint's recompute -------------------------------------
def _ckpts(n: int, ranges) -> Plan:
    return Plan.from_dict({"strategy": "x", "n_layers": n, "checkpoints": [list(r) for r in ranges]})


def _fsdp3() -> Chain:
    return per_rank_chain(chain3(), world_size=W, kind="fsdp", layer_param_bytes=[P] * 3, root_param_bytes=R)


def test_fsdp_multi_layer_checkpoint_holds_its_units_by_hand():
    """FSDP2 does not reshard a unit whose forward runs during backward: in the backward of
    C[0,3) all three units (P = 40 bytes each) stay unsharded until their own backward."""
    ch = _fsdp3()
    ev = {e.label: e for e in trace(ch, _ckpts(3, [(0, 3)]))}
    # first forward: persistent 109, pre 23 (its 3 + the root's 20), the boundary x[2] 2, post 5;
    # post backward: + its gradients 12 + x[2]'s gradient 2 - its 5 saved = 148; boundary dropped
    assert ev["free boundary x[2] of [0,3)"].mem_bytes == 146
    start = ev["backward of [0,3) starts: its layers are held until their backward"]
    assert start.mem_bytes == 146 + 3 * P == 266
    # recompute of layer 0 and 1: each keeps its xbar 6; transient: the forward's own 1 and the
    # all-gather buffer of the unit it unshards (40); nothing retained (the post is the root's)
    f1 = ev["F(layer 1) during recompute of [0,3)"]
    assert (f1.live_bytes, f1.transient_bytes, f1.peak_bytes) == (266 + 6 + 6, 1 + P, 319)
    # layer 2, the last: unsharded by its pre-backward hook before the recompute, no buffer
    assert ev["F(layer 2) during recompute of [0,3)"].peak_bytes == 266 + 18 + 1 == 285
    # B(2): transient 3; after: + x[1]'s gradient 2 + its shard 10, - xbar 6 - x[2]'s gradient 2
    # - its unit 40
    b2 = ev["B(layer 2) during recompute of [0,3)"]
    assert (b2.peak_bytes, b2.mem_bytes) == (287, 284 + 2 + 10 - 6 - 2 - P)
    # B(1): units 0 and 1 still held; transient 3 + layer 2's reduce-scatter input 40
    b1 = ev["B(layer 1) during recompute of [0,3)"]
    assert (b1.live_bytes, b1.transient_bytes, b1.peak_bytes) == (248, 3 + P, 291)
    sc = simulate(ch, _ckpts(3, [(0, 3)]))
    assert sc.peak_bytes == 319 and sc.peak_at == "F(layer 1) during recompute of [0,3)"


def test_fsdp_first_layer_of_a_checkpoint_has_the_prefetch_beside_its_backward():
    """S0 C[1,3): B(1)'s pre-backward hook prefetches unit 0 (its all-gather buffer, 40 bytes),
    which the held units 1 and 2 do not include."""
    ch = _fsdp3()
    ev = {e.label: e for e in trace(ch, _ckpts(3, [(1, 3)]))}
    b1 = ev["B(layer 1) during recompute of [1,3)"]
    assert (b1.live_bytes, b1.transient_bytes, b1.peak_bytes) == (208, 3 + P + P, 291)
    assert ev["F(layer 2) during recompute of [1,3)"].transient_bytes == 1  # the last: no buffer


def test_fsdp_single_layer_checkpoints_match_the_per_layer_model():
    """A checkpoint of one layer holds its unit only: the recompute and the backward peak exactly
    where the per-layer transients (own + prefetch + retained, measured to the byte) put them."""
    ch = _fsdp3()
    ev = {e.label: e for e in trace(ch, plan_every_k(3, 1))}
    # B(2)'s after 160, x[1] dropped: 158; unit 1 held (40) = 198; F1: + xbar 6, transient
    # 1 + 40 (retained by B2) + 40 (unit 0 prefetched) = 285: its unit, the prefetch and the
    # retained input above its own transient, as its backward has them (123 = 3 + 3P)
    f1 = ev["F(layer 1) during recompute of [1,2)"]
    assert (f1.live_bytes, f1.transient_bytes, f1.peak_bytes) == (204, 1 + 2 * P, 285)
    assert f1.peak_bytes == 158 + 6 + 1 + 3 * P
    assert ev["B(layer 1) during recompute of [1,2)"].peak_bytes == 158 + 6 + ch.layers[1].bwd_tmp_bytes


def test_ddp_holds_nothing():
    ch = per_rank_chain(chain3(), world_size=2, kind="ddp", layer_param_bytes=[P] * 3, root_param_bytes=R)
    assert not ch.has_holds
    assert _fsdp3().has_holds


def test_held_sizes_are_checked():
    base = chain3()
    with pytest.raises(ValueError, match="non-negative"):
        replace(base, layers=(replace(base.layers[0], held_bytes=-1), *base.layers[1:]))


SIZE = 20


def brute(chain: Chain) -> list[tuple[int, float]]:
    """(peak, recompute) of every plan of rotor's grammar, with every option of every layer."""
    from brute_options import brute as every
    return every(chain)


def _least(scores, budget: int) -> float:
    fit = [r for p, r in scores if p <= budget]
    return min(fit) if fit else math.inf


def _budgets(scores) -> list[int]:
    peaks = sorted({p for p, _ in scores})
    return sorted(set(peaks) | {p - 1 for p in peaks} | {(a + b) // 2 for a, b in zip(peaks, peaks[1:])})


def check_held_against_brute(chain: Chain) -> None:
    """min_peak, min_peak_plan and plan_dp at every budget that matters against every plan."""
    scores = brute(chain)
    lowest = min(p for p, _ in scores)
    assert min_peak(chain) == lowest
    assert simulate(chain, min_peak_plan(chain)).peak_bytes == lowest
    none = simulate(chain, plan_none(chain.n_layers)).peak_bytes
    for b in _budgets(scores):
        if b < lowest:
            with pytest.raises(InfeasibleBudgetError):
                plan_dp(chain, b)
            continue
        res = plan_dp(chain, b)
        sc = simulate(chain, res.plan)
        assert sc.peak_bytes <= b
        assert res.exact or b >= none
        assert sc.recompute_ms == pytest.approx(_least(scores, b), rel=1e-9, abs=1e-9), (b, res.plan.describe())
        assert simulate(chain, min_peak_plan(chain, b)).peak_bytes <= b


def _fsdp_random(n: int, seed: int) -> Chain:
    rng = np.random.default_rng(seed + 7)
    return per_rank_chain(random_chain(n, seed, max_size=SIZE), world_size=int(rng.integers(1, 4)), kind="fsdp",
                          layer_param_bytes=[int(rng.integers(0, 3 * SIZE)) for _ in range(n)],
                          root_param_bytes=int(rng.integers(0, 2 * SIZE)))


@pytest.mark.parametrize("seed", range(6))
def test_dp_on_per_rank_fsdp_chains_equals_brute_force(seed):
    """The DP's model is the simulator's: on per-rank FSDP chains (held units, their all-gather
    buffers, prefetch and reduce-scatter inputs) it is optimal at every budget and never over."""
    check_held_against_brute(_fsdp_random(2 + seed % 4, seed))


@pytest.mark.parametrize("seed", range(4))
def test_dp_with_any_held_sizes_equals_brute_force(seed):
    check_held_against_brute(with_holds(random_chain(2 + seed % 4, 100 + seed, max_size=SIZE), seed))


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(6, 30))
def test_dp_with_held_layers_equals_brute_force_more(seed):
    chain = (_fsdp_random(2 + seed % 4, seed) if seed % 2 else
             with_holds(random_chain(2 + seed % 4, 100 + seed, max_size=SIZE), seed))
    check_held_against_brute(chain)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(4))
def test_dp_with_held_layers_and_options_against_brute_force(seed):
    """With selective options the prefetch beside a checkpoint's first layer is counted with its
    costliest option (its plans fit) and its cheapest gives a lower bound: the smallest peak lies
    between them, and a plan marked exact recomputes the least."""
    chain = with_holds(random_chain(2 + seed % 3, 200 + seed, max_size=SIZE, options=2), seed)
    scores = brute(chain)
    lowest = min(p for p, _ in scores)
    low = max(fixed_peak(chain), base_bytes(chain) + held.top_level(chain, "least").need_bytes)
    assert low <= lowest <= min_peak(chain)
    assert simulate(chain, min_peak_plan(chain)).peak_bytes == min_peak(chain)
    for b in _budgets(scores):
        if b < min_peak(chain):
            continue
        res = plan_dp(chain, b)
        sc = simulate(chain, res.plan)
        assert sc.peak_bytes <= b
        if res.exact:
            assert sc.recompute_ms == pytest.approx(_least(scores, b), rel=1e-9, abs=1e-9)


@pytest.mark.parametrize("seed", range(3))
def test_held_chains_the_exact_dp_does_not_take_still_fit(seed):
    """Autocast copies (and unkept boundaries): planned without the holds at budgets lowered until
    the plan fits; the smallest peak reported is one a plan reaches."""
    chain = with_casts(with_holds(random_chain(3 + seed % 2, 300 + seed, max_size=SIZE), seed), seed)
    if seed == 2:
        chain = replace(chain, layers=tuple(replace(ly, x_kept=bool(i % 2), cast_bytes=0)
                                            for i, ly in enumerate(chain.layers)))
    assert not held.held_applies(chain)
    scores = brute(chain)
    lo, none = min_peak(chain), simulate(chain, plan_none(chain.n_layers)).peak_bytes
    assert lo >= min(p for p, _ in scores)
    assert simulate(chain, min_peak_plan(chain)).peak_bytes == lo
    for b in _budgets(scores):
        if lo <= b < none:
            res = plan_dp(chain, b)
            assert simulate(chain, res.plan).peak_bytes <= b and not res.exact


def test_dp_never_over_its_per_rank_budget_on_a_long_fsdp_chain():
    """A 16-layer per-rank chain whose boundaries are cheap and whose units are large: before the
    holds were modelled the smallest-peak plan put most layers in one long checkpoint."""
    base = random_chain(16, 5, scale=1000)
    ch = per_rank_chain(base, world_size=2, kind="fsdp", layer_param_bytes=[60_000] * 16, root_param_bytes=9_000)
    lo, hi = min_peak(ch), simulate(ch, plan_none(16)).peak_bytes
    assert simulate(ch, min_peak_plan(ch)).peak_bytes == lo
    for t in range(9):
        b = lo + (hi - lo) * t // 8
        res = plan_dp(ch, b)
        assert simulate(ch, res.plan).peak_bytes <= b and res.exact


def test_world_size_rows_price_the_collectives_by_hand():
    from fake_records import make_profile

    from ckplan.device_model import BUILTIN

    prof = make_profile()
    P = prof.totals.param_bytes  # fp32: the gradients are as large
    h100 = BUILTIN["h100"]
    rows = {r.world_size: r for r in world_size_table(prof, [1, 8, 16], "fsdp", "dp", None, device=h100)}
    # FSDP2 moves (n-1)/n of the parameters twice (forward and backward all-gathers) and of the
    # gradients once (reduce-scatter): over NVLink within 8 ranks, over the network beyond
    assert rows[1].comm_ms == 0.0
    assert rows[8].comm_ms == pytest.approx(3 * 7 / 8 * P / h100.link_bw * 1e3)
    assert rows[16].comm_ms == pytest.approx(3 * 15 / 16 * P / h100.network_bw * 1e3)
    ddp = world_size_table(prof, [4], "ddp", "dp", None, device=h100)[0]
    assert ddp.comm_ms == pytest.approx(2 * 3 / 4 * P / h100.link_bw * 1e3)  # a ring all-reduce
    # the per-rank step: the plan's recompute on top of the step without checkpointing
    assert rows[8].step_ms == pytest.approx(per_rank_chain_from_profile(prof, 8, "fsdp").base_step_ms
                                            * (1 + rows[8].overhead))
    assert world_size_table(prof, [8], "fsdp", "dp", None)[0].comm_ms is None  # no device model
    # under MixedPrecisionPolicy(bf16): all-gathers of bf16 parameters, the gradients reduced in
    # fp32 (twice the bf16 gradients' bytes) or, with reduce_dtype bf16, in bf16
    for reduce, grads in (("fp32", P), ("bf16", P // 2)):
        mp = replace(prof, param_dtype="bf16", reduce_dtype=reduce,
                     totals=replace(prof.totals, param_bytes=P // 2, grad_bytes=P // 2))
        row = world_size_table(mp, [8], "fsdp", "dp", None, device=h100)[0]
        assert row.comm_ms == pytest.approx((2 * P // 2 + grads) * 7 / 8 / h100.link_bw * 1e3), reduce
