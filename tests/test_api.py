"""The README's Python API example runs as written, and its plan keeps the math; the Python API
refuses a plan file made for another chain, names layers it cannot see, and hands the distributed
bench a profile made with the options asked for."""
import json
import re
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import ckplan
from ckplan import api
from ckplan.errors import InfeasibleBudgetError, ModelRunError, SpecError, UsageError

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_python_example_runs():
    code = re.search(r"## Python API.*?```python\n(.*?)```", README.read_text(), re.S).group(1)
    ns: dict = {}
    exec(compile(code, "README.md", "exec"), ns)
    assert ns["result"].fits and ns["result"].score.peak_bytes <= ns["result"].budget_bytes


def test_plan_model_then_apply_gives_same_gradients():
    from ckplan.zoo import build_builtin
    torch.manual_seed(0)
    model = build_builtin("mlp", dict(in_features=32, depth=6, width=64, activation="gelu"))
    x = torch.randn(128, 32)
    res = ckplan.plan_model(model, x, strategy="every-k", k=2)
    ref = torch.autograd.grad(model(x).pow(2).mean(), list(model.parameters()))
    with ckplan.apply_plan(model, res):
        got = torch.autograd.grad(model(x).pow(2).mean(), list(model.parameters()))
    for a, b in zip(ref, got):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-7)


def test_plan_model_plans_one_rank_as_the_spec_planner_does(tiny_gpt_spec, tmp_path):
    # Oracle: the spec route (api.plan with world_size, the CLI's --world-size) on the same model
    # and micro-batch; both profile it for real, so the per-rank byte figures must agree.
    from ckplan import api
    from ckplan.spec import build_model, make_batch
    spec = api.load(tiny_gpt_spec(tmp_path, n_layer=4))
    torch.manual_seed(0)
    model = build_model(spec, "cpu")
    args, kwargs = make_batch(spec, "cpu")
    for kind in ("fsdp", "ddp"):
        mine = ckplan.plan_model(model, (args, kwargs), strategy="none", optimizer="sgd", world_size=2,
                                 parallel=kind)
        theirs = api.plan(spec, strategy="none", device="cpu", world_size=2, parallel=kind,
                          overrides={"optimizer": "sgd"}).chosen
        assert mine.score.peak_bytes == theirs.score.peak_bytes, kind
    one = ckplan.plan_model(model, (args, kwargs), strategy="none", optimizer="sgd")
    fsdp = ckplan.plan_model(model, (args, kwargs), strategy="none", optimizer="sgd", world_size=2)
    assert fsdp.score.persistent_bytes < one.score.persistent_bytes  # parameters sharded
    # a share is of one rank's peak: 90% of it, not of one process's
    half = ckplan.plan_model(model, (args, kwargs), budget="90%", optimizer="sgd", world_size=2)
    assert abs(half.budget_bytes - 0.9 * fsdp.score.peak_bytes) <= 1 and half.fits


def test_ci_runs_the_readme_test_command():
    readme = README.read_text()
    cmd = re.search(r"# 2\. install and run the tests\n(.+)\n", readme).group(1).strip()
    ci = (README.parent / ".ci" / "run").read_text()
    assert cmd in ci


# ---- the Python API validates like the CLI, naming its own arguments ---------------------------

def _mlp_and_batch():
    from ckplan.zoo import build_builtin
    return build_builtin("mlp", dict(in_features=8, depth=3, width=8, activation="relu")), torch.randn(4, 8)


@pytest.mark.parametrize("kw,needle", [
    ({"precision": "int8"}, "precision='int8'"), ({"accum": 0}, "accum=0"),
    ({"optimizer": "lion"}, "optimizer='lion'"), ({"strategy": "fastest"}, "strategy='fastest'"),
    ({"k": 0}, "k=0"), ({"budget": "1e400"}, "larger than any machine"), ({"budget": "lots"}, "'lots'"),
    ({"world_size": 0}, "world_size"), ({"world_size": 2, "parallel": "zero3"}, "parallel='zero3'"),
])
def test_plan_model_rejects_bad_arguments_by_their_api_names(kw, needle):
    model, x = _mlp_and_batch()
    with pytest.raises(UsageError) as e:
        ckplan.plan_model(model, x, **kw)
    assert needle in str(e.value) and "--" not in e.value.message


@pytest.mark.parametrize("call,needle", [
    (lambda s: api.profile(s, device="gpu"), "device='gpu'"),
    (lambda s: api.plan(s, strategy="fastest", device="meta"), "strategy='fastest'"),
    (lambda s: api.plan(s, budget="12 parsecs", device="meta"), "budget '12 parsecs'"),
    (lambda s: api.bench(s, strategies=["dp", "fastest"], device="cpu"), "strategy='fastest'"),
    (lambda s: api.bench(s, strategies=["none"], device="cpu", memory_limit="-1"), "memory_limit"),
    (lambda s: api.bench(s, strategies=["none"], device="cpu", steps=0), "steps=0"),
    (lambda s: api.profile_model(torch.nn.Linear(2, 2), (torch.randn(1, 2),), {}, name="m", chain=None,
                                 device="cpu", precision="int8"), "precision='int8'"),
])
def test_api_functions_reject_bad_arguments(tiny_gpt_spec, tmp_path, call, needle):
    spec = api.load(tiny_gpt_spec(tmp_path))
    with pytest.raises(UsageError) as e:
        call(spec)
    assert needle in str(e.value) and "--" not in e.value.message  # API names, not CLI flags


def test_api_load_overrides_are_validated(tiny_gpt_spec, tmp_path):
    with pytest.raises(UsageError, match="precision='int8'"):
        api.load(tiny_gpt_spec(tmp_path), precision="int8")


def test_api_infeasible_budget_is_a_dedicated_exception():
    from ckplan.zoo import build_builtin
    model = build_builtin("mlp", dict(in_features=16, depth=4, width=16))
    with pytest.raises(InfeasibleBudgetError) as e:
        ckplan.plan_model(model, torch.randn(8, 16), budget="1KB")
    assert e.value.exit_code == 3 and e.value.min_peak_bytes > e.value.budget_bytes == 1000
    assert "smallest feasible peak" in str(e.value)


def test_a_whole_float_budget_is_bytes():
    # 12e9 is how Python users write 12 GB; a fraction of a byte is refused by the API's name
    model, x = _mlp_and_batch()
    big = ckplan.plan_model(model, x, budget=12e9)
    assert big.budget_bytes == 12_000_000_000 and big.fits
    for bad in (1.5, float("nan"), float("inf")):
        with pytest.raises(UsageError, match="is not a whole number of bytes") as e:
            ckplan.plan_model(model, x, budget=bad)
        assert "--" not in e.value.message


def _plan_doc(chain="layers", model="mlp3", n=3, command="plan"):
    return {"schema_version": 1, "command": command, "model": model, "chain": chain, "n_layers": n,
            "plan": {"format": "ckplan.plan/1", "strategy": "every-k", "n_layers": n, "params": {},
                     "checkpoints": [[0, 1]]}}


def test_apply_plan_refuses_a_plan_file_made_for_another_chain(tmp_path):
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))

        def forward(self, x):
            for m in self.layers:
                x = m(x)
            return x

    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(_plan_doc(chain="blocks")))
    with pytest.raises(SpecError, match="chain 'blocks'"):
        ckplan.apply_plan(Net(), str(plan))
    plan.write_text(json.dumps(_plan_doc(chain="layers")))  # the same chain still applies
    ckplan.apply_plan(Net(), plan).remove()


def test_layers_called_through_forward_are_named(tmp_path):
    # SqueezeBERT's encoder calls `layer.forward(x)`: no module hook fires, so no container works;
    # the message says why instead of asking for another `chain:`
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))

        def forward(self, x):
            for layer in self.layers:
                x = layer.forward(x)
            return x.pow(2).mean()

    with pytest.raises(ModelRunError, match=r"layer\.forward\(x\)") as err:
        api.profile_model(Net(), (torch.randn(4, 8),), {}, name="fwd", chain="layers", device="cpu",
                          optimizer="sgd", repeats=1, warmup=0)
    assert "instead of `layer.forward" in err.value.tip


def test_distributed_bench_profiles_options_when_asked(tiny_gpt_spec, tmp_path, monkeypatch):
    """``bench --nproc`` (``api.bench_distributed``) passes ``--options`` on to its profile, as the
    one-process bench does, and hands the ranks' launcher the loaded spec and that profile."""
    from ckplan.distributed import fsdp_runs_on_cpu
    if not fsdp_runs_on_cpu():
        pytest.skip("FSDP2 on CPU ranks needs torch 2.9 (ckplan refuses it)")
    spec = api.load(tiny_gpt_spec(tmp_path, n_layer=2))
    seen = []
    monkeypatch.setattr(api, "_bench_distributed", lambda spec, **kw: seen.append(kw["profile"]))
    api.bench_distributed(spec, nproc=2, strategies=["none"], device="cpu", options=True)
    api.bench_distributed(spec, nproc=2, strategies=["none"], device="cpu")
    with_options, without = seen
    assert any(r.options for r in with_options.chain_layers)
    assert not any(r.options for r in without.chain_layers)


def test_offload_asked_for_without_a_host_link_says_so(tiny_gpt_spec, tmp_path):
    """A CPU (or meta for a CPU) profile has no host link: asked for, offload says it planned none;
    left to dp, nothing is said; a GPU target's meta profile has one."""
    spec = api.load(tiny_gpt_spec(tmp_path))
    asked = api.plan(spec, device="meta", meta_target="cpu", offload=True)
    assert any("--offload: nothing is offloaded: the profile has no host link" in n for n in asked.notes)
    assert "offload" not in asked.chosen.plan.options()
    quiet = api.plan(spec, device="meta", meta_target="cpu")
    assert not any("--offload" in n for n in quiet.notes)
    gpu = api.plan(spec, device="meta", meta_target="h100", offload=True)
    assert not any("--offload" in n for n in gpu.notes) and gpu.profile.host_bw == (55e9, 55e9)


def test_per_rank_bf16_plan_names_autocast_copies_unsharded(tiny_gpt_spec, tmp_path):
    """Per rank under FSDP2, autocast still caches a bf16 copy of every weight a layer reads in a
    matmul, unsharded, to the end of the forward: the note gives the chain's bytes (two per
    element of every Linear's weight and bias in the blocks), and the per-rank chain holds them."""
    from ckplan.planner.parallel import per_rank_chain_from_profile
    from ckplan.spec import build_model
    from ckplan.units import format_bytes
    path = tiny_gpt_spec(tmp_path)
    rep = api.plan(path, world_size=4, overrides={"precision": "bf16"}, device="cpu")
    model = build_model(api.load(path), "meta")
    analytic = 2 * sum(p.numel() for m in model.blocks.modules() if isinstance(m, nn.Linear)
                       for p in m.parameters())
    note = next(n for n in rep.notes if n.startswith("per rank of FSDP2"))
    assert f"({format_bytes(analytic)} of the chain's per rank)" in note, note
    chain = per_rank_chain_from_profile(rep.profile, 4, "fsdp")
    assert sum(ly.cast_bytes for ly in chain.layers) == analytic


def test_torchtitan_export_says_when_the_plan_is_not_for_its_default_policy(tiny_gpt_spec, tmp_path):
    """torchtitan shards with MixedPrecisionPolicy(bf16) by default: a plan made without the policy
    says so; one made with it does not."""
    path = tiny_gpt_spec(tmp_path)
    plain = api.plan(path, device="meta")
    assert "mixed_precision_param bfloat16" in api.export(plain, "torchtitan")[0].message
    assert "mixed_precision_param" not in api.export(plain, "hf")[0].message
    mp = tmp_path / "mp.yaml"
    mp.write_text(path.read_text() + "parallel: {kind: fsdp, param_dtype: bf16}\n")
    assert "mixed_precision_param" not in api.export(api.plan(mp, device="meta"), "torchtitan")[0].message


def test_no_public_name_is_shadowed_by_a_submodule():
    """``ckplan.NAME`` stays the function after any import: a submodule of the same name would
    replace it on the package the moment something imports that submodule."""
    import importlib
    import importlib.util

    import ckplan
    importlib.import_module("ckplan.api")  # imports most of the package
    for name in ckplan.__all__:
        assert importlib.util.find_spec(f"ckplan.{name}") is None, name
        assert callable(getattr(ckplan, name)) or isinstance(getattr(ckplan, name), type), name
    from ckplan import compiled_model
    assert callable(compiled_model)


def test_import_ckplan_loads_neither_numpy_nor_the_planner():
    """``import ckplan`` is light; the facade's names load their modules on first use."""
    import os
    import subprocess
    import sys
    root = str(Path(ckplan.__file__).resolve().parents[1])  # this checkout's ckplan, in the child too
    code = ("import sys, ckplan\n"
            "print(sorted(m for m in ('numpy', 'torch', 'ckplan.export', 'ckplan.planner') if m in sys.modules))\n"
            "print(set(ckplan.__all__) <= set(dir(ckplan)))\n"
            "ckplan.export_plan\n"
            "print('ckplan.export' in sys.modules, 'numpy' in sys.modules)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split("\n")[:3] == ["[]", "True", "True True"], out.stdout + out.stderr
