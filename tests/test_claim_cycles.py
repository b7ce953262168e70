"""Several claim cycles of one queue in flight (``claims_in_flight``), in the thread worker
and the asyncio worker: each job runs once and each completion commits once, the cycles
share the worker's places, a stop with claims in flight leaves nothing running, an idle
queue's extra cycles make no claims, bounded claimers claim one cycle at a time; and the
core's bookkeeping of the cycles (:class:`ClaimCycles`, :class:`Capacity`)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy import Engine
from sqlalchemy.ext.asyncio import create_async_engine

from qstore import InsertOpts, InsertParams, QueueStorage
from qstore.errors import ValidationError
from qstore.runtime.core import Capacity, ClaimCycles
from qstore.tasks import App, JobContext
from qstore.types import JobState
from qstore.worker import AsyncWorker, Worker, WorkerSettings

#: The storage calls a dispatcher claims with.
CLAIMS = frozenset({"complete_and_claim", "claim_runtime_batch", "claim_runtime_batch_with_aging",
                    "claim_runtime_batch_with_aging_for_instance"})


def eventually(check: Callable[[], Any], timeout: float = 10.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while not (value := check()):
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {timeout}s (last: {value!r})")
        time.sleep(0.005)
    return value


class ClaimWatch:
    """Stands in for a worker's storage face: every call goes to the real storage; a claim
    waits ``delay`` seconds first (so the cycles' claims overlap) and is counted: how many
    were in flight at once, and which dispatcher sent it (thread or task name)."""

    def __init__(self, storage: Any, delay: float) -> None:
        self._storage = storage
        self.delay = delay
        self.lock = threading.Lock()
        self.in_flight = 0
        self.most = 0
        self.by: Counter[str] = Counter()

    def _enter(self, who: str) -> None:
        with self.lock:
            self.in_flight += 1
            self.most = max(self.most, self.in_flight)
            self.by[who] += 1

    def _leave(self) -> None:
        with self.lock:
            self.in_flight -= 1

    def _landed(self, result: Any) -> None:
        """A claim came back with ``result`` (a hook for subclasses)."""

    @property
    def calls(self) -> int:
        with self.lock:
            return sum(self.by.values())

    def __getattr__(self, name: str) -> Any:
        target = getattr(self._storage, name)
        if name not in CLAIMS:
            return target
        if asyncio.iscoroutinefunction(target):
            async def claim_async(*args: Any, **kwargs: Any) -> Any:
                task = asyncio.current_task()
                self._enter(task.get_name() if task is not None else "?")
                try:
                    await asyncio.sleep(self.delay)
                    result = await target(*args, **kwargs)
                finally:
                    self._leave()
                self._landed(result)
                return result

            return claim_async

        def claim(*args: Any, **kwargs: Any) -> Any:
            self._enter(threading.current_thread().name)
            try:
                time.sleep(self.delay)
                result = target(*args, **kwargs)
            finally:
                self._leave()
            self._landed(result)
            return result

        return claim


class Held:
    """What a handler records: how often each job ran, and the most attempts its worker
    held at once (claimed, not yet let go) and the most handlers running at once."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.runs: Counter[int] = Counter()
        self.running = 0
        self.most_running = 0
        self.most_held = 0
        self.worker: Any = None

    def enter(self, n: int) -> None:
        core = self.worker.core
        with core.lock:
            held = len(core.attempts)
        with self.lock:
            self.runs[n] += 1
            self.running += 1
            self.most_running = max(self.most_running, self.running)
            self.most_held = max(self.most_held, held)

    def leave(self) -> None:
        with self.lock:
            self.running -= 1


def enqueue(engine: Engine, storage: QueueStorage, n: int) -> list[int]:
    return storage.enqueue_many(engine, [InsertParams("job", {"n": i}, InsertOpts()) for i in range(n)])


def sync_app(storage: QueueStorage, held: Held, pause: float = 0.0) -> App:
    app = App(storage)

    @app.task(kind="job")
    def job(ctx: JobContext, n: int) -> None:
        held.enter(n)
        try:
            if pause:
                time.sleep(pause)
        finally:
            held.leave()

    return app


def async_app(storage: QueueStorage, held: Held, pause: float = 0.0) -> App:
    app = App(storage)

    @app.task(kind="job")
    async def job(ctx: JobContext, n: int) -> None:
        held.enter(n)
        try:
            if pause:
                await asyncio.sleep(pause)
        finally:
            held.leave()

    return app


def cycles_settings(n: int, **given: Any) -> WorkerSettings:
    given.setdefault("concurrency", 8)
    given.setdefault("claim_batch", 8)
    return WorkerSettings(claims_in_flight=n, listen=False, poll_interval=0.05, maintain=False, **given)


def started(app: App, engine: Engine, settings: WorkerSettings, delay: float) -> tuple[Worker, ClaimWatch]:
    w = Worker(app, engine, settings)
    watch = ClaimWatch(w.storage, delay)
    w.storage = watch  # type: ignore[assignment]
    return w, watch


# -- the core's bookkeeping ----------------------------------------------------------------------


def test_claims_in_flight_below_one_is_refused() -> None:
    with pytest.raises(ValidationError, match="claims_in_flight"):
        WorkerSettings(claims_in_flight=0)
    with pytest.raises(ValidationError, match="claims_in_flight"):
        WorkerSettings(claims_in_flight=1.5)  # type: ignore[arg-type]


def test_only_the_lead_cycle_claims_until_a_claim_comes_back_full() -> None:
    c = ClaimCycles(2)
    assert c.may_claim(0) and not c.may_claim(1)
    assert c.returned(8, 3) is False and not c.may_claim(1)  # short: the queue stays quiet
    assert c.returned(8, 8) is True and c.may_claim(1)  # full: the other cycles claim too
    assert c.returned(8, 8) is False and c.may_claim(1)  # already busy: nobody to wake
    assert c.returned(8, 0) is False and not c.may_claim(1)  # empty (or failed): quiet again


def test_a_claim_for_nothing_does_not_make_the_queue_busy() -> None:
    assert ClaimCycles(2).returned(0, 0) is False


def test_the_claim_floor_leaves_room_for_each_cycle_in_flight() -> None:
    assert Capacity(32).floor == Capacity(32, 2).floor == 16
    assert Capacity(32, 3).floor == 10
    assert Capacity(1, 3).floor == 1


@pytest.mark.parametrize(("cycles", "first", "second"), [(1, 32, 0), (2, 16, 16), (3, 11, 11)])
def test_one_cycles_claim_takes_at_most_its_share_of_the_places(cycles, first, second) -> None:  # type: ignore[no-untyped-def]
    places = Capacity(32, cycles)
    assert places.take(32, None, 0.0)[0] == first
    assert places.take(32, None, 0.0)[0] == second


def test_bounded_claimers_make_one_cycle_whatever_claims_in_flight_says(engine, st) -> None:  # type: ignore[no-untyped-def]
    w = Worker(App(st), engine, WorkerSettings(queues=["default"], claims_in_flight=3, max_claimers=2,
                                               maintain=False))
    assert w.core.cycles == 1 and w._places.floor == w._places.total // 2


# -- the thread worker ---------------------------------------------------------------------------


def ran_until_completed(w: Any, jobs: int) -> Any:
    """Start thread worker ``w``, wait until it completed ``jobs`` attempts, stop it (also
    when the wait fails); its stop's stats."""
    w.start()
    try:
        eventually(lambda: w.stats.completed >= jobs, what=f"{jobs} completed")
    finally:
        stats = w.stop(5)
    return stats


def test_a_default_worker_has_two_claims_of_a_busy_queue_in_flight(engine, st):  # type: ignore[no-untyped-def]
    assert WorkerSettings().claims_in_flight == 2
    jobs = 400
    held = Held()
    enqueue(engine, st, jobs)
    w, watch = started(sync_app(st, held), engine,
                       WorkerSettings(listen=False, poll_interval=0.05, maintain=False), delay=0.003)
    held.worker = w
    stats = ran_until_completed(w, jobs)
    assert watch.most == 2 and set(watch.by) == {"qstore-claim-default", "qstore-claim-default#1"}
    assert set(held.runs.values()) == {1} and len(held.runs) == jobs
    assert (stats.claimed, stats.completed, stats.stale_completions) == (jobs, jobs, 0)


def test_each_job_runs_once_and_each_completion_commits_once_with_cycles_in_flight(engine, st):  # type: ignore[no-untyped-def]
    drained_once_each(engine, st, 2)


def test_three_cycles_in_flight_run_each_job_once_and_commit_each_completion_once(engine, st):  # type: ignore[no-untyped-def]
    drained_once_each(engine, st, 3)


def drained_once_each(engine: Engine, st: QueueStorage, n: int) -> None:
    """A worker with ``n`` cycles drains a queue: its ``n`` claims were in flight together,
    each job ran once, each completion committed once (the storage's counts agree)."""
    jobs = 120
    held = Held()
    ids = enqueue(engine, st, jobs)
    w, watch = started(sync_app(st, held), engine, cycles_settings(n), delay=0.003)
    held.worker = w
    stats = ran_until_completed(w, jobs)
    assert watch.most == n  # the cycles' claims were in flight together
    assert sorted(held.runs) == list(range(jobs)) and set(held.runs.values()) == {1}
    assert (stats.claimed, stats.completed, stats.stale_completions) == (jobs, jobs, 0)
    assert w.batcher.stats.abandoned == 0 and stats.claim_calls == watch.calls
    counts = st.queue_counts(engine, "default")
    assert (counts.terminal, counts.available, counts.running) == (jobs, 0, 0)
    assert {st.load_job(engine, i).state for i in ids} == {JobState.COMPLETED}


def test_cycles_in_flight_never_hold_more_attempts_than_concurrency_plus_prefetch(engine, st):  # type: ignore[no-untyped-def]
    jobs = 100
    held = Held()
    enqueue(engine, st, jobs)
    settings = cycles_settings(3, concurrency=3, prefetch=2, claim_batch=4, claim_ahead=0)
    w, watch = started(sync_app(st, held, pause=0.002), engine, settings, delay=0.003)
    held.worker = w
    ran_until_completed(w, jobs)
    assert watch.most >= 2  # more than one cycle claimed at once
    assert 0 < held.most_held <= 3 + 2
    assert held.most_running <= 3
    assert set(held.runs.values()) == {1} and len(held.runs) == jobs


def test_a_stop_with_claims_in_flight_leaves_every_job_completed_or_given_back(engine, st):  # type: ignore[no-untyped-def]
    jobs = 200
    held = Held()
    ids = enqueue(engine, st, jobs)
    w, watch = started(sync_app(st, held, pause=0.01), engine, cycles_settings(2), delay=0.03)
    held.worker = w
    w.start()
    eventually(lambda: watch.in_flight == 2 and held.runs, what="two claims in flight while jobs run")
    stats = w.stop(0.0)
    assert watch.in_flight == 0 and stats.in_flight == 0
    counts = st.queue_counts(engine, "default")
    states = Counter(st.load_job(engine, i).state for i in ids)
    # never claimed (available), given back (snoozed for 0 s: scheduled, due at once), completed
    assert counts.running == 0 and set(states) <= {JobState.AVAILABLE, JobState.SCHEDULED, JobState.COMPLETED}
    assert states[JobState.COMPLETED] == counts.terminal == stats.completed > 0
    assert states[JobState.SCHEDULED] == stats.handed_back > 0
    assert stats.claimed == stats.completed + stats.handed_back
    assert w.batcher.stats.abandoned == 0 and w.batcher.pending == 0


def test_the_extra_cycles_of_an_idle_queue_make_no_claims(engine, st):  # type: ignore[no-untyped-def]
    held = Held()
    settings = WorkerSettings(claims_in_flight=3, concurrency=4, poll_interval=0.05, maintain=False)
    w, watch = started(sync_app(st, held), engine, settings, delay=0.0)
    held.worker = w
    w.start()
    try:
        for i in range(5):  # a trickle: one job at a time, each picked up before the next
            enqueue(engine, st, 1)
            eventually(lambda i=i: w.stats.completed >= i + 1, what=f"job {i} completed")
        time.sleep(0.2)  # a few polls of the idle queue
    finally:
        w.stop(5)
    assert set(watch.by) == {"qstore-claim-default"} and watch.by["qstore-claim-default"] >= 5


def test_a_busy_queue_brings_the_extra_cycles_in_and_a_quiet_one_sends_them_back(engine, st):  # type: ignore[no-untyped-def]
    held = Held()
    enqueue(engine, st, 200)
    w, watch = started(sync_app(st, held), engine, cycles_settings(2), delay=0.002)
    held.worker = w
    w.start()
    try:
        eventually(lambda: w.stats.completed >= 200, what="200 completed")
        time.sleep(0.1)
        before = dict(watch.by)
        time.sleep(0.3)  # the lead polls the empty queue; the other cycle waits
        after = dict(watch.by)
    finally:
        w.stop(5)
    assert before.get("qstore-claim-default#1", 0) > 0
    assert after.get("qstore-claim-default#1", 0) == before.get("qstore-claim-default#1", 0)
    assert after["qstore-claim-default"] > before["qstore-claim-default"]


def test_a_paused_queue_keeps_the_extra_cycles_waiting_until_it_resumes(engine, st):  # type: ignore[no-untyped-def]
    held = Held()
    st.set_queue_options(engine, "default", paused=True)
    enqueue(engine, st, 60)
    w, watch = started(sync_app(st, held), engine, cycles_settings(2), delay=0.0)
    held.worker = w
    w.start()
    try:
        eventually(lambda: watch.by["qstore-claim-default"] >= 3, what="the lead polled the paused queue")
        assert not held.runs and set(watch.by) == {"qstore-claim-default"}
        st.set_queue_options(engine, "default", paused=False)
        eventually(lambda: w.stats.completed >= 60, what="60 completed after the resume")
    finally:
        w.stop(5)
    assert set(held.runs.values()) == {1} and len(held.runs) == 60


def test_bounded_claimers_keep_one_claim_in_flight_per_queue(engine, st):  # type: ignore[no-untyped-def]
    jobs = 120
    held = Held()
    enqueue(engine, st, jobs)
    w, watch = started(sync_app(st, held), engine, cycles_settings(3, max_claimers=2), delay=0.003)
    held.worker = w
    w.start()
    try:
        eventually(lambda: w.stats.completed >= jobs, what=f"{jobs} completed")
    finally:
        w.stop(5)
    assert watch.most == 1 and set(watch.by) == {"qstore-claim-default"}
    assert set(held.runs.values()) == {1} and len(held.runs) == jobs


# -- the asyncio worker --------------------------------------------------------------------------


def run_async_worker(db_url: str, engine: Engine, app: App, settings: WorkerSettings, delay: float,
                     body: Callable[[AsyncWorker, ClaimWatch], Any], held: Held) -> Any:
    async def main() -> Any:
        aengine = create_async_engine(db_url)
        try:
            w = AsyncWorker(app, aengine, settings, sync_engine=engine)
            watch = ClaimWatch(w.storage, delay)
            w.storage = watch  # type: ignore[assignment]
            held.worker = w
            await w.start()
            try:
                return await body(w, watch)
            finally:
                if w.running:
                    await w.stop(5)
        finally:
            await aengine.dispose()

    return asyncio.run(main())


async def until(check: Callable[[], Any], timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {timeout}s")
        await asyncio.sleep(0.005)


def test_the_async_worker_runs_each_job_once_with_cycles_in_flight(db_url, engine, st):  # type: ignore[no-untyped-def]
    async_drained_once_each(db_url, engine, st, 2)


def test_the_async_worker_with_three_cycles_runs_each_job_once(db_url, engine, st):  # type: ignore[no-untyped-def]
    async_drained_once_each(db_url, engine, st, 3)


def async_drained_once_each(db_url: str, engine: Engine, st: QueueStorage, n: int) -> None:
    """:func:`drained_once_each` with the asyncio worker."""
    jobs = 120
    held = Held()
    ids = enqueue(engine, st, jobs)

    async def body(w: AsyncWorker, watch: ClaimWatch) -> Any:
        await until(lambda: w.stats.completed >= jobs, what=f"{jobs} completed")
        stats = await w.stop(5)
        return stats, watch.most, watch.calls, w.batcher.stats.abandoned

    stats, most, calls, abandoned = run_async_worker(db_url, engine, async_app(st, held),
                                                     cycles_settings(n), 0.003, body, held)
    assert most == n
    assert sorted(held.runs) == list(range(jobs)) and set(held.runs.values()) == {1}
    assert (stats.claimed, stats.completed, stats.stale_completions, abandoned) == (jobs, jobs, 0, 0)
    assert stats.claim_calls == calls
    counts = st.queue_counts(engine, "default")
    assert (counts.terminal, counts.available, counts.running) == (jobs, 0, 0)
    assert {st.load_job(engine, i).state for i in ids} == {JobState.COMPLETED}


def test_the_async_worker_with_cycles_in_flight_never_holds_more_than_its_places(db_url, engine, st):  # type: ignore[no-untyped-def]
    jobs = 100
    held = Held()
    enqueue(engine, st, jobs)

    async def body(w: AsyncWorker, watch: ClaimWatch) -> Any:
        await until(lambda: w.stats.completed >= jobs, what=f"{jobs} completed")
        return watch.most

    most = run_async_worker(db_url, engine, async_app(st, held, pause=0.002),
                            cycles_settings(3, concurrency=3, prefetch=2, claim_batch=4, claim_ahead=0), 0.003, body, held)
    assert most >= 2
    assert 0 < held.most_held <= 3 + 2 and held.most_running <= 3
    assert set(held.runs.values()) == {1} and len(held.runs) == jobs


def test_an_async_stop_with_claims_in_flight_leaves_every_job_completed_or_given_back(db_url, engine, st):  # type: ignore[no-untyped-def]
    jobs = 200
    held = Held()
    ids = enqueue(engine, st, jobs)

    async def body(w: AsyncWorker, watch: ClaimWatch) -> Any:
        await until(lambda: watch.in_flight == 2 and held.runs, what="two claims in flight while jobs run")
        stats = await w.stop(0.0)
        return stats, watch.in_flight, w.batcher.stats.abandoned, w.batcher.pending

    stats, in_flight, abandoned, pending = run_async_worker(
        db_url, engine, async_app(st, held, pause=0.01), cycles_settings(2), 0.03, body, held)
    assert in_flight == 0 and stats.in_flight == 0 and abandoned == pending == 0
    counts = st.queue_counts(engine, "default")
    states = Counter(st.load_job(engine, i).state for i in ids)
    # never claimed (available), given back (snoozed for 0 s: scheduled, due at once), completed
    assert counts.running == 0 and set(states) <= {JobState.AVAILABLE, JobState.SCHEDULED, JobState.COMPLETED}
    assert states[JobState.COMPLETED] == counts.terminal == stats.completed > 0
    assert states[JobState.SCHEDULED] == stats.handed_back > 0
    assert stats.claimed == stats.completed + stats.handed_back


def test_the_extra_cycles_of_an_idle_queue_make_no_claims_in_the_async_worker(db_url, engine, st):  # type: ignore[no-untyped-def]
    held = Held()
    settings = WorkerSettings(claims_in_flight=3, concurrency=4, poll_interval=0.05, maintain=False)

    async def body(w: AsyncWorker, watch: ClaimWatch) -> Any:
        for i in range(5):
            await asyncio.to_thread(enqueue, engine, st, 1)
            await until(lambda i=i: w.stats.completed >= i + 1, what=f"job {i} completed")
        await asyncio.sleep(0.2)
        return dict(watch.by)

    by = run_async_worker(db_url, engine, async_app(st, held), settings, 0.0, body, held)
    assert set(by) == {"qstore-claim-default"} and by["qstore-claim-default"] >= 5
