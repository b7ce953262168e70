"""The worker through database outages (a TCP proxy cut under it, tests/outage.py): outcome
writes land once the database is back, or the attempt is given back; and an outage reads
as a few log lines."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from outage import OutageProxy
from sqlalchemy import Engine, create_engine
from test_worker import eventually, settles_in, state_of

from qstore.maintainer import MaintenanceSchedule
from qstore.model import JobState
from qstore.tasks import App, Cancel, Fail, JobContext, RetryAfter, Snooze, WaitForCallback
from qstore.worker import Worker, WorkerSettings

#: Longer than the 0.1 + 0.5 + 2 s an outcome write used to be retried for.
OUTAGE = 4.0
#: Loggers of the runtime (the storage's own logger, ``qstore.storage``, is not the runtime's).
RUNTIME_LOGGERS = ("qstore.worker", "qstore.maintainer", "qstore.listen", "sqlalchemy")


def runtime_records(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name.startswith(RUNTIME_LOGGERS)]


def logged(records: list[logging.LogRecord]) -> str:
    """The records as the default formatter prints them, tracebacks included."""
    formatter = logging.Formatter("%(levelname)s %(name)s: %(message)s")
    return "\n".join(formatter.format(r) for r in records)


@pytest.fixture
def proxy() -> Iterator[OutageProxy]:
    with OutageProxy() as p:
        yield p


@pytest.fixture
def proxied(db_url: str, proxy: OutageProxy) -> Iterator[Engine]:
    """An engine on the session database through the proxy."""
    eng = create_engine(proxy.url(db_url), pool_size=12, max_overflow=8)
    yield eng
    eng.dispose()


@pytest.fixture
def workers() -> Iterator[Callable[..., Worker]]:
    """``start(app, engine, **settings)`` → a started worker (no maintainer unless asked),
    stopped at teardown (hurried: a test may leave it facing a cut)."""
    started: list[Worker] = []

    def start(app: App, engine: Engine, **settings: Any) -> Worker:
        settings.setdefault("maintain", False)
        settings.setdefault("concurrency", 4)
        settings.setdefault("poll_interval", 0.2)
        w = Worker(app, engine, WorkerSettings(**settings))
        w.start()
        started.append(w)
        return w

    yield start
    for w in started:
        w.request_stop(hurry=True)
        w.stop(0)


# -- outcome writes through an outage -------------------------------------------------------------


def test_every_outcome_lands_after_an_outage_longer_than_a_few_retries(engine, proxied, proxy, st, workers):  # type: ignore[no-untyped-def]
    app = App(st)
    release = threading.Event()
    outcomes: dict[str, Callable[[], Any]] = {
        "raise": lambda: ValueError("smtp down"),
        "snooze": lambda: Snooze(60),
        "retry_after": lambda: RetryAfter(60),
        "cancel": lambda: Cancel("not needed"),
        "fail": lambda: Fail("bad input"),
        "dlq": lambda: Fail("poison", dlq=True),
        "callback": lambda: WaitForCallback(timeout=600),
    }
    started = threading.Semaphore(0)

    @app.task(kind="k")
    def handler(ctx: JobContext, how: str) -> Any:
        started.release()
        release.wait(30)
        result = outcomes[how]()
        if isinstance(result, Exception):
            raise result
        return result

    @app.task(kind="late", deadline=1.0)
    def late(ctx: JobContext) -> None:
        started.release()
        ctx.cancelled.wait(30)

    ids = {how: handler.defer(engine, how=how) for how in outcomes}
    ids["deadline"] = late.defer(engine)
    w = workers(app, proxied, concurrency=len(ids), heartbeat_interval=0.4)
    for _ in ids:
        assert started.acquire(timeout=10)
    proxy.cut()  # every handler is running; the deadline passes during the outage
    release.set()
    time.sleep(OUTAGE)
    assert all(state_of(engine, st, i) == JobState.RUNNING for i in ids.values())
    proxy.restore()
    expected = {"raise": JobState.RETRYABLE, "snooze": JobState.SCHEDULED, "retry_after": JobState.RETRYABLE,
                "cancel": JobState.CANCELLED, "fail": JobState.FAILED, "dlq": JobState.FAILED,
                "callback": JobState.WAITING_EXTERNAL, "deadline": JobState.RETRYABLE}
    for how, job_id in ids.items():
        settles_in(engine, st, job_id, expected[how], timeout=15)
    assert "deadline of 1s exceeded" in st.load_job(engine, ids["deadline"]).errors[-1]["error"]
    stats = w.stats
    assert (stats.outcome_errors, stats.handed_back, stats.deadline_exceeded) == (0, 0, 1), stats
    assert (stats.retried, stats.snoozed, stats.retry_after, stats.cancelled, stats.failed, stats.dlq,
            stats.waiting_callback) == (2, 1, 1, 1, 1, 1, 1), stats


def test_an_outcome_write_that_cannot_land_within_the_lease_gives_the_attempt_back(  # type: ignore[no-untyped-def]
        engine, proxied, proxy, st, workers):
    app = App(st)
    started, release = threading.Event(), threading.Event()

    @app.task(kind="k")
    def handler(ctx: JobContext) -> None:
        started.set()
        release.wait(30)
        raise ValueError("fails; its outcome cannot be written")

    job_id = handler.defer(engine)
    # the attempt counts as abandoned 6 s after its claim; the write is tried for the first 4
    w = workers(app, proxied, heartbeat_interval=3.0, schedule=MaintenanceSchedule(heartbeat_staleness=6.0))
    assert started.wait(10)
    proxy.cut()
    release.set()
    eventually(lambda: w.stats.outcome_errors == 1, timeout=15, what="the write given up")
    proxy.restore()  # in time for the give-back, within the lease
    row = settles_in(engine, st, job_id, JobState.SCHEDULED, timeout=10)
    assert row.attempt == 0 and not row.errors  # given back: the attempt does not count
    eventually(lambda: w.stats.handed_back == 1, what="counted handed back")
    assert w.stats.retried == 0


# -- an outage in the log --------------------------------------------------------------------------


def test_an_outage_reads_as_a_few_lines_and_one_line_when_the_database_is_back(  # type: ignore[no-untyped-def]
        engine, proxied, proxy, st, workers, caplog):
    app = App(st)
    long_started, release = threading.Event(), threading.Event()

    @app.task(kind="long")
    def long(ctx: JobContext) -> None:  # heartbeated through the outage
        long_started.set()
        release.wait(30)

    @app.task(kind="quick")
    def quick(ctx: JobContext) -> None: ...

    long.defer(engine)
    fast = MaintenanceSchedule(promote_every=0.1, queue_ring_every=1.0, lease_ring_every=0.2,
                               claim_ring_every=0.5, leader_retry_every=0.3)
    w = workers(app, proxied, maintain=True, schedule=fast, heartbeat_interval=0.5, poll_interval=0.2,
                error_backoff=0.2)
    assert long_started.wait(10)
    eventually(lambda: w.maintainer is not None and w.maintainer.is_leader(), what="the maintainer leads")
    caplog.set_level(logging.INFO)
    caplog.clear()
    proxy.cut()
    time.sleep(OUTAGE)
    during = list(caplog.records)
    proxy.restore()
    eventually(lambda: any("back after" in r.getMessage() for r in caplog.records), timeout=15,
               what="the recovery line")
    job_id = quick.defer(engine)  # the worker works again
    settles_in(engine, st, job_id, JobState.COMPLETED, timeout=10)
    release.set()

    records = runtime_records(caplog)
    text_ = logged(records)
    assert "Traceback" not in text_, text_
    assert not [r for r in records if r.levelno >= logging.ERROR], text_
    warnings = [r for r in records if r.levelno == logging.WARNING]
    # what failed: claims, the listener, maintenance, heartbeats (and whatever else was in flight)
    assert 3 <= len(warnings) <= 10, text_
    assert all("\n" not in r.getMessage() for r in records), text_
    assert all("SQLSTATE" in r.getMessage() and "retrying in" in r.getMessage() for r in warnings), text_
    assert len(during) <= 12, "\n".join(r.getMessage() for r in during)
    back = [r for r in records if "back after" in r.getMessage()]
    assert len(back) == 1 and back[0].levelno == logging.INFO, text_
    seconds = float(back[0].getMessage().split("back after ")[1].split(" s")[0])
    assert OUTAGE - 0.5 <= seconds <= OUTAGE + 5, back[0].getMessage()
