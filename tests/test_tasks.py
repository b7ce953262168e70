"""Tasks: registration, direct calls, and deferring jobs (one round trip on an Engine, one
statement in a caller's transaction that commits or rolls back with it, on both faces)."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone

import pytest
from jobtools import BACKLOG
from sqlalchemy import Engine, create_engine, event, text
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from sqlalchemy.orm import Session
from test_enqueue import DEFERRED_COLS, READY_COLS
from test_enqueue import rows as enqueue_rows
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


# -- what a deferral reuses from one job to the next ---------------------------------------------
# A deferral without a delay sends its jobs as DeferredJobs: the storage keeps the values its
# kind and options give and checks only the args of the next job (qstore.storage.enqueue).


def deferrals_of_every_shape(app):  # type: ignore[no-untyped-def]
    """Deferrals whose kept values are reused (plain, every reusable option set) and some whose
    are not (metadata, a unique key), each with two calls' keyword arguments."""

    @app.task(kind="plain", queue="q")
    def plain(ctx: JobContext, n: int, s: str = "x") -> None: ...

    @app.task(kind="keyed", queue="q", unique=UniqueOpts())
    def keyed(ctx: JobContext, n: int) -> None: ...

    later = datetime.now(timezone.utc) + timedelta(hours=1)
    return [
        (plain.deferral, [{"n": 1}, {"s": "ünï", "n": 2}]),
        (plain.configure(queue="other", priority=4, max_attempts=3, tags=["t1", "t2"], ordering_key=b"k"),
         [{"n": 3}, {"n": 4, "s": "y"}]),
        (plain.configure(run_at=later, tags=("w",)), [{"n": 5}, {"n": 6}]),
        (plain.configure(metadata={"m": 1}), [{"n": 7}, {"n": 8}]),
        (keyed.deferral, [{"n": 9}, {"n": 10}]),
    ]


@pytest.mark.parametrize("stripes", [1, 3])
def test_deferred_jobs_are_the_rows_storage_enqueue_writes_for_their_params(engine, make_storage, stripes):  # type: ignore[no-untyped-def]
    # each deferral defers twice (the second job reuses the first one's kept values); the
    # other install gets the same jobs as plain InsertParams through the full checks
    by_defer, by_enqueue = make_storage(queue_stripe_count=stripes), make_storage(queue_stripe_count=stripes)
    for deferral, calls in deferrals_of_every_shape(App(by_defer)):
        for kwargs in calls:
            deferral.defer(engine, **kwargs)
            by_enqueue.enqueue(engine, deferral.params(**kwargs))

    for table, cols in (("ready_entries", READY_COLS), (BACKLOG, DEFERRED_COLS)):
        written = [enqueue_rows(engine, st, table, cols) for st in (by_defer, by_enqueue)]
        assert written[0] == written[1] and written[0]
    with engine.connect() as c:
        keys = [c.execute(text(f'SELECT unique_key, job_id FROM "{st.schema()}".job_unique_claims ORDER BY 2')).all()
                for st in (by_defer, by_enqueue)]
    assert len(keys[0]) == 2 and keys[0] == keys[1]


@pytest.mark.parametrize("queue", ["mail", "mail#1"])
def test_deferred_jobs_go_round_robin_over_the_stripes(engine, make_storage, queue):  # type: ignore[no-untyped-def]
    # a deferral reuses its values from the second job on: the stripe is still picked per job
    st = make_storage(queue_stripe_count=3)
    app = App(st)

    @app.task(kind="send", queue=queue)
    def send(ctx: JobContext, to: str) -> None: ...

    for i in range(6):
        send.defer(engine, to=str(i))
    per_stripe = Counter(q for (q,) in enqueue_rows(engine, st, "ready_entries", ("queue",)))
    assert per_stripe == ({"mail#0": 2, "mail#1": 2, "mail#2": 2} if queue == "mail" else {"mail#1": 6})


def test_a_deferral_keeps_no_values_for_options_it_cannot_trust_to_stay_the_same(app, send):  # type: ignore[no-untyped-def]
    from qstore.storage.enqueue import _reusable

    reused = [send.deferral, send.configure(tags=["t"], ordering_key=b"k", run_at=datetime.now(timezone.utc))]
    assert all(_reusable(d.opts) for d in reused)
    not_reused = [send.configure(metadata={"m": 1}), send.configure(unique=UniqueOpts()),
                  send.configure(ordering_key=bytearray(b"k"))]  # type: ignore[arg-type]
    assert not any(_reusable(d.opts) for d in not_reused)


def test_metadata_changed_in_place_after_a_defer_is_checked_and_written(engine, st, send):  # type: ignore[no-untyped-def]
    deferral = send.configure()
    deferral.defer(engine, to="a")  # its values are kept now
    deferral.opts.metadata["tenant"] = 7
    assert st.load_job(engine, deferral.defer(engine, to="b")).metadata == {"tenant": 7}
    deferral.opts.metadata["bad"] = float("nan")
    with pytest.raises(ValidationError) as info:
        deferral.defer(engine, to="c")
    assert info.value.field == "job.metadata.bad"
    assert st.queue_counts(engine, "mail").available == 2


@pytest.mark.parametrize(("options", "field"), [({"max_attempts": 0}, "job.max_attempts"),
                                                 ({"tags": ["ok", "a\x00"]}, "job.tags[1]"),
                                                 ({"ordering_key": "text"}, "job.ordering_key"),
                                                 ({"unique": UniqueOpts(states=256)}, "job.unique.states")])
def test_a_bad_option_is_refused_at_every_defer_naming_the_option(engine, st, send, options, field):  # type: ignore[no-untyped-def]
    deferral = send.configure(**options)
    for _ in range(2):
        with pytest.raises(ValidationError) as info:
            deferral.defer(engine, to="a")
        assert info.value.field == field
    assert st.queue_counts(engine, "mail").available == 0


@pytest.mark.parametrize("bad", [float("nan"), {"x": "a\x00"}, ["ok", 10**5000], {1: "key"}, {"k\ud800": 1}],
                         ids=["nan", "nul", "huge", "int-key", "surrogate-key"])
def test_bad_args_after_a_defer_are_refused_as_storage_enqueue_refuses_them(engine, st, send, bad):  # type: ignore[no-untyped-def]
    send.defer(engine, to="a")  # its values are kept now
    errors = []
    for call in (lambda: send.defer(engine, to=bad), lambda: st.enqueue(engine, send.params(to=bad))):
        with pytest.raises(ValidationError) as info:
            call()
        errors.append((info.value.field, info.value.reason))
    assert errors[0] == errors[1] and errors[0][0].startswith("job.args.to")
    assert st.queue_counts(engine, "mail").available == 1


SIGNATURES = {
    "plain": (lambda ctx, a, b=2: None, [{"a": 1}, {"b": 3, "a": 1}, {}, {"a": 1, "c": 3}, {"b": 1}]),
    "keyword-only": (lambda ctx, a, *, k, j=0: None, [{"k": 1, "a": 2}, {"a": 2}, {"j": 1, "k": 2, "a": 3}]),
    "var-keyword": (lambda ctx, a, **rest: None, [{"a": 1, "z": 2}, {"z": 1, "a": 2}, {"z": 3}]),
}


@pytest.mark.parametrize("name", list(SIGNATURES))
def test_keyword_arguments_bind_as_signature_bind_binds_them(app, name):  # type: ignore[no-untyped-def]
    import inspect

    fn, calls = SIGNATURES[name]
    task = app.task(kind=name)(fn)
    for kwargs in calls:
        try:
            bound = inspect.signature(fn).bind(None, **kwargs).arguments
            expected: object = {k: v for k, v in bound.items() if k != "ctx"}
            if name == "var-keyword":
                expected = {k: v for k, v in bound.items() if k not in ("ctx", "rest")} | bound.get("rest", {})
        except TypeError as err:
            expected = ValidationError(f"{name}.args", kwargs, str(err))
        try:
            got: object = task.deferral.args_of(**kwargs)
        except ValidationError as err:
            got = err
        if isinstance(expected, ValidationError):
            assert isinstance(got, ValidationError) and (got.field, got.reason) == (expected.field, expected.reason)
        else:
            assert got == expected and list(got) == list(expected), kwargs  # type: ignore[call-overload]


def test_defer_on_an_engine_with_a_cursor_listener_goes_through_it(engine, st, send):  # type: ignore[no-untyped-def]
    seen: list[str] = []

    def record(conn, cursor, statement, *rest) -> None:  # type: ignore[no-untyped-def]
        seen.append(statement)

    send.defer(engine, to="a")  # its values are kept now
    event.listen(engine, "before_cursor_execute", record)
    try:
        ids = [send.defer(engine, to="b"), send.defer(engine, to="c")]
    finally:
        event.remove(engine, "before_cursor_execute", record)
    assert sum(".enqueue_job(" in s for s in seen) == 2
    assert [st.load_job(engine, i).args for i in ids] == [{"to": "b"}, {"to": "c"}]


@pytest.mark.parametrize("commit", [True, False], ids=["commit", "rollback"])
def test_a_defer_with_kept_values_in_a_session_commits_or_rolls_back_with_it(engine, st, send, commit):  # type: ignore[no-untyped-def]
    send.defer(engine, to="a")  # its values are kept now
    with Session(engine) as session:
        send.defer(session, to="b")
        session.commit() if commit else session.rollback()
    with engine.connect() as conn:
        conn.begin()
        send.defer(conn, to="c")
        conn.commit() if commit else conn.rollback()
    assert st.queue_counts(engine, "mail").available == (3 if commit else 1)
