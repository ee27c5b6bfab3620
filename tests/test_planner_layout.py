"""The planner's modules import one way, at the top of each file (issue 8.1)."""
from __future__ import annotations

import ast
from pathlib import Path

import ckplan.planner

PLANNER = Path(ckplan.planner.__file__).parent
# Each module may import only the ones before it (the order of ckplan/planner/__init__.py).
ORDER = ["chain", "plan", "simulate", "baselines", "calibrate", "groups", "floor", "tables", "casts",
         "held", "dp", "strategies", "budget", "parallel", "synthetic"]


def _modules() -> dict[str, ast.Module]:
    return {p.stem: ast.parse(p.read_text()) for p in PLANNER.glob("*.py") if p.stem != "__init__"}


def _local_imports(tree: ast.Module) -> set[str]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            if node.module:
                out.add(node.module.split(".")[0])
            else:
                out.update(a.name for a in node.names)
    return out


def test_every_planner_module_is_in_the_order():
    assert sorted(_modules()) == sorted(ORDER)


def test_imports_flow_one_way():
    for name, tree in _modules().items():
        allowed = set(ORDER[:ORDER.index(name)])
        assert _local_imports(tree) <= allowed, (name, _local_imports(tree) - allowed)


def test_imports_sit_at_the_top_of_each_file():
    for name, tree in _modules().items():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                inner = [n for n in ast.walk(node) if isinstance(n, (ast.Import, ast.ImportFrom))]
                assert not inner, f"{name}.{node.name} imports inside a function or class"
