"""The import directions between hybridkv's top-level packages, locked in (issue 24).

An AST scan of every module under ``src/hybridkv`` (imports inside functions included)
lists the arrows between top-level packages and modules; any arrow not in ALLOWED fails
with the two modules that drew it. Adding an arrow is a design decision: make it here.
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
    "cli": {"engine", "engine_config", "core", "planner", "scheduler", "checkpoint", "tokenizer", "errors", "sampling_params",
            "structured_outputs", "protocol", "server", "router", "__init__"},
    "__init__": {"core", "planner", "errors"},
    "__main__": {"cli"},
}


def _package(rel: Path) -> str:
    """``core/block_pool.py`` -> ``core``; ``errors.py`` -> ``errors``."""
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def _targets(node: ast.AST, module: list[str]) -> list[str]:
    """The hybridkv top-level names an import statement reaches."""
    if isinstance(node, ast.Import):
        full = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom):
        if node.level:  # relative: from the module's package upwards
            # ``module`` of a package's __init__ ends in "__init__": one level is the package itself
            base = module[: len(module) - node.level]
            full = [".".join(base + ([node.module] if node.module else []))]
        else:
            full = [node.module or ""]
        if full == ["hybridkv"]:  # from hybridkv import errors, __version__
            full = [f"hybridkv.{a.name}" for a in node.names]
    else:
        return []
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
