"""The declaration of a job's columns (qstore.storage.columns) matches the database: the claim
statement's columns are ``claim_ready``'s result columns as the installed function reports
them (names, order and types), and its decoder fills every field of what it builds."""

from __future__ import annotations

import dataclasses
from datetime import datetime, timezone

import pytest
from sqlalchemy import text
from sqlalchemy.dialects import postgresql

from qstore import ClaimedEntry, JobRow, JobState
from qstore.storage.columns import CLAIMED, ORIGINAL_PRIORITY_KEY, claimed, field_names

PG = postgresql.dialect()


def function_result(engine, schema: str, function: str) -> list[tuple[str, str]]:
    """``(name, type)`` of each result column of ``schema.function`` (its ``RETURNS TABLE``
    columns: the OUT arguments of mode ``t``), in order, as the catalog holds them."""
    with engine.connect() as conn:
        rows = conn.execute(text("""
            SELECT a.name, format_type(a.type, NULL)
            FROM pg_proc p
            JOIN pg_namespace n ON n.oid = p.pronamespace
            CROSS JOIN LATERAL unnest(p.proargnames, p.proargmodes::text[], p.proallargtypes)
                 WITH ORDINALITY AS a(name, mode, type, position)
            WHERE n.nspname = :schema AND p.proname = :function AND a.mode = 't'
            ORDER BY a.position"""), {"schema": schema, "function": function}).all()
    return [(r[0], r[1]) for r in rows]


def declared(columns) -> list[tuple[str, str]]:
    return [(c.name, c.type.compile(dialect=PG).lower()) for c in columns]


def test_the_claim_declaration_is_claim_ready_s_result(engine, storage):
    result = function_result(engine, storage.schema(), "claim_ready")
    assert len(result) > 20
    assert declared(CLAIMED) == result


def test_a_drifted_declaration_is_told_apart(engine, storage):
    """The comparison sees a reordering and a changed type."""
    result = function_result(engine, storage.schema(), "claim_ready")
    swapped = list(CLAIMED)
    swapped[0], swapped[1] = swapped[1], swapped[0]
    assert declared(swapped) != result
    retyped = [dataclasses.replace(c, type=postgresql.INTEGER()) if c.name == "priority" else c for c in CLAIMED]
    assert declared(retyped) != result


def row(**values: object) -> tuple[object, ...]:
    now = datetime(2026, 1, 2, tzinfo=timezone.utc)
    base: dict[str, object] = {c.name: i for i, c in enumerate(CLAIMED)}
    base.update(queue="q", kind="k", args={"a": 1}, run_at=now, created_at=now, claimed_at=now,
                deadline_at=None, unique_key=None, unique_states=None, payload=None)
    base.update(values)
    return tuple(base[c.name] for c in CLAIMED)


def test_the_decoder_fills_every_field_from_its_column():
    c = claimed(row(priority=3, effective_priority=3), True)
    by_name = dict(zip([x.name for x in CLAIMED], row(priority=3, effective_priority=3), strict=True))
    assert set(vars(c.job)) == field_names(JobRow) and set(vars(c.claim)) == field_names(ClaimedEntry)
    for col in CLAIMED:
        for f in col.job:
            assert getattr(c.job, f) == by_name[col.name], f
        if col.claim:
            assert getattr(c.claim, col.claim) == by_name[col.name], col.claim
    assert (c.job.state, c.job.finalized_at, c.job.callback_id) == (JobState.RUNNING, None, None)
    assert (c.job.metadata, c.job.tags, c.job.errors, c.job.progress) == ({}, [], None, None)
    assert c.claim.lease_claim_receipt is True and claimed(row(), False).claim.lease_claim_receipt is False


@pytest.mark.parametrize(("metadata", "stamped"), [({"m": 1}, 4), ({ORIGINAL_PRIORITY_KEY: 9}, 9)])
def test_the_decoder_reads_the_payload_and_stamps_an_aged_priority(metadata, stamped):
    payload = {"metadata": metadata, "tags": ["t"], "errors": [{"error": "x"}], "progress": {"p": 1}}
    c = claimed(row(priority=4, effective_priority=2, payload=payload), True)
    assert (c.job.priority, c.claim.priority) == (2, 4)
    assert c.job.metadata == {**metadata, ORIGINAL_PRIORITY_KEY: stamped}
    assert (c.job.tags, c.job.errors, c.job.progress) == (["t"], [{"error": "x"}], {"p": 1})
    assert payload["metadata"] == metadata  # the row's payload is not changed
    assert dataclasses.replace(c.job) == c.job
