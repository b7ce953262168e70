"""A worker's cycle is one round trip: the claim that follows finished handlers takes their
completions along (``complete_and_claim``), in the thread worker and the asyncio worker, on
both receipt modes; completions a claim took but could not send go back to the batcher."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from sqlalchemy import Engine, create_engine, event
from sqlalchemy.ext.asyncio import create_async_engine

from qstore import InsertOpts, InsertParams
from qstore.runtime.batcher import CompletionBatcher
from qstore.tasks import App, JobContext
from qstore.types import JobState
from qstore.worker import AsyncWorker, Worker, WorkerSettings

JOBS = 12


def eventually(check: Callable[[], Any], timeout: float = 10.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while not (value := check()):
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {timeout}s (last: {value!r})")
        time.sleep(0.01)
    return value


class Statements:
    """The statements a worker's engine sends, each with how many completions waited in its
    batcher (queued: not lent to a claim) when it was sent."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, int]] = []
        self.queued: Callable[[], int] = lambda: 0
        self.lock = threading.Lock()

    def note(self, conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        with self.lock:
            self.seen.append((statement, self.queued()))

    def kinds(self) -> dict[str, int]:
        with self.lock:
            seen = list(self.seen)
        out = {"combined": 0, "claim": 0, "complete": 0}
        for s, _ in seen:
            claims, completes = "claim_ready" in s, "complete_receipts" in s
            if claims and completes:
                out["combined"] += 1
            elif claims:
                out["claim"] += 1
            elif completes:
                out["complete"] += 1
        return out

    def claims_with_completions_waiting(self) -> list[int]:
        """How many completions waited at each claim sent without them."""
        with self.lock:
            return [q for s, q in self.seen if "claim_ready" in s and "complete_receipts" not in s and q]


@pytest.fixture
def traced(db_url: str) -> Iterator[tuple[Engine, Statements]]:
    eng = create_engine(db_url, pool_size=2, max_overflow=0)
    seen = Statements()
    event.listen(eng, "before_cursor_execute", seen.note)
    yield eng, seen
    eng.dispose()


def one_at_a_time(**given: Any) -> WorkerSettings:
    """One handler, no prefetch, and a batcher that never sends by itself within a test:
    the claim after each job is the only way its completion can go out."""
    return WorkerSettings(concurrency=1, prefetch=0, completion_interval=60.0, listen=False,
                          poll_interval=0.05, maintain=False, **given)


def enqueue(engine: Engine, app: App, n: int) -> list[int]:
    return app.storage.enqueue_many(engine, [InsertParams("quick", {"n": i}, InsertOpts()) for i in range(n)])


@pytest.mark.parametrize("receipts", [True, False], ids=["receipts", "no-receipts"])
def test_each_claim_after_a_finished_job_takes_its_completion_along(make_storage, traced, receipts):
    engine, seen = traced
    app = App(make_storage(lease_claim_receipts=receipts))

    @app.task(kind="quick")
    def quick(ctx: JobContext, n: int) -> None: ...

    ids = enqueue(engine, app, JOBS)
    w = Worker(app, engine, one_at_a_time())
    seen.queued = lambda: w.batcher.queued
    w.start()
    try:
        eventually(lambda: w.stats.completed == JOBS, what=f"{JOBS} completed")
        stats = w.stats
    finally:
        w.stop(5)
    assert seen.claims_with_completions_waiting() == []
    # every completion went out with a claim: the batcher itself sent nothing
    assert stats.claims_with_completions == stats.completion_calls == JOBS
    assert all(app.storage.load_job(engine, i).state is JobState.COMPLETED for i in ids)
    if receipts:  # one statement a cycle: no completion statement of its own
        assert seen.kinds()["complete"] == 0 and seen.kinds()["combined"] == JOBS


def test_a_cycle_of_a_busy_worker_completes_and_claims_in_one_statement(st, traced):
    engine, seen = traced
    app = App(st)

    @app.task(kind="quick")
    def quick(ctx: JobContext, n: int) -> None: ...

    enqueue(engine, app, 200)
    w = Worker(app, engine, WorkerSettings(concurrency=4, listen=False, poll_interval=0.05, maintain=False,
                                           completion_interval=60.0))
    w.start()
    try:
        eventually(lambda: w.stats.completed == 200, what="200 completed")
        stats = w.stats
    finally:
        w.stop(5)
    kinds = seen.kinds()
    assert kinds["complete"] == 0 and kinds["combined"] == stats.claims_with_completions > 0
    assert stats.claimed == 200 and stats.stale_completions == 0


def test_the_async_worker_takes_completions_along_with_its_claims(db_url, make_storage, engine):
    app = App(make_storage())

    @app.task(kind="quick")
    async def quick(ctx: JobContext, n: int) -> None: ...

    ids = enqueue(engine, app, JOBS)
    seen = Statements()

    async def main() -> Any:
        aengine = create_async_engine(db_url)
        event.listen(aengine.sync_engine, "before_cursor_execute", seen.note)
        try:
            async with AsyncWorker(app, aengine, one_at_a_time(), sync_engine=engine) as w:
                seen.queued = lambda: w.batcher.queued
                deadline = time.monotonic() + 10
                while w.stats.completed < JOBS and time.monotonic() < deadline:
                    await asyncio.sleep(0.01)
                return w.stats
        finally:
            await aengine.dispose()

    stats = asyncio.run(main())
    assert seen.claims_with_completions_waiting() == []
    assert stats.completed == stats.claims_with_completions == stats.completion_calls == JOBS
    assert seen.kinds()["complete"] == 0
    assert all(app.storage.load_job(engine, i).state is JobState.COMPLETED for i in ids)


# -- completions a claim took ----------------------------------------------------------------------


def test_completions_a_claim_could_not_send_are_sent_by_the_batcher(engine, st):
    st.enqueue_many(engine, [InsertParams("k", {}, InsertOpts()) for _ in range(3)])
    claimed = st.claim_runtime_batch(engine, "default", 3)
    batcher = CompletionBatcher(st, engine, interval=60.0)
    batcher.start()
    try:
        for c in claimed:
            batcher.submit(c)
        lent = batcher.lend()
        assert len(lent) == 3 and batcher.queued == 0 and batcher.pending == 3
        batcher.return_lent(lent)  # the claim failed: nothing of it committed
        assert batcher.flush(5)
    finally:
        batcher.stop()
    assert (batcher.stats.completed, batcher.stats.with_claims) == (3, 0)
    assert st.queue_counts(engine, "default").terminal == 3


def test_completions_a_claim_sent_are_counted_once_with_the_stale_ones(engine, st):
    st.enqueue_many(engine, [InsertParams("k", {}, InsertOpts()) for _ in range(2)])
    a, b = st.claim_runtime_batch(engine, "default", 2)
    st.fail_retryable(engine, b.job.id, b.job.run_lease, "closed elsewhere first")
    batcher = CompletionBatcher(st, engine, interval=60.0)
    batcher.submit(a)
    batcher.submit(b)
    lent = batcher.lend()
    got = st.complete_and_claim(engine, [c.claimed for c in lent], "default", 1)
    batcher.settle_lent(lent, got.completed)
    s = batcher.stats
    assert (s.completed, s.stale, s.calls, s.with_claims, batcher.pending) == (1, 1, 1, 1, 0)
    batcher.stop()


def test_completions_with_follow_up_jobs_are_not_lent_to_a_claim(engine, st):
    st.enqueue_many(engine, [InsertParams("k", {}, InsertOpts()) for _ in range(2)])
    a, b = st.claim_runtime_batch(engine, "default", 2)
    batcher = CompletionBatcher(st, engine, interval=60.0)
    batcher.submit(a, [InsertParams("follow", {}, InsertOpts(queue="later"))])
    batcher.submit(b)
    assert [c.claimed for c in batcher.lend()] == [b] and batcher.queued == 1
    batcher.stop()
