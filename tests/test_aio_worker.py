"""The asyncio worker (``AsyncWorker`` on an ``AsyncEngine``) and the async LISTEN helper:
every outcome lands the job in its state, several workers claim one queue with each job
run exactly once, shutdown finishes or hands back, heartbeats keep long attempts alive,
``NOTIFY`` wakes an idle worker, sync handlers run on the pool without blocking the loop."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from outage import OutageProxy
from sqlalchemy import create_engine
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from qstore import InsertOpts, InsertParams
from qstore.aio import AsyncListener
from qstore.status import UNHANDLED_KEY
from qstore.tasks import App, Cancel, Fail, JobContext, RetryAfter, Snooze, WaitForCallback
from qstore.types import JobState
from qstore.worker import AsyncWorker, WorkerSettings


def run(coro: Awaitable[Any]) -> Any:
    return asyncio.run(coro)  # type: ignore[arg-type]


async def eventually(check: Callable[[], Any], timeout: float = 5.0, what: str = "condition") -> Any:
    """Poll ``check`` (run on a thread: it may read the database) until it returns something
    truthy; fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = await asyncio.to_thread(check)
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {timeout}s (last: {value!r})")
        await asyncio.sleep(0.01)


def state_of(st, engine, job_id: int) -> JobState | None:  # type: ignore[no-untyped-def]
    row = st.load_job(engine, job_id)
    return row.state if row is not None else None


def settings(**given: Any) -> WorkerSettings:
    given.setdefault("maintain", False)
    given.setdefault("concurrency", 4)
    given.setdefault("poll_interval", 0.2)
    return WorkerSettings(**given)


async def with_worker(app: App, db_url: str, engine: Any, body: Callable[[AsyncWorker], Awaitable[Any]],
                      **given: Any) -> Any:
    """Run ``body(worker)`` inside ``async with AsyncWorker(...)`` on a fresh async engine."""
    aengine = create_async_engine(db_url)
    try:
        async with AsyncWorker(app, aengine, settings(**given), sync_engine=engine) as w:
            return await body(w)
    finally:
        await aengine.dispose()


@pytest.fixture
def app(st) -> App:  # type: ignore[no-untyped-def]
    return App(st)


# -- outcomes -------------------------------------------------------------------------------------


def test_an_async_handler_that_returns_completes_its_job_on_the_loop_thread(db_url, engine, st, app):  # type: ignore[no-untyped-def]
    ran: list[tuple[int, bool]] = []

    @app.task(kind="hello")
    async def hello(ctx: JobContext, name: str) -> str:
        ran.append((ctx.attempt, threading.current_thread() is loop_thread[0]))
        return name

    loop_thread: list[threading.Thread] = []
    job_id = hello.defer(engine, name="ada")

    async def body(w: AsyncWorker) -> Any:
        loop_thread.append(threading.current_thread())
        await eventually(lambda: state_of(st, engine, job_id) == JobState.COMPLETED, what="completed")
        await eventually(lambda: w.stats.completed == 1, what="counted")
        return w.stats

    stats = run(with_worker(app, db_url, engine, body))
    assert ran == [(1, True)]
    assert (stats.claimed, stats.completed) == (1, 1)


@pytest.mark.parametrize("kind", ["async", "sync"])
@pytest.mark.parametrize(("outcome", "state", "counter"), [
    (lambda: Snooze(60), JobState.SCHEDULED, "snoozed"),
    (lambda: RetryAfter(60), JobState.RETRYABLE, "retry_after"),
    (lambda: Cancel("not needed"), JobState.CANCELLED, "cancelled"),
    (lambda: Fail("bad input"), JobState.FAILED, "failed"),
    (lambda: Fail("poison", dlq=True), JobState.FAILED, "dlq"),
    (lambda: WaitForCallback(timeout=600), JobState.WAITING_EXTERNAL, "waiting_callback"),
    (lambda: ValueError("smtp down"), JobState.RETRYABLE, "retried"),
], ids=["snooze", "retry_after", "cancel", "fail", "fail_dlq", "wait_for_callback", "error"])
def test_each_outcome_lands_the_job_in_its_state(db_url, engine, st, app, outcome, state, counter, kind):  # type: ignore[no-untyped-def]
    if kind == "async":
        @app.task(kind="k")
        async def handler(ctx: JobContext) -> None:
            raise outcome()
    else:
        @app.task(kind="k")
        def handler(ctx: JobContext) -> None:
            raise outcome()

    job_id = handler.defer(engine)

    async def body(w: AsyncWorker) -> None:
        await eventually(lambda: state_of(st, engine, job_id) == state, what=state.value)
        await eventually(lambda: getattr(w.stats, counter) == 1, what=counter)

    run(with_worker(app, db_url, engine, body))
    if counter == "retried":
        assert st.load_job(engine, job_id).errors[-1]["error"].startswith("ValueError: smtp down")


def test_an_exhausted_job_counts_as_failed_and_exhausted(db_url, engine, st, app):  # type: ignore[no-untyped-def]
    @app.task(kind="k", max_attempts=1)
    async def handler(ctx: JobContext) -> None:
        raise RuntimeError("no luck")

    job_id = handler.defer(engine)

    async def body(w: AsyncWorker) -> Any:
        await eventually(lambda: state_of(st, engine, job_id) == JobState.FAILED)
        await eventually(lambda: w.stats.failed == 1)
        return w.stats

    stats = run(with_worker(app, db_url, engine, body))
    assert (stats.exhausted, stats.dlq) == (1, 0)


def test_a_job_of_a_kind_without_a_task_is_handed_back_without_counting_an_attempt(db_url, engine, st, app):  # type: ignore[no-untyped-def]
    job_id = st.enqueue(engine, InsertParams("mystery.kind", {}, InsertOpts(queue="default")))

    async def body(w: AsyncWorker) -> Any:
        await eventually(lambda: w.stats.unknown_kind == 1)
        return st.load_job(engine, job_id)

    row = run(with_worker(app, db_url, engine, body, queues=["default"]))
    assert (row.state, row.attempt) == (JobState.SCHEDULED, 0)
    assert row.progress[UNHANDLED_KEY]["count"] == 1


def test_follow_up_jobs_commit_with_the_completion(db_url, engine, st, app):  # type: ignore[no-untyped-def]
    @app.task(kind="next")
    async def after(ctx: JobContext, n: int) -> None: ...

    @app.task(kind="first")
    async def first(ctx: JobContext) -> None:
        ctx.defer(after, n=1)

    job_id = first.defer(engine)

    async def body(w: AsyncWorker) -> Any:
        await eventually(lambda: w.stats.completed == 2, what="both completed")
        return w.stats

    stats = run(with_worker(app, db_url, engine, body))
    assert stats.followups == 1 and state_of(st, engine, job_id) == JobState.COMPLETED


def test_an_operator_cancel_cancels_a_running_async_handler(db_url, engine, st, app):  # type: ignore[no-untyped-def]
    seen: list[str] = []

    @app.task(kind="k")
    async def handler(ctx: JobContext) -> None:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            seen.append("cancelled")
            raise

    job_id = handler.defer(engine)

    async def body(w: AsyncWorker) -> Any:
        await eventually(lambda: state_of(st, engine, job_id) == JobState.RUNNING)
        await asyncio.sleep(0.1)
        await asyncio.to_thread(st.cancel_job, engine, job_id)
        await eventually(lambda: seen == ["cancelled"], what="the handler cancelled")
        await eventually(lambda: w.stats.closed_under_handler == 1)

    run(with_worker(app, db_url, engine, body))
    assert state_of(st, engine, job_id) == JobState.CANCELLED


def test_an_operator_cancel_of_a_claimed_job_waiting_for_a_handler_lets_it_go(db_url, engine, st, app):  # type: ignore[no-untyped-def]
    gate = asyncio.Event()
    ran: list[int] = []

    @app.task(kind="k")
    async def handler(ctx: JobContext, i: int) -> None:
        ran.append(i)
        await gate.wait()

    first, second = handler.defer_many(engine, [{"i": 1}, {"i": 2}])

    async def body(w: AsyncWorker) -> Any:
        await eventually(lambda: w.stats.claimed == 2 and ran == [1], what="one running, one waiting")
        await asyncio.to_thread(st.cancel_job, engine, second)
        await eventually(lambda: w.stats.in_flight == 1, what="the cancelled one let go")
        gate.set()
        await eventually(lambda: state_of(st, engine, first) == JobState.COMPLETED)
        return w.stats

    stats = run(with_worker(app, db_url, engine, body, concurrency=1, prefetch=1))
    assert ran == [1] and state_of(st, engine, second) == JobState.CANCELLED
    assert stats.in_flight == 0


def test_a_tasks_deadline_closes_the_attempt_and_cancels_its_handler(db_url, engine, st, app):  # type: ignore[no-untyped-def]
    @app.task(kind="k", deadline=0.3)
    async def handler(ctx: JobContext) -> None:
        await asyncio.sleep(30)

    job_id = handler.defer(engine)

    async def body(w: AsyncWorker) -> Any:
        await eventually(lambda: w.stats.deadline_exceeded == 1, what="deadline")
        return st.load_job(engine, job_id)

    row = run(with_worker(app, db_url, engine, body, heartbeat_interval=0.4))
    assert row.state == JobState.RETRYABLE and "deadline of 0.3s exceeded" in row.errors[-1]["error"]


# -- several workers ------------------------------------------------------------------------------


def test_several_async_workers_on_one_queue_run_each_job_exactly_once(db_url, engine, st, app):  # type: ignore[no-untyped-def]
    runs: dict[int, int] = {}

    @app.task(kind="k")
    async def handler(ctx: JobContext, i: int) -> None:
        runs[i] = runs.get(i, 0) + 1
        await asyncio.sleep(0.001)

    n = 600
    handler.defer_many(engine, [{"i": i} for i in range(n)])

    async def main() -> list[Any]:
        aengine = create_async_engine(db_url, pool_size=10)
        workers = [AsyncWorker(app, aengine, settings(concurrency=8, claim_batch=16), sync_engine=engine)
                   for _ in range(3)]
        try:
            for w in workers:
                await w.start()
            await eventually(lambda: sum(w.stats.completed for w in workers) == n, timeout=60, what="drained")
            return [await w.stop(5) for w in workers]
        finally:
            await aengine.dispose()

    stats = run(main())
    assert sorted(runs) == list(range(n)) and set(runs.values()) == {1}
    assert all(s.claimed > 0 for s in stats), [s.claimed for s in stats]  # every worker took a share
    assert sum(s.claimed for s in stats) == n
    assert st.queue_counts(engine, "default").terminal == n


# -- shutdown -------------------------------------------------------------------------------------


def test_a_stop_finishes_a_handler_within_the_timeout_and_hands_back_the_rest(db_url, engine, st, app):  # type: ignore[no-untyped-def]
    @app.task(kind="brief")
    async def brief(ctx: JobContext) -> None:
        await asyncio.sleep(0.3)

    @app.task(kind="stuck")
    async def stuck(ctx: JobContext) -> None:
        await asyncio.sleep(60)

    brief_id = brief.defer(engine)
    stuck_id = stuck.defer(engine)

    async def main() -> Any:
        aengine = create_async_engine(db_url)
        try:
            w = AsyncWorker(app, aengine, settings(concurrency=2, prefetch=0), sync_engine=engine)
            await w.start()
            await eventually(lambda: w.stats.in_flight == 2 and state_of(st, engine, stuck_id) == JobState.RUNNING)
            started = time.monotonic()
            stats = await w.stop(1.0)
            return stats, time.monotonic() - started
        finally:
            await aengine.dispose()

    stats, took = run(main())
    assert state_of(st, engine, brief_id) == JobState.COMPLETED
    row = st.load_job(engine, stuck_id)
    assert (row.state, row.attempt) == (JobState.SCHEDULED, 0)  # handed back, the attempt not counted
    assert (stats.completed, stats.handed_back, stats.in_flight) == (1, 1, 0)
    assert 0.9 < took < 5


def test_a_stop_hands_back_claimed_jobs_no_handler_started(db_url, engine, st, app):  # type: ignore[no-untyped-def]
    gate = threading.Event()

    @app.task(kind="k")
    async def handler(ctx: JobContext) -> None:
        await asyncio.to_thread(gate.wait, 10)

    ids = handler.defer_many(engine, [{} for _ in range(6)])

    async def main() -> Any:
        aengine = create_async_engine(db_url)
        try:
            w = AsyncWorker(app, aengine, settings(concurrency=2, prefetch=4), sync_engine=engine)
            await w.start()
            await eventually(lambda: w.stats.claimed == 6, what="all claimed")
            stopping = asyncio.ensure_future(w.stop(10))
            await asyncio.sleep(0.3)
            gate.set()  # the two running handlers finish
            return await stopping
        finally:
            await aengine.dispose()

    stats = run(main())
    states = sorted(state_of(st, engine, i).value for i in ids)
    assert states == ["completed"] * 2 + ["scheduled"] * 4
    assert (stats.completed, stats.handed_back) == (2, 4)


# -- heartbeats, LISTEN, the pool ------------------------------------------------------------------


def test_heartbeats_extend_the_lease_of_a_long_attempt(db_url, engine, st, app):  # type: ignore[no-untyped-def]
    @app.task(kind="k")
    async def handler(ctx: JobContext) -> None:
        await asyncio.sleep(1.5)

    job_id = handler.defer(engine)

    async def body(w: AsyncWorker) -> Any:
        await eventually(lambda: state_of(st, engine, job_id) == JobState.RUNNING)
        first = st.load_job(engine, job_id).heartbeat_at
        await asyncio.sleep(1.0)
        rescued = await asyncio.to_thread(st.rescue_stale_heartbeats, engine, 0.6)
        later = st.load_job(engine, job_id).heartbeat_at
        await eventually(lambda: state_of(st, engine, job_id) == JobState.COMPLETED)
        return first, later, rescued, w.stats

    first, later, rescued, stats = run(with_worker(app, db_url, engine, body, heartbeat_interval=0.2))
    assert rescued == []  # heartbeated within the last 0.6 s throughout
    assert later is not None and (first is None or later > first) and stats.heartbeats >= 3


def test_a_notify_wakes_an_idle_worker_promptly(db_url, engine, st, app):  # type: ignore[no-untyped-def]
    started: list[float] = []

    @app.task(kind="k")
    async def handler(ctx: JobContext) -> None:
        started.append(time.monotonic())

    async def body(w: AsyncWorker) -> float:
        await asyncio.sleep(0.5)  # the first claim came back empty: the worker waits (poll 30 s)
        before = w.stats.claim_calls
        sent = time.monotonic()
        await asyncio.to_thread(handler.defer, engine)
        await eventually(lambda: started, timeout=5, what="the handler to start")
        assert w.stats.claim_calls == before + 1  # woken once, not polling
        return started[0] - sent

    latency = run(with_worker(app, db_url, engine, body, poll_interval=30))
    assert latency < 0.5


def test_a_sync_handler_runs_on_the_pool_without_blocking_the_loop(db_url, engine, st, app):  # type: ignore[no-untyped-def]
    threads: list[threading.Thread] = []
    done = threading.Event()

    @app.task(kind="k")
    def handler(ctx: JobContext) -> None:
        threads.append(threading.current_thread())
        time.sleep(1.0)  # blocking: on the loop's thread this would stall it for a second
        done.set()

    handler.defer(engine)

    async def body(w: AsyncWorker) -> Any:
        loop_thread = threading.current_thread()
        while not threads:
            await asyncio.sleep(0.005)
        gaps: list[float] = []
        last = time.monotonic()
        while not done.is_set():
            await asyncio.sleep(0.01)
            now = time.monotonic()
            gaps.append(now - last)
            last = now
        await eventually(lambda: w.stats.completed == 1)
        return loop_thread, gaps

    loop_thread, gaps = run(with_worker(app, db_url, engine, body))
    assert threads[0] is not loop_thread and threads[0].name.startswith("qstore-handler")
    assert len(gaps) >= 5 and max(gaps) < 0.5, gaps  # the loop kept turning while the handler slept


def test_the_async_listener_returns_a_wakeup_as_soon_as_a_notify_arrives(db_url, engine, st):  # type: ignore[no-untyped-def]
    async def main() -> Any:
        aengine: AsyncEngine = create_async_engine(db_url)
        try:
            async with AsyncListener(aengine, st.config, ["mail"]) as listener:
                assert (await listener.wait(0.05)).queues == frozenset()
                sent = time.monotonic()
                await asyncio.to_thread(st.enqueue, engine, InsertParams("k", {}, InsertOpts(queue="mail")))
                wake = await listener.wait(10)
                took = time.monotonic() - sent
                listener.interrupt()
                interrupted = time.monotonic()
                quiet = await listener.wait(10)
                return wake, took, quiet, time.monotonic() - interrupted
        finally:
            await aengine.dispose()

    wake, took, quiet, stopped_in = run(main())
    assert wake.queues == frozenset({"mail"}) and took < 1.0
    assert quiet.queues == frozenset() and stopped_in < 0.5



def test_an_interrupt_ends_a_wait_in_progress_and_the_listener_still_hears_the_next_notify(
        db_url, engine, st):  # type: ignore[no-untyped-def]
    async def main() -> Any:
        aengine: AsyncEngine = create_async_engine(db_url)
        try:
            async with AsyncListener(aengine, st.config, ["mail"]) as listener:
                waiting = asyncio.ensure_future(listener.wait(10))
                await asyncio.sleep(0.1)  # the wait is receiving by now
                interrupted = time.monotonic()
                listener.interrupt()
                quiet = await waiting
                stopped_in = time.monotonic() - interrupted
                await asyncio.to_thread(st.enqueue, engine, InsertParams("k", {}, InsertOpts(queue="mail")))
                wake = await listener.wait(10)
                return quiet, stopped_in, wake
        finally:
            await aengine.dispose()

    quiet, stopped_in, wake = run(main())
    assert quiet.queues == frozenset() and stopped_in < 0.5
    assert wake.queues == frozenset({"mail"})

# -- a database outage ------------------------------------------------------------------------------


@pytest.mark.slow
def test_an_outcome_written_during_an_outage_lands_once_the_database_is_back(db_url, engine, st, app):  # type: ignore[no-untyped-def]
    gate = asyncio.Event()

    @app.task(kind="k")
    async def handler(ctx: JobContext, i: int) -> Any:
        if i == 1:
            await gate.wait()
            return RetryAfter(600)
        return None

    first = handler.defer(engine, i=1)

    async def main(proxy: OutageProxy) -> Any:
        url = proxy.url(db_url)
        aengine = create_async_engine(url, pool_size=8)
        sync_engine = create_engine(url, pool_size=4)
        w = AsyncWorker(app, aengine, settings(), sync_engine=sync_engine)
        try:
            await w.start()
            await eventually(lambda: state_of(st, engine, first) == JobState.RUNNING)
            proxy.cut()
            gate.set()  # the handler returns while the database is away: the write is retried
            await asyncio.sleep(2.0)
            assert state_of(st, engine, first) == JobState.RUNNING
            second = await asyncio.to_thread(handler.defer, engine, i=2)  # its NOTIFY is lost
            proxy.restore()
            await eventually(lambda: state_of(st, engine, first) == JobState.RETRYABLE, timeout=15,
                             what="the outcome written")
            await eventually(lambda: state_of(st, engine, second) == JobState.COMPLETED, timeout=15,
                             what="the job enqueued during the outage run")
            return await w.stop(5)
        finally:
            await aengine.dispose()
            sync_engine.dispose()

    with OutageProxy() as proxy:
        stats = run(main(proxy))
    assert (stats.retry_after, stats.completed, stats.outcome_errors, stats.handed_back) == (1, 1, 0, 0)
