"""Round trips of the hot calls, counted on the wire (libpq's protocol trace of the one
pooled connection an engine of pool size 1 has): an enqueue, an empty claim and a fast
completion on an ``Engine`` are one round trip each, with no BEGIN or COMMIT; in a caller's
transaction an enqueue is one statement there."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from psycopg import pq
from sqlalchemy import Engine, create_engine

from qstore import InsertOpts, InsertParams


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
