"""The package's dependencies point one way (README, "Where things live").

Every module's imports are read with `ast`, those inside functions included, and grouped by
package-level unit: a subpackage (`jaxrag.models`, `jaxrag.pipeline`, ...) or a top-level module
(`jaxrag.errors`, `jaxrag.serve`, ...). Units sit in layers; a unit imports its own layer or
lower ones, never a higher one, and no units (nor modules) import each other round in a cycle. The documented
CLIs' entry modules sit above every layer: they may import anything, and only another entry
imports them.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "jaxrag"

# Lowest first. A unit may import units of its own layer or of a lower one.
LAYERS = (
    ("shared", {"jaxrag.errors", "jaxrag.sharding", "jaxrag.runtime"}),
    ("library", {"jaxrag", "jaxrag.models", "jaxrag.prompts", "jaxrag.decode", "jaxrag.policies",
                 "jaxrag.retrieval", "jaxrag.train", "jaxrag.eval", "jaxrag.data", "jaxrag.world", "jaxrag.serve"}),
    ("planner", {"jaxrag.plan"}),
    ("pipeline", {"jaxrag.pipeline"}),
)
# `python -m` entries of the documented CLIs (docs/pipeline.md).
ENTRIES = {
    "jaxrag.pipeline.__main__", "jaxrag.train.__main__", "jaxrag.plan.__main__", "jaxrag.retrieval.__main__",
    "jaxrag.eval.tau", "jaxrag.eval.seeds", "jaxrag.datastore", "jaxrag.convert", "jaxrag.export",
}
# Entries that only hand over to the tool living in a higher layer: a docstring, imports, `main`.
THIN_ENTRIES = {"jaxrag.train.__main__", "jaxrag.eval.tau", "jaxrag.eval.seeds"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def unit(module: str) -> str:
    return ".".join(module.split(".")[:2])


def imports(module: str) -> list[tuple[str, int, bool]]:
    """(imported jaxrag module, line, inside a function) for every import statement of `module`."""
    tree = ast.parse(MODULES[module].read_text(encoding="utf-8"))
    top = {id(node) for node in tree.body}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{module}:{node.lineno}: relative import"
            # `from pkg import sub` imports the module pkg.sub when there is one, else a name of pkg
            names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in MODULES else node.module
                     for a in node.names]
        else:
            continue
        for name in names:
            while name and name not in MODULES:
                name = name.rpartition(".")[0]
            if name:
                out.append((name, node.lineno, id(node) not in top))
    return out


EDGES = [(m, target, line, inner) for m in MODULES for target, line, inner in imports(m) if target != m]


def layer_of(module: str) -> int:
    return next(i for i, (_, units) in enumerate(LAYERS) if unit(module) in units)


def test_every_unit_has_a_layer():
    missing = sorted({unit(m) for m in MODULES if m not in ENTRIES} - set().union(*(u for _, u in LAYERS)))
    assert not missing, f"units in no layer of LAYERS: {missing}"


def test_no_upward_import():
    upward = [f"{m}:{line} imports {t} ({LAYERS[layer_of(m)][0]} -> {LAYERS[layer_of(t)][0]})"
              for m, t, line, _ in EDGES if m not in ENTRIES and t not in ENTRIES and layer_of(t) > layer_of(m)]
    assert not upward, "imports from a lower layer into a higher one:\n" + "\n".join(upward)


def test_only_entries_import_entries():
    bad = [f"{m}:{line} imports the entry {t}" for m, t, line, _ in EDGES if t in ENTRIES and m not in ENTRIES]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("grouped", [unit, lambda module: module], ids=["units", "modules"])
def test_no_import_cycle(grouped):
    graph: dict[str, dict[str, str]] = {}
    for m, t, line, inner in EDGES:
        if m not in ENTRIES and t not in ENTRIES and grouped(m) != grouped(t):
            graph.setdefault(grouped(m), {}).setdefault(
                grouped(t), f"{m}:{line} -> {t}" + (" (in a function)" if inner else ""))
    cycles = [c for c in strongly_connected(graph) if len(c) > 1]
    assert not cycles, "import cycles:\n" + "\n".join(
        " / ".join(graph[a][b] for a in sorted(c) for b in sorted(c) if b in graph.get(a, {})) for c in cycles)


def test_the_top_level_shows_the_architecture():
    """At most 8 modules directly in jaxrag/ besides __init__.py: the documented CLIs and what every
    layer shares; everything else lives in the package of its layer (runtime helpers in
    jaxrag/runtime/)."""
    top = sorted(p.name for p in PACKAGE.glob("*.py") if p.name != "__init__.py")
    assert len(top) <= 8, top


def test_entries_are_thin():
    for name in THIN_ENTRIES:
        tree = ast.parse(MODULES[name].read_text(encoding="utf-8"))
        kinds = {type(node).__name__ for node in tree.body[1:]}
        assert kinds <= {"Import", "ImportFrom", "If"}, f"{name} does more than hand over: {kinds}"


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m not in ENTRIES))
def test_imports_inside_functions_say_why(module):
    """An import inside a function (of jaxrag or of another package) keeps something heavy or
    optional from loading too early: a comment on its line, or just above its group of imports,
    says what and why."""
    text = MODULES[module].read_text(encoding="utf-8")
    lines = text.splitlines()
    inner = {node.lineno for fn in ast.walk(ast.parse(text)) if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
             for node in ast.walk(fn) if isinstance(node, (ast.Import, ast.ImportFrom))}
    for line in sorted(inner):
        at = line - 1
        while at > 0 and lines[at - 1].lstrip().startswith(("from ", "import ")):
            at -= 1  # the first import of the group
        said = "#" in lines[line - 1] or (at > 0 and lines[at - 1].lstrip().startswith("#"))
        assert said, f"{module}:{line}: import inside a function without a comment saying why"


def strongly_connected(graph: dict[str, dict[str, str]]) -> list[set[str]]:
    """Tarjan's strongly connected components of `graph` (node -> successors)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            out.append(component)

    for v in sorted(set(graph) | {w for ws in graph.values() for w in ws}):
        if v not in index:
            visit(v)
    return out
