"""Landed revisions are frozen: each installs exactly the text it was written with.

Every revision's upgrade and downgrade are rendered for two install shapes and compared with
the digests recorded in ``tests/data/revision_digests.json`` when the revision landed. A new
revision records its digests once (``python tests/test_revision_freeze.py --record``, which
only ever adds entries); changing the text of a recorded revision fails here.
"""

from __future__ import annotations

import ast
import hashlib
import importlib
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest
from alembic.script import ScriptDirectory

from qstore import QueueStorageConfig
from qstore.migrate import REVISIONS, alembic_config

DIGESTS = Path(__file__).with_name("data") / "revision_digests.json"
FROZEN = Path(__file__).resolve().parents[1] / "qstore" / "migrations" / "frozen"
SHAPES = {
    "default": QueueStorageConfig(),
    "custom": QueueStorageConfig(schema="frozen_alt", queue_slot_count=4, lease_slot_count=2,
                                 claim_slot_count=3, queue_stripe_count=2,
                                 lease_claim_receipts=False),
}


def frozen_module(revision: str) -> ModuleType:
    return importlib.import_module(f"qstore.migrations.frozen.r{revision}")


def rendered(revision: str, shape: str, direction: str) -> str:
    statements = getattr(frozen_module(revision), direction)(SHAPES[shape])
    return "\n;\n".join(statements)


def digests_now() -> dict[str, dict[str, str]]:
    return {rev: {f"{shape}.{d}": hashlib.sha256(rendered(rev, shape, d).encode()).hexdigest()
                  for shape in SHAPES for d in ("upgrade", "downgrade")}
            for rev in REVISIONS}


def script_revisions() -> list[str]:
    script = ScriptDirectory.from_config(alembic_config(QueueStorageConfig()))
    return [s.revision for s in reversed(list(script.walk_revisions()))]


def test_every_alembic_revision_is_listed_in_order():
    assert script_revisions() == list(REVISIONS)


@pytest.mark.parametrize("revision", REVISIONS)
def test_landed_revision_renders_the_recorded_text(revision):
    recorded = json.loads(DIGESTS.read_text())
    assert revision in recorded, f"revision {revision} has no recorded digest: run --record once"
    assert digests_now()[revision] == recorded[revision], (
        f"revision {revision} renders different SQL than when it landed; "
        "a change to the schema or a function body must be a new revision")


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_frozen_templates_import_only_the_standard_library_mako_and_each_other():
    # Mako renders the SQL texts a revision keeps as files (from revision 0010 on); the
    # digests above pin what it renders.
    for path in FROZEN.glob("r*.py"):
        for name in _imports(path):
            assert name in ("__future__", "collections.abc", "typing", "importlib", "mako.template") or \
                name.startswith("qstore.migrations.frozen"), f"{path.name} imports {name}"


def test_each_revision_module_runs_its_own_frozen_template():
    versions = FROZEN.parent / "versions"
    for revision in REVISIONS:
        (path,) = versions.glob(f"qstore_{revision}_*.py")
        imports = _imports(path)
        assert imports <= {"__future__", "typing", "alembic", "qstore.migrate",
                           "qstore.migrations.frozen"}, path.name
        source = path.read_text()
        assert f"r{revision}.upgrade(" in source and f"r{revision}.downgrade(" in source


def test_revision_0001_has_no_dlq_policy_column_and_0002_adds_it():
    assert "dlq_enabled" not in rendered("0001", "default", "upgrade")
    assert "ADD COLUMN dlq_enabled" in rendered("0002", "default", "upgrade")


def test_custom_shape_renders_one_ring_child_per_slot():
    text = rendered("0001", "custom", "upgrade")
    assert "frozen_alt.ready_entries_3 PARTITION OF" in text
    assert "ready_entries_4 " not in text
    assert "frozen_alt.lease_claims_2 PARTITION OF" in text


if __name__ == "__main__":  # pragma: no cover - maintenance entry point
    if sys.argv[1:] != ["--record"]:
        raise SystemExit("usage: python tests/test_revision_freeze.py --record")
    recorded = json.loads(DIGESTS.read_text()) if DIGESTS.exists() else {}
    for rev, digest in digests_now().items():
        recorded.setdefault(rev, digest)  # never overwrite what landed
    DIGESTS.write_text(json.dumps(recorded, indent=2, sort_keys=True) + "\n")
    print(f"recorded {sorted(recorded)}")
