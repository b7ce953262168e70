"""A thread that sends hot statements one after the other can keep one pooled connection for
them (``keeping_engine``): one checkout for many statements, each still committed on its own;
the connection goes back to the pool on ``release_kept``, after an error (replaced after a
disconnect), when someone starts listening to cursor events, and after ``KEEP_LIMIT``. A
worker's claim cycles keep theirs while jobs come often and hand it back when the queue goes
quiet; so do an asyncio worker's."""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from jobtools import checkouts_of
from sqlalchemy import Engine, create_engine, event, text
from sqlalchemy.ext.asyncio import create_async_engine

from qstore import (
    InsertOpts,
    InsertParams,
    QueueStorage,
    QueueStorageConfig,
    ValidationError,
    kept_connection,
)
from qstore.storage import targets
from qstore.storage.targets import keeping_engine, release_kept
from qstore.tasks import App, JobContext
from qstore.worker import AsyncWorker, Worker, WorkerSettings

QUEUE = "kept"


@pytest.fixture
def app_engine(db_url: str) -> Iterator[Engine]:
    """An engine of the test's own (SQLAlchemy's default pool), so its pool counts are the
    test's alone."""
    e = create_engine(db_url)
    yield e
    e.dispose()


def enqueue(st: QueueStorage, engine: Engine, n: int) -> None:
    st.enqueue_many(engine, [InsertParams("note", {"n": i}, InsertOpts(queue=QUEUE)) for i in range(n)])


def kept_backend(engine: Engine) -> int:
    kept = engine.__dict__[targets._KEPT]
    assert kept.held
    return int(kept._got[1].info.backend_pid)


def receipts(engine: Engine, st: QueueStorage) -> int:
    with engine.connect() as conn:
        return int(conn.execute(text(f"SELECT count(*) FROM {st.config.schema}.lease_claims")).scalar_one())


def wait_for(check: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "not reached in time"
        time.sleep(0.01)


# -- keeping_engine ------------------------------------------------------------------------------
def test_hot_statements_on_a_keeping_engine_take_one_checkout(st, app_engine) -> None:  # type: ignore[no-untyped-def]
    enqueue(st, app_engine, 5)
    keeping = keeping_engine(app_engine)
    seen = checkouts_of(app_engine.pool)
    claimed = [st.claim_runtime_batch(keeping, QUEUE, 1) for _ in range(5)]
    done = st.complete_runtime_batch(keeping, [c for batch in claimed for c in batch])
    release_kept(keeping)
    assert [len(batch) for batch in claimed] == [1] * 5 and len(done) == 5
    assert seen[0] == 1


def test_a_striped_claim_takes_every_stripe_on_the_kept_connection(make_storage, app_engine) -> None:  # type: ignore[no-untyped-def]
    striped = make_storage(queue_stripe_count=3)
    striped.enqueue_many(app_engine, [InsertParams("note", {"n": i}, InsertOpts(queue=f"{QUEUE}#{i % 3}"))
                                      for i in range(6)])
    keeping = keeping_engine(app_engine)
    seen = checkouts_of(app_engine.pool)
    claimed = striped.claim_runtime_batch(keeping, QUEUE, 6)  # one statement per stripe
    got = striped.complete_and_claim(keeping, claimed, QUEUE, 6)
    release_kept(keeping)
    assert sorted(c.job.args["n"] for c in claimed) == list(range(6))
    assert len(got.completed) == 6 and got.claimed == []
    assert seen[0] == 1


def test_the_same_statements_on_the_engine_check_out_per_statement(st, app_engine) -> None:  # type: ignore[no-untyped-def]
    enqueue(st, app_engine, 3)
    seen = checkouts_of(app_engine.pool)
    for _ in range(3):
        st.claim_runtime_batch(app_engine, QUEUE, 1)
    assert seen[0] == 3


def test_each_statement_on_a_kept_connection_commits_on_its_own(st, app_engine) -> None:  # type: ignore[no-untyped-def]
    enqueue(st, app_engine, 2)
    keeping = keeping_engine(app_engine)
    try:
        st.claim_runtime_batch(keeping, QUEUE, 1)
        assert receipts(app_engine, st) == 1  # seen by another connection while still kept
        st.claim_runtime_batch(keeping, QUEUE, 1)
        assert receipts(app_engine, st) == 2
        driver = keeping.__dict__[targets._KEPT]._got[1]
        assert driver.autocommit and driver.info.transaction_status == 0  # idle, no transaction
    finally:
        release_kept(keeping)


def test_release_kept_hands_the_connection_back_out_of_autocommit(st, app_engine) -> None:  # type: ignore[no-untyped-def]
    enqueue(st, app_engine, 1)
    keeping = keeping_engine(app_engine)
    st.claim_runtime_batch(keeping, QUEUE, 1)
    pid = kept_backend(keeping)
    assert app_engine.pool.checkedout() == 1
    release_kept(keeping)
    assert app_engine.pool.checkedout() == 0
    raw = app_engine.raw_connection()
    try:
        assert raw.driver_connection.info.backend_pid == pid
        assert raw.driver_connection.autocommit is False
    finally:
        raw.close()


def test_other_operations_on_a_keeping_engine_use_the_pool_as_on_the_engine(st, app_engine) -> None:  # type: ignore[no-untyped-def]
    enqueue(st, app_engine, 3)
    keeping = keeping_engine(app_engine)
    try:
        st.claim_runtime_batch(keeping, QUEUE, 1)
        counts = st.queue_counts(keeping, QUEUE)  # a snapshot read: a transaction of its own
        assert counts.available == 2
        st.set_queue_options(keeping, QUEUE, paused=True)  # a transaction of its own, committed
        assert st.claim_runtime_batch(app_engine, QUEUE, 1) == []
        assert app_engine.pool.checkedout() == 1  # the kept connection alone
    finally:
        release_kept(keeping)


def test_a_kept_connection_that_was_cut_is_replaced_after_one_error(st, app_engine) -> None:  # type: ignore[no-untyped-def]
    enqueue(st, app_engine, 2)
    keeping = keeping_engine(app_engine)
    try:
        st.claim_runtime_batch(keeping, QUEUE, 1)
        pid = kept_backend(keeping)
        with app_engine.connect() as conn:
            conn.execute(text("SELECT pg_terminate_backend(:p)"), {"p": pid})
        time.sleep(0.1)
        with pytest.raises(Exception):  # noqa: B017 - the driver's disconnect, whatever it is mapped to
            st.claim_runtime_batch(keeping, QUEUE, 1)
        assert not keeping.__dict__[targets._KEPT].held
        assert [c.job.args["n"] for c in st.claim_runtime_batch(keeping, QUEUE, 1)] == [1]
        assert kept_backend(keeping) != pid
    finally:
        release_kept(keeping)
    assert app_engine.pool.checkedout() == 0


def test_a_statement_error_hands_the_kept_connection_back(st, app_engine, db_url) -> None:  # type: ignore[no-untyped-def]
    enqueue(st, app_engine, 1)
    keeping = keeping_engine(app_engine)
    st.claim_runtime_batch(keeping, QUEUE, 1)
    missing = QueueStorage(QueueStorageConfig(schema="kept_not_installed"))
    with pytest.raises(Exception):  # noqa: B017 - the schema-gone error, whatever its type
        missing.claim_runtime_batch(keeping, QUEUE, 1)
    assert not keeping.__dict__[targets._KEPT].held
    assert app_engine.pool.checkedout() == 0


def test_a_cursor_listener_added_later_sees_the_statements_and_the_connection_goes_back(st, app_engine) -> None:  # type: ignore[no-untyped-def]
    enqueue(st, app_engine, 2)
    keeping = keeping_engine(app_engine)
    st.claim_runtime_batch(keeping, QUEUE, 1)
    statements: list[str] = []
    event.listen(app_engine, "before_cursor_execute", lambda c, cur, sql, *a: statements.append(sql))
    assert len(st.claim_runtime_batch(keeping, QUEUE, 1)) == 1
    assert any("claim_ready" in s for s in statements)
    assert not keeping.__dict__[targets._KEPT].held
    assert app_engine.pool.checkedout() == 0


def test_a_kept_connection_goes_back_after_its_keep_limit(st, app_engine, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    enqueue(st, app_engine, 3)
    monkeypatch.setattr(targets, "KEEP_LIMIT", 0.0)
    keeping = keeping_engine(app_engine)
    seen = checkouts_of(app_engine.pool)
    for _ in range(3):
        st.claim_runtime_batch(keeping, QUEUE, 1)
    release_kept(keeping)
    assert seen[0] == 3


def test_release_kept_of_another_engine_does_nothing(app_engine) -> None:
    with app_engine.connect() as conn:
        conn.execute(text("SELECT 1"))
    release_kept(app_engine)
    release_kept(keeping_engine(app_engine))  # nothing kept yet
    assert app_engine.pool.checkedout() == 0


# -- kept_connection: a block of calls on one connection ---------------------------------------
def ready_rows(engine: Engine, st: QueueStorage) -> int:
    with engine.connect() as conn:
        return int(conn.execute(text(f"SELECT count(*) FROM {st.config.schema}.ready_entries")).scalar_one())


def test_defers_in_a_kept_connection_block_take_one_checkout(st, app_engine) -> None:  # type: ignore[no-untyped-def]
    app = App(st)

    @app.task(kind="note", queue=QUEUE)
    def note(ctx: JobContext, n: int) -> None: ...

    seen = checkouts_of(app_engine.pool)
    with kept_connection(app_engine) as producing:
        for i in range(10):
            note.defer(producing, n=i)
        assert app_engine.pool.checkedout() == 1
    assert seen[0] == 1
    assert app_engine.pool.checkedout() == 0
    assert ready_rows(app_engine, st) == 10


def test_each_job_of_a_kept_connection_block_is_committed_at_its_call(st, app_engine) -> None:  # type: ignore[no-untyped-def]
    with kept_connection(app_engine) as producing:
        st.enqueue(producing, InsertParams("note", {"n": 1}, InsertOpts(queue=QUEUE)))
        assert ready_rows(app_engine, st) == 1  # seen from another connection inside the block


def test_a_kept_connection_block_hands_its_connection_back_when_it_raises(st, app_engine) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(RuntimeError), kept_connection(app_engine) as producing:
        st.enqueue(producing, InsertParams("note", {"n": 1}, InsertOpts(queue=QUEUE)))
        raise RuntimeError("the caller's own error")
    assert app_engine.pool.checkedout() == 0
    assert ready_rows(app_engine, st) == 1  # what was sent before the error stays committed


def test_kept_connection_refuses_anything_but_an_engine(app_engine) -> None:
    with app_engine.connect() as conn, pytest.raises(ValidationError, match="engine"), \
            kept_connection(conn):  # type: ignore[arg-type]
        pass


# -- the worker's claim cycles -------------------------------------------------------------------
def note_app(st: QueueStorage) -> tuple[App, list[int]]:
    app = App(st)
    done: list[int] = []

    @app.task(kind="note", queue=QUEUE)
    def note(ctx: JobContext, n: int) -> None:
        done.append(n)

    return app, done


def worker_settings(**given: Any) -> WorkerSettings:
    given.setdefault("maintain", False)
    given.setdefault("concurrency", 4)
    given.setdefault("poll_interval", 1.0)
    return WorkerSettings(queues=[QUEUE], **given)


def trickle(st: QueueStorage, app_engine: Engine, jobs: int, gap: float) -> tuple[int, int]:
    """Run a worker while ``jobs`` jobs arrive one every ``gap`` seconds; (checkouts its
    claim cycles made, claims they made) meanwhile."""
    app, done = note_app(st)
    w = Worker(app, app_engine, worker_settings())
    seen = checkouts_of(w.engine.pool, "qstore-claim")  # the claim cycles' checkouts
    w.start()
    try:
        time.sleep(0.2)
        before = (seen[0], w.stats.claim_calls)
        for i in range(jobs):
            st.enqueue(app_engine, InsertParams("note", {"n": i}, InsertOpts(queue=QUEUE)))
            time.sleep(gap)
        wait_for(lambda: len(done) == jobs and w.stats.completed == jobs)
        return seen[0] - before[0], w.stats.claim_calls - before[1]
    finally:
        w.stop(5)


def test_a_worker_claims_a_steady_trickle_on_a_kept_connection(st, app_engine) -> None:  # type: ignore[no-untyped-def]
    checkouts, claims = trickle(st, app_engine, 40, 0.02)  # well within KEEP_IDLE
    assert claims >= 20
    assert checkouts <= 2, (checkouts, claims)  # a checkout per claim without the kept connection


def test_a_worker_claims_a_slow_trickle_on_connections_checked_out_per_claim(st, app_engine) -> None:  # type: ignore[no-untyped-def]
    checkouts, claims = trickle(st, app_engine, 4, 0.25)  # the cycle waits beyond KEEP_IDLE in between
    assert claims >= 4 and checkouts >= 4, (checkouts, claims)


def test_an_idle_worker_hands_its_claim_connections_back(st, app_engine) -> None:  # type: ignore[no-untyped-def]
    app, done = note_app(st)
    w = Worker(app, app_engine, worker_settings(claims_in_flight=2))
    enqueue(st, app_engine, 200)  # full claims: both cycles claim
    w.start()
    try:
        wait_for(lambda: len(done) == 200 and w.stats.completed == 200)
        wait_for(lambda: w.engine.pool.checkedout() == 0, timeout=3.0)
    finally:
        w.stop(5)


def test_a_stopped_worker_has_handed_its_claim_connections_back(st, app_engine) -> None:  # type: ignore[no-untyped-def]
    app, done = note_app(st)
    w = Worker(app, app_engine, worker_settings(own_pool=False, poll_interval=0.05))
    w.start()
    try:
        for i in range(5):
            st.enqueue(app_engine, InsertParams("note", {"n": i}, InsertOpts(queue=QUEUE)))
        wait_for(lambda: len(done) == 5)
    finally:
        w.stop(5)
    assert app_engine.pool.checkedout() == 0
    assert not any(t.name.startswith("qstore-claim") for t in threading.enumerate())


# -- the asyncio worker's claim cycles -------------------------------------------------------------
CLAIM_OPS = frozenset({"claim_runtime_batch", "complete_and_claim"})


def claim_checkouts_of(pool: Any) -> list[int]:
    """Count the checkouts of ``pool`` made by a claim (an async face call runs the storage
    operation in a greenlet, whose frames lead back to the operation); ``[n]``, in place."""
    seen = [0]

    def checkout(*_: Any) -> None:
        frame = sys._getframe()
        while frame is not None:
            if frame.f_code.co_name in CLAIM_OPS:
                seen[0] += 1
                return
            frame = frame.f_back

    event.listen(pool, "checkout", checkout)
    return seen


def async_trickle(st: QueueStorage, engine: Engine, db_url: str, jobs: int, gap: float) -> tuple[int, int]:
    """:func:`trickle` for an ``AsyncWorker``: (checkouts its claims made, claims made)
    while ``jobs`` jobs arrive one every ``gap`` seconds."""
    app, done = note_app(st)

    async def body() -> tuple[int, int]:
        aengine = create_async_engine(db_url)
        try:
            async with AsyncWorker(app, aengine, worker_settings(), sync_engine=engine) as w:
                seen = claim_checkouts_of(w.engine.sync_engine.pool)
                await asyncio.sleep(0.2)
                before = (seen[0], w.stats.claim_calls)
                for i in range(jobs):
                    st.enqueue(engine, InsertParams("note", {"n": i}, InsertOpts(queue=QUEUE)))
                    await asyncio.sleep(gap)
                deadline = time.monotonic() + 10
                while not (len(done) == jobs and w.stats.completed == jobs):
                    assert time.monotonic() < deadline, "not drained in time"
                    await asyncio.sleep(0.01)
                return seen[0] - before[0], w.stats.claim_calls - before[1]
        finally:
            await aengine.dispose()

    return asyncio.run(asyncio.wait_for(body(), 30))


def test_an_async_worker_claims_a_steady_trickle_on_a_kept_connection(st, engine, db_url) -> None:  # type: ignore[no-untyped-def]
    checkouts, claims = async_trickle(st, engine, db_url, 40, 0.02)
    assert claims >= 20
    assert checkouts <= 2, (checkouts, claims)


def test_an_async_worker_claims_a_slow_trickle_on_connections_checked_out_per_claim(st, engine, db_url) -> None:  # type: ignore[no-untyped-def]
    checkouts, claims = async_trickle(st, engine, db_url, 4, 0.25)
    assert claims >= 4 and checkouts >= 4, (checkouts, claims)


def test_a_stopped_async_worker_has_handed_its_claim_connections_back(st, engine, db_url) -> None:  # type: ignore[no-untyped-def]
    app, done = note_app(st)

    async def body() -> int:
        aengine = create_async_engine(db_url)
        try:
            async with AsyncWorker(app, aengine, worker_settings(own_pool=False, poll_interval=0.05),
                                   sync_engine=engine):
                for i in range(5):
                    st.enqueue(engine, InsertParams("note", {"n": i}, InsertOpts(queue=QUEUE)))
                    await asyncio.sleep(0.01)
                while len(done) < 5:
                    await asyncio.sleep(0.01)
            return aengine.sync_engine.pool.checkedout()
        finally:
            await aengine.dispose()

    assert asyncio.run(asyncio.wait_for(body(), 30)) == 0


def test_a_wait_for_places_hands_the_connection_back_once_it_has_lasted_keep_idle() -> None:
    from qstore.runtime.core import KEEP_IDLE, IdleGiveBack

    idle = IdleGiveBack(True)
    assert idle.step(0.0, 0.5) == (KEEP_IDLE, False)  # waits are cut to KEEP_IDLE until then
    assert idle.step(KEEP_IDLE / 2, 0.5) == (KEEP_IDLE, False)
    assert idle.step(KEEP_IDLE, 0.5) == (0.5, True)  # once, then waits are left alone
    assert idle.step(1.0, 0.5) == (0.5, False)
    assert IdleGiveBack(False).step(10.0, 0.5) == (0.5, False)  # nothing kept: nothing to hand back
