"""Applying plans never changes the math; the executor restores the model."""
import gc

import pytest
import torch

from ckplan import api
from ckplan.execute import apply_plan
from ckplan.planner import Plan, chain_from_profile, plan_chain
from ckplan.planner.plan import items_from_ranges
from ckplan.spec import build_model, make_batch


@pytest.mark.parametrize("ranges", [
    [[0, 1], [1, 2], [2, 3], [3, 4]],            # every layer (Hugging Face style)
    [[0, 2], [2, 4]],                            # two segments
    [[0, 3], [0, 1], [1, 3], [2, 3]],             # nested, three levels
    [[1, 4], [2, 4]],                             # nested, layer 0 stored
])
def test_gradients_equal_with_dropout(tiny_gpt_spec, tmp_path, ranges, plan_grads):
    spec = api.load(tiny_gpt_spec(tmp_path, n_layer=4, dropout=0.2))
    model, batch = build_model(spec), make_batch(spec)
    loss0, g0 = plan_grads(model, batch, None)
    plan = Plan("custom", 4, items_from_ranges(4, [tuple(r) for r in ranges]))
    loss1, g1 = plan_grads(model, batch, plan)
    assert loss1 == pytest.approx(loss0, rel=1e-6)
    for n in g0:
        assert torch.allclose(g0[n], g1[n], rtol=1e-5, atol=1e-7), n
    for layer in model.blocks:
        assert "forward" not in layer.__dict__  # restored
    assert set(model.state_dict()) == set(build_model(spec).state_dict())


def test_hf_gpt2_every_strategy_same_gradients(configs, plan_grads):
    pytest.importorskip("transformers")
    from ckplan.spec import validate
    d = api.load(configs / "hf-gpt2.yaml", batch_size=1, seq_len=16).model_dump()
    d["model"]["hf"].update(n_layer=4, n_embd=64, n_head=2)
    spec = validate(d)
    model, batch = build_model(spec), make_batch(spec)
    prof = api.profile_model(model, *batch, name="hf", chain=None, device="cpu", repeats=1, warmup=0)
    chain = chain_from_profile(prof)
    loss0, g0 = plan_grads(model, batch, None)
    for strategy in ("every-k", "sqrtn", "dp"):
        res = plan_chain(chain, strategy, None, 1)
        loss1, g1 = plan_grads(model, batch, res.plan)
        assert loss1 == pytest.approx(loss0, rel=1e-6)
        assert max((g0[n] - g1[n]).abs().max().item() for n in g0) < 1e-5


def test_changed_hidden_state_between_layers_is_refused():
    import torch.nn as nn

    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))

        def forward(self, x):
            for layer in self.layers:
                x = layer(x) * 0.5  # changes the hidden state between layers
            return x

    m = Scaled()
    from ckplan.errors import ModelRunError
    with apply_plan(m, Plan("custom", 3, items_from_ranges(3, [(0, 2)]))):
        with pytest.raises(ModelRunError, match="unchanged"):
            m(torch.randn(2, 4, requires_grad=True))
    with apply_plan(m, Plan("custom", 3, items_from_ranges(3, [(0, 1), (1, 2), (2, 3)]))):
        m(torch.randn(2, 4, requires_grad=True)).sum().backward()  # one-layer checkpoints are fine


def test_a_plan_for_another_chain_is_refused_before_its_layers_are_built(tiny_gpt_spec, tmp_path):
    import json
    import time

    import ckplan
    from ckplan.errors import SpecError
    model = build_model(api.load(tiny_gpt_spec(tmp_path)))
    huge = {"n_layers": 10**12, "checkpoints": [[0, 2]]}
    path = tmp_path / "huge.json"
    path.write_text(json.dumps(huge))
    start = time.perf_counter()
    for plan in (huge, {"plan": huge}, str(path)):
        for apply in (apply_plan, ckplan.apply_plan):
            with pytest.raises(SpecError, match="the plan is for about 10\\^12 layers but the chain has 3"):
                apply(model, plan)
    assert time.perf_counter() - start < 2.0
    assert all("forward" not in layer.__dict__ for layer in model.blocks)


# ---- buffers a forward changes: a recompute leaves them as the first forward left them ----------

class _InstanceNormLayer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.norm = torch.nn.InstanceNorm1d(8, track_running_stats=True)

    def forward(self, x):  # (B, T, 8)
        return self.norm(self.lin(x).transpose(1, 2)).transpose(1, 2)


class _OwnBatchNormLayer(torch.nn.Module):
    """F.batch_norm on its own buffers: the kernel updates them without bumping their version."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.register_buffer("mean", torch.zeros(8))
        self.register_buffer("var", torch.ones(8))

    def forward(self, x):
        y = self.lin(x)
        return torch.nn.functional.batch_norm(y.reshape(-1, 8), self.mean, self.var, training=True,
                                              momentum=0.1).reshape(y.shape)


class _EmaLayer(torch.nn.Module):
    """An exponential moving average and a step counter updated in forward, in place and rebound."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.register_buffer("ema", torch.zeros(8))
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))
        self.register_buffer("seen", torch.zeros(8), persistent=False)

    def forward(self, x):
        y = self.lin(x)
        with torch.no_grad():
            self.ema.mul_(0.9).add_(y.mean((0, 1)), alpha=0.1)
            self.steps += 1
        self.seen = self.seen + y.detach().abs().mean((0, 1))
        return y


class _Stack(torch.nn.Module):
    def __init__(self, make, n=4):
        super().__init__()
        self.layers = torch.nn.ModuleList(make() for _ in range(n))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def _buffer_plans():
    from ckplan.planner.plan import Checkpoint, Store
    per_layer = Plan("per-layer", 4, items_from_ranges(4, [(i, i + 1) for i in range(4)]))
    spanning = Plan("multi-layer", 4, items_from_ranges(4, [(0, 2), (2, 4)]))
    nested = Plan("nested", 4, items_from_ranges(4, [(0, 4), (1, 4), (2, 3)]))
    options = Plan("options", 4, (Checkpoint(0, 3, (Store(0, "sac-compute"), Checkpoint(1, 3, (Store(1), Store(2))))),
                                  Store(3, "sac-linear")))
    return [per_layer, spanning, nested, options]


@pytest.mark.parametrize("make", [_InstanceNormLayer, _OwnBatchNormLayer, _EmaLayer],
                         ids=["instance-norm", "own-batch-norm", "ema"])
def test_buffers_a_forward_changes_end_a_step_as_without_checkpoints(make):
    # Oracle: the same two training steps without checkpoints; every buffer (persistent or not)
    # and every gradient equal bit for bit, for one-layer, multi-layer, nested and option plans.
    import copy
    torch.manual_seed(0)
    model = _Stack(make)
    xs = [torch.randn(2, 5, 8) for _ in range(2)]

    def steps(plan):
        m = copy.deepcopy(model)
        for x in xs:
            m.zero_grad()
            if plan is None:
                m(x).pow(2).mean().backward()
            else:
                with apply_plan(m, plan):
                    m(x).pow(2).mean().backward()
        return dict(m.named_buffers()), {k: p.grad for k, p in m.named_parameters()}

    ref_buffers, ref_grads = steps(None)
    for plan in _buffer_plans():
        buffers, grads = steps(plan)
        for k, v in ref_buffers.items():
            assert torch.equal(buffers[k], v), (plan.strategy, k)
        for k, g in ref_grads.items():
            assert torch.equal(grads[k], g), (plan.strategy, k)


def test_a_buffer_only_the_recompute_changes_is_refused():
    from ckplan.errors import ModelRunError

    class EveryOtherCall(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)
            self.register_buffer("hits", torch.zeros(()))
            self.calls = 0

        def forward(self, x):
            self.calls += 1
            if self.calls % 2 == 0:  # the recompute, not the first forward
                with torch.no_grad():
                    self.hits += 1
            return self.lin(x)

    model = _Stack(EveryOtherCall, n=2)
    with apply_plan(model, Plan("all", 2, items_from_ranges(2, [(0, 2)]))):
        with pytest.raises(ModelRunError, match="changed its buffer hits in place, which its first forward did not"):
            model(torch.randn(2, 3, 8)).sum().backward()


@pytest.mark.parametrize("moved", [False, True])
def test_offloaded_layers_keep_the_gradients(tiny_gpt_spec, tmp_path, plan_grads, monkeypatch, moved):
    """A plan that offloads top-level layers beside a checkpoint: the loss and gradients of no
    checkpointing, the layers restored. On a CPU the hooks keep every tensor where it is; with
    ``moved`` they treat CPU tensors as a GPU's (synchronous copies out, copied back from the next
    layer's backward on), so their packing, prefetch and unpacking run too."""
    import ckplan.execute.offload as offload
    from ckplan.planner.plan import OFFLOAD, Checkpoint, Store
    if moved:
        monkeypatch.setattr(offload, "DEVICE_TYPES", ("cuda", "cpu"))
        seen: list = []
        real_run = offload.PlanOffload.run

        def run(self, i, fn, args, kwargs, *option):
            out = real_run(self, i, fn, args, kwargs, *option)
            seen.append((i, self._hooks[i]))
            return out
        monkeypatch.setattr(offload.PlanOffload, "run", run)
    spec = api.load(tiny_gpt_spec(tmp_path, n_layer=4, dropout=0.2))
    model, batch = build_model(spec), make_batch(spec)
    loss0, g0 = plan_grads(model, batch, None)
    plan = Plan("custom", 4, (Store(0, OFFLOAD), Checkpoint(1, 3, (Store(1), Store(2))), Store(3, OFFLOAD)))
    loss1, g1 = plan_grads(model, batch, plan)
    assert loss1 == pytest.approx(loss0, rel=1e-6)
    for n in g0:
        assert torch.allclose(g0[n], g1[n], rtol=1e-5, atol=1e-7), n
    for layer in model.blocks:
        assert "forward" not in layer.__dict__
    if moved:  # layers 0 and 3 offloaded what they saved (their inputs kept), and it came back:
        hooks = dict(seen)  # layer 0's from the next layer's backward on, the last layer's on demand
        assert sorted(hooks) == [0, 3]
        assert all(h.offloaded_bytes > 0 for h in hooks.values())
        assert hooks[0].prefetched and not hooks[3].prefetched
        # every tensor came back before its use, and no copy back outlives the backward
        assert all(p.uses == 0 and p.back is None for h in hooks.values() for p in h.packed)


@pytest.mark.parametrize("releases, ckpt", [({}, False), ({"0": 2, "1": 3}, False), ({"0": 2}, True)])
def test_offloaded_bytes_stay_on_the_device_until_the_release_point(tiny_gpt_spec, tmp_path, plan_grads,
                                                                    monkeypatch, releases, ckpt):
    """The device bytes of an offloaded layer are held by its hooks until the forward of its
    release point is over (the plan's, by default the next layer's; with ``ckpt`` a layer inside a
    checkpoint), then freed; the gradients stay those of no checkpointing (CPU tensors treated as
    a GPU's)."""
    import ckplan.execute.offload as offload
    from ckplan.planner.plan import OFFLOAD, RELEASE, Checkpoint, Store
    monkeypatch.setattr(offload, "DEVICE_TYPES", ("cuda", "cpu"))
    held_after: list[tuple[int, tuple[int, ...]]] = []
    real_done = offload.PlanOffload.forward_done

    def forward_done(self, k, out):
        real_done(self, k, out)
        held_after.append((k, tuple(sorted(i for i, h in self._hooks.items()
                                           if any(p.held is not None for p in h.packed)))))
    monkeypatch.setattr(offload.PlanOffload, "forward_done", forward_done)
    spec = api.load(tiny_gpt_spec(tmp_path, n_layer=4, dropout=0.0))
    model, batch = build_model(spec), make_batch(spec)
    loss0, g0 = plan_grads(model, batch, None)
    items = ((Store(0, OFFLOAD), Checkpoint(1, 3, (Store(1), Store(2))), Store(3)) if ckpt else
             (Store(0, OFFLOAD), Store(1, OFFLOAD), Store(2), Store(3)))
    loss1, g1 = plan_grads(model, batch, Plan("custom", 4, items, {RELEASE: releases}))
    assert loss1 == pytest.approx(loss0, rel=1e-6)
    assert all(torch.allclose(g0[n], g1[n], rtol=1e-5, atol=1e-7) for n in g0)
    if ckpt:  # 0 -> after F(2), the checkpoint's last layer
        assert held_after == [(0, (0,)), (1, (0,)), (2, ()), (3, ())]
    elif releases:  # 0 -> after F(2), 1 -> after F(3)
        assert held_after == [(0, (0,)), (1, (0, 1)), (2, (1,)), (3, ())]
    else:  # 0 -> after F(1), 1 -> after F(2)
        assert held_after == [(0, (0,)), (1, (1,)), (2, ()), (3, ())]


@pytest.mark.parametrize("fetch", [None, 2, 3])
def test_copies_back_start_at_the_fetch_point(tiny_gpt_spec, tmp_path, plan_grads, monkeypatch, fetch):
    """Layer 0's copy back starts when the gradient of layer ``fetch``'s output arrives (the start
    of its backward; by default layer 1's), before that layer's own backward hooks see it; the
    gradients stay those of no checkpointing (CPU tensors treated as a GPU's)."""
    import ckplan.execute.offload as offload
    from ckplan.planner.plan import FETCH, OFFLOAD, Store
    monkeypatch.setattr(offload, "DEVICE_TYPES", ("cuda", "cpu"))
    events: list = []
    real_prefetch = offload.OffloadHooks.prefetch

    def prefetch(self):
        events.append("prefetch")
        real_prefetch(self)
    monkeypatch.setattr(offload.OffloadHooks, "prefetch", prefetch)
    spec = api.load(tiny_gpt_spec(tmp_path, n_layer=4, dropout=0.0))
    model, batch = build_model(spec), make_batch(spec)
    loss0, g0 = plan_grads(model, batch, None)
    def on_output(k):
        def hook(module, args, out) -> None:  # the start of layer k's backward, seen from its output
            out.register_hook(lambda g: events.append(k))
        return hook
    for k, block in enumerate(model.blocks):
        block.register_forward_hook(on_output(k))
    items = (Store(0, OFFLOAD), Store(1), Store(2), Store(3))
    loss1, g1 = plan_grads(model, batch, Plan("custom", 4, items, {FETCH: {0: fetch}} if fetch else {}))
    assert loss1 == pytest.approx(loss0, rel=1e-6)
    assert all(torch.allclose(g0[n], g1[n], rtol=1e-5, atol=1e-7) for n in g0)
    assert events.count("prefetch") == 1
    assert events.index("prefetch") == events.index(fetch or 1) - 1


@pytest.mark.parametrize("model", ["hf-llama-gqa", "zoo-gpt"])
def test_offloaded_bytes_are_what_the_model_offloads(configs, tiny_gpt_spec, tmp_path, monkeypatch, model,
                                                     plan_grads):
    """What the executor copies to the host for each offloaded layer (each storage once, its
    inputs kept, CPU tensors treated as a GPU's) is the planner's ``Chain.offload_bytes``, to the
    byte: the memory the simulator frees is the memory the hooks free. (A Hugging Face Llama with
    grouped-query attention, whose layers take the rotary pair as a keyword; ckplan's GPT.)"""
    import ckplan.execute.offload as offload
    from ckplan.planner.plan import OFFLOAD, Store
    monkeypatch.setattr(offload, "DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setattr(offload, "MIN_BYTES", 0)
    seen: dict = {}
    real_run = offload.PlanOffload.run

    def run(self, i, fn, args, kwargs, *option):
        out = real_run(self, i, fn, args, kwargs, *option)
        seen[i] = self._hooks[i]
        return out
    monkeypatch.setattr(offload.PlanOffload, "run", run)
    if model == "hf-llama-gqa":
        pytest.importorskip("transformers")
        spec = api.load(configs / "hf-llama-gqa.yaml", batch_size=1, seq_len=16)
    else:
        spec = api.load(tiny_gpt_spec(tmp_path, n_layer=3, dropout=0.1))
    chain = chain_from_profile(api.profile(spec, device="cpu"))
    n = chain.n_layers
    model, batch = build_model(spec), make_batch(spec)
    plan_grads(model, batch, Plan("custom", n, tuple(Store(i, OFFLOAD) for i in range(n))))
    assert sorted(seen) == list(range(n))
    assert [seen[i].offloaded_bytes for i in range(n)] == [chain.offload_bytes(i) for i in range(n)]


def _sac_offload_ok() -> bool:
    from ckplan.sac import OFFLOAD_OPTIONS
    return OFFLOAD_OPTIONS


@pytest.mark.skipif(not _sac_offload_ok(), reason="torch < 2.14: what SAC keeps bypasses saved-tensor hooks")
@pytest.mark.parametrize("model", ["zoo-gpt", "hf-llama-gqa"])
def test_an_option_with_what_it_keeps_offloaded_runs_as_planned(configs, tiny_gpt_spec, tmp_path, monkeypatch,
                                                                plan_grads, model):
    """``sac-compute+offload`` on every layer (CPU tensors treated as a GPU's): the loss and the
    gradients of no checkpointing; each layer's hooks copy out exactly what the planner says
    (``Chain.offload_bytes(i, "sac-compute")``: what the policy keeps, the output aside), and every
    copy came back and was used by the layer's recompute. (ckplan's GPT with dropout; a Hugging
    Face Llama with grouped-query attention, whose layers take the rotary pair as a keyword.)"""
    import ckplan.execute.offload as offload
    from ckplan.planner.plan import Store
    monkeypatch.setattr(offload, "DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setattr(offload, "MIN_BYTES", 0)
    seen: dict = {}
    real_run = offload.PlanOffload.run

    def run(self, i, fn, args, kwargs, option="store"):
        out = real_run(self, i, fn, args, kwargs, option)
        seen[i] = self._hooks[i]
        return out
    monkeypatch.setattr(offload.PlanOffload, "run", run)
    alive: list[tuple[int, int]] = []  # (layer, its copied storages still alive) at its release point
    real_done = offload.PlanOffload.forward_done

    def forward_done(self, k, out):
        real_done(self, k, out)
        gc.collect()
        alive.extend((i, sum(wr() is not None for wr, _ in h._copied.values()))
                     for i, h in self._hooks.items() if self.releases.get(i) == k)
    monkeypatch.setattr(offload.PlanOffload, "forward_done", forward_done)
    if model == "hf-llama-gqa":
        pytest.importorskip("transformers")
        spec = api.load(configs / "hf-llama-gqa.yaml", batch_size=1, seq_len=16)
    else:
        spec = api.load(tiny_gpt_spec(tmp_path, n_layer=3, dropout=0.1))
    chain = chain_from_profile(api.profile(spec, device="cpu", options=["sac-compute"]), keep=("sac-compute",))
    n = chain.n_layers
    model, batch = build_model(spec), make_batch(spec)
    loss0, g0 = plan_grads(model, batch, None)
    plan = Plan("custom", n, tuple(Store(i, "sac-compute+offload") for i in range(n)))
    loss1, g1 = plan_grads(model, batch, plan)
    assert loss1 == pytest.approx(loss0, rel=1e-6)
    for name in g0:
        assert torch.allclose(g0[name], g1[name], rtol=1e-5, atol=1e-7), name
    assert sorted(seen) == list(range(n))
    assert [seen[i].offloaded_bytes for i in range(n)] == [chain.offload_bytes(i, "sac-compute") for i in range(n)]
    assert all(0 < chain.offload_bytes(i, "sac-compute") < chain.offload_bytes(i) for i in range(n))
    # at each release point the device tensors SAC kept are gone: its cache holds only the host copies
    assert alive == [(i, 0) for i in range(n)]
    # nothing copied back outlives its layer's backward (a Llama's SAC cache holds entries past
    # where its recompute stops: never read, their copies are dropped when the layer's backward ends)
    assert all(p.back is None and p.host is None for h in seen.values() for p in h.packed)


@pytest.mark.skipif(_sac_offload_ok(), reason="this torch routes what SAC keeps through saved-tensor hooks")
def test_an_option_with_what_it_keeps_offloaded_is_refused_on_an_older_torch():
    from ckplan.errors import SpecError
    from ckplan.planner.plan import Store
    model = _Stack(lambda: torch.nn.Linear(4, 4), n=2)
    plan = Plan("custom", 2, (Store(0, "sac-compute+offload"), Store(1)))
    with pytest.raises(SpecError, match=r"torch 2\.14") as e:
        with apply_plan(model, plan):
            pass
    assert "re-plan" in e.value.tip
    assert "forward" not in model.layers[0].__dict__
