"""Tasks: registration, direct calls, and deferring jobs (one round trip on an Engine, one
statement in a caller's transaction that commits or rolls back with it, on both faces)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone

import pytest
from sqlalchemy import Engine, create_engine
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from sqlalchemy.orm import Session
from test_round_trips import pooled_pgconn, wire

from qstore import UniqueOpts
from qstore.errors import ValidationError
from qstore.tasks import App, Cancel, Fail, JobContext, RetryAfter, Snooze, Task, WaitForCallback
from qstore.types import JobState


@pytest.fixture
def one_connection(db_url: str) -> Iterator[Engine]:
    eng = create_engine(db_url, pool_size=1, max_overflow=0)
    yield eng
    eng.dispose()


@pytest.fixture
def app(st):  # type: ignore[no-untyped-def]
    return App(st)


@pytest.fixture
def send(app):  # type: ignore[no-untyped-def]
    @app.task(kind="send_email", queue="mail", priority=1, max_attempts=5)
    def send_email(ctx: JobContext, to: str, subject: str = "hi") -> str:
        return f"{to}:{subject}"

    return send_email


def only_job(storage, engine, queue="mail"):  # type: ignore[no-untyped-def]
    jobs = storage.claim_runtime_batch(engine, queue, 10)
    assert len(jobs) == 1, jobs
    return jobs[0].job


# -- registration ------------------------------------------------------------------------------


def test_a_task_registers_under_its_kind_with_its_insert_options(app, send):  # type: ignore[no-untyped-def]
    assert isinstance(send, Task)
    assert app.get("send_email") is send
    assert (send.queue, send.opts.priority, send.opts.max_attempts) == ("mail", 1, 5)
    assert app.queues == ["mail"]


def test_the_kind_defaults_to_the_functions_module_and_qualname(app):  # type: ignore[no-untyped-def]
    @app.task
    def resize(ctx: JobContext, image: int) -> None: ...

    assert resize.kind == f"{__name__}.test_the_kind_defaults_to_the_functions_module_and_qualname.<locals>.resize"
    assert resize.queue == "default"


def test_a_second_task_of_one_kind_is_refused(app, send):  # type: ignore[no-untyped-def]
    with pytest.raises(ValidationError, match="send_email"):
        app.task(kind="send_email")(lambda ctx: None)


def test_a_function_without_a_context_argument_is_refused(app):  # type: ignore[no-untyped-def]
    def no_ctx(*, to: str) -> None: ...

    with pytest.raises(ValidationError, match="JobContext"):
        app.task(no_ctx)


def test_a_task_stays_callable_directly(st, send):  # type: ignore[no-untyped-def]
    ctx = JobContext.__new__(JobContext)
    assert send(ctx, to="x", subject="s") == "x:s"


def test_async_functions_are_async_tasks(app):  # type: ignore[no-untyped-def]
    @app.task(kind="a")
    async def a(ctx: JobContext) -> None: ...

    assert a.is_async


@pytest.mark.parametrize("bad", [{"queue": ""}, {"priority": 9}, {"max_attempts": 0},
                                 {"deadline": -1}, {"unique": "yes"}])
def test_bad_task_options_are_refused_naming_the_option(app, bad):  # type: ignore[no-untyped-def]
    with pytest.raises(ValidationError, match=next(iter(bad))):
        app.task(kind="k", **bad)


@pytest.mark.parametrize("make", [lambda: Snooze(-1), lambda: RetryAfter(float("nan")),
                                  lambda: WaitForCallback("not-a-uuid"), lambda: WaitForCallback(timeout=0),
                                  lambda: Cancel(3), lambda: Fail(None)])  # type: ignore[arg-type]
def test_bad_outcome_values_are_refused(make):  # type: ignore[no-untyped-def]
    with pytest.raises(ValidationError):
        make()


# -- defer -------------------------------------------------------------------------------------------


def test_defer_writes_a_job_with_the_keyword_arguments_as_its_args(engine, st, send):  # type: ignore[no-untyped-def]
    job_id = send.defer(engine, to="a@example.com")
    job = only_job(st, engine)
    assert (job.id, job.kind, job.args, job.priority, job.max_attempts) == (
        job_id, "send_email", {"to": "a@example.com"}, 1, 5)


def test_defer_binds_positional_arguments_to_their_names(engine, st, send):  # type: ignore[no-untyped-def]
    send.defer(engine, "b@example.com", "report")
    assert only_job(st, engine).args == {"to": "b@example.com", "subject": "report"}


@pytest.mark.parametrize("kwargs", [{}, {"to": "x", "cc": "y"}])
def test_defer_with_missing_or_unknown_arguments_is_refused_and_writes_nothing(engine, st, send, kwargs):  # type: ignore[no-untyped-def]
    with pytest.raises(ValidationError, match=r"send_email\.args"):
        send.defer(engine, **kwargs)
    assert st.queue_counts(engine, "mail").available == 0


def test_defer_of_a_value_json_cannot_hold_is_refused(engine, st, send):  # type: ignore[no-untyped-def]
    with pytest.raises(ValidationError):
        send.defer(engine, to=float("inf"))
    assert st.queue_counts(engine, "mail").available == 0


def test_defer_on_an_engine_is_one_round_trip(one_connection, st, send):  # type: ignore[no-untyped-def]
    send.defer(one_connection, to="warm-up")
    with wire(pooled_pgconn(one_connection)) as sent:
        send.defer(one_connection, to="a")
    assert sent.round_trips == 1 and "Query" not in sent.sent  # no BEGIN, no COMMIT


def test_defer_in_a_callers_connection_is_one_statement_there(one_connection, st, send):  # type: ignore[no-untyped-def]
    with one_connection.connect() as conn:
        conn.begin()
        st.load_job(conn, 1)  # the caller's transaction is under way
        with wire(conn.connection.driver_connection.pgconn) as sent:
            send.defer(conn, to="a")
        conn.commit()
    assert sent.round_trips == 1


@pytest.mark.parametrize("commit", [True, False], ids=["commit", "rollback"])
def test_defer_in_a_callers_connection_commits_or_rolls_back_with_it(engine, st, send, commit):  # type: ignore[no-untyped-def]
    with engine.connect() as conn:
        conn.begin()
        send.defer(conn, to="a")
        conn.commit() if commit else conn.rollback()
    assert st.queue_counts(engine, "mail").available == (1 if commit else 0)


@pytest.mark.parametrize("commit", [True, False], ids=["commit", "rollback"])
def test_defer_in_a_session_commits_or_rolls_back_with_it(engine, st, send, commit):  # type: ignore[no-untyped-def]
    with Session(engine) as session:
        send.defer(session, to="a")
        session.commit() if commit else session.rollback()
    assert st.queue_counts(engine, "mail").available == (1 if commit else 0)


@pytest.mark.parametrize("commit", [True, False], ids=["commit", "rollback"])
def test_defer_async_commits_or_rolls_back_with_the_callers_async_transaction(db_url, engine, st, send, commit):  # type: ignore[no-untyped-def]
    async def main() -> int:
        aengine = create_async_engine(db_url)
        try:
            async with aengine.connect() as conn:
                await conn.begin()
                job_id = await send.defer_async(conn, to="a")
                await (conn.commit() if commit else conn.rollback())
            async with AsyncSession(aengine) as session:
                await send.defer_async(session, to="b")
                await (session.commit() if commit else session.rollback())
            return job_id
        finally:
            await aengine.dispose()

    asyncio.run(main())
    assert st.queue_counts(engine, "mail").available == (2 if commit else 0)


def test_defer_async_on_an_async_engine_commits_by_itself(db_url, engine, st, send):  # type: ignore[no-untyped-def]
    async def main() -> list[int]:
        aengine = create_async_engine(db_url)
        try:
            one = await send.defer_async(aengine, to="a")
            more = await send.defer_many_async(aengine, [{"to": "b"}, {"to": "c"}])
            return [one, *more]
        finally:
            await aengine.dispose()

    ids = asyncio.run(main())
    assert len(set(ids)) == 3
    assert st.queue_counts(engine, "mail").available == 3


def test_defer_many_writes_one_job_per_mapping_in_order(engine, st, send):  # type: ignore[no-untyped-def]
    ids = send.defer_many(engine, [{"to": "a"}, {"to": "b", "subject": "s"}])
    jobs = sorted(st.claim_runtime_batch(engine, "mail", 10), key=lambda j: j.job.id)
    assert [j.job.id for j in jobs] == sorted(ids)
    assert [j.job.args for j in jobs] == [{"to": "a"}, {"to": "b", "subject": "s"}]


def test_defer_many_refuses_a_bad_item_and_writes_nothing(engine, st, send):  # type: ignore[no-untyped-def]
    with pytest.raises(ValidationError, match=r"items\[1\]"):
        send.defer_many(engine, [{"to": "a"}, "to=b"])
    with pytest.raises(ValidationError, match=r"send_email\.args"):
        send.defer_many(engine, [{"to": "a"}, {"too": "b"}])
    assert st.queue_counts(engine, "mail").available == 0


# -- configure --------------------------------------------------------------------------------------


def test_configure_overrides_queue_and_priority_of_the_deferred_jobs(engine, st, send):  # type: ignore[no-untyped-def]
    send.configure(queue="bulk", priority=4).defer(engine, to="a")
    job = only_job(st, engine, "bulk")
    assert (job.queue, job.priority) == ("bulk", 4)
    assert send.queue == "mail"  # the task itself keeps its options


def test_configure_delay_schedules_the_job(engine, st, send):  # type: ignore[no-untyped-def]
    job_id = send.configure(delay=timedelta(minutes=5)).defer(engine, to="a")
    job = st.load_job(engine, job_id)
    assert job.state == JobState.SCHEDULED
    assert job.run_at > datetime.now(timezone.utc) + timedelta(minutes=4)


def test_configure_run_at_schedules_the_job_at_that_time(engine, st, send):  # type: ignore[no-untyped-def]
    at = datetime.now(timezone.utc) + timedelta(hours=1)
    job_id = send.configure(run_at=at).defer(engine, to="a")
    job = st.load_job(engine, job_id)
    assert job.state == JobState.SCHEDULED and abs((job.run_at - at).total_seconds()) < 1


def test_configure_refuses_delay_and_run_at_together(send):  # type: ignore[no-untyped-def]
    with pytest.raises(ValidationError, match="delay"):
        send.configure(delay=1, run_at=datetime.now(timezone.utc))


def test_a_unique_task_defers_one_job_per_key(engine, st, app):  # type: ignore[no-untyped-def]
    from qstore.errors import UniqueConflictError

    @app.task(kind="report", unique=UniqueOpts())
    def report(ctx: JobContext, day: str) -> None: ...

    report.defer(engine, day="2026-01-01")
    with pytest.raises(UniqueConflictError):
        report.defer(engine, day="2026-01-01")
    report.defer(engine, day="2026-01-02")
    assert st.queue_counts(engine, "default").available == 2
