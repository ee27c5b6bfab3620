"""The house stays livable: modules of one concept (at most 400 lines), functions at most 80 lines,
ckplan's own imports at the top of each file, no import cycles, and test files that do not import
from each other. An exception is named here with its reason."""
from __future__ import annotations

import ast
from pathlib import Path

import ckplan

PACKAGE = Path(ckplan.__file__).parent
TESTS = Path(__file__).parent
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 80

# module (dotted, relative to ckplan) -> why it may be longer
LONG_MODULES: dict[str, str] = {}
# "module.function" -> why it may be longer
LONG_FUNCTIONS: dict[str, str] = {
    "planner.tables.frontier_kernel._pareto_kernel":
        "the numba-compiled merge loop: split, it would pass the frontier buffers and counters in and out "
        "on every point",
}


def _modules() -> dict[str, tuple[Path, ast.Module]]:
    out = {}
    for p in sorted(PACKAGE.rglob("*.py")):
        rel = p.relative_to(PACKAGE).with_suffix("")
        name = ".".join(rel.parts)
        out[name] = (p, ast.parse(p.read_text()))
    return out


def _functions(tree: ast.AST, prefix: str = ""):
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield f"{prefix}{node.name}", node
            yield from _functions(node, f"{prefix}{node.name}.")
        elif isinstance(node, ast.ClassDef):
            yield from _functions(node, f"{prefix}{node.name}.")


def test_every_module_holds_one_concept():
    long = {}
    for name, (path, _) in _modules().items():
        n = len(path.read_text().splitlines())
        if n > MAX_MODULE_LINES and name not in LONG_MODULES:
            long[name] = n
    assert not long, f"modules over {MAX_MODULE_LINES} lines (split them, or name why in LONG_MODULES): {long}"


def test_every_function_fits_on_a_screen():
    long = {}
    for name, (_, tree) in _modules().items():
        for fname, node in _functions(tree):
            n = node.end_lineno - node.lineno + 1
            key = f"{name}.{fname}"
            if n > MAX_FUNCTION_LINES and key not in LONG_FUNCTIONS:
                long[key] = n
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines (name why in LONG_FUNCTIONS): {long}"


def _own_import(node: ast.AST, module: str) -> str | None:
    """The ckplan module a (possibly relative) import names, or None for third-party ones."""
    if isinstance(node, ast.ImportFrom):
        if node.level:
            base = module.split(".")[:-node.level] if node.level else []
            return ".".join([*base, node.module] if node.module else base) or "__init__"
        if node.module and (node.module == "ckplan" or node.module.startswith("ckplan.")):
            return node.module[len("ckplan."):] if node.module != "ckplan" else "__init__"
    if isinstance(node, ast.Import):
        for a in node.names:
            if a.name.startswith("ckplan."):
                return a.name[len("ckplan."):]
    return None


def test_own_imports_sit_at_the_top():
    inner = []
    for name, (_, tree) in _modules().items():
        for fname, fn in _functions(tree):
            for node in ast.walk(fn):
                if isinstance(node, (ast.Import, ast.ImportFrom)) and _own_import(node, name) is not None:
                    inner.append(f"{name}.{fname}")
    assert not inner, f"ckplan imports inside functions: {sorted(set(inner))}"


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    names = set(mods)
    graph: dict[str, set[str]] = {}
    for name, (_, tree) in mods.items():
        deps = set()
        for node in tree.body:  # module level only: what a reader sees at the top
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                target = _own_import(node, name if not name.endswith("__init__") else name[: -len("__init__")] + "x")
                if target is None:
                    continue
                # `from . import a, b` names submodules
                cands = [target]
                if isinstance(node, ast.ImportFrom):
                    cands += [f"{target}.{a.name}" if target != "__init__" else a.name for a in node.names]
                for c in cands:
                    for form in (c, f"{c}.__init__"):
                        if form in names and form != name:
                            deps.add(form)
        graph[name] = deps
    return graph


def test_imports_have_no_cycles():
    graph = _graph()
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        path.append(n)
        for d in sorted(graph.get(n, ())):
            if d.endswith("__init__") and n.startswith(d[: -len("__init__")]):
                continue  # a submodule may read its own package's face only if the face does not import it
            if state.get(d) == 1:
                return path[path.index(d):] + [d]
            if d not in state:
                cyc = visit(d)
                if cyc:
                    return cyc
        state[n] = 2
        path.pop()
        return None

    for n in sorted(graph):
        if n not in state:
            cyc = visit(n)
            assert cyc is None, f"import cycle: {' -> '.join(cyc)}"


def test_test_files_do_not_import_each_other():
    bad = []
    for p in sorted(TESTS.glob("test_*.py")):
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and (
                    node.module.startswith("test_") or node.module.startswith("tests.test_")
                    or (node.level and (node.module or "").startswith("test_"))):
                bad.append(f"{p.name}: {node.module}")
            if isinstance(node, ast.Import):
                bad += [f"{p.name}: {a.name}" for a in node.names if a.name.startswith(("test_", "tests.test_"))]
    assert not bad, bad


# The stages, lowest first: a module may import its own stage and those below it, never above.
# Measuring (measure, profiling) and planning (planner, pure Python) never reach the report, the
# commands or the library's entry points built on them.
UPPER = ("render", "report", "cli", "commands", "api", "api_plan", "api_profile", "api_whole",
         "public", "bench", "export", "whole_choice", "plan_report")
LOWER = ("measure", "profiling", "planner", "records", "units", "errors")


def _stage_of(module: str) -> str:
    return module.split(".")[0]


def test_imports_flow_from_measuring_to_commands():
    graph = _graph()
    upward = sorted(f"{name} -> {dep}" for name, deps in graph.items() if _stage_of(name) in LOWER
                    for dep in deps if _stage_of(dep) in UPPER)
    upward += sorted(f"{name} -> {dep}" for name, deps in graph.items() if _stage_of(name) == "render"
                     for dep in deps if _stage_of(dep) in UPPER and _stage_of(dep) not in ("render", "report"))
    assert not upward, f"imports against the flow (measure -> records -> planner -> report -> CLI): {upward}"
    # the planner reads records and pure-Python data (the device model's rates, option names)
    data = ("planner", "records", "units", "errors", "device_model", "options")
    planner_out = sorted(f"{name} -> {dep}" for name, deps in graph.items() if _stage_of(name) == "planner"
                         for dep in deps if _stage_of(dep) not in data)
    assert not planner_out, f"the planner reads records only: {planner_out}"
