"""Exported snippets apply the plan they claim: exact plans exactly, others the documented closest.

Oracles: the fsdp/lightning snippets and the hf snippet run on real models, and the layers that
run forward twice (hooks) are the planned ones, with loss and gradients equal to the plain model;
torchtitan's config is parsed as TOML and read with torchtitan's own counting rule (v0.2.2
``_apply_layer_sac``, restated here); the closest plans are checked by brute force over the
expressible ones.
"""
import copy
import random

import pytest
import torch

from ckplan.errors import UsageError
from ckplan.export import TARGETS, export_plan, per_layer_plan
from ckplan.planner import Plan, plan_chain, plan_every_k, plan_none
from ckplan.planner.plan import items_from_ranges
from ckplan.planner.synthetic import uniform_chain
from ckplan.zoo.gpt import build_gpt


def _recomputed(plan: Plan) -> set[int]:
    return {d.layer for d in plan.per_layer() if d.depth > 0}


def _is_per_layer(plan: Plan) -> bool:
    return all(r.stop - r.start == 1 for r in plan.recomputed_ranges())


def _titan_layers(n_layers: int, mode: str, option: str | None) -> set[int]:
    """Which blocks torchtitan v0.2.2 wraps (activation_checkpoint.py, _apply_layer_sac)."""
    if mode == "none":
        return set()
    if mode == "full":
        return set(range(n_layers))
    out = set()
    for count, i in enumerate(range(n_layers), start=1):  # layers.named_children(), counted from 1
        freq = int(option)
        if not freq or count % freq == 0:
            out.add(i)
    return out


def _random_plan(rng: random.Random, n: int) -> Plan:
    ranges: list[tuple[int, int]] = []

    def fill(s: int, t: int, depth: int, inner: bool) -> None:
        pos = s
        while pos < t:
            length = rng.randint(1, t - pos)
            whole = inner and pos == s and length == t - s
            if not whole and rng.random() < 0.5:
                ranges.append((pos, pos + length))
                if length > 1 and depth < 3 and rng.random() < 0.5:
                    fill(pos, pos + length, depth + 1, True)
            pos += length

    fill(0, n, 0, False)
    return Plan("custom", n, items_from_ranges(n, ranges))


def _dp_plans() -> list[Plan]:
    chain = uniform_chain(12, x_bytes=100, xbar_bytes=300)
    return [plan_chain(chain, "dp", b).plan for b in (700, 900, 1100, 1800, 3000)]


NESTED_DP = _dp_plans()[0]  # C[0,7){C[0,3){...} C[3,6){...} S6} C[7,11){...} S11


def test_the_nested_dp_plan_is_nested():
    assert max(r.depth for r in NESTED_DP.recomputed_ranges()) >= 3


# ---- exactness --------------------------------------------------------------------------
@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("plan", [plan_none(6), plan_every_k(6, 1)], ids=["none", "every-layer"])
def test_none_and_every_layer_are_exact_everywhere(target, plan):
    e = export_plan(plan, target, chain_path="layers")
    assert e.exact and e.closest_plan is plan
    assert "apply_plan" in e.message


@pytest.mark.parametrize("target", ["fsdp", "lightning", "hf"])
@pytest.mark.parametrize("layers", [(0, 2, 5), (3,), (1, 2), (0, 1, 2, 3, 4)])
def test_any_single_layer_set_is_exact_for_module_wrappers(target, layers):
    plan = per_layer_plan(6, layers)
    e = export_plan(plan, target, chain_path="blocks")
    assert e.exact and e.closest_plan == plan
    assert f"in {tuple(layers)!r}" in e.text


@pytest.mark.parametrize("n", [2, 3, 5])
def test_torchtitan_every_n_is_exact_and_other_sets_are_not(n):
    titan = sorted(_titan_layers(12, "selective", str(n)))
    e = export_plan(per_layer_plan(12, titan), "torchtitan", chain_path="layers")
    assert e.exact and f'selective_ac_option = "{n}"' in e.text
    hf_style = per_layer_plan(12, list(range(0, 12, n)))  # 0, n, 2n: transformers' phase, not torchtitan's
    assert not export_plan(hf_style, "torchtitan", chain_path="layers").exact


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("plan", [plan_every_k(6, 2), NESTED_DP], ids=["every-2", "nested-dp"])
def test_multi_layer_and_nested_plans_are_not_exact(target, plan):
    e = export_plan(plan, target, chain_path="layers")
    assert not e.exact and e.closest_plan != plan
    assert _is_per_layer(e.closest_plan)
    again = export_plan(e.closest_plan, target, chain_path="layers")
    assert again.exact and again.closest_plan == e.closest_plan  # the closest is expressible
    assert "apply_plan" in e.message and "closest" in e.message.lower()


# ---- the closest plan, by brute force over what each target can express ------------------
def _plans_to_check() -> list[Plan]:
    rng = random.Random(0)
    return _dp_plans() + [_random_plan(rng, rng.randint(1, 9)) for _ in range(300)]


@pytest.mark.parametrize("target", ["fsdp", "lightning", "hf"])
def test_module_wrappers_checkpoint_the_recomputed_layers_one_by_one(target):
    for plan in _plans_to_check():
        e = export_plan(plan, target, chain_path="h")
        assert e.exact == _is_per_layer(plan), plan.describe()
        assert _is_per_layer(e.closest_plan)
        assert _recomputed(e.closest_plan) == _recomputed(plan), plan.describe()
        assert export_plan(e.closest_plan, target, chain_path="h").exact


def test_torchtitan_closest_is_the_fewest_blocks_at_least_as_many_as_recomputed():
    for plan in _plans_to_check():
        n = plan.n_layers
        options = [_titan_layers(n, "none", None)] + [_titan_layers(n, "selective", str(k))
                                                     for k in range(1, n + 1)]
        e = export_plan(plan, "torchtitan", chain_path="layers")
        wanted = _recomputed(plan)
        assert e.exact == (_is_per_layer(plan) and wanted in options), plan.describe()
        got = _recomputed(e.closest_plan)
        assert got in options and _is_per_layer(e.closest_plan)
        if not e.exact:
            best = min(len(o) for o in options if len(o) >= len(wanted))
            assert len(got) == best, plan.describe()
        assert export_plan(e.closest_plan, "torchtitan", chain_path="layers").exact


def test_torchtitan_closest_fits_the_budget_when_an_every_n_pattern_does():
    # Oracle: every expressible torchtitan config simulated on the chain. With a budget, the one
    # exported is the fewest checkpointed blocks that fits; the nearest by count may not fit (a
    # dp plan with 2 of 4 layers recomputed, whose nearest every-N, blocks 1 and 3, was over).
    from ckplan.planner import simulate
    from ckplan.planner.synthetic import random_chain
    moved = 0
    for seed in range(30):
        chain = random_chain(6, seed, max_size=5000)
        hi = simulate(chain, plan_none(6)).peak_bytes
        lo = simulate(chain, plan_every_k(6, 1)).peak_bytes
        for budget in (lo + (hi - lo) * t // 6 for t in range(1, 6)):
            plan = plan_chain(chain, "dp", budget).plan
            def fits(p, budget=budget, chain=chain):
                return simulate(chain, p).peak_bytes <= budget
            e = export_plan(plan, "torchtitan", chain_path="layers", fits=fits)
            if e.exact:
                continue
            c = len(_recomputed(plan))
            titan = [(k, per_layer_plan(6, sorted(_titan_layers(6, "selective", str(k))))) for k in range(1, 7)]
            fitting = [(k, p) for k, p in titan if fits(p)]
            got = _recomputed(e.closest_plan)
            if fitting:  # the largest N (fewest blocks) that fits, among those with at least c blocks
                best = max(k for k, p in fitting if len(_recomputed(p)) >= c or k == 1)
                assert got == _recomputed(dict(titan)[best]) and fits(e.closest_plan), (seed, budget)
            nearest = max(k for k in range(1, 7) if 6 // k >= c)
            moved += got != _titan_layers(6, "selective", str(nearest))
    assert moved  # the budget changed the config somewhere: the oracle can fail


@pytest.mark.parametrize("plan", [plan_none(12), plan_every_k(12, 1), per_layer_plan(12, [3, 7, 11]),
                                  NESTED_DP, *_dp_plans()[1:]])
def test_torchtitan_toml_applies_the_closest_plan(plan):
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    e = export_plan(plan, "torchtitan", chain_path="layers")
    ac = tomllib.loads(e.text)["activation_checkpoint"]
    assert _titan_layers(12, ac["mode"], ac.get("selective_ac_option")) == _recomputed(e.closest_plan)


def test_messages_name_the_difference():
    e = export_plan(plan_every_k(6, 3), "fsdp", chain_path="h")
    assert "[0,3) [3,6)" in e.message and "layers 0-5" in e.message
    assert "inputs of layers 1-2, 4-5 are kept too" in e.message
    one = export_plan(Plan("dp", 4, items_from_ranges(4, [(0, 2)])), "hf", chain_path="h").message
    assert "inputs of layer 1 are kept too" in one and "layers 0-1 checkpointed" in one
    # per-layer checkpoints hold more for backward, but recompute one layer at a time, so their
    # peak can be lower than the plan's: the message must not claim which way it goes
    assert "higher than planned" not in e.message
    nested = export_plan(NESTED_DP, "hf", chain_path="h").message
    assert "nests checkpoints inside" in nested and "more than once" in nested
    t = export_plan(plan_every_k(12, 2), "torchtitan", chain_path="transformer.h").message
    assert 'mode = "full"' in t and "model.layers" in t


@pytest.mark.parametrize("policy", [("bf16", "fp32"), ("bf16", "bf16"), ("fp16", "fp32")])
def test_the_policy_a_plan_was_made_for_is_written(policy):
    """A plan made under FSDP2's MixedPrecisionPolicy: the fsdp snippet shows the wrapping with that
    policy (its commented lines build the policy with the same dtypes), torchtitan's TOML sets it,
    and a reduce torchtitan does not run is said."""
    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    plan = plan_every_k(4, 1)
    code = [ln[4:] for ln in export_plan(plan, "fsdp", chain_path="blocks", policy=policy).text.splitlines()
            if ln.startswith("#   ")]
    assert "    fully_shard(layer, mp_policy=policy)" in code and code[2] == "for layer in model.blocks:"
    scope = {"torch": torch}
    exec("\n".join(code[:2]), scope)  # the import and the policy
    made = scope["policy"]  # torch <= 2.6 stores a reduce equal to the param dtype as None: the same policy
    assert (made.param_dtype, made.reduce_dtype or made.param_dtype) == (dtypes[policy[0]], dtypes[policy[1]])
    tomllib = pytest.importorskip("tomllib")
    e = export_plan(plan, "torchtitan", chain_path="layers", policy=policy)
    names = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
    assert tomllib.loads(e.text)["training"] == {"mixed_precision_param": names[policy[0]],
                                                 "mixed_precision_reduce": names[policy[1]]}
    assert ("torchtitan reduces in float32" in e.message) == (policy[1] != "fp32")
    # no policy: no wrapping lines, no [training]
    assert "MixedPrecisionPolicy" not in export_plan(plan, "fsdp", chain_path="blocks").text
    assert "training" not in tomllib.loads(export_plan(plan, "torchtitan", chain_path="layers").text)


def test_bad_target_and_chain_path():
    with pytest.raises(UsageError, match="megatron"):
        export_plan(plan_none(3), "megatron", chain_path="h")
    with pytest.raises(UsageError, match="chain path"):
        export_plan(plan_none(3), "fsdp", chain_path="")


# ---- the snippets, run on real models ----------------------------------------------------
@pytest.fixture
def one_thread():
    """The models are tiny: one intra-op thread is faster, and far faster on busy cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _count_forwards(layers, counted_module=lambda layer: layer):
    counts = [0] * len(layers)
    hooks = [counted_module(layer).register_forward_pre_hook(
        lambda mod, args, i=i: counts.__setitem__(i, counts[i] + 1)) for i, layer in enumerate(layers)]
    return counts, hooks


def _loss_and_grads(model, ids):
    torch.manual_seed(1)
    model.zero_grad(set_to_none=True)
    loss = model(ids, labels=ids)
    loss = getattr(loss, "loss", loss)
    loss.backward()
    return loss.item(), {n.replace("_checkpoint_wrapped_module.", ""): p.grad.clone()
                         for n, p in model.named_parameters()}


@pytest.mark.parametrize("target", ["fsdp", "lightning"])
@pytest.mark.parametrize("plan", [per_layer_plan(4, [0, 2, 3]),
                                  Plan("dp", 4, items_from_ranges(4, [(0, 3), (0, 1), (1, 3)]))],
                         ids=["exact-subset", "nested"])
def test_wrapper_snippet_checkpoints_exactly_the_planned_layers(target, plan, one_thread):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    torch.manual_seed(0)
    plain = build_gpt(vocab_size=97, block_size=32, n_layer=4, n_head=2, n_embd=32, dropout=0.1)
    model = copy.deepcopy(plain)
    blocks = list(model.blocks)
    e = export_plan(plan, target, chain_path="blocks", layer_class="Block")
    ns = {"model": model}
    exec(e.text, ns)
    if target == "lightning":  # the hook body, twice: configure_model may run more than once
        ns["ckplan_checkpoint"](model)
        ns["ckplan_checkpoint"](model)
    wrapped = {i for i, layer in enumerate(model.blocks) if isinstance(layer, CheckpointWrapper)}
    assert wrapped == _recomputed(e.closest_plan)
    assert sum(isinstance(m, CheckpointWrapper) for m in model.modules()) == len(wrapped)

    ids = torch.randint(0, 97, (2, 16))
    plain.train(), model.train()
    counts, hooks = _count_forwards(blocks)
    loss1, g1 = _loss_and_grads(model, ids)
    for h in hooks:
        h.remove()
    assert counts == [d.forwards for d in e.closest_plan.per_layer()]
    loss0, g0 = _loss_and_grads(plain, ids)
    assert loss1 == pytest.approx(loss0, rel=1e-6)
    assert g1.keys() == g0.keys()
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], rtol=1e-5, atol=1e-6)


def test_hf_snippet_runs_on_transformers(one_thread):
    transformers = pytest.importorskip("transformers")
    v4 = int(transformers.__version__.split(".")[0]) < 5  # the per-layer form runs there too
    cfg = transformers.GPT2Config(n_layer=4, n_embd=32, n_head=2, vocab_size=97, n_positions=32,
                                  bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    plain = transformers.GPT2LMHeadModel(cfg)
    ids = torch.randint(0, 97, (2, 16))
    plain.train()
    loss0, g0 = _loss_and_grads(plain, ids)
    cases = [(per_layer_plan(4, [1, 2]), "gradient_checkpointing = m in chosen"),
             (per_layer_plan(4, [0, 2]), "every_n_layers=2"),
             (plan_every_k(4, 1), "activation_checkpointing_enable("),
             (plan_none(4), "leave activation checkpointing off"),
             (plan_every_k(4, 2), "activation_checkpointing_enable("),  # not exact: 0-3 one by one
             (Plan("dp", 4, items_from_ranges(4, [(1, 3)])), "gradient_checkpointing = m in chosen")]
    for plan, form in cases:
        model = copy.deepcopy(plain)
        e = export_plan(plan, "hf", chain_path="transformer.h")
        assert form in e.text
        if v4 and form in ("every_n_layers=2", "activation_checkpointing_enable("):
            continue  # transformers 5's one-liners
        exec(e.text, {"model": model})
        counts, hooks = _count_forwards(model.transformer.h, lambda block: block.ln_1)
        loss1, g1 = _loss_and_grads(model, ids)
        for h in hooks:
            h.remove()
        assert counts == [d.forwards for d in e.closest_plan.per_layer()], plan.describe()
        assert loss1 == pytest.approx(loss0, rel=1e-6)
        for name in g0:
            torch.testing.assert_close(g1[name], g0[name], rtol=1e-5, atol=1e-6)


def test_fsdp_snippet_under_fully_shard(one_thread):
    """The fsdp snippet, then FSDP2's fully_shard per block and on the root (one gloo rank on CPU):
    the planned blocks run forward twice and the gradients equal the plain model's."""
    import socket

    import torch.distributed as dist
    if not dist.is_available() or dist.is_initialized():
        pytest.skip("needs torch.distributed and no process group yet")
    from ckplan.distributed import fsdp_runs_on_cpu
    if not fsdp_runs_on_cpu():
        pytest.skip(f"FSDP2 on CPU needs torch 2.9 (this is {torch.__version__})")
    from torch.distributed.fsdp import fully_shard

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        plain = build_gpt(vocab_size=97, block_size=32, n_layer=4, n_head=2, n_embd=32, dropout=0.1)
        model = copy.deepcopy(plain)
        blocks = list(model.blocks)
        e = export_plan(Plan("dp", 4, items_from_ranges(4, [(1, 3)])), "fsdp", chain_path="blocks")
        exec(e.text, {"model": model})
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        ids = torch.randint(0, 97, (2, 16))
        counts, hooks = _count_forwards(blocks)
        loss1, g1 = _loss_and_grads(model, ids)
        for h in hooks:
            h.remove()
        assert counts == [1, 2, 2, 1] == [d.forwards for d in e.closest_plan.per_layer()]
        loss0, g0 = _loss_and_grads(plain, ids)
        assert loss1 == pytest.approx(loss0, rel=1e-6)
        for name, g in g1.items():
            g = g.full_tensor() if hasattr(g, "full_tensor") else g  # a DTensor under fully_shard
            torch.testing.assert_close(g, g0[name], rtol=1e-5, atol=1e-6)
    finally:
        dist.destroy_process_group()


def test_selective_options_are_not_exact_and_say_so():
    """No target carries a per-layer SAC policy: the export stores those layers whole, says which,
    and is not exact; the header still shows the real plan."""
    plan = Plan("dp", 4, items_from_ranges(4, [(1, 2)])).with_options(
        ["sac-compute", "store", "store", "sac-linear"])
    for target in ("fsdp", "hf", "torchtitan", "lightning"):
        e = export_plan(plan, target, chain_path="h")
        assert not e.exact and not e.closest_plan.uses_options
        assert "0: sac-compute" in e.message and "3: sac-linear" in e.message
        assert "S0:sac-compute" in e.text.splitlines()[0]


@pytest.mark.parametrize("target", TARGETS)
def test_a_checkpoint_starting_at_a_layer_given_a_copy_is_not_exact_anywhere_else(target):
    """apply_plan copies the input of a layer that changes it in place where a checkpoint starts
    (params copy_inputs); no framework's checkpointing does, so the snippet says so."""
    plan = Plan("dp", 4, items_from_ranges(4, [(0, 2)])).copying_inputs([0, 1, 2, 3])
    out = export_plan(plan, target, chain_path="layers", layer_class="Block")
    assert not out.exact and "layers 0 change their input in place" in out.message
    assert "# Not exact: layers 0 change their input in place" in out.text
    later = Plan("dp", 4, items_from_ranges(4, [(2, 4)])).copying_inputs([1])  # no checkpoint starts at 1
    assert "in place" not in export_plan(later, target, chain_path="layers", layer_class="Block").message
