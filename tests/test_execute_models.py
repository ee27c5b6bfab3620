"""Plans never change the math on models that pass different arguments to each layer.

Oracle: the loss and every parameter gradient with a plan applied equal those without one
(fp32, rtol 1e-5), for every strategy, hand-built nested plans, and dropout (same RNG).
Models: Hugging Face Qwen2 / Gemma2 / Gemma3 with alternating full and sliding-window attention
(each layer gets its own mask, Gemma3 its own rotary embeddings), and ``target:`` models of
tests/ckmodels.py whose layers get a per-layer float and tensor keyword.
"""
import contextlib
import copy
import io
import textwrap
from collections import UserDict

import ckmodels
import pytest
import torch

from ckplan import api
from ckplan.errors import ModelRunError
from ckplan.execute import apply_plan, remove_plan
from ckplan.measure import LiveTensorTracker
from ckplan.planner import Plan, chain_from_profile, min_peak, plan_chain, simulate, trace
from ckplan.planner.plan import Checkpoint, items_from_ranges

NESTED = {  # hand-built plans with inner checkpoints (ranges, outermost first)
    4: [[[0, 4], [1, 3]], [[0, 3], [0, 1], [1, 3], [2, 3]], [[1, 4], [2, 4]], [[0, 4], [0, 2], [2, 4]]],
    6: [[[0, 6], [1, 5], [2, 4]], [[0, 3], [0, 2], [3, 6], [4, 6]], [[1, 6], [1, 3], [3, 6], [3, 5]]],
}


def _step(model, args, kwargs, plan):
    """Loss and gradients of one step, with ``plan`` applied (None: no plan)."""
    return ckmodels.step_with_plan(model, args, kwargs, plan)


def _plans(model, args, kwargs, n):
    """Every strategy (k=2, 3; chen and dp at a budget halfway down and at the floor) and the nested plans."""
    prof = api.profile_model(model, args, kwargs, name="t", chain=None, device="cpu", optimizer="sgd",
                             repeats=1, warmup=0)
    chain = chain_from_profile(prof)
    none_peak = plan_chain(chain, "none").score.peak_bytes
    mid = (none_peak + min_peak(chain)) // 2
    plans = [plan_chain(chain, "none").plan, plan_chain(chain, "every-k", k=2).plan,
             plan_chain(chain, "every-k", k=3).plan, plan_chain(chain, "sqrtn").plan,
             plan_chain(chain, "chen", mid).plan, plan_chain(chain, "dp", mid).plan,
             plan_chain(chain, "dp", min_peak(chain)).plan]
    plans += [Plan("custom", n, items_from_ranges(n, [tuple(r) for r in rs])) for rs in NESTED[n]]
    return list({p.describe(): p for p in plans}.values())  # each distinct plan once


def _assert_same_math(model, args, kwargs, n):
    loss0, g0 = _step(model, args, kwargs, None)
    multi = 0
    for plan in _plans(model, args, kwargs, n):
        loss1, g1 = _step(model, args, kwargs, plan)
        assert loss1 == pytest.approx(loss0, rel=1e-6), plan.describe()
        assert g1.keys() == g0.keys()
        for name in g0:
            assert torch.allclose(g1[name], g0[name], rtol=1e-5, atol=1e-6), (plan.describe(), name)
        multi += any(isinstance(it, Checkpoint) and it.stop - it.start > 1 for it, _ in plan.walk())
    assert multi >= 5  # the interesting plans were there
    return loss0


def _lm_batch(seq=32, batch=2):
    ids = torch.randint(0, 101, (batch, seq), generator=torch.Generator().manual_seed(1))
    return (), {"input_ids": ids, "labels": ids}


@pytest.mark.parametrize("model_type,n,dropout", [
    ("qwen2", 4, 0.0), ("gemma3_text", 4, 0.1),
    pytest.param("qwen2", 6, 0.1, marks=pytest.mark.slow),
    pytest.param("gemma2", 4, 0.0, marks=pytest.mark.slow)])
def test_hf_alternating_attention_every_plan_same_gradients(model_type, n, dropout):
    pytest.importorskip("transformers")
    model = ckmodels.hf_alternating(model_type, n, dropout=dropout)
    args, kwargs = _lm_batch()
    loss0 = _assert_same_math(model, args, kwargs, n)
    # The oracle can fail: the same weights with every layer on full attention give another loss.
    twin = ckmodels.hf_alternating(model_type, n, dropout=dropout, full=True)
    assert abs(_step(twin, args, kwargs, None)[0] - loss0) > 1e-4


@pytest.mark.parametrize("dropout,probe", [(0.0, False), (0.3, False), (0.3, True)])
def test_target_model_with_per_layer_keywords(write_spec, tmp_path, dropout, probe):
    spec = api.load(write_spec(tmp_path, textwrap.dedent(f"""
        model:
          target: ckmodels:ScaledChain
          args: {{d: 32, n_layers: 6, dropout: {dropout}, probe: {str(probe).lower()}}}
        input: {{batch_size: 4, shape: [32], dtype: float32}}
        chain: layers
    """)))
    from ckplan.spec import build_model, make_batch
    model = build_model(spec)
    args, kwargs = make_batch(spec)
    _assert_same_math(model, args, kwargs, 6)


def test_two_tensors_carried_between_layers():
    torch.manual_seed(0)
    model = ckmodels.TwoStream(n_layers=4)
    x = torch.randn(3, 16)
    _assert_same_math(model, (x,), {}, 4)


def test_multi_layer_segment_keeps_only_input_and_output():
    """Bytes live after the forward: exactly the simulator's, and what each segment drops is
    the sum of what its layers would store minus the boundary it keeps."""
    torch.manual_seed(0)
    model = ckmodels.ScaledChain(d=64, n_layers=6)
    x = torch.randn(8, 64)
    prof = api.profile_model(model, (x,), {}, name="t", chain="layers", device="cpu", optimizer="sgd",
                             repeats=1, warmup=0)
    chain = chain_from_profile(prof)

    def live_after_forward(plan):
        with apply_plan(model, plan), LiveTensorTracker() as tr:
            loss = model(x)
            live = tr.live  # the loss included (Post.loss_bytes)
            loss.backward()
        model.zero_grad(set_to_none=True)
        return live, loss.item()

    def predicted(plan):
        post = next(e for e in trace(chain, plan) if e.op == "F" and e.stage == chain.n_layers)
        return post.mem_bytes - chain.persistent_bytes

    none = plan_chain(chain, "none").plan
    base, loss0 = live_after_forward(none)
    assert base == predicted(none)
    for plan in (plan_chain(chain, "every-k", k=2).plan, plan_chain(chain, "every-k", k=3).plan,
                 Plan("custom", 6, items_from_ranges(6, [(0, 6), (1, 5), (2, 4)]))):
        dropped = sum(sum(chain.layers[k].xbar_bytes for k in range(it.start, it.stop))
                      - chain.layers[it.stop - 1].x_bytes for it in plan.items if isinstance(it, Checkpoint))
        live, loss = live_after_forward(plan)
        assert loss == pytest.approx(loss0, rel=1e-6), plan.describe()  # and the math is right
        assert live == predicted(plan), plan.describe()
        assert live == base - dropped, plan.describe()


def test_changed_hidden_state_in_place_is_refused():
    import torch.nn as nn

    class InPlace(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
                x.mul_(0.5)  # same tensor object, changed between two layers
            return x

    m = InPlace()
    with apply_plan(m, Plan("custom", 3, items_from_ranges(3, [(0, 3)]))):
        with pytest.raises(ModelRunError, match="unchanged"):
            m(torch.randn(2, 4))


class _ChangesInput(torch.nn.Module):
    """A layer that changes its own argument in place before using it."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x):
        x.mul_(0.5)
        return x + torch.tanh(self.fc(x))


class _ChangesInputNet(torch.nn.Module):
    def __init__(self, n: int = 4):
        super().__init__()
        self.layers = torch.nn.ModuleList(_ChangesInput() for _ in range(n))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x.pow(2).sum()


@pytest.mark.parametrize("ranges", [[(0, 1)], [(1, 3)], [(0, 4), (2, 3)]])
def test_a_checkpoint_starting_at_a_layer_that_changes_its_input_is_refused(ranges):
    """Its recompute would start from the changed input: silently wrong gradients where the
    input needs none (layer 0, the batch), PyTorch's version error in the backward elsewhere.
    The first forward stops with the reason instead."""
    from ckplan.errors import PlanRunError
    torch.manual_seed(0)
    m = _ChangesInputNet()
    with apply_plan(m, Plan("custom", 4, items_from_ranges(4, ranges))):
        with pytest.raises(PlanRunError, match="changes its input in place"):
            m(torch.randn(3, 8))
    # the model runs as before once the plan is gone, and a plan can be applied again
    assert torch.isfinite(m(torch.randn(3, 8)))


def test_layers_that_change_their_input_inside_a_checkpoint_keep_the_gradients():
    """Inside a checkpoint (not at its start) such a layer's input is made by the checkpoint and
    made again by its recompute: gradients equal the plain model's."""
    torch.manual_seed(0)
    m, x = _ChangesInputNet(), torch.randn(3, 8, requires_grad=True)
    m.layers[0] = torch.nn.Linear(8, 8)  # the checkpoints start here; layers 1-3 change their input
    plain = torch.autograd.grad(m(x), list(m.parameters()))
    for ranges in ([(0, 4)], [(0, 4), (0, 2)], [(0, 2)]):
        with apply_plan(m, Plan("custom", 4, items_from_ranges(4, ranges))):
            got = torch.autograd.grad(m(x), list(m.parameters()))
        for a, b in zip(plain, got):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("strategy", ["every-k", "sqrtn", "dp"])
def test_plans_from_a_profile_give_those_layers_a_copy(strategy):
    """A plan made from the profile names them (``params["copy_inputs"]``): where a checkpoint
    starts at one, ``apply_plan`` gives it a copy of the hidden state, the gradients equal the
    plain model's, and the simulator counts the copy (the measured peak at or just below it)."""
    torch.manual_seed(0)
    m = _ChangesInputNet(6)
    x = torch.randn(16, 8)
    prof = api.profile_model(m, (x.clone(),), {}, name="t", chain="layers", device="cpu", optimizer="sgd",
                             repeats=1, warmup=0, loss_fn=lambda out: out)
    chain = chain_from_profile(prof)
    assert all(ly.copies_input and not ly.in_place for ly in chain.layers)
    none = plan_chain(chain, "none").plan
    plan = plan_chain(chain, strategy, simulate(chain, none).peak_bytes - 1, k=2).plan
    assert plan.params["copy_inputs"] == list(range(6)) and plan.n_checkpoints

    def run(p):
        with apply_plan(m, p), LiveTensorTracker() as tr:
            m(x.clone()).backward()
        grads = [q.grad.clone() for q in m.parameters()]
        m.zero_grad(set_to_none=True)
        return tr.peak, grads

    (peak0, grads0), (peak, grads) = run(none), run(plan)
    for a, b in zip(grads0, grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    predicted = simulate(chain, plan).peak_bytes - simulate(chain, none).peak_bytes
    assert predicted - 16 * 8 * 4 <= peak - peak0 <= predicted, plan.describe()


def test_the_profile_names_the_layers_that_change_their_input():
    m = _ChangesInputNet(3)
    prof = api.profile_model(m, (torch.randn(2, 8),), {}, name="t", chain="layers", device="cpu",
                             optimizer="sgd", repeats=1, warmup=0, loss_fn=lambda out: out)
    note = next(n for n in prof.notes if n.startswith("layers that change their input in place"))
    assert note.endswith("layers 0, 1, 2")
    plain = _ChangesInputNet(3)
    plain.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(3))
    prof = api.profile_model(plain, (torch.randn(2, 8),), {}, name="t", chain="layers", device="cpu",
                             optimizer="sgd", repeats=1, warmup=0, loss_fn=lambda out: out)
    assert not any("change their input" in n for n in prof.notes)


def test_thread_local_segments():
    """Two threads running the same planned model at once each get the right gradients."""
    import threading
    torch.manual_seed(0)
    model = ckmodels.ScaledChain(d=16, n_layers=4)
    xs = [torch.randn(4, 16) for _ in range(2)]
    ref = [torch.autograd.grad(model(x), list(model.parameters())) for x in xs]
    got = [None, None]
    plan = Plan("custom", 4, items_from_ranges(4, [(0, 4), (1, 3)]))
    with apply_plan(model, plan):
        def work(i):
            for _ in range(5):
                got[i] = torch.autograd.grad(model(xs[i]), list(model.parameters()))
        ts = [threading.Thread(target=work, args=(i,)) for i in range(2)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
    for r, g in zip(ref, got):
        assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(r, g))


# ---- copies and checkpoints of a model with a plan applied ---------------
def _planned_model():
    torch.manual_seed(0)
    model = ckmodels.ScaledChain(d=16, n_layers=4, dropout=0.2)
    apply_plan(model, Plan("custom", 4, items_from_ranges(4, [(0, 4), (1, 3)])))
    return model


def test_deepcopy_runs_its_own_layers():
    model = _planned_model()
    x = torch.randn(4, 16)
    twin = copy.deepcopy(model)
    assert twin._ckplan_executor is not model._ckplan_executor
    assert twin._ckplan_executor.layers[0] is twin.layers[0]
    torch.manual_seed(1)
    before = model(x).item()
    with torch.no_grad():
        twin.layers[2].down.weight.mul_(3.0)  # change the copy only
    torch.manual_seed(1)
    assert model(x).item() == before
    torch.manual_seed(1)
    assert twin(x).item() != before
    with torch.no_grad():  # and the other way round
        model.layers[1].up.bias.add_(1.0)
    torch.manual_seed(1)
    twin_out = twin(x).item()
    remove_plan(twin)
    torch.manual_seed(1)
    assert twin(x).item() == pytest.approx(twin_out, rel=1e-6)  # plain twin: same value


def test_deepcopy_gradients_are_right():
    model = _planned_model()
    x = torch.randn(4, 16)
    twin = copy.deepcopy(model)
    torch.manual_seed(2)
    twin(x).backward()
    assert all(p.grad is None for p in model.parameters())  # nothing leaked into the original
    got = {n: p.grad.clone() for n, p in twin.named_parameters()}
    plain = copy.deepcopy(twin)
    remove_plan(plain)
    plain.zero_grad(set_to_none=True)
    torch.manual_seed(2)
    plain(x).backward()
    for n, p in plain.named_parameters():
        assert torch.allclose(got[n], p.grad, rtol=1e-5, atol=1e-6), n
    assert "forward" not in plain.layers[0].__dict__


def test_torch_save_load_round_trip_keeps_the_plan():
    model = _planned_model()
    keys = list(model.state_dict())
    remove_plan(model)
    assert list(model.state_dict()) == keys  # a plan adds and removes no state_dict key
    apply_plan(model, Plan("custom", 4, items_from_ranges(4, [(0, 4), (1, 3)])))
    x = torch.randn(4, 16)
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert list(loaded.state_dict()) == keys
    ex = loaded._ckplan_executor
    assert ex.model is loaded and ex.layers[3] is loaded.layers[3] and ex.plan == model._ckplan_executor.plan
    torch.manual_seed(3)
    a = model(x)
    a.backward()
    torch.manual_seed(3)
    b = loaded(x)
    b.backward()
    assert a.item() == b.item()
    for (n, p), q in zip(model.named_parameters(), loaded.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-6), n
    remove_plan(loaded)
    assert "forward" not in loaded.layers[0].__dict__


def test_autocast_state_per_layer_and_second_backward():
    """bf16 autocast (turned off for one layer by the model) and backward twice on one graph."""
    torch.manual_seed(0)
    model = ckmodels.MixedPrecisionChain(d=32, n_layers=4, dropout=0.2)
    x = torch.randn(4, 32)

    def grads(plan):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(5)
        ex = apply_plan(model, plan) if plan else None
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(x)
        loss.backward(retain_graph=True)
        loss.backward()  # recomputes again: same RNG, same autocast state, gradients doubled
        if ex:
            ex.remove()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    g0 = grads(None)
    for ranges in ([(0, 2), (2, 4)], [(0, 4), (1, 3)], [(0, 3), (0, 1), (1, 3)]):
        g1 = grads(Plan("custom", 4, items_from_ranges(4, ranges)))
        for n in g0:
            assert torch.allclose(g1[n], g0[n], rtol=1e-5, atol=1e-6), (ranges, n)


def test_no_grad_forward_runs_plain_and_fallback_is_correct(monkeypatch):
    import ckplan.execute.executor as executor
    torch.manual_seed(0)
    model = ckmodels.ScaledChain(d=16, n_layers=4)
    x = torch.randn(4, 16)
    plan = Plan("custom", 4, items_from_ranges(4, [(0, 4), (1, 3)]))
    ref = model(x)
    with apply_plan(model, plan), torch.no_grad():
        assert model(x).item() == ref.item()
    _, g0 = _step(model, (x,), {}, None)
    # Without torch's checkpoint frames: warn, checkpoint each layer alone, same gradients.
    monkeypatch.setattr(executor, "_CAN_SPAN", False)
    with pytest.warns(RuntimeWarning, match="each layer"):
        ex = apply_plan(model, plan)
    ex.remove()
    with pytest.warns(RuntimeWarning):
        _, g1 = _step(model, (x,), {}, plan)
    for n in g0:
        assert torch.allclose(g1[n], g0[n], rtol=1e-5, atol=1e-6), n


def test_hf_kv_cache_is_refused_with_the_fix():
    """With use_cache on, the recompute would append to the cache a second time (today: a size
    mismatch deep in attention); ckplan says what to change before anything runs."""
    pytest.importorskip("transformers")
    model = ckmodels.hf_alternating("qwen2", 4)
    model.config.use_cache = True
    args, kwargs = _lm_batch()
    with apply_plan(model, Plan("custom", 4, items_from_ranges(4, [(0, 2), (2, 4)]))):
        with pytest.raises(ModelRunError, match="use_cache: false"):
            model(*args, **kwargs)
    model(*args, **kwargs).loss.backward()  # without a plan the cache is harmless


def test_batchnorm_running_stats_as_without_checkpoints():
    # BatchNorm updates its running statistics on every training forward, so under plain
    # torch.utils.checkpoint a recomputed layer updates them twice and the model's buffers drift
    # from training without checkpoints. Oracle: the state dict after one step (running mean,
    # var, num_batches_tracked), bit for bit, and the gradients, for flat, nested and
    # selective-option plans on the zoo ResNet (a BatchNorm in every block).
    from ckplan.planner.plan import Store
    from ckplan.zoo.resnet import ResNet, ResNetConfig
    torch.manual_seed(0)
    model = ResNet(ResNetConfig(layers=[1, 1, 1, 1], widths=[8, 16, 32, 64], num_classes=10)).train()
    x = torch.randn(4, 3, 32, 32)
    n = len(model.blocks)

    def step(plan):
        m = copy.deepcopy(model)
        with apply_plan(m, plan):
            m(x).pow(2).mean().backward()
        return m.state_dict(), {k: p.grad for k, p in m.named_parameters()}

    ref_state, ref_grads = step(Plan("none", n, items_from_ranges(n, [])))
    nested = Checkpoint(0, n, (Store(0), Checkpoint(1, 3, (Store(1), Store(2))), Store(3, "sac-compute")))
    plans = [Plan("c", n, items_from_ranges(n, r)) for r in ([(0, n)], [(i, i + 1) for i in range(n)])]
    plans += [Plan("nested", n, (nested,)),
              Plan("option", n, (Checkpoint(0, 2, (Store(0, "sac-attn"), Store(1))), Store(2, "sac-compute"),
                                 Store(3)))]
    for plan in plans:
        state, grads = step(plan)
        assert all(torch.equal(state[k], v) for k, v in ref_state.items()), plan.describe()
        assert all(torch.equal(grads[k], g) for k, g in ref_grads.items()), plan.describe()


class _SharedKV(UserDict):
    """A container the layers write into and read from (Gemma 4's ``shared_kv_states``, a UserDict
    so that pytree leaves it whole)."""


class _KVBlock(torch.nn.Module):
    """Stores its key in ``shared`` ("store"), reads an earlier layer's ("reuse"), or neither. The
    key comes through a wider hidden layer, so a key kept with its graph keeps 4x its size more."""

    def __init__(self, mode: str | None, d: int = 16, w: int = 64):
        super().__init__()
        self.mode, self.q = mode, torch.nn.Linear(d, d)
        self.k1, self.k2 = torch.nn.Linear(d, w), torch.nn.Linear(w, d)

    def forward(self, x, shared):
        k = shared["k"] if self.mode == "reuse" else self.k2(torch.tanh(self.k1(x)))
        if self.mode == "store":
            shared["k"] = k
        return x + torch.tanh(self.q(x) * k)


class _KVNet(torch.nn.Module):
    def __init__(self, modes):
        super().__init__()
        self.layers = torch.nn.ModuleList(_KVBlock(m) for m in modes)

    def forward(self, x):
        shared = _SharedKV()
        for layer in self.layers:
            x = layer(x, shared=shared)
        return x.pow(2).mean()


_KV_MODES = [None, "store", None, "store", "reuse", "reuse"]


@pytest.mark.parametrize("ranges", [[(0, 2), (2, 4), (4, 6)], [(0, 6)], [(1, 5)], [(3, 6), (4, 5)]])
def test_a_container_the_layers_write_into_keeps_gradients_and_the_predicted_peak(ranges):
    """The record of a checkpointed call keeps the container's contents at the call, and each
    recompute writes into a copy: gradients equal the plain model's (reuse layers recompute from
    what they read the first time), and the step's peak moves as the simulator says it does (the
    recompute's keys, graph and all, are not kept by the model's container to the end). With the
    record holding the model's container, three of these plans measured 15-29 KB above the
    prediction, past the bound."""
    torch.manual_seed(0)
    model, x = _KVNet(_KV_MODES), torch.randn(32, 16)
    prof = api.profile_model(model, (x,), {}, name="kv", chain="layers", device="cpu", optimizer="sgd",
                             repeats=1, warmup=0, loss_fn=lambda out: out)
    chain = chain_from_profile(prof)

    def measured(plan):
        with apply_plan(model, plan) if plan is not None else contextlib.nullcontext():
            with LiveTensorTracker() as tr:
                model(x).backward()
        grads = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        return tr.peak, grads

    plan = Plan("custom", 6, items_from_ranges(6, ranges))
    peak0, grads0 = measured(None)
    peak, grads = measured(plan)
    for a, b in zip(grads0, grads):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    predicted = simulate(chain, plan).peak_bytes - simulate(chain, plan_chain(chain, "none").plan).peak_bytes
    # what the records keep of the first forward: the stored keys (2 x 32 x 16 fp32), which the
    # memory model does not count (the profile says so in a note)
    kept = 2 * 32 * 16 * 4
    assert predicted <= peak - peak0 <= predicted + kept, plan.describe()
    assert any(n.startswith("layers that write tensors into a container") and n.endswith("layers 1, 3")
               for n in prof.notes), prof.notes


def test_gemma4_checkpointed_peak_moves_as_predicted(write_spec, tmp_path):
    """Gemma 4's layers write keys and values into ``shared_kv_states``: with the record holding the
    model's container, every-k measured 35% above its prediction; with a copy it is exact."""
    transformers = pytest.importorskip("transformers")
    if "gemma4_text" not in transformers.CONFIG_MAPPING:
        pytest.skip(f"transformers {transformers.__version__} has no Gemma 4")
    spec = api.load(write_spec(tmp_path, """
model:
  hf: {model_type: gemma4_text, hidden_size: 64, intermediate_size: 128, num_hidden_layers: 4,
       num_attention_heads: 4, num_key_value_heads: 2, vocab_size: 512, max_position_embeddings: 128,
       use_cache: false, head_dim: 16, per_layer_config: {"3": {head_dim: 32}}, sliding_window: 32,
       vocab_size_per_layer_input: 512, hidden_size_per_layer_input: 16,
       layer_types: [sliding_attention, sliding_attention, sliding_attention, full_attention]}
  task: causal-lm
input: {batch_size: 2, shape: [64], dtype: int64, high: 512, name: input_ids, labels: copy}
train: {optimizer: sgd, precision: fp32}
"""))
    from ckplan.spec import build_model, make_batch
    torch.manual_seed(0)
    model = build_model(spec, "cpu")
    args, kwargs = make_batch(spec, "cpu")
    prof = api.profile_model(model, args, kwargs, name="g4", chain=spec.chain, device="cpu", optimizer="sgd",
                             repeats=1, warmup=0, options=())
    assert any(n.startswith("layers that write tensors into a container") for n in prof.notes)
    chain = chain_from_profile(prof)

    def peak(plan):
        with apply_plan(model, plan, chain=prof.chain), LiveTensorTracker() as tr:
            model(*args, **kwargs).loss.backward()
        model.zero_grad(set_to_none=True)
        return tr.peak

    none, plan = plan_chain(chain, "none").plan, plan_chain(chain, "every-k", k=2).plan
    assert peak(plan) - peak(none) == simulate(chain, plan).peak_bytes - simulate(chain, none).peak_bytes


@pytest.mark.parametrize("chain", [None, "model.decoder.layers"])
def test_hf_whisper_speech_seq2seq_is_predicted_to_the_byte(write_spec, tmp_path, chain):
    """Whisper (``task: speech-seq2seq``): float features in, the labels shifted into the decoder's
    inputs; the encoder's layers are the detected chain and the decoder's can be named. Every plan's
    measured peak is its prediction, and its gradients are none's."""
    pytest.importorskip("transformers")
    spec = api.load(write_spec(tmp_path, f"""
model:
  hf: {{model_type: whisper, d_model: 64, encoder_layers: 4, decoder_layers: 4, encoder_attention_heads: 4,
       decoder_attention_heads: 4, encoder_ffn_dim: 128, decoder_ffn_dim: 128, num_mel_bins: 16,
       max_source_positions: 25, max_target_positions: 64, vocab_size: 512, decoder_start_token_id: 1,
       pad_token_id: 0, eos_token_id: 2, bos_token_id: 1, use_cache: false}}
  task: speech-seq2seq
input: {{batch_size: 2, shape: [16, 50], dtype: float32, name: input_features,
        labels: {{shape: [48], dtype: int64, high: 512}}}}
{'' if chain is None else f'chain: {chain}'}
train: {{optimizer: sgd, precision: fp32}}
"""))
    assert api.profile(spec, device="meta").chain == (chain or "model.encoder.layers")
    res = api.bench(spec, strategies=["none", "every-k", "dp"], k=2, device="cpu", steps=1, warmup=0)
    rows = {r.strategy: r for r in res.rows}
    for name, row in rows.items():
        assert row.status == "ok", row.message
        assert row.measured_peak_bytes == row.predicted_peak_bytes, name
        assert row.max_grad_diff == 0.0, name
    assert rows["every-k"].measured_peak_bytes < rows["none"].measured_peak_bytes
