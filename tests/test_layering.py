"""The import directions between hybridkv's top-level packages, locked in, and no import
cycle between its modules.

An AST scan of every module under ``src/hybridkv`` (imports inside functions and under
``if TYPE_CHECKING:`` included) lists the arrows between top-level packages and modules;
any arrow not in ALLOWED fails with the two modules that drew it. Adding an arrow is a
design decision: make it here. The same scan, module by module, builds the import graph
between modules; a cycle in it fails, naming its modules.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "hybridkv"

#: package -> the packages it may import (besides itself). Low to high.
ALLOWED: dict[str, set[str]] = {
    "errors": set(),
    "structured_outputs": {"errors"},
    "sampling_params": {"errors", "structured_outputs"},
    "core": {"errors"},
    "checkpoint": {"errors"},
    "tokenizer": {"checkpoint", "errors"},
    "planner": {"core", "checkpoint", "errors"},
    "scheduler": {"core", "errors", "sampling_params"},
    "protocol": {"core", "errors"},
    "engine_config": {"core", "errors", "scheduler"},
    "engine": {"core", "planner", "scheduler", "checkpoint", "tokenizer", "errors", "sampling_params", "engine_config",
               "structured_outputs"},
    "router": {"core", "errors", "protocol", "tokenizer", "__init__"},  # __init__: __version__
    "server": {"engine", "engine_config", "core", "planner", "scheduler", "checkpoint", "tokenizer", "errors", "sampling_params",
               "structured_outputs", "protocol", "__init__"},
    # hybridkv inside other serving systems (Ray Serve): over the server's app and the router's index
    "integrations": {"server", "router", "engine_config", "errors"},
    "cli": {"engine", "engine_config", "core", "planner", "scheduler", "checkpoint", "tokenizer", "errors", "sampling_params",
            "structured_outputs", "protocol", "server", "router", "integrations", "__init__"},
    "__init__": {"core", "planner", "errors"},
    "__main__": {"cli"},
}


def _package(rel: Path) -> str:
    """``core/block_pool.py`` -> ``core``; ``errors.py`` -> ``errors``."""
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def _imported(node: ast.AST, module: list[str]) -> list[tuple[str, list[str]]]:
    """(the absolute dotted name an import statement names, the names it takes from it):
    ``import a.b`` -> [("a.b", [])]; ``from ..core import specs`` in hybridkv.engine.llm ->
    [("hybridkv.core", ["specs"])]. Not an import: []."""
    if isinstance(node, ast.Import):
        return [(a.name, []) for a in node.names]
    if isinstance(node, ast.ImportFrom):
        if node.level:  # relative: from the module's package upwards
            # ``module`` of a package's __init__ ends in "__init__": one level is the package itself
            base = module[: len(module) - node.level]
            name = ".".join(base + ([node.module] if node.module else []))
        else:
            name = node.module or ""
        return [(name, [a.name for a in node.names])]
    return []


def _targets(node: ast.AST, module: list[str]) -> list[str]:
    """The hybridkv top-level names an import statement reaches."""
    full = []
    for name, names in _imported(node, module):
        if name == "hybridkv" and names:  # from hybridkv import errors, __version__
            full += [f"hybridkv.{a}" for a in names]
        else:
            full.append(name)
    out = []
    for name in full:
        parts = name.split(".")
        if parts[0] != "hybridkv":
            continue
        top = parts[1] if len(parts) > 1 else "__init__"
        out.append("__init__" if top == "__version__" else top)
    return out


def arrows() -> dict[tuple[str, str], list[str]]:
    """(from package, to package) -> the modules that import across it."""
    found: dict[tuple[str, str], list[str]] = {}
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC)
        module = ["hybridkv", *rel.with_suffix("").parts]
        src = _package(rel)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            for tgt in _targets(node, module):
                if tgt != src:
                    found.setdefault((src, tgt), []).append(".".join(module))
    return found


def test_every_import_arrow_is_allowed():
    bad = [f"{a} -> {b} (in {', '.join(sorted(set(mods)))})" for (a, b), mods in arrows().items()
           if b not in ALLOWED.get(a, set())]
    assert not bad, "imports against the layering (tests/test_layering.py ALLOWED):\n" + "\n".join(bad)


def test_every_top_level_package_is_placed():
    names = {_package(p.relative_to(SRC)) for p in SRC.rglob("*.py")}
    assert names <= set(ALLOWED), f"place these in ALLOWED: {sorted(names - set(ALLOWED))}"


def test_the_scan_sees_arrows():
    """Not vacuous: the scan finds the known arrows, relative imports included."""
    found = arrows()
    assert ("engine", "core") in found and ("cli", "engine") in found and ("router", "protocol") in found
    assert ("protocol", "errors") in found  # ``from hybridkv import errors as E``
    assert ("router", "server") not in found and ("server", "router") not in found
    tree = ast.parse("from ..core import specs\nfrom . import x\n")
    nodes = list(ast.walk(tree))
    got = [t for n in nodes for t in _targets(n, ["hybridkv", "engine", "llm"])]
    assert got == ["core", "engine"]
    init = [t for n in nodes for t in _targets(n, ["hybridkv", "engine", "__init__"])]
    assert init == ["core", "engine"]  # in engine/__init__.py, ``..core`` is hybridkv.core
    top = ast.parse("from .core import specs\n")
    assert [t for n in ast.walk(top) for t in _targets(n, ["hybridkv", "__init__"])] == ["core"]


# ------------------------------------------------------------------ module import graph
def _module_name(rel: Path) -> str:
    """``core/block_pool.py`` -> ``hybridkv.core.block_pool``; ``core/__init__.py`` -> ``hybridkv.core``."""
    parts = rel.with_suffix("").parts
    return ".".join(["hybridkv", *(parts[:-1] if parts[-1] == "__init__" else parts)])


def _resolve(name: str, modules: set[str]) -> str | None:
    """The module an imported dotted name runs: itself when it is one of ``modules`` (a
    package is its __init__), else its longest prefix that is (``hybridkv.x.attr``)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _edges(node: ast.AST, module: list[str], modules: set[str]) -> set[str]:
    """The hybridkv modules an import statement in ``module`` imports: ``from pkg import
    name`` imports the submodule ``pkg.name`` when there is one, else ``pkg`` (its
    __init__); ``import a.b`` imports a.b alone (not its parents' __init__)."""
    out = set()
    for name, names in _imported(node, module):
        if name.split(".")[0] != "hybridkv":
            continue
        for n in names or [None]:
            sub = f"{name}.{n}" if n is not None else None
            target = sub if sub in modules else _resolve(name, modules)
            if target is not None:
                out.add(target)
    return out


def import_graph(root: Path = SRC) -> dict[str, set[str]]:
    """Module -> the hybridkv modules it imports (anywhere in the file), itself left out."""
    files = {_module_name(p.relative_to(root)): p for p in sorted(root.rglob("*.py"))}
    modules = set(files)
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        module = ["hybridkv", *path.relative_to(root).with_suffix("").parts]
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            found |= _edges(node, module, modules)
        graph[name] = found - {name}
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The groups of modules that import each other (strongly connected components of
    more than one module, Tarjan's algorithm), each sorted; empty when there is no cycle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return sorted(found)


def a_cycle(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """A shortest import path from the component's first module back to it, inside it."""
    start, members = component[0], set(component)
    came_from: dict[str, str] = {}
    queue = [start]
    for node in queue:
        for child in sorted(graph[node] & members):
            if child == start:
                path = [node]
                while path[-1] != start:
                    path.append(came_from[path[-1]])
                return [start, *reversed(path[:-1]), start]
            if child not in came_from:
                came_from[child] = node
                queue.append(child)
    raise AssertionError(f"{component} is not a cycle")


def test_no_import_cycle_between_modules():
    graph = import_graph()
    cycles = import_cycles(graph)
    report = [f"{', '.join(c)}\n    e.g. {' -> '.join(a_cycle(graph, c))}" for c in cycles]
    assert not cycles, "modules of src/hybridkv that import each other (a cycle):\n" + "\n".join(report)


def test_the_module_graph_sees_imports_and_cycles(tmp_path):
    """Not vacuous: submodule and package imports, relative ones, imports in functions and
    under TYPE_CHECKING all count, and a cycle made of them is found."""
    pkg = tmp_path / "a"
    pkg.mkdir()
    (tmp_path / "__init__.py").write_text("from .a import x\n")  # x is a name in a/__init__
    (pkg / "__init__.py").write_text("x = 1\n")
    (pkg / "b.py").write_text("from hybridkv.a import c, x\n")
    (pkg / "c.py").write_text("def f():\n    from . import d\n")
    (pkg / "d.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import hybridkv.a.b\n")
    (pkg / "e.py").write_text("from ..a.b import y\nimport hybridkv\n")
    graph = import_graph(tmp_path)
    assert graph == {
        "hybridkv": {"hybridkv.a"},
        "hybridkv.a": set(),  # a package's __init__ does not import its submodules by itself
        "hybridkv.a.b": {"hybridkv.a.c", "hybridkv.a"},
        "hybridkv.a.c": {"hybridkv.a.d"},
        "hybridkv.a.d": {"hybridkv.a.b"},
        "hybridkv.a.e": {"hybridkv.a.b", "hybridkv"},
    }
    cycles = import_cycles(graph)
    assert cycles == [["hybridkv.a.b", "hybridkv.a.c", "hybridkv.a.d"]]
    assert a_cycle(graph, cycles[0]) == ["hybridkv.a.b", "hybridkv.a.c", "hybridkv.a.d", "hybridkv.a.b"]
    assert import_cycles({"p": {"q"}, "q": {"p"}, "r": {"p"}}) == [["p", "q"]]
    assert a_cycle({"p": {"q"}, "q": {"p"}}, ["p", "q"]) == ["p", "q", "p"]
