"""Plans as checkpoint regions inside one whole-model torch.compile (ckplan.whole_compile): which
plans have such regions, and gradients equal to eager PyTorch's."""
from __future__ import annotations

import pytest
import torch

from ckplan.errors import UsageError
from ckplan.peers import compile_unavailable
from ckplan.planner import plan_every_k, plan_none
from ckplan.planner.plan import Checkpoint, Plan, Store
from ckplan.planner.regions import FULL, regions_plan
from ckplan.whole_compile import CompiledModel, region_options
from ckplan.zoo import build_builtin


def test_one_region_per_layer_plans_are_read_layer_by_layer():
    plan = regions_plan(["store", "sac-linear", FULL, "sac-compute"])
    assert region_options(plan) == ("store", "sac-linear", FULL, "sac-compute")
    assert region_options(plan_every_k(3, 1)) == (FULL, FULL, FULL)
    assert region_options(plan_none(2)) == ("store", "store")


@pytest.mark.parametrize("plan,what", [
    (plan_every_k(4, 2), "spans 2 layers"),
    (Plan("x", 2, (Store(0, "mincut-50"), Store(1))), "mincut-50"),
    (Plan("x", 2, (Store(0, "offload"), Store(1))), "offload"),
    (Plan("x", 1, (Checkpoint(0, 1, (Store(0, "sac-linear"),)),)), "one checkpoint region per layer"),
])
def test_plans_without_such_regions_are_refused_with_the_layer_named(plan, what):
    with pytest.raises(UsageError) as err:
        region_options(plan)
    assert what in err.value.message and err.value.tip


def test_a_partitioner_budget_travels_with_the_plan_and_only_runs_compiled(tmp_path):
    """A plan's partitioner budget is its whole-model compile's activation_memory_budget: it
    survives the plan file, the compiled copy takes it, bad values and eager execution are refused."""
    import json

    import ckplan
    from ckplan.whole_compile import PARTITIONER_BUDGET, partitioner_budget
    plan = Plan("dp", 3, plan_none(3).items, {PARTITIONER_BUDGET: 0.625})
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan.to_dict()))
    back = ckplan.load_plan(path)
    assert partitioner_budget(back) == 0.625 and partitioner_budget(plan_none(3)) == 1.0
    assert CompiledModel(_tiny(), back).fraction == 0.625  # compiles lazily: nothing runs here
    for bad in (0, 1.5, "half", True):
        with pytest.raises(UsageError) as err:
            partitioner_budget(Plan("dp", 3, plan_none(3).items, {PARTITIONER_BUDGET: bad}))
        assert repr(bad) in err.value.message and err.value.tip
    with pytest.raises(UsageError) as err:
        ckplan.apply_plan(_tiny(), back)
    assert "compiled_model" in err.value.tip


def _tiny():
    torch.manual_seed(0)
    return build_builtin("gpt", dict(vocab_size=128, block_size=64, n_layer=3, n_head=2, n_embd=64, dropout=0.1))


@pytest.mark.slow  # a TorchInductor compile of a small GPT: about a minute on 2 cores
@pytest.mark.skipif(bool(compile_unavailable("cpu")), reason="TorchInductor cannot compile on this machine")
def test_regions_inside_a_whole_model_compile_give_eager_gradients():
    model = _tiny()
    ids = torch.randint(0, 128, (2, 64))
    torch.manual_seed(1)
    model(ids, labels=ids).backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    cm = CompiledModel(model, regions_plan(["sac-linear", FULL, "store"]), "blocks")
    with cm.compiling():
        torch.manual_seed(1)  # the same dropout masks: random ops are drawn as eager draws them
        cm.module(ids, labels=ids).backward()
    assert cm.graphs >= 1
    scale = max(g.abs().max().item() for g in ref.values())
    for n, p in model.named_parameters():  # the copy shares the model's parameters
        assert (p.grad - ref[n]).abs().max().item() <= 1e-5 * scale, n
    by = cm.saved.bytes  # what each layer's region saves: recomputed whole least (with dropout, the
    assert 0 < by["L1"] < min(by["L0"], by["L2"])  # selective one keeps its masks beside the matmuls)


TINY = """
model:
  builtin: gpt
  args: {vocab_size: 512, block_size: 64, n_layer: 3, n_head: 2, n_embd: 64, dropout: 0.0}
input: {batch_size: 2, shape: [64], dtype: int64, high: 512, name: input_ids, labels: copy}
chain: blocks
train: {optimizer: sgd, precision: fp32, accum: 1}
"""


@pytest.mark.slow  # the whole model compiled once per choice and per row: minutes on 2 cores
@pytest.mark.skipif(bool(compile_unavailable("cpu")), reason="TorchInductor cannot compile on this machine")
def test_bench_model_scope_predicts_the_compiled_rows(tmp_path):
    import ckplan
    from ckplan.api import bench
    spec = tmp_path / "tiny.yaml"
    spec.write_text(TINY)
    res = bench(ckplan.load(spec), strategies=["none", "dp", "every-k"], k=1, steps=1, warmup=1,
                device="cpu", options=["sac-linear"], compile_scope="model")
    assert res.compile_scope == "model" and res.device_tag == "cpu-compiled-model"
    rows = {r.strategy: r for r in res.rows}
    for name in ("none", "dp", "every-k"):
        r = rows[name]
        assert r.status == "ok", (name, r.message)
        assert r.max_grad_diff is not None and r.max_grad_diff <= r.grad_tolerance
        # every plan here was measured whole before the rows ran (none and every layer recomputed to
        # build the chain, dp's own plan while planning when it mixes choices): the bench's step runs
        # the same compiled graph and holds the loss a few bytes longer
        assert abs(r.predicted_peak_bytes - r.measured_peak_bytes) <= 64, (name, r.predicted_peak_bytes,
                                                                            r.measured_peak_bytes)
        # one graph each: the copy the bench runs is the one that was measured, not a recompile
        assert "compiled 1 graph(s)" in r.message, (name, r.message)


@pytest.mark.slow  # the whole model compiled per uniform step and once more at the plan's budget
@pytest.mark.skipif(bool(compile_unavailable("cpu")), reason="TorchInductor cannot compile on this machine")
def test_a_plan_with_a_partitioner_budget_runs_as_measured_and_saves_less(tmp_path):
    """A plan file with params.partitioner_budget, benched under --compile-scope model: its peak
    predicted from its own measured step, the same compiled graph in the row, eager gradients, and
    less held for the backward than every layer stored (the min-cut recomputed something)."""
    import json

    import ckplan
    from ckplan.api import bench
    from ckplan.whole_compile import PARTITIONER_BUDGET
    spec = tmp_path / "tiny.yaml"
    spec.write_text(TINY.replace("n_layer: 3", "n_layer: 4"))
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(Plan("mine", 4, plan_none(4).items, {PARTITIONER_BUDGET: 0.5}).to_dict()))
    res = bench(ckplan.load(spec), strategies=["none"], steps=1, warmup=1, device="cpu", options=False,
                compile_scope="model", plan_path=plan)
    rows = {r.strategy: r for r in res.rows}
    none, mine = rows["none"], rows["plan:mine"]
    for r in (none, mine):
        assert r.status == "ok", (r.strategy, r.message)
        assert r.max_grad_diff is not None and r.max_grad_diff <= r.grad_tolerance
        assert abs(r.predicted_peak_bytes - r.measured_peak_bytes) <= 64, (r.strategy, r.predicted_peak_bytes,
                                                                            r.measured_peak_bytes)
    assert "activation_memory_budget 0.500" in mine.message and "compiled 1 graph(s)" in mine.message
    assert mine.measured_activation_bytes < none.measured_activation_bytes
