"""The planner's modules import one way, at the top of each file, subpackages included."""
from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

import ckplan.planner

PLANNER = Path(ckplan.planner.__file__).parent
# Each module may import only the ones before it; a subpackage (its ``__init__``) comes after its
# own modules, which import each other and the planner's modules above them.
ORDER = ["limits", "layer", "chain", "plan_items", "plan_json", "plan", "boundaries", "transfers", "replay",
         "simulate", "baselines",
         "calibrate", "groups", "floor",
         "tables.common", "tables.table_kernels", "tables.frontier_kernel", "tables.compiled",
         "tables.pairs", "tables.reader", "tables.peaks", "tables.slots", "tables.frontiers",
         "tables.pareto", "tables",
         "casts", "held_costs", "held",
         "solve.common", "solve.lowest", "solve.solver", "solve.improve", "solve.near_min", "solve.band",
         "solve.coarse", "solve.unkept_dp", "solve.unkept", "solve.portfolio", "solve.held_fallback",
         "solve.offload_passes", "solve.offload", "solve.entry", "solve",
         "strategies", "frontier", "budget", "regions", "whole", "parallel", "synthetic"]


def _name(path: Path) -> str:
    parts = list(path.relative_to(PLANNER).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@cache
def _modules() -> dict[str, tuple[Path, ast.Module]]:
    return {_name(p): (p, ast.parse(p.read_text())) for p in PLANNER.rglob("*.py") if p != PLANNER / "__init__.py"}


def _local_imports(name: str, path: Path, tree: ast.Module) -> set[str]:
    """The planner modules ``name`` imports (relative imports resolved; ckplan's others left out)."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    known = _modules()
    out = set()
    for node in ast.walk(tree):
        if not (isinstance(node, ast.ImportFrom) and node.level >= 1):
            continue
        if node.level - 1 > len(package):  # above the planner: ckplan's own (errors, units, ...)
            continue
        base = package[:len(package) - (node.level - 1)]
        targets = ([base + node.module.split(".")] if node.module
                   else [base + [a.name] for a in node.names])
        for t in targets:
            while t and ".".join(t) not in known:  # a name imported from a module: the module
                t = t[:-1]
            if t:
                out.add(".".join(t))
    return out


def test_every_planner_module_is_in_the_order():
    assert sorted(_modules()) == sorted(ORDER)


def test_imports_flow_one_way():
    for name, (path, tree) in _modules().items():
        allowed = set(ORDER[:ORDER.index(name)])
        got = _local_imports(name, path, tree) - {name}
        assert got <= allowed, (name, got - allowed)


def test_imports_sit_at_the_top_of_each_file():
    for name, (_, tree) in _modules().items():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                inner = [n for n in ast.walk(node) if isinstance(n, (ast.Import, ast.ImportFrom))]
                assert not inner, f"{name}.{node.name} imports inside a function or class"
