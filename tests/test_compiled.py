"""--compile: ckplan's plans around compiled chain layers (ckplan.compiled), their profile and bench.

Oracles: gradients of eager PyTorch without checkpoints (dropout on, same seed); the compiled
peer at a low activation budget against eager; the bench's own predicted-vs-measured peaks.
"""
import pytest
import torch

from ckplan import api
from ckplan.api import profile_model
from ckplan.bench import run_bench
from ckplan.compiled import CompiledLayers, compile_unavailable, compiled_layers
from ckplan.errors import UsageError
from ckplan.execute import apply_plan
from ckplan.planner import chain_from_profile
from ckplan.planner.plan import Plan, items_from_ranges
from ckplan.zoo.gpt import build_gpt

needs_inductor = pytest.mark.skipif(bool(compile_unavailable("cpu")), reason=compile_unavailable("cpu") or "-")


def _grads(model, x, seed=1):
    torch.manual_seed(seed)
    model.zero_grad(set_to_none=True)
    loss = model(x, labels=x)
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _compiled_plans_match_eager(plans):
    """Each (label, plan) applied around the compiled blocks of a 4-layer dropout GPT: loss and
    gradients as the eager model's without checkpoints; returns the model and its CompiledLayers."""
    torch.manual_seed(0)
    model = build_gpt(vocab_size=97, block_size=32, n_layer=4, n_head=2, n_embd=32, dropout=0.1)
    x = torch.randint(0, 97, (2, 16))
    ref_loss, ref = _grads(model, x)
    scale = max(g.abs().max().item() for g in ref.values())
    layers = CompiledLayers(list(model.blocks))
    for label, plan in plans:
        with layers, apply_plan(model, plan, chain="blocks"):
            loss, got = _grads(model, x)
        assert loss == pytest.approx(ref_loss, rel=1e-6), label
        diff = max((got[n] - ref[n]).abs().max().item() for n in ref)
        assert diff <= 1e-5 * scale, (label, diff)
    return model, layers


@needs_inductor
def test_plans_around_compiled_layers_keep_eager_gradients():
    """Compiled layers (dropout 0.1) inside one- and multi-layer checkpoints: the gradients of the
    eager model without checkpoints, and the layers are left as they were."""
    plans = [(ranges, Plan("custom", 4, items_from_ranges(4, ranges), {}))
             for ranges in ([], [(0, 1), (1, 2), (2, 3), (3, 4)], [(0, 3)], [(1, 3)])]
    model, layers = _compiled_plans_match_eager(plans)
    assert layers.graphs >= 1  # it compiled (one graph for the four identical blocks)
    assert all("forward" not in b.__dict__ for b in model.blocks)


@pytest.mark.slow
@needs_inductor
def test_selective_options_on_compiled_layers_keep_eager_gradients():
    """Compiled layers stored with selective options (SAC compiled in), at the top level, inside
    one- and multi-layer checkpoints and next to them: the eager model's gradients without
    checkpoints, dropout on; one graph per option for the four identical blocks."""
    cases = [
        ([], ["sac-compute", "sac-linear", "sac-attn", "store"]),
        ([(0, 1)], ["store", "sac-linear", "sac-linear", "sac-compute"]),
        ([(0, 4), (1, 3)], ["sac-linear", "store", "sac-attn", "sac-compute"]),  # nested, options inside
        ([(0, 2), (2, 4)], ["sac-compute", "sac-compute", "sac-linear", "store"]),
        # torch.compile's own partitioner at a budget per layer (mincut-*), beside SAC and inside
        # one- and multi-layer checkpoints
        ([], ["mincut-50", "mincut-20", "sac-attn", "mincut-80"]),
        ([(0, 4), (1, 3)], ["mincut-20", "mincut-50", "store", "mincut-50"]),
        ([(2, 3)], ["mincut-50", "mincut-20", "store", "mincut-20"]),
    ]
    model, layers = _compiled_plans_match_eager(
        [((ranges, options), Plan("custom", 4, items_from_ranges(4, ranges), {}).with_options(options))
         for ranges, options in cases])
    options = {o for _, opts in cases for o in opts}  # store and six options
    assert layers.graphs <= len(options)  # each compiled once for the four blocks
    assert all("forward" not in b.__dict__ for b in model.blocks)


def test_compiled_layers_install_and_restore_own_forwards():
    model = build_gpt(vocab_size=97, block_size=32, n_layer=2, n_head=2, n_embd=32)
    own = model.blocks[1].forward = lambda *a, **k: type(model.blocks[1]).forward(model.blocks[1], *a, **k)
    layers = CompiledLayers(list(model.blocks))
    with layers:
        assert layers.active and model.blocks[0].forward is not own
        with pytest.raises(RuntimeError):
            layers.__enter__()
    assert not layers.active
    assert "forward" not in model.blocks[0].__dict__ and model.blocks[1].forward is own


def test_compile_is_refused_on_meta(tiny_gpt_spec, tmp_path):
    spec = api.load(tiny_gpt_spec(tmp_path))
    with pytest.raises(UsageError, match="not on meta"):
        api.profile(spec, device="meta", compile=True)
    model = api.build_model(spec, "meta")
    batch = api.make_batch(spec, "meta")
    with pytest.raises(UsageError, match="measured on cpu or cuda"):
        profile_model(model, *batch, name="t", chain="blocks", device="meta", compile=True)


@needs_inductor
@pytest.mark.slow  # about a minute on 2 cores: six options, each compiled
def test_compiled_profile_measures_compiled_options():
    """Options on compiled layers: each keeps what its compiled forward saves. sac-linear keeps
    the linear outputs only, so less than the compiled layer stored whole, and identical blocks
    get identical records; the recompute is within [0, the layer's forward]."""
    torch.manual_seed(0)
    model = build_gpt(vocab_size=97, block_size=64, n_layer=3, n_head=2, n_embd=64, dropout=0.1)
    x = torch.randint(0, 97, (4, 64))
    prof = profile_model(model, (x,), {"labels": x}, name="t", chain="blocks", device="cpu",
                         repeats=1, warmup=0, options=True, compile=True)
    assert prof.compiled
    assert prof.option_names == ("sac-compute", "sac-linear", "sac-attn", "mincut-80", "mincut-50", "mincut-20")
    rows = prof.chain_layers
    for r in rows:
        assert [o.name for o in r.options] == list(prof.option_names)
        lin = r.option("sac-linear")
        assert r.output_bytes <= lin.saved_bytes < r.saved_bytes
        # the partitioner's budget is a share of what the compiled layer saves by default
        most, half, fifth = r.option("mincut-80"), r.option("mincut-50"), r.option("mincut-20")
        assert r.output_bytes <= fifth.saved_bytes < half.saved_bytes <= most.saved_bytes <= r.saved_bytes
        for o in r.options:
            assert 0.0 <= o.recompute_ms <= r.fwd_ms + 1e-9 and o.recompute_flops == 0
    for name in prof.option_names:
        # blocks followed by a block are identical; the last one's output is saved by the final
        # norm (post), and a tensor saved later is counted where it was made, as in the eager pass
        assert len({r.option(name).saved_bytes for r in rows[:-1]}) == 1, name
        extra = rows[-1].option(name).saved_bytes - rows[0].option(name).saved_bytes
        assert extra in (0, rows[-1].output_bytes), (name, extra)
    chain = chain_from_profile(prof)
    assert chain.has_options


@needs_inductor
@pytest.mark.slow  # a compiled profile with one option: 1-2 minutes on 2 cores
def test_compiled_option_pass_makes_the_gradients_in_its_backward():
    """An option's measured pass starts without gradients, as a training step does: at the last
    chain layer's backward, the gradients of every later stage are live in it as in the plain
    pass, so the two peak alike there (on a model whose gradients outweigh its activations; a
    pass that found the warm-up's gradients still there peaked lower by all of them, and a mixed
    plan whose peak fell in an option's backward was predicted short: BERT-large, 19.9 MB)."""
    torch.manual_seed(0)
    model = build_gpt(vocab_size=97, block_size=16, n_layer=3, n_head=2, n_embd=128, dropout=0.0)
    x = torch.randint(0, 97, (1, 16))
    prof = profile_model(model, (x,), {"labels": x}, name="t", chain="blocks", device="cpu", optimizer="sgd",
                         repeats=1, warmup=0, options=["sac-linear"], compile=True)
    rows = prof.chain_layers
    later_grads = sum(r.grad_bytes for r in rows[1:]) + prof.post.grad_bytes
    assert later_grads > 4 * rows[0].saved_bytes
    opt = rows[0].option("sac-linear")
    assert opt.bwd_peak_bytes >= later_grads
    assert abs(rows[0].bwd_peak_bytes - opt.bwd_peak_bytes) < later_grads / 4


def test_compiled_flag_round_trips_and_is_checked(tmp_path):
    """A profile says whether its layers were compiled; older profiles (no key) load as eager."""
    import json

    from ckplan.records import Profile
    model = build_gpt(vocab_size=97, block_size=32, n_layer=2, n_head=2, n_embd=32)
    x = torch.randint(0, 97, (2, 16))
    prof = profile_model(model, (x,), {"labels": x}, name="t", chain="blocks", device="cpu", repeats=1, warmup=0)
    d = json.loads(json.dumps(prof.to_dict()))
    assert d["compiled"] is False and api.profile_problem(d) is None
    d["compiled"] = True
    assert Profile.from_dict(d).compiled is True
    del d["compiled"]
    assert api.profile_problem(d) is None and Profile.from_dict(d).compiled is False
    d["compiled"] = "yes"
    assert "compiled is 'yes'" in api.profile_problem(d)


@needs_inductor
@pytest.mark.slow
def test_bench_compile_rows_predicted_and_exact(tiny_gpt_spec, tmp_path):
    """bench --compile on a dropout GPT: every ckplan row runs compiled, with gradients equal to
    none's, peaks within 5% of the compiled profile's prediction; none compiled is checked
    against eager."""
    spec = api.load(tiny_gpt_spec(tmp_path, n_layer=4, n_embd=64, dropout=0.1), batch_size=4, seq_len=32)
    res = api.bench(spec, strategies=["none", "every-k", "dp", "selective", "sac-policy"], k=1, steps=1,
                    device="cpu", compile=True, options=True)
    assert res.compiled and res.device_tag == "cpu-compiled"
    for r in res.rows:
        assert r.status == "ok", r
        assert r.max_grad_diff <= r.grad_tolerance
        if r.kind == "peer":  # runs eagerly: a prediction from the compiled profile would be wrong
            assert r.predicted_peak_bytes is None and "ran eagerly" in r.message, r
            continue
        assert abs(r.measured_peak_bytes - r.predicted_peak_bytes) <= 0.05 * r.measured_peak_bytes, r
    # What none holds for backward, predicted from the compiled layers' saved bytes: a layer's output
    # saved by the next stage is counted (leaving it out is one output per layer low)
    none = next(r for r in res.rows if r.strategy == "none")
    held, predicted = none.measured_activation_bytes, none.predicted_activation_bytes
    assert abs(held - predicted) <= 0.01 * held
    cross = next(n for n in res.notes if n.startswith("--compile: none with compiled layers against none eager"))
    diff = float(cross.split("max |grad difference| ")[1].split()[0])
    assert diff < 1e-5


@needs_inductor
@pytest.mark.slow
def test_torch_compile_peer_with_dropout_at_a_low_budget(tiny_gpt_spec, tmp_path):
    """At a low activation budget the min-cut partitioner recomputes what it may: random ops are
    kept out of that (ckplan.peers.save_random_ops), so dropout's mask is not drawn again."""
    spec = api.load(tiny_gpt_spec(tmp_path, n_layer=4, n_embd=64, dropout=0.1), batch_size=4, seq_len=32)
    torch.manual_seed(0)
    dev = torch.device("cpu")
    model = api.build_model(spec, "cpu")
    batch = api.make_batch(spec, "cpu")
    prof = profile_model(model, *batch, name="tiny", chain=spec.chain, device=dev, optimizer="sgd")
    chain = chain_from_profile(prof)
    none_peak = prof.totals.predicted_peak_bytes
    low = chain.persistent_bytes + (none_peak - chain.persistent_bytes) // 10  # budget fraction 0.1
    res = run_bench(model, batch, api.to_loss, prof, strategies=["none", "torch-compile"], budget_bytes=low,
                    k=1, steps=1, warmup=1, device=dev, lr=spec.train.lr)
    r = {r.strategy: r for r in res.rows}["torch-compile"]
    assert r.status == "ok", r.message
    assert float(r.plan.split()[-1]) < 0.3
    assert r.max_grad_diff <= r.grad_tolerance


def test_compiled_layers_refused_where_inductor_cannot_run(monkeypatch):
    import ckplan.compiled as compiled
    monkeypatch.setattr(compiled, "compile_unavailable", lambda device_type: "no C++ compiler on PATH")
    model = build_gpt(vocab_size=97, block_size=32, n_layer=2, n_head=2, n_embd=32)
    with pytest.raises(UsageError, match="no C\\+\\+ compiler"):
        compiled_layers(model)


def test_mincut_options_need_compiled_layers(tiny_gpt_spec, tmp_path):
    """mincut-* options are torch.compile's partitioner: refused on eager layers with a message
    that says so, in the API's option list and when a plan with one is applied."""
    from ckplan.errors import SpecError
    assert api.option_names(True) == ("sac-compute", "sac-linear", "sac-attn")
    assert api.option_names(True, compile=True)[-3:] == ("mincut-80", "mincut-50", "mincut-20")
    with pytest.raises(UsageError, match="needs compiled chain layers"):
        api.option_names(["sac-linear", "mincut-50"])
    with pytest.raises(UsageError, match="unknown selective option 'mincut-30'"):
        api.option_names(["mincut-30"], compile=True)
    model = build_gpt(vocab_size=97, block_size=32, n_layer=2, n_head=2, n_embd=32)
    plan = Plan("custom", 2, items_from_ranges(2, []), {}).with_options(["mincut-50", "store"])
    with pytest.raises(SpecError, match="runs only in compiled chain layers"):
        apply_plan(model, plan, chain="blocks")
    assert all("forward" not in b.__dict__ for b in model.blocks)  # nothing was touched


@needs_inductor
@pytest.mark.slow
def test_mincut_options_on_compiled_hf_layers_keep_eager_gradients():
    """A Hugging Face Qwen2 (alternating full / sliding-window attention, attention dropout on) with
    its decoder layers compiled: plans with mincut-* and SAC options, at the top level and inside
    one- and multi-layer checkpoints, give the eager model's loss and gradients without checkpoints."""
    pytest.importorskip("transformers")
    import ckmodels
    model = ckmodels.hf_alternating("qwen2", 4, dropout=0.1)
    ids = torch.randint(0, 101, (2, 16), generator=torch.Generator().manual_seed(3))
    kwargs = {"input_ids": ids, "labels": ids}
    ref_loss, ref = ckmodels.step_with_plan(model, (), kwargs, None)
    scale = max(g.abs().max().item() for g in ref.values())
    layers = CompiledLayers(list(model.model.layers))
    cases = [([], ["mincut-50", "mincut-20", "sac-compute", "store"]),
             ([(1, 3)], ["mincut-20", "mincut-80", "store", "mincut-50"]),
             ([(0, 4), (2, 4)], ["mincut-50", "store", "mincut-20", "sac-linear"])]
    for ranges, options in cases:
        plan = Plan("custom", 4, items_from_ranges(4, ranges), {}).with_options(options)
        with layers:
            loss, got = ckmodels.step_with_plan(model, (), kwargs, plan)
        assert loss == pytest.approx(ref_loss, rel=1e-6), (ranges, options)
        diff = max((got[n] - ref[n]).abs().max().item() for n in ref)
        assert diff <= 1e-5 * scale, (ranges, options, diff)
    assert all("forward" not in layer.__dict__ for layer in model.model.layers)
