"""The head's SQL texts (``qstore/sql``) are what the revisions install.

Replaying the frozen statements of every revision in order (the last ``CREATE OR REPLACE``
of a function or view wins, a ``DROP`` removes it) must end with exactly the head's texts,
byte for byte, for several install shapes: the last revision that touched an object holds
the head's text of it, and no head text exists that no revision installs.
"""

from __future__ import annotations

import importlib
import re

import pytest

from qstore import QueueStorageConfig
from qstore.migrate import REVISIONS
from qstore.sql import FUNCTIONS, VIEWS, function_texts, view_texts

SHAPES = [
    QueueStorageConfig(),
    QueueStorageConfig(schema="texts_alt", queue_slot_count=4, lease_slot_count=2, claim_slot_count=3,
                       queue_stripe_count=2, lease_claim_receipts=False),
    QueueStorageConfig(schema="texts_big", queue_slot_count=64, lease_slot_count=16, claim_slot_count=32),
]
_CREATE = re.compile(r"CREATE (?:OR REPLACE )?(FUNCTION|VIEW) (\w+)\.(\w+)")
_DROP = re.compile(r"DROP (FUNCTION|VIEW) (?:IF EXISTS )?(\w+)\.(\w+)")


def replayed(cfg: QueueStorageConfig) -> dict[tuple[str, str], str]:
    """(kind, name) -> the text of the last statement that created it, over every revision."""
    objects: dict[tuple[str, str], str] = {}
    for revision in REVISIONS:
        module = importlib.import_module(f"qstore.migrations.frozen.r{revision}")
        for statement in module.upgrade(cfg):
            if created := _CREATE.match(statement):
                objects[(created.group(1), created.group(3))] = statement
            elif dropped := _DROP.match(statement):
                objects.pop((dropped.group(1), dropped.group(3)), None)
    return objects


def normalized(statement: str) -> str:
    # PostgreSQL keeps a view as its parsed query: only CREATE VIEW vs CREATE OR REPLACE VIEW
    # and nothing else may differ for views
    return statement.replace("CREATE VIEW ", "CREATE OR REPLACE VIEW ", 1)


@pytest.mark.parametrize("cfg", SHAPES, ids=lambda c: c.schema)
def test_the_revisions_install_exactly_the_head_functions(cfg):
    objects = replayed(cfg)
    installed = {name: text for (kind, name), text in objects.items() if kind == "FUNCTION"}
    assert sorted(installed) == sorted(FUNCTIONS)
    assert [installed[name] for name in FUNCTIONS] == list(function_texts(cfg))


@pytest.mark.parametrize("cfg", SHAPES, ids=lambda c: c.schema)
def test_the_revisions_install_exactly_the_head_views(cfg):
    objects = replayed(cfg)
    installed = {name: normalized(text) for (kind, name), text in objects.items() if kind == "VIEW"}
    assert sorted(installed) == sorted(VIEWS)
    assert [installed[name] for name in VIEWS] == list(view_texts(cfg))


def _tokens(statement: str) -> str:
    return " ".join(re.sub(r"--[^\n]*", "", statement).split())


@pytest.mark.parametrize("cfg", SHAPES, ids=lambda c: c.schema)
def test_revision_0010_changes_the_layout_of_the_texts_only(cfg):
    r0010 = importlib.import_module("qstore.migrations.frozen.r0010")
    before = [_tokens(normalized(t)) for t in r0010.downgrade(cfg)]
    after = [_tokens(t) for t in r0010.upgrade(cfg)][:len(before)]
    assert before == after


def test_a_head_text_renders_one_branch_per_ring_slot():
    text = dict(zip(FUNCTIONS, function_texts(SHAPES[1]), strict=True))["claim_ready"]
    assert "texts_alt.ready_entries_3 r" in text and "ready_entries_4" not in text
    assert text.count("ELSIF v_guess = ") == 3
