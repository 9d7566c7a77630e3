"""The package layers of docs/architecture.md, checked on the source: who may import whom,
and no import cycle anywhere (a function-level import included)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[2]
# Package -> its folder: pyproject.toml's package-dir (the design card's flat layout).
FOLDERS: dict[str, str] = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"][
    "setuptools"
]["package-dir"]
# Small leaf modules every layer above the core may use.
BASE = {"kiln.version", "kiln.paths", "kiln.terminal"}
# Layer -> the layers it may import (besides itself and BASE). Bottom first.
ALLOWED = {
    "kiln.core": set(),
    "kiln.version": set(),
    "kiln.paths": set(),
    "kiln.terminal": set(),
    "kiln.args": set(),
    "kiln.kernels": {"kiln.core", "kiln.paths"},
    "kiln.models": {"kiln.core"},
    "kiln.passes": {"kiln.core", "kiln.kernels", "kiln.args"},
    "kiln.runtime": {"kiln.core", "kiln.kernels", "kiln.args", "kiln.paths", "kiln.terminal"},
    "kiln.serve": {"kiln.core", "kiln.runtime", "kiln.args", "kiln.terminal", "kiln"},
    "kiln.compiler": {
        "kiln.core",
        "kiln.kernels",
        "kiln.models",
        "kiln.passes",
        "kiln.args",
        "kiln.paths",
        "kiln.terminal",
        "kiln",
    },
}


def modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for package, folder in FOLDERS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT / folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            name = ".".join([package, *parts])
            found.setdefault(name, path)
    return found


def layer(module: str) -> str:
    for name in sorted(ALLOWED, key=len, reverse=True):
        if module == name or module.startswith(name + "."):
            return name
    return "kiln"  # the root: cli, example, __init__ (may import anything)


def imports(path: Path, module: str) -> dict[str, int]:
    """kiln modules `path` imports (type-checking-only imports aside), with a line each."""
    tree = ast.parse(path.read_text())
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip |= {id(n) for n in ast.walk(node)}
    found: dict[str, int] = {}
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
                base = f"{base}.{node.module}" if node.module else base
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            if name == "kiln" or name.startswith("kiln."):
                found.setdefault(name, node.lineno)
    return found


def resolved(name: str, known: dict[str, Path]) -> str | None:
    while name and name not in known:
        name = name.rsplit(".", 1)[0] if "." in name else ""
    return name or None


GRAPH = {m: imports(p, m) for m, p in modules().items()}
KNOWN = modules()


@pytest.mark.parametrize("module", sorted(GRAPH))
def test_a_module_imports_only_the_layers_below_it(module: str) -> None:
    mine = layer(module)
    if mine == "kiln":
        return
    bad = []
    for name, line in GRAPH[module].items():
        target = resolved(name, KNOWN)
        if target is None:
            continue
        theirs = layer(target)
        base = BASE if mine != "kiln.core" else set()
        if theirs != mine and theirs not in ALLOWED[mine] | base:
            bad.append(f"{KNOWN[module].relative_to(ROOT)}:{line} imports {target} ({theirs})")
    assert not bad, "\n".join(bad)


def test_no_import_cycle() -> None:
    edges = {
        m: {t for n in names if (t := resolved(n, KNOWN)) is not None and t != m}
        for m, names in GRAPH.items()
    }
    # A package's __init__ importing its own modules is how a package is assembled.
    for m in edges:
        edges[m] = {t for t in edges[m] if not m.startswith(t + ".") or t == "kiln"}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for t in sorted(edges.get(m, ())):
            if state.get(t) == 1:
                cycle = [*stack[stack.index(t) :], t]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if t not in state:
                visit(t)
        stack.pop()
        state[m] = 2

    for m in sorted(edges):
        if m not in state:
            visit(m)
