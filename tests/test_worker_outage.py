"""The worker through database outages (a TCP proxy cut under it, tests/outage.py): outcome
writes land once the database is back, or the attempt is given back; an outage reads as a
few log lines; and a schema that is missing or disappears stops the worker with one line."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from installs import unique_schema
from outage import OutageProxy
from sqlalchemy import Engine, create_engine, text
from test_worker import eventually, settles_in, state_of

from qstore import QueueStorage
from qstore.errors import SchemaNotInstalledError
from qstore.runtime.maintainer import MaintenanceSchedule
from qstore.tasks import App, Cancel, Fail, JobContext, RetryAfter, Snooze, WaitForCallback
from qstore.types import JobState
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


def test_an_attempt_stays_held_while_its_deadline_closure_is_pending(engine, proxied, proxy, st, workers):  # type: ignore[no-untyped-def]
    app = App(st)
    started, returned = threading.Event(), threading.Event()

    @app.task(kind="late", deadline=0.5)
    def late(ctx: JobContext) -> None:
        started.set()
        ctx.cancelled.wait(30)  # a cooperative handler: returns as soon as the deadline closes it
        returned.set()

    job_id = late.defer(engine)
    w = workers(app, proxied, heartbeat_interval=0.4)
    assert started.wait(10)
    proxy.cut()  # before the deadline: its closure cannot be written yet
    assert returned.wait(10)
    time.sleep(0.5)
    assert w.stats.in_flight == 1  # held (heartbeated, given back at a stop) until written
    proxy.restore()
    row = settles_in(engine, st, job_id, JobState.RETRYABLE, timeout=15)
    assert "deadline of 0.5s exceeded" in row.errors[-1]["error"]
    eventually(lambda: (w.stats.in_flight, w.stats.deadline_exceeded) == (0, 1), what="let go once written")


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


# -- a schema that is not (or no longer) installed -------------------------------------------------

APP = '''
import os
from qstore import QueueStorage, QueueStorageConfig
from qstore.tasks import App

app = App(QueueStorage(QueueStorageConfig(schema=os.environ["QSTORE_TEST_SCHEMA"])))


@app.task(kind="work")
def work(ctx) -> None: ...
'''


def run_cli_worker(tmp_path: Path, url: str, schema: str) -> subprocess.Popen[str]:
    (tmp_path / "outage_app.py").write_text(textwrap.dedent(APP))
    env = {**os.environ, "QSTORE_TEST_SCHEMA": schema,
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1]),
                                          os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen([sys.executable, "-m", "qstore", "worker", "outage_app:app", "--url", url,
                             "--poll-interval", "0.2"],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen[str], timeout: float) -> tuple[str, str]:
    """The process's output once it exited; killed (and the test failed) if it runs on."""
    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
        raise AssertionError(f"still running after {timeout} s; its stderr:\n{err[-3000:]}") from None


def test_the_worker_command_refuses_a_database_without_the_install_in_one_line(tmp_path, fresh_db_url):  # type: ignore[no-untyped-def]
    proc = run_cli_worker(tmp_path, fresh_db_url, "qstore")
    out, err = finish(proc, 30)
    assert proc.returncode == 1, (out, err)
    assert err.splitlines() == [err.strip()], err  # one line: nothing started, nothing logged
    assert err.startswith("qstore: qstore schema 'qstore' is not installed"), err
    assert "qstore worker started" not in err


def test_a_worker_refuses_to_start_on_a_schema_that_is_not_installed(fresh_engine):  # type: ignore[no-untyped-def]
    w = Worker(App(QueueStorage()), fresh_engine, WorkerSettings(queues=["default"]))
    try:
        with pytest.raises(SchemaNotInstalledError, match="qstore schema 'qstore' is not installed"):
            w.start()
        assert not w.running
        with pytest.raises(SchemaNotInstalledError):
            w.run()
    finally:
        if w.running:  # a worker that started anyway must not outlive the test
            w.request_stop(hurry=True)
            w.stop(0)


def drop_schema(engine: Engine, schema: str) -> None:
    with engine.begin() as conn:
        conn.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))


def test_a_worker_whose_schema_is_dropped_stops_with_one_line(engine, make_storage, caplog):  # type: ignore[no-untyped-def]
    st = make_storage(schema=unique_schema())
    app = App(st)

    @app.task(kind="work")
    def work(ctx: JobContext) -> None: ...

    job_id = work.defer(engine)
    w = Worker(app, engine, WorkerSettings(concurrency=2, poll_interval=0.2,
                                           schedule=MaintenanceSchedule(leader_retry_every=0.2)))
    raised: list[BaseException] = []

    def run() -> None:
        try:
            w.run()
        except BaseException as err:
            raised.append(err)

    caplog.set_level(logging.INFO)
    runner = threading.Thread(target=run)
    runner.start()
    try:
        settles_in(engine, st, job_id, JobState.COMPLETED)
        caplog.clear()
        drop_schema(engine, st.schema())
        runner.join(15)
        assert not runner.is_alive(), "the worker did not stop"
    finally:
        w.request_stop(hurry=True)
        runner.join(10)
    assert len(raised) == 1 and isinstance(raised[0], SchemaNotInstalledError), raised
    assert st.schema() in str(raised[0]) and w.failure is raised[0]
    records = runtime_records(caplog)
    errors = [r for r in records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "stopping" in errors[0].getMessage(), logged(records)
    assert "Traceback" not in logged(records)
    assert len([r for r in records if r.levelno >= logging.WARNING]) <= 6, logged(records)


def read_until(proc: subprocess.Popen[str], needle: str, timeout: float) -> str:
    """The process's stderr up to and including the first line holding ``needle``; the test
    fails if the process exits or ``timeout`` passes first."""
    assert proc.stderr is not None
    lines: list[str] = []
    found = threading.Event()

    def read() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.append(line)
            if needle in line:
                found.set()
                return

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    assert found.wait(timeout), f"no {needle!r} within {timeout} s; stderr so far:\n{''.join(lines)}"
    reader.join()
    return "".join(lines)


def test_the_worker_command_exits_1_with_one_line_when_its_schema_is_dropped(tmp_path, engine, db_url,  # type: ignore[no-untyped-def]
                                                                              make_storage):
    st = make_storage(schema=unique_schema())
    proc = run_cli_worker(tmp_path, db_url, st.schema())
    try:
        started = read_until(proc, "qstore worker started", 30)
        time.sleep(0.5)  # its loops run, its maintainer leads
        assert proc.poll() is None, proc.communicate()
        drop_schema(engine, st.schema())
        out, rest = finish(proc, 30)
        err = started + rest
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 1, (out, err)
    assert err.splitlines()[-1].startswith(f"qstore: qstore schema '{st.schema()}' is not installed"), err
    assert "Traceback" not in err and len(err.splitlines()) <= 15, err
