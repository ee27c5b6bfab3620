"""The README's Python API example runs as written, and its plan keeps the math."""
import re
from pathlib import Path

import pytest
import torch

import ckplan
from ckplan import api
from ckplan.errors import InfeasibleBudgetError, UsageError

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
