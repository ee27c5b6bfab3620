"""Selective options installed by the executor never change the math, and hold what they say.

Oracles: loss and every gradient equal those without a plan (bitwise here: the recompute replays
the same ops with the same RNG), for every policy, at the top level and inside (nested)
checkpoints, on the zoo GPT (dropout on) and a Hugging Face Qwen2; bytes live after the forward
computed by hand from the layer's shapes.
"""
import ckmodels
import pytest
import torch
import torch.nn as nn

from ckplan.errors import SpecError
from ckplan.execute import apply_plan
from ckplan.measure import LiveTensorTracker
from ckplan.planner.plan import Plan, items_from_ranges
from ckplan.sac import POLICIES
from ckplan.zoo import build_builtin


def _step(model, kwargs, plan):
    return ckmodels.step_with_plan(model, (), kwargs, plan)


def _plans(n):
    """Options at the top level, under one checkpoint, and two checkpoints deep, mixed with
    stored and checkpointed layers."""
    shapes = [[], [(0, 2)], [(0, n), (1, n - 1)], [(1, n)]]
    out = []
    for pol in POLICIES:
        for ranges in shapes:
            out.append(Plan("custom", n, items_from_ranges(n, ranges)).with_options([pol] * n))
    # a mix: each layer a different option (store included)
    names = ["store", *POLICIES]
    out.append(Plan("custom", n, items_from_ranges(n, [(0, n), (2, n)]))
               .with_options([names[i % len(names)] for i in range(n)]))
    return out


def _assert_same_math(model, kwargs, n):
    loss0, g0 = _step(model, kwargs, None)
    for plan in _plans(n):
        loss1, g1 = _step(model, kwargs, plan)
        assert loss1 == loss0, plan.describe()
        assert g1.keys() == g0.keys()
        for name in g0:
            assert torch.equal(g1[name], g0[name]), (plan.describe(), name)


def _ids(seq=32, batch=2):
    return torch.randint(0, 101, (batch, seq), generator=torch.Generator().manual_seed(1))


def test_zoo_gpt_options_same_gradients():
    model = build_builtin("gpt", {"n_layer": 3, "n_embd": 64, "n_head": 4, "vocab_size": 101,
                                  "block_size": 32, "dropout": 0.1})
    ids = _ids()
    _assert_same_math(model, {"input_ids": ids, "labels": ids}, 3)


def test_hf_qwen2_options_same_gradients():
    pytest.importorskip("transformers")
    model = ckmodels.hf_alternating("qwen2", 4, dropout=0.1)
    ids = _ids()
    _assert_same_math(model, {"input_ids": ids, "labels": ids}, 4)


class _Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


class _MLP(nn.Module):
    def __init__(self, d, n):
        super().__init__()
        self.layers = nn.ModuleList(_Block(d) for _ in range(n))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x.square().mean()


B, D, N = 64, 32, 4
F32 = 4


def _live_after_forward(model, x, plan):
    with apply_plan(model, plan), LiveTensorTracker() as tr:
        loss = model(x)
        live = tr.live - loss.untyped_storage().nbytes()
        loss.backward()
    model.zero_grad(set_to_none=True)
    return live


def test_bytes_kept_by_options_by_hand():
    """Per block (input x of B x D held by the previous one): ``store`` keeps the up output
    (gelu's input) and the gelu output (down's input), 2 x B x 4D, plus its output; sac-compute
    and sac-linear keep the outputs of the two matmuls (B x 4D and B x D) and the output;
    sac-attn keeps those and the gelu output. Inside a checkpoint, an option keeps nothing in
    the first forward."""
    torch.manual_seed(0)
    model = _MLP(D, N)
    x = torch.randn(B, D, requires_grad=True)
    out = B * D * F32
    per = {"store": 2 * B * 4 * D * F32 + out,
           "sac-compute": B * 4 * D * F32 + B * D * F32 + out,
           "sac-linear": B * 4 * D * F32 + B * D * F32 + out,
           "sac-attn": 2 * B * 4 * D * F32 + B * D * F32 + out}
    for name, kept in per.items():
        plan = Plan("custom", N, items_from_ranges(N, [])).with_options([name] * N)
        # the last block's output is what square() saves for the loss: counted in its ``out``
        assert _live_after_forward(model, x, plan) == N * kept, name
    plain = Plan("custom", N, items_from_ranges(N, [(0, N), (1, 3)]))
    base = _live_after_forward(model, x, plain)
    for name in POLICIES:
        assert _live_after_forward(model, x, plain.with_options([name] * N)) == base, name


def test_unknown_option_is_refused_before_running():
    model = _MLP(D, 2)
    plan = Plan("custom", 2, items_from_ranges(2, [])).with_options(["store", "sac-magic"])
    with pytest.raises(SpecError, match="sac-magic"):
        apply_plan(model, plan)
    assert "forward" not in model.layers[0].__dict__  # nothing installed


def test_plan_with_options_round_trips_through_json():
    plan = Plan("dp", 4, items_from_ranges(4, [(0, 4), (1, 3)])).with_options(
        ["sac-compute", "store", "sac-attn", "store"])
    d = plan.to_dict()
    assert d["options"] == ["sac-compute", "store", "sac-attn", "store"]
    back = Plan.from_dict(d)
    assert back == plan and back.describe() == plan.describe()
    assert "S0:sac-compute" in plan.describe()
    assert "options" not in Plan("none", 4, items_from_ranges(4, [])).to_dict()


def test_a_kept_random_op_keeps_the_later_ones_random_numbers_right():
    """A policy that keeps one random op's output (CUDA's fused attention with dropout, under
    sac-compute) must keep every later random op too, else the recompute draws the later masks
    from the wrong RNG offset. Here the kept random op is a plain draw, so it runs on CPU."""
    import functools

    from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

    from ckplan.sac import KeepLaterRandom

    def keep_first_draw(ctx, op, *args, **kwargs):  # stateless: the first draw is the 32-wide one
        if op is torch.ops.aten.rand_like.default and args[0].shape[-1] == 32:
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    w = torch.randn(32, 48, requires_grad=True)

    def layer(x):
        h = (x * (torch.rand_like(x) > 0.3)) @ w
        return (torch.tanh(h) * (torch.rand_like(h) > 0.5)).sum()

    x = torch.randn(16, 32)

    def grad(policy):
        w.grad = None
        torch.manual_seed(0)
        if policy is None:
            layer(x).backward()
        else:
            ctx = functools.partial(lambda p: create_selective_checkpoint_contexts(p()), policy)
            checkpoint(layer, x, use_reentrant=False, context_fn=ctx).backward()
        return w.grad.clone()

    ref = grad(None)
    assert not torch.allclose(grad(lambda: keep_first_draw), ref)  # the bug this guards against
    assert torch.equal(grad(lambda: KeepLaterRandom(keep_first_draw)), ref)


def test_plan_files_and_the_executor_know_the_same_options():
    from ckplan.options import SELECTIVE_OPTIONS
    from ckplan.sac import OPTIONS
    assert OPTIONS == SELECTIVE_OPTIONS
