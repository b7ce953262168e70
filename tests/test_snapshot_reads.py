"""Reads that promise one snapshot over ring children stay consistent while upkeep truncates.

``TRUNCATE`` is not MVCC-safe: a snapshot taken before a prune commits sees the truncated
children empty while the rows the prune wrote (its rollup-ledger row) stay invisible to it.
A multi-statement read therefore locks the tables upkeep truncates (``ACCESS SHARE``) before
its snapshot is taken: a prune that meets it reports ``Blocked`` and truncates nothing until
the read ends. Each test commits the upkeep from another engine at a deterministic point:
inside the read, just before one of its statements is sent.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from jobtools import params
from sqlalchemy import Engine, create_engine, event

from qstore import QueueStorage, status
from qstore.types import JobState


@pytest.fixture
def reader(db_url: str) -> Iterator[Engine]:
    """An engine of its own for the read under test, so statement hooks see only its work."""
    eng = create_engine(db_url, pool_size=2, max_overflow=2)
    yield eng
    eng.dispose()


@pytest.fixture
def bounded(db_url: str) -> Iterator[Engine]:
    """An engine whose sessions give up on any lock after 2 s, so a write that queued behind
    a read fails the test instead of hanging it."""
    eng = create_engine(db_url, pool_size=2, max_overflow=2,
                        connect_args={"options": "-c lock_timeout=2000"})
    yield eng
    eng.dispose()


@contextlib.contextmanager
def before_statement(engine: Engine, match: Callable[[str], bool], action: Callable[[], Any]) -> Iterator[list[Any]]:
    """Run ``action`` (to completion: it commits on another engine) the first time ``engine``
    is about to send a statement ``match`` accepts; yields the list its result lands in."""
    fired: list[Any] = []

    def before(conn: Any, cursor: Any, statement: str, *_: Any) -> None:
        if not fired and match(statement):
            fired.append(action())

    event.listen(engine, "before_cursor_execute", before)
    try:
        yield fired
    finally:
        event.remove(engine, "before_cursor_execute", before)


def _hundred_completed_in_a_sealed_slot(engine: Engine, s: QueueStorage) -> None:
    s.enqueue_params_batch(engine, [params() for _ in range(100)])
    jobs = []
    while len(jobs) < 100:
        got = s.claim_runtime_batch(engine, "q", 100, None)
        assert got
        jobs.extend(got)
    assert len(s.complete_runtime_batch(engine, jobs)) == 100
    assert s.rotate(engine).kind == "rotated"


def _grouped_read(statement: str) -> bool:
    # a statement of the report after its snapshot was taken and before it reads the rings:
    # the DLQ depth by queue
    return "dlq_entries GROUP BY" in statement


def test_queue_status_counts_every_terminal_job_while_a_prune_commits_during_the_read(engine, reader, st):
    _hundred_completed_in_a_sealed_slot(engine, st)
    with before_statement(reader, _grouped_read, lambda: st.prune_oldest(engine)) as prune:
        (q,) = status.queue_status(reader, st, ["q"])
    assert (q.terminal, q.completed, q.available, q.running) == (100, 100, 0, 0)
    assert prune and prune[0].kind == "blocked"  # held off by the read's locks, not waited for
    assert st.prune_oldest(engine).kind == "pruned"  # once the read has ended
    (q,) = status.queue_status(reader, st, ["q"])
    assert (q.terminal, q.completed) == (100, 0)


def test_status_report_counts_every_terminal_job_while_a_prune_commits_during_the_read(engine, reader, st):
    _hundred_completed_in_a_sealed_slot(engine, st)
    with before_statement(reader, _grouped_read, lambda: st.prune_oldest(engine)) as prune:
        report = status.status_report(reader, st)
    (q,) = report.queues
    assert (q.terminal, q.completed) == (100, 100)
    assert prune and prune[0].kind == "blocked"
    assert report.rings[0].slots[0].heap_bytes > 0  # the slot the counts saw is still there


def test_status_on_a_repeatable_read_connection_is_one_snapshot_when_it_reads_first(engine, reader, st):
    # the caller's isolation is the caller's choice: in REPEATABLE READ, a status read that
    # is the transaction's first statement takes its locks before the snapshot
    _hundred_completed_in_a_sealed_slot(engine, st)
    with reader.connect() as conn:
        conn = conn.execution_options(isolation_level="REPEATABLE READ")
        with conn.begin(), before_statement(reader, _grouped_read, lambda: st.prune_oldest(engine)) as prune:
            (q,) = status.queue_status(conn, st, ["q"])
            assert (q.terminal, q.completed) == (100, 100)
            assert prune and prune[0].kind == "blocked"
            (q,) = status.queue_status(conn, st, ["q"])  # later reads of the transaction agree
            assert (q.terminal, q.completed) == (100, 100)


def test_hold_rings_first_in_a_repeatable_read_transaction_keeps_its_reads_whole(engine, reader, st):
    _hundred_completed_in_a_sealed_slot(engine, st)
    with reader.connect() as conn:
        conn = conn.execution_options(isolation_level="REPEATABLE READ")
        with conn.begin():
            status.hold_rings(conn, st)
            conn.exec_driver_sql("SELECT 1")  # the snapshot
            assert st.prune_oldest(engine).kind == "blocked"
            assert st.queue_counts(conn, "q").terminal == 100
    # without it, a prune committing after the snapshot takes the slot's history with it
    with reader.connect() as conn:
        conn = conn.execution_options(isolation_level="REPEATABLE READ")
        with conn.begin():
            conn.exec_driver_sql("SELECT 1")
            assert st.prune_oldest(engine).kind == "pruned"
            assert st.queue_counts(conn, "q").terminal == 0
    assert st.queue_counts(reader, "q").terminal == 100


def test_load_job_finds_a_running_job_whose_claim_slot_is_pruned_during_the_read(engine, reader, st):
    st.enqueue_params_batch(engine, [params()])
    (claimed,) = st.claim_runtime_batch(engine, "q", 1, None)
    assert st.rotate_claims(engine).kind == "rotated"  # its receipt's slot is sealed

    def complete_and_prune() -> Any:
        assert st.complete_runtime_batch(engine, [claimed])
        return st.prune_oldest_claims(engine)

    # the receipt is read after the snapshot was taken (the ready row before it): the
    # completion that commits in between is invisible to the read, so the receipt must be
    # too, or the job is nowhere
    with before_statement(reader, lambda s: s.startswith("SELECT") and "lease_claims" in s,
                          complete_and_prune) as prune:
        job = st.load_job(reader, claimed.job.id)
    assert job is not None and job.state is JobState.RUNNING
    assert prune and prune[0].kind == "blocked"
    assert st.load_job(reader, claimed.job.id).state is JobState.COMPLETED
    assert st.prune_oldest_claims(engine).kind == "pruned"


def test_a_status_read_holds_off_prune_but_never_enqueues_claims_or_completions(engine, reader, bounded, st):
    _hundred_completed_in_a_sealed_slot(engine, st)
    seen: dict[str, Any] = {}

    def meanwhile() -> None:
        # runs while the read holds its locks (inside it, on other sessions)
        started = time.monotonic()
        bounded_storage = QueueStorage(st.config)
        bounded_storage.enqueue_params_batch(bounded, [params() for _ in range(3)])
        got = bounded_storage.claim_runtime_batch(bounded, "q", 3, None)
        seen["claimed"] = len(got)
        seen["completed"] = len(bounded_storage.complete_runtime_batch(bounded, got))
        seen["rotate"] = bounded_storage.rotate(bounded).kind
        seen["writes_seconds"] = time.monotonic() - started
        started = time.monotonic()
        seen["prune"] = bounded_storage.prune_oldest(bounded).kind
        seen["prune_seconds"] = time.monotonic() - started

    with before_statement(reader, _grouped_read, meanwhile):
        report = status.status_report(reader, st)
    assert report.queues[0].terminal == 100  # its snapshot predates the three completions
    assert (seen["claimed"], seen["completed"], seen["rotate"]) == (3, 3, "rotated")
    assert seen["writes_seconds"] < 1.5, seen
    assert seen["prune"] == "blocked" and seen["prune_seconds"] < 1.5, seen
