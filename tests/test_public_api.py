"""The public API is what the documentation imports: README.md and docs/*.md import only from
``qstore``, ``qstore.tasks``, ``qstore.worker`` and ``qstore.aio``, every name they import
exists there, and every public type is exported from ``qstore``."""

from __future__ import annotations

import dataclasses
import enum
import importlib
import re

import pytest
from docblocks import README, REPO

import qstore
import qstore.types

PUBLIC_MODULES = ("qstore", "qstore.tasks", "qstore.worker", "qstore.aio")
DOCS = [README, *sorted((REPO / "docs").glob("*.md"))]

_FROM = re.compile(r"^\s*from\s+(?P<module>qstore[\w.]*)\s+import\s+(?P<names>\([^)]*\)|[^\n#]+)", re.M)
_IMPORT = re.compile(r"^\s*import\s+(?P<modules>qstore[\w., ]*)", re.M)


def doc_imports(text: str) -> list[tuple[str, list[str]]]:
    """``(module, names)`` of every ``from qstore… import …`` line of ``text`` and
    ``(module, [])`` of every ``import qstore…``."""
    out = [(m["module"], [n.split(" as ")[0].strip() for n in m["names"].strip("() \n").split(",") if n.strip()])
           for m in _FROM.finditer(text)]
    out += [(module.split(" as ")[0].strip(), []) for m in _IMPORT.finditer(text)
            for module in m["modules"].split(",")]
    return out


def test_the_import_scanner_sees_every_form():
    text = ("from qstore import A, B\nfrom qstore.storage.jobs import (\n    C,\n    D,\n)\n"
            "    import qstore.status as st, qstore\n")
    assert doc_imports(text) == [("qstore", ["A", "B"]), ("qstore.storage.jobs", ["C", "D"]),
                                 ("qstore.status", []), ("qstore", [])]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_docs_import_only_the_public_modules(doc):
    private = [module for module, _ in doc_imports(doc.read_text()) if module not in PUBLIC_MODULES]
    assert private == [], f"{doc.name} imports from private modules"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_name_the_docs_import_exists(doc):
    for module, names in doc_imports(doc.read_text()):
        if module not in PUBLIC_MODULES:
            continue
        public = importlib.import_module(module)
        for name in names:
            if module == "qstore" and name == "migrate":  # a host's Alembic env.py hooks
                continue
            assert name in public.__all__, f"{doc.name}: {name} is not exported by {module}"


def test_every_public_type_is_exported_from_qstore():
    assert set(qstore.types.__all__) <= set(qstore.__all__)
    for name in qstore.__all__:
        assert getattr(qstore, name) is not None, name


def test_the_types_module_holds_only_public_types():
    """Everything ``qstore.types`` exports is a dataclass or an enum a caller passes or gets."""
    for name in qstore.types.__all__:
        obj = getattr(qstore.types, name)
        assert dataclasses.is_dataclass(obj) or issubclass(obj, enum.Enum), name
        assert obj.__module__ == "qstore.types", name
