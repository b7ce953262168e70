"""The package tree is layered: a module imports only from its own layer or the layers below
it, and no modules import each other in a circle.

Imports are read from the source (module level, inside functions and under TYPE_CHECKING
alike). The layers, top to bottom, are listed in :data:`LAYERS`; a module's layer is the
first entry its dotted name starts with. docs/architecture.md describes the same order.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "qstore"

#: Top to bottom. A module of a layer may import modules of its own layer and of the layers
#: after it, never of a layer before it.
LAYERS: list[tuple[str, ...]] = [
    ("qstore.__main__", "qstore.cli"),
    ("qstore", "qstore.tasks", "qstore.worker"),  # the public faces ("qstore" is __init__)
    ("qstore.runtime",),
    ("qstore.aio", "qstore.status"),
    ("qstore.storage",),
    ("qstore.migrations",),
    ("qstore.migrate",),
    ("qstore.schema",),
    ("qstore.sql",),
    ("qstore.types", "qstore.config", "qstore.errors", "qstore.outage", "qstore.embedded"),
]


def modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        name = ".".join(rel.parts)
        out[name.removesuffix(".__init__")] = path
    return out


MODULES = modules()


def _resolve(name: str) -> str | None:
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def imports(module: str) -> set[str]:
    """The package's modules that ``module`` imports (``from a import b`` counts a module ``a.b``
    when it exists, else ``a``)."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*parts, base] if base else parts)
            names = [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            target = _resolve(name)
            if target and target != module and not target.startswith(module + "."):
                found.add(target)
    return found


def layer(module: str) -> int:
    best: tuple[int, int] | None = None  # (prefix length, layer): the longest prefix wins
    for i, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            matches = module == prefix or module.startswith(prefix + ".")
            if matches and (best is None or len(prefix) > best[0]):
                best = (len(prefix), i)
    assert best is not None, f"{module} belongs to no layer: add it to LAYERS"
    return best[1]


def test_every_module_belongs_to_a_layer():
    for module in MODULES:
        layer(module)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_a_module_imports_only_its_own_layer_and_the_layers_below(module):
    upward = sorted(t for t in imports(module) if layer(t) < layer(module))
    assert not upward, f"{module} (layer {layer(module)}) imports from layers above it: {upward}"


def _cycle() -> list[str] | None:
    graph = {m: imports(m) for m in MODULES}
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return [*path[path.index(n):], n]
            if n not in state and (found := visit(n)):
                return found
        path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_no_modules_import_each_other_in_a_circle():
    assert _cycle() is None, f"import cycle: {' -> '.join(_cycle() or [])}"


def test_the_checks_see_an_upward_import_and_a_cycle(tmp_path, monkeypatch):
    # the reading itself must be able to fail: a storage module importing the runtime
    fake = {**MODULES, "qstore.storage.fake": tmp_path / "fake.py", "qstore.runtime.fake": tmp_path / "back.py"}
    (tmp_path / "fake.py").write_text("from qstore.runtime import fake\n")
    (tmp_path / "back.py").write_text("import qstore.storage.fake\n")
    monkeypatch.setattr(__import__(__name__), "MODULES", fake)
    assert imports("qstore.storage.fake") == {"qstore.runtime.fake"}
    assert layer("qstore.runtime.fake") < layer("qstore.storage.fake")
    assert _cycle() is not None
