"""The maintainer (qstore.runtime.maintainer): one leader per install runs ring rotation and prune,
promotion, rescue and the counter rollup on a schedule; leadership moves when the leader's
session ends, and leadership never holds a transaction open."""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from jobtools import BACKLOG, relation
from sqlalchemy import Engine, create_engine, event, text

from qstore import InsertOpts, InsertParams, QueueStorage, UniqueOpts, ValidationError
from qstore.cli import main as cli_main
from qstore.runtime.maintainer import LEADER_KEY_PREFIX, Maintainer, MaintenanceSchedule, RingTick
from qstore.types import JobState

SMALL = {"queue_slot_count": 4, "lease_slot_count": 2, "claim_slot_count": 2}
Q = "mq"
FAST = MaintenanceSchedule(queue_ring_every=0.05, lease_ring_every=0.05, claim_ring_every=0.05,
                           promote_every=0.05, rescue_every=0.05, rollup_every=0.05,
                           leader_retry_every=0.05, heartbeat_staleness=3600)


@pytest.fixture
def engine(db_url: str) -> Iterator[Engine]:
    """A private pool: these tests kill backends and keep connections for locks."""
    eng = create_engine(db_url, pool_size=5, max_overflow=10)
    yield eng
    eng.dispose()


@pytest.fixture
def small(make_storage: Callable[..., QueueStorage]) -> QueueStorage:
    return make_storage(**SMALL)


@pytest.fixture
def maintainers(small: QueueStorage, engine: Engine) -> Iterator[Callable[..., Maintainer]]:
    """``make(storage=small, schedule=FAST)`` → a Maintainer stopped at teardown."""
    made: list[Maintainer] = []

    def make(storage: QueueStorage | None = None, schedule: MaintenanceSchedule = FAST) -> Maintainer:
        m = Maintainer(storage or small, engine, schedule)
        made.append(m)
        return m

    yield make
    for m in made:
        m.stop()


def enqueue(st: QueueStorage, engine: Engine, n: int = 1, **opts: Any) -> None:
    assert st.enqueue_params_batch(engine, [InsertParams("m", {"i": i}, InsertOpts(queue=Q, **opts))
                                            for i in range(n)]) == n


def job_state(st: QueueStorage, engine: Engine, job_id: int) -> JobState:
    row = st.load_job(engine, job_id)
    assert row is not None
    return row.state


def wait_until(pred: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.02)
    return pred()


def run(m: Maintainer, task: str) -> Any:
    """Run every task once; the result of ``task`` (which must not have failed)."""
    report = next(r for r in m.run_all() if r.task == task)
    assert report.error is None, report
    return report.result


def deferred_ids(st: QueueStorage, engine: Engine) -> list[int]:
    with engine.connect() as c:
        return list(c.execute(text(f'SELECT job_id FROM {relation(st.schema(), BACKLOG)}')).scalars())


# -- schedule ------------------------------------------------------------------------------------
@pytest.mark.parametrize(("name", "value"), [
    ("queue_ring_every", 0), ("promote_every", -1.0), ("rescue_every", float("nan")),
    ("promote_batch_size", 0), ("rollup_max_slots", 2.5), ("prune_backoff_limit", -1),
    ("lease_ring_every", True), ("claim_ring_turn_bytes", -1), ("claim_ring_turn_bytes", 1024.5),
    ("claim_ring_turn_after", 0),
])
def test_schedule_rejects_bad_values_naming_the_field(name: str, value: object) -> None:
    with pytest.raises(ValidationError) as err:
        MaintenanceSchedule(**{name: value})  # type: ignore[arg-type]
    assert err.value.field == name


def test_schedule_allows_no_prune_backoff() -> None:
    assert MaintenanceSchedule(prune_backoff_limit=0).prune_backoff_limit == 0


def test_schedule_allows_a_claim_ring_on_a_fixed_clock() -> None:
    assert MaintenanceSchedule(claim_ring_turn_bytes=0).claim_ring_turn_bytes == 0


def test_maintainer_refuses_an_async_engine_or_a_connection(small: QueueStorage, engine: Engine) -> None:
    with engine.connect() as conn, pytest.raises(ValidationError) as err:
        Maintainer(small, conn)  # type: ignore[arg-type]
    assert err.value.field == "engine"


# -- leadership ------------------------------------------------------------------------------------
def test_only_one_maintainer_leads_an_install(maintainers: Callable[..., Maintainer]) -> None:
    a, b = maintainers(), maintainers()
    assert a.acquire_leadership()
    assert not b.acquire_leadership()
    assert a.is_leader() and not b.is_leader()
    assert b.run_pending() == []  # a follower runs nothing


def test_a_leaders_first_pass_runs_each_task_once_then_waits_for_its_cadence(
        maintainers: Callable[..., Maintainer]) -> None:
    slow = {f"{task}_every": 60.0 for task in ("queue_ring", "lease_ring", "claim_ring", "promote", "wheel",
                                                 "rescue", "rollup", "keys", "leader_retry")}
    m = maintainers(schedule=MaintenanceSchedule(**slow))  # type: ignore[arg-type]
    assert m.acquire_leadership()
    first = m.run_pending()
    assert sorted(r.task for r in first) == sorted(m.task_names)
    assert m.run_pending() == []  # nothing is due again right after the first pass
    assert m.seconds_until_due() > 30


def test_leadership_passes_on_release(maintainers: Callable[..., Maintainer]) -> None:
    a, b = maintainers(), maintainers()
    assert a.acquire_leadership()
    a.release_leadership()
    assert not a.is_leader()
    assert b.acquire_leadership()


def test_installs_elect_their_leaders_independently(
        maintainers: Callable[..., Maintainer], make_storage: Callable[..., QueueStorage]) -> None:
    a = maintainers()
    other = maintainers(make_storage(**SMALL))
    assert a.acquire_leadership() and other.acquire_leadership()


def test_leadership_passes_when_the_leaders_session_dies(
        maintainers: Callable[..., Maintainer], engine: Engine) -> None:
    a, b = maintainers(), maintainers()
    assert a.acquire_leadership()
    assert a._lock_conn is not None
    pid = a._lock_conn.execute(text("SELECT pg_backend_pid()")).scalar_one()
    with engine.connect() as c:
        assert c.execute(text("SELECT pg_terminate_backend(:p)"), {"p": pid}).scalar_one()
    assert wait_until(lambda: b.acquire_leadership())
    time.sleep(FAST.leader_retry_every)  # past the liveness-check interval
    assert not a.is_leader()


def test_leadership_holds_no_transaction_open(maintainers: Callable[..., Maintainer], engine: Engine) -> None:
    """An idle-in-transaction leader would pin the MVCC horizon the rings exist to ignore."""
    a = maintainers()
    assert a.acquire_leadership()
    assert a._lock_conn is not None
    pid = a._lock_conn.execute(text("SELECT pg_backend_pid()")).scalar_one()
    with engine.connect() as c:
        state, xid, xmin = c.execute(text(
            "SELECT state, backend_xid, backend_xmin FROM pg_stat_activity WHERE pid = :p"), {"p": pid}).one()
    assert (state, xid, xmin) == ("idle", None, None)


# -- tasks ---------------------------------------------------------------------------------------
def test_promote_task_makes_due_scheduled_jobs_claimable(
        small: QueueStorage, engine: Engine, maintainers: Callable[..., Maintainer]) -> None:
    m = maintainers()
    run(m, "promote")  # warm: the first run plans every task's statements
    enqueue(small, engine, 3, run_at=datetime.now(timezone.utc) + timedelta(seconds=0.5))
    assert small.claim_runtime_batch(engine, Q, 10) == []
    assert run(m, "promote") == {"scheduled": 0, "retryable": 0}  # not due yet
    time.sleep(0.55)
    assert run(m, "promote") == {"scheduled": 3, "retryable": 0}
    assert len(small.claim_runtime_batch(engine, Q, 10)) == 3


def test_promote_task_moves_more_than_one_batch(
        small: QueueStorage, engine: Engine, maintainers: Callable[..., Maintainer]) -> None:
    enqueue(small, engine, 7, run_at=datetime.now(timezone.utc) + timedelta(seconds=0.2))
    time.sleep(0.25)
    m = maintainers(schedule=MaintenanceSchedule(promote_batch_size=2, promote_max_batches=3))
    assert run(m, "promote")["scheduled"] == 6  # 3 batches of 2
    assert len(deferred_ids(small, engine)) == 1


def test_promote_task_goes_on_while_batches_of_both_states_come_back_full(
        small: QueueStorage, engine: Engine, maintainers: Callable[..., Maintainer]) -> None:
    """A batch holds the waits due first across both states, so a full batch may hold
    fewer than a batch of each: the task goes on until a batch comes back short."""
    enqueue(small, engine, 3, run_at=datetime.now(timezone.utc) - timedelta(seconds=10))
    enqueue(small, engine, 2)
    for c in small.claim_runtime_batch(engine, Q, 2):
        assert small.retry_after(engine, c.job.id, c.job.run_lease, 0) is not None
    m = maintainers(schedule=MaintenanceSchedule(promote_batch_size=2, promote_max_batches=5))
    batches: list[dict[str, int]] = []
    promote_all_due = small.promote_all_due

    def spy(*args: Any) -> dict[JobState, int]:
        out = promote_all_due(*args)
        batches.append({st.value: n for st, n in out.items()})
        return out

    small.promote_all_due = spy  # type: ignore[method-assign]
    try:
        assert run(m, "promote") == {"scheduled": 3, "retryable": 2}
    finally:
        del small.promote_all_due
    assert batches == [{"scheduled": 2, "retryable": 0}, {"scheduled": 1, "retryable": 1},
                       {"scheduled": 0, "retryable": 1}]
    assert deferred_ids(small, engine) == []


LIVE_ONLY = 0b0000_0111  # the key is held while scheduled, available or running


def keyed(st: QueueStorage, conn: Any, *, states: int, in_s: float | None = None,
          at: datetime | None = None) -> int:
    """One job of the shared key (kind ``m``, not by args), due ``in_s`` from now or at
    ``at`` if given."""
    if in_s is not None:
        at = datetime.now(timezone.utc) + timedelta(seconds=in_s)
    return st.enqueue(conn, InsertParams("m", {}, InsertOpts(
        queue=Q, run_at=at, unique=UniqueOpts(by_args=False, states=states))))


def test_promote_task_decides_a_key_before_a_worker_can_end_the_later_due_holder(
        small: QueueStorage, engine: Engine, db_url: str, maintainers: Callable[..., Maintainer]) -> None:
    """A late promotion of a retry due first and of the job that took its key, due later:
    a worker that claims and completes whatever is available between any two statements
    of the promotion still finds the retry failed, naming the key's holder."""
    a = keyed(small, engine, states=LIVE_ONLY)
    [claimed] = small.claim_runtime_batch(engine, Q, 1)
    with engine.begin() as conn:  # the retry releases the key; its partner takes it
        assert small.retry_after(conn, a, claimed.job.run_lease, 0.05) is not None
        b = keyed(small, conn, states=LIVE_ONLY, in_s=0.1)
    time.sleep(0.2)  # both due: the promotion is late
    worker = create_engine(db_url, pool_size=1)
    ended: list[int] = []

    def instant_worker(*_: Any) -> None:
        if not ended or ended[-1] != -1:
            ended.append(-1)  # no re-entry from the worker's own statements
            for c in small.claim_runtime_batch(worker, Q, 10):
                small.complete_runtime_batch(worker, [c])
                ended.append(c.job.id)
            ended.remove(-1)

    event.listen(engine, "after_cursor_execute", instant_worker)
    try:
        run(maintainers(), "promote")
    finally:
        event.remove(engine, "after_cursor_execute", instant_worker)
    try:
        instant_worker()  # whatever the promotion left available (whichever task ran last)
    finally:
        worker.dispose()
    row = small.load_job(engine, a)
    assert row is not None and row.state == JobState.FAILED
    assert row.errors is not None and row.errors[-1]["unique_owner"] == b
    assert ended == [b]


@pytest.mark.parametrize("first", ["retry", "schedule"])
def test_promote_task_gives_a_free_key_to_the_job_due_first_whatever_its_state(
        small: QueueStorage, engine: Engine, maintainers: Callable[..., Maintainer], first: str) -> None:
    """Two due jobs, one retryable and one scheduled, both wanting a key neither holds while
    waiting: the one due first takes it and the other fails naming it."""
    available_only = 0b0000_0110  # held while available or running
    a = keyed(small, engine, states=available_only)
    [claimed] = small.claim_runtime_batch(engine, Q, 1)
    retried = small.retry_after(engine, a, claimed.job.run_lease, 0.1)
    assert retried is not None and retried.run_at is not None
    # the schedule is due 50 ms after the retry or 50 ms before it, however long this took
    b = keyed(small, engine, states=available_only,
              at=retried.run_at + timedelta(seconds=0.05 if first == "retry" else -0.05))
    time.sleep(max(0.0, (retried.run_at - datetime.now(timezone.utc)).total_seconds()) + 0.1)
    assert run(maintainers(), "promote") == {"scheduled": int(first == "schedule"), "retryable": int(first == "retry")}
    winner, loser = (a, b) if first == "retry" else (b, a)
    won, lost = small.load_job(engine, winner), small.load_job(engine, loser)
    assert won is not None and won.state == JobState.AVAILABLE
    assert lost is not None and lost.state == JobState.FAILED
    assert lost.errors is not None and lost.errors[-1]["unique_owner"] == winner


def test_rescue_task_reopens_attempts_past_their_deadline(
        small: QueueStorage, engine: Engine, maintainers: Callable[..., Maintainer]) -> None:
    enqueue(small, engine, 2)
    claimed = small.claim_runtime_batch(engine, Q, 2, 0.001)
    time.sleep(0.02)
    assert run(maintainers(), "rescue") == {"heartbeat": 0, "deadline": 2, "callback": 0}
    assert {job_state(small, engine, c.job.id) for c in claimed} == {JobState.RETRYABLE}
    assert small.complete_runtime_batch(engine, claimed) == []  # the rescued attempts are closed


def test_ring_tasks_rotate_and_prune_spent_history(
        small: QueueStorage, engine: Engine, maintainers: Callable[..., Maintainer]) -> None:
    m = maintainers(schedule=MaintenanceSchedule(prune_backoff_limit=0))
    pruned = 0
    for _ in range(6):
        enqueue(small, engine, 2)
        claimed = small.claim_runtime_batch(engine, Q, 2)
        assert len(small.complete_runtime_batch(engine, claimed)) == 2
        tick = run(m, "queue_ring")
        assert isinstance(tick, RingTick) and tick.prune is not None
        pruned += tick.prune.kind == "pruned"
    assert pruned >= 3
    counts = small.queue_counts(engine, Q)
    assert (counts.available, counts.running, counts.terminal) == (0, 0, 12)


def test_a_queue_ring_tick_prunes_slots_sealed_before_it_not_the_one_it_seals(
        small: QueueStorage, engine: Engine, maintainers: Callable[..., Maintainer]) -> None:
    m = maintainers(schedule=MaintenanceSchedule(prune_backoff_limit=0))
    enqueue(small, engine, 2)
    claimed = small.claim_runtime_batch(engine, Q, 2)
    assert len(small.complete_runtime_batch(engine, claimed)) == 2
    first = run(m, "queue_ring")
    assert first.rotated and first.prune is not None and first.prune.kind == "noop", first
    assert small.load_job(engine, claimed[0].job.id) is not None  # finished, still readable
    second = run(m, "queue_ring")
    assert second.prune is not None and second.prune.kind == "pruned" and second.prune.slot == 0, second
    assert small.load_job(engine, claimed[0].job.id) is None


def test_prune_backs_off_after_prunes_that_prune_nothing(maintainers: Callable[..., Maintainer]) -> None:
    m = maintainers(schedule=MaintenanceSchedule(prune_backoff_limit=2))
    ticks = [run(m, "lease_ring") for _ in range(10)]
    pruned_at = [i for i, t in enumerate(ticks) if t.prune is not None]
    # an idle ring: noop, skip 1, noop, skip 3, noop, skip 3, ...
    assert pruned_at == [0, 2, 6]
    assert all(t.prune.kind == "noop" for t in ticks if t.prune is not None)


def test_rollup_task_reports_its_outcome(
        small: QueueStorage, engine: Engine, maintainers: Callable[..., Maintainer]) -> None:
    assert run(maintainers(), "rollup").rolled_slots == 0  # nothing sealed yet


def test_failing_task_is_reported_and_the_others_still_run(
        small: QueueStorage, engine: Engine, maintainers: Callable[..., Maintainer]) -> None:
    with engine.begin() as c:  # break the promote task: it reads the deferred backlog
        c.execute(text(f'ALTER TABLE "{small.schema()}".deferred_jobs RENAME TO deferred_jobs_gone'))
    m = maintainers()
    for _ in range(2):  # and it keeps failing without stopping the rest
        reports = {r.task: r for r in m.run_all()}
        assert reports["promote"].error is not None and "deferred_jobs" in reports["promote"].error
        assert all(r.error is None for t, r in reports.items() if t not in ("promote", "rescue", "wheel"))
        assert isinstance(reports["queue_ring"].result, RingTick)


def test_a_task_failing_again_and_again_is_one_warning_and_one_line_when_it_works_again(
        small: QueueStorage, engine: Engine, maintainers: Callable[..., Maintainer],
        caplog: pytest.LogCaptureFixture) -> None:
    table = f'"{small.schema()}".deferred_jobs'
    with engine.begin() as c:  # break the promote task
        c.execute(text(f"ALTER TABLE {table} RENAME TO deferred_jobs_gone"))
    m = maintainers()
    caplog.set_level(logging.INFO, logger="qstore.maintainer")
    for _ in range(3):
        assert {r.task: r for r in m.run_all()}["promote"].error is not None
    with engine.begin() as c:
        c.execute(text(f'ALTER TABLE "{small.schema()}".deferred_jobs_gone RENAME TO deferred_jobs'))
    assert all(r.error is None for r in m.run_all())
    records = [r for r in caplog.records if r.name == "qstore.maintainer"]
    shown = "\n".join(f"{r.levelname} {r.getMessage()}" for r in records)
    assert [r.levelname for r in records] == ["WARNING", "INFO"], shown  # rescue fails with promote
    assert not any(r.exc_info for r in records), shown  # a database error: no traceback
    warning, back = (r.getMessage() for r in records)
    assert "task promote" in warning and "SQLSTATE 42P01" in warning and "\n" not in warning, warning
    assert "back after" in back and "failed attempts" in back, back


def test_a_stopping_maintainer_prunes_no_further_slot(small: QueueStorage, engine: Engine) -> None:
    m = Maintainer(small, engine, MaintenanceSchedule(prune_backoff_limit=0))
    for _ in range(small.queue_slot_count() - 1):  # sealed slots of finished jobs
        enqueue(small, engine)
        small.complete_runtime_batch(engine, small.claim_runtime_batch(engine, Q, 10))
        small.rotate(engine)
    pruned: list[str] = []

    @event.listens_for(engine, "before_cursor_execute")
    def spot(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if statement.startswith("TRUNCATE") and ".ready_entries_" in statement:  # a queue slot's prune
            pruned.append(statement)
            m._stop.set()  # as stop() does, in the middle of the tick

    try:
        tick = run(m, "queue_ring")
    finally:
        event.remove(engine, "before_cursor_execute", spot)
    assert tick.slots_pruned == 1 and len(pruned) == 1, tick


def test_reports_are_kept_per_task_and_bounded(small: QueueStorage, engine: Engine) -> None:
    m = Maintainer(small, engine, keep_reports=3)
    for _ in range(5):
        m.run_all()
    assert len(m.reports("promote")) == 3
    assert len(m.reports()) == 3 * len(m.task_names)
    with pytest.raises(ValidationError):
        m.reports("nope")


def test_each_report_says_when_its_run_began_on_the_monotonic_clock(small: QueueStorage, engine: Engine) -> None:
    m = Maintainer(small, engine)
    before = time.monotonic()
    first = m.run_all()
    second = m.run_all()
    after = time.monotonic()
    for r in first + second:
        assert before <= r.started <= r.started + r.duration <= after
    # runs of one pass follow each other, and the second pass begins after the first ended
    starts = [r.started for r in first]
    assert starts == sorted(starts)
    assert min(r.started for r in second) >= max(r.started + r.duration for r in first)


# -- background thread ---------------------------------------------------------------------------
def test_background_maintainer_promotes_and_rescues_on_its_own(
        small: QueueStorage, engine: Engine, maintainers: Callable[..., Maintainer]) -> None:
    enqueue(small, engine, 2, run_at=datetime.now(timezone.utc) + timedelta(seconds=0.2))
    m = maintainers()
    m.start()
    assert wait_until(lambda: deferred_ids(small, engine) == [])
    claimed = small.claim_runtime_batch(engine, Q, 2, 0.001)
    assert len(claimed) == 2
    assert wait_until(lambda: {job_state(small, engine, c.job.id) for c in claimed} == {JobState.RETRYABLE})
    assert m.is_leader()
    m.stop()
    assert not m.running and not m.is_leader()


LEADER_HOLDERS = """
SELECT pid FROM pg_locks
WHERE locktype = 'advisory' AND granted AND objsubid = 1
  AND database = (SELECT oid FROM pg_database WHERE datname = current_database())
  AND ((classid::bigint << 32) | objid::bigint) = hashtextextended(:prefix || :schema, 0)
"""


def lock_holders(engine: Engine, st: QueueStorage) -> list[int]:
    """Backends of this test's database holding ``st``'s maintainer leader lock."""
    with engine.connect() as c:
        return list(c.execute(text(LEADER_HOLDERS), {
            "prefix": LEADER_KEY_PREFIX, "schema": st.schema()}).scalars())


def test_background_maintainer_leads_again_after_its_session_is_killed(
        small: QueueStorage, engine: Engine, maintainers: Callable[..., Maintainer]) -> None:
    m = maintainers()
    m.start()
    assert wait_until(lambda: len(lock_holders(engine, small)) == 1)
    (first,) = lock_holders(engine, small)
    with engine.connect() as c:
        assert c.execute(text("SELECT pg_terminate_backend(:p)"), {"p": first}).scalar_one()
    assert wait_until(lambda: len(holders := lock_holders(engine, small)) == 1 and holders[0] != first)
    assert m.is_leader()
    enqueue(small, engine, 1, run_at=datetime.now(timezone.utc) + timedelta(seconds=0.1))
    assert wait_until(lambda: deferred_ids(small, engine) == [])  # and it still does its work


def test_follower_thread_takes_over_when_the_leader_stops(
        small: QueueStorage, engine: Engine, maintainers: Callable[..., Maintainer]) -> None:
    a, b = maintainers(), maintainers()
    a.start()
    assert wait_until(a.is_leader)
    b.start()
    time.sleep(0.2)
    assert not b.is_leader()
    assert b.reports() == []  # the follower ran nothing
    a.stop()
    assert wait_until(b.is_leader)
    enqueue(small, engine, 1, run_at=datetime.now(timezone.utc) + timedelta(seconds=0.1))
    assert wait_until(lambda: deferred_ids(small, engine) == [])


def test_context_manager_starts_and_stops(small: QueueStorage, engine: Engine) -> None:
    with Maintainer(small, engine, FAST) as m:
        assert m.running
        assert wait_until(m.is_leader)
    assert not m.running and not m.is_leader()


def test_cli_maintain_once_runs_every_task(small: QueueStorage, engine: Engine, db_url: str,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    enqueue(small, engine, 1, run_at=datetime.now(timezone.utc) + timedelta(seconds=0.1))
    time.sleep(0.15)
    code = cli_main(["maintain", "--once", "--url", db_url, "--schema", small.schema()])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "promote" in out and "'scheduled': 1" in out
    assert deferred_ids(small, engine) == []


def test_cli_maintain_runs_until_terminated_and_releases_leadership(
        small: QueueStorage, engine: Engine, db_url: str, maintainers: Callable[..., Maintainer]) -> None:
    proc = subprocess.Popen([sys.executable, "-m", "qstore", "maintain", "--url", db_url,
                             "--schema", small.schema()], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        follower = maintainers()
        assert wait_until(lambda: len(lock_holders(engine, small)) == 1)
        assert not follower.acquire_leadership()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        assert follower.acquire_leadership()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_ring_tick_prunes_every_spent_slot_a_skipped_prune_left_behind(
        small: QueueStorage, engine: Engine, maintainers: Callable[..., Maintainer]) -> None:
    # Three sealed slots of finished jobs, then one tick: it rotates once and prunes all three
    # (one prune a tick would keep two of them for good).
    m = maintainers(schedule=MaintenanceSchedule(prune_backoff_limit=0))
    for _ in range(3):
        enqueue(small, engine, 2)
        assert small.rotate(engine).kind == "rotated"
    claimed = small.claim_runtime_batch(engine, Q, 10)
    assert len(small.complete_runtime_batch(engine, claimed)) == 6
    tick = run(m, "queue_ring")
    assert isinstance(tick, RingTick) and tick.prune is not None
    assert tick.slots_pruned == 3, tick
    assert small.prune_oldest(engine).kind == "noop"
    counts = small.queue_counts(engine, Q)
    assert (counts.available, counts.running, counts.terminal) == (0, 0, 6)


@pytest.mark.parametrize("ring", ["claim_ring", "lease_ring"])
def test_a_derived_ring_tick_that_prunes_takes_the_ring_lock_once_per_rotate_and_prune(
        make_storage: Callable[..., QueueStorage], engine: Engine,
        maintainers: Callable[..., Maintainer], ring: str) -> None:
    # The lease and claim rings prune only the oldest slot of the generation: a second
    # prune in the same tick could only find it truncated, so the tick does not try one.
    st = make_storage(lease_claim_receipts=ring == "claim_ring", **SMALL)
    m = maintainers(storage=st, schedule=MaintenanceSchedule(prune_backoff_limit=0))
    enqueue(st, engine, 2)
    claimed = st.claim_runtime_batch(engine, Q, 2)
    assert len(st.complete_runtime_batch(engine, claimed)) == 2
    turn = st.rotate_claims if ring == "claim_ring" else st.rotate_leases
    assert turn(engine).kind == "rotated"  # the spent slot is sealed: the tick prunes it, then rotates into it
    ring_locks: list[str] = []

    def note(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if "pg_advisory_xact_lock" in statement:
            ring_locks.append(statement)

    event.listen(engine, "before_cursor_execute", note)
    try:
        tick = m._run(next(t for t in m._tasks if t.name == ring)).result
    finally:
        event.remove(engine, "before_cursor_execute", note)
    assert isinstance(tick, RingTick) and tick.rotate is not None  # (idle: nothing written since)
    assert tick.prune is not None and tick.prune.kind == "pruned", tick
    assert len(ring_locks) == 2, ring_locks


# -- the claim ring turns by volume ----------------------------------------------------------------
def tick(m: Maintainer, task: str) -> RingTick:
    """One scheduled run of ``task`` (not a full pass): what ``run_pending`` does when it is due."""
    report = m._run(next(t for t in m._tasks if t.name == task))
    assert report.error is None and isinstance(report.result, RingTick), report
    return report.result


def claim_generation(st: QueueStorage, engine: Engine) -> int:
    with engine.connect() as c:
        return int(c.execute(text(f'SELECT generation FROM "{st.schema()}".claim_ring_state')).scalar_one())


def claim_and_complete(st: QueueStorage, engine: Engine, n: int) -> None:
    enqueue(st, engine, n)
    claimed = st.claim_runtime_batch(engine, Q, n)
    assert len(st.complete_runtime_batch(engine, claimed)) == n


def by_volume(turn_bytes: int, turn_after: float = 3600.0) -> MaintenanceSchedule:
    return MaintenanceSchedule(claim_ring_turn_bytes=turn_bytes, claim_ring_turn_after=turn_after,
                               prune_backoff_limit=0)


def test_claim_slot_bytes_grows_with_claims_and_starts_again_from_zero_after_a_turn(
        small: QueueStorage, engine: Engine) -> None:
    assert small.claim_slot_bytes(engine) == 0
    claim_and_complete(small, engine, 20)
    written = small.claim_slot_bytes(engine)
    assert written > 0
    claim_and_complete(small, engine, 200)
    assert small.claim_slot_bytes(engine) > written
    assert small.rotate_claims(engine).kind == "rotated"
    assert small.claim_slot_bytes(engine) == 0  # the incoming slot was empty


def test_claim_slot_bytes_stays_zero_when_claims_take_leases(make_storage: Callable[..., QueueStorage],
                                                              engine: Engine) -> None:
    st = make_storage(lease_claim_receipts=False, **SMALL)
    claim_and_complete(st, engine, 20)
    assert st.claim_slot_bytes(engine) == 0


def test_the_claim_ring_does_not_turn_while_its_slot_is_below_the_threshold(
        small: QueueStorage, engine: Engine, maintainers: Callable[..., Maintainer]) -> None:
    m = maintainers(schedule=by_volume(1 << 30))
    assert tick(m, "claim_ring").rotate is not None  # a new maintainer looks at once
    claim_and_complete(small, engine, 20)
    generation = claim_generation(small, engine)
    ticks = [tick(m, "claim_ring") for _ in range(3)]
    assert all(t.rotate is None and t.prune is None for t in ticks), ticks
    assert all(t.slot_bytes == small.claim_slot_bytes(engine) > 0 for t in ticks)
    assert claim_generation(small, engine) == generation


def test_the_claim_ring_turns_once_its_slot_holds_the_threshold(
        small: QueueStorage, engine: Engine, maintainers: Callable[..., Maintainer]) -> None:
    m = maintainers(schedule=by_volume(64 * 1024))
    tick(m, "claim_ring")
    claim_and_complete(small, engine, 5)
    assert small.claim_slot_bytes(engine) < 64 * 1024
    assert tick(m, "claim_ring").rotate is None
    while small.claim_slot_bytes(engine) < 64 * 1024:
        claim_and_complete(small, engine, 10)
    generation = claim_generation(small, engine)
    assert tick(m, "claim_ring").rotated
    assert claim_generation(small, engine) == generation + 1
    assert tick(m, "claim_ring").rotate is None  # the new slot starts empty


def test_the_claim_ring_turns_after_its_age_limit_with_little_written(
        small: QueueStorage, engine: Engine, maintainers: Callable[..., Maintainer]) -> None:
    # an age limit a loaded host's claims and ticks stay well inside (1 s was not: a CI run
    # on a busy 2-core host took longer than that for two claims and a tick)
    m = maintainers(schedule=by_volume(1 << 30, turn_after=2.5))
    tick(m, "claim_ring")
    # the age counts from the first tick's (idle) rotation, which has ended by now
    first_done = time.monotonic()
    claim_and_complete(small, engine, 2)
    assert tick(m, "claim_ring").rotate is None
    time.sleep(max(0.0, first_done + 2.55 - time.monotonic()))
    assert tick(m, "claim_ring").rotated


def test_an_idle_claim_ring_is_looked_at_once_per_age_limit(
        small: QueueStorage, engine: Engine, maintainers: Callable[..., Maintainer]) -> None:
    m = maintainers(schedule=by_volume(1 << 30, turn_after=0.3))
    first = tick(m, "claim_ring")
    assert first.rotate is not None and first.rotate.kind == "skipped_idle"
    assert tick(m, "claim_ring").rotate is None  # idle: the next look is an age limit away
    time.sleep(0.35)
    assert tick(m, "claim_ring").rotate is not None


def test_a_refused_claim_ring_turn_is_retried_on_every_tick_until_it_goes_through(
        small: QueueStorage, engine: Engine, maintainers: Callable[..., Maintainer]) -> None:
    # Two slots: after one turn the incoming slot is the one still holding an open claim.
    m = maintainers(schedule=by_volume(64 * 1024))
    enqueue(small, engine, 1)
    open_claim = small.claim_runtime_batch(engine, Q, 1)
    assert tick(m, "claim_ring").rotated  # the open claim's slot is sealed now
    while small.claim_slot_bytes(engine) < 64 * 1024:
        claim_and_complete(small, engine, 10)
    for _ in range(3):
        t = tick(m, "claim_ring")
        assert t.rotate is not None and t.rotate.kind == "skipped_busy", t
        assert t.prune is not None and t.prune.kind == "skipped_active", t
    assert len(small.complete_runtime_batch(engine, open_claim)) == 1
    t = tick(m, "claim_ring")  # the prune goes through, and the rotation into the pruned slot
    assert t.prune is not None and t.prune.kind == "pruned", t
    assert t.rotated


def test_a_full_pass_turns_the_claim_ring_whatever_its_slot_holds(
        small: QueueStorage, engine: Engine, maintainers: Callable[..., Maintainer]) -> None:
    m = maintainers(schedule=by_volume(1 << 30))
    tick(m, "claim_ring")
    claim_and_complete(small, engine, 2)
    generation = claim_generation(small, engine)
    assert run(m, "claim_ring").rotated
    assert claim_generation(small, engine) == generation + 1


def test_a_zero_byte_threshold_turns_the_claim_ring_on_every_tick(
        small: QueueStorage, engine: Engine, maintainers: Callable[..., Maintainer]) -> None:
    m = maintainers(schedule=by_volume(0))
    for _ in range(3):
        claim_and_complete(small, engine, 1)
        assert tick(m, "claim_ring").rotated
