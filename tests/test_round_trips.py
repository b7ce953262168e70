"""Round trips of the hot calls, counted on the wire (libpq's protocol trace of the one
pooled connection an engine of pool size 1 has): an enqueue, an empty claim and a fast
completion on an ``Engine`` are one round trip each, with no BEGIN or COMMIT; in a caller's
transaction an enqueue is one statement there. A promotion pass that finds nothing due is one
round trip per state (whether it promotes one state or both), a statement the server planned
once for the connection."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta, timezone

import pytest
from psycopg import pq
from sqlalchemy import Engine, create_engine, text

from qstore import InsertOpts, InsertParams
from qstore.types import JobState


@pytest.fixture
def one_connection(db_url: str) -> Iterator[Engine]:
    eng = create_engine(db_url, pool_size=1, max_overflow=0)
    yield eng
    eng.dispose()


class Wire:
    """What the client sent while tracing: protocol message names, in order."""

    def __init__(self) -> None:
        self.sent: list[str] = []

    @property
    def round_trips(self) -> int:
        # every extended-protocol exchange ends with Sync; a simple query is one Query
        return sum(m in ("Sync", "Query") for m in self.sent)


def pooled_pgconn(engine: Engine) -> pq.abc.PGconn:
    """The libpq connection of the engine's only pooled connection."""
    raw = engine.raw_connection()
    try:
        return raw.driver_connection.pgconn
    finally:
        raw.close()


@contextmanager
def wire(pgconn: pq.abc.PGconn) -> Iterator[Wire]:
    seen = Wire()
    with tempfile.TemporaryFile("w+") as log:
        pgconn.trace(log.fileno())
        pgconn.set_trace_flags(pq.Trace.SUPPRESS_TIMESTAMPS)
        try:
            yield seen
        finally:
            pgconn.untrace()
            log.seek(0)
            for line in log.read().splitlines():
                parts = line.split("\t")
                if len(parts) >= 3 and parts[0] == "F":
                    seen.sent.append(parts[2])


def job(**opts: object) -> InsertParams:
    opts.setdefault("queue", "q")
    return InsertParams("k", {"n": 1}, InsertOpts(**opts))


def test_single_job_enqueue_on_an_engine_is_one_round_trip(one_connection, storage):
    storage.enqueue(one_connection, job())
    with wire(pooled_pgconn(one_connection)) as sent:
        storage.enqueue(one_connection, job())
    assert sent.round_trips == 1 and "Query" not in sent.sent  # no BEGIN, no COMMIT


def test_empty_claim_on_an_engine_is_one_round_trip(one_connection, storage):
    storage.claim_runtime_batch(one_connection, "q", 10)
    with wire(pooled_pgconn(one_connection)) as sent:
        assert storage.claim_runtime_batch(one_connection, "q", 10) == []
    assert sent.round_trips == 1 and "Query" not in sent.sent


def test_claim_and_fast_completion_on_an_engine_are_one_round_trip_each(one_connection, storage):
    storage.enqueue(one_connection, job())
    with wire(pooled_pgconn(one_connection)) as sent:
        claimed = storage.claim_runtime_batch(one_connection, "q", 10)
        assert len(storage.complete_runtime_batch(one_connection, claimed)) == 1
    assert sent.round_trips == 2 and "Query" not in sent.sent


def test_enqueue_in_a_callers_transaction_adds_one_statement_to_it(one_connection, storage):
    with one_connection.connect() as conn:
        conn.begin()
        storage.load_job(conn, 1)  # the caller's transaction is under way
        with wire(conn.connection.driver_connection.pgconn) as sent:
            storage.enqueue(conn, job())
        conn.commit()
    assert sent.round_trips == 1


def _nothing_due_for_promotion(engine: Engine, storage) -> None:
    """Waits of every kind a promotion must pass over: one not yet due in the wheel, one due
    beyond the wheel's span (an overflow row), a paused queue's due one, and a due one
    already promoted (its wheel entry stays until its slot is truncated, marked)."""
    at = datetime.now(timezone.utc)
    storage.enqueue_many(engine, [job(run_at=at + timedelta(minutes=5)), job(run_at=at + timedelta(hours=2)),
                                  job(queue="held", run_at=at - timedelta(seconds=1)),
                                  job(run_at=at - timedelta(seconds=1))])
    storage.set_queue_options(engine, "held", paused=True)
    assert storage.promote_due(engine, JobState.SCHEDULED, 10) == 1


def test_a_promotion_pass_that_finds_nothing_due_is_one_round_trip_per_state(one_connection, storage):
    _nothing_due_for_promotion(one_connection, storage)
    for state in (JobState.SCHEDULED, JobState.RETRYABLE):
        assert storage.promote_due(one_connection, state, 10) == 0
    with wire(pooled_pgconn(one_connection)) as sent:
        for state in (JobState.SCHEDULED, JobState.RETRYABLE):
            assert storage.promote_due(one_connection, state, 10) == 0
    # no BEGIN or COMMIT, and no Parse: the statement prepared by the first pass is reused
    assert sent.round_trips == 2 and "Query" not in sent.sent and "Parse" not in sent.sent, sent.sent


def test_a_promotion_of_both_states_that_finds_nothing_due_is_one_round_trip_per_state(one_connection, storage):
    _nothing_due_for_promotion(one_connection, storage)
    nothing = {JobState.SCHEDULED: 0, JobState.RETRYABLE: 0}
    assert storage.promote_all_due(one_connection, 10) == nothing
    with wire(pooled_pgconn(one_connection)) as sent:
        assert storage.promote_all_due(one_connection, 10) == nothing
    assert sent.round_trips == 2 and "Query" not in sent.sent and "Parse" not in sent.sent, sent.sent


def test_the_promotion_probe_is_planned_once_per_connection(one_connection, storage):
    _nothing_due_for_promotion(one_connection, storage)
    for _ in range(3):
        assert storage.promote_due(one_connection, JobState.RETRYABLE, 10) == 0
    with one_connection.connect() as conn:
        plans = conn.execute(text(
            "SELECT generic_plans, custom_plans FROM pg_prepared_statements "
            "WHERE statement LIKE :probe AND statement LIKE :schema"),
            {"probe": "%deferred_wheel_marks%'retryable'%", "schema": f"%{storage.schema()}.%"}).all()
    assert [tuple(p) for p in plans] == [(3, 0)]  # one generic plan, made once and reused
