"""Periodic tasks: schedules and their errors, tick arithmetic, the planner's ticks (each
enqueued once, missed ticks skipped or caught up), and workers running them, in one process
and in several processes with the planning leader killed."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta, timezone
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import make_url, text
from test_worker import eventually

from qstore import QueueStorage
from qstore.errors import QueueStorageError, UniqueConflictError, ValidationError
from qstore.runtime.periodic import (
    LOCK_KEY_PREFIX,
    TICK_KEY,
    Cron,
    Every,
    MissingExtraError,
    Periodic,
    Planner,
)
from qstore.tasks import App, JobContext
from qstore.types import InsertOpts, InsertParams, JobState
from qstore.worker import Worker, WorkerSettings

UTC = timezone.utc
#: A "now" far in the future: ticks the planner enqueues for it stay scheduled (nothing
#: promotes them), so a test reads exactly what was enqueued.
FUTURE = datetime(2100, 1, 1, tzinfo=UTC)


def at(seconds: float) -> datetime:
    return FUTURE + timedelta(seconds=seconds)


# -- schedules and tick arithmetic ----------------------------------------------------------------


def test_an_interval_ticks_on_its_multiples_since_the_epoch() -> None:
    every = Every(30)
    t = datetime(2026, 3, 1, 12, 0, 41, 250000, tzinfo=UTC)
    assert every.next_after(t) == datetime(2026, 3, 1, 12, 1, 0, tzinfo=UTC)
    assert every.at_or_before(t) == datetime(2026, 3, 1, 12, 0, 30, tzinfo=UTC)
    on_tick = datetime(2026, 3, 1, 12, 1, 0, tzinfo=UTC)
    assert every.at_or_before(on_tick) == on_tick  # a tick is at or before itself
    assert every.next_after(on_tick) == on_tick + timedelta(seconds=30)  # strictly after
    assert Every(3600).next_after(t) == datetime(2026, 3, 1, 13, 0, tzinfo=UTC)
    riga = timezone(timedelta(hours=2))  # the same instant in another offset ticks the same
    assert every.next_after(t.astimezone(riga)) == datetime(2026, 3, 1, 12, 1, 0, tzinfo=UTC)


def test_a_cron_expression_ticks_where_it_matches_in_utc() -> None:
    t = datetime(2026, 3, 1, 12, 7, 41, 250000, tzinfo=UTC)
    five = Cron("*/5 * * * *")
    assert five.next_after(t) == datetime(2026, 3, 1, 12, 10, tzinfo=UTC)
    assert five.at_or_before(t) == datetime(2026, 3, 1, 12, 5, tzinfo=UTC)
    on_tick = datetime(2026, 3, 1, 12, 10, tzinfo=UTC)
    assert five.at_or_before(on_tick) == on_tick
    assert five.next_after(on_tick) == datetime(2026, 3, 1, 12, 15, tzinfo=UTC)
    seconds = Cron("* * * * * */2")  # a sixth field counts seconds
    assert seconds.next_after(t) == datetime(2026, 3, 1, 12, 7, 42, tzinfo=UTC)
    assert seconds.at_or_before(t) == datetime(2026, 3, 1, 12, 7, 40, tzinfo=UTC)
    assert Cron("@daily").next_after(t) == datetime(2026, 3, 2, tzinfo=UTC)


@pytest.mark.parametrize("expression", ["61 * * * *", "* * *", "every minute", "0 0 30 2 *", "", "  "])
def test_an_invalid_cron_expression_is_refused_at_decoration_naming_it(st, expression: str) -> None:  # type: ignore[no-untyped-def]
    app = App(st)
    with pytest.raises(ValidationError) as raised:
        @app.periodic(cron=expression)
        @app.task(kind="never")
        def never(ctx: JobContext) -> None: ...
    assert raised.value.field == "cron" and raised.value.value == expression
    assert repr(expression) in str(raised.value)
    assert app.periodic_tasks == {}


@pytest.mark.parametrize(("options", "field"), [
    ({"every": 0}, "every"),
    ({"every": 0.5}, "every"),
    ({"every": -30}, "every"),
    ({"every": float("nan")}, "every"),
    ({"every": "30s"}, "every"),
    ({"every": timedelta(milliseconds=10)}, "every"),
    ({}, "periodic"),
    ({"every": 30, "cron": "* * * * *"}, "periodic"),
    ({"every": 30, "catch_up": -1}, "catch_up"),
    ({"every": 30, "catch_up": 1.5}, "catch_up"),
    ({"every": 30, "catch_up": 10_000}, "catch_up"),
    ({"every": 30, "args": [1]}, "args"),
])
def test_a_bad_schedule_option_is_refused_naming_it(st, options: dict[str, Any], field: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValidationError) as raised:
        App(st).periodic(**options)
    assert raised.value.field == field


def test_periodic_args_are_bound_against_the_function_at_decoration(st) -> None:  # type: ignore[no-untyped-def]
    app = App(st)
    with pytest.raises(ValidationError, match="missing a required argument: 'region'"):
        @app.periodic(every=60)
        @app.task(kind="report")
        def report(ctx: JobContext, region: str) -> None: ...

    @app.periodic(every=60, args={"region": "eu"})
    @app.task(kind="report_eu")
    def report_eu(ctx: JobContext, region: str) -> None: ...

    assert app.periodic_tasks["report_eu"].args == {"region": "eu"}


def test_a_task_gets_one_schedule(st) -> None:  # type: ignore[no-untyped-def]
    app = App(st)

    @app.periodic(every=60)
    @app.task(kind="once")
    def once(ctx: JobContext) -> None: ...

    with pytest.raises(ValidationError, match="has a schedule already"):
        app.periodic(every=30)(once)


def test_a_cron_schedule_without_croniter_names_the_missing_extra(st, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setitem(sys.modules, "croniter", None)  # import croniter now raises ImportError
    app = App(st)
    with pytest.raises(MissingExtraError) as raised:
        app.periodic(cron="*/5 * * * *")
    assert isinstance(raised.value, QueueStorageError) and isinstance(raised.value, ImportError)
    assert raised.value.extra == "cron" and "pip install 'qstore[cron]'" in str(raised.value)


def test_an_interval_needs_no_extra(st, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setitem(sys.modules, "croniter", None)
    app = App(st)

    @app.periodic(every=timedelta(seconds=30))
    @app.task(kind="tidy")
    def tidy(ctx: JobContext) -> None: ...

    assert app.periodic_tasks["tidy"].schedule == Every(30)


def test_a_periodic_task_stays_a_normal_task(engine, st) -> None:  # type: ignore[no-untyped-def]
    app = App(st)

    @app.periodic(every=60)
    @app.task(kind="stacked", queue="reports", priority=1)
    def stacked(ctx: JobContext, day: str = "today") -> str:
        return day

    @app.periodic(every=60)
    def plain(ctx: JobContext) -> None: ...

    assert app.tasks["stacked"] is stacked and stacked(None, day="x") == "x"  # type: ignore[arg-type]
    assert plain.kind in app.tasks and plain.kind in app.periodic_tasks
    job = st.load_job(engine, stacked.defer(engine, day="monday"))
    assert (job.kind, job.queue, job.priority, job.args) == ("stacked", "reports", 1, {"day": "monday"})
    assert job.state is JobState.AVAILABLE and TICK_KEY not in job.metadata  # not a tick


def test_a_tick_job_is_scheduled_for_its_tick_and_carries_it(st) -> None:  # type: ignore[no-untyped-def]
    p = Periodic("report", Every(60), InsertOpts(queue="reports", metadata={"team": "ops"}), {"region": "eu"})
    params = p.params(at(60))
    assert params.kind == "report" and params.args == {"region": "eu"}
    assert params.opts.run_at == at(60) and params.opts.queue == "reports"
    assert params.opts.metadata == {"team": "ops", TICK_KEY: "2100-01-01T00:01:00+00:00"}
    assert params.opts.unique is not None and params.opts.unique.states == 0xFF  # held in every state
    assert params.opts.unique != p.params(at(120)).opts.unique  # one key per tick


# -- the planner ----------------------------------------------------------------------------------


@pytest.fixture
def planners(engine) -> Iterator[Callable[..., Planner]]:  # type: ignore[no-untyped-def]
    """``planners(storage, *periodic)`` → a planner that leads (its locks taken); released
    at teardown."""
    made: list[Planner] = []

    def make(storage: QueueStorage, *tasks: Periodic, lead: bool = True) -> Planner:
        planner = Planner(storage, engine, list(tasks))
        made.append(planner)
        if lead:
            assert planner.refresh_leadership() == {p.kind for p in tasks}
        return planner

    yield make
    for planner in made:
        planner.stop()


def every_second(kind: str = "tick", catch_up: int = 0) -> Periodic:
    return Periodic(kind, Every(1), InsertOpts(queue="periodic"), catch_up=catch_up)


def planned(result: list[Any]) -> list[tuple[float, bool, bool]]:
    """(seconds after FUTURE, enqueued now, catch-up) of each tick of a pass."""
    return [((p.tick - FUTURE).total_seconds(), p.job_id is not None, p.catch_up) for p in result]


def test_a_ticks_key_refuses_a_second_job_in_every_state(engine, st) -> None:  # type: ignore[no-untyped-def]
    p = every_second()
    job_id = st.enqueue(engine, p.params(at(1)))
    with pytest.raises(UniqueConflictError):  # scheduled
        st.enqueue(engine, p.params(at(1)))
    past = datetime.now(UTC) - timedelta(seconds=5)
    done = st.enqueue(engine, p.params(past))
    assert st.promote_due(engine, JobState.SCHEDULED, 10) == 1
    (claimed,) = st.claim_runtime_batch(engine, "periodic", 10)
    with pytest.raises(UniqueConflictError):  # running
        st.enqueue(engine, p.params(past))
    assert st.complete_runtime_batch(engine, [claimed]) == [(done, claimed.job.run_lease)]
    with pytest.raises(UniqueConflictError):  # completed
        st.enqueue(engine, p.params(past))
    assert st.load_job(engine, job_id).state is JobState.SCHEDULED


def test_a_tick_stays_with_its_job_through_a_retry(engine, st) -> None:  # type: ignore[no-untyped-def]
    tick = datetime.now(UTC).replace(microsecond=0) - timedelta(seconds=5)
    st.enqueue(engine, every_second().params(tick))
    st.promote_due(engine, JobState.SCHEDULED, 10)
    (first,) = st.claim_runtime_batch(engine, "periodic", 10)
    assert JobContext(first, st).tick == tick
    st.retry_after(engine, first.job.id, first.job.run_lease, 0)
    st.promote_due(engine, JobState.RETRYABLE, 10)
    (again,) = st.claim_runtime_batch(engine, "periodic", 10)
    assert again.job.attempt == 2 and JobContext(again, st).tick == tick


def test_a_job_no_schedule_enqueued_has_no_tick(engine, st) -> None:  # type: ignore[no-untyped-def]
    st.enqueue(engine, InsertParams("plain", {}, InsertOpts(queue="periodic", metadata={"x": 1})))
    (claimed,) = st.claim_runtime_batch(engine, "periodic", 10)
    assert JobContext(claimed, st).tick is None


def test_one_planner_leads_a_kind_and_another_takes_it_when_released(st, planners) -> None:  # type: ignore[no-untyped-def]
    first = planners(st, every_second("a"), every_second("b"))
    second = planners(st, every_second("a"), every_second("b"), lead=False)
    assert second.refresh_leadership() == set()
    assert second.plan(at(0.5)) == []  # a planner that leads nothing enqueues nothing
    first.release()
    time.sleep(1.05)  # a planner tries again once a second
    assert second.refresh_leadership() == {"a", "b"}


def test_a_planner_taking_over_enqueues_only_the_next_tick_by_default(engine, st, planners) -> None:  # type: ignore[no-untyped-def]
    planner = planners(st, every_second())
    assert planned(planner.plan(at(5.5))) == [(6.0, True, False)]
    assert planner.plan(at(5.9)) == []  # nothing due until the tick comes
    assert planned(planner.plan(at(6.2))) == [(7.0, True, False)]
    job = st.load_job(engine, planner.plan(at(7.0))[0].job_id)
    assert job.state is JobState.SCHEDULED and job.run_at == at(8)
    assert job.metadata[TICK_KEY] == at(8).isoformat()


def test_a_planner_taking_over_a_kind_whose_next_tick_is_enqueued_replays_nothing(st, planners) -> None:  # type: ignore[no-untyped-def]
    first = planners(st, every_second(catch_up=5))
    first.plan(at(0.5))
    first.release()
    second = planners(st, every_second(catch_up=5))
    assert planned(second.plan(at(0.7))) == [(1.0, False, False)]  # found: nothing was missed


def test_a_late_pass_skips_missed_ticks_by_default(st, planners) -> None:  # type: ignore[no-untyped-def]
    planner = planners(st, every_second())
    planner.plan(at(0.5))
    assert planned(planner.plan(at(4.5))) == [(5.0, True, False)]  # 2, 3 and 4 were missed


def test_a_late_pass_replays_the_newest_missed_ticks_with_catch_up(st, planners) -> None:  # type: ignore[no-untyped-def]
    planner = planners(st, every_second(catch_up=2))
    planner.plan(at(0.5))
    assert planned(planner.plan(at(4.5))) == [(5.0, True, False), (4.0, True, True), (3.0, True, True)]
    assert planned(planner.plan(at(5.5))) == [(6.0, True, False)]  # 5 was enqueued ahead: nothing missed


def test_catch_up_after_downtime_stops_at_the_last_tick_enqueued_before_it(st, planners) -> None:  # type: ignore[no-untyped-def]
    before = planners(st, every_second(catch_up=10))
    before.plan(at(0.5))  # tick 1 enqueued ahead; then every planner stops
    before.release()
    after = planners(st, every_second(catch_up=10))
    assert planned(after.plan(at(5.5))) == [
        (6.0, True, False), (5.0, True, True), (4.0, True, True), (3.0, True, True), (2.0, True, True),
        (1.0, False, True)]  # tick 1's job exists: the ticks before it were not missed


def test_catch_up_after_downtime_is_bounded(st, planners) -> None:  # type: ignore[no-untyped-def]
    before = planners(st, every_second(catch_up=2))
    before.plan(at(0.5))
    before.release()
    after = planners(st, every_second(catch_up=2))
    assert planned(after.plan(at(50.5))) == [(51.0, True, False), (50.0, True, True), (49.0, True, True)]


def test_the_very_first_start_counts_as_coming_back(st, planners) -> None:  # type: ignore[no-untyped-def]
    planner = planners(st, every_second(catch_up=3))  # nothing was ever enqueued for the kind
    assert planned(planner.plan(at(10.5))) == [(11.0, True, False), (10.0, True, True), (9.0, True, True),
                                               (8.0, True, True)]


def test_a_cron_task_is_planned_on_its_expression(st, planners) -> None:  # type: ignore[no-untyped-def]
    planner = planners(st, Periodic("cron", Cron("*/5 * * * *"), InsertOpts(), catch_up=1))
    assert planned(planner.plan(at(7 * 60))) == [(600.0, True, False), (300.0, True, True)]


# -- workers --------------------------------------------------------------------------------------


class Seen:
    """What the handlers of a periodic task saw: (tick, job id, when it ran)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.runs: list[tuple[datetime, int, datetime]] = []

    def record(self, ctx: JobContext) -> None:
        assert ctx.tick is not None
        with self.lock:
            self.runs.append((ctx.tick, ctx.job_id, datetime.now(UTC)))

    @property
    def ticks(self) -> list[datetime]:
        with self.lock:
            return sorted(t for t, _, _ in self.runs)


@pytest.fixture
def workers(engine) -> Iterator[Callable[..., Worker]]:  # type: ignore[no-untyped-def]
    started: list[Worker] = []

    def start(app: App, **settings: Any) -> Worker:
        settings.setdefault("maintain", False)
        settings.setdefault("concurrency", 2)
        settings.setdefault("poll_interval", 0.2)
        w = Worker(app, engine, WorkerSettings(**settings))
        w.start()
        started.append(w)
        return w

    yield start
    for w in started:
        w.stop(0)


def ticking_app(st: QueueStorage, seen: Seen, **options: Any) -> App:
    app = App(st)
    if "cron" not in options:
        options.setdefault("every", 1)

    @app.periodic(**options)
    @app.task(kind="tick", queue="periodic")
    def tick(ctx: JobContext) -> None:
        seen.record(ctx)

    return app


def assert_each_tick_once(ticks: list[datetime]) -> None:
    assert len(ticks) == len(set(ticks)), f"a tick ran as two jobs: {ticks}"


def test_several_workers_in_one_process_enqueue_each_tick_once(st, workers) -> None:  # type: ignore[no-untyped-def]
    seen = Seen()
    app = ticking_app(st, seen)
    for i in range(3):
        workers(app, maintain=i == 0)
    eventually(lambda: len(seen.ticks) >= 4, timeout=8, what="four ticks ran")
    ticks = seen.ticks
    assert_each_tick_once(ticks)
    assert [b - a for a, b in pairwise(ticks)] == [timedelta(seconds=1)] * (len(ticks) - 1)


def test_async_workers_beside_a_thread_worker_enqueue_each_tick_once(st, db_url, workers) -> None:  # type: ignore[no-untyped-def]
    """The asyncio worker plans periodic ticks too (on its planner thread), sharing the
    per-kind lock with thread workers: each tick runs once whichever worker planned it."""
    from sqlalchemy.ext.asyncio import create_async_engine

    from qstore.worker import AsyncWorker

    seen = Seen()
    app = ticking_app(st, seen)

    async def main() -> None:
        engine = create_async_engine(db_url)
        try:
            async with AsyncWorker(app, engine, WorkerSettings(maintain=True, concurrency=2, poll_interval=0.2)) as w:
                assert w.planner is not None
                for _ in range(80):
                    if len(seen.ticks) >= 2:
                        break
                    await asyncio.sleep(0.1)
                workers(app)  # a thread worker joins; it may take the kind over only when released
                for _ in range(60):
                    if len(seen.ticks) >= 4:
                        break
                    await asyncio.sleep(0.1)
        finally:
            await engine.dispose()

    asyncio.run(main())
    ticks = seen.ticks
    assert len(ticks) >= 4, ticks
    assert_each_tick_once(ticks)


@pytest.mark.parametrize("schedule", [{"every": 1}, {"cron": "* * * * * *"}])
def test_the_handler_sees_its_tick(engine, st, workers, schedule: dict[str, Any]) -> None:  # type: ignore[no-untyped-def]
    seen = Seen()
    workers(ticking_app(st, seen, **schedule), maintain=True)
    eventually(lambda: len(seen.ticks) >= 2, timeout=6, what="two ticks ran")
    with seen.lock:
        tick, job_id, ran = seen.runs[-1]
    assert tick.tzinfo is not None and tick.utcoffset() == timedelta(0)
    assert tick.microsecond == 0 and tick <= ran < tick + timedelta(seconds=1)
    job = st.load_job(engine, job_id)
    assert job.metadata[TICK_KEY] == tick.isoformat() and job.run_at >= tick  # promotion moves run_at


def contiguous(ticks: list[datetime]) -> bool:
    return all(b - a == timedelta(seconds=1) for a, b in pairwise(ticks))


def run_stop_wait_and_run_again(app: App, seen: Seen, workers: Callable[..., Worker],
                                down: float) -> tuple[datetime, datetime, datetime]:
    """A worker runs a few ticks and stops; ``down`` seconds later another one starts and runs
    past the next tick. Returns the last tick run before the stop, the stop and the restart."""
    first = workers(app, maintain=True)
    eventually(lambda: len(seen.ticks) >= 2, timeout=6, what="two ticks ran")
    first.stop(0)  # the next tick was enqueued ahead: it stays scheduled
    stopped = datetime.now(UTC)
    last = max(seen.ticks)
    time.sleep(down)
    restarted = datetime.now(UTC)
    workers(app, maintain=True)
    eventually(lambda: sum(t > restarted for t in seen.ticks) >= 2, timeout=6, what="ticks after the restart")
    return last, stopped, restarted


@pytest.mark.slow
def test_ticks_missed_while_no_worker_ran_are_not_replayed_by_default(st, workers) -> None:  # type: ignore[no-untyped-def]
    seen = Seen()
    last, stopped, restarted = run_stop_wait_and_run_again(ticking_app(st, seen), seen, workers, 3.5)
    ticks = seen.ticks
    assert_each_tick_once(ticks)
    ahead, *after = [t for t in ticks if t > last]
    assert ahead <= stopped + timedelta(seconds=1)  # enqueued before the stop, run late
    assert after and all(t > restarted for t in after), (ahead, after, restarted)  # none in between


@pytest.mark.slow
def test_catch_up_replays_ticks_missed_while_no_worker_ran(st, workers) -> None:  # type: ignore[no-untyped-def]
    seen = Seen()
    _, stopped, restarted = run_stop_wait_and_run_again(ticking_app(st, seen, catch_up=5), seen, workers, 3.5)
    ticks = seen.ticks
    assert_each_tick_once(ticks)
    missed = [t for t in ticks if stopped + timedelta(seconds=1) < t <= restarted]
    assert len(missed) >= 2, (ticks, stopped, restarted)
    assert contiguous(ticks), ticks  # every tick from the first to the last ran, once


@pytest.mark.slow
def test_catch_up_replays_at_most_its_bound(st, workers) -> None:  # type: ignore[no-untyped-def]
    seen = Seen()
    last, _, restarted = run_stop_wait_and_run_again(ticking_app(st, seen, catch_up=1), seen, workers, 4.5)
    ticks = seen.ticks
    assert_each_tick_once(ticks)
    _, *after = [t for t in ticks if t > last]  # the first ran late: it was enqueued before the stop
    replayed = [t for t in after if t <= restarted]
    assert len(replayed) == 1 and restarted - replayed[0] < timedelta(seconds=1), (after, restarted)


# -- several worker processes ---------------------------------------------------------------------

PROCESS_APP = '''
import os, pathlib
from qstore import QueueStorage, QueueStorageConfig
from qstore.tasks import App, JobContext

MARKS = pathlib.Path(os.environ["QSTORE_TEST_MARKS"])
app = App(QueueStorage(QueueStorageConfig(schema=os.environ["QSTORE_TEST_SCHEMA"])))


@app.periodic(every=1, catch_up=5)
@app.task(kind="tick")
def tick(ctx: JobContext) -> None:
    """Marks the tick with the job that ran it (a rerun of one job marks the same job)."""
    (MARKS / f"{ctx.tick.timestamp():.0f}.{ctx.job_id}.{os.getpid()}").touch()
'''


@pytest.fixture
def processes(tmp_path: Path, db_url: str, st) -> Iterator[Callable[[str], subprocess.Popen[bytes]]]:  # type: ignore[no-untyped-def]
    module = f"qstore_periodic_app_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{module}.py").write_text(textwrap.dedent(PROCESS_APP))
    (tmp_path / "marks").mkdir()
    started: list[subprocess.Popen[bytes]] = []

    def start(name: str) -> subprocess.Popen[bytes]:
        url = make_url(db_url).update_query_dict({"application_name": name}).render_as_string(hide_password=False)
        env = {**os.environ, "QSTORE_TEST_MARKS": str(tmp_path / "marks"), "QSTORE_TEST_SCHEMA": st.schema(),
               "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1]),
                                              os.environ.get("PYTHONPATH", "")])}
        popen = subprocess.Popen(
            [sys.executable, "-m", "qstore", "worker", f"{module}:app", "--url", url, "--concurrency", "2",
             "--poll-interval", "0.2"],
            cwd=tmp_path, env=env, stdout=(tmp_path / f"{name}.log").open("wb"), stderr=subprocess.STDOUT)
        started.append(popen)
        return popen

    yield start
    for popen in started:
        if popen.poll() is None:
            popen.kill()
        popen.wait(10)


def planning_leader(engine, st) -> str | None:  # type: ignore[no-untyped-def]
    """The application name of the session holding the lock of the kind "tick"."""
    with engine.connect() as conn:
        return conn.execute(text(
            "SELECT a.application_name FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid "
            "WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1 "
            "AND ((l.classid::bigint << 32) | l.objid::bigint) = hashtextextended(:key, 0)"),
            {"key": f"{LOCK_KEY_PREFIX}{st.schema()}:tick"}).scalar()


def process_ticks(marks: Path) -> dict[int, set[str]]:
    """Each tick (Unix seconds) that ran, with the ids of the jobs that ran it."""
    out: dict[int, set[str]] = {}
    for p in marks.iterdir():
        tick, job_id, _ = p.name.split(".")
        out.setdefault(int(tick), set()).add(job_id)
    return out


@pytest.mark.slow
def test_worker_processes_enqueue_each_tick_once_when_the_planning_leader_is_killed(  # type: ignore[no-untyped-def]
        engine, st, processes, tmp_path) -> None:
    procs = {name: processes(name) for name in ("w_a", "w_b", "w_c")}
    leader = eventually(lambda: planning_leader(engine, st), timeout=15, what="a worker leads the planning")
    marks = tmp_path / "marks"
    eventually(lambda: len(process_ticks(marks)) >= 3, timeout=10, what="three ticks ran")
    procs[leader].send_signal(signal.SIGKILL)
    procs[leader].wait(5)
    killed = time.time()
    successor = eventually(lambda: (planning_leader(engine, st) or leader) != leader and planning_leader(engine, st),
                           timeout=10, what="another worker leads the planning")
    # A tick job the killed worker had claimed runs again once its attempt is rescued (after
    # the heartbeat staleness, 90 s by default): rescue it now, as its staleness is long past.
    time.sleep(0.6)
    st.rescue_stale_heartbeats(engine, 0.5)

    def contiguous_past_the_kill() -> bool:
        ticks = sorted(process_ticks(marks))
        return ticks[-1] >= killed + 4 and ticks == list(range(ticks[0], ticks[-1] + 1))

    eventually(contiguous_past_the_kill, timeout=20, what="every tick ran, past the kill")
    for name, popen in procs.items():
        if name != leader:
            popen.send_signal(signal.SIGTERM)
            assert popen.wait(15) == 0, (tmp_path / f"{name}.log").read_text()
    ran = process_ticks(marks)
    assert {t: ids for t, ids in ran.items() if len(ids) > 1} == {}  # no tick ran as two jobs
    ticks = sorted(ran)
    assert ticks == list(range(ticks[0], ticks[-1] + 1)), ticks  # none missed (catch_up covers the kill)
    assert "periodic tasks planned here" in (tmp_path / f"{successor}.log").read_text()
