"""The package's import graph has no cycle: every `import` / `from … import` of every module under oscar_zoo/, at any
level (module top, inside functions and methods, under `if` or `try`), read with `ast` — not only the imports Python
happens to run first. A cycle means two modules each need the other to be read; the fix is to move what both need
below them (docs/architecture.md), never an import inside a function."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "oscar_zoo"


def _modules() -> dict[str, Path]:
    """Every module of the package by dotted name (a package is its __init__)."""
    out = {}
    for path in sorted((ROOT / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _targets(node: ast.AST, name: str, is_package: bool, modules: dict[str, Path]) -> set[str]:
    """The package modules one import statement of module `name` reads."""
    if isinstance(node, ast.Import):
        found = set()
        for alias in node.names:
            dotted = alias.name
            while dotted and dotted not in modules:  # `import a.b.c` names its deepest module
                dotted = dotted.rpartition(".")[0]
            if dotted:
                found.add(dotted)
        return found
    assert isinstance(node, ast.ImportFrom)
    if node.level:
        here = name.split(".") if is_package else name.split(".")[:-1]
        base_parts = here[: len(here) - (node.level - 1)]
        base = ".".join(base_parts + ([node.module] if node.module else []))
    else:
        base = node.module or ""
    if not base.startswith(PACKAGE):
        return set()
    found = set()
    for alias in node.names:
        sub = f"{base}.{alias.name}"
        if sub in modules:
            found.add(sub)  # `from pkg import module`
        elif base in modules:
            found.add(base)  # `from module import name`
    return found


def import_graph() -> dict[str, set[str]]:
    """module → the package modules it imports anywhere in its source."""
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        edges = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                edges |= _targets(node, name, path.name == "__init__.py", modules)
        edges.discard(name)
        graph[name] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_package_has_no_import_cycle():
    graph = import_graph()
    assert len(graph) > 50 and graph["oscar_zoo.runtime.ops"]  # the walk found the package and its imports
    found = cycles(graph)
    assert not found, "import cycles (modules that import each other, at any level):\n" + "\n".join(
        " ↔ ".join(c) for c in found)


def test_the_walk_sees_imports_inside_functions_and_relative_levels():
    """The checker itself: a function-level `from .b import x` of a module is an edge, and a cycle through it is
    found."""
    modules = {"oscar_zoo.p": Path("p/__init__.py"), "oscar_zoo.p.a": Path("p/a.py"), "oscar_zoo.p.b": Path("p/b.py")}
    tree = ast.parse("def f():\n    from .b import x\n")
    node = next(n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom))
    assert _targets(node, "oscar_zoo.p.a", False, modules) == {"oscar_zoo.p.b"}
    tree = ast.parse("from . import a\n")
    node = next(n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom))
    assert _targets(node, "oscar_zoo.p", True, modules) == {"oscar_zoo.p.a"}
    assert cycles({"x": {"y"}, "y": {"z"}, "z": {"x"}, "w": {"x"}}) == [["x", "y", "z"]]


# The levels of docs/architecture.md, top first: a module may import its own unit (package or top-level module) and
# the units of any level below, never a level above nor a unit beside it on its own level. The root package (its
# `__version__`) is below everything. A unit missing here fails the test: a new module takes its place first.
LAYERS = (
    ("__main__",),  # `python -m oscar_zoo`
    ("cli",),  # the `oscar-zoo` entry point: the one error boundary
    ("commands",),  # typer: options, tables, exit codes
    ("console",),  # rich, for cli and commands only
    ("calibration", "evaluation", "hub", "export"),  # the work; none imports another
    ("artifacts", "models", "texts"),  # folders on disk, loading models, the calibration and held-out text
    ("errors",),  # the errors a command reports, with their exit codes
    ("runtime",),  # importable with torch and transformers alone
    ("attention_binding",),  # a value bound to a model's attention modules (the runtime's binding, capture, scoring)
    ("format",),  # the artifact format, torch alone
    ("",),  # oscar_zoo itself: __version__
)


def _unit(module: str) -> str:
    """The package or top-level module under oscar_zoo that `module` belongs to ("" for oscar_zoo itself)."""
    return module.split(".")[1] if "." in module else ""


def layering_violations(graph: dict[str, set[str]]) -> list[str]:
    """Every import that points up a level or sideways to a unit beside its own, as 'a → b (why)'."""
    level = {unit: i for i, units in enumerate(LAYERS) for unit in units}
    out = []
    for a in sorted(graph):
        for b in sorted(graph[a]):
            ua, ub = _unit(a), _unit(b)
            if ua == ub:
                continue
            if ua not in level or ub not in level:
                out.append(f"{a} → {b} ({ua if ua not in level else ub!r} has no level in LAYERS)")
            elif level[ua] > level[ub]:
                out.append(f"{a} → {b} (up: {ub} is above {ua})")
            elif level[ua] == level[ub]:
                out.append(f"{a} → {b} (sideways: {ua} and {ub} share a level)")
    return out


def test_imports_follow_the_layers_of_the_architecture():
    graph = import_graph()
    assert {_unit(m) for m in graph} <= {u for units in LAYERS for u in units}, "a unit without a level in LAYERS"
    found = layering_violations(graph)
    assert not found, "imports against docs/architecture.md's levels:\n" + "\n".join(found)


def test_the_layer_check_sees_up_and_sideways_arrows():
    graph = {"oscar_zoo.evaluation.x": {"oscar_zoo.calibration.y", "oscar_zoo.format.z", "oscar_zoo.evaluation.w"},
             "oscar_zoo.format.z": {"oscar_zoo.runtime.v", "oscar_zoo"}, "oscar_zoo.newthing": {"oscar_zoo.format.z"}}
    assert layering_violations(graph) == [
        "oscar_zoo.evaluation.x → oscar_zoo.calibration.y (sideways: evaluation and calibration share a level)",
        "oscar_zoo.format.z → oscar_zoo.runtime.v (up: runtime is above format)",
        "oscar_zoo.newthing → oscar_zoo.format.z ('newthing' has no level in LAYERS)",
    ]
