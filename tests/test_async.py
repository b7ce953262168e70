"""The async face runs the same operations through run_sync, with the same contract."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine

from qstore import InsertParams
from qstore.aio import AsyncQueueStorage


def _run(coro):  # type: ignore[no-untyped-def]
    return asyncio.run(coro)


@pytest.fixture
def async_storage(make_storage):  # type: ignore[no-untyped-def]
    return AsyncQueueStorage(make_storage())


def test_async_engine_enqueue_claim_complete_round_trip(db_url, async_storage):  # type: ignore[no-untyped-def]
    async def main():  # type: ignore[no-untyped-def]
        engine = create_async_engine(db_url)
        try:
            assert await async_storage.enqueue_params_copy(engine, [InsertParams("k", {"i": i}) for i in range(3)]) == 3
            assert await async_storage.enqueue_params_batch(engine, [InsertParams("k", {"i": 3})]) == 1
            jobs = await async_storage.claim_runtime_batch(engine, "default", 10)
            done = await async_storage.complete_runtime_batch(engine, jobs)
            counts = await async_storage.queue_counts(engine, "default")
        finally:
            await engine.dispose()
        return jobs, done, counts

    jobs, done, counts = _run(main())
    assert sorted(j.job.args["i"] for j in jobs) == [0, 1, 2, 3]
    assert len(done) == 4
    assert (counts.available, counts.running, counts.terminal) == (0, 0, 4)


def test_async_engine_load_job_reads_the_job_in_its_own_snapshot(db_url, async_storage):  # type: ignore[no-untyped-def]
    async def main():  # type: ignore[no-untyped-def]
        engine = create_async_engine(db_url)
        try:
            await async_storage.enqueue_params_batch(engine, [InsertParams("k", {"i": 7})])
            (claimed,) = await async_storage.claim_runtime_batch(engine, "default", 1)
            running = await async_storage.load_job(engine, claimed.job.id)
            await async_storage.complete_runtime_batch(engine, [claimed])
            done = await async_storage.load_job(engine, claimed.job.id)
        finally:
            await engine.dispose()
        return running, done

    running, done = _run(main())
    assert (running.state.value, running.args) == ("running", {"i": 7})
    assert done.state.value == "completed"


def test_async_session_rollback_discards_the_enqueue(db_url, async_storage):  # type: ignore[no-untyped-def]
    async def main():  # type: ignore[no-untyped-def]
        engine = create_async_engine(db_url)
        try:
            async with AsyncSession(engine) as session:
                await async_storage.enqueue_params_batch(session, [InsertParams("k", {})])
                await session.rollback()
            async with AsyncSession(engine) as session:
                await async_storage.enqueue_params_batch(session, [InsertParams("k", {"kept": True})])
                await session.commit()
            async with engine.connect() as conn:
                schema = async_storage.schema()
                rows = (await conn.execute(text(f"SELECT args FROM {schema}.ready_entries"))).scalars().all()
        finally:
            await engine.dispose()
        return rows

    assert _run(main()) == [{"kept": True}]


WITHOUT_GREENLET = r'''
import asyncio, sys
sys.modules["greenlet"] = None  # as if the 'async' extra were not installed
from qstore import QueueStorage, QueueStorageError
from qstore.tasks import App

for what, attempt in [("import", lambda: __import__("qstore.aio")),
                      ("async_storage", lambda: App(QueueStorage()).async_storage)]:
    try:
        attempt()
    except ImportError as err:
        assert isinstance(err, QueueStorageError), type(err).__mro__
        print(f"{what}: {type(err).__name__}: {err}")
    else:
        print(f"{what}: no error")
'''


def test_the_async_face_without_the_async_extra_fails_in_one_line_naming_it() -> None:
    done = subprocess.run([sys.executable, "-c", WITHOUT_GREENLET], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert [line.split(":")[0] for line in lines] == ["import", "async_storage"], done.stdout
    for line in lines:
        assert "AsyncExtraMissingError" in line and "pip install 'qstore[async]'" in line, line
