"""The gradient of a side input while the autograd engine sums it (``SideInput.partial_bytes``):
layers that concatenate the side input to their hidden state (Zamba2's hybrid layers) hand it a
slice of the concatenation's gradient, which keeps that whole gradient alive until the next
layer's share arrives. A checkpoint whose recompute runs in between runs beside it.

Oracle: the live-tensor tracker's peak of real training steps under every plan of a small chain,
predicted to the byte; without the partial gradient, the plans recomputing in between were below
the measurement by the side input's size.
"""
from dataclasses import replace

import pytest
import torch
from brute_plans import all_plans
from side_nets import B, ConcatChain, D, measured_peak, profiled

from ckplan import api
from ckplan.planner import Plan, chain_from_profile, simulate
from ckplan.records import SideInput

ORIG = B * D * 4  # the (B, d) fp32 side input


@pytest.mark.parametrize("uses,span", [((1, 3), (2, 1)), ((0, 2, 4), (3, 2)), ((4,), None)])
def test_every_plan_predicted_to_the_byte(uses, span):
    n = 5
    model, x, prof = profiled(lambda d, _: ConcatChain(d, n, uses), f"concat{uses}")
    (si,) = [si for si in prof.side_inputs if si.grad_bytes]
    assert si.grad_from == (max(uses) if max(uses) < n - 1 else -1)  # layer 4 alone sends none back
    if span is None:  # one layer reads it: its slice is the whole gradient, the concatenation's
        assert (si.grad_bytes, si.partial_bytes, si.partial_span) == (2 * ORIG, 0, ())
    else:  # the slice held from the backward after the last reader's to the next reader's
        assert (si.grad_bytes, si.partial_bytes, si.partial_span) == (ORIG, ORIG, span)
    chain = chain_from_profile(prof)
    without = replace(chain, side_inputs=tuple(replace(s, partial_bytes=0, partial_span=()) for s in chain.side_inputs))
    p = chain.persistent_bytes
    low_without = 0
    for items in all_plans(n):
        plan = Plan("brute", n, items)
        measured = measured_peak(model, x, plan)
        assert simulate(chain, plan).peak_bytes - p == measured, plan.describe()
        low_without += simulate(without, plan).peak_bytes - p < measured
    assert (low_without >= 20) == (span is not None)


def test_partial_gradient_round_trips_and_is_checked():
    _, _, prof = profiled(lambda d, _: ConcatChain(d, 4), "concat")
    back = type(prof).from_dict(prof.to_dict())
    assert back.side_inputs == prof.side_inputs
    chain = chain_from_profile(prof)
    with pytest.raises(ValueError, match="partial_span"):
        replace(chain, side_inputs=(SideInput(8, (1, 3), grad_bytes=8, partial_bytes=8, partial_span=(1, 2)),))


def test_meta_profile_equals_the_cpu_profile():
    torch.manual_seed(0)
    model = ConcatChain()
    x = torch.randn(B, D)
    kw = dict(name="concat", chain=None, optimizer="sgd", repeats=1, warmup=0)
    cpu = api.profile_model(model, (x,), {}, device="cpu", **kw)
    meta = api.profile_model(model, (x,), {}, device="meta", **kw)
    assert meta.side_inputs == cpu.side_inputs
