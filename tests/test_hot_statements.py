"""The worker's calls compile nothing once warm: hot statements are compiled once per
dialect, and where they go through SQLAlchemy (cursor events listened to) and on the
general completion path they hit its compiled cache."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from jobtools import materialise
from sqlalchemy import Engine, create_engine, event

from qstore import InsertOpts, InsertParams
from qstore.storage import statements


@pytest.fixture
def own_engine(db_url: str) -> Iterator[Engine]:
    eng = create_engine(db_url, pool_size=2)
    yield eng
    eng.dispose()


def cycle(engine: Engine, storage: Any) -> None:
    """One round of every hot call a worker and a producer make: enqueue, claim, fast and
    general completion, ``complete_and_claim``."""
    storage.enqueue(engine, InsertParams("k", {"n": 1}, InsertOpts(queue="q")))
    storage.enqueue_many(engine, [InsertParams("k", {"n": n}, InsertOpts(queue="q")) for n in range(3)])
    a, b = storage.claim_runtime_batch(engine, "q", 2)
    materialise(engine, storage, b)
    assert len(storage.complete_runtime_batch(engine, [a, b])) == 2  # fast and general path
    got = storage.complete_and_claim(engine, [], "q", 1)
    assert len(storage.complete_and_claim(engine, got.claimed, "q", 1).completed) == 1
    storage.complete_and_claim(engine, [(c.job.id, c.job.run_lease) for c in storage.claim_runtime_batch(
        engine, "q", 5)], "q", 1)


def compiled_entries(engine: Engine) -> int:
    cache = engine._compiled_cache
    return len(cache) if cache is not None else 0


def test_hot_calls_compile_nothing_after_a_warm_up(own_engine, storage, monkeypatch):
    compiles: list[object] = []
    original = statements.HotStatement._compile

    def counted(self: statements.HotStatement, dialect: Any) -> Any:
        compiles.append(self.statement)
        return original(self, dialect)

    monkeypatch.setattr(statements.HotStatement, "_compile", counted)
    cycle(own_engine, storage)
    hot, cached = len(compiles), compiled_entries(own_engine)
    for _ in range(3):
        cycle(own_engine, storage)
    assert len(compiles) == hot and compiled_entries(own_engine) == cached


def test_every_hot_statement_runs_on_a_generic_plan_after_the_servers_first_custom_ones(own_engine, storage):
    # The server plans a prepared statement's first five executions with their values
    # (custom plans), then keeps its generic plan unless that one is estimated dearer: a
    # statement left on custom plans is planned again at every call. (The general path's
    # statements, which the driver prepares after a few runs, are left to the server.)
    for _ in range(12):
        cycle(own_engine, storage)
    raws = [own_engine.raw_connection() for _ in range(2)]  # the pool's two connections
    try:
        plans = [row for raw in raws for row in raw.driver_connection.execute(
            "SELECT statement, generic_plans, custom_plans FROM pg_prepared_statements "
            "WHERE statement ~ '(claim_ready|complete_receipts|enqueue_jobs?)\\('").fetchall()]
    finally:
        for raw in raws:
            raw.close()
    texts = [text for text, _, _ in plans]
    assert any("complete_receipts" in t and "claim_ready" in t for t in texts)  # complete_and_claim
    assert any("enqueue_job(" in t for t in texts) and any("enqueue_jobs(" in t for t in texts)
    assert sum(generic for _, generic, _ in plans) > 0
    assert [(text[:80], generic, custom) for text, generic, custom in plans if custom > 5] == []


def test_with_cursor_events_listened_to_hot_calls_hit_the_compiled_cache(own_engine, storage):
    seen: list[str] = []

    @event.listens_for(own_engine, "before_cursor_execute")
    def note(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        seen.append(statement)

    cycle(own_engine, storage)
    cached = compiled_entries(own_engine)
    for _ in range(3):
        cycle(own_engine, storage)
    assert compiled_entries(own_engine) == cached
    assert any("complete_receipts" in s and "claim_ready" in s for s in seen)  # the listener saw the cycle


def test_values_in_parameter_order_go_to_the_driver_as_the_named_ones_do(own_engine, storage):
    from qstore.storage import enqueue as enqueuing
    from qstore.storage.jobs import prepare_job

    hot, keys = enqueuing._enqueue_one_stmt(storage.tables), enqueuing._VALUE_KEYS
    prepared = prepare_job(InsertParams("k", {"n": 1}, InsertOpts(queue="q", tags=("t",), ordering_key=b"o")), 1)
    values = enqueuing._one_values(storage.tables, prepared)
    named_sql, named = hot.parameters(own_engine.dialect, dict(zip(keys, values, strict=True)))
    ordered_sql, ordered = hot.in_order(own_engine.dialect, keys, values)

    def plain(value: Any) -> Any:  # psycopg's Json wrappers compare by identity
        return (type(value), value.obj) if hasattr(value, "obj") else value

    assert ordered_sql == named_sql and list(map(plain, ordered)) == list(map(plain, named))
    with pytest.raises(TypeError, match="parameters"):
        hot.in_order(own_engine.dialect, tuple(reversed(keys)), values)


def test_a_hot_call_on_an_async_engine_checks_out_one_connection(storage, db_url):
    import asyncio

    from sqlalchemy.ext.asyncio import create_async_engine

    from qstore.aio import AsyncQueueStorage

    async def body() -> list[int]:
        aengine = create_async_engine(db_url)
        try:
            astorage = AsyncQueueStorage(storage)
            seen = [0]
            event.listen(aengine.sync_engine.pool, "checkout", lambda *a: seen.__setitem__(0, seen[0] + 1))
            for n in range(3):
                await astorage.enqueue(aengine, InsertParams("k", {"n": n}, InsertOpts(queue="q")))
            claimed = await astorage.claim_runtime_batch(aengine, "q", 3)
            assert len(claimed) == 3
            return seen
        finally:
            await aengine.dispose()

    assert asyncio.run(body()) == [4]  # three enqueues and a claim, one checkout each


# -- on an AsyncEngine ---------------------------------------------------------------------------
async def async_cycle(aengine: Any, astorage: Any) -> None:
    """:func:`cycle` on the async face."""
    await astorage.enqueue(aengine, InsertParams("k", {"n": 1}, InsertOpts(queue="q")))
    await astorage.enqueue_many(aengine, [InsertParams("k", {"n": n}, InsertOpts(queue="q")) for n in range(3)])
    claimed = await astorage.claim_runtime_batch(aengine, "q", 2)
    assert len(await astorage.complete_runtime_batch(aengine, claimed)) == 2
    got = await astorage.complete_and_claim(aengine, [], "q", 1)
    assert len((await astorage.complete_and_claim(aengine, got.claimed, "q", 1)).completed) == 1


def run_async_cycles(storage: Any, db_url: str, listen: str | None) -> tuple[list[str], list[str]]:
    """Two async cycles on a new ``AsyncEngine``: the statements ``Connection.execute`` ran
    (``before_execute``) and the ones a ``listen`` cursor event saw, if asked for."""
    import asyncio

    from sqlalchemy.ext.asyncio import create_async_engine

    from qstore.aio import AsyncQueueStorage

    executed: list[str] = []
    cursor_seen: list[str] = []

    async def body() -> None:
        aengine = create_async_engine(db_url)
        try:
            event.listen(aengine.sync_engine, "before_execute",
                         lambda conn, clause, *a: executed.append(str(clause)))
            if listen is not None:
                event.listen(aengine.sync_engine, listen, lambda conn, cur, stmt, *a: cursor_seen.append(stmt))
            astorage = AsyncQueueStorage(storage)
            for _ in range(2):
                await async_cycle(aengine, astorage)
        finally:
            await aengine.dispose()

    asyncio.run(body())
    return executed, cursor_seen


def test_hot_calls_on_an_async_engine_go_to_the_driver_cursor_directly(storage, db_url):
    executed, _ = run_async_cycles(storage, db_url, None)
    hot = ("claim_ready", "complete_receipts", "enqueue_job")
    assert not [s for s in executed if any(name in s for name in hot)]


def test_with_cursor_events_listened_to_an_async_engines_hot_calls_go_through_a_connection(storage, db_url):
    executed, seen = run_async_cycles(storage, db_url, "before_cursor_execute")
    assert any("claim_ready" in s for s in executed) and any("enqueue_job" in s for s in seen)


def test_an_async_hot_call_on_a_cut_connection_fails_once_and_the_next_reconnects(storage, db_url, engine):
    import asyncio

    from sqlalchemy import text
    from sqlalchemy.ext.asyncio import create_async_engine

    from qstore.aio import AsyncQueueStorage
    from qstore.errors import QueueStorageError

    name = "qstore-cut-async"

    async def body() -> tuple[str, int]:
        aengine = create_async_engine(db_url, pool_size=1, connect_args={"application_name": name})
        try:
            astorage = AsyncQueueStorage(storage)
            job = InsertParams("k", {"n": 1}, InsertOpts(queue="q"))
            await astorage.enqueue(aengine, job)
            with engine.connect() as conn:
                conn.execute(text("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                                  "WHERE application_name = :n"), {"n": name})
            await asyncio.sleep(0.1)
            try:
                await astorage.enqueue(aengine, job)
                outcome = "sent"
            except QueueStorageError as err:
                outcome = type(err).__name__
            await astorage.enqueue(aengine, job)
            return outcome, len(await astorage.claim_runtime_batch(aengine, "q", 10))
        finally:
            await aengine.dispose()

    outcome, claimed = asyncio.run(body())
    assert outcome != "sent"
    assert claimed == 2


def test_hot_calls_in_a_callers_async_transaction_go_to_the_driver_and_follow_its_end(storage, db_url, engine):
    import asyncio

    from sqlalchemy.ext.asyncio import create_async_engine

    from qstore.aio import AsyncQueueStorage

    executed: list[str] = []

    async def body() -> tuple[int, int]:
        aengine = create_async_engine(db_url)
        try:
            event.listen(aengine.sync_engine, "before_execute", lambda conn, clause, *a: executed.append(str(clause)))
            astorage = AsyncQueueStorage(storage)
            job = InsertParams("k", {"n": 1}, InsertOpts(queue="q"))
            async with aengine.connect() as conn:
                await astorage.enqueue(conn, job)
                await conn.rollback()  # the enqueue goes with the caller's transaction
                await astorage.enqueue(conn, job)
                await astorage.enqueue(conn, job)
                await conn.commit()
                claimed = await astorage.claim_runtime_batch(conn, "q", 10)
                await conn.rollback()  # so does the claim: both jobs are claimable again
            async with aengine.begin() as conn:
                again = await astorage.claim_runtime_batch(conn, "q", 10)
            return len(claimed), len(again)
        finally:
            await aengine.dispose()

    assert asyncio.run(body()) == (2, 2)
    assert not [s for s in executed if "enqueue_job" in s or "claim_ready" in s]
