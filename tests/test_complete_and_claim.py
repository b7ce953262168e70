"""``complete_and_claim``: a worker's cycle (complete the finished attempts, claim the next
ones) in one call, one round trip on the fast path; guarded by ``(job_id, run_lease)``,
exactly-once claiming, both receipt modes, striped queues, every kind of target."""

from __future__ import annotations

import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from jobtools import count, materialise, requeue
from psycopg import pq
from sqlalchemy import Engine, create_engine
from sqlalchemy.orm import Session

from qstore import CompletedAndClaimed, InsertOpts, InsertParams, JobState, ValidationError
from qstore.types import ClaimedRuntimeJob


def enqueue(engine, storage, n: int, queue: str = "q") -> list[int]:
    return storage.enqueue_many(engine, [InsertParams("k", {"i": i}, InsertOpts(queue=queue)) for i in range(n)])


def pairs(claimed: list[ClaimedRuntimeJob]) -> list[tuple[int, int]]:
    return [(c.job.id, c.job.run_lease) for c in claimed]


def test_completes_the_finished_attempts_and_claims_the_next_ones(engine, storage):
    enqueue(engine, storage, 5)
    first = storage.claim_runtime_batch(engine, "q", 2)
    got = storage.complete_and_claim(engine, first, "q", 2)
    assert isinstance(got, CompletedAndClaimed)
    assert got.completed == pairs(first)
    assert len(got.claimed) == 2 and not {c.job.id for c in got.claimed} & {c.job.id for c in first}
    assert all(storage.load_job(engine, i).state is JobState.COMPLETED for i, _ in got.completed)
    assert all(c.job.state is JobState.RUNNING and c.job.attempt == 1 for c in got.claimed)
    counts = storage.queue_counts(engine, "q")
    assert (counts.available, counts.running, counts.terminal) == (1, 2, 2)


def test_nothing_to_complete_is_a_plain_claim(engine, storage):
    enqueue(engine, storage, 3)
    got = storage.complete_and_claim(engine, [], "q", 10)
    assert got.completed == [] and len(got.claimed) == 3


def test_nothing_to_claim_still_completes(engine, storage):
    enqueue(engine, storage, 2)
    claimed = storage.claim_runtime_batch(engine, "q", 2)
    got = storage.complete_and_claim(engine, claimed, "q", 10)
    assert got.completed == pairs(claimed) and got.claimed == []
    assert storage.queue_counts(engine, "q").terminal == 2


def test_a_deadline_given_is_set_on_the_claimed_attempts(engine, storage):
    enqueue(engine, storage, 1)
    (claimed,) = storage.complete_and_claim(engine, [], "q", 1, 60).claimed
    assert claimed.job.deadline_at is not None


# -- round trips ----------------------------------------------------------------------------------

@pytest.fixture
def one_connection(db_url: str) -> Iterator[Engine]:
    eng = create_engine(db_url, pool_size=1, max_overflow=0)
    yield eng
    eng.dispose()


def pooled_pgconn(engine: Engine) -> pq.abc.PGconn:
    """The libpq connection of the engine's only pooled connection."""
    raw = engine.raw_connection()
    try:
        return raw.driver_connection.pgconn
    finally:
        raw.close()


@contextmanager
def sent_messages(pgconn: pq.abc.PGconn) -> Iterator[list[str]]:
    """The protocol messages ``pgconn`` sends meanwhile."""
    sent: list[str] = []
    with tempfile.TemporaryFile("w+") as log:
        pgconn.trace(log.fileno())
        pgconn.set_trace_flags(pq.Trace.SUPPRESS_TIMESTAMPS)
        try:
            yield sent
        finally:
            pgconn.untrace()
            log.seek(0)
            sent += [p[2] for p in (line.split("\t") for line in log.read().splitlines())
                     if len(p) >= 3 and p[0] == "F"]


def test_on_an_engine_the_fast_cycle_is_one_round_trip(one_connection, storage):
    enqueue(one_connection, storage, 4)
    claimed = storage.complete_and_claim(one_connection, [], "q", 2).claimed
    with sent_messages(pooled_pgconn(one_connection)) as sent:
        got = storage.complete_and_claim(one_connection, claimed, "q", 2)
    assert got.completed == pairs(claimed) and len(got.claimed) == 2
    assert sent.count("Sync") == 1 and "Query" not in sent  # no BEGIN, no COMMIT


def test_in_a_callers_transaction_the_fast_cycle_is_one_statement(one_connection, storage):
    enqueue(one_connection, storage, 4)
    claimed = storage.claim_runtime_batch(one_connection, "q", 2)
    with one_connection.connect() as conn:
        conn.begin()
        storage.queue_counts(conn, "q")  # the transaction is open: what follows is the call alone
        with sent_messages(conn.connection.driver_connection.pgconn) as sent:
            got = storage.complete_and_claim(conn, claimed, "q", 2)
        conn.commit()
    assert got.completed == pairs(claimed) and len(got.claimed) == 2
    assert sent.count("Sync") == 1 and "Query" not in sent


# -- guarded completion ---------------------------------------------------------------------------

def test_a_repeated_completion_completes_nothing_and_still_claims(engine, storage):
    enqueue(engine, storage, 3)
    claimed = storage.claim_runtime_batch(engine, "q", 1)
    assert storage.complete_and_claim(engine, claimed, "q", 1).completed == pairs(claimed)
    again = storage.complete_and_claim(engine, claimed, "q", 1)
    assert again.completed == [] and len(again.claimed) == 1
    assert storage.queue_counts(engine, "q").terminal == 1


def test_a_stale_lease_is_not_completed(engine, storage):
    enqueue(engine, storage, 1)
    (c,) = storage.claim_runtime_batch(engine, "q", 1)
    got = storage.complete_and_claim(engine, [(c.job.id, c.job.run_lease + 1)], "q", 1)
    assert got.completed == [] and got.claimed == []
    assert storage.load_job(engine, c.job.id).state is JobState.RUNNING


def test_an_attempt_rescued_and_claimed_again_is_not_completed_by_its_old_lease(engine, storage):
    enqueue(engine, storage, 1)
    (old,) = storage.claim_runtime_batch(engine, "q", 1)
    requeue(engine, storage, old)
    (new,) = storage.claim_runtime_batch(engine, "q", 1)
    got = storage.complete_and_claim(engine, [old], "q", 1)
    assert got.completed == [] and got.claimed == []
    assert storage.load_job(engine, new.job.id).state is JobState.RUNNING
    assert storage.complete_and_claim(engine, [new], "q", 1).completed == pairs([new])


def test_the_same_attempt_twice_completes_once(engine, storage):
    enqueue(engine, storage, 1)
    (c,) = storage.claim_runtime_batch(engine, "q", 1)
    got = storage.complete_and_claim(engine, [c, c, (c.job.id, c.job.run_lease)], "q", 1)
    assert got.completed == pairs([c])
    assert count(engine, storage, "terminal_jobs") == 1


def test_pairs_and_materialised_attempts_take_the_general_path_in_the_same_call(engine, storage):
    enqueue(engine, storage, 4)
    plain, beating, by_pair = storage.claim_runtime_batch(engine, "q", 3)
    materialise(engine, storage, beating)
    got = storage.complete_and_claim(engine, [beating, (by_pair.job.id, by_pair.job.run_lease), plain], "q", 5)
    assert got.completed == [(beating.job.id, 1), (by_pair.job.id, 1), (plain.job.id, 1)]  # input order
    assert len(got.claimed) == 1
    counts = storage.queue_counts(engine, "q")
    assert (counts.available, counts.running, counts.terminal) == (0, 1, 3)


def test_an_attempt_materialised_since_its_claim_is_completed_after_the_statement(engine, storage):
    enqueue(engine, storage, 3)
    a, b = storage.claim_runtime_batch(engine, "q", 2)
    # the client still holds a plain receipt: the statement leaves it, the general path ends it
    materialise(engine, storage, a)
    got = storage.complete_and_claim(engine, [a, b], "q", 1)
    assert got.completed == pairs([a, b]) and len(got.claimed) == 1
    assert storage.queue_counts(engine, "q").terminal == 2


# -- receipt modes, stripes -----------------------------------------------------------------------

def test_an_install_without_receipts_completes_leases_and_claims(engine, make_storage):
    storage = make_storage(lease_claim_receipts=False)
    enqueue(engine, storage, 4)
    claimed = storage.claim_runtime_batch(engine, "q", 2)
    assert count(engine, storage, "leases") == 2
    got = storage.complete_and_claim(engine, claimed, "q", 2)
    assert got.completed == pairs(claimed) and len(got.claimed) == 2
    assert count(engine, storage, "leases") == 2  # the new attempts' leases only
    assert storage.complete_and_claim(engine, claimed, "q", 2).completed == []
    assert storage.complete_and_claim(engine, got.claimed, "q", 2).completed == pairs(got.claimed)
    assert storage.queue_counts(engine, "q").terminal == 4


def test_a_striped_queue_claims_across_its_stripes(engine, make_storage):
    storage = make_storage(queue_stripe_count=3)
    enqueue(engine, storage, 9)
    first = storage.claim_runtime_batch(engine, "q", 2)
    got = storage.complete_and_claim(engine, first, "q", 7)
    assert got.completed == pairs(first)
    assert len(got.claimed) == 7 and len({c.claim.queue for c in got.claimed}) == 3
    assert storage.complete_and_claim(engine, got.claimed, "q", 5).completed == pairs(got.claimed)
    assert storage.queue_counts(engine, "q").terminal == 9


# -- targets --------------------------------------------------------------------------------------

@pytest.mark.parametrize("receipts", [True, False], ids=["receipts", "leases"])
def test_a_rollback_of_the_callers_connection_undoes_both_parts(engine, make_storage, receipts):
    storage = make_storage(lease_claim_receipts=receipts)
    enqueue(engine, storage, 2)
    (done_one,) = storage.claim_runtime_batch(engine, "q", 1)
    with engine.connect() as conn:
        conn.begin()
        got = storage.complete_and_claim(conn, [done_one], "q", 1)
        assert got.completed == pairs([done_one]) and len(got.claimed) == 1
        conn.rollback()
    counts = storage.queue_counts(engine, "q")
    assert (counts.available, counts.running, counts.terminal) == (1, 1, 0)
    assert storage.load_job(engine, done_one.job.id).state is JobState.RUNNING
    again = storage.complete_and_claim(engine, [done_one], "q", 1)
    assert again.completed == pairs([done_one]) and [c.job.id for c in again.claimed] == [got.claimed[0].job.id]


def test_a_session_commit_keeps_both_parts_and_a_rollback_undoes_them(engine, storage):
    enqueue(engine, storage, 3)
    (a,) = storage.claim_runtime_batch(engine, "q", 1)
    with Session(engine) as session:
        got = storage.complete_and_claim(session, [a], "q", 1)
        assert got.completed == pairs([a]) and len(got.claimed) == 1
        assert storage.queue_counts(engine, "q").terminal == 0  # not visible before the commit
        session.rollback()
    assert storage.queue_counts(engine, "q").running == 1
    with Session(engine) as session:
        got = storage.complete_and_claim(session, [a], "q", 1)
        session.commit()
    counts = storage.queue_counts(engine, "q")
    assert got.completed == pairs([a]) and (counts.available, counts.running, counts.terminal) == (1, 1, 1)


def test_the_async_face_runs_the_same_cycle(engine, storage, db_url):
    import asyncio

    from sqlalchemy.ext.asyncio import create_async_engine

    from qstore.aio import AsyncQueueStorage

    enqueue(engine, storage, 3)
    claimed = storage.claim_runtime_batch(engine, "q", 1)

    async def cycle() -> CompletedAndClaimed:
        aeng = create_async_engine(db_url)
        try:
            return await AsyncQueueStorage(storage).complete_and_claim(aeng, claimed, "q", 2)
        finally:
            await aeng.dispose()

    got = asyncio.run(cycle())
    assert got.completed == pairs(claimed) and len(got.claimed) == 2


@pytest.mark.parametrize("bad", [None, [None], [(1,)], [(1, "x")], [(True, 1)], "ab"])
def test_anything_but_attempts_is_refused_naming_it(engine, storage, bad):
    with pytest.raises(ValidationError, match="completions"):
        storage.complete_and_claim(engine, bad, "q", 1)


# -- concurrency ----------------------------------------------------------------------------------

@pytest.mark.parametrize("receipts", [True, False], ids=["receipts", "leases"])
def test_concurrent_cycles_complete_every_job_exactly_once(engine, make_storage, receipts):
    storage = make_storage(lease_claim_receipts=receipts)
    total = 600
    ids = set(enqueue(engine, storage, total))
    completed: list[list[tuple[int, int]]] = [[] for _ in range(4)]
    claimed: list[list[int]] = [[] for _ in range(4)]
    errors: list[BaseException] = []

    def worker(n: int) -> None:
        try:
            held: list[ClaimedRuntimeJob] = []
            empty = 0
            while empty < 3:
                got = storage.complete_and_claim(engine, held, "q", 7)
                completed[n] += got.completed
                assert got.completed == pairs(held)  # nobody else completes this worker's attempts
                claimed[n] += [c.job.id for c in got.claimed]
                held = got.claimed
                empty = 0 if held else empty + 1
        except BaseException as err:  # pragma: no cover - reported below
            errors.append(err)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    every_claim = [i for c in claimed for i in c]
    every_completion = [i for c in completed for i, _ in c]
    assert len(every_claim) == len(set(every_claim)) == total  # each job claimed once
    assert sorted(every_completion) == sorted(ids)  # and completed once
    counts = storage.queue_counts(engine, "q")
    assert (counts.available, counts.running, counts.terminal) == (0, 0, total)


def test_the_statement_sends_the_completed_pairs_once_not_once_per_claimed_job(engine, storage):
    from qstore.storage.complete import _fast_and_claim_stmt
    from qstore.storage.targets import Runner

    enqueue(engine, storage, 5)
    done = storage.claim_runtime_batch(engine, "q", 2)
    with engine.connect() as conn:
        rows = Runner.on(conn).rows(_fast_and_claim_stmt(storage.tables), {
            "claim_slots": [c.claim.claim_slot for c in done], "job_ids": [c.job.id for c in done],
            "run_leases": [c.job.run_lease for c in done], "kinds": [c.job.kind for c in done],
            "queue": "q", "max_batch": 3, "deadline_ms": 0, "aging_ms": 0, "receipts": True})
        conn.rollback()
    assert len(rows) == 3
    assert sorted(zip(rows[0][0], rows[0][1], strict=True)) == sorted(pairs(done))
    assert all(r[0] is None and r[1] is None for r in rows[1:])
