"""The declaration of a job's columns (qstore.storage.columns) matches the database: the claim
statement's columns are ``claim_ready``'s result columns as the installed function reports
them (names, order and types), a job's body columns are those of every table and view that
holds whole jobs, and the decoders fill every field of what they build."""

from __future__ import annotations

import dataclasses
from datetime import datetime, timezone

import pytest
from sqlalchemy import text
from sqlalchemy.dialects import postgresql

from qstore import ClaimedEntry, JobRow, JobState
from qstore.storage import columns
from qstore.storage.columns import (
    BODY,
    CLAIMED,
    ORIGINAL_PRIORITY_KEY,
    body_job,
    body_values,
    claimed,
    field_names,
)

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


def relation_columns(engine, schema: str, relation: str) -> dict[str, str]:
    """``{name: type}`` of the columns of ``schema.relation`` (a table or a view) in the catalog."""
    with engine.connect() as conn:
        rows = conn.execute(text("""
            SELECT a.attname, format_type(a.atttypid, a.atttypmod)
            FROM pg_attribute a
            WHERE a.attrelid = to_regclass(quote_ident(:schema) || '.' || quote_ident(:relation))
              AND a.attnum > 0 AND NOT a.attisdropped"""), {"schema": schema, "relation": relation}).all()
    return {r[0]: r[1] for r in rows}


def declared(cols) -> list[tuple[str, str]]:
    return [(c.name, c.type.compile(dialect=PG).lower()) for c in cols]


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


@pytest.mark.parametrize("relation", ["ready_entries", "deferred_jobs", "dlq_entries", "done_entries",
                                      "terminal_jobs"])
def test_the_body_declaration_is_every_job_table_s(engine, storage, relation):
    found = relation_columns(engine, storage.schema(), relation)
    assert found, relation
    assert [(c.name, found.get(c.name)) for c in BODY] == declared(BODY)


def test_a_declaration_missing_a_field_is_refused():
    """The decoder is generated at import only from a declaration that fills every field."""
    no_kind = tuple(c for c in CLAIMED if c.name != "kind")
    with pytest.raises(TypeError, match=r"JobRow\.kind"):
        columns._fixed_fields(no_kind, state=JobState.RUNNING)
    typo = tuple(dataclasses.replace(c, job=("progres",)) if c.name == "deadline_at" else c for c in CLAIMED)
    with pytest.raises(TypeError, match="progres"):
        columns._check_fills(typo, columns._fixed_fields(typo, state=JobState.RUNNING), "lease_claim_receipt")
    with pytest.raises(TypeError, match="ClaimedEntry"):
        columns._check_fills(CLAIMED, columns._fixed_fields(CLAIMED, state=JobState.RUNNING), "no_such_field")


def test_a_body_reads_back_as_it_was_written():
    now = datetime(2026, 1, 2, tzinfo=timezone.utc)
    job = JobRow(id=7, kind="k", queue="q#1", args={"a": [1]}, state=JobState.RETRYABLE, priority=3, attempt=2,
                 run_lease=4, max_attempts=5, run_at=now, created_at=now, attempted_at=now,
                 errors=[{"error": "x"}], metadata={"m": 1}, tags=["t"], unique_key=b"k", unique_states="11111000",
                 progress={"p": 1})
    values = body_values(job)
    assert list(values) == [c.name for c in BODY]
    assert values["payload"] == {"metadata": {"m": 1}, "tags": ["t"], "errors": [{"error": "x"}], "progress": {"p": 1}}

    class Row:
        pass

    stored = Row()
    vars(stored).update(values)
    assert body_job(stored, JobState.RETRYABLE) == job
    assert body_values(dataclasses.replace(job, errors=None, metadata={}, tags=[], progress=None))["payload"] is None


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
