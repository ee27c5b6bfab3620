"""Models that change the hidden state between two chain layers (a residual added in the
container's loop, U-Net skip connections added between blocks): no checkpoint can span such a
boundary (apply_plan links the layers of one checkpoint by the identity of the tensor one
returns and the next receives, inside tuples, lists and dicts too: a chain handing on a dict of
tensors has no break).

Oracles: which boundaries the profile finds (read off the models' code), the live-tensor
tracker's peak of real steps under every strategy's plan (predicted to the byte), gradients
equal to the plan without checkpoints, and brute force over every nested plan that spans no
break for the DP.
"""
from dataclasses import replace

import ckmodels
import pytest
import torch
from brute_plans import check_plan_chain_against_brute
from side_nets import measured_peak

from ckplan import api
from ckplan.errors import SpecError
from ckplan.planner import Plan, chain_from_profile, min_peak, plan_chain, simulate
from ckplan.planner.plan import items_from_ranges
from ckplan.planner.synthetic import random_chain
from ckplan.profiling.notes import BREAKS_NOTE
from ckplan.records import Profile

CASES = {  # model, batch, the breaks its forward makes
    "residual-in-loop": (lambda: ckmodels.PreNormResidualMLP(32, 6), (64, 32), (1, 2, 3, 4, 5)),
    "dict": (lambda: ckmodels.DictChain(32, 5), (64, 32), ()),  # linked inside the dict: no break
    "unet": (lambda: ckmodels.UNet(4, 3), (2, 3, 32, 32), (4, 5)),  # the up blocks add a skip
}


def _profiled(name):
    make, shape, breaks = CASES[name]
    torch.manual_seed(0)
    model, x = make(), torch.randn(*shape)
    prof = api.profile_model(model, (x,), {}, name=name, chain=None, device="cpu", optimizer="sgd",
                             repeats=1, warmup=0)
    return model, x, prof, breaks


@pytest.mark.parametrize("name", sorted(CASES))
def test_profile_finds_the_breaks(name):
    _, _, prof, breaks = _profiled(name)
    assert prof.chain_breaks == breaks
    assert any(n.startswith(BREAKS_NOTE) for n in prof.notes) == bool(breaks)
    assert Profile.from_dict(prof.to_dict()).chain_breaks == breaks  # JSON round trip


def test_a_chain_without_breaks_has_none():
    torch.manual_seed(0)
    model, x = ckmodels.Coupling(16, 4), torch.randn(8, 16)
    prof = api.profile_model(model, (x,), {}, name="c", chain=None, device="cpu", optimizer="sgd",
                             repeats=1, warmup=0)
    assert prof.chain_breaks == ()


@pytest.mark.parametrize("name", sorted(CASES))
def test_every_strategy_runs_exact_and_same_gradients(name):
    model, x, prof, breaks = _profiled(name)
    chain = chain_from_profile(prof)
    p = chain.persistent_bytes
    none = plan_chain(chain, "none").plan
    lo, hi = min_peak(chain), simulate(chain, none).peak_bytes
    plans = [none, plan_chain(chain, "every-k", k=2).plan, plan_chain(chain, "every-k", k=3).plan,
             plan_chain(chain, "sqrtn").plan, plan_chain(chain, "chen", (lo + hi) // 2).plan,
             plan_chain(chain, "dp", lo).plan, plan_chain(chain, "dp", (lo + hi) // 2).plan]
    ref = ckmodels.step_with_plan(model, (x,), {}, none)
    spanned = 0
    for plan in plans:
        for r in plan.recomputed_ranges():
            assert not any(r.start < b < r.stop for b in breaks), plan.describe()
            spanned += r.stop - r.start > 1
        assert simulate(chain, plan).peak_bytes - p == measured_peak(model, x, plan), plan.describe()
        loss, grads = ckmodels.step_with_plan(model, (x,), {}, plan)
        assert loss == ref[0] and all(torch.equal(grads[k], g) for k, g in ref[1].items())
    if name != "residual-in-loop":
        assert spanned  # U-Net's down blocks share checkpoints; so do the dict-passing blocks
    said = any("chain breaks" in n for n in plan_chain(chain, "dp", lo).notes)
    assert said == bool(breaks)


def test_a_plan_spanning_a_break_is_refused_with_the_layer():
    _, _, prof, _ = _profiled("unet")
    chain = chain_from_profile(prof)
    plan = Plan("custom", chain.n_layers, items_from_ranges(chain.n_layers, [(3, 5)]))
    with pytest.raises(SpecError, match="layer 4 does not receive layer 3's output"):
        simulate(chain, plan)


@pytest.mark.parametrize("seed", range(6))
def test_dp_equals_brute_force_over_plans_that_span_no_break(seed):
    chain = random_chain(5, seed)
    breaks = ((2,), (1, 3), (4,), (2, 3), (1, 2, 3, 4), (3,))[seed]
    check_plan_chain_against_brute(replace(chain, breaks=breaks))


def test_a_profile_json_with_bad_breaks_is_named(tmp_path):
    from ckplan.api import profile_problem
    _, _, prof, _ = _profiled("residual-in-loop")
    d = prof.to_dict()
    assert profile_problem(d) is None
    d["chain_breaks"] = [0, 9]
    assert "chain_breaks is [0, 9], not a list of chain layer indices 1..5" in profile_problem(d)


def test_tensors_the_container_saves_between_layers_are_kept_by_every_plan():
    # x = norm(layer(x)) in the loop: the norm (outside every chain layer) saves the layer's
    # output, and a checkpoint over the layer does not drop it. Planned as kept until the
    # backward ends (it is freed at the norm's backward): every plan predicted at or above its
    # measured peak, the plan without checkpoints exact, dp within its budget when measured.
    from ckplan.profiling.notes import OUTSIDE_NOTE
    torch.manual_seed(0)
    model, x = ckmodels.NormInLoop(32, 5), torch.randn(64, 32)
    prof = api.profile_model(model, (x,), {}, name="norm", chain=None, device="cpu", optimizer="sgd",
                             repeats=1, warmup=0)
    assert prof.chain_breaks == (1, 2, 3, 4)
    # each layer's output (64 x 32 fp32), and the norm's mean and rstd (2 x 64 fp32) it saves
    assert 64 * 32 * 4 + 2 * 64 * 4 == 8704  # 8.5 KiB
    assert [n for n in prof.notes if n.startswith(OUTSIDE_NOTE)] == [
        OUTSIDE_NOTE + ": " + ", ".join(f"layer {i} (8.5 KiB)" for i in range(4))]
    chain = chain_from_profile(prof)
    p = chain.persistent_bytes
    none = plan_chain(chain, "none").plan
    assert simulate(chain, none).peak_bytes - p == measured_peak(model, x, none)
    lo, hi = min_peak(chain), simulate(chain, none).peak_bytes
    for plan in (plan_chain(chain, "every-k", k=1).plan, plan_chain(chain, "dp", lo).plan,
                 plan_chain(chain, "dp", (lo + hi) // 2).plan):
        assert simulate(chain, plan).peak_bytes - p >= measured_peak(model, x, plan), plan.describe()
