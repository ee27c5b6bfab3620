"""The per-rank memory model (FSDP2, DDP) against bytes computed by hand. No torch."""
from __future__ import annotations

from dataclasses import replace

import pytest

from ckplan.errors import UsageError
from ckplan.planner import plan_none, simulate, trace
from ckplan.planner.chain import Chain, Layer, Post, Pre
from ckplan.planner.parallel import per_rank_chain, per_rank_chain_from_profile, world_size_table
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
    # forward: unsharded + flat all-gather buffer (2P); recompute: unsharded + prefetch + the
    # retained reduce-scatter input of the layer after (3P for the middle layer).
    assert [ly.fwd_tmp_bytes for ly in ch.layers] == [1 + 2 * P, 1 + 3 * P, 1 + 2 * P]
    # backward: unsharded P + prefetch of the layer before + reduce-scatter input of the one after
    assert [ly.bwd_tmp_bytes for ly in ch.layers] == [3 + 2 * P, 3 + 3 * P, 3 + 2 * P]
    # the root stays unsharded from the pre stage to the end of backward
    assert ch.pre.retained_bytes == 3 + R and ch.pre.fwd_tmp_bytes == 1 + R
    assert ch.pre.bwd_tmp_bytes == max(2 + P, 8 + R) and ch.pre.grad_bytes == 0
    assert ch.post.fwd_tmp_bytes == 2 + P and ch.post.bwd_tmp_bytes == 4 + P


def test_fsdp_one_rank_has_no_flat_buffers():
    ch = per_rank_chain(chain3(), world_size=1, kind="fsdp", layer_param_bytes=[P] * 3, root_param_bytes=R)
    # one rank copies the shard into the unsharded parameters: no all-gather buffer, no prefetch
    assert [ly.fwd_tmp_bytes for ly in ch.layers] == [1 + 2 * P, 1 + 2 * P, 1 + P]
    assert [ly.bwd_tmp_bytes for ly in ch.layers] == [3 + 2 * P, 3 + 2 * P, 3 + P]
    assert ch.pre.fwd_tmp_bytes == 1 and ch.post.fwd_tmp_bytes == 2
    assert ch.param_bytes == 3 * P + R and [ly.grad_bytes for ly in ch.layers] == [P] * 3


def test_fsdp_none_peak_by_hand():
    ch = per_rank_chain(chain3(), world_size=W, kind="fsdp", layer_param_bytes=[P] * 3, root_param_bytes=R)
    # mem 109; pre F: live 109 + 23 = 132 (+21 -> 153); F0 138 (+81 -> 219); F1 144 (+121 -> 265);
    # F2 150 (+81 -> 231); post F 155 (+42 -> 197); post B 155 (+44 -> 199), then 155 + 2 + 12 - 5
    # = 164; B2 164 (+83 -> 247) -> 164 + 2 + 10 - 6 - 2 = 168; B1 168 (+123 -> 291) -> 172;
    # B0 172 (+83 -> 255) -> 174; pre B 174 (+42 -> 216) -> 174 - 23 = 151, above the optimizer
    # step's 109 + 35 + 2 = 146.
    ev = trace(ch, plan_none(3))
    assert [e.peak_bytes for e in ev] == [153, 219, 265, 231, 197, 199, 247, 291, 255, 216, 151]
    assert ch.opt_step_peak_bytes == 146
    sc = simulate(ch, plan_none(3))
    assert sc.peak_bytes == 291 and sc.peak_at == "B(layer 1)"


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
    its own transients (by hand, the middle layer: 3P in the forward, 3P in the backward)."""
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
    assert (mid.fwd_tmp_bytes, mid.bwd_tmp_bytes) == (2 + 3 * P, 5 + 3 * P)
