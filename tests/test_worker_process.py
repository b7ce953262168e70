"""Real worker processes (``python -m qstore worker MODULE:APP``) against the test database:
a worker killed mid-job, a worker stopped with SIGTERM, maintainer leadership moving to a
surviving worker; and the command's one-line refusals."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import make_url, text
from test_worker import eventually

from qstore import InsertOpts, InsertParams, status
from qstore.cli import main
from qstore.runtime.maintainer import LEADER_KEY_PREFIX
from qstore.status import UNHANDLED_KEY
from qstore.types import JobState

APP = '''
import os, pathlib, time
from qstore import QueueStorage, QueueStorageConfig
from qstore.tasks import App, JobContext

MARKS = pathlib.Path(os.environ["QSTORE_TEST_MARKS"])
app = App(QueueStorage(QueueStorageConfig(schema=os.environ["QSTORE_TEST_SCHEMA"])))
not_an_app = 42


@app.task(kind="work")
def work(ctx: JobContext, name: str, hold: float = 0.0) -> None:
    """Holds (ignoring ctx.cancelled) on the job's first run only; marks start and end."""
    first = not any(MARKS.glob(f"{name}.start.*"))
    (MARKS / f"{name}.start.{os.getpid()}.{ctx.run_lease}").touch()
    if hold and first:
        time.sleep(hold)
    (MARKS / f"{name}.done.{os.getpid()}.{ctx.run_lease}").touch()


# the next release of the application: the same tasks plus one of a new kind
next_app = App(app.storage)
next_app.tasks.update(app.tasks)


@next_app.task(kind="brand_new")
def brand_new(ctx: JobContext, name: str) -> None:
    (MARKS / f"{name}.done.{os.getpid()}.{ctx.run_lease}").touch()
'''


class WorkerProcess:
    """One ``python -m qstore worker`` process, its output in ``log``."""

    def __init__(self, popen: subprocess.Popen[bytes], log: Path, name: str) -> None:
        self.popen, self.log, self.name = popen, log, name

    @property
    def output(self) -> str:
        return self.log.read_text()

    def wait_started(self) -> WorkerProcess:
        eventually(lambda: "qstore worker started" in self.output or self.popen.poll() is not None,
                   timeout=15, what=f"{self.name} started")
        assert self.popen.poll() is None, self.output
        return self


@pytest.fixture
def app_module(tmp_path: Path, st) -> tuple[str, Path]:  # type: ignore[no-untyped-def]
    name = f"qstore_test_app_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(APP))
    (tmp_path / "marks").mkdir()
    return name, tmp_path


@pytest.fixture
def spawn(app_module, db_url, st) -> Iterator[Callable[..., WorkerProcess]]:  # type: ignore[no-untyped-def]
    module, where = app_module
    started: list[WorkerProcess] = []

    def start(name: str, *extra: str, app: str = "app") -> WorkerProcess:
        url = make_url(db_url).update_query_dict({"application_name": name}).render_as_string(hide_password=False)
        env = {**os.environ, "QSTORE_TEST_MARKS": str(where / "marks"), "QSTORE_TEST_SCHEMA": st.schema(),
               "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1]),
                                              os.environ.get("PYTHONPATH", "")])}
        log = where / f"{name}.log"
        popen = subprocess.Popen(
            [sys.executable, "-m", "qstore", "worker", f"{module}:{app}", "--url", url, "--concurrency", "4",
             "--poll-interval", "0.2", *extra],
            cwd=where, env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT)
        proc = WorkerProcess(popen, log, name)
        started.append(proc)
        return proc

    yield start
    for proc in started:
        if proc.popen.poll() is None:
            proc.popen.kill()
        proc.popen.wait(10)


def marks(app_module, kind: str, name: str) -> list[str]:  # type: ignore[no-untyped-def]
    return sorted(p.name for p in (app_module[1] / "marks").glob(f"{name}.{kind}.*"))


def work(engine, st, name: str, hold: float = 0.0) -> int:  # type: ignore[no-untyped-def]
    return st.enqueue(engine, InsertParams("work", {"name": name, "hold": hold}, InsertOpts(queue="default")))


def state_of(engine, st, job_id: int) -> Any:  # type: ignore[no-untyped-def]
    # None when load_job's statements straddle a promotion's commit (it reads the ready rows,
    # then the deferred ones, at READ COMMITTED); the callers poll again
    row = st.load_job(engine, job_id)
    return row.state if row is not None else None


def test_a_job_whose_worker_is_killed_is_rescued_and_completed_once_by_another(engine, st, spawn,  # type: ignore[no-untyped-def]
                                                                                 app_module):
    job_id = work(engine, st, "victim", hold=60)
    first = spawn("w_first").wait_started()
    eventually(lambda: marks(app_module, "start", "victim"), timeout=10, what="first run started")
    first.popen.send_signal(signal.SIGKILL)
    first.popen.wait(5)
    second = spawn("w_second").wait_started()
    time.sleep(0.6)  # the killed attempt's last sign of life (its claim) is now > 0.5 s old
    assert [r.id for r in st.rescue_stale_heartbeats(engine, 0.5)] == [job_id]
    eventually(lambda: state_of(engine, st, job_id) == JobState.COMPLETED, timeout=10, what="completed")
    done = marks(app_module, "done", "victim")
    assert len(done) == 1 and f".{second.popen.pid}." in done[0]
    assert len(marks(app_module, "start", "victim")) == 2
    assert st.load_job(engine, job_id).attempt == 2


def test_sigterm_drains_gracefully_and_handed_back_jobs_run_again(engine, st, spawn, app_module):  # type: ignore[no-untyped-def]
    stuck = work(engine, st, "stuck", hold=60)  # will not finish within the shutdown timeout
    brief = work(engine, st, "brief", hold=0.5)  # finishes within it
    worker = spawn("w_term", "--shutdown-timeout", "1.5").wait_started()
    eventually(lambda: marks(app_module, "start", "stuck") and marks(app_module, "start", "brief"),
               timeout=10, what="both jobs started")
    sent = time.monotonic()
    worker.popen.send_signal(signal.SIGTERM)
    assert worker.popen.wait(15) == 0, worker.output
    assert time.monotonic() - sent < 10
    assert "1 completed" in worker.output and "1 handed back" in worker.output, worker.output
    assert state_of(engine, st, brief) == JobState.COMPLETED
    row = st.load_job(engine, stuck)
    # given back, due at once (promoted already if the maintainer ran once more meanwhile)
    assert row.state in (JobState.SCHEDULED, JobState.AVAILABLE) and row.attempt == 0
    assert st.queue_counts(engine, "default").running == 0
    assert "shutdown begun" in worker.output and "shutdown done" in worker.output

    spawn("w_after").wait_started()  # its maintainer promotes the job; it runs again
    eventually(lambda: state_of(engine, st, stuck) == JobState.COMPLETED, timeout=10, what="ran again")
    assert len(marks(app_module, "done", "stuck")) == 1


def test_a_second_sigterm_stops_at_once_giving_running_jobs_back(engine, st, spawn, app_module):  # type: ignore[no-untyped-def]
    stuck = work(engine, st, "stuck", hold=60)
    worker = spawn("w_twice", "--shutdown-timeout", "60").wait_started()
    eventually(lambda: marks(app_module, "start", "stuck"), timeout=10, what="job started")
    worker.popen.send_signal(signal.SIGTERM)
    eventually(lambda: "shutdown begun" in worker.output, timeout=5, what="shutdown begun")
    sent = time.monotonic()
    worker.popen.send_signal(signal.SIGTERM)
    assert worker.popen.wait(15) == 0, worker.output
    assert time.monotonic() - sent < 10
    assert "1 handed back" in worker.output, worker.output
    assert state_of(engine, st, stuck) in (JobState.SCHEDULED, JobState.AVAILABLE)


def leader(engine, st) -> str | None:  # type: ignore[no-untyped-def]
    """The application name of the session holding the install's maintainer lock."""
    with engine.connect() as conn:
        return conn.execute(text(
            "SELECT a.application_name FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid "
            "WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1 "
            "AND ((l.classid::bigint << 32) | l.objid::bigint) = hashtextextended(:key, 0)"),
            {"key": LEADER_KEY_PREFIX + st.schema()}).scalar()


def test_maintainer_leadership_moves_to_the_surviving_worker_when_the_leader_is_killed(engine, st, spawn):  # type: ignore[no-untyped-def]
    first = spawn("w_lead").wait_started()
    eventually(lambda: leader(engine, st) == "w_lead", timeout=10, what="first worker leads")
    second = spawn("w_follow").wait_started()
    time.sleep(0.3)
    assert leader(engine, st) == "w_lead"
    first.popen.send_signal(signal.SIGKILL)
    eventually(lambda: leader(engine, st) == "w_follow", timeout=10, what="leadership moved")
    eventually(lambda: "maintainer leadership taken" in second.output, timeout=5, what="logged")


# -- one-line refusals ----------------------------------------------------------------------------


@pytest.mark.parametrize(("target", "message"), [
    ("no_such_module_xyz:app", "cannot import module 'no_such_module_xyz'"),
    ("{module}:missing", "has no attribute 'missing'"),
    ("{module}:not_an_app", "is a int, not a qstore.tasks.App"),
    ("no_colon", "expected MODULE:APP"),
])
def test_a_bad_app_path_is_refused_in_one_line(app_module, db_url, monkeypatch, capsys, target, message):  # type: ignore[no-untyped-def]
    module, where = app_module
    monkeypatch.chdir(where)
    monkeypatch.setenv("QSTORE_TEST_MARKS", str(where / "marks"))
    monkeypatch.setenv("QSTORE_TEST_SCHEMA", "qstore")
    assert main(["worker", target.format(module=module), "--url", db_url]) == 1
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


def test_a_schema_other_than_the_apps_is_refused_in_one_line(app_module, db_url, st, monkeypatch, capsys):  # type: ignore[no-untyped-def]
    module, where = app_module
    monkeypatch.chdir(where)
    monkeypatch.setenv("QSTORE_TEST_MARKS", str(where / "marks"))
    monkeypatch.setenv("QSTORE_TEST_SCHEMA", st.schema())
    assert main(["worker", f"{module}:app", "--url", db_url, "--schema", "elsewhere"]) == 1
    err = capsys.readouterr().err
    assert "--schema 'elsewhere' differs" in err and err.count("\n") == 1, err


def test_a_worker_without_a_database_url_is_refused_in_one_line(app_module, monkeypatch, capsys):  # type: ignore[no-untyped-def]
    module, where = app_module
    monkeypatch.chdir(where)
    monkeypatch.delenv("QSTORE_DATABASE_URL", raising=False)
    monkeypatch.setenv("QSTORE_TEST_MARKS", str(where / "marks"))
    monkeypatch.setenv("QSTORE_TEST_SCHEMA", "qstore")
    assert main(["worker", f"{module}:app"]) == 1
    err = capsys.readouterr().err
    assert "worker needs a database" in err and err.count("\n") == 1, err


def test_a_new_kind_handed_back_by_an_old_worker_completes_on_a_new_one_without_spending_attempts(  # type: ignore[no-untyped-def]
        engine, st, spawn, app_module):
    old = spawn("w_old").wait_started()
    job_id = st.enqueue(engine, InsertParams("brand_new", {"name": "fresh"}, InsertOpts(queue="default")))

    def handed_back(times: int) -> bool:
        row = st.load_job(engine, job_id)
        mark = (row.progress or {}).get(UNHANDLED_KEY) if row is not None else None
        return bool(mark) and mark["count"] >= times and row.state == JobState.SCHEDULED

    eventually(lambda: handed_back(2), timeout=15, what="handed back twice by the old worker")
    row = st.load_job(engine, job_id)
    assert (row.attempt, row.errors) == (0, None)
    assert [(h.kind, h.jobs) for h in status.handed_back_kinds(engine, st)] == [("brand_new", 1)]
    new = spawn("w_new", app="next_app").wait_started()
    eventually(lambda: state_of(engine, st, job_id) == JobState.COMPLETED, timeout=20, what="completed")
    assert st.load_job(engine, job_id).attempt == 1
    done = marks(app_module, "done", "fresh")
    assert len(done) == 1 and f".{new.popen.pid}." in done[0]
    assert old.popen.poll() is None
    assert old.output.count("no task for kind 'brand_new'") == 1
    assert status.handed_back_kinds(engine, st) == []
