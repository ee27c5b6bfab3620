"""The README's Python API example runs as written, and its plan keeps the math."""
import re
from pathlib import Path

import torch

import ckplan

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
