"""A worker's connections come from a pool of its own (``WorkerSettings.own_pool``): made
from the application's engine, with its connect arguments, pool events and engine events,
emptied at stop; with ``own_pool=False`` the worker uses the application's pool. Both
workers (threads and asyncio), and the ``qstore worker`` command, which makes an engine
for the worker alone."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from jobtools import checkouts_of
from sqlalchemy import Engine, create_engine, event, text
from sqlalchemy.ext.asyncio import create_async_engine
from sqlalchemy.pool import AssertionPool, AsyncAdaptedQueuePool, NullPool, QueuePool, StaticPool

from qstore import InsertOpts, InsertParams
from qstore.cli import build_parser
from qstore.cli.worker import worker_engine, worker_settings
from qstore.errors import ValidationError
from qstore.runtime.pools import (
    ONE_CONNECTION_OVERFLOW,
    ConnectionNeeds,
    own_pool_engine,
    pool_capacity,
)
from qstore.runtime.worker import connection_needs
from qstore.tasks import App, JobContext
from qstore.worker import AsyncWorker, Worker, WorkerSettings

JOBS = 20


def settings(**given: Any) -> WorkerSettings:
    given.setdefault("maintain", False)
    given.setdefault("concurrency", 4)
    given.setdefault("poll_interval", 0.2)
    return WorkerSettings(**given)


def counted_app(st: Any) -> tuple[App, list[int]]:
    """An app whose one task notes each job's ``n``."""
    app = App(st)
    done: list[int] = []

    @app.task(kind="note", queue="pool")
    def note(ctx: JobContext, n: int) -> None:
        done.append(n)

    return app, done


def enqueue_jobs(st: Any, engine: Engine) -> None:
    st.enqueue_many(engine, [InsertParams("note", {"n": i}, InsertOpts(queue="pool")) for i in range(JOBS)])


def wait_for(check: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "not reached in time"
        time.sleep(0.01)


@pytest.fixture
def app_engine(db_url: str) -> Iterator[Engine]:
    """The application's engine: SQLAlchemy's default pool, and an ``application_name``
    of its own in the connect arguments (so its backends can be told from the others)."""
    e = create_engine(db_url, connect_args={"application_name": f"qstore-app-{uuid.uuid4().hex[:8]}"})
    yield e
    e.dispose()


def backends_named(engine: Engine, name: str) -> int:
    with engine.connect() as conn:
        return int(conn.execute(text("SELECT count(*) FROM pg_stat_activity WHERE application_name = :n"),
                                {"n": name}).scalar_one())


# -- the thread worker ---------------------------------------------------------------------------
def test_a_worker_takes_no_connection_from_the_applications_pool(st, app_engine) -> None:  # type: ignore[no-untyped-def]
    app, done = counted_app(st)
    enqueue_jobs(st, app_engine)
    w = Worker(app, app_engine, settings())
    app_checkouts = checkouts_of(app_engine.pool)
    w.start()
    try:
        wait_for(lambda: len(done) == JOBS and w.stats.completed == JOBS)
    finally:
        w.stop(5)
    assert w.engine.pool is not app_engine.pool
    assert app_checkouts[0] == 0


def test_the_workers_pool_connects_with_the_applications_connect_arguments(st, app_engine) -> None:  # type: ignore[no-untyped-def]
    app, _ = counted_app(st)
    with w_started(app, app_engine) as w:
        with w.engine.connect() as conn:
            got = conn.execute(text("SELECT current_setting('application_name')")).scalar_one()
        with app_engine.connect() as conn:
            own = conn.execute(text("SELECT current_setting('application_name')")).scalar_one()
    assert got == own and got.startswith("qstore-app-")


def test_the_applications_pool_and_engine_listeners_see_the_workers_connections_and_statements(st, app_engine) -> None:  # type: ignore[no-untyped-def]
    app, _ = counted_app(st)
    enqueue_jobs(st, app_engine)
    connects: list[object] = []
    statements: list[str] = []
    event.listen(app_engine, "connect", lambda dbapi, rec: connects.append(dbapi))
    event.listen(app_engine, "before_cursor_execute", lambda c, cur, sql, *a: statements.append(sql))
    with w_started(app, app_engine) as w:
        wait_for(lambda: w.stats.completed == JOBS)
    assert connects, "the pool events of the application's engine run for the worker's connections"
    assert any("claim_ready" in s or "complete_and_claim" in s or "claim_runtime" in s for s in statements), statements[:5]


def test_a_stopped_worker_leaves_no_connection_of_its_pool_open(st, app_engine) -> None:  # type: ignore[no-untyped-def]
    app, _ = counted_app(st)
    enqueue_jobs(st, app_engine)
    name = _application_name(app_engine)
    with w_started(app, app_engine) as w:
        wait_for(lambda: w.stats.completed == JOBS)
        assert w.engine.pool.checkedin() + w.engine.pool.checkedout() > 0
    assert w.engine.pool.checkedin() == 0
    app_engine.dispose()  # (the application's own idle connections, from the enqueue)
    observer = create_engine(app_engine.url)
    try:
        wait_for(lambda: backends_named(observer, name) == 0, timeout=5.0)
    finally:
        observer.dispose()


def test_a_restarted_worker_opens_its_pool_again(st, app_engine) -> None:  # type: ignore[no-untyped-def]
    app, done = counted_app(st)
    w = Worker(app, app_engine, settings())
    for round_ in range(2):
        enqueue_jobs(st, app_engine)
        w.start()
        try:
            wait_for(lambda r=round_: w.stats.completed == JOBS * (r + 1))
        finally:
            w.stop(5)
    assert sorted(done) == sorted(list(range(JOBS)) * 2)


def test_own_pool_false_runs_the_worker_on_the_applications_pool(st, app_engine) -> None:  # type: ignore[no-untyped-def]
    app, _ = counted_app(st)
    enqueue_jobs(st, app_engine)
    app_checkouts = checkouts_of(app_engine.pool)
    with w_started(app, app_engine, own_pool=False) as w:
        wait_for(lambda: w.stats.completed == JOBS)
        assert w.engine is app_engine
    assert app_checkouts[0] > 0


@pytest.mark.parametrize("bad", ["yes", 1, None])
def test_own_pool_must_be_true_or_false(bad: object) -> None:
    with pytest.raises(ValidationError, match="own_pool"):
        WorkerSettings(own_pool=bad)  # type: ignore[arg-type]


def test_the_worker_command_runs_its_worker_on_the_engine_it_makes_for_it() -> None:
    args = build_parser().parse_args(["worker", "some.module:app"])
    assert worker_settings(args).own_pool is False


def test_the_worker_command_sizes_its_engine_for_a_worker_of_many_queues(st, db_url) -> None:  # type: ignore[no-untyped-def]
    queues = [f"q{i}" for i in range(8)]
    args = build_parser().parse_args(["worker", "some.module:app", "--concurrency", "1",
                                      *[a for q in queues for a in ("--queue", q)]])
    app = counted_app(st)[0]
    made = worker_engine(db_url, app, worker_settings(args))
    try:
        w = Worker(app, made, worker_settings(args))  # 8 queues x 2 cycles + the maintainer's lock
        assert w.connection_needs.kept == 17
        assert made.pool.size() == w.connection_needs.most
    finally:
        made.dispose()


def test_an_engine_on_a_pool_of_its_own_is_disposed_without_touching_the_applications(app_engine) -> None:
    with app_engine.connect() as conn:
        conn.execute(text("SELECT 1"))
    own = own_pool_engine(app_engine)
    with own.connect() as conn:
        conn.execute(text("SELECT 1"))
    own.dispose()
    assert own.pool is not app_engine.pool
    assert app_engine.pool.checkedin() == 1


# -- pool sizes ------------------------------------------------------------------------------------
def test_a_worker_on_an_engine_of_one_connection_runs_its_jobs(st, db_url) -> None:  # type: ignore[no-untyped-def]
    # the maintainer's lock holder and a busy claim cycle keep a connection each: a copy of a
    # one-connection pool would leave the batcher and the other cycle waiting for good
    tiny = create_engine(db_url, pool_size=1, max_overflow=0, pool_timeout=2)
    try:
        app, done = counted_app(st)
        enqueue_jobs(st, tiny)
        with w_started(app, tiny, maintain=True) as w:
            wait_for(lambda: w.stats.completed == JOBS)
        assert sorted(done) == list(range(JOBS))
    finally:
        tiny.dispose()


def test_the_workers_own_pool_keeps_room_for_every_connection_its_threads_use(st, db_url) -> None:  # type: ignore[no-untyped-def]
    small = create_engine(db_url, pool_size=2, max_overflow=3, pool_timeout=7, pool_recycle=60,
                          pool_pre_ping=True, pool_use_lifo=True)
    try:
        w = Worker(counted_app(st)[0], small, settings(maintain=True, concurrency=4))
        own = w.engine.pool
        assert isinstance(own, QueuePool) and own is not small.pool
        # 2 claim cycles + the maintainer's lock kept; batcher, keeper, a task, 4 outcome writers
        assert w.connection_needs == ConnectionNeeds(kept=3, brief=7)
        assert own.size() == 10
        # 2 + 3 = 5 at once was too few: 10 kept, none beyond
        assert (own._max_overflow, own._timeout, own._recycle, own._pre_ping, own._pool.use_lifo) == (
            0, 7, 60, True, True)
    finally:
        small.dispose()


def test_the_workers_own_pool_hands_out_no_more_at_once_than_the_applications(st, db_url) -> None:  # type: ignore[no-untyped-def]
    default = create_engine(db_url)  # 5 kept, 10 more: 15 at once
    try:
        w = Worker(counted_app(st)[0], default, settings(maintain=True, concurrency=4))
        own = w.engine.pool
        assert isinstance(own, QueuePool)
        assert (own.size(), own._max_overflow) == (w.connection_needs.most, 15 - w.connection_needs.most)
        assert pool_capacity(own) == 15
    finally:
        default.dispose()


def test_the_workers_own_pool_keeps_a_larger_size_of_the_applications(st, db_url) -> None:  # type: ignore[no-untyped-def]
    large = create_engine(db_url, pool_size=40, max_overflow=0)
    try:
        own = Worker(counted_app(st)[0], large, settings()).engine.pool
        assert isinstance(own, QueuePool)
        assert (own.size(), own._max_overflow) == (40, 0)
    finally:
        large.dispose()


def test_a_worker_on_an_applications_pool_it_cannot_progress_on_is_refused(st, db_url) -> None:  # type: ignore[no-untyped-def]
    tiny = create_engine(db_url, pool_size=1, max_overflow=2)
    try:
        with pytest.raises(ValidationError, match=r"a pool of 3 connections.*at least 4") as caught:
            Worker(counted_app(st)[0], tiny, settings(own_pool=False, maintain=True))
        assert caught.value.field == "engine"
        assert tiny.pool.checkedout() == 0 and tiny.pool.checkedin() == 0  # nothing was opened
        # without the maintainer's lock holder 3 is enough
        Worker(counted_app(st)[0], tiny, settings(own_pool=False, maintain=False))
    finally:
        tiny.dispose()


# -- pools of one connection ----------------------------------------------------------------------
def test_a_worker_on_a_static_pool_runs_on_a_queue_pool_of_its_own(st, db_url, caplog) -> None:  # type: ignore[no-untyped-def]
    # a StaticPool hands its one connection to every thread: the maintainer's transactions and
    # the claim cycles' autocommitted statements would interleave on it
    static = create_engine(db_url, poolclass=StaticPool, pool_pre_ping=True)
    try:
        app, done = counted_app(st)
        enqueue_jobs(st, static)
        with caplog.at_level("WARNING", logger="qstore"), w_started(app, static, maintain=True) as w:
            own = w.engine.pool
            assert type(own) is QueuePool
            assert (own.size(), own._max_overflow, own._pre_ping) == (
                w.connection_needs.most, ONE_CONNECTION_OVERFLOW, True)
            wait_for(lambda: w.stats.completed == JOBS)
            m = w.maintainer
            assert m is not None
            wait_for(lambda: {r.task for r in m.reports()} == set(m.task_names))  # each task ran
            assert [(r.task, r.error) for r in m.reports() if r.error is not None] == []
        assert sorted(done) == list(range(JOBS))
        assert [r.getMessage() for r in caplog.records if r.levelname in ("WARNING", "ERROR")] == []
    finally:
        static.dispose()


def test_a_worker_on_an_assertion_pool_runs_its_jobs(st, db_url) -> None:  # type: ignore[no-untyped-def]
    # an AssertionPool allows one checkout at a time: a copy of it refused every claim
    single = create_engine(db_url, poolclass=AssertionPool)
    try:
        app, done = counted_app(st)
        enqueue_jobs(st, single)
        with w_started(app, single, maintain=True) as w:
            wait_for(lambda: w.stats.completed == JOBS)
            assert w.stats.claim_errors == 0
        assert sorted(done) == list(range(JOBS))
    finally:
        single.dispose()


@pytest.mark.parametrize("pool_class", [StaticPool, AssertionPool], ids=lambda c: c.__name__)
def test_a_worker_refuses_to_share_the_one_connection_of_the_applications_pool(st, db_url, pool_class) -> None:  # type: ignore[no-untyped-def]
    one = create_engine(db_url, poolclass=pool_class)
    try:
        with pytest.raises(ValidationError, match=rf"invalid engine='{pool_class.__name__}'.*one connection to "
                                                  r"every caller.*QueuePool of at least") as caught:
            Worker(counted_app(st)[0], one, settings(own_pool=False))
        assert caught.value.field == "engine"
    finally:
        one.dispose()


def test_an_async_worker_on_a_static_pool_claims_on_an_async_queue_pool_of_its_own(st, db_url, engine) -> None:  # type: ignore[no-untyped-def]
    app, done = counted_app(st)
    enqueue_jobs(st, engine)

    async def body() -> type:
        aengine = create_async_engine(db_url, poolclass=StaticPool)
        try:
            w = AsyncWorker(app, aengine, settings(concurrency=4), sync_engine=engine)
            pool: Any = w.engine.sync_engine.pool
            async with w:
                while w.stats.completed < JOBS:
                    await asyncio.sleep(0.01)
            return type(pool)
        finally:
            await aengine.dispose()

    assert asyncio.run(asyncio.wait_for(body(), 20)) is AsyncAdaptedQueuePool
    assert sorted(done) == list(range(JOBS))


@pytest.mark.parametrize("pool", ["static", "one connection"])
def test_an_async_worker_refuses_an_applications_async_pool_it_cannot_run_on(st, db_url, engine, pool) -> None:  # type: ignore[no-untyped-def]
    app, _ = counted_app(st)
    given: dict[str, Any] = {"poolclass": StaticPool} if pool == "static" else {"pool_size": 1, "max_overflow": 0}

    async def body() -> None:
        aengine = create_async_engine(db_url, **given)
        try:
            AsyncWorker(app, aengine, settings(own_pool=False), sync_engine=engine)
        finally:
            await aengine.dispose()

    with pytest.raises(ValidationError, match="StaticPool" if pool == "static" else "a pool of 1 connection") as caught:
        asyncio.run(body())
    assert caught.value.field == "engine"


def test_an_async_worker_refuses_a_sync_engine_of_one_shared_connection(st, db_url) -> None:  # type: ignore[no-untyped-def]
    app, _ = counted_app(st)
    static = create_engine(db_url, poolclass=StaticPool)

    async def body() -> None:
        aengine = create_async_engine(db_url)
        try:
            AsyncWorker(app, aengine, settings(maintain=True), sync_engine=static)
        finally:
            await aengine.dispose()

    try:
        with pytest.raises(ValidationError, match="StaticPool") as caught:
            asyncio.run(body())
        assert caught.value.field == "sync_engine"
    finally:
        static.dispose()


def test_connection_needs_count_one_cycle_per_queue_with_bounded_claimers_and_the_planners_lock(st) -> None:  # type: ignore[no-untyped-def]
    app, _ = counted_app(st)
    plain = connection_needs(app, settings(concurrency=16, maintain=True), ("a", "b", "c"))
    assert plain == ConnectionNeeds(kept=3 * 2 + 1, brief=2 + 1 + 8)
    bounded = connection_needs(app, settings(concurrency=2, max_claimers=1), ("a", "b", "c"))
    assert bounded == ConnectionNeeds(kept=3, brief=2 + 2)

    @app.periodic(every=60)
    @app.task(kind="tick", queue="pool")
    def tick(ctx: JobContext) -> None: ...

    planned = connection_needs(app, settings(concurrency=2), ("pool",))
    assert planned == ConnectionNeeds(kept=2 + 1, brief=2 + 1 + 2)


def test_pool_capacity_is_size_and_overflow_or_none_without_a_limit(db_url) -> None:
    engines = [create_engine(db_url, pool_size=3, max_overflow=4), create_engine(db_url, pool_size=3, max_overflow=-1),
               create_engine(db_url, poolclass=NullPool)]
    try:
        assert [pool_capacity(e.pool) for e in engines] == [7, None, None]
    finally:
        for e in engines:
            e.dispose()


# -- the asyncio worker --------------------------------------------------------------------------
def test_an_async_worker_takes_no_connection_from_the_applications_async_pool(st, engine, db_url) -> None:  # type: ignore[no-untyped-def]
    app, _ = counted_app(st)
    enqueue_jobs(st, engine)

    async def body() -> tuple[int, bool]:
        aengine = create_async_engine(db_url)
        try:
            w = AsyncWorker(app, aengine, settings(), sync_engine=engine)
            seen = checkouts_of(aengine.sync_engine.pool)  # (after the worker made its pool)
            async with w:
                while w.stats.completed < JOBS:
                    await asyncio.sleep(0.01)
                separate = w.engine.sync_engine.pool is not aengine.sync_engine.pool
            return seen[0], separate and w.engine.sync_engine.pool.checkedin() == 0
        finally:
            await aengine.dispose()

    checkouts, separate_and_emptied = asyncio.run(asyncio.wait_for(body(), 20))
    assert checkouts == 0
    assert separate_and_emptied


def test_an_async_worker_with_own_pool_false_uses_the_applications_async_pool(st, engine, db_url) -> None:  # type: ignore[no-untyped-def]
    app, _ = counted_app(st)
    enqueue_jobs(st, engine)

    async def body() -> int:
        aengine = create_async_engine(db_url)
        try:
            w = AsyncWorker(app, aengine, settings(own_pool=False), sync_engine=engine)
            seen = checkouts_of(aengine.sync_engine.pool)
            async with w:
                while w.stats.completed < JOBS:
                    await asyncio.sleep(0.01)
                assert w.engine is aengine
            return seen[0]
        finally:
            await aengine.dispose()

    assert asyncio.run(asyncio.wait_for(body(), 20)) > 0


def test_an_async_workers_own_pool_keeps_room_for_its_claims_and_writes(st, db_url, engine) -> None:  # type: ignore[no-untyped-def]
    app, _ = counted_app(st)

    async def body() -> tuple[int, int]:
        aengine = create_async_engine(db_url, pool_size=1, max_overflow=0)
        try:
            w = AsyncWorker(app, aengine, settings(concurrency=4), sync_engine=engine)
            pool: Any = w.engine.sync_engine.pool
            return pool.size(), w.connection_needs.most
        finally:
            await aengine.dispose()

    size, most = asyncio.run(body())
    assert (size, most) == (2 + 2 + 4, 8)  # 2 claim cycles; batcher, keeper, 4 outcome writers


def test_an_async_worker_refuses_a_sync_engine_too_small_for_its_maintainer(st, db_url) -> None:  # type: ignore[no-untyped-def]
    app, _ = counted_app(st)
    tiny = create_engine(db_url, pool_size=1, max_overflow=0)

    async def body() -> None:
        aengine = create_async_engine(db_url)
        try:
            AsyncWorker(app, aengine, settings(maintain=True), sync_engine=tiny)
        finally:
            await aengine.dispose()

    try:
        with pytest.raises(ValidationError, match="a pool of 1 connection") as caught:
            asyncio.run(body())
        assert caught.value.field == "sync_engine"
    finally:
        tiny.dispose()


def test_stopping_a_worker_on_a_pool_of_its_own_tells_no_engine_disposed_listener(st, db_url, engine) -> None:  # type: ignore[no-untyped-def]
    app, _ = counted_app(st)
    disposed: list[str] = []

    async def body() -> tuple[list[str], bool]:
        aengine = create_async_engine(db_url)
        try:
            event.listen(aengine.sync_engine, "engine_disposed", lambda e: disposed.append("async"))
            w = AsyncWorker(app, aengine, settings(), sync_engine=engine)
            async with w:
                await asyncio.sleep(0.2)
            return list(disposed), w.engine.sync_engine.pool.checkedin() == 0
        finally:
            await aengine.dispose()

    sync_app = create_engine(db_url)
    try:
        event.listen(sync_app, "engine_disposed", lambda e: disposed.append("sync"))
        with w_started(app, sync_app):
            time.sleep(0.2)
        assert disposed == []  # the thread worker emptied its pool alone
        seen, emptied = asyncio.run(asyncio.wait_for(body(), 20))
    finally:
        sync_app.dispose()
    assert seen == [] and emptied
    assert disposed == ["async", "sync"]  # the applications' own disposals are told as ever


# -- helpers -------------------------------------------------------------------------------------
@contextlib.contextmanager
def w_started(app: App, engine: Engine, **given: Any) -> Iterator[Worker]:
    """A worker of ``app`` on ``engine`` with ``settings(**given)``, started for the block."""
    worker = Worker(app, engine, settings(**given))
    worker.start()
    try:
        yield worker
    finally:
        worker.stop(5)


def _application_name(engine: Engine) -> str:
    with engine.connect() as conn:
        return str(conn.execute(text("SELECT current_setting('application_name')")).scalar_one())
