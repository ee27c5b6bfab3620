"""Tensors a layer keeps that no saved-tensor hook sees: a custom autograd Function keeping its
input as a ``ctx`` attribute instead of through ``save_for_backward`` (common in hand-written
kernels' wrappers). A checkpoint's forward cannot drop them, and the graph's node holds them
until the step's backward is over, after the layer's own backward too.

Oracles: the analytic size of the kept tensor, the live-tensor tracker's peak of real training
steps under many plans (the prediction must equal it to the byte; without the two measured
fields it was up to 37% low: a checkpoint saved nothing on this chain), gradients equal to the
step without checkpoints, and the dp plan's measured peak within its budget.
"""
from dataclasses import replace

import ckmodels
import torch
from side_nets import B, D, N, measured_peak, profiled

from ckplan import api
from ckplan.planner import Plan, chain_from_profile, min_peak, plan_chain, simulate
from ckplan.planner.plan import items_from_ranges

KEPT = B * 4 * D * 4  # ctx.a: the (B, 4d) fp32 tanh output


def _setup():
    return profiled(ckmodels.CtxChain, "ctx")


def test_profile_measures_what_the_ctx_attribute_keeps():
    _, _, prof = _setup()
    for r in prof.chain_layers:
        assert r.unsaved_kept_bytes == KEPT  # a forward that saves nothing still keeps ctx.a
        assert r.kept_after_backward_bytes == KEPT  # and its backward does not free it
    back = type(prof).from_dict(prof.to_dict())
    assert [r.kept_after_backward_bytes for r in back.chain_layers] == [KEPT] * N
    # a chain without such tensors measures none
    _, _, plain = profiled(ckmodels.BiasedChain, "b")
    assert all(r.unsaved_kept_bytes == 0 == r.kept_after_backward_bytes for r in plain.chain_layers)


def test_peaks_predicted_to_the_byte_with_tensors_checkpoints_cannot_drop():
    model, x, prof = _setup()
    chain = chain_from_profile(prof)
    p = chain.persistent_bytes
    bare = replace(chain, layers=tuple(replace(ly, unsaved_kept_bytes=0, kept_after_bytes=0)
                                       for ly in chain.layers))
    ref = ckmodels.step_with_plan(model, (x,), {}, None)
    plans = [Plan("c", N, items_from_ranges(N, r)) for r in
             ([], [(0, 2), (2, 4), (4, 6)], [(0, 3), (3, 6)], [(0, 6)], [(2, 4)], [(0, 6), (1, 4)], [(1, 2)])]
    low = 0
    for plan in plans:
        measured = measured_peak(model, x, plan)
        assert simulate(chain, plan).peak_bytes - p == measured, plan.describe()
        low += simulate(bare, plan).peak_bytes - p < measured
        loss, grads = ckmodels.step_with_plan(model, (x,), {}, plan)
        assert loss == ref[0] and all(torch.equal(grads[k], g) for k, g in ref[1].items())
    assert low >= 5  # the oracle can fail: without the two fields these plans were predicted low
    # the dp plan, at the smallest peak and halfway: measured as predicted, within budget
    none_peak = simulate(chain, plans[0]).peak_bytes
    for budget in (min_peak(chain), (min_peak(chain) + none_peak) // 2):
        got = plan_chain(chain, "dp", budget)
        assert got.plan.n_checkpoints > 0 and not got.exact and any("ctx attributes" in n for n in got.notes)
        assert simulate(chain, got.plan).peak_bytes - p == measured_peak(model, x, got.plan) <= budget - p


def test_dp_fits_where_only_some_layers_keep_such_tensors():
    # Layers 0 and 3 plain (BiasedChain-like blocks keep nothing extra), the others with ctx.a:
    # checkpoints pay where they drop something; the dp plan fits its budget when measured.
    torch.manual_seed(0)
    model = ckmodels.CtxChain(D, N)
    for i in (0, 3):
        model.layers[i] = ckmodels.MaskedBlock(D)
        model.layers[i].forward = lambda h, blk=model.layers[i]: h + blk.down(torch.tanh(blk.up(h)))
    x = torch.randn(B, D)
    prof = api.profile_model(model, (x,), {}, name="mixed", chain=None, device="cpu", optimizer="sgd",
                             repeats=1, warmup=0)
    assert [r.unsaved_kept_bytes for r in prof.chain_layers] == [0, KEPT, KEPT, 0, KEPT, KEPT]
    chain = chain_from_profile(prof)
    p = chain.persistent_bytes
    none_peak = simulate(chain, Plan("none", N, items_from_ranges(N, []))).peak_bytes
    lo = min_peak(chain)
    assert lo < none_peak
    for budget in (lo, (lo + none_peak) // 2):
        got = plan_chain(chain, "dp", budget)
        assert got.plan.n_checkpoints > 0 and not got.exact and any("ctx attributes" in n for n in got.notes)
        assert simulate(chain, got.plan).peak_bytes - p == measured_peak(model, x, got.plan) <= budget - p


def test_a_cache_on_the_module_keeps_the_recompute_and_plans_stay_safe():
    # `self.last_attn = attn` keeps the forward's attention on the module; a recompute replaces it
    # with its own, whose graph holds the recompute's tensors until the layer's next forward.
    # The profile measures what each recompute leaves (alone, and in one checkpoint with
    # the layers after it, whose graphs reach back through it) and every plan is predicted at or above its
    # measured peak (second step: the first step's caches are there when it starts), dp within
    # its budget, gradients equal.
    from ckplan.profiling.notes import LEFT_NOTE
    torch.manual_seed(0)
    model, x = ckmodels.CachingChain(32, 6), torch.randn(4, 64, 32)
    prof = api.profile_model(model, (x,), {}, name="cache", chain=None, device="cpu", optimizer="sgd",
                             repeats=1, warmup=0)
    probs = 4 * 64 * 64 * 4  # what each layer keeps on the module: its attention probabilities
    assert all(r.recompute_kept_bytes >= probs for r in prof.chain_layers)
    assert all(r.recompute_chain_kept_bytes >= r.recompute_kept_bytes for r in prof.chain_layers[:-1])
    assert any(n.startswith(LEFT_NOTE) for n in prof.notes)
    chain = chain_from_profile(prof)
    p = chain.persistent_bytes
    none = plan_chain(chain, "none").plan
    lo, hi = min_peak(chain), simulate(chain, none).peak_bytes
    ref = ckmodels.step_with_plan(model, (x,), {}, none)
    for plan in (plan_chain(chain, "every-k", k=1).plan, plan_chain(chain, "every-k", k=2).plan,
                 plan_chain(chain, "dp", lo).plan, plan_chain(chain, "dp", (lo + hi) // 2).plan):
        measured_peak(model, x, plan)  # the step before: its caches are there when the next starts
        measured = measured_peak(model, x, plan)
        assert simulate(chain, plan).peak_bytes - p >= measured, plan.describe()
        loss, grads = ckmodels.step_with_plan(model, (x,), {}, plan)
        assert loss == ref[0] and all(torch.equal(grads[k], g) for k, g in ref[1].items())
    for budget in (lo, (lo + hi) // 2):
        got = plan_chain(chain, "dp", budget).plan
        measured_peak(model, x, got)
        assert p + measured_peak(model, x, got) <= budget
