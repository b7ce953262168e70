"""The worker in this process (``start`` / ``stop``): every outcome lands the job in the
right state, async handlers, cancel delivery, deadlines, heartbeats, follow-up jobs joined
to the completion, the completion batcher, and shutdown giving attempts back."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from sqlalchemy import create_engine, event, text

from qstore import InsertOpts, InsertParams, UniqueOpts, status
from qstore.errors import CallbackWaitEndedError, PartialCommitError, ValidationError
from qstore.runtime.batcher import CompletionBatcher
from qstore.runtime.core import HAND_BACK_FIRST, unhandled
from qstore.runtime.maintainer import MaintenanceSchedule
from qstore.status import UNHANDLED_KEY
from qstore.tasks import App, Cancel, Fail, JobContext, RetryAfter, Snooze, WaitForCallback
from qstore.types import JobState
from qstore.worker import Worker, WorkerSettings


def eventually(check: Callable[[], Any], timeout: float = 5.0, what: str = "condition") -> Any:
    """Poll ``check`` until it returns something truthy (returned), or fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {timeout}s (last: {value!r})")
        time.sleep(0.01)


@pytest.fixture
def app(st) -> App:  # type: ignore[no-untyped-def]
    return App(st)


@pytest.fixture
def run_worker(engine, st) -> Iterator[Callable[..., Worker]]:  # type: ignore[no-untyped-def]
    """``run_worker(app, **settings)`` → a started worker (no maintainer unless asked),
    stopped at teardown."""
    workers: list[Worker] = []

    def start(app: App, **settings: Any) -> Worker:
        settings.setdefault("maintain", False)
        settings.setdefault("concurrency", 4)
        settings.setdefault("poll_interval", 0.2)
        w = Worker(app, engine, WorkerSettings(**settings))
        w.start()
        workers.append(w)
        return w

    yield start
    for w in workers:
        w.stop(0)


def state_of(engine, st, job_id: int) -> JobState | None:  # type: ignore[no-untyped-def]
    row = st.load_job(engine, job_id)
    return row.state if row is not None else None


def settles_in(engine, st, job_id: int, state: JobState, timeout: float = 5.0):  # type: ignore[no-untyped-def]
    """Wait until the job is in ``state``; returns its row."""
    try:
        eventually(lambda: state_of(engine, st, job_id) == state, timeout, f"job {job_id} {state.value}")
    except AssertionError as err:
        raise AssertionError(f"{err}; the job: {st.load_job(engine, job_id)}") from None
    return st.load_job(engine, job_id)


# -- outcomes ----------------------------------------------------------------------------------


def test_a_handler_that_returns_completes_its_job(engine, st, app, run_worker):  # type: ignore[no-untyped-def]
    got: list[Any] = []

    @app.task(kind="hello")
    def hello(ctx: JobContext, name: str) -> str:
        got.append((ctx.job_id, ctx.attempt, name))
        return "ignored"

    job_id = hello.defer(engine, name="ada")
    w = run_worker(app)
    settles_in(engine, st, job_id, JobState.COMPLETED)
    assert got == [(job_id, 1, "ada")]
    eventually(lambda: w.stats.completed == 1)


def test_a_handler_that_raises_leaves_its_job_retryable_with_the_error(engine, st, app, run_worker):  # type: ignore[no-untyped-def]
    @app.task(kind="boom")
    def boom(ctx: JobContext) -> None:
        raise ValueError("smtp down")

    job_id = boom.defer(engine)
    w = run_worker(app)
    row = settles_in(engine, st, job_id, JobState.RETRYABLE)
    assert row.errors[-1]["error"].startswith("ValueError: smtp down (at ")
    assert row.errors[-1]["attempt"] == 1 and not row.errors[-1].get("terminal")
    eventually(lambda: w.stats.retried == 1)


def test_an_error_on_the_last_attempt_fails_the_job_for_good(engine, st, app, run_worker):  # type: ignore[no-untyped-def]
    @app.task(kind="boom", max_attempts=1)
    def boom(ctx: JobContext) -> None:
        raise RuntimeError("no luck")

    job_id = boom.defer(engine)
    w = run_worker(app)
    row = settles_in(engine, st, job_id, JobState.FAILED)
    assert row.errors[-1]["terminal"] is True
    eventually(lambda: w.stats.failed == 1)


@pytest.mark.parametrize("dlq_policy", [False, True], ids=["failed_history", "dlq_policy"])
def test_an_exhausted_job_counts_as_failed_and_exhausted_wherever_the_queue_puts_it(  # type: ignore[no-untyped-def]
        engine, st, app, run_worker, dlq_policy):
    st.set_queue_options(engine, "default", dlq_enabled=dlq_policy)

    @app.task(kind="boom", max_attempts=1)
    def boom(ctx: JobContext) -> None:
        raise RuntimeError("no luck")

    job_id = boom.defer(engine)
    w = run_worker(app)
    settles_in(engine, st, job_id, JobState.FAILED)
    eventually(lambda: w.stats.failed == 1)
    assert (w.stats.exhausted, w.stats.dlq) == (1, 0)
    assert [e.job.id for e in st.list_dlq(engine)] == ([job_id] if dlq_policy else [])


@pytest.mark.parametrize(("outcome", "counts"), [
    (lambda: Fail("bad input"), (1, 0, 0)),
    (lambda: Fail("poison", dlq=True), (0, 0, 1)),
], ids=["fail", "fail_dlq"])
def test_a_handlers_fail_counts_as_failed_or_dlq_never_as_exhausted(engine, st, app, run_worker,  # type: ignore[no-untyped-def]
                                                                      outcome, counts):
    @app.task(kind="k")
    def handler(ctx: JobContext) -> Any:
        return outcome()

    job_id = handler.defer(engine)
    w = run_worker(app)
    settles_in(engine, st, job_id, JobState.FAILED)
    eventually(lambda: (w.stats.failed, w.stats.exhausted, w.stats.dlq) == counts, what="counts")


@pytest.mark.parametrize("returned", [False, True], ids=["raised", "returned"])
@pytest.mark.parametrize(("outcome", "state", "counter"), [
    (lambda: Snooze(60), JobState.SCHEDULED, "snoozed"),
    (lambda: RetryAfter(60), JobState.RETRYABLE, "retry_after"),
    (lambda: Cancel("not needed"), JobState.CANCELLED, "cancelled"),
    (lambda: Fail("bad input"), JobState.FAILED, "failed"),
    (lambda: Fail("poison", dlq=True), JobState.FAILED, "dlq"),
], ids=["snooze", "retry_after", "cancel", "fail", "fail_dlq"])
def test_each_outcome_lands_the_job_in_its_state(engine, st, app, run_worker, outcome, state, counter,  # type: ignore[no-untyped-def]
                                                  returned):
    @app.task(kind="k")
    def handler(ctx: JobContext) -> Any:
        if returned:
            return outcome()
        raise outcome()

    job_id = handler.defer(engine)
    w = run_worker(app)
    settles_in(engine, st, job_id, state)
    eventually(lambda: getattr(w.stats, counter) == 1, what=counter)


def test_an_outcome_the_storage_refuses_ends_the_attempt_retryable_with_the_reason(engine, st, app, run_worker):  # type: ignore[no-untyped-def]
    # not given back: the same handler would run again at once, and again, without counting
    @app.task(kind="k")
    def handler(ctx: JobContext) -> None:
        ctx.set_progress({"ratio": float("nan")})
        raise ValueError("failed, with progress JSON cannot hold")

    job_id = handler.defer(engine)
    w = run_worker(app, heartbeat_interval=10)
    row = settles_in(engine, st, job_id, JobState.RETRYABLE)
    assert row.errors[-1]["error"].startswith("the outcome fail_retryable was refused: invalid progress"), row.errors
    assert row.attempt == 1
    eventually(lambda: (w.stats.outcome_errors, w.stats.retried) == (1, 1), what="counted")


def test_snooze_gives_the_attempt_back(engine, st, app, run_worker):  # type: ignore[no-untyped-def]
    @app.task(kind="k")
    def handler(ctx: JobContext) -> Snooze:
        return Snooze(30)

    job_id = handler.defer(engine)
    run_worker(app)
    row = settles_in(engine, st, job_id, JobState.SCHEDULED)
    assert row.attempt == 0


def test_fail_with_dlq_puts_the_job_in_the_dead_letter_queue(engine, st, app, run_worker):  # type: ignore[no-untyped-def]
    @app.task(kind="k")
    def handler(ctx: JobContext) -> None:
        raise Fail("cannot parse", dlq=True, dlq_reason="poison message")

    job_id = handler.defer(engine)
    run_worker(app)
    settles_in(engine, st, job_id, JobState.FAILED)
    with engine.connect() as conn:
        reason = conn.execute(text(f'SELECT dlq_reason FROM "{st.schema()}".dlq_entries WHERE job_id = :j'),
                              {"j": job_id}).scalar_one()
    assert reason == "poison message"


def test_wait_for_callback_parks_the_job_until_the_callback_completes_it(engine, st, app, run_worker):  # type: ignore[no-untyped-def]
    tokens: list[Any] = []

    @app.task(kind="k")
    def handler(ctx: JobContext) -> WaitForCallback:
        token = ctx.register_callback(timeout=600)
        tokens.append(token)
        return WaitForCallback(token)

    job_id = handler.defer(engine)
    w = run_worker(app)
    settles_in(engine, st, job_id, JobState.WAITING_EXTERNAL)
    assert w.stats.waiting_callback == 1
    st.complete_external(engine, tokens[0], {"paid": True})
    assert state_of(engine, st, job_id) == JobState.COMPLETED


def test_wait_for_callback_without_an_id_registers_one(engine, st, app, run_worker):  # type: ignore[no-untyped-def]
    @app.task(kind="k")
    def handler(ctx: JobContext) -> WaitForCallback:
        return WaitForCallback(timeout=600)

    job_id = handler.defer(engine)
    run_worker(app)
    row = settles_in(engine, st, job_id, JobState.WAITING_EXTERNAL)
    assert row.callback_id is not None
    st.fail_external(engine, row.callback_id, "declined")
    assert state_of(engine, st, job_id) == JobState.FAILED


class CallbackWaiter:
    """A task (kind ``k``) whose handler registers a callback (timeout 600 s), notes its id in
    ``tokens``, waits for it, and returns the payload; a :class:`CallbackWaitEndedError` is
    noted in ``ended`` (and raised again when ``reraise``)."""

    def __init__(self, app: App, poll_interval: float, *, reraise: bool = False, **task_opts: Any) -> None:
        self.tokens: list[Any] = []
        self.ended: list[CallbackWaitEndedError] = []

        @app.task(kind="k", **task_opts)
        def handler(ctx: JobContext) -> Any:
            token = ctx.register_callback(timeout=600)
            self.tokens.append(token)
            try:
                return ctx.wait_for_callback(token, poll_interval=poll_interval)
            except CallbackWaitEndedError as err:
                self.ended.append(err)
                if reraise:
                    raise
                return None

        self.task = handler


def test_a_handler_waiting_for_its_callback_goes_on_with_the_resumed_payload(engine, st, app, run_worker):  # type: ignore[no-untyped-def]
    waiter = CallbackWaiter(app, 0.02)
    job_id = waiter.task.defer(engine)
    run_worker(app)
    settles_in(engine, st, job_id, JobState.WAITING_EXTERNAL)
    resumed = st.complete_external(engine, waiter.tokens[0], {"amount": 5}, resume=True)
    assert resumed.state == JobState.RUNNING
    row = settles_in(engine, st, job_id, JobState.COMPLETED)
    assert row.run_lease == resumed.run_lease  # the same attempt went on, not a retry


def test_an_async_handler_waiting_for_its_callback_goes_on_with_the_resumed_payload(engine, st, app, run_worker):  # type: ignore[no-untyped-def]
    tokens: list[Any] = []
    ran: list[Any] = []

    @app.task(kind="k")
    async def handler(ctx: JobContext) -> None:
        token = await asyncio.to_thread(ctx.register_callback, 600)
        tokens.append(token)
        ran.append(await ctx.wait_for_callback_async(token, poll_interval=0.02))

    job_id = handler.defer(engine)
    run_worker(app)
    settles_in(engine, st, job_id, JobState.WAITING_EXTERNAL)
    st.complete_external(engine, tokens[0], [1, 2], resume=True)
    settles_in(engine, st, job_id, JobState.COMPLETED)
    assert ran == [[1, 2]]


def test_a_bad_poll_interval_is_refused_before_the_attempt_starts_waiting(engine, st, app, run_worker):  # type: ignore[no-untyped-def]
    refused: list[str] = []

    @app.task(kind="k")
    def handler(ctx: JobContext) -> None:
        token = ctx.register_callback(timeout=600)
        try:
            ctx.wait_for_callback(token, poll_interval=0)
        except ValidationError as err:
            refused.append(str(err))

    job_id = handler.defer(engine)
    run_worker(app)
    settles_in(engine, st, job_id, JobState.COMPLETED)  # never parked as waiting_external
    assert refused and "poll_interval" in refused[0]


def test_a_wait_for_a_callback_failed_from_outside_ends_with_a_typed_error(engine, st, app, run_worker):  # type: ignore[no-untyped-def]
    waiter = CallbackWaiter(app, 0.02, reraise=True)
    job_id = waiter.task.defer(engine)
    run_worker(app)
    settles_in(engine, st, job_id, JobState.WAITING_EXTERNAL)
    st.fail_external(engine, waiter.tokens[0], "declined")
    eventually(lambda: waiter.ended, what="the waiting handler to stop")
    assert str(waiter.tokens[0]) in str(waiter.ended[0]) and waiter.ended[0].outcome != "cancelled"
    time.sleep(0.2)  # the handler's error is written as a retry of a closed attempt: refused
    assert state_of(engine, st, job_id) == JobState.FAILED


def test_a_wait_for_a_callback_ends_when_the_worker_closes_the_attempt(engine, st, app, run_worker):  # type: ignore[no-untyped-def]
    waiter = CallbackWaiter(app, 30)
    job_id = waiter.task.defer(engine)
    run_worker(app)
    settles_in(engine, st, job_id, JobState.WAITING_EXTERNAL)
    assert st.cancel_job(engine, job_id) is not None
    eventually(lambda: waiter.ended, what="the waiting handler to see the cancel")
    assert waiter.ended[0].outcome == "cancelled"
    assert state_of(engine, st, job_id) == JobState.CANCELLED


def test_a_tasks_deadline_does_not_count_the_wait_for_its_callback(engine, st, app, run_worker):  # type: ignore[no-untyped-def]
    waiter = CallbackWaiter(app, 0.02, deadline=0.3)
    job_id = waiter.task.defer(engine)
    w = run_worker(app, heartbeat_interval=0.2)
    settles_in(engine, st, job_id, JobState.WAITING_EXTERNAL)
    time.sleep(0.8)  # well past the deadline, all of it waiting
    st.complete_external(engine, waiter.tokens[0], "ok", resume=True)
    settles_in(engine, st, job_id, JobState.COMPLETED)
    assert w.stats.deadline_exceeded == 0


def test_a_stopping_worker_ends_the_wait_and_leaves_the_attempt_waiting_for_its_callback(engine, st, app, run_worker):  # type: ignore[no-untyped-def]
    waiter = CallbackWaiter(app, 5)
    job_id = waiter.task.defer(engine)
    w = run_worker(app)
    settles_in(engine, st, job_id, JobState.WAITING_EXTERNAL)
    w.stop(0.2)
    assert [e.outcome for e in waiter.ended] == ["cancelled"]
    # nobody holds the wait now: the callback still decides the job
    assert state_of(engine, st, job_id) == JobState.WAITING_EXTERNAL
    st.complete_external(engine, waiter.tokens[0], "done")
    assert state_of(engine, st, job_id) == JobState.COMPLETED


def test_a_resume_after_the_waiting_worker_stopped_is_rescued_and_runs_the_handler_afresh(  # type: ignore[no-untyped-def]
        engine, st, app, run_worker):
    waiter = CallbackWaiter(app, 0.02)
    job_id = waiter.task.defer(engine)
    w = run_worker(app)
    settles_in(engine, st, job_id, JobState.WAITING_EXTERNAL)
    w.stop(0.2)
    resumed = st.complete_external(engine, waiter.tokens[0], {"amount": 5}, resume=True)
    assert resumed.state == JobState.RUNNING  # running, with no handler behind it
    time.sleep(0.3)
    assert [r.id for r in st.rescue_stale_heartbeats(engine, 0.2)] == [job_id]
    row = st.load_job(engine, job_id)
    assert (row.state, row.attempt) == (JobState.RETRYABLE, 1)
    eventually(lambda: st.promote_due(engine, "retryable", 10) == 1, timeout=10, what="the backoff over")
    run_worker(app)
    eventually(lambda: len(waiter.tokens) == 2, what="the handler to run again")
    assert waiter.tokens[1] != waiter.tokens[0]  # from the start: a new callback, the payload not handed over
    assert settles_in(engine, st, job_id, JobState.WAITING_EXTERNAL).attempt == 2


def test_a_job_of_an_unknown_kind_is_handed_back_without_counting_an_attempt(engine, st, app, run_worker):  # type: ignore[no-untyped-def]
    @app.task(kind="known")
    def known(ctx: JobContext) -> None: ...

    job_id = st.enqueue(engine, InsertParams("mystery.kind", {}, InsertOpts(queue="default")))
    w = run_worker(app)
    row = settles_in(engine, st, job_id, JobState.SCHEDULED)
    assert (row.attempt, row.errors) == (0, None)
    mark = row.progress[UNHANDLED_KEY]
    assert (mark["count"], mark["run_lease"]) == (1, row.run_lease)
    assert 0.5 < (row.run_at - datetime.now(timezone.utc)).total_seconds() <= HAND_BACK_FIRST
    eventually(lambda: w.stats.unknown_kind == 1)
    assert w.stats.failed == 0


def test_a_hand_back_of_an_unknown_kind_keeps_the_progress_an_earlier_handler_left(engine, st, app, run_worker):  # type: ignore[no-untyped-def]
    st.enqueue(engine, InsertParams("mystery.kind", {}, InsertOpts(queue="default")))
    (c,) = st.claim_runtime_batch(engine, "default", 1)
    st.snooze(engine, c.job.id, c.job.run_lease, 0, {"step": 3})
    assert st.promote_due(engine, "scheduled", 10) == 1
    w = run_worker(app, queues=["default"])
    row = settles_in(engine, st, c.job.id, JobState.SCHEDULED)
    eventually(lambda: w.stats.unknown_kind == 1)
    row = st.load_job(engine, c.job.id)
    assert row.progress["step"] == 3 and row.progress[UNHANDLED_KEY]["count"] == 1


def test_each_further_hand_back_of_one_job_waits_twice_as_long(engine, st):  # type: ignore[no-untyped-def]
    st.enqueue(engine, InsertParams("mystery.kind", {}, InsertOpts(queue="default")))
    (c,) = st.claim_runtime_batch(engine, "default", 1)
    now = datetime.now(timezone.utc)
    delays, job = [], c.job
    for _ in range(9):
        back = unhandled(job, now)
        delays.append(back.seconds)
        job = replace(job, progress=back.progress, run_lease=job.run_lease + 1)
    assert delays == [1, 2, 4, 8, 16, 32, 60, 60, 60]
    assert job.progress[UNHANDLED_KEY]["count"] == 9


def test_an_unknown_kind_is_logged_once_however_many_of_its_jobs_come(engine, st, app, run_worker, caplog):  # type: ignore[no-untyped-def]
    for _ in range(3):
        st.enqueue(engine, InsertParams("mystery.kind", {}, InsertOpts(queue="default")))
    with caplog.at_level("WARNING", logger="qstore.worker"):
        w = run_worker(app, queues=["default"])
        eventually(lambda: w.stats.unknown_kind == 3)
    said = [r for r in caplog.records if "mystery.kind" in r.getMessage()]
    assert len(said) == 1 and "handing its jobs back" in said[0].getMessage()


def test_status_lists_the_jobs_handed_back_for_lack_of_a_task_by_kind(engine, st, app, run_worker):  # type: ignore[no-untyped-def]
    for kind in ("mystery.a", "mystery.a", "mystery.b"):
        st.enqueue(engine, InsertParams(kind, {}, InsertOpts(queue="default")))
    st.enqueue(engine, InsertParams("later", {}, InsertOpts(queue="default", run_at=datetime.now(timezone.utc)
                                                           + timedelta(hours=1))))
    w = run_worker(app, queues=["default"])
    eventually(lambda: w.stats.unknown_kind == 3)
    got = [(h.queue, h.kind, h.jobs, h.most) for h in status.handed_back_kinds(engine, st)]
    assert got == [("default", "mystery.a", 2, 1), ("default", "mystery.b", 1, 1)]


def test_status_does_not_list_a_job_whose_hand_back_record_is_from_an_earlier_attempt(engine, st, app, run_worker):  # type: ignore[no-untyped-def]
    job_id = st.enqueue(engine, InsertParams("mystery.kind", {}, InsertOpts(queue="default")))
    w = run_worker(app, queues=["default"])
    eventually(lambda: w.stats.unknown_kind == 1)
    w.stop(0)
    eventually(lambda: st.promote_due(engine, "scheduled", 10) == 1, timeout=5, what="due again")
    (c,) = st.claim_runtime_batch(engine, "default", 1)
    # a handler of the kind ran this attempt and snoozed, carrying the job's progress over
    st.snooze(engine, c.job.id, c.job.run_lease, 3600, c.job.progress)
    assert st.load_job(engine, job_id).progress[UNHANDLED_KEY]["count"] == 1
    assert status.handed_back_kinds(engine, st) == []


# -- async handlers ------------------------------------------------------------------------------


def test_async_handlers_run_on_the_event_loop_and_complete(engine, st, app, run_worker):  # type: ignore[no-untyped-def]
    loops: set[int] = set()

    @app.task(kind="a")
    async def handler(ctx: JobContext, n: int) -> None:
        await asyncio.sleep(0.01)
        loops.add(id(asyncio.get_running_loop()))

    ids = handler.defer_many(engine, [{"n": i} for i in range(5)])
    run_worker(app)
    for job_id in ids:
        settles_in(engine, st, job_id, JobState.COMPLETED)
    assert len(loops) == 1


def test_async_handlers_raise_and_return_outcomes_like_sync_ones(engine, st, app, run_worker):  # type: ignore[no-untyped-def]
    @app.task(kind="a")
    async def handler(ctx: JobContext, how: str) -> Any:
        if how == "raise":
            raise KeyError("missing")
        return Snooze(60)

    failing = handler.defer(engine, how="raise")
    snoozing = handler.defer(engine, how="snooze")
    run_worker(app)
    assert "KeyError" in settles_in(engine, st, failing, JobState.RETRYABLE).errors[-1]["error"]
    settles_in(engine, st, snoozing, JobState.SCHEDULED)


# -- cancel, deadline, heartbeats ----------------------------------------------------------------


def test_an_operator_cancel_reaches_a_running_sync_handler(engine, st, app, run_worker):  # type: ignore[no-untyped-def]
    started, saw_cancel = threading.Event(), threading.Event()

    @app.task(kind="long")
    def long(ctx: JobContext) -> None:
        started.set()
        if ctx.cancelled.wait(5):
            saw_cancel.set()

    job_id = long.defer(engine)
    w = run_worker(app)
    assert started.wait(5)
    st.cancel_job(engine, job_id)
    assert saw_cancel.wait(5)
    assert state_of(engine, st, job_id) == JobState.CANCELLED
    eventually(lambda: w.stats.closed_under_handler == 1)
    assert w.stats.completed == 0  # the handler's return after the cancel was dropped


def test_an_operator_cancel_cancels_a_running_async_handler(engine, st, app, run_worker):  # type: ignore[no-untyped-def]
    started, interrupted = threading.Event(), threading.Event()

    @app.task(kind="long")
    async def long(ctx: JobContext) -> None:
        started.set()
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            interrupted.set()
            raise

    job_id = long.defer(engine)
    w = run_worker(app)
    assert started.wait(5)
    st.cancel_job(engine, job_id)
    assert interrupted.wait(5)
    assert state_of(engine, st, job_id) == JobState.CANCELLED
    eventually(lambda: w.stats.closed_under_handler == 1)


def test_a_task_past_its_deadline_is_closed_retryable_and_sees_cancelled(engine, st, app, run_worker):  # type: ignore[no-untyped-def]
    saw_cancel = threading.Event()

    @app.task(kind="slow", deadline=0.3)
    def slow(ctx: JobContext) -> None:
        if ctx.cancelled.wait(5):
            saw_cancel.set()

    job_id = slow.defer(engine)
    w = run_worker(app, heartbeat_interval=0.2)
    row = settles_in(engine, st, job_id, JobState.RETRYABLE)
    assert "deadline of 0.3s exceeded" in row.errors[-1]["error"]
    assert saw_cancel.wait(5)
    eventually(lambda: w.stats.deadline_exceeded == 1)


def test_heartbeats_keep_a_long_attempt_from_being_rescued(engine, st, app, run_worker):  # type: ignore[no-untyped-def]
    release = threading.Event()

    @app.task(kind="long")
    def long(ctx: JobContext) -> None:
        ctx.set_progress({"step": 1})
        release.wait(5)

    job_id = long.defer(engine)
    w = run_worker(app, heartbeat_interval=0.2, schedule=MaintenanceSchedule(heartbeat_staleness=0.5))
    eventually(lambda: w.stats.heartbeats >= 4, what="heartbeats")  # ~0.8 s of running
    assert st.rescue_stale_heartbeats(engine, 0.5) == []
    assert st.load_job(engine, job_id).progress == {"step": 1}
    release.set()
    settles_in(engine, st, job_id, JobState.COMPLETED)


def test_an_attempt_without_heartbeats_would_be_rescued(engine, st, app, run_worker):  # type: ignore[no-untyped-def]
    """The twin of the test above: without the worker's heartbeats the same wait is stale."""
    release = threading.Event()

    @app.task(kind="long")
    def long(ctx: JobContext) -> None:
        release.wait(5)

    long.defer(engine)
    w = run_worker(app, heartbeat_interval=10)
    eventually(lambda: w.stats.in_flight == 1)
    time.sleep(0.8)
    assert len(st.rescue_stale_heartbeats(engine, 0.5)) == 1
    release.set()


def test_a_heartbeat_interval_too_close_to_the_staleness_is_refused():  # type: ignore[no-untyped-def]
    with pytest.raises(ValidationError, match="heartbeat_interval"):
        WorkerSettings(heartbeat_interval=60)


# -- follow-up jobs joined to the completion ------------------------------------------------------


def test_a_follow_up_deferred_through_ctx_commits_with_the_completion(engine, st, app, run_worker):  # type: ignore[no-untyped-def]
    @app.task(kind="next", queue="later")
    def after(ctx: JobContext, parent: int) -> None: ...

    @app.task(kind="first")
    def first(ctx: JobContext) -> None:
        ctx.defer(after, parent=ctx.job_id)

    job_id = first.defer(engine)
    w = run_worker(app, queues=["default"])
    settles_in(engine, st, job_id, JobState.COMPLETED)
    follow = st.claim_runtime_batch(engine, "later", 10)
    assert [(j.job.kind, j.job.args) for j in follow] == [("next", {"parent": job_id})]
    eventually(lambda: w.stats.followups == 1)


def test_a_follow_up_that_cannot_be_written_leaves_neither_it_nor_the_completion(engine, st, app, run_worker):  # type: ignore[no-untyped-def]
    @app.task(kind="next", queue="later", unique=UniqueOpts())
    def after(ctx: JobContext, key: str) -> None: ...

    @app.task(kind="first")
    def first(ctx: JobContext) -> None:
        ctx.defer(after, key="taken")

    after.defer(engine, key="taken")  # owns the unique key
    job_id = first.defer(engine)
    run_worker(app, queues=["default"])
    row = settles_in(engine, st, job_id, JobState.RETRYABLE)
    assert "follow-up jobs could not be enqueued" in row.errors[-1]["error"]
    assert st.queue_counts(engine, "later").available == 1  # only the key's owner


def test_a_stale_completion_writes_no_follow_up(engine, st):  # type: ignore[no-untyped-def]
    st.enqueue(engine, InsertParams("k", {}))
    claimed = st.claim_runtime_batch(engine, "default", 1)[0]
    st.fail_retryable(engine, claimed.job.id, claimed.job.run_lease, "closed elsewhere first")
    batcher = CompletionBatcher(st, engine)
    batcher.start()
    try:
        batcher.submit(claimed, [InsertParams("follow", {}, InsertOpts(queue="later"))])
        assert batcher.flush(5)
    finally:
        batcher.stop()
    assert (batcher.stats.stale, batcher.stats.completed, batcher.stats.followups) == (1, 0, 0)
    assert st.queue_counts(engine, "later").available == 0


# -- the completion batcher ----------------------------------------------------------------------


def test_many_completions_go_out_in_few_calls(engine, st, app, run_worker):  # type: ignore[no-untyped-def]
    @app.task(kind="quick")
    def quick(ctx: JobContext, n: int) -> None: ...

    quick.defer_many(engine, [{"n": i} for i in range(200)])
    w = run_worker(app, concurrency=8, completion_interval=0.02)
    eventually(lambda: w.stats.completed == 200, timeout=10)
    assert w.stats.completion_calls <= 200 / 4, w.stats
    assert st.queue_counts(engine, "default").terminal == 200


def test_a_busy_worker_claims_many_jobs_per_claim_call(engine, st, app, run_worker):  # type: ignore[no-untyped-def]
    @app.task(kind="quick")
    def quick(ctx: JobContext, n: int) -> None: ...

    quick.defer_many(engine, [{"n": i} for i in range(200)])
    w = run_worker(app, concurrency=8)
    eventually(lambda: w.stats.completed == 200, timeout=10)
    stats = w.stats
    assert stats.claim_calls - stats.empty_claims <= 200 / 4, stats  # 8 per claim when all is well


def test_a_batch_flushes_at_its_size_without_waiting_for_the_interval(engine, st):  # type: ignore[no-untyped-def]
    st.enqueue_many(engine, [InsertParams("k", {"n": i}) for i in range(6)])
    claimed = st.claim_runtime_batch(engine, "default", 6)
    batcher = CompletionBatcher(st, engine, max_batch=3, interval=60)
    batcher.start()
    try:
        for c in claimed:
            batcher.submit(c)
        eventually(lambda: batcher.stats.completed == 6, timeout=3)
    finally:
        batcher.stop()
    assert (batcher.stats.calls, batcher.stats.largest_batch) == (2, 3)


def test_a_stale_completion_is_counted_not_raised(engine, st):  # type: ignore[no-untyped-def]
    st.enqueue_many(engine, [InsertParams("k", {"n": i}) for i in range(3)])
    claimed = st.claim_runtime_batch(engine, "default", 3)
    st.cancel_job(engine, claimed[0].job.id)  # closed by an operator before the completion
    batcher = CompletionBatcher(st, engine)
    batcher.start()
    try:
        for c in claimed:
            batcher.submit(c)
        assert batcher.flush(5)
    finally:
        batcher.stop()
    assert (batcher.stats.completed, batcher.stats.stale, batcher.stats.calls) == (2, 1, 1)


class PartialOnce:
    """Storage whose first ``complete_runtime_batch`` commits the first half of the batch
    for real and then fails as a two-transaction completion does when its second part fails."""

    def __init__(self, storage: Any) -> None:
        self._storage = storage
        self.calls: list[int] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._storage, name)

    def complete_runtime_batch(self, engine: Any, claimed: list[Any]) -> Any:
        self.calls.append(len(claimed))
        if len(self.calls) > 1:
            return self._storage.complete_runtime_batch(engine, claimed)
        half = claimed[: len(claimed) // 2]
        done = self._storage.complete_runtime_batch(engine, half)
        rest = [(c.job.id, c.job.run_lease) for c in claimed[len(half):]]
        raise PartialCommitError(RuntimeError("second transaction failed"), done, rest)


def test_a_partial_commit_keeps_what_committed_and_sends_only_the_rest(engine, st):  # type: ignore[no-untyped-def]
    st.enqueue_many(engine, [InsertParams("k", {"n": i}) for i in range(4)])
    claimed = st.claim_runtime_batch(engine, "default", 4)
    storage = PartialOnce(st)
    batcher = CompletionBatcher(storage, engine)  # type: ignore[arg-type]
    batcher.start()
    try:
        for c in claimed:
            batcher.submit(c)
        assert batcher.flush(5)
    finally:
        batcher.stop()
    assert storage.calls == [4, 2]
    assert (batcher.stats.completed, batcher.stats.stale) == (4, 0)
    assert st.queue_counts(engine, "default").terminal == 4


# -- wake-ups --------------------------------------------------------------------------------------


def test_a_notification_wakes_an_idle_worker_long_before_its_poll_interval(engine, st, app, run_worker):  # type: ignore[no-untyped-def]
    @app.task(kind="k")
    def handler(ctx: JobContext) -> None: ...

    w = run_worker(app, poll_interval=30)
    eventually(lambda: w.stats.empty_claims >= 1)  # idle, waiting
    started = time.monotonic()
    job_id = handler.defer(engine)
    settles_in(engine, st, job_id, JobState.COMPLETED, timeout=5)
    assert time.monotonic() - started < 2


def test_a_trickle_of_jobs_costs_one_claim_per_job_not_two(engine, st, app, run_worker):  # type: ignore[no-untyped-def]
    # After a claim that came back partly filled the dispatcher waits for the next
    # notification (or 50 ms) instead of claiming again at once into an empty queue.
    @app.task(kind="k")
    def handler(ctx: JobContext) -> None: ...

    w = run_worker(app, poll_interval=30)
    eventually(lambda: w.stats.empty_claims >= 1)  # idle, waiting
    before = w.stats.claim_calls
    n = 20
    for _ in range(n):
        handler.defer(engine)
        time.sleep(0.01)
    eventually(lambda: w.stats.completed == n, timeout=10)
    # one claim per job (fewer when jobs arrive during a claim), plus the odd recheck
    assert w.stats.claim_calls - before <= n + 3, w.stats


def test_without_listen_the_worker_polls(engine, st, app, run_worker):  # type: ignore[no-untyped-def]
    @app.task(kind="k")
    def handler(ctx: JobContext) -> None: ...

    w = run_worker(app, listen=False, poll_interval=0.1)
    eventually(lambda: w.stats.empty_claims >= 1)
    job_id = handler.defer(engine)
    settles_in(engine, st, job_id, JobState.COMPLETED, timeout=5)


# -- shutdown ----------------------------------------------------------------------------------------


def test_stop_waits_for_running_handlers_to_finish(engine, st, app, run_worker):  # type: ignore[no-untyped-def]
    started = threading.Event()

    @app.task(kind="k")
    def handler(ctx: JobContext) -> None:
        started.set()
        time.sleep(0.3)

    job_id = handler.defer(engine)
    w = run_worker(app)
    assert started.wait(5)
    stats = w.stop(timeout=5)
    assert (stats.completed, stats.handed_back, stats.in_flight) == (1, 0, 0)
    assert state_of(engine, st, job_id) == JobState.COMPLETED


def test_stop_gives_back_attempts_still_running_at_the_timeout(engine, st, app, run_worker):  # type: ignore[no-untyped-def]
    started, release = threading.Event(), threading.Event()

    @app.task(kind="k")
    def handler(ctx: JobContext) -> None:
        started.set()
        release.wait(5)

    job_id = handler.defer(engine)
    w = run_worker(app)
    assert started.wait(5)
    try:
        stats = w.stop(timeout=0.1)
    finally:
        release.set()
    assert stats.handed_back == 1
    row = st.load_job(engine, job_id)
    assert (row.state, row.attempt) == (JobState.SCHEDULED, 0)  # due at once; the attempt did not count
    assert st.queue_counts(engine, "default").running == 0


def test_claimed_jobs_no_handler_started_are_given_back_at_stop(engine, st, app, run_worker):  # type: ignore[no-untyped-def]
    release = threading.Event()
    ran: list[int] = []

    @app.task(kind="k")
    def handler(ctx: JobContext, n: int) -> None:
        ran.append(n)
        release.wait(5)

    handler.defer_many(engine, [{"n": i} for i in range(3)])
    w = run_worker(app, concurrency=1, prefetch=2)
    eventually(lambda: w.stats.claimed == 3)
    try:
        stats = w.stop(timeout=0.1)
    finally:
        release.set()
    assert len(ran) == 1 and stats.handed_back == 3
    assert st.queue_counts(engine, "default").running == 0


def test_given_back_jobs_run_again_on_the_next_worker(engine, st, app, run_worker):  # type: ignore[no-untyped-def]
    first_run = threading.Event()
    runs: list[int] = []

    @app.task(kind="k")
    def handler(ctx: JobContext) -> None:
        runs.append(ctx.attempt)
        if len(runs) == 1:
            first_run.set()
            ctx.cancelled.wait(5)  # a cooperative handler: returns once its attempt is given back

    job_id = handler.defer(engine)
    w = run_worker(app)
    assert first_run.wait(5)
    assert w.stop(timeout=0.1).handed_back == 1
    fast = MaintenanceSchedule(promote_every=0.05, queue_ring_every=0.5, lease_ring_every=0.5,
                               claim_ring_every=0.5)
    run_worker(app, maintain=True, schedule=fast)
    settles_in(engine, st, job_id, JobState.COMPLETED)
    assert runs == [1, 1]  # the given-back attempt did not count


def test_a_second_stop_request_gives_running_attempts_back_without_waiting(engine, st, app):  # type: ignore[no-untyped-def]
    started, release = threading.Event(), threading.Event()

    @app.task(kind="k")
    def handler(ctx: JobContext) -> None:
        started.set()
        release.wait(10)  # ignores ctx.cancelled

    job_id = handler.defer(engine)
    w = Worker(app, engine, WorkerSettings(maintain=False, concurrency=2, poll_interval=0.2,
                                           shutdown_timeout=30))
    result: list[Any] = []
    runner = threading.Thread(target=lambda: result.append(w.run()))
    runner.start()
    try:
        assert started.wait(5)
        w.request_stop()
        time.sleep(0.3)
        assert runner.is_alive()  # waiting for the running handler (up to 30 s)
        hurried = time.monotonic()
        w.request_stop(hurry=True)
        runner.join(10)
        assert not runner.is_alive() and time.monotonic() - hurried < 5
    finally:
        release.set()
        runner.join(10)
    assert result[0].handed_back == 1
    assert state_of(engine, st, job_id) == JobState.SCHEDULED


def test_an_idle_worker_stops_at_once_even_while_its_maintainer_reclaims_history(engine, make_storage):  # type: ignore[no-untyped-def]
    st = make_storage()
    app = App(st)

    @app.task(kind="noop")
    def noop(ctx: JobContext, n: int) -> None: ...

    for _ in range(st.queue_slot_count() - 2):  # sealed slots of finished jobs: a long first tick
        st.enqueue_params_copy(engine, [InsertParams("noop", {"n": i}) for i in range(200)])
        while jobs := st.claim_runtime_batch(engine, "default", 500):
            st.complete_runtime_batch(engine, jobs)
        st.rotate(engine)
    pruning = threading.Event()
    eng = create_engine(engine.url, pool_size=20, max_overflow=8)

    @event.listens_for(eng, "before_cursor_execute")
    def spot(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if statement.startswith("TRUNCATE"):
            pruning.set()

    w = Worker(app, eng, WorkerSettings(concurrency=16))  # listen on, maintainer on
    try:
        w.start()
        assert pruning.wait(10), "the maintainer never pruned"
        began = time.monotonic()
        w.stop()
        took = time.monotonic() - began
    finally:
        w.stop(0)
        eng.dispose()
    assert took < 0.3, f"stop took {took:.3f} s"


def test_a_worker_stops_at_once_after_draining_its_queue(engine, st):  # type: ignore[no-untyped-def]
    app = App(st)

    @app.task(kind="noop")
    def noop(ctx: JobContext, n: int) -> None: ...

    st.enqueue_params_copy(engine, [InsertParams("noop", {"n": i}) for i in range(400)])
    w = Worker(app, engine, WorkerSettings(concurrency=16))
    try:
        w.start()
        eventually(lambda: w.stats.completed == 400, timeout=30, what="drained")
        began = time.monotonic()
        w.stop()
        took = time.monotonic() - began
    finally:
        w.stop(0)
    assert took < 0.3, f"stop took {took:.3f} s"


def test_ctx_heartbeat_reports_an_attempt_closed_under_the_handler(engine, st, app, run_worker):  # type: ignore[no-untyped-def]
    beats: list[bool] = []
    started, go = threading.Event(), threading.Event()

    @app.task(kind="k")
    def handler(ctx: JobContext) -> None:
        beats.append(ctx.heartbeat({"done": 1}))
        started.set()
        go.wait(5)
        beats.append(ctx.heartbeat())

    job_id = handler.defer(engine)
    run_worker(app, listen=False)  # the handler is not told: it learns from its heartbeat
    assert started.wait(5)
    st.cancel_job(engine, job_id)
    go.set()
    eventually(lambda: len(beats) == 2)
    assert beats == [True, False]
